//! FP8 E4M3 (OCP "E4M3FN"): the element type of the FP8 KV cache and of NVFP4 block scales.
//!
//! Bits `S EEEE MMM`, exponent bias 7. Normal numbers are `2^(E-7) * (1 + M/8)`, subnormals (`E = 0`) are
//! `M * 2^-9`. There are no infinities; `0x7F`/`0xFF` are NaN, so the largest finite value is 448 (`0x7E`).
//! Encoding rounds to nearest, ties to even, and saturates to ±448 (as FP8 KV caches and ModelOpt do).

/// The largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Decodes one E4M3 byte.
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xF);
    let m = f32::from(b & 7);
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m * (1.0 / 512.0)
    } else {
        (1.0 + m / 8.0) * exp2i(e - 7)
    };
    sign * mag
}

/// `2^e` for the small exponents E4M3 needs, exactly.
#[inline]
fn exp2i(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Encodes an f32 as E4M3: round to nearest even, saturating to ±448; NaN becomes `0x7F`.
#[inline]
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range: value = q * 2^-9. q == 8 is the smallest normal, whose code is also 8.
        let q = round_half_even(a * 512.0) as u8;
        return sign | q;
    }
    let bits = a.to_bits();
    let mut exp = ((bits >> 23) & 0xFF) as i32 - 127;
    let frac = bits & 0x7F_FFFF;
    let mut keep = frac >> 20;
    let rem = frac & 0xF_FFFF;
    const HALF: u32 = 0x8_0000;
    if rem > HALF || (rem == HALF && keep & 1 == 1) {
        keep += 1;
        if keep == 8 {
            keep = 0;
            exp += 1;
        }
    }
    let e = exp + 7;
    if e > 15 || (e == 15 && keep == 7) {
        return sign | 0x7E;
    }
    sign | ((e as u8) << 3) | keep as u8
}

#[inline]
fn round_half_even(v: f32) -> f32 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - v.signum()
    } else {
        r
    }
}

/// Encodes `src / scale` into `dst` (FP8 KV cache store with a per-tensor or per-head scale).
pub fn quantize_fp8_ref(src: &[f32], scale: f32, dst: &mut [u8]) {
    let inv = 1.0 / scale;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32_to_fp8_e4m3(s * inv);
    }
}

/// Decodes `src * scale` into `dst`.
pub fn dequantize_fp8_ref(src: &[u8], scale: f32, dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = fp8_e4m3_to_f32(s) * scale;
    }
}

/// Dot product of an FP8 row (times `scale`) with `x`, accumulated in f64 (the oracle for fast kernels).
pub fn dot_fp8_ref(src: &[u8], scale: f32, x: &[f32]) -> f32 {
    let acc: f64 = src
        .iter()
        .zip(x)
        .map(|(&b, &v)| f64::from(fp8_e4m3_to_f32(b)) * f64::from(v))
        .sum();
    (acc * f64::from(scale)) as f32
}
