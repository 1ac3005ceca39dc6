//! The attention KV cache: fixed-size pages under a memory budget, a radix tree of cached prefixes over
//! them, and one page table per running sequence.
//!
//! * [`PagePool`] (the device's page storage, `crate::backend::pages`): every page of KV memory allocated
//!   once (`--kv-memory`), handed out by refcount. A page holds `page_size` positions of one sequence for
//!   all layers and heads. The cache fills a [`Batch`] with its tables for each forward pass.
//! * [`radix`]: the [`RadixTree`] of token runs whose KV is still in memory. A new request reuses the
//!   longest cached prefix of its tokens (whole pages by reference, a partly matching page by copy), so an
//!   agent loop that resends the whole conversation each turn only prefills the new turn.
//! * [`fp8`] (`crate::backend::fp8`): the E4M3 format of `--kv-dtype fp8`, with a power-of-two scale per (page, layer, KV head).
//!
//! [`KvCache`] ties them together with the calls a scheduler needs: [`KvCache::acquire`] a sequence for a
//! prompt (prefix reuse), [`KvCache::reserve`] pages before a forward pass (evicting least recently used
//! cached prefixes when memory is short, and failing cleanly when even that is not enough, so the
//! scheduler can preempt), [`KvCache::commit`] a running sequence's full pages to the tree so concurrent
//! requests share them, and [`KvCache::release`] it when done, leaving its tokens cached.
//!
//! Invariants (checked by the property tests): a page's refcount is the number of tree nodes and sequence
//! tables that hold it; a page in the tree is never written (a sequence only writes pages it alone owns:
//! [`KvCache::reserve`] copies a shared partly filled page first); a free page is in no table.

pub mod radix;
pub mod state;

pub use crate::backend::batch::{Batch, Logits, NO_PARENT, SeqSpan};
pub use crate::backend::fp8;
pub use crate::backend::pages::{Gathered, KvDtype, KvShape, KvSlice, PageId, PagePool, RowMove};
pub use radix::{PrefixMatch, RadixTree};
pub use state::{PrefixHash, Recurrent, SnapshotStats, Snapshots};

use crate::backend::{Device, DeviceError};
use crate::tokenizer::TokenId;
use thiserror::Error;

impl Batch {
    /// Adds `tokens` of `seq`, to be written at positions `seq.len()..`; the sequence must have pages for
    /// them ([`KvCache::reserve`]).
    pub fn push(&mut self, seq: &SeqKv, tokens: &[TokenId], logits: Logits) {
        assert!(
            seq.pages.len() * seq.page_size >= seq.len + tokens.len(),
            "no pages reserved for the batch"
        );
        let span = SeqSpan {
            table: self.table.len(),
            pages: seq.pages.len(),
            start: seq.len,
            first: self.tokens.len(),
            len: tokens.len(),
        };
        self.owner
            .extend(std::iter::repeat_n(self.seqs.len() as u32, tokens.len()));
        let first = self.tokens.len() as u32;
        self.pos
            .extend((0..tokens.len()).map(|i| (seq.len + i) as u32));
        self.parent.extend(
            (0..tokens.len() as u32).map(|i| if i == 0 { NO_PARENT } else { first + i - 1 }),
        );
        self.direct
            .extend(std::iter::repeat_n(u32::MAX, tokens.len()));
        self.table.extend_from_slice(&seq.pages);
        self.tokens.extend_from_slice(tokens);
        self.seqs.push(span);
        self.logits.push(logits);
    }

    /// Adds a token tree of `seq`: token `i` follows token `parents[i]` of this call ([`NO_PARENT`]: the
    /// sequence's last position) and sees only the sequence's KV and its own ancestors. Token `i` is stored
    /// at slot `seq.len() + i` but sits at position `seq.len() + depth`. Parents come before their children;
    /// a first child placed right after its parent (depth-first order) keeps its rows in place, so a
    /// chain costs no gathering. Pages must be reserved for `tokens.len()` slots.
    pub fn push_tree(&mut self, seq: &SeqKv, tokens: &[TokenId], parents: &[u32], logits: Logits) {
        assert_eq!(tokens.len(), parents.len(), "one parent per tree token");
        let first = self.tokens.len();
        self.push(seq, tokens, logits);
        let start = seq.len as u32;
        for (i, &p) in parents.iter().enumerate() {
            let t = first + i;
            let (pos, parent_direct, parent) = if p == NO_PARENT {
                (start, u32::MAX, NO_PARENT)
            } else {
                assert!((p as usize) < i, "a tree token's parent comes before it");
                let pt = first + p as usize;
                (self.pos[pt] + 1, self.direct[pt], pt as u32)
            };
            let slot = start + i as u32;
            self.pos[t] = pos;
            self.parent[t] = parent;
            self.direct[t] = if parent_direct != u32::MAX {
                parent_direct
            } else if slot != pos {
                pos
            } else {
                u32::MAX
            };
        }
    }
}

