//! Attention over one page of the KV cache: the entry points ([`attend_group`] for one token's query group,
//! [`attend_tile`] for several tokens), the online-softmax state and its merge, and the portable path
//! (float dot products and `axpy`) for what the SIMD row kernels ([`super::row_kernel`]) do not take.

#[cfg(target_arch = "aarch64")]
use super::neon;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use super::row_kernel::{MAX_ROWS, QRow, attend_rows, kernel_rows};
use super::vector::{axpy, exp_sub, max};
use super::{Isa, dot_f32, dot4_f32};
use crate::backend::pages::KvSlice;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};

/// Keys per block of the grouped attention kernel (scores for a block live on the stack).
pub(super) const GROUP_CHUNK: usize = 64;
/// Most query heads sharing one KV head that the grouped kernel handles (models with more are rejected at
/// load).
pub const MAX_GROUP: usize = 16;
/// Largest head width the attention kernels handle.
pub const MAX_HEAD_DIM: usize = 256;

/// The kernels an attention call runs: `isa`'s, with f32 products, or with bf16 products where `bf16` is
/// set (AVX-512 BF16's `vdpbf16ps`, `attend_bf16`; only on such a CPU: see [`AttnKernels::new`]). Every
/// call of one engine uses the same, so a token's bits do not depend on its tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnKernels {
    /// The instruction set.
    pub isa: Isa,
    /// 16-bit products (bf16 queries, keys, values and weights; f32 sums and softmax).
    pub bf16: bool,
}

impl AttnKernels {
    /// `isa`'s kernels, with bf16 products if `bf16` is asked for and this CPU has them at `isa`.
    pub fn new(isa: Isa, bf16: bool) -> Self {
        AttnKernels {
            isa,
            bf16: bf16 && Self::has_bf16(isa),
        }
    }

    /// Whether this CPU runs the bf16 kernels at `isa` (AVX-512 with BF16).
    pub fn has_bf16(isa: Isa) -> bool {
        #[cfg(target_arch = "x86_64")]
        return isa == Isa::Avx512Vnni && super::attend_bf16::supported();
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = isa;
            false
        }
    }

    /// Every choice this machine has: each ISA's f32 kernels, and the bf16 ones where there are (tests).
    pub fn available() -> Vec<AttnKernels> {
        let mut all: Vec<AttnKernels> = Isa::available().into_iter().map(Self::from).collect();
        all.extend(
            Isa::available()
                .into_iter()
                .filter(|&i| Self::has_bf16(i))
                .map(|i| AttnKernels::new(i, true)),
        );
        all
    }
}

impl From<Isa> for AttnKernels {
    fn from(isa: Isa) -> Self {
        AttnKernels { isa, bf16: false }
    }
}

/// Online-softmax state of `G` query heads over part of the positions: running max `m`, denominator `l`
/// and the unnormalised output `o` (`G * head_dim`). [`merge_partials`] combines several.
#[derive(Debug)]
pub struct PartialAttn<'a> {
    /// Running max per head.
    pub m: &'a mut [f32],
    /// Running denominator per head.
    pub l: &'a mut [f32],
    /// Unnormalised output, `G * head_dim`.
    pub o: &'a mut [f32],
}

/// Attends the `q.len() / head_dim` query heads of one KV group to positions `range` of `keys`/`values`,
/// updating `part`. Keys are loaded once for the whole group; exponentials are vectorised per block.
#[expect(
    clippy::too_many_arguments,
    reason = "attention needs its shape spelled out"
)]
pub fn attend_group(
    kernels: AttnKernels,
    q: &[f32],
    hd: usize,
    keys: KvSlice<'_>,
    values: KvSlice<'_>,
    range: std::ops::Range<usize>,
    scale: f32,
    mut part: PartialAttn<'_>,
) {
    let isa = kernels.isa;
    let g = q.len() / hd;
    debug_assert!(g <= MAX_GROUP);
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    if let Some((k, v, fp8)) = kernel_rows(isa, hd, keys, values) {
        let mut rows = [QRow::NONE; MAX_GROUP];
        QRow::group(q, hd, &mut part, range.end, &mut rows);
        // SAFETY: a SIMD ISA was detected (kernel_rows; bf16 only where detected, AttnKernels::new); each
        // row points at its own head's query and state (QRow::group checks the lengths); the kernel
        // asserts that `range` is inside the page.
        unsafe { attend_rows(kernels, hd, &rows[..g], k, v, fp8, range.start, scale) };
        return;
    }
    let mut scores = [[0f32; GROUP_CHUNK]; MAX_GROUP];
    let mut kbuf = [0f32; MAX_HEAD_DIM];
    let mut start = range.start;
    while start < range.end {
        let len = (range.end - start).min(GROUP_CHUNK);
        for j in 0..len {
            let k = kv_row(keys, (start + j) * hd, hd, &mut kbuf);
            for (h, row) in scores[..g].iter_mut().enumerate() {
                row[j] = dot_f32(isa, &q[h * hd..(h + 1) * hd], k) * scale;
            }
        }
        for (h, row) in scores[..g].iter_mut().enumerate() {
            fold_scores(isa, &mut row[..len], h, hd, &mut part);
        }
        for j in 0..len {
            let v = kv_row(values, (start + j) * hd, hd, &mut kbuf);
            for (h, row) in scores[..g].iter().enumerate() {
                axpy(isa, row[j], v, &mut part.o[h * hd..(h + 1) * hd]);
            }
        }
        start += len;
    }
}

