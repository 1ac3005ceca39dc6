//! The SIMD attention row kernels' shared part: the rows they take ([`QRow`], [`Rows`]), which pages and
//! heads they handle ([`kernel_rows`]), the dispatch by ISA and head width ([`attend_rows`]), and the row
//! driver, written once ([`attend_rows_with`]) over [`RowKernels`]: an ISA's vector type and inner
//! kernels (AVX-512 in `attend_avx512`, AVX2 in `attend_avx2`, NEON in `attend_neon`).

use super::Isa;
#[cfg(target_arch = "x86_64")]
use super::attend_avx2::attend_rows_avx2;
#[cfg(target_arch = "x86_64")]
use super::attend_avx512::attend_rows_avx512;
#[cfg(target_arch = "x86_64")]
use super::attend_bf16::attend_rows_bf16;
#[cfg(target_arch = "aarch64")]
use super::attend_neon::attend_rows_neon;
use super::attention::{AttnKernels, GROUP_CHUNK, MAX_GROUP, MAX_TILE, PartialAttn, softmax_step};
use crate::backend::pages::KvSlice;
use std::mem::MaybeUninit;

/// Rows of keys or values for the row kernels: f16 elements, or E4M3 bytes with a scale to apply.
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub(super) ptr: *const u8,
    /// Elements.
    pub(super) len: usize,
    /// Multiplies every decoded element (1 for f16; 256 * the page scale for E4M3).
    pub(super) scale: f32,
}

/// One query row of the row kernels ([`attend_rows_with`]): a (token, head)'s query (`head_dim` floats),
/// its softmax state (`m`, `l`, `head_dim` floats of `o`), and the end (exclusive, in positions of the page) of what it sees.
#[derive(Clone, Copy)]
pub(super) struct QRow {
    pub(super) q: *const f32,
    pub(super) m: *mut f32,
    pub(super) l: *mut f32,
    pub(super) o: *mut f32,
    pub(super) end: usize,
}

impl QRow {
    pub(super) const NONE: QRow = QRow {
        q: std::ptr::null(),
        m: std::ptr::null_mut(),
        l: std::ptr::null_mut(),
        o: std::ptr::null_mut(),
        end: 0,
    };

    /// The rows of one token's query group `q` (`q.len() / hd` heads) and its state `part`, seeing up to
    /// `end`, into `out`'s first slots.
    pub(super) fn group(
        q: &[f32],
        hd: usize,
        part: &mut PartialAttn<'_>,
        end: usize,
        out: &mut [QRow],
    ) {
        let g = q.len() / hd;
        assert!(part.m.len() >= g && part.l.len() >= g && part.o.len() >= g * hd && out.len() >= g);
        let (m, l, o) = (
            part.m.as_mut_ptr(),
            part.l.as_mut_ptr(),
            part.o.as_mut_ptr(),
        );
        for (h, row) in out[..g].iter_mut().enumerate() {
            *row = QRow {
                q: q[h * hd..].as_ptr(),
                m: m.wrapping_add(h),
                l: l.wrapping_add(h),
                o: o.wrapping_add(h * hd),
                end,
            };
        }
    }
}

/// Most query rows one call of a row kernel takes (a tile's tokens times a group's heads).
pub(super) const MAX_ROWS: usize = MAX_TILE * MAX_GROUP;

/// The row kernels' view of a page's keys and values, when they have a form for them: 32-, 64- or 128-wide
/// heads over f16 or FP8 pages on an AVX-512, AVX2 or NEON machine. `(keys, values, fp8)`.
pub(super) fn kernel_rows(
    isa: Isa,
    hd: usize,
    keys: KvSlice<'_>,
    values: KvSlice<'_>,
) -> Option<(Rows, Rows, bool)> {
    if isa == Isa::Scalar || !matches!(hd, 32 | 64 | 128) {
        return None;
    }
    match (keys, values) {
        (KvSlice::F16(k), KvSlice::F16(v)) => {
            let rows = |s: &[half::f16]| Rows {
                ptr: s.as_ptr().cast::<u8>(),
                len: s.len(),
                scale: 1.0,
            };
            Some((rows(k), rows(v), false))
        }
        (KvSlice::Fp8 { data: k, scale: ks }, KvSlice::Fp8 { data: v, scale: vs }) => {
            // The f16 route decodes E4M3 times 2^-8 (see backend::fp8); the 256 goes into the scales.
            let rows = |s: &[u8], sc: f32| Rows {
                ptr: s.as_ptr(),
                len: s.len(),
                scale: sc * 256.0,
            };
            Some((rows(k, ks), rows(v, vs), true))
        }
        _ => None,
    }
}