/// One sequence's view of the cache: its page table and how many positions hold KV.
#[derive(Debug)]
pub struct SeqKv {
    pages: Vec<PageId>,
    len: usize,
    page_size: usize,
    /// Positions that came from the prefix cache when it was acquired.
    hit: usize,
    /// Where the prompt left the cached tokens (a hybrid model snapshots its state there).
    branch: usize,
    /// Recurrent state (hybrid models).
    pub rec: Recurrent,
}

impl SeqKv {
    /// Positions holding KV.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position holds KV.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions served from the prefix cache when the sequence started.
    pub fn hit(&self) -> usize {
        self.hit
    }

    /// Its page table.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// Marks `n` more positions as written (after a forward pass wrote them).
    pub fn advance(&mut self, n: usize) {
        assert!(
            self.len + n <= self.pages.len() * self.page_size,
            "advance past the reserved pages"
        );
        self.len += n;
    }
}

/// Why pages could not be had.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum KvError {
    /// Every page is in use by running sequences, even after evicting every cached prefix.
    #[error("KV cache memory is full: {need} more pages needed, {free} free of {total}")]
    OutOfPages {
        /// Pages the request needed.
        need: usize,
        /// Pages free.
        free: usize,
        /// Pages in the pool.
        total: usize,
    },
}

/// How to size and run the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// Element type.
    pub dtype: KvDtype,
    /// Positions per page.
    pub page_size: usize,
    /// Memory budget in bytes (rounded down to whole pages).
    pub memory: usize,
    /// Whether finished sequences leave their generated tokens in the tree too (not only their prompt).
    pub cache_output: bool,
    /// Bytes of `memory` set aside for recurrent-state snapshots (hybrid models; ignored otherwise).
    pub state_memory: usize,
    /// A hybrid model snapshots its state every this many positions of a long prefill.
    pub snapshot_interval: usize,
    /// The chat template's message-start token: a hybrid model snapshots its state before the last two of
    /// a prompt (where the next request's prompt is likely to diverge).
    pub turn_token: Option<TokenId>,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            dtype: KvDtype::F16,
            page_size: Self::PAGE_SIZE,
            memory: 0,
            cache_output: true,
            state_memory: 0,
            snapshot_interval: Self::SNAPSHOT_INTERVAL,
            turn_token: None,
        }
    }
}

impl KvConfig {
    /// Default positions per page. Attention walks one page per kernel call, and on CPU each call's fixed
    /// cost shows: decode at depth 2000 measured 61, 65 and 73 tok/s with pages of 16, 32 and 64 positions
    /// (SmolLM2, 2 threads). Prefix hits stay token-exact at any size (a partly matching page is copied).
    pub const PAGE_SIZE: usize = 64;

    /// Default spacing of snapshots in long prefills (positions).
    pub const SNAPSHOT_INTERVAL: usize = 2048;
}

/// Counters of the cache (the stats endpoint and benchmarks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Pages in the pool.
    pub pages_total: usize,
    /// Pages referenced by anything.
    pub pages_used: usize,
    /// Pages held by the prefix tree.
    pub pages_cached: usize,
    /// Nodes in the prefix tree.
    pub nodes: usize,
    /// Positions per page.
    pub page_size: usize,
    /// Bytes per page.
    pub page_bytes: usize,
    /// Sequences acquired.
    pub sequences: u64,
    /// Prompt tokens served from the cache.
    pub hit_tokens: u64,
    /// Tokens computed by forward passes (prefill and decode).
    pub computed_tokens: u64,
    /// Tree nodes evicted.
    pub evicted_nodes: u64,
    /// Pages freed by eviction.
    pub evicted_pages: u64,
    /// Recurrent-state snapshots (hybrid models).
    pub snapshots: SnapshotStats,
}

