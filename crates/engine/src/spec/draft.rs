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
//! * [`HeadDrafter`]: a model's multi-token-prediction head, through the same trait. Running the head needs
//!   the device and its own KV, so the engine runs it right before the draft and hands its top candidates
//!   for the token after the pending one in [`DraftContext::head`]; the drafter turns them into weighted
//!   paths like any other source. Every [`super::Speculator`] has one (it proposes nothing for a model
//!   without a head).

use crate::tokenizer::{TokenId, Tokenizer};

/// What a drafter sees.
#[derive(Debug, Clone, Copy)]
pub struct DraftContext<'a> {
    /// Prompt and tokens chosen so far (the draft continues after the last one).
    pub history: &'a [TokenId],
    /// The model head's candidates for the token after the pending one, with their probabilities (an MTP
    /// head's top tokens), computed for this draft; empty when the model has no head or it failed.
    pub head: &'a [(TokenId, f32)],
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

/// Drafts what the model's own head predicts: each candidate a one-token path whose weight is its
/// probability times the weight the other sources gave the root, so an MTP guess counts as much as a
/// suffix match in proportion to the head's confidence; its acceptance is calibrated as [`MODEL_CLASS`].
/// It must run after the other sources (it reads their total weight).
#[derive(Debug, Default, Clone, Copy)]
pub struct HeadDrafter;

impl Drafter for HeadDrafter {
    fn propose(&mut self, ctx: &DraftContext<'_>, out: &mut Proposals) {
        let base = out.get(0).weight.max(1.0);
        for &(t, p) in ctx.head {
            out.add(&[t], p * base, MODEL_CLASS);
        }
    }
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

    #[test]
    fn the_head_drafter_weighs_its_candidates_by_the_others_evidence() {
        use crate::tokenizer::TokenKind;
        let tokens: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let tok = Tokenizer::new(tokens, vec![TokenKind::Normal; 3], &[], "gpt2").unwrap();
        let head = [(2, 0.75), (1, 0.25)];
        let ctx = DraftContext {
            history: &[0],
            head: &head,
            tokenizer: &tok,
            max_depth: 4,
        };
        // The other sources gave the root a weight of 4: the head's candidates share it by probability.
        let mut p = Proposals::default();
        p.add(&[1, 2], 4.0, 3);
        HeadDrafter.propose(&ctx, &mut p);
        let c2 = p.child(0, 2).unwrap();
        assert_eq!((p.get(c2).weight, p.get(c2).class), (3.0, MODEL_CLASS));
        let c1 = p.child(0, 1).unwrap();
        assert_eq!(
            p.get(c1).weight,
            5.0,
            "agreement with a suffix match adds up"
        );
        assert_eq!(p.get(c1).class, MODEL_CLASS, "the strongest class wins");
        // Alone, a candidate counts its probability (the root weight floors at 1); no head, no proposal.
        let mut alone = Proposals::default();
        HeadDrafter.propose(&ctx, &mut alone);
        assert_eq!(alone.get(alone.child(0, 2).unwrap()).weight, 0.75);
        let mut none = Proposals::default();
        HeadDrafter.propose(&DraftContext { head: &[], ..ctx }, &mut none);
        assert!(none.is_empty());
    }
}