/// Runs [`attend_rows_bf16`] (bf16 products), [`attend_rows_avx512`] or [`attend_rows_avx2`] for
/// `hd`-wide rows (which [`kernel_rows`] accepted).
///
/// # Safety
/// `kernels` were detected; every row's pointers are valid for its `hd`-float query and output and its
/// `m`/`l`, no two rows share state, and no row's `end` is past the rows of `keys`/`values` (the kernels
/// assert that last part).
#[cfg(target_arch = "x86_64")]
#[expect(
    clippy::too_many_arguments,
    reason = "attention needs its shape spelled out"
)]
pub(super) unsafe fn attend_rows(
    kernels: AttnKernels,
    hd: usize,
    rows: &[QRow],
    keys: Rows,
    values: Rows,
    fp8: bool,
    start: usize,
    scale: f32,
) {
    // SAFETY: the caller's contract is the kernels'.
    unsafe {
        if kernels.bf16 {
            match (hd, fp8) {
                (32, false) => attend_rows_bf16::<1, 2, false>(rows, keys, values, start, scale),
                (64, false) => attend_rows_bf16::<2, 4, false>(rows, keys, values, start, scale),
                (128, false) => attend_rows_bf16::<4, 8, false>(rows, keys, values, start, scale),
                (32, true) => attend_rows_bf16::<1, 2, true>(rows, keys, values, start, scale),
                (64, true) => attend_rows_bf16::<2, 4, true>(rows, keys, values, start, scale),
                (128, true) => attend_rows_bf16::<4, 8, true>(rows, keys, values, start, scale),
                _ => unreachable!("kernel_rows accepts 32-, 64- and 128-wide heads"),
            }
            return;
        }
        match (kernels.isa, hd, fp8) {
            (Isa::Avx512Vnni, 32, false) => {
                attend_rows_avx512::<2, false>(rows, keys, values, start, scale)
            }
            (Isa::Avx512Vnni, 64, false) => {
                attend_rows_avx512::<4, false>(rows, keys, values, start, scale)
            }
            (Isa::Avx512Vnni, 128, false) => {
                attend_rows_avx512::<8, false>(rows, keys, values, start, scale)
            }
            (Isa::Avx512Vnni, 32, true) => {
                attend_rows_avx512::<2, true>(rows, keys, values, start, scale)
            }
            (Isa::Avx512Vnni, 64, true) => {
                attend_rows_avx512::<4, true>(rows, keys, values, start, scale)
            }
            (Isa::Avx512Vnni, 128, true) => {
                attend_rows_avx512::<8, true>(rows, keys, values, start, scale)
            }
            (Isa::Avx2, 32, false) => {
                attend_rows_avx2::<4, false>(rows, keys, values, start, scale)
            }
            (Isa::Avx2, 64, false) => {
                attend_rows_avx2::<8, false>(rows, keys, values, start, scale)
            }
            (Isa::Avx2, 128, false) => {
                attend_rows_avx2::<16, false>(rows, keys, values, start, scale)
            }
            (Isa::Avx2, 32, true) => attend_rows_avx2::<4, true>(rows, keys, values, start, scale),
            (Isa::Avx2, 64, true) => attend_rows_avx2::<8, true>(rows, keys, values, start, scale),
            (Isa::Avx2, 128, true) => {
                attend_rows_avx2::<16, true>(rows, keys, values, start, scale)
            }
            _ => {
                unreachable!("kernel_rows accepts 32-, 64- and 128-wide heads on AVX-512 and AVX2")
            }
        }
    }
}