/// The paged KV cache with its prefix tree.
#[derive(Debug)]
pub struct KvCache {
    pool: PagePool,
    tree: RadixTree,
    cfg: KvConfig,
    stats: KvStats,
    snaps: Snapshots,
    /// The row moves of [`KvCache::keep_path`], reused.
    moves: Vec<RowMove>,
}

impl KvCache {
    /// A cache for a model of `shape`, sized by `cfg.memory` (at least one page). For a hybrid model
    /// (`shape.recurrent > 0`) `cfg.state_memory` of it holds state snapshots and the rest KV pages.
    pub fn new(shape: KvShape, cfg: KvConfig) -> Self {
        match Self::build(None, shape, cfg) {
            Ok(kv) => kv,
            Err(e) => unreachable!("host memory: {e}"),
        }
    }

    /// The cache with its page pool in `dev`'s memory (see [`PagePool::on`]).
    pub fn on(dev: &Device, shape: KvShape, cfg: KvConfig) -> Result<Self, DeviceError> {
        Self::build(Some(dev), shape, cfg)
    }

    fn build(dev: Option<&Device>, shape: KvShape, cfg: KvConfig) -> Result<Self, DeviceError> {
        let page_size = cfg.page_size.max(1);
        let page_bytes = PagePool::page_bytes(shape, page_size, cfg.dtype);
        let state_memory = if shape.recurrent > 0 {
            cfg.state_memory.min(cfg.memory)
        } else {
            0
        };
        let n_pages = ((cfg.memory - state_memory) / page_bytes).max(1);
        let pool = match dev {
            Some(dev) => PagePool::on(dev, shape, page_size, cfg.dtype, n_pages)?,
            None => PagePool::new(shape, page_size, cfg.dtype, n_pages),
        };
        Ok(KvCache {
            pool,
            tree: RadixTree::new(page_size),
            cfg: KvConfig {
                page_size,
                state_memory,
                snapshot_interval: cfg.snapshot_interval.max(1),
                ..cfg
            },
            stats: KvStats {
                page_size,
                page_bytes,
                ..KvStats::default()
            },
            snaps: Snapshots::new(shape.recurrent, state_memory),
            moves: Vec::new(),
        })
    }

    /// Whether sequences carry recurrent state (a hybrid model).
    pub fn is_hybrid(&self) -> bool {
        self.pool.shape().recurrent > 0
    }

    /// The page pool (the forward pass reads and writes pages here).
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// The page pool, mutably.
    pub fn pool_mut(&mut self) -> &mut PagePool {
        &mut self.pool
    }

    /// Its configuration.
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    /// Positions the whole pool can hold.
    pub fn capacity(&self) -> usize {
        self.pool.total() * self.pool.page_size()
    }

    /// Current counters.
    pub fn stats(&self) -> KvStats {
        KvStats {
            pages_total: self.pool.total(),
            pages_used: self.pool.total() - self.pool.free(),
            pages_cached: self.tree.pages(),
            nodes: self.tree.nodes(),
            snapshots: self.snaps.stats(),
            ..self.stats
        }
    }

    /// Counts `n` tokens computed by a forward pass.
    pub fn count_computed(&mut self, n: usize) {
        self.stats.computed_tokens += n as u64;
    }

    /// Takes a free page, evicting cached prefixes if none is free.
    fn alloc(&mut self) -> Option<PageId> {
        if self.pool.free() == 0 {
            let e = self.tree.evict(&mut self.pool, 1);
            self.stats.evicted_nodes += e.nodes as u64;
            self.stats.evicted_pages += e.pages as u64;
        }
        self.pool.alloc()
    }

