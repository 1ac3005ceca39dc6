//! NVFP4: 4-bit E2M1 weights with a two-level scale, the weight format of the Thor path.
//!
//! The value of element `i` of a tensor is `e2m1(q[i]) * e4m3(block_scale[i / 16]) * tensor_scale`:
//! one unsigned E4M3 scale per 16 consecutive elements along the input dimension and one f32 scale per tensor.
//!
//! GGUF stores it as ggml type 40 ([`GgmlType::NVFP4`](super::GgmlType::NVFP4)): blocks of 64 elements,
//! 36 bytes, `d[4]` (one UE4M3 scale per 16-element sub-block) then `qs[32]`. Within sub-block `s`, byte
//! `qs[8s + j]` holds element `16s + j` in its low nibble and element `16s + 8 + j` in its high nibble
//! ("split-half", unlike ModelOpt's adjacent pairs). ggml keeps E2M1 values doubled (`{0,1,2,3,4,6,8,12}`)
//! and halves the scale instead; the product is the same. The f32 tensor scale is stored as a separate
//! tensor (`<name>.scale`) and applied to the matmul output, so row kernels here do not include it.

use super::fp8::{E4M3_MAX, f32_to_fp8_e4m3};

/// Elements per ggml NVFP4 block.
pub const BLOCK: usize = 64;
/// Bytes per ggml NVFP4 block.
pub const BLOCK_BYTES: usize = 36;
/// Elements sharing one E4M3 scale.
pub const SUB_BLOCK: usize = 16;
/// The largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// E2M1 code (`S EE M`) to value: `{0, 0.5, 1, 1.5, 2, 3, 4, 6}` with bit 3 as the sign.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Decodes an unsigned E4M3 block scale exactly as ggml does: `0x00` and `0x7F` are zero, and the sign bit is
/// ignored by the decoder (so `0xFF` decodes as exponent 15, mantissa 7: 480, not NaN). Our quantizer never
/// writes either odd code.
#[inline]
pub fn ue4m3_to_f32(x: u8) -> f32 {
    if x == 0 || x == 0x7F {
        return 0.0;
    }
    let e = i32::from((x >> 3) & 0xF);
    let m = f32::from(x & 7);
    if e == 0 {
        m * (1.0 / 512.0)
    } else {
        (1.0 + m / 8.0) * f32::powi(2.0, e - 7)
    }
}

/// Nearest E2M1 code for `v` (ties go to the smaller magnitude), saturating at ±6.
#[inline]
pub fn f32_to_e2m1(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 8 } else { 0 };
    let a = v.abs();
    // Midpoints between consecutive magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
    const MID: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let code = MID.iter().take_while(|&&m| a > m).count() as u8;
    if code == 0 { 0 } else { sign | code }
}

/// Decodes one ggml NVFP4 block (64 elements, without the tensor scale).
pub fn dequantize_ggml_block(b: &[u8], out: &mut [f32]) {
    for s in 0..4 {
        let d = ue4m3_to_f32(b[s]);
        for j in 0..8 {
            let q = b[4 + 8 * s + j];
            out[16 * s + j] = E2M1_VALUES[usize::from(q & 0xF)] * d;
            out[16 * s + 8 + j] = E2M1_VALUES[usize::from(q >> 4)] * d;
        }
    }
}

/// The per-tensor scale ModelOpt chooses: `amax / (6 * 448)`, so every block scale fits E4M3 (1.0 if all zero).
pub fn tensor_scale(data: &[f32]) -> f32 {
    let amax = data.iter().fold(0f32, |m, &v| m.max(v.abs()));
    if amax == 0.0 {
        1.0
    } else {
        amax / (E2M1_MAX * E4M3_MAX)
    }
}

/// Quantizes `src` (a multiple of 64 elements) into ggml NVFP4 blocks in `dst`, relative to `tensor_scale`.
///
/// Each 16-element sub-block gets the E4M3 scale nearest to `amax / (6 * tensor_scale)`, and each element the
/// nearest E2M1 value of `x / (scale * tensor_scale)`. Panics if the lengths do not match (a caller bug).
pub fn quantize_ggml_ref(src: &[f32], tensor_scale: f32, dst: &mut [u8]) {
    assert!(
        src.len().is_multiple_of(BLOCK) && dst.len() == src.len() / BLOCK * BLOCK_BYTES,
        "NVFP4 row shape"
    );
    for (x, b) in src
        .chunks_exact(BLOCK)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        for s in 0..4 {
            let sub = &x[16 * s..16 * s + 16];
            let amax = sub.iter().fold(0f32, |m, &v| m.max(v.abs()));
            let code = f32_to_fp8_e4m3(amax / (E2M1_MAX * tensor_scale)) & 0x7F;
            b[s] = code;
            let scale = ue4m3_to_f32(code) * tensor_scale;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            for j in 0..8 {
                let lo = f32_to_e2m1(sub[j] * inv);
                let hi = f32_to_e2m1(sub[8 + j] * inv);
                b[4 + 8 * s + j] = lo | (hi << 4);
            }
        }
    }
}
