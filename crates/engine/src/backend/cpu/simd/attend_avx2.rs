//! The AVX2 attention row kernels: eight-lane loads of f16 and E4M3 rows, the dot products and their
//! eight-way reduction tree, the scores and value passes, as [`RowKernels`] for the shared row driver.

use super::Isa;
use super::row_kernel::{Active, QRow, RowKernels, Rows, Src, attend_rows_with};
use std::arch::x86_64::*;

/// The AVX2 (+ FMA, F16C) row kernels.
pub(super) struct Avx2;

impl RowKernels for Avx2 {
    type Vec = __m256;
    type Scale = __m256;
    const LANES: usize = 8;
    const ISA: Isa = Isa::Avx2;

    #[inline(always)]
    unsafe fn scale(x: f32) -> __m256 {
        // SAFETY: the entry point runs with AVX.
        unsafe { _mm256_set1_ps(x) }
    }

    /// Up to four rows (a decode step's group) read the page directly.
    #[inline(always)]
    fn direct<const V: usize>(rows: usize) -> bool {
        rows <= 4
    }

    #[inline(always)]
    fn value_rows<const V: usize>() -> usize {
        2
    }

    #[inline(always)]
    unsafe fn stage<const V: usize, const FP8: bool>(
        dst: *mut __m256,
        rows: Rows,
        at: usize,
        block: usize,
    ) {
        // SAFETY: the caller keeps the positions inside `rows` and `dst` for `block * V` vectors.
        unsafe {
            for j in 0..block {
                for i in 0..V {
                    dst.add(j * V + i)
                        .write(load8::<FP8>(rows, (at + j) * 8 * V + 8 * i));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn scores<const V: usize, const N: usize, const FP8: bool>(
        q: [*const f32; N],
        keys: Src<__m256>,
        n: usize,
        ks: __m256,
        s: [*mut f32; N],
    ) {
        // SAFETY: the caller's contract is the kernel's.
        unsafe { scores_avx2::<V, N, FP8>(q, keys, n, ks, s) }
    }

    /// Two rows at a time, 32 lanes per pass.
    #[inline(always)]
    unsafe fn values<const V: usize, const FP8: bool>(
        rows: Active<'_>,
        a: usize,
        n: usize,
        vals: Src<__m256>,
    ) {
        // SAFETY: the caller's contract is the kernel's; c0 + 4 <= V (V is a multiple of 4).
        unsafe {
            for c0 in (0..V).step_by(4) {
                macro_rules! pass {
                    ($n:literal) => {
                        values_avx2::<V, $n, FP8>(
                            std::array::from_fn(|r| rows.o(a + r)),
                            std::array::from_fn(|r| rows.p(a + r)),
                            std::array::from_fn(|r| rows.count(a + r)),
                            std::array::from_fn(|r| rows.corr(a + r)),
                            vals,
                            c0,
                        )
                    };
                }
                match n {
                    1 => pass!(1),
                    _ => pass!(2),
                }
            }
        }
    }
}

/// The row driver on AVX2, `head_dim == 8 * V`: scores four rows at a time, eight dot products per
/// reduction ([`scores_avx2`]); then the outputs two rows at a time, 32 lanes per pass, in registers while
/// the value vectors stream past.
///
/// # Safety
/// AVX2, FMA and F16C were detected, with [`super::row_kernel::attend_rows`]' contract.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_rows_avx2<const V: usize, const FP8: bool>(
    rows: &[QRow],
    keys: Rows,
    values: Rows,
    start: usize,
    scale: f32,
) {
    // SAFETY: the caller's contract is the driver's, and this function has the ISA.
    unsafe { attend_rows_with::<Avx2, V, FP8>(rows, keys, values, start, scale) }
}

/// Eight elements of `rows` starting at element `at`, as f32 (E4M3 times 2^-8, before `rows.scale`): the
/// AVX2 form of the AVX-512 kernels' `load16`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<const FP8: bool>(rows: Rows, at: usize) -> __m256 {
    // SAFETY: the caller keeps `at + 8` within the `rows.len` elements behind `rows.ptr`.
    unsafe {
        if FP8 {
            let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(rows.ptr.add(at) as *const __m128i));
            let sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
            let mag = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
            _mm256_cvtph_ps(_mm_or_si128(sign, mag))
        } else {
            _mm256_cvtph_ps(_mm_loadu_si128(rows.ptr.add(2 * at) as *const __m128i))
        }
    }
}

/// The sums of 8 vectors as one vector: lane `s` holds `((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))`
/// for `x = v[s]`, the same tree whichever slot a vector takes (so a dot product's bits do not depend on
/// which others share the reduction).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn sum8(v: &[__m256; 8]) -> __m256 {
    // Pairs, then quads, within each 128-bit half: q0 = [v0..v3 low halves' sums | v0..v3 high halves'].
    let q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_add_ps(
        _mm256_permute2f128_ps(q0, q1, 0x20),
        _mm256_permute2f128_ps(q0, q1, 0x31),
    )
}

