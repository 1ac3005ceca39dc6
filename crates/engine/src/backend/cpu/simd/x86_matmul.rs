//! The x86-64 kernels of the products: activation quantization (AVX2), the quantized matrix product
//! (AVX-512 VNNI and AVX2) and the float dot products (AVX2), behind [`super::matmul`]'s dispatch.

use super::matmul::{BYTE, NIB16, NIB32, layout_kind};
use crate::backend::cpu::qmatmul::{GROUP, QActs, QMatrix};
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    // SAFETY: the caller passes 32-element slices; all loads/stores stay inside them.
    unsafe {
        let p = x.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let sign = _mm256_set1_ps(-0.0);
        let mut mx = _mm256_andnot_ps(sign, v[0]);
        for vi in &v[1..] {
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, *vi));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_movehdup_ps(m2));
        let amax = _mm_cvtss_f32(m1);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        // cvtps rounds to nearest even under the default MXCSR, like round_ties_even in the reference.
        let i: [__m256i; 4] = [0, 1, 2, 3].map(|k| _mm256_cvtps_epi32(_mm256_mul_ps(v[k], idv)));
        let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b10_11_00_01));
        let sum = _mm_cvtsi128_si32(s1);
        // Pack 32 i32 (all within -127..=127) to i8 in order.
        let p16a = _mm256_packs_epi32(i[0], i[1]);
        let p16b = _mm256_packs_epi32(i[2], i[3]);
        let p8 = _mm256_packs_epi16(p16a, p16b);
        let ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, ordered);
        (d, sum)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot4_f32_avx2(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    // SAFETY: loads are at offsets < n - 7 for full vectors (every slice has n elements); the tail is
    // scalar. The accumulation order is dot_f32_avx2's, per output.
    unsafe {
        // acc[k][j]: lane group k (of four per 32 elements) of output j.
        let mut acc = [[_mm256_setzero_ps(); 4]; 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                let av = _mm256_loadu_ps(a.as_ptr().add(o));
                for (aj, bj) in acc_k.iter_mut().zip(&b) {
                    *aj = _mm256_fmadd_ps(av, _mm256_loadu_ps(bj.as_ptr().add(o)), *aj);
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            let av = _mm256_loadu_ps(a.as_ptr().add(i));
            for (aj, bj) in acc[0].iter_mut().zip(&b) {
                *aj = _mm256_fmadd_ps(av, _mm256_loadu_ps(bj.as_ptr().add(i)), *aj);
            }
            i += 8;
        }
        let mut out = [0f32; 4];
        for (j, o) in out.iter_mut().enumerate() {
            let s = _mm256_add_ps(
                _mm256_add_ps(acc[0][j], acc[1][j]),
                _mm256_add_ps(acc[2][j], acc[3][j]),
            );
            let mut total = hsum256(s);
            for q in i..n {
                total += a[q] * b[j][q];
            }
            *o = total;
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    // SAFETY: loads are at offsets < n - 7 for full vectors; the tail is scalar.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, a_k) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                *a_k = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(o)),
                    _mm256_loadu_ps(b.as_ptr().add(o)),
                    *a_k,
                );
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc[0],
            );
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = hsum256(s);
        while i < n {
            total += a[i] * b[i];
            i += 1;
        }
        total
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hsum256(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

/// The quantized kernels' walk: tokens in tiles of up to `width`, and for each tile the row units
/// (groups, or half groups) `units` a few at a time, `per(tile tokens)` of them (one at a time where fewer
/// are left); calls `f(first unit, units, first token, tokens)`.
#[cfg(target_arch = "x86_64")]
fn for_tiles(
    tokens: usize,
    width: usize,
    units: std::ops::Range<usize>,
    per: impl Fn(usize) -> usize,
    mut f: impl FnMut(usize, usize, usize, usize),
) {
    let mut t = 0;
    while t < tokens {
        let nt = (tokens - t).min(width);
        let per = per(nt);
        let mut u = units.start;
        while u < units.end {
            let nu = if u + per <= units.end { per } else { 1 };
            f(u, nu, t, nt);
            u += nu;
        }
        t += nt;
    }
}

/// [`super::matmul::matmul`] on AVX-512 VNNI: tokens in tiles of up to 8, each tile over `rows`' groups a few at a time
/// (more groups for fewer tokens, so enough sums are in flight to hide `vpdpbusd`'s latency).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI was detected, and [`super::matmul::matmul`]'s asserted shapes hold (`out` is `x.n * w.rows`).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn matmul_avx512(
    w: &QMatrix,
    x: &QActs,
    rows: std::ops::Range<usize>,
    out: *mut f32,
) {
    let groups = rows.start / GROUP..rows.end.div_ceil(GROUP);
    let per = |nt: usize| match nt {
        1 | 2 => 4,
        3 | 4 => 2,
        _ => 1,
    };
    for_tiles(x.n, 8, groups, per, |g, ng, t, nt| {
        macro_rules! k {
            ($g:literal, $t:literal) => {
                match layout_kind(w) {
                    NIB16 => groups_avx512::<NIB16, $g, $t>(w, g, x, t, rows.end, out),
                    NIB32 => groups_avx512::<NIB32, $g, $t>(w, g, x, t, rows.end, out),
                    _ => groups_avx512::<BYTE, $g, $t>(w, g, x, t, rows.end, out),
                }
            };
        }
        // SAFETY: the caller's contract; groups g..g + ng are inside rows' and tokens t..t + nt exist.
        unsafe {
            match (ng, nt) {
                (4, 1) => k!(4, 1),
                (4, 2) => k!(4, 2),
                (2, 3) => k!(2, 3),
                (2, 4) => k!(2, 4),
                (1, 1) => k!(1, 1),
                (1, 2) => k!(1, 2),
                (1, 3) => k!(1, 3),
                (1, 4) => k!(1, 4),
                (1, 5) => k!(1, 5),
                (1, 6) => k!(1, 6),
                (1, 7) => k!(1, 7),
                (1, 8) => k!(1, 8),
                _ => unreachable!("group counts follow the tile width"),
            }
        }
    });
}

/// Groups `g0..g0+G` of `w` (16 rows each, one per lane) against tokens `t0..t0+T` of `x`, AVX-512 VNNI;
/// writes the rows below `end` of `out[t * w.rows + r]`.
///
/// Per group block: each weight vector is loaded (and its nibbles unpacked) once for all `T` tokens, and
/// multiplied by four activation bytes broadcast to every lane; a row's exact integer block sum then
/// enters its float sum by two fused multiply-adds (`isum * (d*dx)`, `m * sx`), as in
/// [`super::qmatmul::matmul_ref`], so every output equals the reference's bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn groups_avx512<const L: u8, const G: usize, const T: usize>(
    w: &QMatrix,
    g0: usize,
    x: &QActs,
    t0: usize,
    end: usize,
    out: *mut f32,
) {
    // SAFETY: see matmul: the groups and tokens exist, every token holds w.blocks blocks of quantized
    // values and scales, and rows below `end` of each token's output row are inside `out`.
    unsafe {
        let (nb, bb) = (w.blocks, w.block_bytes);
        let grp: [*const u8; G] = std::array::from_fn(|k| w.data.as_ptr().add((g0 + k) * nb * bb));
        let xq: [*const u8; T] =
            std::array::from_fn(|t| x.q.as_ptr().add((t0 + t) * x.cols).cast::<u8>());
        let xd: [*const f32; T] = std::array::from_fn(|t| x.d.as_ptr().add((t0 + t) * x.blocks));
        let xs: [*const f32; T] = std::array::from_fn(|t| x.s.as_ptr().add((t0 + t) * x.blocks));
        let bcast = |p: *const u8| _mm512_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>()));
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [[_mm512_setzero_ps(); T]; G];
        for b in 0..nb {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                let rec = grp[k].add(b * bb);
                // Two independent integer sums per token (added at the end: exact).
                let mut isum = [[_mm512_setzero_si512(); 2]; T];
                if L == BYTE {
                    for v in 0..8 {
                        let wv = _mm512_loadu_si512(rec.add(64 * v).cast());
                        for (t, s) in isum.iter_mut().enumerate() {
                            let xb = bcast(xq[t].add(32 * b + 4 * v));
                            s[v & 1] = _mm512_dpbusd_epi32(s[v & 1], wv, xb);
                        }
                    }
                } else {
                    for v in 0..4 {
                        let raw = _mm512_loadu_si512(rec.add(64 * v).cast());
                        let lo = _mm512_and_si512(raw, m4);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                        for (t, s) in isum.iter_mut().enumerate() {
                            let xb = xq[t].add(32 * b + 4 * v);
                            s[0] = _mm512_dpbusd_epi32(s[0], lo, bcast(xb));
                            s[1] = _mm512_dpbusd_epi32(s[1], hi, bcast(xb.add(16)));
                        }
                    }
                }
                let (d, m) = match L {
                    NIB16 => (
                        _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(256).cast())),
                        _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(288).cast())),
                    ),
                    NIB32 => (
                        _mm512_loadu_ps(rec.add(256).cast()),
                        _mm512_loadu_ps(rec.add(320).cast()),
                    ),
                    _ => {
                        let d = _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(512).cast()));
                        (d, _mm512_mul_ps(d, _mm512_set1_ps(-128.0)))
                    }
                };
                for (t, (a, s)) in acc_k.iter_mut().zip(&isum).enumerate() {
                    let i = _mm512_cvtepi32_ps(_mm512_add_epi32(s[0], s[1]));
                    let dd = _mm512_mul_ps(d, _mm512_set1_ps(*xd[t].add(b)));
                    *a = _mm512_fmadd_ps(i, dd, *a);
                    *a = _mm512_fmadd_ps(m, _mm512_set1_ps(*xs[t].add(b)), *a);
                }
            }
        }
        for (k, acc_k) in acc.iter().enumerate() {
            let r0 = (g0 + k) * GROUP;
            let n = end.saturating_sub(r0).min(GROUP);
            let mask: __mmask16 = if n == GROUP { 0xffff } else { (1u16 << n) - 1 };
            for (t, a) in acc_k.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add((t0 + t) * w.rows + r0), mask, *a);
            }
        }
    }
}