/// Runs [`attend_rows_neon`] for `hd`-wide rows (which [`kernel_rows`] accepted).
///
/// # Safety
/// As for the x86 `attend_rows`: every row's pointers are valid for its `hd`-float query and output and its
/// `m`/`l`, no two rows share state, and no row's `end` is past the rows of `keys`/`values` (the kernel
/// asserts that last part).
#[cfg(target_arch = "aarch64")]
#[expect(
    clippy::too_many_arguments,
    reason = "attention needs its shape spelled out"
)]
pub(super) unsafe fn attend_rows(
    kernels: AttnKernels,
    hd: usize,
    rows: &[QRow],
    keys: Rows,
    values: Rows,
    fp8: bool,
    start: usize,
    scale: f32,
) {
    debug_assert!(kernels.isa.is_neon() && !kernels.bf16);
    // SAFETY: the caller's contract is the kernel's.
    unsafe {
        match (hd, fp8) {
            (32, false) => attend_rows_neon::<8, false>(rows, keys, values, start, scale),
            (64, false) => attend_rows_neon::<16, false>(rows, keys, values, start, scale),
            (128, false) => attend_rows_neon::<32, false>(rows, keys, values, start, scale),
            (32, true) => attend_rows_neon::<8, true>(rows, keys, values, start, scale),
            (64, true) => attend_rows_neon::<16, true>(rows, keys, values, start, scale),
            (128, true) => attend_rows_neon::<32, true>(rows, keys, values, start, scale),
            _ => unreachable!("kernel_rows accepts 32-, 64- and 128-wide heads"),
        }
    }
}

/// Where a kernel reads a block's key or value rows: converted on the stack (`staged`, shared by many
/// rows), or straight from the page (few rows: no stores, half the cache footprint). Either way a row is
/// the same f32 vectors, so the choice changes no bits. Each ISA reads it with its own vectors `T`.
#[derive(Clone, Copy)]
pub(super) struct Src<T> {
    /// The page's rows (read when `staged` is null), from position `at`.
    pub(super) rows: Rows,
    pub(super) at: usize,
    /// Converted rows of the block, `V` vectors each, or null.
    pub(super) staged: *const T,
}

/// The rows of a block that a value pass takes: row `a` is query row `rows[active[a]]`, its weights
/// (`count[a]` of them) at `scores + a * GROUP_CHUNK`, its output's rescale factor `corr[a]`.
#[derive(Clone, Copy)]
pub(super) struct Active<'a> {
    rows: &'a [QRow],
    active: &'a [usize; MAX_ROWS],
    count: &'a [usize; MAX_ROWS],
    corr: &'a [f32; MAX_ROWS],
    scores: *const f32,
}

impl Active<'_> {
    /// Row `a`'s output.
    #[inline(always)]
    pub(super) fn o(&self, a: usize) -> *mut f32 {
        self.rows[self.active[a]].o
    }

    /// Row `a`'s weights.
    #[inline(always)]
    pub(super) fn p(&self, a: usize) -> *const f32 {
        self.scores.wrapping_add(a * GROUP_CHUNK)
    }

    /// How many of the block's positions row `a` sees.
    #[inline(always)]
    pub(super) fn count(&self, a: usize) -> usize {
        self.count[a]
    }

    /// The factor row `a`'s output is rescaled by before the block's values are added.
    #[inline(always)]
    pub(super) fn corr(&self, a: usize) -> f32 {
        self.corr[a]
    }
}

/// What differs between the ISAs in the row driver [`attend_rows_with`]: the vector type and the inner
/// kernels on it. The methods are `#[inline(always)]` in every implementation and the driver is inlined
/// into each ISA's `#[target_feature]` entry point, so the whole walk is compiled for that ISA.
///
/// # Safety
/// Implementations are only called from their ISA's entry point, on a CPU that has the ISA.
pub(super) trait RowKernels {
    /// The f32 vector (`LANES` floats) a key or value row is converted to.
    type Vec: Copy;
    /// The score scale as the scores kernel takes it (a broadcast vector, or a float).
    type Scale: Copy;
    /// Floats per vector: a `head_dim`-wide row is `V` vectors, `head_dim == LANES * V`.
    const LANES: usize;
    /// The ISA whose [`softmax_step`] the driver runs.
    const ISA: Isa;

    /// `x` as the scores kernel takes it.
    ///
    /// # Safety
    /// The ISA is there.
    unsafe fn scale(x: f32) -> Self::Scale;

    /// Whether a call of `rows` rows reads the page's rows directly rather than staging them.
    fn direct<const V: usize>(rows: usize) -> bool;

    /// Most rows one value pass ([`RowKernels::values`]) takes.
    fn value_rows<const V: usize>() -> usize;

