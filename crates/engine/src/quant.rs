//! Number formats for weights and the KV cache.
//!
//! Every format here has a *scalar reference* implementation: a plain-Rust dequantizer and a dot product
//! against an f32 vector. They are deliberately simple and allocation-free; they are the oracle that
//! every SIMD and CUDA kernel is tested against, and the fallback where no fast kernel exists.
//!
//! * ggml block types as GGUF stores them ([`GgmlType`]): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K,
//!   and NVFP4 (ggml type 40). The table of block sizes covers every type ggml defines, so the GGUF reader
//!   can open any well-formed file; [`GgmlType::has_reference_kernel`] says which ones we can compute with.
//! * FP8 E4M3 ([`fp8`]), the KV-cache element type of the Thor path, and NVFP4 ([`nvfp4`]), its weight
//!   format: 16 E2M1 values share one E4M3 scale and a tensor shares one f32 scale.

mod blocks;
pub mod fp8;
pub mod nvfp4;

use thiserror::Error;

/// The largest number of elements in one block of any supported type (the K-quants' super-block).
pub const MAX_BLOCK: usize = 256;

/// What can go wrong when a row of quantized data is decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// The type has a known layout but no kernel in this build.
    #[error(
        "ggml type {0} has no reference kernel yet (supported: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q6_K NVFP4)"
    )]
    Unsupported(GgmlType),
    /// The element count is not a whole number of blocks.
    #[error("{n} elements is not a multiple of the {ty} block size {block}")]
    PartialBlock {
        /// Type of the row.
        ty: GgmlType,
        /// Elements asked for.
        n: usize,
        /// Elements per block.
        block: usize,
    },
    /// The byte slice does not hold exactly the blocks the element count needs.
    #[error("{ty} row of {n} elements needs {expected} bytes, got {got}")]
    Length {
        /// Type of the row.
        ty: GgmlType,
        /// Elements asked for.
        n: usize,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
}

macro_rules! ggml_types {
    ($( $(#[$doc:meta])* $name:ident = $id:literal, $block:literal, $bytes:literal, $kernel:literal; )*) => {
        /// A ggml tensor element type, as GGUF stores it (`ggml_type`).
        #[allow(non_camel_case_types, reason = "the names are ggml's, so they read the same in both projects")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum GgmlType {
            $( $(#[$doc])* $name = $id, )*
        }

        impl GgmlType {
            /// Every type ggml defines, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$name),*];

            /// The type with ggml id `id`, if ggml defines one.
            pub fn from_id(id: u32) -> Option<Self> {
                match id {
                    $( $id => Some(GgmlType::$name), )*
                    _ => None,
                }
            }

            /// ggml's name for the type (`Q4_1`, `F16`, ...).
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$name => stringify!($name), )* }
            }

            /// Elements per block.
            pub fn block_size(self) -> usize {
                match self { $( GgmlType::$name => $block, )* }
            }

            /// Bytes per block.
            pub fn type_size(self) -> usize {
                match self { $( GgmlType::$name => $bytes, )* }
            }

            /// Whether a scalar reference dequantizer and dot product exist for this type.
            pub fn has_reference_kernel(self) -> bool {
                match self { $( GgmlType::$name => $kernel, )* }
            }
        }
    };
}

