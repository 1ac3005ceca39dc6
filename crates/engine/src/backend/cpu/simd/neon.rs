//! The aarch64 kernels, behind the same run-time dispatch as the x86 ones ([`Isa`]; `THORN_ISA` caps it):
//! NEON (Advanced SIMD, part of every aarch64 CPU), the dot-product extension (FEAT_DotProd, `sdot`) and
//! the int8 matrix-multiply extension (FEAT_I8MM, `smmla`/`usmmla`).
//!
//! Each kernel holds to its scalar reference the way its x86 counterpart does:
//! * activation quantization and every quantized product **bit for bit**: the integer block sums are exact
//!   whatever instruction makes them (`smull`+`sadalp`, `sdot`, `smmla`), and the float combination is the
//!   reference's two fused multiply-adds per block, in block order;
//! * the float reductions (dot products, softmax, attention) to the tests' tolerance, with a fixed
//!   reduction tree per output so that a result never depends on what shares the call (a tile of tokens
//!   gets, token by token, the bits each gets alone).
//!
//! Quantized products read the same group-block layout as the x86 kernels (see
//! [`super::super::qmatmul::QMatrix`]): 16 bytes of a 64-byte group-block vector are one *quarter* (4 rows ×
//! 4 consecutive inputs, one 32-bit lane a row), which is exactly what one `sdot` multiplies by four
//! activation bytes taken from a lane of another register. `smmla` wants 2 rows × 8 inputs: two quarters'
//! vectors zipped by 32-bit lanes make that, and two tokens' activations zipped by 64-bit lanes make its
//! other operand, so one instruction does a 2 × 2 block of row-token sums.
//!
//! The attention row kernels on NEON are in `attend_neon`, beside the x86 ones.
//!
//! `sdot`, `smmla` and `usmmla` are written as inline assembly: their intrinsics are not stable Rust yet.
//! Everything here runs under `qemu-aarch64 -cpu max` in `scripts/test-aarch64`.

use super::Isa;
use super::matmul::{BYTE, NIB16, NIB32, layout_kind};
use crate::backend::cpu::qmatmul::{GROUP, QActs, QK, QMatrix};
use std::arch::aarch64::*;
use std::arch::asm;

/// One block of 32 activations quantized as [`crate::backend::cpu::qmatmul::quantize_block_ref`] does it,
/// bit for bit: the same `amax / 127` and reciprocal, products rounded to nearest even (`fcvtns`, the
/// reference's `round_ties_even`), narrowed from values inside -127..=127.
///
/// # Safety
/// `x` and `q` hold at least 32 elements.
pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    assert!(x.len() >= QK && q.len() >= QK);
    // SAFETY: all loads and stores stay inside the 32 elements asserted above.
    unsafe {
        let p = x.as_ptr();
        let v: [float32x4_t; 8] = std::array::from_fn(|i| vld1q_f32(p.add(4 * i)));
        // maxNum, like the reference's f32::max fold, skips NaN.
        let mut mx = vabsq_f32(v[0]);
        for vi in &v[1..] {
            mx = vmaxnmq_f32(mx, vabsq_f32(*vi));
        }
        let amax = vmaxnmvq_f32(mx);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let i: [int32x4_t; 8] = std::array::from_fn(|k| vcvtnq_s32_f32(vmulq_n_f32(v[k], id)));
        let s = vaddq_s32(
            vaddq_s32(vaddq_s32(i[0], i[1]), vaddq_s32(i[2], i[3])),
            vaddq_s32(vaddq_s32(i[4], i[5]), vaddq_s32(i[6], i[7])),
        );
        let h: [int16x8_t; 4] =
            std::array::from_fn(|k| vcombine_s16(vqmovn_s32(i[2 * k]), vqmovn_s32(i[2 * k + 1])));
        let o = q.as_mut_ptr();
        vst1q_s8(o, vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1])));
        vst1q_s8(o.add(16), vcombine_s8(vqmovn_s16(h[2]), vqmovn_s16(h[3])));
        (d, vaddvq_s32(s))
    }
}