/// [`super::matmul::matmul`] on AVX2: the same arithmetic as the AVX-512 kernel over half groups (8 rows a vector),
/// tokens in tiles of up to 4.
///
/// # Safety
/// AVX2/FMA/F16C were detected, and [`super::matmul::matmul`]'s asserted shapes hold (`out` is `x.n * w.rows`).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn matmul_avx2(
    w: &QMatrix,
    x: &QActs,
    rows: std::ops::Range<usize>,
    out: *mut f32,
) {
    let halves = rows.start / 8..rows.end.div_ceil(8);
    let per = |nt: usize| if nt <= 2 { 2 } else { 1 };
    for_tiles(x.n, 4, halves, per, |h, nh, t, nt| {
        macro_rules! k {
            ($h:literal, $t:literal) => {
                match layout_kind(w) {
                    NIB16 => halves_avx2::<NIB16, $h, $t>(w, h, x, t, rows.end, out),
                    NIB32 => halves_avx2::<NIB32, $h, $t>(w, h, x, t, rows.end, out),
                    _ => halves_avx2::<BYTE, $h, $t>(w, h, x, t, rows.end, out),
                }
            };
        }
        // SAFETY: the caller's contract; halves h..h + nh are inside rows' and tokens t..t + nt exist.
        unsafe {
            match (nh, nt) {
                (2, 1) => k!(2, 1),
                (2, 2) => k!(2, 2),
                (1, 1) => k!(1, 1),
                (1, 2) => k!(1, 2),
                (1, 3) => k!(1, 3),
                (1, 4) => k!(1, 4),
                _ => unreachable!("half counts follow the tile width"),
            }
        }
    });
}

