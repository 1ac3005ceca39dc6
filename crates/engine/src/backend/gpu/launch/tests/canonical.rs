//! The quantized products' one order of arithmetic (`cuda/blocks.cuh`: the canonical product), written
//! here once more in scalar Rust as the oracle: every product kernel (the matrix-vector kernels at any
//! batch up to 16, the tensor-core products past it, each weight layout) must give its bits, so a token's
//! output never depends on what it was batched with.

use super::*;
use crate::quant::nvfp4::{E2M1_VALUES, ue4m3_to_f32};

/// Block `b` of a GGUF row as the kernels unpack it: 32 integers, the scales block_term takes ((d, m), or
/// the halves' (d0, d1)), and whether the format scales its halves on their own.
fn unpack(ty: GgmlType, row: &[u8], b: usize) -> ([i32; 32], (f32, f32), bool) {
    let h = |i: usize| half::f16::from_bits(u16::from_le_bytes([row[i], row[i + 1]])).to_f32();
    let mut v = [0i32; 32];
    let nibbles = |v: &mut [i32; 32], qs: &[u8]| {
        for j in 0..16 {
            v[j] = i32::from(qs[j] & 0xF);
            v[16 + j] = i32::from(qs[j] >> 4);
        }
    };
    match ty {
        GgmlType::Q4_0 => {
            let base = 18 * b;
            nibbles(&mut v, &row[base + 2..]);
            let d = h(base);
            (v, (d, -8.0 * d), false)
        }
        GgmlType::Q4_1 => {
            let base = 20 * b;
            nibbles(&mut v, &row[base + 4..]);
            (v, (h(base), h(base + 2)), false)
        }
        GgmlType::Q8_0 => {
            let base = 34 * b;
            for (j, x) in v.iter_mut().enumerate() {
                *x = i32::from(row[base + 2 + j] as i8);
            }
            (v, (h(base), 0.0), false)
        }
        GgmlType::Q4_K => {
            let (base, sub) = (144 * (b / 8), b % 8);
            let sc = &row[base + 4..base + 16];
            let (s, mn) = if sub < 4 {
                (sc[sub] & 63, sc[sub + 4] & 63)
            } else {
                (
                    (sc[sub + 4] & 0xF) | ((sc[sub - 4] >> 6) << 4),
                    (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4),
                )
            };
            let qs = &row[base + 16 + 32 * (sub / 2)..][..32];
            for (j, x) in v.iter_mut().enumerate() {
                *x = i32::from((qs[j] >> (4 * (sub % 2))) & 0xF);
            }
            (
                v,
                (h(base) * f32::from(s), -(h(base + 2) * f32::from(mn))),
                false,
            )
        }
        GgmlType::Q6_K => {
            let (base, sub) = (210 * (b / 8), b % 8);
            let (n, g) = (sub / 4, sub % 4);
            for (l, x) in v.iter_mut().enumerate() {
                let lo = (row[base + 64 * n + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0xF;
                let hi = (row[base + 128 + 32 * n + l] >> (2 * g)) & 3;
                *x = i32::from(lo | (hi << 4)) - 32;
            }
            let d = h(base + 208);
            let sc = |i: usize| f32::from(row[base + 192 + 8 * n + 2 * g + i] as i8);
            (v, (d * sc(0), d * sc(1)), true)
        }
        GgmlType::NVFP4 => {
            let base = 36 * (b / 2);
            let mut s = [0.0f32; 2];
            for (half, sh) in s.iter_mut().enumerate() {
                let si = 2 * (b % 2) + half;
                *sh = 0.5 * ue4m3_to_f32(row[base + si]);
                for j in 0..16 {
                    let byte = row[base + 4 + 8 * si + j % 8];
                    let code = if j < 8 { byte & 0xF } else { byte >> 4 };
                    v[16 * half + j] = (2.0 * E2M1_VALUES[usize::from(code)]) as i32;
                }
            }
            (v, (s[0], s[1]), true)
        }
        ty => panic!("{ty} is not a block format"),
    }
}

/// The canonical product of `rows` GGUF rows of `ty` (`bytes`) and the quantized activations `qa`, times
/// `scale`, as `tokens × rows` outputs.
fn canonical(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    qa: &QActs,
    tokens: usize,
    scale: f32,
) -> Vec<f32> {
    let (rb, nb) = (ty.row_bytes(cols).unwrap(), cols / 32);
    let mut out = vec![0.0f32; tokens * rows];
    for r in 0..rows {
        let row = &bytes[r * rb..(r + 1) * rb];
        let blocks: Vec<_> = (0..nb).map(|b| unpack(ty, row, b)).collect();
        for t in 0..tokens {
            let mut acc = 0.0f32;
            for (b, (v, s, two)) in blocks.iter().enumerate() {
                let x = &qa.q[t * qa.cols + 32 * b..][..32];
                let dot =
                    |r: std::ops::Range<usize>| -> i32 { r.map(|j| v[j] * i32::from(x[j])).sum() };
                let (lo, hi) = (dot(0..16), dot(16..32));
                let (d, sx) = (qa.d[t * qa.blocks + b], qa.s[t * qa.blocks + b]);
                let term = if *two {
                    (s.1 * d).mul_add(hi as f32, (s.0 * d) * lo as f32)
                } else {
                    s.1.mul_add(sx, (s.0 * d) * (lo + hi) as f32)
                };
                acc += term;
            }
            out[t * rows + r] = acc * scale;
        }
    }
    out
}

#[test]
fn every_product_kernel_gives_the_canonical_bits_at_any_batch() {
    on_every_device(every_product_kernel_gives_the_canonical_bits_at_any_batch_on);
}

fn every_product_kernel_gives_the_canonical_bits_at_any_batch_on(d: &dyn TestDev) {
    let layouts = FORMATS
        .into_iter()
        .filter(|ty| !matches!(ty, GgmlType::F32 | GgmlType::F16))
        .map(|ty| (ty, Layout::Gguf))
        .chain([(GgmlType::Q4_1, Layout::Packed)]);
    for (ty, layout) in layouts {
        // Rows: a partial tile of 64 (and of 4); tokens: a partial tile of 32. Packed Q4_1 also with rows
        // longer than its 32 lanes take in one step.
        let widths: &[usize] = match (ty.block_size(), layout) {
            (256, _) => &[512],
            (_, Layout::Packed) => &[576, 1536],
            _ => &[576],
        };
        for &cols in widths {
            check(d, ty, layout, 70, cols, 45);
        }
    }
}

/// `tokens` tokens through a `rows × cols` matrix of `ty` in `layout`: all at once (a tensor-core
/// product), 16 at a time and one at a time (matrix-vector launches); each must give the canonical bits.
fn check(d: &dyn TestDev, ty: GgmlType, layout: Layout, rows: usize, cols: usize, tokens: usize) {
    let what = format!("{ty} ({layout:?}) {rows}x{cols}");
    let scale = if ty == GgmlType::NVFP4 { 0.375 } else { 1.0 };
    let bytes = weights(ty, rows, cols, 41 + cols as u64);
    let xs = data(tokens * cols, 42);
    let mut qa = QActs::default();
    quantize_ref(&xs, tokens, cols, &mut qa);
    let want = canonical(ty, &bytes, rows, cols, &qa, tokens, scale);
    let q: Vec<u8> = (0..tokens)
        .flat_map(|t| qa.q[t * qa.cols..][..cols].iter().map(|&v| v as u8))
        .collect();
    let ds: Vec<f32> = (0..tokens)
        .flat_map(|t| (0..cols / 32).map(move |b| t * qa.blocks + b))
        .flat_map(|i| [qa.d[i], qa.s[i]])
        .collect();
    let (qm, dsm) = (Mem::from_bytes(d, &q), Mem::from_f32(d, &ds));
    let wmem = Mem::from_bytes(d, &laid_out(&bytes, ty, layout, rows, cols));
    let w = Weights {
        ptr: wmem.ptr(),
        ty,
        rows,
        cols,
        scale,
        layout,
    };
    for per in [tokens, MATVEC_TOKENS, 1] {
        let out = Mem::zeroed(d, 4 * tokens * rows);
        for t0 in (0..tokens).step_by(per) {
            let n = per.min(tokens - t0);
            let a = Acts {
                x: DevPtr(0),
                q: qm.ptr().offset(Acts::q_bytes(t0, cols)),
                ds: dsm.ptr().offset(Acts::ds_bytes(t0, cols)),
                tokens: n,
                cols,
                prep: Prep::Quantized,
            };
            matvec(d, &w, &a, out.ptr().offset(4 * t0 * rows), rows, false).unwrap();
        }
        for (i, (g, w)) in out.f32s().iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{what}, {per} tokens a launch: token {}, row {}: got {g}, want {w}",
                i / rows,
                i % rows
            );
        }
    }
}
