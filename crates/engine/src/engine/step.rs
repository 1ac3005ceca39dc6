//! One forward pass: planned by a caller, executed by the engine.
//!
//! Every forward pass the engine runs goes through [`Engine::execute`], whoever planned it: a scheduler
//! step (decodes, draft trees and prompt chunks of many sequences, [`super::scheduler`]), a lone generation
//! (the same scheduler with one submission), a [`super::Session`]'s passes (benchmarks and logit tests), and
//! the speculation cost calibration. A [`StepPlan`] lists each sequence's part: its tokens, as a chain or
//! as a tree with parents inside the part, and the logits it wants back. The plan owns the sequences for
//! the pass (moved in, handed back by [`StepPlan::drain`]), so one plan can be reused step after step
//! without allocating.
//!
//! Executing reserves the parts' KV pages (a no-op when the planner reserved them), lays them out as one
//! [`crate::kv::Batch`], moves hybrid models' recurrent states into the pass and back, runs the model, times the pass
//! for the speculation cost model, and advances every sequence past its tokens. The logits come back as
//! rows in plan order, one group per part that wanted any.

use super::{Engine, EngineError, PREFILL_CHUNK};
use crate::kv::{KvCache, Logits, NO_PARENT, SeqKv};
use crate::model::LogitRows;
use crate::spec::Speculator;
use crate::tokenizer::{TokenId, Tokenizer};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// One sequence's part of a pass.
#[derive(Debug)]
struct Part {
    /// The planner's name for the sequence (its index in the scheduler's batch).
    owner: usize,
    seq: SeqKv,
    /// Its tokens in [`StepPlan::tokens`].
    tokens: Range<usize>,
    /// Its parents in [`StepPlan::parents`], for a tree.
    parents: Option<Range<usize>>,
    want: Logits,
}

/// A planned forward pass: which sequences, their tokens (chains or trees) and the logits each wants.
#[derive(Debug, Default)]
pub struct StepPlan {
    parts: Vec<Part>,
    tokens: Vec<TokenId>,
    parents: Vec<u32>,
    /// Whether a sampler of the pass reads its rows' top-k candidates (a GPU then finds them where the
    /// logits are, see [`LogitRows::candidates`]).
    pub top_candidates: bool,
}

impl StepPlan {
    /// Empties the plan (its sequences must have been drained).
    pub fn clear(&mut self) {
        debug_assert!(
            self.parts.is_empty(),
            "a plan's sequences were not handed back"
        );
        self.parts.clear();
        self.tokens.clear();
        self.parents.clear();
        self.top_candidates = false;
    }

    /// Sequences in the pass.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    /// Whether the pass carries nothing.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Tokens in the pass.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Adds `tokens` as a chain after `seq`'s positions.
    pub fn push(&mut self, owner: usize, seq: SeqKv, tokens: &[TokenId], want: Logits) {
        let start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.parts.push(Part {
            owner,
            seq,
            tokens: start..self.tokens.len(),
            parents: None,
            want,
        });
    }

    /// Adds a decode with a draft tree: the `pending` tokens as a chain, then the `tree` (its roots follow
    /// the last pending token; `tree_parents` index the tree, [`NO_PARENT`] for a root). The logits of
    /// the last pending token and of every tree node come back.
    pub fn push_tree(
        &mut self,
        owner: usize,
        seq: SeqKv,
        pending: &[TokenId],
        tree: &[TokenId],
        tree_parents: &[u32],
        want: Logits,
    ) {
        debug_assert!(!pending.is_empty(), "a tree follows a pending token");
        let (start, pstart) = (self.tokens.len(), self.parents.len());
        let p = pending.len() as u32;
        self.tokens.extend_from_slice(pending);
        self.tokens.extend_from_slice(tree);
        self.parents
            .extend((0..p).map(|i| if i == 0 { NO_PARENT } else { i - 1 }));
        self.parents.extend(
            tree_parents
                .iter()
                .map(|&q| if q == NO_PARENT { p - 1 } else { q + p }),
        );
        self.parts.push(Part {
            owner,
            seq,
            tokens: start..self.tokens.len(),
            parents: Some(pstart..self.parents.len()),
            want,
        });
    }

    /// Hands the sequences back in plan order, each with what it ran; the plan is empty after.
    pub fn drain(&mut self) -> impl Iterator<Item = Ran> + '_ {
        self.tokens.clear();
        self.parents.clear();
        self.parts.drain(..).map(|p| Ran {
            owner: p.owner,
            seq: p.seq,
            tokens: p.tokens.len(),
            want: p.want,
            tree: p.parents.is_some(),
        })
    }
}