/// Folds a block of head `h`'s scores into its running softmax state: rescales what `part` holds to the
/// block's new max and turns the scores into their weights `exp(s - m)` (in place), adding them to the
/// denominator. [`attend_group`] and [`attend_tile`] share it, so a token gets the same bits either way.
fn fold_scores(isa: Isa, row: &mut [f32], h: usize, hd: usize, part: &mut PartialAttn<'_>) {
    let corr = softmax_step(isa, &mut part.m[h], &mut part.l[h], row);
    if corr != 1.0 {
        part.o[h * hd..(h + 1) * hd]
            .iter_mut()
            .for_each(|o| *o *= corr);
    }
}

/// The softmax state's part of [`fold_scores`]: moves the running max `m` to the block's, rescales the
/// denominator `l` to it and adds the block's weights `exp(s - m)` (written over the scores); returns the
/// factor the output must be rescaled by. Both row kernels call it too. The block's max comes from [`max`]
/// (vectorised; the same value as a scalar fold for NaN-free scores, so no bits move).
pub(super) fn softmax_step(isa: Isa, m: &mut f32, l: &mut f32, row: &mut [f32]) -> f32 {
    let cmax = max(isa, row);
    let new_m = m.max(cmax);
    let corr = (*m - new_m).exp();
    *m = new_m;
    *l = *l * corr + exp_sub(isa, row, new_m);
    corr
}

/// Most tokens [`attend_tile`] takes at once.
pub const MAX_TILE: usize = 8;

