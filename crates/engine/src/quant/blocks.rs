//! Scalar block decoders for the ggml types, written from the layouts in ggml-common.h (read, not copied).
//! One function per type; each decodes exactly one block into `out` (`out.len() == block_size`).

use super::GgmlType;
use super::nvfp4;
use half::{bf16, f16};

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Decodes one block of `ty`. The caller has checked the type has a kernel and the slice lengths.
pub(super) fn dequantize_block(ty: GgmlType, block: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
        GgmlType::F16 => out[0] = f16_at(block, 0),
        GgmlType::BF16 => {
            out[0] = bf16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32()
        }
        GgmlType::Q8_0 => q8_0(block, out),
        GgmlType::Q4_0 => q4_0(block, out),
        GgmlType::Q4_1 => q4_1(block, out),
        GgmlType::Q4_K => q4_k(block, out),
        GgmlType::Q6_K => q6_k(block, out),
        GgmlType::NVFP4 => nvfp4::dequantize_ggml_block(block, out),
        other => unreachable!("{other} has no reference kernel; GgmlType::check rejects it"),
    }
}

/// `d:f16, qs:i8[32]`; `y = d * q`.
fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = d * f32::from(q as i8);
    }
}

/// `d:f16, qs[16]`; low nibbles are elements 0..16, high nibbles 16..32; `y = d * (q - 8)`.
fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        out[j] = d * (f32::from(q & 0xF) - 8.0);
        out[j + 16] = d * (f32::from(q >> 4) - 8.0);
    }
}

/// `d:f16, m:f16, qs[16]`; `y = d * q + m`.
fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        out[j] = d * f32::from(q & 0xF) + m;
        out[j + 16] = d * f32::from(q >> 4) + m;
    }
}

/// The 6-bit scale and minimum of sub-block `j` from Q4_K's packed `scales[12]`.
#[inline]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `d:f16, dmin:f16, scales[12], qs[128]`: 4 chunks of 64; chunk c uses sub-blocks 2c (low nibbles) and 2c+1.
fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for c in 0..4 {
        let (sc0, m0) = scale_min_k4(2 * c, scales);
        let (sc1, m1) = scale_min_k4(2 * c + 1, scales);
        let (d0, min0) = (d * f32::from(sc0), dmin * f32::from(m0));
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        for l in 0..32 {
            let q = qs[32 * c + l];
            out[64 * c + l] = d0 * f32::from(q & 0xF) - min0;
            out[64 * c + 32 + l] = d1 * f32::from(q >> 4) - min1;
        }
    }
}

/// `ql[128], qh[64], scales:i8[16], d:f16`: two halves of 128, each built from 4-bit low and 2-bit high parts.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut out[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let h = qh[l];
            let q1 = i32::from((ql[l] & 0xF) | ((h & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32;
            let s = |k: usize| d * f32::from(sc[k] as i8);
            y[l] = s(is) * q1 as f32;
            y[l + 32] = s(is + 2) * q2 as f32;
            y[l + 64] = s(is + 4) * q3 as f32;
            y[l + 96] = s(is + 6) * q4 as f32;
        }
    }
}
