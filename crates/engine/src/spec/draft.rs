//! Drafters: where candidate continuations come from.
//!
//! A drafter adds token paths to a [`Proposals`] trie, each node with a weight (how many sources agree) and
//! a match class (how strong the evidence is). The tree builder turns weights into conditional probabilities
//! and the class into a calibrated acceptance rate ([`super::Calibration`]).
//!
//! * [`super::suffix::SuffixDrafter`]: copies what followed earlier occurrences of the context's suffix, in
//!   the request (prompt and output so far) and in a store of earlier outputs, matched on bytes and
//!   re-tokenized, so a value copied from prose finds its continuation even where BPE splits it differently.
//! * Grammar-forced tokens are not proposed here: the tree builder appends the run the grammar forces after
//!   every drafted token, at probability 1 given that token; and where nothing is proposed but the grammar
//!   allows only a few tokens, the builder drafts them as siblings ([`GRAMMAR_CLASS`]).
//! * A model with a multi-token-prediction head drafts through the same trait: its
//!   [`DraftContext::hidden`] is the last position's hidden state, and its top-k per depth become weighted
//!   paths.

use crate::tokenizer::{TokenId, Tokenizer};

/// What a drafter sees.
#[derive(Debug, Clone, Copy)]
pub struct DraftContext<'a> {
    /// Prompt and tokens chosen so far (the draft continues after the last one).
    pub history: &'a [TokenId],
    /// The last position's final hidden state, for drafters that read the model (MTP heads); `None` when
    /// the engine does not keep it.
    pub hidden: Option<&'a [f32]>,
    /// The model's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Deepest useful path.
    pub max_depth: usize,
}

/// A source of draft continuations.
pub trait Drafter: Send + std::fmt::Debug {
    /// Adds continuations of `ctx.history` to `out`.
    fn propose(&mut self, ctx: &DraftContext<'_>, out: &mut Proposals);
}

/// Evidence classes of suffix matches (by match length).
pub const SUFFIX_CLASSES: usize = 6;
/// The class of a grammar alternative: one of the few tokens the grammar allows at a point where no
/// drafter proposes anything (`true`/`false`, an enum value, another call or the end).
pub const GRAMMAR_CLASS: u8 = SUFFIX_CLASSES as u8;
/// The class of a model's own draft (an MTP head's prediction of the token after next).
pub const MODEL_CLASS: u8 = GRAMMAR_CLASS + 1;
/// Evidence classes, for calibration (see [`super::Calibration`]).
pub const CLASSES: usize = SUFFIX_CLASSES + 2;

/// One node of the proposal trie.
#[derive(Debug, Clone)]
pub struct Proposal {
    /// The token.
    pub token: TokenId,
    /// Summed weight of the paths through it.
    pub weight: f32,
    /// Strongest evidence class among them.
    pub class: u8,
    first_child: u32,
    next_sibling: u32,
}

const NONE: u32 = u32::MAX;

/// Candidate continuations as a trie; node 0 is the root (the position after the history).
#[derive(Debug, Clone)]
pub struct Proposals {
    nodes: Vec<Proposal>,
}

impl Default for Proposals {
    fn default() -> Self {
        let mut p = Proposals { nodes: Vec::new() };
        p.clear();
        p
    }
}

impl Proposals {
    /// Empties the trie, keeping its buffer.
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.nodes.push(Proposal {
            token: 0,
            weight: 0.0,
            class: 0,
            first_child: NONE,
            next_sibling: NONE,
        });
    }

    /// Adds a path of `tokens` after the root with `weight` and evidence `class`.
    pub fn add(&mut self, tokens: &[TokenId], weight: f32, class: u8) {
        let mut at = 0usize;
        self.nodes[0].weight += weight;
        for &t in tokens {
            let next = match self.child(at, t) {
                Some(c) => c,
                None => {
                    let id = self.nodes.len() as u32;
                    let n = &mut self.nodes[at];
                    let sib = n.first_child;
                    n.first_child = id;
                    self.nodes.push(Proposal {
                        token: t,
                        weight: 0.0,
                        class: 0,
                        first_child: NONE,
                        next_sibling: sib,
                    });
                    id as usize
                }
            };
            let n = &mut self.nodes[next];
            n.weight += weight;
            n.class = n.class.max(class);
            at = next;
        }
    }

    /// The child of `node` for `token`.
    pub fn child(&self, node: usize, token: TokenId) -> Option<usize> {
        self.children(node).find(|&c| self.nodes[c].token == token)
    }

    /// The children of `node`.
    pub fn children(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        let mut c = self.nodes[node].first_child;
        std::iter::from_fn(move || {
            if c == NONE {
                return None;
            }
            let at = c as usize;
            c = self.nodes[at].next_sibling;
            Some(at)
        })
    }

    /// Node `i`.
    pub fn get(&self, i: usize) -> &Proposal {
        &self.nodes[i]
    }

    /// Nodes, the root included.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether nothing was proposed.
    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_merge_into_a_weighted_trie() {
        let mut p = Proposals::default();
        p.add(&[1, 2, 3], 1.0, 2);
        p.add(&[1, 2, 4], 2.0, 1);
        p.add(&[5], 1.0, 0);
        assert_eq!(p.get(0).weight, 4.0);
        let a = p.child(0, 1).unwrap();
        assert_eq!(p.get(a).weight, 3.0);
        assert_eq!(p.get(a).class, 2);
        let b = p.child(a, 2).unwrap();
        assert_eq!(p.children(b).count(), 2);
        assert_eq!(p.get(p.child(b, 4).unwrap()).weight, 2.0);
        assert!(p.child(0, 2).is_none());
        p.clear();
        assert!(p.is_empty());
    }
}
