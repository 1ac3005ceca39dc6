//! The input of one forward pass, as the device sees it: the new tokens of several sequences, their page
//! tables, positions, draft-tree parents and which logits each wants. The KV cache fills it
//! (`kv::KvCache`, `Batch::push`); the models and the device's attention read it.

use super::pages::PageId;
use crate::tokenizer::TokenId;

/// Where one sequence's new tokens go in a batched forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// Index of its first page in [`Batch::table`].
    pub table: usize,
    /// Pages it has there.
    pub pages: usize,
    /// Position of its first new token.
    pub start: usize,
    /// Index of its first new token in [`Batch::tokens`].
    pub first: usize,
    /// New tokens.
    pub len: usize,
}

/// Which positions' logits a forward pass returns for a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's.
    Last,
    /// Every token's (`n * vocab`).
    All,
    /// The last `n` tokens' (a draft tree's nodes and the token before them).
    Tail(usize),
    /// None (prefilling a prefix).
    None,
}

/// The input of one forward pass: the new tokens of several sequences, their page tables and positions.
/// Built afresh each step into reused buffers.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    /// Every new token, sequence after sequence.
    pub tokens: Vec<TokenId>,
    /// Every sequence's page table, concatenated.
    pub table: Vec<PageId>,
    /// One span per sequence.
    pub seqs: Vec<SeqSpan>,
    /// Which logits each sequence wants.
    pub logits: Vec<Logits>,
    /// For each token, its sequence.
    pub owner: Vec<u32>,
    /// For each token, its position in its sequence: what RoPE and causality see. A chain's tokens sit at
    /// their position; a draft tree's nodes sit at `start + depth` while stored at `start + index`.
    pub pos: Vec<u32>,
    /// For each token of a tree span, its parent's index in the batch ([`NO_PARENT`]: the position before
    /// the span).
    pub parent: Vec<u32>,
    /// For each token, the first position whose KV row is not stored at its own slot (its ancestors from
    /// there on are found through [`Batch::parent`]); `u32::MAX` when every row it sees is in place.
    pub direct: Vec<u32>,
    /// Positions before this are not attended to (0; 1 for an MTP head, whose row at position `p` holds the
    /// pair (hidden `p − 1`, token `p`), so position 0 has none).
    pub attend_from: usize,
    /// Whether a sampler reads the logits rows' top-k candidates (a GPU then finds them where the rows
    /// are: [`Device::logit_top`](crate::backend::Device::logit_top)).
    pub top_candidates: bool,
}

/// [`Batch::parent`] of a tree's first tokens: they follow the sequence's last position.
pub const NO_PARENT: u32 = u32::MAX;

impl Batch {
    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.table.clear();
        self.seqs.clear();
        self.logits.clear();
        self.owner.clear();
        self.pos.clear();
        self.parent.clear();
        self.direct.clear();
        self.attend_from = 0;
        self.top_candidates = false;
    }

    /// The position (RoPE, causality) of token `t`.
    #[inline]
    pub fn position(&self, t: usize) -> usize {
        self.pos[t] as usize
    }

    /// The slot holding the KV of position `p` as token `t` sees it (`p <= position(t)`).
    pub fn slot_seen(&self, t: usize, p: usize) -> usize {
        if p < self.direct[t] as usize {
            return p;
        }
        let mut a = t;
        while self.pos[a] as usize > p {
            a = self.parent[a] as usize;
        }
        self.locate(a).1
    }

    /// Tokens in the batch.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Rows of logits the forward pass returns for sequence `i`.
    pub fn logit_rows(&self, i: usize) -> usize {
        match self.logits[i] {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All => self.seqs[i].len,
            Logits::Tail(n) => n.min(self.seqs[i].len),
        }
    }

    /// The batch rows whose logits sequence `i` wants (empty for [`Logits::None`]).
    pub fn logit_range(&self, i: usize) -> std::ops::Range<usize> {
        let span = &self.seqs[i];
        let end = span.first + span.len;
        end - self.logit_rows(i)..end
    }

    /// Calls `f` with the rows whose logits the batch wants, in batch order, each run of rows that follow
    /// each other (a decode step's, a prefill's) as one range.
    pub fn for_each_logit_run(&self, mut f: impl FnMut(std::ops::Range<usize>)) {
        let mut run: Option<std::ops::Range<usize>> = None;
        for i in 0..self.seqs.len() {
            for t in self.logit_range(i) {
                run = match run {
                    Some(r) if r.end == t => Some(r.start..t + 1),
                    Some(r) => {
                        f(r);
                        Some(t..t + 1)
                    }
                    None => Some(t..t + 1),
                };
            }
        }
        if let Some(r) = run {
            f(r);
        }
    }

    /// The sequence of token `t` and the slot its KV is written to (its position, for chains).
    #[inline]
    pub fn locate(&self, t: usize) -> (&SeqSpan, usize) {
        let s = &self.seqs[self.owner[t] as usize];
        (s, s.start + t - s.first)
    }

    /// The page table of `span`.
    #[inline]
    pub fn pages(&self, span: &SeqSpan) -> &[PageId] {
        &self.table[span.table..span.table + span.pages]
    }
}
