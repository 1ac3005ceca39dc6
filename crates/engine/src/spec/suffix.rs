//! Suffix drafting: what followed the context's suffix before is likely to follow it again.
//!
//! SuffixDecoding's idea (Oliaro et al., NeurIPS'25) on bytes instead of tokens. Agent loops repeat
//! themselves: tool results quote files, calls copy paths and values from the prompt, turns follow the same
//! shape. Each request indexes its own prompt and output; the engine keeps a bounded store of earlier outputs.
//! To draft, the last bytes of the context are looked up in both, every earlier occurrence is extended
//! backwards to its match length, and the bytes that followed the longest matches are re-tokenized into
//! draft paths. Matching bytes finds ` Francisco",` after `"San` even when the prompt spelled ` San
//! Francisco` with other token boundaries.
//!
//! The index maps every 3-byte window to where it ends: appending a token costs a few hash inserts, a
//! lookup scans the most recent occurrences only, and control tokens become a `0xFF` byte (never valid
//! UTF-8), so no match or continuation runs across them.

use super::draft::{DraftContext, Drafter, Proposals, SUFFIX_CLASSES};
use crate::tokenizer::{TokenId, Tokenizer};
use std::collections::HashMap;

/// Shortest match (bytes) worth drafting from: short matches matter when a value starts being copied
/// (`"San` after `"city": `), and their calibrated acceptance keeps weak ones out of the tree.
pub const MIN_MATCH: usize = 3;
/// Longest match measured (bytes); longer matches count as this long.
const MAX_MATCH: usize = 256;
/// Most recent occurrences examined per lookup.
const SCAN: usize = 64;
/// Continuations re-tokenized per lookup (the longest matches).
const KEEP: usize = 6;
/// Bytes of continuation re-tokenized.
const CONT_BYTES: usize = 96;
/// Byte standing for a control token.
const SEP: u8 = 0xFF;

/// Evidence class of a match of `len` bytes: 3-5, 6-11, 12-23, 24-47, 48-95, 96 and more.
pub fn class_of(len: usize) -> u8 {
    let c = (len.max(MIN_MATCH) / MIN_MATCH).ilog2() as usize;
    c.min(SUFFIX_CLASSES - 1) as u8
}

/// Bytes with an index of every 4-byte window.
#[derive(Debug, Default)]
pub struct SuffixIndex {
    bytes: Vec<u8>,
    grams: HashMap<u32, Vec<u32>, ahash::RandomState>,
}

/// Bytes per indexed window.
const GRAM: usize = 3;

fn gram(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], 0])
}

impl SuffixIndex {
    /// Appends bytes, indexing the windows that end in them.
    pub fn push(&mut self, b: &[u8]) {
        let from = self.bytes.len();
        self.bytes.extend_from_slice(b);
        for end in from.max(GRAM - 1) + 1..=self.bytes.len() {
            let w = &self.bytes[end - GRAM..end];
            if w.contains(&SEP) {
                continue;
            }
            let g = gram(w);
            self.grams.entry(g).or_default().push(end as u32);
        }
    }

    /// Appends the bytes of `token`.
    pub fn push_token(&mut self, tok: &Tokenizer, token: TokenId) {
        if tok.is_control(token) {
            self.push(&[SEP]);
        } else {
            self.push(tok.token_bytes(token));
        }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Empties the index.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.grams.clear();
    }

    /// The longest earlier occurrences of a suffix of `query`: `(end, length)` pairs, longest first, at
    /// least [`MIN_MATCH`] long, skipping an occurrence ending at `skip`.
    pub fn matches(&self, query: &[u8], skip: usize, out: &mut Vec<(usize, usize)>) {
        out.clear();
        if query.len() < MIN_MATCH {
            return;
        }
        let Some(ends) = self.grams.get(&gram(&query[query.len() - GRAM..])) else {
            return;
        };
        for &e in ends.iter().rev().take(SCAN) {
            let e = e as usize;
            if e == skip {
                continue;
            }
            let len = self.bytes[..e]
                .iter()
                .rev()
                .zip(query.iter().rev())
                .take(MAX_MATCH)
                .take_while(|(a, b)| a == b && **a != SEP)
                .count();
            if len >= MIN_MATCH {
                out.push((e, len));
            }
        }
        // Longest first; among equals, the most recent (a stable sort keeps scan order).
        out.sort_by_key(|&(_, len)| std::cmp::Reverse(len));
        out.truncate(KEEP);
    }