    /// Starts a sequence for `prompt`, reusing the longest cached prefix of it (never the whole prompt: the
    /// last token is always computed, since its logits are needed). The sequence then holds KV for
    /// positions `0..seq.len()` of the prompt.
    pub fn acquire(&mut self, prompt: &[TokenId]) -> SeqKv {
        let m = self
            .tree
            .match_prefix(&mut self.pool, prompt, prompt.len().saturating_sub(1));
        let mut seq = SeqKv {
            pages: m.pages,
            len: m.len,
            page_size: self.pool.page_size(),
            hit: 0,
            branch: 0,
            rec: Recurrent::default(),
        };
        if let Some((src, n)) = m.partial {
            // Keep the source alive while a page is found: eviction could otherwise free and reuse it.
            self.pool.retain(src);
            if let Some(dst) = self.alloc() {
                self.pool.copy(src, dst, n);
                seq.pages.push(dst);
                seq.len += n;
            }
            self.pool.release(src);
        }
        if self.is_hybrid() {
            // The KV alone is not enough: resume from the deepest state snapshot it covers.
            seq.branch = seq.len;
            seq.rec = Recurrent::zeros(self.pool.shape().recurrent);
            let (p, key) = self.snaps.deepest(prompt, seq.len);
            if p > 0
                && let Some(state) = self.snaps.restore(&key)
            {
                seq.rec.state = state;
                seq.rec.len = p;
            }
            let p = seq.rec.len;
            self.truncate(&mut seq, p);
        }
        seq.hit = seq.len;
        self.stats.sequences += 1;
        self.stats.hit_tokens += seq.len as u64;
        seq
    }

    /// Makes sure `seq` owns pages for positions up to `len`, and that the page it writes next is its own
    /// (copying it first if it is shared). On failure the sequence keeps what it had and nothing leaks.
    pub fn reserve(&mut self, seq: &mut SeqKv, len: usize) -> Result<(), KvError> {
        let ps = self.pool.page_size();
        let need = len.div_ceil(ps);
        if need > seq.pages.len() {
            // Whether the pool could ever satisfy this, counting what eviction can free.
            let want = need - seq.pages.len();
            if self.pool.free() < want {
                let e = self.tree.evict(&mut self.pool, want);
                self.stats.evicted_nodes += e.nodes as u64;
                self.stats.evicted_pages += e.pages as u64;
            }
            let cow = !seq.len.is_multiple_of(ps) && self.pool.refs(seq.pages[seq.len / ps]) > 1;
            if self.pool.free() < want + usize::from(cow) {
                return Err(KvError::OutOfPages {
                    need: want + usize::from(cow),
                    free: self.pool.free(),
                    total: self.pool.total(),
                });
            }
        }
        if !seq.len.is_multiple_of(ps) && seq.len < len {
            let i = seq.len / ps;
            let page = seq.pages[i];
            if self.pool.refs(page) > 1 {
                let dst = self.alloc().ok_or(KvError::OutOfPages {
                    need: 1,
                    free: 0,
                    total: self.pool.total(),
                })?;
                self.pool.copy(page, dst, seq.len % ps);
                self.pool.release(page);
                seq.pages[i] = dst;
            }
        }
        while seq.pages.len() < need {
            let p = self.alloc().ok_or(KvError::OutOfPages {
                need: need - seq.pages.len(),
                free: 0,
                total: self.pool.total(),
            })?;
            seq.pages.push(p);
        }
        Ok(())
    }

    /// Forgets positions `len..` of `seq` (rejected draft tokens, a diverged prompt), releasing whole pages
    /// past the new end.
    ///
    /// A hybrid sequence's recurrent state cannot be cut back: it is rolled back to a step kept by the last
    /// speculative pass, and a position with no kept step is a bug (the caller restores a copy instead).
    pub fn truncate(&mut self, seq: &mut SeqKv, len: usize) {
        if len >= seq.len {
            return;
        }
        if self.is_hybrid() && seq.rec.len != len {
            assert!(
                seq.rec.roll_back_to(len),
                "recurrent state cannot go back to position {len}"
            );
        }
        seq.len = len;
        let keep = len.div_ceil(self.pool.page_size());
        for p in seq.pages.drain(keep..) {
            self.pool.release(p);
        }
    }

    /// Keeps the accepted path of a draft tree stored from slot `start` (tree node `k` at slot `start + k`):
    /// `path[i]` is the node at depth `i` (increasing, as parents precede children). Each row moves into
    /// place and positions past the path are forgotten.
    ///
    /// On a hybrid model the draft is a chain (`path[i] == i`) and the state rolls back to the step kept
    /// after its last accepted token.
    pub fn keep_path(&mut self, seq: &mut SeqKv, start: usize, path: &[usize]) {
        let ps = self.pool.page_size();
        debug_assert!(
            !self.is_hybrid() || path.iter().enumerate().all(|(i, &k)| i == k),
            "hybrid models verify chains"
        );
        self.moves.clear();
        for (i, &k) in path.iter().enumerate() {
            let (s, d) = (start + k, start + i);
            assert!(s >= d && s < seq.len, "path slots out of order");
            if s != d {
                let slot = |p: usize| (p % ps) as u32;
                self.moves
                    .push([seq.pages[s / ps], slot(s), seq.pages[d / ps], slot(d)]);
            }
        }
        // One batch (one kernel on a GPU): no move reads a row an earlier one wrote, as each reads a
        // slot at or past its own destination, and the destinations before it are below that.
        self.pool.move_rows(&self.moves);
        self.truncate(seq, start + path.len());
    }