    /// Converts rows `at..at + block` (positions) of `rows` onto the stack at `dst`, `V` vectors a row.
    ///
    /// # Safety
    /// The positions are inside `rows`; `dst` has room for `block * V` vectors.
    unsafe fn stage<const V: usize, const FP8: bool>(
        dst: *mut Self::Vec,
        rows: Rows,
        at: usize,
        block: usize,
    );

    /// Scores of `N` (1 to 4) query rows `q` against the block's keys `0..n`, times `ks`, into `s[r][..n]`.
    /// A score's bits must not depend on `N` or on which rows share the call.
    ///
    /// # Safety
    /// Each `q[r]` is valid for `LANES * V` floats, `s[r]` for `n`, and `keys` for `n` rows.
    unsafe fn scores<const V: usize, const N: usize, const FP8: bool>(
        q: [*const f32; N],
        keys: Src<Self::Vec>,
        n: usize,
        ks: Self::Scale,
        s: [*mut f32; N],
    );

    /// The value pass of rows `a..a + n` of `rows` (`n` at most [`RowKernels::value_rows`]): each output
    /// times its `corr`, plus its weights times the block's value rows, in order of position. A row's
    /// bits must not depend on which rows share the pass.
    ///
    /// # Safety
    /// Each row's output is valid for `LANES * V` floats and its weights for its count; `vals` holds the
    /// largest count's rows.
    unsafe fn values<const V: usize, const FP8: bool>(
        rows: Active<'_>,
        a: usize,
        n: usize,
        vals: Src<Self::Vec>,
    );
}

/// The rows of `rows` that see position `at` (their end is past it): their indices into `active`, how many
/// of the block's positions from `at` each sees into `count`; returns how many rows.
pub(super) fn active_rows(
    rows: &[QRow],
    at: usize,
    active: &mut [usize; MAX_ROWS],
    count: &mut [usize; MAX_ROWS],
) -> usize {
    let mut na = 0;
    for (r, row) in rows.iter().enumerate() {
        if row.end > at {
            active[na] = r;
            count[na] = (row.end - at).min(GROUP_CHUNK);
            na += 1;
        }
    }
    na
}

/// The softmax step of a block for every active row (row `rows[active[a]]`, its `count[a]` scores at
/// `scores + a * GROUP_CHUNK`, turned into weights in place and then multiplied by `value_scale`), each
/// row's output rescale factor into `corr[a]`. Every attention walk (the f32 row driver, the bf16 kernel)
/// runs this one step.
///
/// # Safety
/// Each active row's `m`/`l` are valid and its own; `scores` holds `active.len()` rows of
/// [`GROUP_CHUNK`] floats, the first `count[a]` of row `a` written.
pub(super) unsafe fn softmax_rows(
    isa: Isa,
    rows: &[QRow],
    active: &[usize],
    count: &[usize; MAX_ROWS],
    scores: *mut f32,
    value_scale: f32,
    corr: &mut [f32; MAX_ROWS],
) {
    for (a, &r) in active.iter().enumerate() {
        let row = rows[r];
        // softmax_step, not a many-lane version: with one (tried on AVX-512, not landed) the FP8 accuracy
        // test (`engine::fp8_kv_cache_stays_close_to_f32`) went from 0.50-0.57 to 0.94-1.01 nats of top-10
        // log-probability error and lost the first token on 1-2 of 8 prompts, which a change of summation
        // order alone should not do; until that is understood the kernels keep the arithmetic the test
        // holds. The weights then carry the value scale.
        // SAFETY: the caller's contract: the row's scores and state are valid and not shared.
        let (sl, m, l) = unsafe {
            (
                std::slice::from_raw_parts_mut(scores.add(a * GROUP_CHUNK), count[a]),
                &mut *row.m,
                &mut *row.l,
            )
        };
        corr[a] = softmax_step(isa, m, l, sl);
        if value_scale != 1.0 {
            sl.iter_mut().for_each(|x| *x *= value_scale);
        }
    }
}

/// Floats of the stack's converted key (or value) rows of one block: [`GROUP_CHUNK`] rows of the widest
/// head the row kernels take.
const STAGED: usize = GROUP_CHUNK * 128;

/// A block's converted key or value rows, aligned for any ISA's vectors.
#[repr(C, align(64))]
struct Staged([MaybeUninit<f32>; STAGED]);