/// Tokens a quantized product takes per pass over a weight group's blocks: their activations (at most
/// 16 × 32 bytes per block) stay in L1 while the group's blocks stream past once.
const TILE: usize = 16;

/// [`super::matmul`] on aarch64: for each tile of up to [`TILE`] tokens, each group of 16 rows in `rows`,
/// the tile's tokens two at a time (`smmla` on i8mm machines, `sdot` on dot-product ones, `smull` and
/// pairwise adds on plain NEON). A group's blocks are read from memory once per tile; the second and later
/// token pairs find them in L1.
///
/// # Safety
/// `isa` was detected on this CPU, and [`super::matmul`]'s asserted shapes hold (`out` is `x.n * w.rows`).
pub(super) unsafe fn matmul(
    isa: Isa,
    w: &QMatrix,
    x: &QActs,
    rows: std::ops::Range<usize>,
    out: *mut f32,
) {
    let groups = rows.start / GROUP..rows.end.div_ceil(GROUP);
    let kind = layout_kind(w);
    let end = rows.end;
    let mut t = 0;
    while t < x.n {
        let tile = (x.n - t).min(TILE);
        for g in groups.clone() {
            let mut u = t;
            while u < t + tile {
                let nt = (t + tile - u).min(2);
                macro_rules! k {
                    ($f:ident $(, $n:literal)?) => {
                        match kind {
                            NIB16 => $f::<NIB16 $(, $n)?>(w, g, x, u, end, out),
                            NIB32 => $f::<NIB32 $(, $n)?>(w, g, x, u, end, out),
                            _ => $f::<BYTE $(, $n)?>(w, g, x, u, end, out),
                        }
                    };
                }
                // SAFETY: the caller's contract; group g is inside rows' and tokens u..u + nt exist.
                unsafe {
                    match (isa, nt) {
                        (Isa::NeonI8mm, 2) => k!(group_mmla),
                        (Isa::NeonDotprod, 2) => k!(group_sdot, 2),
                        (Isa::NeonI8mm | Isa::NeonDotprod, _) => k!(group_sdot, 1),
                        (_, 2) => k!(group_neon, 2),
                        _ => k!(group_neon, 1),
                    }
                }
                u += nt;
            }
        }
        t += tile;
    }
}

/// Four f16 at `p` as f32 (exact).
///
/// # Safety
/// `p` is valid for 8 bytes.
#[inline(always)]
unsafe fn f16x4(p: *const u8) -> float32x4_t {
    // SAFETY: the caller's contract; an unaligned 8-byte load.
    unsafe { vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p.cast()))) }
}

/// Row quarter `q`'s (rows `4q..4q + 4` of the group) scales `(d, m)` in group block `rec`: f16 or f32
/// after the integers, `m = -128 d` for bytes (as [`QMatrix::dm`] gives them).
///
/// # Safety
/// `rec` is a whole group block of layout `L`, and `q < 4`.
#[inline(always)]
unsafe fn scales<const L: u8>(rec: *const u8, q: usize) -> (float32x4_t, float32x4_t) {
    // SAFETY: the scales sit inside the group block (256..320 or 256..384 for nibbles, 512..544 for bytes).
    unsafe {
        match L {
            NIB16 => (f16x4(rec.add(256 + 8 * q)), f16x4(rec.add(288 + 8 * q))),
            NIB32 => (
                vld1q_f32(rec.add(256 + 16 * q).cast()),
                vld1q_f32(rec.add(320 + 16 * q).cast()),
            ),
            _ => {
                let d = f16x4(rec.add(512 + 8 * q));
                (d, vmulq_n_f32(d, -128.0))
            }
        }
    }
}