    /// Puts the full pages of a running sequence into the tree (`tokens` are the tokens at positions
    /// `0..seq.len()`), so requests that share them reuse them while it runs.
    pub fn commit(&mut self, seq: &SeqKv, tokens: &[TokenId]) {
        let full = seq.len / self.pool.page_size() * self.pool.page_size();
        assert!(tokens.len() >= full, "fewer tokens than cached positions");
        self.tree
            .insert(&mut self.pool, &tokens[..full], &seq.pages);
        self.snapshot(seq, tokens);
    }

    /// Keeps a copy of a hybrid sequence's recurrent state as the state after `tokens[..seq.len()]`
    /// (nothing for attention-only models, or if the state is not the one for that position).
    pub fn snapshot(&mut self, seq: &SeqKv, tokens: &[TokenId]) {
        if !self.is_hybrid() || seq.rec.len != seq.len || seq.len == 0 || tokens.len() < seq.len {
            return;
        }
        self.snaps
            .put(PrefixHash::of(&tokens[..seq.len]), &seq.rec.state);
    }

    /// Whether a hybrid sequence should snapshot its state after position `p` of `tokens` (its prompt or
    /// history): every [`KvConfig::snapshot_interval`] positions, at the branch point where it left the
    /// cached tokens, and before either of the last two turn-start tokens.
    pub fn snapshot_point(&self, seq: &SeqKv, tokens: &[TokenId], p: usize) -> bool {
        self.is_hybrid() && self.is_point(seq, self.last_turns(tokens), p)
    }

    /// Where a prefill chunk over `tokens[from..to]` should end: `to`, or the first snapshot point before it.
    pub fn chunk_end(&self, seq: &SeqKv, tokens: &[TokenId], from: usize, to: usize) -> usize {
        if !self.is_hybrid() {
            return to;
        }
        let turns = self.last_turns(tokens);
        (from + 1..to)
            .find(|&p| self.is_point(seq, turns, p))
            .unwrap_or(to)
    }

    /// Positions of the last two turn-start tokens of `tokens`.
    fn last_turns(&self, tokens: &[TokenId]) -> [Option<usize>; 2] {
        let mut out = [None; 2];
        if let Some(turn) = self.cfg.turn_token {
            let mut it = tokens.iter().rposition(|&t| t == turn);
            out[0] = it;
            if let Some(i) = it.take() {
                out[1] = tokens[..i].iter().rposition(|&t| t == turn);
            }
        }
        out
    }

    fn is_point(&self, seq: &SeqKv, turns: [Option<usize>; 2], p: usize) -> bool {
        p > 0
            && (p.is_multiple_of(self.cfg.snapshot_interval)
                || (p == seq.branch && p > seq.hit)
                || turns.contains(&Some(p)))
    }

    /// Ends a sequence. With `tokens` (the tokens at positions `0..seq.len()`), its KV stays in the tree
    /// for later requests; without, its pages are just released.
    /// A hybrid sequence also leaves a snapshot of its final state (the next turn of a conversation
    /// extends exactly these tokens).
    pub fn release(&mut self, seq: SeqKv, tokens: Option<&[TokenId]>) {
        if let Some(t) = tokens {
            let n = seq.len.min(t.len());
            if n > 0 {
                self.tree.insert(&mut self.pool, &t[..n], &seq.pages);
                self.snapshot(&seq, t);
            }
        }
        for p in seq.pages {
            self.pool.release(p);
        }
    }

    /// Empties the prefix tree (pages held by running sequences stay).
    pub fn clear(&mut self) {
        self.snaps.clear();
        let e = self.tree.clear(&mut self.pool);
        self.stats.evicted_nodes += e.nodes as u64;
        self.stats.evicted_pages += e.pages as u64;
    }

    /// The prefix tree (tests).
    #[cfg(test)]
    pub(crate) fn tree(&self) -> &RadixTree {
        &self.tree
    }
}

#[cfg(test)]
mod tests;