/// Attention of any number of query rows (a tile's tokens times a GQA group's heads, or one token's group)
/// over one page's f16 or E4M3 keys and values, `head_dim == K::LANES * V`, on the ISA of `K`; each row
/// attends `start..row.end` in blocks of [`GROUP_CHUNK`] positions from `start`.
///
/// Per block: scores come up to four rows at a time with a key row's loads shared and several dot products
/// reduced at once ([`RowKernels::scores`]), the softmax step is [`softmax_step`] (the weights then times
/// the value scale), and outputs stay in registers while the value rows stream past, a few rows at a time
/// ([`RowKernels::values`]). With few rows (a decode step's group) keys and values are converted as they
/// are read; with more (a tile) each key and value row is converted once onto the stack for all of them. A
/// row's arithmetic is the same either way and whichever rows share the call, so a token's bits do not
/// depend on its tile.
///
/// # Safety
/// Called from `K`'s ISA entry point (the CPU has it), with [`attend_rows`]' contract.
#[inline(always)]
pub(super) unsafe fn attend_rows_with<K: RowKernels, const V: usize, const FP8: bool>(
    rows: &[QRow],
    keys: Rows,
    values: Rows,
    start: usize,
    scale: f32,
) {
    let hd = K::LANES * V;
    let last = rows.iter().map(|r| r.end).max().unwrap_or(start);
    assert!(hd <= STAGED / GROUP_CHUNK);
    assert!(rows.len() <= MAX_ROWS && last * hd <= keys.len && last * hd <= values.len);
    let direct = K::direct::<V>(rows.len());
    // SAFETY: positions below `last` are inside `keys`/`values` (asserted above); the caller keeps each
    // row's pointers valid and disjoint. The stack buffers (room for `GROUP_CHUNK` rows of `hd`, asserted)
    // are written before they are read: keys and values up to the block (when staged), scores up to each
    // row's count.
    unsafe {
        let ks = K::scale(scale * keys.scale);
        let mut kf = Staged([MaybeUninit::uninit(); STAGED]);
        let mut vf = Staged([MaybeUninit::uninit(); STAGED]);
        let mut scores = [MaybeUninit::<f32>::uninit(); GROUP_CHUNK * MAX_ROWS];
        let (kp, vp) = (
            kf.0.as_mut_ptr().cast::<K::Vec>(),
            vf.0.as_mut_ptr().cast::<K::Vec>(),
        );
        let sbase = scores.as_mut_ptr().cast::<f32>();
        let sp = |a: usize| sbase.add(a * GROUP_CHUNK);
        let mut active = [0usize; MAX_ROWS];
        let mut count = [0usize; MAX_ROWS];
        let mut corr = [0f32; MAX_ROWS];
        let mut at = start;
        while at < last {
            let block = (last - at).min(GROUP_CHUNK);
            let na = active_rows(rows, at, &mut active, &mut count);
            let src = |r: Rows, staged: *mut K::Vec| Src {
                rows: r,
                at,
                staged: if direct { std::ptr::null() } else { staged },
            };
            let (ksrc, vsrc) = (src(keys, kp), src(values, vp));
            if !direct {
                K::stage::<V, FP8>(kp, keys, at, block);
            }
            let mut a = 0;
            while a < na {
                let n = (na - a).min(4);
                macro_rules! scores {
                    ($n:literal) => {
                        K::scores::<V, $n, FP8>(
                            std::array::from_fn(|r| rows[active[a + r]].q),
                            ksrc,
                            block,
                            ks,
                            std::array::from_fn(|r| sp(a + r)),
                        )
                    };
                }
                match n {
                    1 => scores!(1),
                    2 => scores!(2),
                    3 => scores!(3),
                    _ => scores!(4),
                }
                a += n;
            }
            softmax_rows(
                K::ISA,
                rows,
                &active[..na],
                &count,
                sbase,
                values.scale,
                &mut corr,
            );
            if !direct {
                K::stage::<V, FP8>(vp, values, at, block);
            }
            let act = Active {
                rows,
                active: &active,
                count: &count,
                corr: &corr,
                scores: sbase.cast_const(),
            };
            let mut a = 0;
            while a < na {
                let n = (na - a).min(K::value_rows::<V>());
                K::values::<V, FP8>(act, a, n, vsrc);
                a += n;
            }
            at += block;
        }
    }
}
