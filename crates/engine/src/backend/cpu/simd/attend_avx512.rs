//! The AVX-512 attention row kernels: sixteen-lane loads of f16 and E4M3 rows, the dot products and their
//! sixteen-way reduction tree, the scores and value passes, as [`RowKernels`] for the shared row driver.

use super::Isa;
use super::row_kernel::{Active, QRow, RowKernels, Rows, Src, attend_rows_with};
use std::arch::x86_64::*;

/// The AVX-512 F/BW/VL (+ FMA, F16C) row kernels.
pub(super) struct Avx512;

impl RowKernels for Avx512 {
    type Vec = __m512;
    type Scale = __m512;
    const LANES: usize = 16;
    const ISA: Isa = Isa::Avx512Vnni;

    #[inline(always)]
    unsafe fn scale(x: f32) -> __m512 {
        // SAFETY: the entry point runs with AVX-512 F.
        unsafe { _mm512_set1_ps(x) }
    }

    /// Rows that one scores call and one value pass cover read the page directly.
    #[inline(always)]
    fn direct<const V: usize>(rows: usize) -> bool {
        rows <= 4 && rows <= 16 / V
    }

    #[inline(always)]
    fn value_rows<const V: usize>() -> usize {
        16 / V
    }

    #[inline(always)]
    unsafe fn stage<const V: usize, const FP8: bool>(
        dst: *mut __m512,
        rows: Rows,
        at: usize,
        block: usize,
    ) {
        // SAFETY: the caller keeps the positions inside `rows` and `dst` for `block * V` vectors.
        unsafe {
            for j in 0..block {
                for i in 0..V {
                    dst.add(j * V + i)
                        .write(load16::<FP8>(rows, (at + j) * 16 * V + 16 * i));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn scores<const V: usize, const N: usize, const FP8: bool>(
        q: [*const f32; N],
        keys: Src<__m512>,
        n: usize,
        ks: __m512,
        s: [*mut f32; N],
    ) {
        // SAFETY: the caller's contract is the kernel's.
        unsafe { scores_n::<V, N, FP8>(q, keys, n, ks, s) }
    }

    #[inline(always)]
    unsafe fn values<const V: usize, const FP8: bool>(
        rows: Active<'_>,
        a: usize,
        n: usize,
        vals: Src<__m512>,
    ) {
        // SAFETY: the caller's contract is the kernel's.
        unsafe {
            macro_rules! group {
                ($n:literal) => {
                    values_n::<V, $n, FP8>(
                        std::array::from_fn(|r| rows.o(a + r)),
                        std::array::from_fn(|r| rows.p(a + r)),
                        std::array::from_fn(|r| rows.count(a + r)),
                        std::array::from_fn(|r| rows.corr(a + r)),
                        vals,
                    )
                };
            }
            match n {
                1 => group!(1),
                2 => group!(2),
                3 => group!(3),
                4 => group!(4),
                5 => group!(5),
                6 => group!(6),
                7 => group!(7),
                _ => group!(8),
            }
        }
    }
}

/// The row driver on AVX-512, `head_dim == 16 * V`: scores up to four rows at a time with sixteen dot
/// products reduced at once ([`sum16`]), outputs up to `16 / V` rows at a time.
///
/// # Safety
/// AVX-512 F/BW/VL was detected, with [`super::row_kernel::attend_rows`]' contract.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn attend_rows_avx512<const V: usize, const FP8: bool>(
    rows: &[QRow],
    keys: Rows,
    values: Rows,
    start: usize,
    scale: f32,
) {
    // SAFETY: the caller's contract is the driver's, and this function has the ISA.
    unsafe { attend_rows_with::<Avx512, V, FP8>(rows, keys, values, start, scale) }
}

/// Sixteen elements of `rows` starting at element `at`, as f32 (E4M3 times 2^-8, before `rows.scale`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn load16<const FP8: bool>(rows: Rows, at: usize) -> __m512 {
    // SAFETY: the caller keeps `at + 16` within the `rows.len` elements behind `rows.ptr`.
    unsafe {
        if FP8 {
            let b = _mm256_cvtepu8_epi16(_mm_loadu_si128(rows.ptr.add(at) as *const __m128i));
            let sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
            let mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
            _mm512_cvtph_ps(_mm256_or_si256(sign, mag))
        } else {
            _mm512_cvtph_ps(_mm256_loadu_si256(rows.ptr.add(2 * at) as *const __m256i))
        }
    }
}

/// The sums of 16 vectors as one vector: lane `s` holds the sum of `v[s]`'s lanes. Every vector's lanes are
/// added in the same tree (halves, quarters, pairs, neighbours) whichever slot it takes, so a dot product's
/// bits do not depend on which others share the call.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn sum16(v: &[__m512; 16]) -> __m512 {
    // 16 -> 8: l1[i] = [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3] for (a, b) = v[2i], v[2i + 1]
    // (q: 128-bit quarters).
    let l1: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4(a, b, 0b01_00_01_00),
            _mm512_shuffle_f32x4(a, b, 0b11_10_11_10),
        )
    });
    // 8 -> 4: quarter k of l2[i] holds four partial sums of v[4i + k].
    let l2: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (l1[2 * i], l1[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4(a, b, 0b10_00_10_00),
            _mm512_shuffle_f32x4(a, b, 0b11_01_11_01),
        )
    });
    // 4 -> 2: quarter k of l3[i] holds two partial sums each of v[8i + k] and v[8i + 4 + k].
    let l3: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (l2[2 * i], l2[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps(a, b, 0b01_00_01_00),
            _mm512_shuffle_ps(a, b, 0b11_10_11_10),
        )
    });
    // 2 -> 1: lane 4k + m holds the sum of v[4m + k]; the permutation puts v[s]'s in lane s.
    let l4 = _mm512_add_ps(
        _mm512_shuffle_ps(l3[0], l3[1], 0b10_00_10_00),
        _mm512_shuffle_ps(l3[0], l3[1], 0b11_01_11_01),
    );
    _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
        l4,
    )
}