/// [`attend_group`] for several tokens of one sequence over one page (the rows of a prefill chunk): token
/// `i` attends positions `start..ends[i]` of `keys`/`values` with its query group `qs[i]`, updating
/// `parts[i]`. Each key and value row is converted and loaded once for all of them, and a key row's dot
/// products with the tokens' queries share its loads, four at a time; every token's state is bit for bit
/// what [`attend_group`] gives it alone (the same blocks of positions, the same operations in the same
/// order), so a token's result does not depend on being tiled.
#[expect(
    clippy::too_many_arguments,
    reason = "attention needs its shape spelled out"
)]
#[expect(
    clippy::needless_range_loop,
    reason = "a position indexes its key row and every token's scores"
)]
pub fn attend_tile(
    kernels: AttnKernels,
    qs: &[&[f32]],
    hd: usize,
    keys: KvSlice<'_>,
    values: KvSlice<'_>,
    start: usize,
    ends: &[usize],
    scale: f32,
    parts: &mut [PartialAttn<'_>],
) {
    let isa = kernels.isa;
    let nt = qs.len();
    assert!(nt <= MAX_TILE && ends.len() == nt && parts.len() == nt);
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    if nt > 1
        && let Some((k, v, fp8)) = kernel_rows(isa, hd, keys, values)
    {
        let g = qs[0].len() / hd;
        let mut rows = [QRow::NONE; MAX_ROWS];
        let mut n = 0;
        for ((q, &end), p) in qs.iter().zip(ends).zip(parts.iter_mut()) {
            if end > start {
                QRow::group(&q[..g * hd], hd, p, end, &mut rows[n..]);
                n += g;
            }
        }
        // SAFETY: a SIMD ISA was detected (kernel_rows; bf16 only where detected, AttnKernels::new); each
        // row points at its own token's and head's query and state (QRow::group checks the lengths); the
        // kernel asserts that every end is inside the page.
        unsafe { attend_rows(kernels, hd, &rows[..n], k, v, fp8, start, scale) };
        return;
    }
    if nt == 1 {
        for ((q, &end), p) in qs.iter().zip(ends).zip(parts.iter_mut()) {
            if end > start {
                let part = PartialAttn {
                    m: &mut *p.m,
                    l: &mut *p.l,
                    o: &mut *p.o,
                };
                attend_group(kernels, q, hd, keys, values, start..end, scale, part);
            }
        }
        return;
    }
    let g = qs[0].len() / hd;
    debug_assert!(g <= MAX_GROUP);
    let mut scores = [[[0f32; GROUP_CHUNK]; MAX_GROUP]; MAX_TILE];
    let mut kbuf = [0f32; MAX_HEAD_DIM];
    let last = ends.iter().copied().max().unwrap_or(start);
    let mut at = start;
    while at < last {
        let block = (last - at).min(GROUP_CHUNK);
        // Positions of this block each token sees (its own block of attend_group's walk).
        let mut lens = [0usize; MAX_TILE];
        for (l, &end) in lens.iter_mut().zip(ends) {
            *l = end.saturating_sub(at).min(GROUP_CHUNK);
        }
        // Scores: each key row once, against every (token, head) that sees it, four dot products per
        // load of the row.
        let mut pairs = [(0usize, 0usize); MAX_TILE * MAX_GROUP];
        for j in 0..block {
            let k = kv_row(keys, (at + j) * hd, hd, &mut kbuf);
            let mut np = 0;
            for (i, &l) in lens[..nt].iter().enumerate() {
                if j < l {
                    for h in 0..g {
                        pairs[np] = (i, h);
                        np += 1;
                    }
                }
            }
            let q = |(i, h): (usize, usize)| &qs[i][h * hd..(h + 1) * hd];
            let mut c = 0;
            while c + 4 <= np {
                let p = [pairs[c], pairs[c + 1], pairs[c + 2], pairs[c + 3]];
                let d = dot4_f32(isa, k, p.map(q));
                for (&(i, h), v) in p.iter().zip(d) {
                    scores[i][h][j] = v * scale;
                }
                c += 4;
            }
            for &(i, h) in &pairs[c..np] {
                scores[i][h][j] = dot_f32(isa, q((i, h)), k) * scale;
            }
        }
        for (i, part) in parts.iter_mut().enumerate() {
            let len = lens[i];
            if len == 0 {
                continue;
            }
            for (h, row) in scores[i][..g].iter_mut().enumerate() {
                fold_scores(isa, &mut row[..len], h, hd, part);
            }
        }
        for j in 0..block {
            let v = kv_row(values, (at + j) * hd, hd, &mut kbuf);
            for (i, part) in parts.iter_mut().enumerate() {
                if j < lens[i] {
                    for (h, row) in scores[i][..g].iter().enumerate() {
                        axpy(isa, row[j], v, &mut part.o[h * hd..(h + 1) * hd]);
                    }
                }
            }
        }
        at += block;
    }
}

/// Combines `splits` consecutive partial states of `g` heads (each `g * (hd + 2)` floats laid out as
/// `m[g] l[g] o[g * hd]`, the layout `Cpu::attention` writes) into normalised outputs in `out` (`g * hd`).
pub fn merge_partials(parts: &[f32], splits: usize, hd: usize, out: &mut [f32]) {
    let g = out.len() / hd;
    let stride = g * (hd + 2);
    for h in 0..g {
        let m = |p: usize| parts[p * stride + h];
        let l = |p: usize| parts[p * stride + g + h];
        let mx = (0..splits).fold(f32::NEG_INFINITY, |a, p| a.max(m(p)));
        let o = &mut out[h * hd..(h + 1) * hd];
        o.fill(0.0);
        let mut total = 0f32;
        for p in 0..splits {
            if l(p) == 0.0 {
                continue;
            }
            let w = (m(p) - mx).exp();
            total += l(p) * w;
            let src = &parts[p * stride + 2 * g + h * hd..][..hd];
            o.iter_mut().zip(src).for_each(|(a, b)| *a += w * b);
        }
        let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Asks for a page's keys or values to be brought into the L2 cache ahead of use. A hint only.
pub fn prefetch(s: KvSlice<'_>) {
    let (ptr, bytes) = match s {
        KvSlice::F32(d) => (d.as_ptr().cast::<u8>(), std::mem::size_of_val(d)),
        KvSlice::F16(d) => (d.as_ptr().cast::<u8>(), std::mem::size_of_val(d)),
        KvSlice::Fp8 { data, .. } => (data.as_ptr(), data.len()),
    };
    #[cfg(target_arch = "x86_64")]
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch never faults and reads nothing into the program; the address is inside `s`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(ptr.add(off).cast::<i8>()) };
    }
    #[cfg(target_arch = "aarch64")]
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch never faults and reads nothing into the program; the address is inside `s`.
        unsafe { neon::prefetch(ptr.add(off)) };
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (ptr, bytes);
}

/// Row `off..off + hd` of a KV slice as f32 (converted into `buf` for f16).
#[inline]
fn kv_row<'a>(
    s: KvSlice<'a>,
    off: usize,
    hd: usize,
    buf: &'a mut [f32; MAX_HEAD_DIM],
) -> &'a [f32] {
    match s {
        KvSlice::F32(d) => &d[off..off + hd],
        KvSlice::F16(d) => {
            half::slice::HalfFloatSliceExt::convert_to_f32_slice(&d[off..off + hd], &mut buf[..hd]);
            &buf[..hd]
        }
        KvSlice::Fp8 { data, scale } => {
            for (o, &b) in buf[..hd].iter_mut().zip(&data[off..off + hd]) {
                *o = crate::backend::fp8::e4m3_decode(b) * scale;
            }
            &buf[..hd]
        }
    }
}
