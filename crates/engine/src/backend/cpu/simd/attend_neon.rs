//! The NEON attention row kernels: f16 and E4M3 rows converted with `fcvtl`, four-lane dot products and
//! their reduction tree, the scores and value passes, as [`RowKernels`] for the shared row driver (the
//! x86 AVX2 kernels' structure in 4-lane vectors).

use super::Isa;
use super::row_kernel::{Active, QRow, RowKernels, Rows, Src, attend_rows_with};
use std::arch::aarch64::*;

/// The NEON row kernels (every aarch64 CPU).
pub(super) struct Neon;

impl RowKernels for Neon {
    type Vec = float32x4_t;
    type Scale = f32;
    const LANES: usize = 4;
    const ISA: Isa = Isa::Neon;

    #[inline(always)]
    unsafe fn scale(x: f32) -> f32 {
        x
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
        dst: *mut float32x4_t,
        rows: Rows,
        at: usize,
        block: usize,
    ) {
        // SAFETY: the caller keeps the positions inside `rows` and `dst` for `block * V` vectors.
        unsafe {
            for j in 0..block {
                for p in 0..V / 2 {
                    let h = load8::<FP8>(rows, (at + j) * 4 * V + 8 * p);
                    dst.add(j * V + 2 * p).write(h[0]);
                    dst.add(j * V + 2 * p + 1).write(h[1]);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn scores<const V: usize, const N: usize, const FP8: bool>(
        q: [*const f32; N],
        keys: Src<float32x4_t>,
        n: usize,
        ks: f32,
        s: [*mut f32; N],
    ) {
        // SAFETY: the caller's contract is the kernel's.
        unsafe { scores_n::<V, N, FP8>(q, keys, n, ks, s) }
    }

    /// Two rows at a time, 32 lanes per pass.
    #[inline(always)]
    unsafe fn values<const V: usize, const FP8: bool>(
        rows: Active<'_>,
        a: usize,
        n: usize,
        vals: Src<float32x4_t>,
    ) {
        // SAFETY: the caller's contract is the kernel's; c0 + 8 <= V (V is a multiple of 8).
        unsafe {
            for c0 in (0..V).step_by(8) {
                macro_rules! pass {
                    ($n:literal) => {
                        values_n::<V, $n, FP8>(
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

/// The row driver on NEON, `head_dim == 4 * V`: scores four rows at a time, eight dot products per
/// reduction ([`scores_n`]); then the outputs two rows at a time, 32 lanes per pass, in registers while
/// the value vectors stream past.
///
/// # Safety
/// [`super::row_kernel::attend_rows`]' contract (NEON is in every aarch64 CPU).
pub(super) unsafe fn attend_rows_neon<const V: usize, const FP8: bool>(
    rows: &[QRow],
    keys: Rows,
    values: Rows,
    start: usize,
    scale: f32,
) {
    // SAFETY: the caller's contract is the driver's.
    unsafe { attend_rows_with::<Neon, V, FP8>(rows, keys, values, start, scale) }
}

/// Eight elements of `rows` from element `at` as f32 (E4M3 times 2^-8, before `rows.scale`; see
/// `backend::fp8`): `fcvtl` of f16, or of E4M3 moved into f16's bit positions.
///
/// # Safety
/// `at + 8` is within the `rows.len` elements behind `rows.ptr`.
#[inline(always)]
unsafe fn load8<const FP8: bool>(rows: Rows, at: usize) -> [float32x4_t; 2] {
    // SAFETY: the caller's contract.
    unsafe {
        let h = if FP8 {
            let b = vmovl_u8(vld1_u8(rows.ptr.add(at)));
            let sign = vshlq_n_u16::<8>(vandq_u16(b, vdupq_n_u16(0x80)));
            let mag = vshlq_n_u16::<7>(vandq_u16(b, vdupq_n_u16(0x7f)));
            vorrq_u16(sign, mag)
        } else {
            vld1q_u16(rows.ptr.add(2 * at).cast())
        };
        [
            vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))),
            vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h))),
        ]
    }
}

impl Src<float32x4_t> {
    /// Vectors `2p` and `2p + 1` (of `V`) of row `j` of the block.
    ///
    /// # Safety
    /// Row `j` is inside the block (staged) or the page (direct), and `2p + 1 < V`.
    #[inline(always)]
    unsafe fn pair<const V: usize, const FP8: bool>(self, j: usize, p: usize) -> [float32x4_t; 2] {
        // SAFETY: the caller's contract.
        unsafe {
            if self.staged.is_null() {
                load8::<FP8>(self.rows, (self.at + j) * 4 * V + 8 * p)
            } else {
                let s = self.staged.add(j * V + 2 * p);
                [*s, *s.add(1)]
            }
        }
    }
}

/// Scores of `N` (1 to 4) query rows against the block's keys `0..n`, times `ks`, into `s[r][..n]`: each
/// key vector loaded once for all `N` rows, `8 / N` keys of each row per reduction. A score is `q[0] k[0]`,
/// then a fused multiply-add per vector in order, then the lanes' tree `(x0 + x1) + (x2 + x3)` (two
/// `faddp`), whatever `N`.
///
/// # Safety
/// Each `q[r]` is valid for `4V` floats, `s[r]` for `n`, and `keys` for `n` rows.
unsafe fn scores_n<const V: usize, const N: usize, const FP8: bool>(
    q: [*const f32; N],
    keys: Src<float32x4_t>,
    n: usize,
    ks: f32,
    s: [*mut f32; N],
) {
    // SAFETY: the caller's contract.
    unsafe {
        let k = 8 / N;
        let mut c = 0;
        while c < n {
            let m = (n - c).min(k);
            let mut acc = [vdupq_n_f32(0.0); 8];
            for p in 0..V / 2 {
                let qv: [[float32x4_t; 2]; N] = std::array::from_fn(|r| {
                    [vld1q_f32(q[r].add(8 * p)), vld1q_f32(q[r].add(8 * p + 4))]
                });
                for j in 0..m {
                    let kv = keys.pair::<V, FP8>(c + j, p);
                    for (r, qr) in qv.iter().enumerate() {
                        let a = &mut acc[r * k + j];
                        *a = if p == 0 {
                            vmulq_f32(qr[0], kv[0])
                        } else {
                            vfmaq_f32(*a, qr[0], kv[0])
                        };
                        *a = vfmaq_f32(*a, qr[1], kv[1]);
                    }
                }
            }
            let tree = |a: &[float32x4_t]| {
                vmulq_n_f32(
                    vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])),
                    ks,
                )
            };
            let mut t = [0f32; 8];
            vst1q_f32(t.as_mut_ptr(), tree(&acc[..4]));
            vst1q_f32(t.as_mut_ptr().add(4), tree(&acc[4..]));
            for (r, sr) in s.iter().enumerate() {
                for j in 0..m {
                    *sr.add(c + j) = t[r * k + j];
                }
            }
            c += k;
        }
    }
}

/// The value pass of `N` (1 or 2) rows over output vectors `c0..c0 + 8`: each row's outputs (rescaled by
/// its `corr`) stay in registers while the block's value vectors stream past, each loaded once for both
/// rows; row `r` adds `p[r][j] * v[j]` for its own `j < count[r]` only, in order of `j`.
///
/// # Safety
/// Each `o[r]` is valid for `4V` floats, `p[r]` for `count[r]`, `vals` for `max(count)` rows, and
/// `c0 + 8 <= V`.
#[expect(
    clippy::needless_range_loop,
    reason = "index loops: iterator adapters over vectors are not inlined into SIMD code"
)]
unsafe fn values_n<const V: usize, const N: usize, const FP8: bool>(
    o: [*mut f32; N],
    p: [*const f32; N],
    count: [usize; N],
    corr: [f32; N],
    vals: Src<float32x4_t>,
    c0: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc: [[float32x4_t; 8]; N] = std::array::from_fn(|r| {
            std::array::from_fn(|i| vmulq_n_f32(vld1q_f32(o[r].add(4 * (c0 + i))), corr[r]))
        });
        let all = count.iter().copied().min().unwrap_or(0);
        let n = count.iter().copied().max().unwrap_or(0);
        let row = |j: usize| -> [float32x4_t; 8] {
            let h: [[float32x4_t; 2]; 4] =
                std::array::from_fn(|i| vals.pair::<V, FP8>(j, c0 / 2 + i));
            std::array::from_fn(|i| h[i / 2][i % 2])
        };
        for j in 0..all {
            let v = row(j);
            for r in 0..N {
                let pv = *p[r].add(j);
                for i in 0..8 {
                    acc[r][i] = vfmaq_n_f32(acc[r][i], v[i], pv);
                }
            }
        }
        for j in all..n {
            let v = row(j);
            for r in 0..N {
                if j < count[r] {
                    let pv = *p[r].add(j);
                    for i in 0..8 {
                        acc[r][i] = vfmaq_n_f32(acc[r][i], v[i], pv);
                    }
                }
            }
        }
        for r in 0..N {
            for i in 0..8 {
                vst1q_f32(o[r].add(4 * (c0 + i)), acc[r][i]);
            }
        }
    }
}