ggml_types! {
    /// 32-bit IEEE float.
    F32 = 0, 1, 4, true;
    /// 16-bit IEEE float.
    F16 = 1, 1, 2, true;
    /// 32 4-bit values, one f16 scale, offset -8.
    Q4_0 = 2, 32, 18, true;
    /// 32 4-bit values, f16 scale and f16 minimum.
    Q4_1 = 3, 32, 20, true;
    /// 5-bit, symmetric.
    Q5_0 = 6, 32, 22, false;
    /// 5-bit, with minimum.
    Q5_1 = 7, 32, 24, false;
    /// 32 signed 8-bit values, one f16 scale.
    Q8_0 = 8, 32, 34, true;
    /// 8-bit with precomputed sums (activation type).
    Q8_1 = 9, 32, 40, false;
    /// 2-bit K-quant.
    Q2_K = 10, 256, 84, false;
    /// 3-bit K-quant.
    Q3_K = 11, 256, 110, false;
    /// 4-bit K-quant: 8 sub-blocks of 32 with 6-bit scales and minimums.
    Q4_K = 12, 256, 144, true;
    /// 5-bit K-quant.
    Q5_K = 13, 256, 176, false;
    /// 6-bit K-quant: 16 sub-blocks of 16 with 8-bit scales.
    Q6_K = 14, 256, 210, true;
    /// 8-bit K-quant (activation type).
    Q8_K = 15, 256, 292, false;
    /// i-quant.
    IQ2_XXS = 16, 256, 66, false;
    /// i-quant.
    IQ2_XS = 17, 256, 74, false;
    /// i-quant.
    IQ3_XXS = 18, 256, 98, false;
    /// i-quant.
    IQ1_S = 19, 256, 50, false;
    /// i-quant.
    IQ4_NL = 20, 32, 18, false;
    /// i-quant.
    IQ3_S = 21, 256, 110, false;
    /// i-quant.
    IQ2_S = 22, 256, 82, false;
    /// i-quant.
    IQ4_XS = 23, 256, 136, false;
    /// 8-bit integer.
    I8 = 24, 1, 1, false;
    /// 16-bit integer.
    I16 = 25, 1, 2, false;
    /// 32-bit integer.
    I32 = 26, 1, 4, false;
    /// 64-bit integer.
    I64 = 27, 1, 8, false;
    /// 64-bit float.
    F64 = 28, 1, 8, false;
    /// i-quant.
    IQ1_M = 29, 256, 56, false;
    /// bfloat16.
    BF16 = 30, 1, 2, true;
    /// ternary.
    TQ1_0 = 34, 256, 54, false;
    /// ternary.
    TQ2_0 = 35, 256, 66, false;
    /// OCP MXFP4: 32 E2M1 values, one E8M0 scale.
    MXFP4 = 39, 32, 17, false;
    /// NVFP4 as ggml stores it: 4 sub-blocks of 16 E2M1 values, one UE4M3 scale each (see [`nvfp4`]).
    NVFP4 = 40, 64, 36, true;
    /// 1-bit.
    Q1_0 = 41, 128, 18, false;
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl GgmlType {
    /// Bytes needed for `n` elements, or `None` if `n` is not a whole number of blocks (or overflows).
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    fn check(self, n: usize, got: usize) -> Result<(), QuantError> {
        if !self.has_reference_kernel() {
            return Err(QuantError::Unsupported(self));
        }
        let block = self.block_size();
        let expected = self
            .row_bytes(n)
            .ok_or(QuantError::PartialBlock { ty: self, n, block })?;
        if expected != got {
            return Err(QuantError::Length {
                ty: self,
                n,
                expected,
                got,
            });
        }
        Ok(())
    }
}

/// Decodes `dst.len()` elements of type `ty` from `src` (scalar reference).
///
/// NVFP4's per-tensor f32 scale is not part of the row; multiply by it afterwards (as ggml does).
pub fn dequantize_ref(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    ty.check(dst.len(), src.len())?;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    for (block, out) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
        blocks::dequantize_block(ty, block, out);
    }
    Ok(())
}

/// Dot product of a row of type `ty` with the f32 vector `x` (scalar reference, f64 accumulation).
///
/// This is the oracle for the fast kernels: it dequantizes each block exactly as [`dequantize_ref`] does and
/// accumulates in f64, so its own rounding error is far below any kernel's.
pub fn dot_ref(ty: GgmlType, src: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    ty.check(x.len(), src.len())?;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let mut buf = [0f32; MAX_BLOCK];
    let mut acc = 0f64;
    for (block, xs) in src.chunks_exact(ts).zip(x.chunks_exact(bs)) {
        let out = &mut buf[..bs];
        blocks::dequantize_block(ty, block, out);
        acc += out
            .iter()
            .zip(xs)
            .map(|(&w, &v)| f64::from(w) * f64::from(v))
            .sum::<f64>();
    }
    Ok(acc as f32)
}

#[cfg(test)]
mod tests;