    /// Re-tokenizes what followed each match into draft paths of at most `depth` tokens.
    pub fn propose(
        &self,
        query: &[u8],
        skip: usize,
        tok: &Tokenizer,
        depth: usize,
        scratch: &mut Vec<(usize, usize)>,
        out: &mut Proposals,
    ) {
        self.matches(query, skip, scratch);
        for &(end, len) in scratch.iter() {
            let stop = (end + CONT_BYTES).min(self.bytes.len());
            let mut cont = &self.bytes[end..stop];
            let mut whole = stop == self.bytes.len();
            if let Some(s) = cont.iter().position(|&b| b == SEP) {
                cont = &cont[..s];
                whole = true;
            }
            let text = match std::str::from_utf8(cont) {
                Ok(t) => t,
                Err(e) => {
                    whole = false;
                    std::str::from_utf8(&cont[..e.valid_up_to()]).unwrap_or("")
                }
            };
            if text.is_empty() {
                continue;
            }
            let Ok(mut toks) = tok.encode(text, false) else {
                continue;
            };
            if !whole {
                // The last token may be cut short where the continuation was.
                toks.pop();
            }
            toks.truncate(depth);
            if !toks.is_empty() {
                // Longer matches are stronger evidence for where the branches go.
                out.add(&toks, len.min(64) as f32, class_of(len));
            }
        }
    }
}

/// The suffix drafter of one request: its prompt and output so far.
#[derive(Debug, Default)]
pub struct SuffixDrafter {
    index: SuffixIndex,
    synced: usize,
    last: Option<TokenId>,
    scratch: Vec<(usize, usize)>,
}

impl SuffixDrafter {
    /// Brings the index up to `history` (appending, or rebuilding if history was rewritten).
    pub fn sync(&mut self, history: &[TokenId], tok: &Tokenizer) {
        let consistent = history.len() >= self.synced
            && (self.synced == 0 || Some(history[self.synced - 1]) == self.last);
        if !consistent {
            self.index.clear();
            self.synced = 0;
        }
        for &t in &history[self.synced..] {
            self.index.push_token(tok, t);
        }
        self.synced = history.len();
        self.last = history.last().copied();
    }

    /// The request's bytes (prompt and output so far).
    pub fn bytes(&self) -> &[u8] {
        self.index.bytes()
    }
}

impl Drafter for SuffixDrafter {
    fn propose(&mut self, ctx: &DraftContext<'_>, out: &mut Proposals) {
        self.sync(ctx.history, ctx.tokenizer);
        let b = self.index.bytes();
        let query = &b[b.len().saturating_sub(MAX_MATCH)..];
        let mut scratch = std::mem::take(&mut self.scratch);
        self.index.propose(
            query,
            b.len(),
            ctx.tokenizer,
            ctx.max_depth,
            &mut scratch,
            out,
        );
        self.scratch = scratch;
    }
}

/// Earlier requests' outputs, bounded: the oldest half is dropped when it is full.
#[derive(Debug)]
pub struct SuffixStore {
    index: SuffixIndex,
    capacity: usize,
    scratch: Vec<(usize, usize)>,
}

impl SuffixStore {
    /// A store of at most `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        SuffixStore {
            index: SuffixIndex::default(),
            capacity: capacity.max(1024),
            scratch: Vec::new(),
        }
    }

    /// Remembers an output.
    pub fn add(&mut self, tokens: &[TokenId], tok: &Tokenizer) {
        if tokens.is_empty() {
            return;
        }
        for &t in tokens {
            self.index.push_token(tok, t);
        }
        self.index.push(&[SEP]);
        if self.index.bytes.len() > self.capacity {
            let keep = self.index.bytes[self.index.bytes.len() - self.capacity / 2..].to_vec();
            self.index.clear();
            self.index.push(&keep);
        }
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.index.bytes.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.index.bytes.is_empty()
    }

    /// Adds continuations of `query` (a request's last bytes) found in earlier outputs.
    pub fn propose(&mut self, query: &[u8], tok: &Tokenizer, depth: usize, out: &mut Proposals) {
        let q = &query[query.len().saturating_sub(MAX_MATCH)..];
        self.index
            .propose(q, usize::MAX, tok, depth, &mut self.scratch, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_are_longest_first_and_skip_the_query_itself() {
        let mut ix = SuffixIndex::default();
        ix.push(b"the cat sat on the mat. the cat sat on the hat. the cat sat on the ");
        let q = ix.bytes().to_vec();
        let mut out = Vec::new();
        ix.matches(&q, q.len(), &mut out);
        assert!(!out.is_empty());
        // The occurrence after "hat. " matches "the cat sat on the " plus more context than after "mat.".
        let (end, len) = out[0];
        assert!(len >= 19, "{out:?}");
        assert_eq!(&ix.bytes()[end..end + 3], b"hat");
        assert!(out.iter().all(|&(e, _)| e != q.len()));
    }

    #[test]
    fn separators_stop_matches() {
        let mut ix = SuffixIndex::default();
        ix.push(b"abcdefgh");
        ix.push(&[SEP]);
        ix.push(b"abcdefgh");
        let mut out = Vec::new();
        ix.matches(b"xxabcdefgh", usize::MAX, &mut out);
        out.retain(|&(_, l)| l >= 8);
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|&(_, l)| l == 8));
    }

    #[test]
    fn classes_grow_with_match_length() {
        assert_eq!(class_of(3), 0);
        assert_eq!(class_of(8), 1);
        assert_eq!(class_of(40), 3);
        assert_eq!(class_of(300), (SUFFIX_CLASSES - 1) as u8);
    }
}