/// A block's exact integer sums of four rows into their float sums: `acc = isum * (d * dx) + acc`, then
/// `acc = m * sx + acc`, both fused, as in [`crate::backend::cpu::qmatmul::matmul_ref`].
#[inline(always)]
fn fold(acc: &mut float32x4_t, isum: int32x4_t, d: float32x4_t, m: float32x4_t, dx: f32, sx: f32) {
    // SAFETY: register-only NEON arithmetic (NEON is part of every aarch64 CPU).
    unsafe {
        *acc = vfmaq_f32(*acc, vcvtq_f32_s32(isum), vmulq_n_f32(d, dx));
        *acc = vfmaq_f32(*acc, m, vdupq_n_f32(sx));
    }
}

/// Writes group `g`'s outputs for tokens `t0..t0 + T`: `acc[q][t]` holds rows `16g + 4q..+4`; only rows
/// below `end` are written.
///
/// # Safety
/// Rows below `end` of each token's output row are inside `out` (`out[t * w.rows + r]`).
#[inline(always)]
unsafe fn store<const T: usize>(
    acc: &[[float32x4_t; T]; 4],
    rows: usize,
    g: usize,
    t0: usize,
    end: usize,
    out: *mut f32,
) {
    // SAFETY: the caller's contract; a partial quarter goes through a stack copy.
    unsafe {
        for (q, a) in acc.iter().enumerate() {
            let r0 = g * GROUP + 4 * q;
            let n = end.saturating_sub(r0).min(4);
            for (t, v) in a.iter().enumerate() {
                let dst = out.add((t0 + t) * rows + r0);
                if n == 4 {
                    vst1q_f32(dst, *v);
                } else if n > 0 {
                    let mut tmp = [0f32; 4];
                    vst1q_f32(tmp.as_mut_ptr(), *v);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, n);
                }
            }
        }
    }
}

/// What every quantized kernel reads for one group and `T` tokens: the group's first block and each
/// token's quantized values and per-block scales.
struct Operands<const T: usize> {
    grp: *const u8,
    block_bytes: usize,
    xq: [*const i8; T],
    /// Index of each token's first block in `x.d`, `x.s` and `x.sum`.
    base: [usize; T],
}

impl<const T: usize> Operands<T> {
    /// # Safety
    /// Group `g` and tokens `t0..t0 + T` exist (the shapes [`super::matmul`] asserts).
    #[inline(always)]
    unsafe fn new(w: &QMatrix, g: usize, x: &QActs, t0: usize) -> Self {
        // SAFETY: the caller's contract: the offsets are inside `w.data` and `x.q`.
        unsafe {
            Operands {
                grp: w.data.as_ptr().add(g * w.blocks * w.block_bytes),
                block_bytes: w.block_bytes,
                xq: std::array::from_fn(|t| x.q.as_ptr().add((t0 + t) * x.cols)),
                base: std::array::from_fn(|t| (t0 + t) * x.blocks),
            }
        }
    }

    /// Group block `b`.
    #[inline(always)]
    fn rec(&self, b: usize) -> *const u8 {
        self.grp.wrapping_add(b * self.block_bytes)
    }
}

/// Token `t`'s 32 activations of block `b` as two vectors.
///
/// # Safety
/// Token `t`'s block `b` exists.
#[inline(always)]
unsafe fn acts<const T: usize>(o: &Operands<T>, t: usize, b: usize) -> [int8x16_t; 2] {
    // SAFETY: the caller's contract.
    unsafe {
        let p = o.xq[t].add(QK * b);
        [vld1q_s8(p), vld1q_s8(p.add(16))]
    }
}

/// The integers of quarter `q` of weight vector `v` in group block `rec`.
///
/// # Safety
/// `rec` is a whole group block and `v` one of its vectors.
#[inline(always)]
unsafe fn wvec(rec: *const u8, v: usize, q: usize) -> uint8x16_t {
    // SAFETY: the caller's contract; 16 bytes at 64v + 16q < 512.
    unsafe { vld1q_u8(rec.add(64 * v + 16 * q)) }
}

