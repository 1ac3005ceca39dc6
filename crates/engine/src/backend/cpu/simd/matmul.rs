//! The quantized and float products' dispatch by [`Isa`]: activation quantization, the quantized matrix
//! product, float dot products, and the group-block layout codes the SIMD kernels take as parameters.

use super::Isa;
#[cfg(target_arch = "aarch64")]
use super::neon;
#[cfg(target_arch = "x86_64")]
use super::x86_matmul::{
    dot_f32_avx2, dot4_f32_avx2, matmul_avx2, matmul_avx512, quantize_block_avx2,
};
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use crate::backend::cpu::qmatmul::{GROUP, QK};
use crate::backend::cpu::qmatmul::{Layout, QActs, QMatrix};

/// Quantizes `n` rows of `cols` floats (see [`crate::backend::cpu::qmatmul::quantize_ref`], which this equals bit for bit).
pub fn quantize(isa: Isa, x: &[f32], n: usize, cols: usize, out: &mut QActs) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && cols.is_multiple_of(QK) {
        out.reset(n, cols);
        for t in 0..n {
            for b in 0..cols / QK {
                let i = t * out.blocks + b;
                let src = &x[t * cols + b * QK..][..QK];
                let dst = &mut out.q[t * out.cols + b * QK..][..QK];
                // SAFETY: `isa` was detected on this CPU, so AVX2 is available; both slices hold 32 elements.
                let (d, sum) = unsafe { quantize_block_avx2(src, dst) };
                out.d[i] = d;
                out.sum[i] = sum;
                out.s[i] = d * sum as f32;
            }
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if isa.is_neon() && cols.is_multiple_of(QK) {
        out.reset(n, cols);
        for t in 0..n {
            for b in 0..cols / QK {
                let i = t * out.blocks + b;
                let src = &x[t * cols + b * QK..][..QK];
                let dst = &mut out.q[t * out.cols + b * QK..][..QK];
                // SAFETY: NEON is in every aarch64 CPU; both slices hold 32 elements.
                let (d, sum) = unsafe { neon::quantize_block(src, dst) };
                out.d[i] = d;
                out.sum[i] = sum;
                out.s[i] = d * sum as f32;
            }
        }
        return;
    }
    let _ = isa;
    crate::backend::cpu::qmatmul::quantize_ref(x, n, cols, out);
}

/// Computes `out[t * w.rows + r]` for rows `rows` and every token of `x` (see `qmatmul::matmul_ref`).
pub fn matmul(
    isa: Isa,
    w: &QMatrix,
    x: &QActs,
    xf: &[f32],
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    if w.layout != Layout::F32 && isa != Isa::Scalar {
        let per_token = x.n * x.blocks;
        assert!(
            x.blocks >= w.blocks
                && x.cols >= w.blocks * QK
                && x.q.len() >= x.n * x.cols
                && x.d.len() >= per_token
                && x.s.len() >= per_token
                && x.sum.len() >= per_token
                && rows.start.is_multiple_of(GROUP)
                && rows.start <= rows.end
                && rows.end <= w.rows
                && out.len() >= x.n * w.rows
                && w.data.len() >= w.rows.div_ceil(GROUP) * w.blocks * w.block_bytes,
            "matmul shape"
        );
        // SAFETY: `isa` was detected on this CPU; the shapes the kernels rely on are asserted above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            if isa == Isa::Avx512Vnni {
                matmul_avx512(w, x, rows, out.as_mut_ptr());
            } else {
                matmul_avx2(w, x, rows, out.as_mut_ptr());
            }
        }
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        unsafe {
            neon::matmul(isa, w, x, rows, out.as_mut_ptr());
        }
        return;
    }
    if w.layout == Layout::F32 && isa != Isa::Scalar {
        // Four tokens share each weight row's loads; every dot keeps `dot_f32`'s exact arithmetic, so a
        // token's result does not depend on the tokens it is batched with.
        let c = w.cols;
        let mut t = 0;
        while t + 4 <= x.n {
            let xs = [
                &xf[t * c..(t + 1) * c],
                &xf[(t + 1) * c..(t + 2) * c],
                &xf[(t + 2) * c..(t + 3) * c],
                &xf[(t + 3) * c..(t + 4) * c],
            ];
            for r in rows.clone() {
                let d = dot4_f32(isa, &w.f[r * c..(r + 1) * c], xs);
                for (k, v) in d.into_iter().enumerate() {
                    out[(t + k) * w.rows + r] = v;
                }
            }
            t += 4;
        }
        for t in t..x.n {
            let xr = &xf[t * c..(t + 1) * c];
            for r in rows.clone() {
                out[t * w.rows + r] = dot_f32(isa, &w.f[r * c..(r + 1) * c], xr);
            }
        }
        return;
    }
    crate::backend::cpu::qmatmul::matmul_ref(w, x, xf, rows, out);
}

/// `Σ a[i] * b[i]` in f32.
#[inline]
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: AVX2+FMA were detected; the kernel reads min(len) elements of each slice.
        return unsafe { dot_f32_avx2(a, b) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar {
        // SAFETY: NEON is in every aarch64 CPU; the kernel reads min(len) elements of each slice.
        return unsafe { neon::dot_f32(a, b) };
    }
    let _ = isa;
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `[Σ a·b[0], …, Σ a·b[3]]`, each bit for bit what [`dot_f32`] gives.
#[inline]
pub fn dot4_f32(isa: Isa, a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && b.iter().all(|x| x.len() == a.len()) {
        // SAFETY: AVX2+FMA were detected; every slice has a.len() elements.
        return unsafe { dot4_f32_avx2(a, b) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa != Isa::Scalar && b.iter().all(|x| x.len() == a.len()) {
        // SAFETY: NEON is in every aarch64 CPU; every slice has a.len() elements.
        return unsafe { neon::dot4_f32(a, b) };
    }
    b.map(|x| dot_f32(isa, a, x))
}

/// The group-block layouts as kernel parameters: nibbles with f16 scales, nibbles with f32, bytes.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) const NIB16: u8 = 0;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) const NIB32: u8 = 1;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) const BYTE: u8 = 2;

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) fn layout_kind(w: &QMatrix) -> u8 {
    match (w.layout, w.f32_scales) {
        (Layout::Byte, _) => BYTE,
        (_, true) => NIB32,
        (_, false) => NIB16,
    }
}
