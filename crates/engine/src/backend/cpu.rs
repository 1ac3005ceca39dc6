//! The CPU backend: a persistent thread pool and runtime-dispatched SIMD kernels.
//!
//! Parallel ops split the *output rows* of a weight matrix across threads, so each thread streams its own
//! slice of the weights once per batch of tokens (prefill is a real GEMM: the micro-kernel keeps up to four
//! tokens' accumulators live while a weight block is loaded once). Small element-wise ops run on the calling
//! thread: at SmolLM2's width (576) dispatching them would cost more than they do.

pub mod gdn;
pub mod ops;
pub mod pool;
pub mod qmatmul;
pub mod rows;
pub mod simd;

use super::batch::Batch;
use super::pages::{Gathered, PagePool};
use pool::ThreadPool;
use qmatmul::{QActs, QMatrix};
pub use simd::Isa;

/// The CPU device.
#[derive(Debug)]
pub struct Cpu {
    pool: ThreadPool,
    isa: Isa,
    /// Attention with bf16 products ([`Cpu::set_bf16_attention`]).
    bf16_attention: std::sync::atomic::AtomicBool,
}

/// Raw pointer wrapper so disjoint output ranges can be written from several threads.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint ranges of one buffer to pool threads, which finish before the buffer's
// borrow ends (ThreadPool::run joins them).
#[expect(unsafe_code, reason = "disjoint parallel writes")]
unsafe impl Send for SendPtr {}
// SAFETY: as above.
#[expect(unsafe_code, reason = "disjoint parallel writes")]
unsafe impl Sync for SendPtr {}

impl Cpu {
    /// A backend with `threads` threads (0 = one per physical core) and the best ISA of this machine.
    pub fn new(threads: usize) -> Self {
        Self::with_isa(threads, Isa::detect())
    }

