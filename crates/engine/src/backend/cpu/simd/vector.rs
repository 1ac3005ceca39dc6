//! The vector ops: the reductions (max, argmax, logsumexp), softmax's exponentials, `axpy`, and the
//! element-wise row ops (RMS norm, add, SiLU gate), with their x86 kernels (the aarch64 ones are in
//! [`super::neon`]).

use super::Isa;
#[cfg(target_arch = "aarch64")]
use super::neon;
#[cfg(target_arch = "x86_64")]
use super::x86_matmul::hsum256;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `out = x * w / rms(x)`. The sum of squares runs in f64 like the reference (each `x²` is exact in f64),
/// over eight independent lanes the compiler keeps in vector registers; the scaling is vectorized too. The
/// lanes reorder an f64 sum of exact terms, so the f32 scale agrees with the reference's except when the
/// true value sits within a few f64 ulps of an f32 rounding boundary.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    const LANES: usize = 8;
    let mut acc = [0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    let mut ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for &v in tail {
        ss += f64::from(v) * f64::from(v);
    }
    let scale = (1.0 / (ss / x.len() as f64 + f64::from(eps)).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// `x += y` (exact in any order; the compiler vectorizes it).
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `out = silu(gate) * up`. The exponential is the standard library's, per element: a vector
/// approximation would change the bits the goldens pin, so it is a deliberate change for another day.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// `out += a * x`.
#[inline]
pub(super) fn axpy(isa: Isa, a: f32, x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && out.len().is_multiple_of(8) {
        // SAFETY: AVX2+FMA were detected; both slices hold out.len() floats.
        unsafe { axpy_avx2(a, x, out) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar && out.len().is_multiple_of(4) && x.len() >= out.len() {
        // SAFETY: NEON is in every aarch64 CPU; both slices hold out.len() floats.
        unsafe { neon::axpy(a, x, out) };
        return;
    }
    let _ = isa;
    out.iter_mut().zip(x).for_each(|(o, v)| *o += a * v);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(a: f32, x: &[f32], out: &mut [f32]) {
    // SAFETY: the caller checked the lengths (out.len() multiple of 8, x at least as long).
    unsafe {
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i < out.len() {
            let o = out.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                o,
                _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(o)),
            );
            i += 8;
        }
    }
}

/// The largest value (`-inf` for an empty slice; NaNs are skipped by the vector path).
pub fn max(isa: Isa, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: AVX2+FMA were detected.
        return unsafe { max_avx2(x) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar {
        // SAFETY: NEON is in every aarch64 CPU.
        return unsafe { neon::max(x) };
    }
    let _ = isa;
    x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// Index of the largest value (first on ties); `None` for an empty slice. Same result as
/// [`crate::backend::cpu::ops::argmax`] for NaN-free input.
pub fn argmax(isa: Isa, x: &[f32]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && !x.is_empty() {
        let m = max(isa, x);
        // SAFETY: AVX2+FMA were detected.
        if let Some(i) = unsafe { first_eq_avx2(x, m) } {
            return Some(i);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar && !x.is_empty() {
        let m = max(isa, x);
        // SAFETY: NEON is in every aarch64 CPU.
        if let Some(i) = unsafe { neon::first_eq(x, m) } {
            return Some(i);
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = isa;
    crate::backend::cpu::ops::argmax(x)
}

/// `ln(sum(exp(x)))`, the log-softmax normaliser (`-inf` for an empty or all `-inf` slice).
pub fn logsumexp(isa: Isa, x: &[f32]) -> f32 {
    let m = max(isa, x);
    if m == f32::NEG_INFINITY {
        return m;
    }
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: AVX2+FMA were detected.
        return m + unsafe { sum_exp_sub_avx2(x, m) }.ln();
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar {
        // SAFETY: NEON is in every aarch64 CPU.
        return m + unsafe { neon::sum_exp_sub(x, m) }.ln();
    }
    crate::backend::cpu::ops::logsumexp_ref(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn max_avx2(x: &[f32]) -> f32 {
    // SAFETY: full vectors are read only below x.len(); the tail is scalar.
    unsafe {
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= x.len() {
            acc = _mm256_max_ps(acc, _mm256_loadu_ps(x.as_ptr().add(i)));
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut m = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for &v in &x[i..] {
            m = m.max(v);
        }
        m
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn first_eq_avx2(x: &[f32], v: f32) -> Option<usize> {
    // SAFETY: full vectors are read only below x.len(); the tail is scalar.
    unsafe {
        let vv = _mm256_set1_ps(v);
        let mut i = 0;
        while i + 8 <= x.len() {
            let eq = _mm256_cmp_ps(_mm256_loadu_ps(x.as_ptr().add(i)), vv, _CMP_EQ_OQ);
            let bits = _mm256_movemask_ps(eq);
            if bits != 0 {
                return Some(i + bits.trailing_zeros() as usize);
            }
            i += 8;
        }
        x[i..].iter().position(|&y| y == v).map(|k| i + k)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_sub_avx2(x: &[f32], m: f32) -> f32 {
    // SAFETY: full vectors are read only below x.len(); the tail is scalar.
    unsafe {
        let mv = _mm256_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= x.len() {
            acc = _mm256_add_ps(
                acc,
                exp256(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), mv)),
            );
            i += 8;
        }
        let mut total = hsum256(acc);
        for &v in &x[i..] {
            total += (v - m).exp();
        }
        total
    }
}

/// `x[i] = exp(x[i] - m)` in place (the polynomial exp of the reductions: values more than 87 below `m`,
/// minus infinity and NaN weigh 0 on x86 and aarch64); returns the sum.
pub fn exp_sub(isa: Isa, x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: AVX2+FMA were detected.
        return unsafe { exp_sub_avx2(x, m) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar {
        // SAFETY: NEON is in every aarch64 CPU.
        return unsafe { neon::exp_sub(x, m) };
    }
    let _ = isa;
    x.iter_mut()
        .map(|v| {
            *v = (*v - m).exp();
            *v
        })
        .sum()
}

/// `exp` of 8 lanes: range reduction by ln 2 and a degree-6 polynomial (relative error ~2e-7 for the
/// inputs softmax produces, `x <= 0`); inputs below -87 flush to 0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp256(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    // r = x - n ln2, with ln2 split in two for precision.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    ));
    let out = _mm256_mul_ps(p, pow2);
    _mm256_and_ps(out, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_GT_OQ))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sub_avx2(x: &mut [f32], m: f32) -> f32 {
    // SAFETY: full vectors are read and written only below x.len(); the tail is scalar.
    unsafe {
        let mv = _mm256_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= x.len() {
            let p = x.as_mut_ptr().add(i);
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p), mv));
            _mm256_storeu_ps(p, e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        let mut total = hsum256(acc);
        while i < x.len() {
            x[i] = (x[i] - m).exp();
            total += x[i];
            i += 1;
        }
        total
    }
}