/// One group × `T` tokens on plain NEON: each 4-byte group of a weight quarter times four broadcast
/// activation bytes by `smull` (exact in 16 bits: at most 128 × 127), pairs added into 32 bits by
/// `sadalp`, and the two halves' pairs added at the end of the block (bytes through their signed form
/// `u - 128`, and back with `128 Σx`).
///
/// # Safety
/// NEON (always there); [`super::matmul`]'s shapes; group `g` and tokens `t0..t0 + T` exist.
unsafe fn group_neon<const L: u8, const T: usize>(
    w: &QMatrix,
    g: usize,
    x: &QActs,
    t0: usize,
    end: usize,
    out: *mut f32,
) {
    #[inline(always)]
    fn mla(pr: &mut [int32x4_t; 2], w: int8x16_t, x: int8x16_t) {
        // SAFETY: register-only NEON arithmetic.
        unsafe {
            pr[0] = vpadalq_s16(pr[0], vmull_s8(vget_low_s8(w), vget_low_s8(x)));
            pr[1] = vpadalq_s16(pr[1], vmull_high_s8(w, x));
        }
    }
    // SAFETY: the caller's contract: every block of the group and of the tokens exists, and x's scales
    // hold x.n * x.blocks entries.
    unsafe {
        let o = Operands::<T>::new(w, g, x, t0);
        let bcast = |t: usize, e: usize| {
            vreinterpretq_s8_s32(vdupq_n_s32(std::ptr::read_unaligned(o.xq[t].add(e).cast())))
        };
        let m4 = vdupq_n_u8(0x0F);
        let flip = vdupq_n_u8(0x80);
        let mut acc = [[vdupq_n_f32(0.0); T]; 4];
        for b in 0..w.blocks {
            let rec = o.rec(b);
            for (q, acc_q) in acc.iter_mut().enumerate() {
                // Per token: rows 0-1's and rows 2-3's pair sums.
                let mut pr = [[vdupq_n_s32(0); 2]; T];
                if L == BYTE {
                    for v in 0..8 {
                        let wq = vreinterpretq_s8_u8(veorq_u8(wvec(rec, v, q), flip));
                        for (t, p) in pr.iter_mut().enumerate() {
                            mla(p, wq, bcast(t, QK * b + 4 * v));
                        }
                    }
                } else {
                    for v in 0..4 {
                        let raw = wvec(rec, v, q);
                        let lo = vreinterpretq_s8_u8(vandq_u8(raw, m4));
                        let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(raw));
                        for (t, p) in pr.iter_mut().enumerate() {
                            mla(p, lo, bcast(t, QK * b + 4 * v));
                            mla(p, hi, bcast(t, QK * b + 16 + 4 * v));
                        }
                    }
                }
                let (d, m) = scales::<L>(rec, q);
                for (t, (a, p)) in acc_q.iter_mut().zip(&pr).enumerate() {
                    let i = o.base[t] + b;
                    let mut isum = vpaddq_s32(p[0], p[1]);
                    if L == BYTE {
                        isum = vaddq_s32(isum, vdupq_n_s32(*x.sum.get_unchecked(i) << 7));
                    }
                    fold(a, isum, d, m, *x.d.get_unchecked(i), *x.s.get_unchecked(i));
                }
            }
        }
        store(&acc, w.rows, g, t0, end, out);
    }
}