    /// A backend restricted to `isa` (tests compare ISAs); the scalar kernels where this CPU cannot run
    /// `isa`'s.
    pub fn with_isa(threads: usize, isa: Isa) -> Self {
        let isa = if isa.supported() { isa } else { Isa::Scalar };
        let threads = if threads == 0 {
            default_threads()
        } else {
            threads
        };
        Cpu {
            pool: ThreadPool::new(threads),
            isa,
            bf16_attention: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Runs attention with bf16 products (f32 sums and softmax; see `simd::AttnKernels`) or f32 ones; bf16
    /// only where this CPU has them at the backend's ISA (AVX-512 BF16). Returns whether bf16 is now on.
    /// Set it before the KV cache is filled: a token's bits follow the kernels that computed its context.
    pub fn set_bf16_attention(&self, on: bool) -> bool {
        let on = simd::AttnKernels::new(self.isa, on).bf16;
        self.bf16_attention
            .store(on, std::sync::atomic::Ordering::Relaxed);
        on
    }

    /// The kernels attention runs.
    pub fn attn_kernels(&self) -> simd::AttnKernels {
        simd::AttnKernels {
            isa: self.isa,
            bf16: self
                .bf16_attention
                .load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// The kernels' instruction set.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Threads, the caller included.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Quantizes `n` rows of `cols` activations for [`Cpu::matmul`].
    pub fn quantize(&self, x: &[f32], n: usize, cols: usize, out: &mut QActs) {
        simd::quantize(self.isa, x, n, cols, out);
    }

    /// `out[t * w.rows + r] = W[r] · x[t]` for all tokens of `x` (`xf` is the float input, used by f32 weights).
    pub fn matmul(&self, w: &QMatrix, x: &QActs, xf: &[f32], out: &mut [f32]) {
        assert!(out.len() >= x.n * w.rows, "matmul output too small");
        let isa = self.isa;
        let ptr = SendPtr(out.as_mut_ptr());
        let len = out.len();
        self.pool.for_ranges(w.rows, 16, &|rows| {
            let p = ptr;
            #[expect(unsafe_code, reason = "disjoint parallel writes")]
            // SAFETY: every thread gets a disjoint row range and writes only out[t * w.rows + r] for r in its
            // range; `out` outlives the call because for_ranges joins all threads before returning.
            let out = unsafe { std::slice::from_raw_parts_mut(p.0, len) };
            simd::matmul(isa, w, x, xf, rows, out);
        });
    }

    /// Causal attention for every token of `batch` in `layer`, reading the KV pages (which must already
    /// hold the batch's own tokens). `q` and `out` are `tokens * n_heads * head_dim`; `partials` is scratch.
    ///
    /// Work items are (tile of tokens, KV head, block of [`ATTENTION_SPLIT`] positions): the query heads of a
    /// GQA group share every key and value load, and so do the up to [`simd::MAX_TILE`] consecutive tokens
    /// of a tile (a prefill chunk's; a draft tree's tokens share the prefix they all see in place, then
    /// read their own branches one by one); long contexts spread over every
    /// thread even for one token (as in flash-decoding), and the blocks' partial softmax states are merged
    /// afterwards in a fixed order. Each item walks its sequence's page table, one contiguous run of keys
    /// and values per page. A token's result is the same bits whatever its tile, split or batch.
    #[expect(
        clippy::too_many_arguments,
        reason = "attention needs its shape spelled out"
    )]
    pub fn attention(
        &self,
        pool: &PagePool,
        layer: usize,
        batch: &Batch,
        q: &[f32],
        q_stride: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        out: &mut [f32],
        partials: &mut Vec<f32>,
        tiles: &mut Vec<(usize, usize, bool)>,
    ) {
        let kernels = self.attn_kernels();
        let scale = 1.0 / (head_dim as f32).sqrt();
        let group = n_heads / n_kv_heads;
        let ps = pool.page_size();
        assert!(
            group <= simd::MAX_GROUP && head_dim <= simd::MAX_HEAD_DIM,
            "attention shape outside the kernels' limits (the model loader rejects such models)"
        );
        let n = batch.len();
        let items = n * n_kv_heads;
        let longest = batch
            .seqs
            .iter()
            .map(|s| s.start + s.len)
            .max()
            .unwrap_or(0);
        // Fixed blocks of positions, whatever the batch or the thread count, so a token's result never
        // depends on what it was batched with (greedy output is the same with or without prefix reuse or
        // batching). Blocks past a token's own length are empty and merge as nothing.
        let splits = longest.div_ceil(ATTENTION_SPLIT).max(1);
        let stride = group * (head_dim + 2);
        partials.clear();
        partials.resize(items * splits * stride, 0.0);
        // Tiles of tokens: a sequence's run of tokens whose positions are all in place (a prefill chunk,
        // a decode step) in tiles of up to MAX_TILE consecutive tokens, which share every key and value
        // row they read; a draft tree's tokens in tiles too, which share the rows of the prefix they all
        // see in place (each then reads its own branch alone).
        tiles.clear();
        for span in &batch.seqs {
            let rows = span.first..span.first + span.len;
            let in_place = rows
                .clone()
                .all(|t| batch.position(t) < batch.direct[t] as usize);
            for a in rows.clone().step_by(simd::MAX_TILE) {
                tiles.push((a, (a + simd::MAX_TILE).min(rows.end), in_place));
            }
        }
        let ptr = SendPtr(partials.as_mut_ptr());
        let tasks = tiles.len() * n_kv_heads * splits;
        let tiles = &tiles[..];
        self.pool.for_ranges(tasks, 1, &|range| {
            let p = ptr;
            for i in range {
                let (tile, rest) = (i / (n_kv_heads * splits), i % (n_kv_heads * splits));
                let (kvh, split) = (rest / splits, rest % splits);
                let (t0, t1, in_place) = tiles[tile];
                let nt = t1 - t0;
                let mut parts: [simd::PartialAttn<'_>; simd::MAX_TILE] =
                    std::array::from_fn(|_| simd::PartialAttn {
                        m: &mut [],
                        l: &mut [],
                        o: &mut [],
                    });
                for (t, part) in (t0..t1).zip(&mut parts) {
                    let at = ((t * n_kv_heads + kvh) * splits + split) * stride;
                    #[expect(unsafe_code, reason = "disjoint parallel writes")]
                    // SAFETY: the partial state of (token t, KV head kvh, split) is written only by the
                    // one task that holds t's tile, kvh and split; these ranges are disjoint, inside
                    // `partials`, and the pool joins before the borrow of `partials` ends.
                    let buf = unsafe { std::slice::from_raw_parts_mut(p.0.add(at), stride) };
                    let (ml, o) = buf.split_at_mut(2 * group);
                    let (m, l) = ml.split_at_mut(group);
                    m.fill(f32::NEG_INFINITY);
                    l.fill(0.0);
                    o.fill(0.0);
                    *part = simd::PartialAttn { m, l, o };
                }
                let (span, _) = batch.locate(t0);
                let pages = batch.pages(span);
                let first = (split * ATTENTION_SPLIT).max(batch.attend_from);
                let end_of = |t: usize| ((split + 1) * ATTENTION_SPLIT).min(batch.position(t) + 1);
                let qg = |t: usize| &q[t * q_stride + kvh * group * head_dim..][..group * head_dim];
                if nt > 1 && in_place {
                    // Consecutive positions in place: token ends grow along the tile, so the tokens that
                    // see a page are a suffix of it.
                    let mut qs = [&[][..]; simd::MAX_TILE];
                    let mut ends = [0usize; simd::MAX_TILE];
                    for (j, t) in (t0..t1).enumerate() {
                        qs[j] = qg(t);
                        ends[j] = end_of(t);
                    }
                    let last = ends[nt - 1];
                    let mut at = first;
                    while at < last {
                        let base = at / ps * ps;
                        let from = ends[..nt].partition_point(|&e| e <= at);
                        let mut rel = [0usize; simd::MAX_TILE];
                        for (r, &e) in rel[from..nt].iter_mut().zip(&ends[from..nt]) {
                            *r = e.min(base + ps) - base;
                        }
                        let page = pages[at / ps];
                        simd::attend_tile(
                            kernels,
                            &qs[from..nt],
                            head_dim,
                            pool.keys(page, layer, kvh),
                            pool.values(page, layer, kvh),
                            at - base,
                            &rel[from..nt],
                            scale,
                            &mut parts[from..nt],
                        );
                        at = last.min(base + ps);
                    }
                    continue;
                }
                // A draft tree's tile: every token sees the pages below `shared` in place, so those go
                // through the tile kernel once for all of them, page by page as each token alone would walk
                // them (the same blocks, so the same bits); then each token its own rest.
                let shared = (t0..t1)
                    .map(|t| (batch.direct[t] as usize).min(batch.position(t) + 1))
                    .min()
                    .unwrap_or(0)
                    / ps
                    * ps;
                let shared = shared.min((split + 1) * ATTENTION_SPLIT);
                let mut own_from = first;
                if nt > 1 && first < shared {
                    let mut qs = [&[][..]; simd::MAX_TILE];
                    for (j, t) in (t0..t1).enumerate() {
                        qs[j] = qg(t);
                    }
                    let mut at = first;
                    while at < shared {
                        let base = at / ps * ps;
                        let rel = [shared.min(base + ps) - base; simd::MAX_TILE];
                        let page = pages[at / ps];
                        simd::attend_tile(
                            kernels,
                            &qs[..nt],
                            head_dim,
                            pool.keys(page, layer, kvh),
                            pool.values(page, layer, kvh),
                            at - base,
                            &rel[..nt],
                            scale,
                            &mut parts[..nt],
                        );
                        at = shared.min(base + ps);
                    }
                    own_from = shared;
                }
                for (j, t) in (t0..t1).enumerate() {
                    let part = &mut parts[j];
                    let (m, l, o) = (&mut *part.m, &mut *part.l, &mut *part.o);
                    let direct = batch.direct[t] as usize;
                    let range = own_from.min(batch.position(t) + 1)..end_of(t);
                    let qg = qg(t);
                    let mut at = range.start;
                    while at < range.end {
                        let base = at / ps * ps;
                        let end = range.end.min(base + ps);
                        let part = simd::PartialAttn {
                            m: &mut *m,
                            l: &mut *l,
                            o: &mut *o,
                        };
                        if end <= direct {
                            let page = pages[at / ps];
                            // The next page on into L2 while this one is read: pages are a few
                            // kilobytes each, scattered, too short for the hardware prefetchers (a
                            // decode step at depth 4096 gained ~12%; a prefill tile, compute-bound,
                            // nothing).
                            if end < range.end && range.end <= direct {
                                let next = pages[at / ps + 1];
                                simd::prefetch(pool.keys(next, layer, kvh));
                                simd::prefetch(pool.values(next, layer, kvh));
                            }
                            simd::attend_group(
                                kernels,
                                qg,
                                head_dim,
                                pool.keys(page, layer, kvh),
                                pool.values(page, layer, kvh),
                                at - base..end - base,
                                scale,
                                part,
                            );
                        } else {
                            // A draft-tree node whose ancestors are not all in place: gather the page's
                            // positions as it sees them and make the same kernel call on them.
                            GATHER.with_borrow_mut(|(gk, gv)| {
                                let row = |p: usize| {
                                    let s = batch.slot_seen(t, base + p);
                                    (pages[s / ps], s % ps)
                                };
                                let keys = gk.gather(head_dim, end - base, |p| {
                                    let (pg, r) = row(p);
                                    (pool.keys(pg, layer, kvh), r)
                                });
                                let values = gv.gather(head_dim, end - base, |p| {
                                    let (pg, r) = row(p);
                                    (pool.values(pg, layer, kvh), r)
                                });
                                simd::attend_group(
                                    kernels,
                                    qg,
                                    head_dim,
                                    keys,
                                    values,
                                    at - base..end - base,
                                    scale,
                                    part,
                                );
                            });
                        }
                        at = end;
                    }
                }
            }
        });
        for item in 0..items {
            let (t, kvh) = (item / n_kv_heads, item % n_kv_heads);
            let parts = &partials[item * splits * stride..(item + 1) * splits * stride];
            let dst = &mut out[(t * n_heads + kvh * group) * head_dim
                ..(t * n_heads + (kvh + 1) * group) * head_dim];
            simd::merge_partials(parts, splits, head_dim, dst);
        }
    }
}

thread_local! {
    /// Per-thread buffers for draft-tree rows gathered out of place (keys, values).
    static GATHER: std::cell::RefCell<(Gathered, Gathered)> = std::cell::RefCell::default();
}

/// Positions per attention work item (a multiple of every page size that divides it).
pub const ATTENTION_SPLIT: usize = 256;

/// Physical cores (logical CPUs when that cannot be told).
pub fn default_threads() -> usize {
    let logical = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    // Linux: count distinct (physical id, core id) pairs.
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = std::collections::HashSet::new();
    let mut phys = "";
    for line in info.lines() {
        if let Some(v) = line.strip_prefix("physical id") {
            phys = v.trim_start_matches([' ', '\t', ':']);
        } else if let Some(v) = line.strip_prefix("core id") {
            cores.insert((
                phys.to_owned(),
                v.trim_start_matches([' ', '\t', ':']).to_owned(),
            ));
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

#[cfg(test)]
mod tests;

impl Cpu {
    /// `out[t * f + j] = silu(gate) * up` for each token `t < n` of `gu` (rows of `[gate f | up f]`), the
    /// elements split across threads (each is [`simd::silu_mul`]'s, so the split changes no bits).
    pub fn swiglu_rows(&self, gu: &[f32], n: usize, f: usize, out: &mut [f32]) {
        assert!(gu.len() >= n * 2 * f && out.len() >= n * f, "swiglu shape");
        let ptr = SendPtr(out.as_mut_ptr());
        self.pool.for_ranges(n * f, 64, &|range| {
            let p = ptr;
            let mut i = range.start;
            while i < range.end {
                let (t, j) = (i / f, i % f);
                let len = (f - j).min(range.end - i);
                let row = &gu[t * 2 * f..(t + 1) * 2 * f];
                #[expect(unsafe_code, reason = "disjoint parallel writes")]
                // SAFETY: `i..i + len` is inside `out` (asserted above) and inside this thread's range,
                // which no other thread writes; the pool joins before `out`'s borrow ends.
                let dst = unsafe { std::slice::from_raw_parts_mut(p.0.add(i), len) };
                simd::silu_mul(&row[j..j + len], &row[f + j..f + j + len], dst);
                i += len;
            }
        });
    }

    /// Runs `f` over `0..n` split into one contiguous range per thread (multiples of `align`).
    pub fn for_ranges(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        self.pool.for_ranges(n, align, f);
    }

    /// `out[t * stride + offset + r] = f(r, t)` for `r < rows`, `t < n`, rows split across threads.
    pub fn map_rows(
        &self,
        rows: usize,
        n: usize,
        stride: usize,
        offset: usize,
        out: &mut [f32],
        f: &(dyn Fn(usize, usize) -> f32 + Sync),
    ) {
        assert!(
            n == 0 || (n - 1) * stride + offset + rows <= out.len(),
            "map_rows output too small"
        );
        let ptr = SendPtr(out.as_mut_ptr());
        self.pool.for_ranges(rows, 1, &|range| {
            let p = ptr;
            for r in range {
                for t in 0..n {
                    #[expect(unsafe_code, reason = "disjoint parallel writes")]
                    // SAFETY: the index is in bounds (asserted above) and each (r, t) is written by exactly one
                    // thread, since row ranges are disjoint; the pool joins before `out`'s borrow ends.
                    unsafe {
                        *p.0.add(t * stride + offset + r) = f(r, t);
                    }
                }
            }
        });
    }
}