/// One query (`V` vectors) times one converted key row, lane by lane: `q[0] k[0]`, then a fused
/// multiply-add per vector in order (the lanes are summed by [`sum16`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn dot_lanes<const V: usize>(q: &[__m512; V], k: &[__m512; V]) -> __m512 {
    // Index loops: iterator adapters over vectors are not inlined into AVX-512 code.
    let mut acc = _mm512_mul_ps(q[0], k[0]);
    for i in 1..V {
        acc = _mm512_fmadd_ps(q[i], k[i], acc);
    }
    acc
}

impl Src<__m512> {
    /// Row `j` of the block (`V` vectors of f32; E4M3 before `rows.scale`, as [`load16`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn row<const V: usize, const FP8: bool>(self, j: usize) -> [__m512; V] {
        // SAFETY: the caller keeps row `j` inside the block (staged) or the page (direct).
        unsafe {
            if self.staged.is_null() {
                std::array::from_fn(|i| load16::<FP8>(self.rows, (self.at + j) * 16 * V + 16 * i))
            } else {
                std::array::from_fn(|i| *self.staged.add(j * V + i))
            }
        }
    }
}

/// Scores of `N` (1 to 4) query rows against the block's keys `0..n`, times `ks`, into `s[r][..n]`: each
/// key row read once for all `N`, and `16 / N` keys of each row summed per reduction ([`sum16`]: the same
/// tree for every slot, so a score's bits do not depend on `N`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_n<const V: usize, const N: usize, const FP8: bool>(
    q: [*const f32; N],
    keys: Src<__m512>,
    n: usize,
    ks: __m512,
    s: [*mut f32; N],
) {
    // SAFETY: the caller keeps each q[r] valid for 16 * V floats, s[r] for n floats and keys for n rows;
    // the stores are masked to keys below n (their addresses only formed with wrapping arithmetic).
    unsafe {
        let k = 16 / N;
        let qv: [[__m512; V]; N] =
            std::array::from_fn(|r| std::array::from_fn(|i| _mm512_loadu_ps(q[r].add(16 * i))));
        let mut c = 0;
        while c < n {
            let mut acc = [_mm512_setzero_ps(); 16];
            if c + k <= n {
                for j in 0..k {
                    let kv = keys.row::<V, FP8>(c + j);
                    for (r, qr) in qv.iter().enumerate() {
                        acc[r * k + j] = dot_lanes::<V>(qr, &kv);
                    }
                }
            } else {
                for j in 0..n - c {
                    let kv = keys.row::<V, FP8>(c + j);
                    for (r, qr) in qv.iter().enumerate() {
                        acc[r * k + j] = dot_lanes::<V>(qr, &kv);
                    }
                }
            }
            let sum = _mm512_mul_ps(sum16(&acc), ks);
            let valid: u32 = (1u32 << (n - c).min(k)) - 1;
            for (r, sr) in s.iter().enumerate() {
                let mask = (valid << (r * k)) as __mmask16;
                _mm512_mask_storeu_ps(sr.wrapping_add(c).wrapping_sub(r * k), mask, sum);
            }
            c += k;
        }
    }
}

/// The value pass of `N` rows: each row's output (rescaled by its `corr`) stays in registers while the
/// block's value rows `vals` stream past, each loaded once for all `N`; row `r` adds
/// `p[r][j] * v[j]` for its own `j < count[r]` (masked, so a shorter row keeps its bits; `p` carries the
/// value scale, see [`attend_rows_with`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn values_n<const V: usize, const N: usize, const FP8: bool>(
    o: [*mut f32; N],
    p: [*const f32; N],
    count: [usize; N],
    corr: [f32; N],
    vals: Src<__m512>,
) {
    // SAFETY: the caller keeps `o[r]` valid for 16 * V floats, `p[r]` for max(count) floats and `vals` for
    // max(count) rows.
    unsafe {
        let mut acc: [[__m512; V]; N] = std::array::from_fn(|r| {
            let c = _mm512_set1_ps(corr[r]);
            std::array::from_fn(|i| _mm512_mul_ps(_mm512_loadu_ps(o[r].add(16 * i)), c))
        });
        // Every row sees the first `all` positions (most blocks: all of them); past those, masked.
        let all = count.iter().copied().min().unwrap_or(0);
        let n = count.iter().copied().max().unwrap_or(0);
        for j in 0..all {
            let v = vals.row::<V, FP8>(j);
            for r in 0..N {
                let pv = _mm512_set1_ps(*p[r].add(j));
                for (a, vi) in acc[r].iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(pv, *vi, *a);
                }
            }
        }
        for j in all..n {
            let v = vals.row::<V, FP8>(j);
            for r in 0..N {
                let pv = _mm512_set1_ps(*p[r].add(j));
                let k: __mmask16 = if j < count[r] { 0xffff } else { 0 };
                for (a, vi) in acc[r].iter_mut().zip(&v) {
                    *a = _mm512_mask3_fmadd_ps(pv, *vi, *a, k);
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