/// `acc += Σ_c w[4i + c] * x[4L + c]` per 32-bit lane `i`: `sdot` by element (lane `L` of `x` for every
/// lane of `w`).
#[target_feature(enable = "neon,dotprod")]
#[inline]
fn sdot_lane<const L: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let mut c = acc;
    // SAFETY: a register-only instruction of FEAT_DotProd, which this function's callers were compiled and
    // detected for.
    unsafe {
        asm!(
            "sdot {c:v}.4s, {w:v}.16b, {x:v}.4b[{l}]",
            c = inout(vreg) c,
            w = in(vreg) w,
            x = in(vreg) x,
            l = const L,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    c
}

/// One group × `T` tokens with `sdot`: a token's block is two activation registers, and each weight
/// quarter vector is multiplied by the lane of them its four inputs meet (no broadcasts), two
/// independent sums per token (bytes through their signed form, as in [`group_neon`]).
///
/// # Safety
/// FEAT_DotProd was detected; [`super::matmul`]'s shapes; group `g` and tokens `t0..t0 + T` exist.
#[target_feature(enable = "neon,dotprod")]
unsafe fn group_sdot<const L: u8, const T: usize>(
    w: &QMatrix,
    g: usize,
    x: &QActs,
    t0: usize,
    end: usize,
    out: *mut f32,
) {
    // SAFETY: as for group_neon.
    unsafe {
        let o = Operands::<T>::new(w, g, x, t0);
        let m4 = vdupq_n_u8(0x0F);
        let flip = vdupq_n_u8(0x80);
        let mut acc = [[vdupq_n_f32(0.0); T]; 4];
        for b in 0..w.blocks {
            let rec = o.rec(b);
            let xv: [[int8x16_t; 2]; T] = std::array::from_fn(|t| acts(&o, t, b));
            for (q, acc_q) in acc.iter_mut().enumerate() {
                let mut s = [[vdupq_n_s32(0); 2]; T];
                if L == BYTE {
                    // Vector v holds inputs 4v..4v + 4: half v / 4 of the block, lane v % 4.
                    macro_rules! byte {
                        ($($v:literal)*) => {$(
                            let wq = vreinterpretq_s8_u8(veorq_u8(wvec(rec, $v, q), flip));
                            for (st, xt) in s.iter_mut().zip(&xv) {
                                st[$v & 1] = sdot_lane::<{ $v % 4 }>(st[$v & 1], wq, xt[$v / 4]);
                            }
                        )*};
                    }
                    byte!(0 1 2 3 4 5 6 7);
                } else {
                    // Vector v's low nibbles are inputs 4v..4v + 4, its high ones 16 + 4v..: lane v of
                    // either half.
                    macro_rules! nib {
                        ($($v:literal)*) => {$(
                            let raw = wvec(rec, $v, q);
                            let lo = vreinterpretq_s8_u8(vandq_u8(raw, m4));
                            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(raw));
                            for (st, xt) in s.iter_mut().zip(&xv) {
                                st[0] = sdot_lane::<$v>(st[0], lo, xt[0]);
                                st[1] = sdot_lane::<$v>(st[1], hi, xt[1]);
                            }
                        )*};
                    }
                    nib!(0 1 2 3);
                }
                let (d, m) = scales::<L>(rec, q);
                for (t, (a, st)) in acc_q.iter_mut().zip(&s).enumerate() {
                    let i = o.base[t] + b;
                    let mut isum = vaddq_s32(st[0], st[1]);
                    if L == BYTE {
                        isum = vaddq_s32(isum, vdupq_n_s32(*x.sum.get_unchecked(i) << 7));
                    }
                    fold(a, isum, d, m, *x.d.get_unchecked(i), *x.s.get_unchecked(i));
                }
            }
        }
        store(&acc, w.rows, g, t0, end, out);
    }
}