/// A sequence handed back by [`StepPlan::drain`], with what it ran.
#[derive(Debug)]
pub struct Ran {
    /// The planner's name for it.
    pub owner: usize,
    /// The sequence (advanced past its tokens if the pass succeeded).
    pub seq: SeqKv,
    /// Tokens it ran (a tree's nodes included).
    pub tokens: usize,
    /// The logits it wanted.
    pub want: Logits,
    /// Whether it ran a draft tree ([`StepPlan::push_tree`]).
    pub tree: bool,
}

/// An executed pass: its logits rows and what the caller needs beside them to consume them (the KV cache,
/// the tokenizer and the speculator are the engine's, borrowed for as long as the rows).
#[derive(Debug)]
pub struct Pass<'e> {
    /// The rows wanted, in plan order: one per `Last`, `k` per `Tail(k)`, every token's for `All`; read
    /// back as far as the consumer reads them (a greedy pick on a GPU reads three numbers a row).
    pub logits: LogitRows<'e>,
    /// The KV cache.
    pub kv: &'e mut KvCache,
    /// The tokenizer.
    pub tokenizer: &'e Tokenizer,
    /// Speculation state.
    pub spec: &'e mut Speculator,
    /// Logits per row.
    pub vocab: usize,
}

impl Engine {
    /// Runs `plan` as one forward pass. On success every sequence has advanced past its tokens; on failure
    /// none has. Either way the sequences stay in the plan for [`StepPlan::drain`].
    pub fn execute(&mut self, plan: &mut StepPlan) -> Result<Pass<'_>, EngineError> {
        for part in &mut plan.parts {
            let len = part.seq.len() + part.tokens.len();
            self.kv.reserve(&mut part.seq, len)?;
        }
        self.batch.clear();
        self.batch.top_candidates = plan.top_candidates;
        self.states.clear();
        for part in &mut plan.parts {
            let tokens = &plan.tokens[part.tokens.clone()];
            match &part.parents {
                Some(r) => {
                    self.batch
                        .push_tree(&part.seq, tokens, &plan.parents[r.clone()], part.want)
                }
                None => self.batch.push(&part.seq, tokens, part.want),
            }
            // Hybrid models' recurrent states travel with the batch (moved, not copied).
            self.states.push(std::mem::take(&mut part.seq.rec));
        }
        let t0 = Instant::now();
        let out = self.model.forward(
            &self.device,
            self.kv.pool_mut(),
            &self.batch,
            &mut self.states,
            &mut self.scratch,
        );
        for (part, st) in plan.parts.iter_mut().zip(self.states.drain(..)) {
            part.seq.rec = st;
        }
        let logits = out.map_err(|e| EngineError::Forward(Arc::new(e)))?;
        self.spec
            .cost
            .observe(self.batch.len(), t0.elapsed().as_secs_f64());
        for part in &mut plan.parts {
            part.seq.advance(part.tokens.len());
            self.kv.count_computed(part.tokens.len());
        }
        Ok(Pass {
            logits,
            kv: &mut self.kv,
            tokenizer: &self.tokenizer,
            spec: &mut self.spec,
            vocab: self.model.vocab(),
        })
    }

    /// Runs `tokens` after `seq`'s positions as passes of their own (a run longer than a prefill
    /// micro-batch goes through in prefill-sized passes when only the end's logits are wanted, so one
    /// pass never holds more than a micro-batch of activations); the logits asked for are copied into
    /// `logits`. `seq` is always handed back, advanced past what ran.
    pub(crate) fn run_alone(
        &mut self,
        plan: &mut StepPlan,
        seq: &mut Option<SeqKv>,
        tokens: &[TokenId],
        want: Logits,
        logits: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let mut rest = tokens;
        loop {
            let (head, tail, w) = if want == Logits::Last && rest.len() > PREFILL_CHUNK {
                let (h, t) = rest.split_at(PREFILL_CHUNK);
                (h, t, Logits::None)
            } else {
                (rest, &[][..], want)
            };
            plan.clear();
            plan.push(0, seq.take().expect("the caller's sequence"), head, w);
            let r = self.execute(plan).map(|mut pass| {
                if w != Logits::None {
                    logits.clear();
                    logits.extend_from_slice(pass.logits.all());
                }
            });
            *seq = plan.drain().next().map(|r| r.seq);
            r?;
            if tail.is_empty() {
                return Ok(());
            }
            rest = tail;
        }
    }
}
