//! Attention with 16-bit products on AVX-512 BF16 (`vdpbf16ps`: 32 bf16 products a vector, summed in pairs
//! into f32): twice the f32 kernels' multiply-adds per instruction, and no horizontal sums.
//!
//! Layouts, per block of [`GROUP_CHUNK`] positions (the f32 driver's blocks, so the same positions go
//! through each softmax step):
//! - **keys** are converted to bf16 and transposed, 16 positions at a time, so that one vector holds one
//!   pair of dimensions `(2p, 2p + 1)` of 16 keys: a query row's scores for 16 keys are then
//!   `head_dim / 2` products with the row's pair `p` broadcast, 16 scores in the lanes;
//! - **values** are converted and interleaved two positions at a time, so that one vector holds 16
//!   dimensions of positions `(2j, 2j + 1)`: an output row gains `P[2j] V[2j] + P[2j + 1] V[2j + 1]` per
//!   product, with the row's pair of weights broadcast;
//! - **queries** are converted once per call; the softmax state and outputs stay f32, the weights are
//!   rounded to bf16 for the value products only (the denominator sums them in f32).
//!
//! A score's bits depend only on its query, its key and the order of the products (pairs `0, 2, 4, ...`
//! in one sum and `1, 3, 5, ...` in another, then added), and an output's only on its own weights: the
//! rows that share a call, and how many there are, change no bits, so a token gets the same result in a
//! prefill tile, a draft tree or a decode step. Against f32 products the error is bf16's rounding of the
//! query, the weights and (f16 pages) the keys and values: an E4M3 page's elements are exact in bf16.

use super::Isa;
use super::attend_avx512::load16;
use super::attention::GROUP_CHUNK;
use super::row_kernel::{MAX_ROWS, QRow, Rows, active_rows, softmax_rows};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Largest `head_dim / 32` (128-wide heads).
const MAX_H: usize = 4;
/// Sub-blocks of 16 positions in a block.
const SUBS: usize = GROUP_CHUNK / 16;

/// A 64-byte-aligned stack buffer of `N` vectors, written before it is read.
#[repr(C, align(64))]
struct Vecs<const N: usize>([MaybeUninit<__m512i>; N]);

impl<const N: usize> Vecs<N> {
    fn new() -> Self {
        Vecs([MaybeUninit::uninit(); N])
    }

    fn ptr(&mut self) -> *mut __m512i {
        self.0.as_mut_ptr().cast()
    }
}

/// `x` as the bf16 pairs `vdpbf16ps` takes.
#[inline(always)]
fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain data; every bit pattern is a valid value of either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

/// `a` and `b` (16 floats each) as 32 bf16, `a`'s first, rounded to nearest even.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn pack(a: __m512, b: __m512) -> __m512i {
    // SAFETY: as in `bh`.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a)) }
}

