//! The FP8 KV cache's use of E4M3 ([`crate::quant::fp8`], the OCP "E4M3FN" format NVIDIA's FP8 KV caches
//! use: largest finite value 448).
//!
//! The cache stores `value / scale` in this format with one power-of-two `scale` per (page, layer, KV head),
//! so rescaling a page when a larger value arrives only shifts exponents (exact for every normal number).
//!
//! Decoding has a cheap SIMD form: moving the 7 magnitude bits up by 7 places gives the f16 with the same
//! mantissa and an exponent 8 lower (f16's bias is 15, E4M3's is 7), subnormals included, so
//! `e4m3 == f16_bits(((b & 0x80) << 8) | ((b & 0x7f) << 7)) * 256`. [`e4m3_via_f16`] is that identity in
//! scalar form; the tests hold it against [`e4m3_decode`] for every byte.

use crate::quant::fp8::E4M3_MAX;
pub use crate::quant::fp8::{f32_to_fp8_e4m3 as e4m3_encode, fp8_e4m3_to_f32 as e4m3_decode};
use half::f16;

/// [`e4m3_decode`] by way of f16, as the SIMD kernels do it (times 2^-8; see the module docs).
#[inline]
pub fn e4m3_via_f16(b: u8) -> f32 {
    let h = (u16::from(b & 0x80) << 8) | (u16::from(b & 0x7f) << 7);
    f16::from_bits(h).to_f32()
}

/// The smallest power-of-two scale that brings `amax` into E4M3's range (`amax / scale <= 448`); 0 for 0.
pub fn e4m3_scale(amax: f32) -> f32 {
    if amax <= 0.0 || !amax.is_finite() {
        return 0.0;
    }
    let s = 2f32.powi((amax / E4M3_MAX).log2().ceil() as i32);
    // log2 rounding may land one step low.
    if amax / s > E4M3_MAX { s * 2.0 } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_f16_route_decodes_every_finite_byte_exactly() {
        for b in 0..=255u8 {
            let v = e4m3_decode(b);
            if v.is_nan() {
                continue;
            }
            assert_eq!(e4m3_via_f16(b) * 256.0, v, "f16 identity at {b:#x}");
        }
    }

    #[test]
    fn scales_are_powers_of_two_that_fit() {
        for amax in [1e-6f32, 0.3, 1.0, 447.0, 448.0, 449.0, 1234.5, 3e7] {
            let s = e4m3_scale(amax);
            assert_eq!(s.log2().fract(), 0.0, "{amax}");
            assert!(
                amax / s <= E4M3_MAX && amax / s > E4M3_MAX / 2.0,
                "{amax}: {s}"
            );
        }
        assert_eq!(e4m3_scale(0.0), 0.0);
    }
}