/// `acc += A · Bᵀ` for the 2 × 8 signed matrices `a` (rows) and `b` (tokens): lanes `[a0·b0, a0·b1,
/// a1·b0, a1·b1]`. With `UNSIGNED`, `a` is read as unsigned (`usmmla`).
#[target_feature(enable = "neon,i8mm")]
#[inline]
fn mmla<const UNSIGNED: bool>(acc: int32x4_t, a: uint8x16_t, b: int8x16_t) -> int32x4_t {
    let mut c = acc;
    // SAFETY: register-only instructions of FEAT_I8MM, which this function's callers were compiled and
    // detected for.
    unsafe {
        if UNSIGNED {
            asm!(
                "usmmla {c:v}.4s, {a:v}.16b, {b:v}.16b",
                c = inout(vreg) c,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags)
            );
        } else {
            asm!(
                "smmla {c:v}.4s, {a:v}.16b, {b:v}.16b",
                c = inout(vreg) c,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
    }
    c
}

/// One group × two tokens with `smmla` (nibbles, 0..=15, are signed-safe) or `usmmla` (bytes, unsigned as
/// stored): two quarter vectors zipped by 32-bit lanes are 2 rows × 8 inputs, the two tokens' activations
/// zipped by 64-bit lanes 2 tokens × 8 inputs, and one instruction adds their 2 × 2 products. Unzipping the
/// row pairs' sums gives each token's four rows, whose float arithmetic is then [`group_sdot`]'s.
///
/// # Safety
/// FEAT_I8MM was detected; [`super::matmul`]'s shapes; group `g` and tokens `t0`, `t0 + 1` exist.
#[target_feature(enable = "neon,dotprod,i8mm")]
unsafe fn group_mmla<const L: u8>(
    w: &QMatrix,
    g: usize,
    x: &QActs,
    t0: usize,
    end: usize,
    out: *mut f32,
) {
    // SAFETY: as for group_neon.
    unsafe {
        let o = Operands::<2>::new(w, g, x, t0);
        let m4 = vdupq_n_u8(0x0F);
        let mut acc = [[vdupq_n_f32(0.0); 2]; 4];
        let zip = |a: uint8x16_t, b: uint8x16_t| {
            let (a, b) = (vreinterpretq_u32_u8(a), vreinterpretq_u32_u8(b));
            (
                vreinterpretq_u8_u32(vzip1q_u32(a, b)),
                vreinterpretq_u8_u32(vzip2q_u32(a, b)),
            )
        };
        for b in 0..w.blocks {
            let rec = o.rec(b);
            let (x0, x1) = (acts(&o, 0, b), acts(&o, 1, b));
            let pair = |h: usize, hi: bool| {
                let (a, c) = (vreinterpretq_s64_s8(x0[h]), vreinterpretq_s64_s8(x1[h]));
                vreinterpretq_s8_s64(if hi {
                    vzip2q_s64(a, c)
                } else {
                    vzip1q_s64(a, c)
                })
            };
            // Inputs 8k..8k + 8 of both tokens.
            let bm = [pair(0, false), pair(0, true), pair(1, false), pair(1, true)];
            for (q, acc_q) in acc.iter_mut().enumerate() {
                // Rows 0-1 and rows 2-3 of the quarter, against both tokens.
                let mut c = [vdupq_n_s32(0); 2];
                if L == BYTE {
                    for (k, bk) in bm.iter().enumerate() {
                        let (r01, r23) = zip(wvec(rec, 2 * k, q), wvec(rec, 2 * k + 1, q));
                        c[0] = mmla::<true>(c[0], r01, *bk);
                        c[1] = mmla::<true>(c[1], r23, *bk);
                    }
                } else {
                    let raw: [uint8x16_t; 4] = std::array::from_fn(|v| wvec(rec, v, q));
                    let lo = raw.map(|r| vandq_u8(r, m4));
                    let hi = raw.map(|r| vshrq_n_u8::<4>(r));
                    let halves = [
                        (lo[0], lo[1]),
                        (lo[2], lo[3]),
                        (hi[0], hi[1]),
                        (hi[2], hi[3]),
                    ];
                    for ((a, a2), bk) in halves.into_iter().zip(&bm) {
                        let (r01, r23) = zip(a, a2);
                        c[0] = mmla::<false>(c[0], r01, *bk);
                        c[1] = mmla::<false>(c[1], r23, *bk);
                    }
                }
                let sums = [vuzp1q_s32(c[0], c[1]), vuzp2q_s32(c[0], c[1])];
                let (d, m) = scales::<L>(rec, q);
                for (t, (a, isum)) in acc_q.iter_mut().zip(sums).enumerate() {
                    let i = o.base[t] + b;
                    fold(a, isum, d, m, *x.d.get_unchecked(i), *x.s.get_unchecked(i));
                }
            }
        }
        store(&acc, w.rows, g, t0, end, out);
    }
}

/// `[Σ a·b[0], …]` in f32: four 4-lane accumulators per output over 16 elements at a time, one more pass
/// of 4, the lanes' fixed tree, then a scalar tail. [`dot_f32`] and [`dot4_f32`] are this with one and four
/// outputs, so their results agree bit for bit.
///
/// # Safety
/// Every `b[j]` holds at least `a.len()` elements.
#[inline(always)]
unsafe fn dot_n<const N: usize>(a: &[f32], b: [&[f32]; N]) -> [f32; N] {
    let n = a.len();
    // SAFETY: full vectors are read only below n; the tail is scalar.
    unsafe {
        let ld = |s: &[f32], i: usize| vld1q_f32(s.as_ptr().add(i));
        let mut acc = [[vdupq_n_f32(0.0); 4]; N];
        let mut i = 0;
        while i + 16 <= n {
            for k in 0..4 {
                let av = ld(a, i + 4 * k);
                for (aj, bj) in acc.iter_mut().zip(&b) {
                    aj[k] = vfmaq_f32(aj[k], av, ld(bj, i + 4 * k));
                }
            }
            i += 16;
        }
        while i + 4 <= n {
            let av = ld(a, i);
            for (aj, bj) in acc.iter_mut().zip(&b) {
                aj[0] = vfmaq_f32(aj[0], av, ld(bj, i));
            }
            i += 4;
        }
        let mut out = [0f32; N];
        for ((o, aj), bj) in out.iter_mut().zip(&acc).zip(&b) {
            let mut total = vaddvq_f32(vaddq_f32(vaddq_f32(aj[0], aj[1]), vaddq_f32(aj[2], aj[3])));
            for q in i..n {
                total += a[q] * bj[q];
            }
            *o = total;
        }
        out
    }
}

/// `Σ a[i] * b[i]` (see [`dot_n`]).
///
/// # Safety
/// NEON (always there).
pub(super) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    // SAFETY: both slices hold n elements.
    unsafe { dot_n::<1>(&a[..n], [&b[..n]])[0] }
}