/// Transposes 16 rows of 16 dwords in place: afterwards `z[c]` lane `r` is what `z[r]` lane `c` was.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
fn transpose16(z: &mut [__m512i; 16]) {
    // Within each 128-bit lane: u[4i + c] holds column 4l + c of rows 4i..4i + 4 in lane l.
    let t: [__m512i; 16] = std::array::from_fn(|k| {
        let (a, b) = (z[k & !1], z[k | 1]);
        if k % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    let u: [__m512i; 16] = std::array::from_fn(|k| {
        let (i, c) = (k / 4, k % 4);
        let (a, b) = (t[4 * i + c / 2], t[4 * i + c / 2 + 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // Column 4l + c gathers lane l of u[c], u[4 + c], u[8 + c], u[12 + c].
    for c in 0..4 {
        let wl = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[c], u[4 + c]);
        let wh = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[c], u[4 + c]);
        let xl = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[8 + c], u[12 + c]);
        let xh = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[8 + c], u[12 + c]);
        z[c] = _mm512_shuffle_i32x4::<0b10_00_10_00>(wl, xl);
        z[4 + c] = _mm512_shuffle_i32x4::<0b11_01_11_01>(wl, xl);
        z[8 + c] = _mm512_shuffle_i32x4::<0b10_00_10_00>(wh, xh);
        z[12 + c] = _mm512_shuffle_i32x4::<0b11_01_11_01>(wh, xh);
    }
}

/// Attention of `rows` over one page's f16 or E4M3 keys and values with bf16 products, `head_dim == 32 *
/// H` and `V == 2 * H` (its f32 vectors); each row attends `start..row.end` in blocks of [`GROUP_CHUNK`]
/// positions from `start`, as in [`super::row_kernel::attend_rows_with`], whose contract this shares.
///
/// # Safety
/// AVX-512 F/BW/VL and BF16 were detected; every row's pointers are valid for its `head_dim`-float query
/// and output and its `m`/`l`, no two rows share state, and no row's `end` is past the rows of
/// `keys`/`values` (asserted).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn attend_rows_bf16<const H: usize, const V: usize, const FP8: bool>(
    rows: &[QRow],
    keys: Rows,
    values: Rows,
    start: usize,
    scale: f32,
) {
    assert!(V == 2 * H && H <= MAX_H);
    let hd = 32 * H;
    let last = rows.iter().map(|r| r.end).max().unwrap_or(start);
    assert!(rows.len() <= MAX_ROWS && last * hd <= keys.len && last * hd <= values.len);
    // SAFETY: positions below `last` are inside `keys`/`values` (asserted above); the caller keeps each
    // row's pointers valid and disjoint. Every stack buffer is written before it is read: queries for
    // every row, keys and values for every sub-block and pair of the block (zeros past its end), scores
    // and weights for every active row.
    unsafe {
        let mut qb = Vecs::<{ MAX_ROWS * MAX_H }>::new();
        let qp = qb.ptr();
        for (r, row) in rows.iter().enumerate() {
            for h in 0..H {
                let a = _mm512_loadu_ps(row.q.add(32 * h));
                let b = _mm512_loadu_ps(row.q.add(32 * h + 16));
                qp.add(r * H + h).write(pack(a, b));
            }
        }
        let qword = |r: usize, p: usize| *qp.cast::<i32>().add(r * 16 * H + p);
        let ks = _mm512_set1_ps(scale * keys.scale);
        let mut kt = Vecs::<{ SUBS * 16 * MAX_H }>::new();
        let mut vp = Vecs::<{ GROUP_CHUNK / 2 * 2 * MAX_H }>::new();
        let mut pb = Vecs::<{ MAX_ROWS * 2 }>::new();
        let (ktp, vpp, pbp) = (kt.ptr(), vp.ptr(), pb.ptr());
        let mut scores = [MaybeUninit::<f32>::uninit(); GROUP_CHUNK * MAX_ROWS];
        let sbase = scores.as_mut_ptr().cast::<f32>();
        let sp = |a: usize| sbase.add(a * GROUP_CHUNK);
        let mut active = [0usize; MAX_ROWS];
        let mut count = [0usize; MAX_ROWS];
        let mut corr = [0f32; MAX_ROWS];
        let mut at = start;
        while at < last {
            let block = (last - at).min(GROUP_CHUNK);
            let subs = block.div_ceil(16);
            let na = active_rows(rows, at, &mut active, &mut count);
            // Keys: sub-block s, pair p at ktp[s * 16H + p], lane j = position at + 16s + j.
            for s in 0..subs {
                for h in 0..H {
                    let mut z = [_mm512_setzero_si512(); 16];
                    for (j, zj) in z.iter_mut().enumerate() {
                        let pos = 16 * s + j;
                        if pos < block {
                            let e = (at + pos) * hd + 32 * h;
                            *zj = pack(load16::<FP8>(keys, e), load16::<FP8>(keys, e + 16));
                        }
                    }
                    transpose16(&mut z);
                    for (p, zp) in z.iter().enumerate() {
                        ktp.add(s * 16 * H + 16 * h + p).write(*zp);
                    }
                }
            }
            let mut a = 0;
            while a < na {
                let n = (na - a).min(6);
                macro_rules! scores {
                    ($n:literal) => {
                        scores_n::<H, $n>(
                            std::array::from_fn(|r| active[a + r]),
                            &qword,
                            ktp,
                            subs,
                            ks,
                            std::array::from_fn(|r| sp(a + r)),
                        )
                    };
                }
                match n {
                    1 => scores!(1),
                    2 => scores!(2),
                    3 => scores!(3),
                    4 => scores!(4),
                    5 => scores!(5),
                    _ => scores!(6),
                }
                a += n;
            }
            // The f32 kernels' softmax step, then the weights rounded to bf16 pairs (zeros past each
            // row's count) for the value products.
            let isa = Isa::Avx512Vnni;
            softmax_rows(
                isa,
                rows,
                &active[..na],
                &count,
                sbase,
                values.scale,
                &mut corr,
            );
            for (a, &n) in count[..na].iter().enumerate() {
                for c in 0..GROUP_CHUNK / 32 {
                    let w = |o: usize| {
                        let from = 32 * c + o;
                        let k = n.saturating_sub(from).min(16);
                        _mm512_maskz_loadu_ps(((1u32 << k) - 1) as __mmask16, sp(a).add(from))
                    };
                    pbp.add(2 * a + c).write(pack(w(0), w(16)));
                }
            }
            // Values: pair j (positions 2j, 2j + 1), dimensions 16i.. at vpp[j * V + i], lane d = the
            // two positions' elements.
            let idx = _mm512_set_epi16(
                31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                20, 4, 19, 3, 18, 2, 17, 1, 16, 0,
            );
            let pairs = block.div_ceil(2);
            for j in 0..pairs {
                for i in 0..V {
                    let row = |pos: usize| {
                        if pos < block {
                            load16::<FP8>(values, (at + pos) * hd + 16 * i)
                        } else {
                            _mm512_setzero_ps()
                        }
                    };
                    let x = pack(row(2 * j), row(2 * j + 1));
                    vpp.add(j * V + i).write(_mm512_permutexvar_epi16(idx, x));
                }
            }
            let mut a = 0;
            let per = (24 / V).clamp(1, 8);
            while a < na {
                let n = (na - a).min(per);
                macro_rules! values {
                    ($n:literal) => {
                        values_n::<V, $n>(
                            std::array::from_fn(|r| rows[active[a + r]].o),
                            std::array::from_fn(|r| {
                                pbp.add(2 * (a + r)).cast::<i32>().cast_const()
                            }),
                            std::array::from_fn(|r| count[a + r].div_ceil(2)),
                            std::array::from_fn(|r| corr[a + r]),
                            vpp,
                        )
                    };
                }
                match n {
                    1 => values!(1),
                    2 => values!(2),
                    3 => values!(3),
                    4 => values!(4),
                    5 => values!(5),
                    6 => values!(6),
                    7 => values!(7),
                    _ => values!(8),
                }
                a += n;
            }
            at += block;
        }
    }
}

/// Scores of the `N` rows `row` (indices into the call's queries, `qword(row, p)`: pair `p` of its bf16
/// query) against the block's `subs` sub-blocks of transposed keys `kt`, times `ks`, into `s[r]` (16 per
/// sub-block; lanes past the block hold zeros' scores, which the softmax step never reads).
///
/// # Safety
/// `kt` holds `subs * 16 * H` vectors; each `s[r]` has room for `16 * subs` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn scores_n<const H: usize, const N: usize>(
    row: [usize; N],
    qword: &impl Fn(usize, usize) -> i32,
    kt: *const __m512i,
    subs: usize,
    ks: __m512,
    s: [*mut f32; N],
) {
    // SAFETY: the caller's contract.
    unsafe {
        for sb in 0..subs {
            let k = kt.add(sb * 16 * H);
            let mut even = [_mm512_setzero_ps(); N];
            let mut odd = [_mm512_setzero_ps(); N];
            for p in (0..16 * H).step_by(2) {
                let (k0, k1) = (bh(*k.add(p)), bh(*k.add(p + 1)));
                for r in 0..N {
                    let q0 = bh(_mm512_set1_epi32(qword(row[r], p)));
                    let q1 = bh(_mm512_set1_epi32(qword(row[r], p + 1)));
                    even[r] = _mm512_dpbf16_ps(even[r], k0, q0);
                    odd[r] = _mm512_dpbf16_ps(odd[r], k1, q1);
                }
            }
            for r in 0..N {
                let sc = _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), ks);
                _mm512_storeu_ps(s[r].add(16 * sb), sc);
            }
        }
    }
}