impl Src<__m256> {
    /// Vector `i` (of `V`) of row `j` of the block (E4M3 before `rows.scale`, as [`load8`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn vec<const V: usize, const FP8: bool>(self, j: usize, i: usize) -> __m256 {
        // SAFETY: the caller keeps row `j` inside the block (staged) or the page (direct), and i < V.
        unsafe {
            if self.staged.is_null() {
                load8::<FP8>(self.rows, (self.at + j) * 8 * V + 8 * i)
            } else {
                *self.staged.add(j * V + i)
            }
        }
    }
}

/// Scores of `N` (1 to 4) query rows against the block's keys `0..n`, times `ks`, into `s[r][..n]`, AVX2:
/// each key vector loaded once for all `N` rows, `8 / N` keys of each row per reduction ([`sum8`]). A
/// score is `q[0] k[0]`, then a fused multiply-add per vector in order, then the lanes' tree, whatever `N`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_avx2<const V: usize, const N: usize, const FP8: bool>(
    q: [*const f32; N],
    keys: Src<__m256>,
    n: usize,
    ks: __m256,
    s: [*mut f32; N],
) {
    // SAFETY: the caller keeps each q[r] valid for 8 * V floats, s[r] for n floats and keys for n rows.
    unsafe {
        let k = 8 / N;
        let mut c = 0;
        while c < n {
            let mut acc = [_mm256_setzero_ps(); 8];
            let m = (n - c).min(k);
            if m == k {
                for i in 0..V {
                    let qv: [__m256; N] = std::array::from_fn(|r| _mm256_loadu_ps(q[r].add(8 * i)));
                    for j in 0..k {
                        let kv = keys.vec::<V, FP8>(c + j, i);
                        for r in 0..N {
                            acc[r * k + j] = if i == 0 {
                                _mm256_mul_ps(qv[r], kv)
                            } else {
                                _mm256_fmadd_ps(qv[r], kv, acc[r * k + j])
                            };
                        }
                    }
                }
            } else {
                for i in 0..V {
                    let qv: [__m256; N] = std::array::from_fn(|r| _mm256_loadu_ps(q[r].add(8 * i)));
                    for j in 0..m {
                        let kv = keys.vec::<V, FP8>(c + j, i);
                        for r in 0..N {
                            acc[r * k + j] = if i == 0 {
                                _mm256_mul_ps(qv[r], kv)
                            } else {
                                _mm256_fmadd_ps(qv[r], kv, acc[r * k + j])
                            };
                        }
                    }
                }
            }
            let mut t = [0f32; 8];
            _mm256_storeu_ps(t.as_mut_ptr(), _mm256_mul_ps(sum8(&acc), ks));
            for r in 0..N {
                for j in 0..m {
                    *s[r].add(c + j) = t[r * k + j];
                }
            }
            c += k;
        }
    }
}

/// The value pass of `N` (1 or 2) rows over output vectors `c0..c0 + 4`, AVX2: each row's outputs (rescaled
/// by its `corr`) stay in registers while the block's value vectors stream past, each loaded once for
/// both rows; row `r` adds `p[r][j] * v[j]` for its own `j < count[r]` only, in order of `j`.
#[target_feature(enable = "avx2,fma,f16c")]
#[expect(
    clippy::needless_range_loop,
    reason = "index loops: iterator adapters over vectors are not inlined into SIMD code"
)]
unsafe fn values_avx2<const V: usize, const N: usize, const FP8: bool>(
    o: [*mut f32; N],
    p: [*const f32; N],
    count: [usize; N],
    corr: [f32; N],
    vals: Src<__m256>,
    c0: usize,
) {
    // SAFETY: the caller keeps `o[r]` valid for 8 * V floats, `p[r]` for count[r] floats, `vals` for
    // max(count) rows and c0 + 4 <= V.
    unsafe {
        let mut acc: [[__m256; 4]; N] = std::array::from_fn(|r| {
            let c = _mm256_set1_ps(corr[r]);
            std::array::from_fn(|i| _mm256_mul_ps(_mm256_loadu_ps(o[r].add(8 * (c0 + i))), c))
        });
        let all = count.iter().copied().min().unwrap_or(0);
        let n = count.iter().copied().max().unwrap_or(0);
        for j in 0..all {
            let v: [__m256; 4] = std::array::from_fn(|i| vals.vec::<V, FP8>(j, c0 + i));
            for r in 0..N {
                let pv = _mm256_set1_ps(*p[r].add(j));
                for i in 0..4 {
                    acc[r][i] = _mm256_fmadd_ps(pv, v[i], acc[r][i]);
                }
            }
        }
        for j in all..n {
            let v: [__m256; 4] = std::array::from_fn(|i| vals.vec::<V, FP8>(j, c0 + i));
            for r in 0..N {
                if j < count[r] {
                    let pv = _mm256_set1_ps(*p[r].add(j));
                    for i in 0..4 {
                        acc[r][i] = _mm256_fmadd_ps(pv, v[i], acc[r][i]);
                    }
                }
            }
        }
        for r in 0..N {
            for i in 0..4 {
                _mm256_storeu_ps(o[r].add(8 * (c0 + i)), acc[r][i]);
            }
        }
    }
}