/// Four dot products sharing `a`'s loads, each bit for bit [`dot_f32`]'s.
///
/// # Safety
/// Every `b[j]` holds `a.len()` elements.
pub(super) unsafe fn dot4_f32(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    // SAFETY: the caller's contract.
    unsafe { dot_n::<4>(a, b) }
}

/// `out += a * x`, fused.
///
/// # Safety
/// `out.len()` is a multiple of 4 and `x` at least as long.
pub(super) unsafe fn axpy(a: f32, x: &[f32], out: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut i = 0;
        while i < out.len() {
            let o = out.as_mut_ptr().add(i);
            vst1q_f32(
                o,
                vfmaq_n_f32(vld1q_f32(o), vld1q_f32(x.as_ptr().add(i)), a),
            );
            i += 4;
        }
    }
}

/// The largest value, NaNs skipped (maxNum); `-inf` for an empty slice.
///
/// # Safety
/// NEON (always there).
pub(super) unsafe fn max(x: &[f32]) -> f32 {
    // SAFETY: full vectors are read only below x.len(); the tail is scalar.
    unsafe {
        let mut acc = [vdupq_n_f32(f32::NEG_INFINITY); 2];
        let mut i = 0;
        while i + 8 <= x.len() {
            acc[0] = vmaxnmq_f32(acc[0], vld1q_f32(x.as_ptr().add(i)));
            acc[1] = vmaxnmq_f32(acc[1], vld1q_f32(x.as_ptr().add(i + 4)));
            i += 8;
        }
        let mut m = vmaxnmvq_f32(vmaxnmq_f32(acc[0], acc[1]));
        for &v in &x[i..] {
            m = m.max(v);
        }
        m
    }
}