/// The value pass of `N` rows: each output (`V` vectors, rescaled by its `corr`) stays in registers while
/// the block's interleaved value pairs `vp` stream past, each loaded once for all `N`; row `r` adds its
/// `pairs[r]` pairs of bf16 weights `w[r]` (a pair per dword) times the pairs' values. Past a row's own
/// pairs it adds nothing, so a row's bits do not depend on the others.
///
/// # Safety
/// `o[r]` is valid for `16 * V` floats, `w[r]` for `pairs[r]` dwords, `vp` for the largest count's pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn values_n<const V: usize, const N: usize>(
    o: [*mut f32; N],
    w: [*const i32; N],
    pairs: [usize; N],
    corr: [f32; N],
    vp: *const __m512i,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc: [[__m512; V]; N] = std::array::from_fn(|r| {
            let c = _mm512_set1_ps(corr[r]);
            std::array::from_fn(|i| _mm512_mul_ps(_mm512_loadu_ps(o[r].add(16 * i)), c))
        });
        let all = pairs.iter().copied().min().unwrap_or(0);
        let most = pairs.iter().copied().max().unwrap_or(0);
        for j in 0..all {
            let v: [__m512bh; V] = std::array::from_fn(|i| bh(*vp.add(j * V + i)));
            for r in 0..N {
                let pw = bh(_mm512_set1_epi32(*w[r].add(j)));
                for (a, vi) in acc[r].iter_mut().zip(&v) {
                    *a = _mm512_dpbf16_ps(*a, *vi, pw);
                }
            }
        }
        for j in all..most {
            let v: [__m512bh; V] = std::array::from_fn(|i| bh(*vp.add(j * V + i)));
            for r in 0..N {
                if j < pairs[r] {
                    let pw = bh(_mm512_set1_epi32(*w[r].add(j)));
                    for (a, vi) in acc[r].iter_mut().zip(&v) {
                        *a = _mm512_dpbf16_ps(*a, *vi, pw);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (i, x) in a.iter().enumerate() {
                _mm512_storeu_ps(o[r].add(16 * i), *x);
            }
        }
    }
}

/// Whether this CPU has what the bf16 kernels need (AVX-512 F/BW/VL and BF16).
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_swaps_rows_and_columns() {
        if !supported() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        let m: Vec<i32> = (0..256).collect();
        // SAFETY: the features were detected above; the loads and stores stay inside `m` and `out`.
        unsafe {
            let mut z: [__m512i; 16] =
                std::array::from_fn(|r| _mm512_loadu_si512(m.as_ptr().add(16 * r).cast()));
            transpose16(&mut z);
            let mut out = [0i32; 256];
            for (c, zc) in z.iter().enumerate() {
                _mm512_storeu_si512(out.as_mut_ptr().add(16 * c).cast(), *zc);
            }
            for r in 0..16 {
                for c in 0..16 {
                    assert_eq!(out[16 * c + r], m[16 * r + c], "row {r} column {c}");
                }
            }
        }
    }
}
