//! Scalar reference kernels for the element-wise and attention ops. They define the math; the SIMD
//! versions under `simd/` (one attention row driver over the ISAs, `simd/row_kernel.rs`) are tested
//! against them.

use crate::backend::pages::KvSlice;

/// `out = x / sqrt(mean(x²) + eps) * w` (llama's RMSNorm; the sum runs in f64 like the reference).
pub fn rmsnorm_ref(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let scale = (1.0 / (ss / x.len() as f64 + f64::from(eps)).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// llama.cpp's "normal" RoPE, in place: adjacent pairs `(x[2i], x[2i+1])` of each head rotate by
/// `pos * base^(-2i/head_dim)`. Angles are computed in f64.
pub fn rope_ref(x: &mut [f32], head_dim: usize, pos: usize, base: f32) {
    let half = head_dim / 2;
    for i in 0..half {
        let theta = pos as f64 * f64::from(base).powf(-2.0 * i as f64 / head_dim as f64);
        let (s, c) = (theta.sin() as f32, theta.cos() as f32);
        for head in x.chunks_exact_mut(head_dim) {
            let (a, b) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = a * c - b * s;
            head[2 * i + 1] = a * s + b * c;
        }
    }
}

/// The `(cos, sin)` pairs of RoPE at `pos` for `i = 0..head_dim/2`, appended to `out` (the same f64 math as
/// [`rope_ref`], so a table built from this reproduces it exactly).
pub fn rope_angles(head_dim: usize, pos: usize, base: f32, out: &mut Vec<(f32, f32)>) {
    for i in 0..head_dim / 2 {
        let theta = pos as f64 * f64::from(base).powf(-2.0 * i as f64 / head_dim as f64);
        out.push((theta.cos() as f32, theta.sin() as f32));
    }
}

/// RoPE from precomputed `(cos, sin)` pairs (see [`rope_angles`]).
pub fn rope_table(x: &mut [f32], head_dim: usize, angles: &[(f32, f32)]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(angles) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
    }
}

/// NeoX RoPE of one head, in place: pairs `(i, i + half)` of the first `2 · angles.len()` dims rotate (the
/// rest, in a partial RoPE, stay).
pub fn rope_neox(head: &mut [f32], angles: &[(f32, f32)]) {
    let half = angles.len();
    for (i, &(co, si)) in angles.iter().enumerate() {
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * co - b * si;
        head[i + half] = b * co + a * si;
    }
}

/// `out = silu(gate) * up`.
pub fn silu_mul_ref(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// `x += y`.
pub fn add_ref(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Element `i` of a KV slice as f32.
#[inline]
pub fn kv_at(s: KvSlice<'_>, i: usize) -> f32 {
    match s {
        KvSlice::F32(d) => d[i],
        KvSlice::F16(d) => d[i].to_f32(),
        KvSlice::Fp8 { data, scale } => crate::backend::fp8::e4m3_decode(data[i]) * scale,
    }
}

/// One query head against positions `0..n` of one KV head: `softmax(q·K^T * scale) V`, exact two-pass softmax.
pub fn attention_ref(
    q: &[f32],
    keys: KvSlice<'_>,
    values: KvSlice<'_>,
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = q.len();
    let scores: Vec<f32> = (0..n)
        .map(|j| {
            q.iter()
                .enumerate()
                .map(|(d, &qv)| qv * kv_at(keys, j * hd + d))
                .sum::<f32>()
                * scale
        })
        .collect();
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let e: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    out.fill(0.0);
    for (j, w) in e.iter().enumerate() {
        for (d, o) in out.iter_mut().enumerate() {
            *o += w / sum * kv_at(values, j * hd + d);
        }
    }
}

/// `ln(sum(exp(x)))`, computed stably (reference for [`super::simd::logsumexp`]).
pub fn logsumexp_ref(x: &[f32]) -> f32 {
    let m = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + x.iter().map(|&v| (v - m).exp()).sum::<f32>().ln()
}

/// Index of the largest value (first on ties); `None` for an empty slice.
pub fn argmax(x: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}