/// Half groups `h0..h0+H` (rows `8h..8h+8`) of `w` against tokens `t0..t0+T` of `x`, AVX2: `pmaddubsw`
/// and `pmaddwd` make the same exact integer block sums as `vpdpbusd` (bytes through their signed form,
/// `q = u - 128`, and back: `Σu·x = Σq·x + 128 Σx`), then the same two fused multiply-adds per block, so
/// this equals the AVX-512 kernel and the reference bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves_avx2<const L: u8, const H: usize, const T: usize>(
    w: &QMatrix,
    h0: usize,
    x: &QActs,
    t0: usize,
    end: usize,
    out: *mut f32,
) {
    // SAFETY: as for groups_avx512; a half group reads its 32-byte halves of the group block's vectors.
    unsafe {
        let (nb, bb) = (w.blocks, w.block_bytes);
        let grp: [*const u8; H] =
            std::array::from_fn(|k| w.data.as_ptr().add((h0 + k) / 2 * nb * bb));
        // The half's bytes in each 64-byte weight vector, and its scales' offset (8 f16 or 8 f32 a half).
        let lanes: [usize; H] = std::array::from_fn(|k| 32 * ((h0 + k) % 2));
        let soff: [usize; H] =
            std::array::from_fn(|k| if L == NIB32 { lanes[k] } else { lanes[k] / 2 });
        let xq: [*const u8; T] =
            std::array::from_fn(|t| x.q.as_ptr().add((t0 + t) * x.cols).cast::<u8>());
        let base: [usize; T] = std::array::from_fn(|t| (t0 + t) * x.blocks);
        let bcast = |p: *const u8| _mm256_set1_epi32(std::ptr::read_unaligned(p.cast::<i32>()));
        let m4 = _mm256_set1_epi8(0x0F);
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); T]; H];
        for b in 0..nb {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                let rec = grp[k].add(b * bb);
                let wv = |v: usize| _mm256_loadu_si256(rec.add(64 * v + lanes[k]).cast());
                let mut isum = [_mm256_setzero_si256(); T];
                if L == BYTE {
                    for v in 0..8 {
                        let q = _mm256_xor_si256(wv(v), flip);
                        let aq = _mm256_sign_epi8(q, q);
                        for (t, s) in isum.iter_mut().enumerate() {
                            let xs = _mm256_sign_epi8(bcast(xq[t].add(32 * b + 4 * v)), q);
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), ones);
                            *s = _mm256_add_epi32(*s, p);
                        }
                    }
                    for (t, s) in isum.iter_mut().enumerate() {
                        let sum = *x.sum.get_unchecked(base[t] + b);
                        *s = _mm256_add_epi32(*s, _mm256_set1_epi32(sum << 7));
                    }
                } else {
                    for v in 0..4 {
                        let raw = wv(v);
                        let lo = _mm256_and_si256(raw, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
                        for (t, s) in isum.iter_mut().enumerate() {
                            let xb = xq[t].add(32 * b + 4 * v);
                            // Four products of at most 15 * 127 per 16-bit lane: no saturation.
                            let p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, bcast(xb)),
                                _mm256_maddubs_epi16(hi, bcast(xb.add(16))),
                            );
                            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, ones));
                        }
                    }
                }
                // The scales sit after the 256 (512) bytes of integers.
                let (d, m) = match L {
                    NIB16 => (
                        _mm256_cvtph_ps(_mm_loadu_si128(rec.add(256 + soff[k]).cast())),
                        _mm256_cvtph_ps(_mm_loadu_si128(rec.add(288 + soff[k]).cast())),
                    ),
                    NIB32 => (
                        _mm256_loadu_ps(rec.add(256 + soff[k]).cast()),
                        _mm256_loadu_ps(rec.add(320 + soff[k]).cast()),
                    ),
                    _ => {
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(rec.add(512 + soff[k]).cast()));
                        (d, _mm256_mul_ps(d, _mm256_set1_ps(-128.0)))
                    }
                };
                for (t, (a, s)) in acc_k.iter_mut().zip(&isum).enumerate() {
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(*x.d.get_unchecked(base[t] + b)));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*s), dd, *a);
                    let sx = _mm256_set1_ps(*x.s.get_unchecked(base[t] + b));
                    *a = _mm256_fmadd_ps(m, sx, *a);
                }
            }
        }
        for (k, acc_k) in acc.iter().enumerate() {
            let r0 = (h0 + k) * 8;
            let n = end.saturating_sub(r0).min(8) as i32;
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(n),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            for (t, a) in acc_k.iter().enumerate() {
                _mm256_maskstore_ps(out.add((t0 + t) * w.rows + r0), mask, *a);
            }
        }
    }
}