/// Index of the first element equal to `v`.
///
/// # Safety
/// NEON (always there).
pub(super) unsafe fn first_eq(x: &[f32], v: f32) -> Option<usize> {
    // SAFETY: full vectors are read only below x.len(); the tail is scalar.
    unsafe {
        let vv = vdupq_n_f32(v);
        let mut i = 0;
        while i + 4 <= x.len() {
            if vmaxvq_u32(vceqq_f32(vld1q_f32(x.as_ptr().add(i)), vv)) != 0 {
                break;
            }
            i += 4;
        }
        x[i..].iter().position(|&y| y == v).map(|k| i + k)
    }
}

/// `exp` of 4 lanes: the x86 kernels' range reduction by ln 2 and degree-6 polynomial (relative error ~2e-7
/// for the inputs softmax produces, `x <= 0`); inputs below -87 flush to 0.
#[inline(always)]
fn exp4(x: float32x4_t) -> float32x4_t {
    // SAFETY: register-only NEON arithmetic.
    unsafe {
        let x = vmaxq_f32(x, vdupq_n_f32(-87.0));
        let n = vrndnq_f32(vmulq_n_f32(x, std::f32::consts::LOG2_E));
        // r = x - n ln2, with ln2 split in two for precision.
        let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_145_75));
        let r = vfmsq_f32(r, n, vdupq_n_f32(1.428_606_8e-6));
        let mut p = vdupq_n_f32(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = vfmaq_f32(vdupq_n_f32(c), p, r);
        }
        let pow2 = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(
            vcvtnq_s32_f32(n),
            vdupq_n_s32(127),
        )));
        let out = vmulq_f32(p, pow2);
        let keep = vcgtq_f32(x, vdupq_n_f32(-87.0));
        vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(out), keep))
    }
}

/// `Σ exp(x[i] - m)`.
///
/// # Safety
/// NEON (always there).
pub(super) unsafe fn sum_exp_sub(x: &[f32], m: f32) -> f32 {
    // SAFETY: full vectors are read only below x.len(); the tail is scalar.
    unsafe {
        let mv = vdupq_n_f32(m);
        let mut acc = vdupq_n_f32(0.0);
        let mut i = 0;
        while i + 4 <= x.len() {
            acc = vaddq_f32(acc, exp4(vsubq_f32(vld1q_f32(x.as_ptr().add(i)), mv)));
            i += 4;
        }
        let mut total = vaddvq_f32(acc);
        for &v in &x[i..] {
            total += (v - m).exp();
        }
        total
    }
}

/// `x[i] = exp(x[i] - m)` in place; returns the sum.
///
/// # Safety
/// NEON (always there).
pub(super) unsafe fn exp_sub(x: &mut [f32], m: f32) -> f32 {
    // SAFETY: full vectors are read and written only below x.len(); the tail is scalar.
    unsafe {
        let mv = vdupq_n_f32(m);
        let mut acc = vdupq_n_f32(0.0);
        let mut i = 0;
        while i + 4 <= x.len() {
            let p = x.as_mut_ptr().add(i);
            let e = exp4(vsubq_f32(vld1q_f32(p), mv));
            vst1q_f32(p, e);
            acc = vaddq_f32(acc, e);
            i += 4;
        }
        let mut total = vaddvq_f32(acc);
        while i < x.len() {
            x[i] = (x[i] - m).exp();
            total += x[i];
            i += 1;
        }
        total
    }
}

/// Asks for the cache line at `p` to be brought into L2. A hint only.
///
/// # Safety
/// None needed: a prefetch never faults; `unsafe` for the inline assembly.
#[inline]
pub(super) unsafe fn prefetch(p: *const u8) {
    // SAFETY: `prfm` reads nothing into the program and never faults, whatever the address.
    unsafe {
        asm!("prfm pldl2keep, [{p}]", p = in(reg) p, options(nostack, readonly, preserves_flags))
    };
}
