//! What steers one generation: a grammar, when it applies, and whether forced tokens skip decode steps.
//!
//! A [`Guide`] is built above the engine, from a request's tools, `tool_choice`, `parallel_tool_calls` and
//! `response_format` (`thorn_tools::grammar::guide_spec` says which grammar applies when, as data, and
//! `thorn_guide::ToolGrammars::guide` compiles it); the engine only runs it.
//!
//! With a trigger the model writes free prose, unmasked and at full speed, until its output contains
//! `<tool_call>`; the engine then hands the trigger to the grammar and every later token is masked.
//! Tool-call blocks repeat (`block+`) when parallel calls are allowed, and the turn may end after any of them.
//!
//! Each step while the grammar is active:
//!
//! 1. **Sample first**: the sampler picks from the unmasked logits and the grammar only
//!    checks that one token (a few µs). Only if it is rejected is the full mask computed (tens of µs, up to a
//!    few hundred inside hard lexemes) and the token drawn again from the masked logits. For greedy and plain
//!    temperature sampling this is exactly sampling from the masked distribution (see
//!    [`crate::sample::Sampler::lazy_mask_is_exact`]); otherwise the engine masks first.
//! 2. **Commit** the token.
//! 3. **Fast-forward**: the tokens the grammar now forces (a key, the closing `"}}</tool_call>`) are committed
//!    without sampling and ride in the next forward pass with the sampled token.

mod numbers;

use super::grammar::{Constraint, GrammarError, Mask};
use crate::tokenizer::{TokenId, Tokenizer};
use numbers::NumberGuard;
use std::time::{Duration, Instant};

/// One sequence's output constraint.
#[derive(Debug)]
pub struct Guide {
    constraint: Constraint,
    trigger: Option<String>,
    active: bool,
    fast_forward: bool,
    mask: Mask,
    timings: Option<Vec<Duration>>,
    step_time: Duration,
    lazy: bool,
    lazy_hits: usize,
    forced: usize,
    stops_apply: bool,
    numbers: Option<NumberGuard>,
}

impl Guide {
    /// A guide whose grammar applies from the first token.
    pub fn new(constraint: Constraint) -> Self {
        Guide {
            constraint,
            trigger: None,
            active: true,
            fast_forward: true,
            mask: Mask::default(),
            timings: None,
            step_time: Duration::ZERO,
            lazy: true,
            lazy_hits: 0,
            forced: 0,
            stops_apply: false,
            numbers: None,
        }
    }

    /// Keeps JSON number literals within `f64` range beside the grammar (for JSON grammars; see
    /// the `numbers` module). The factory's guides have it on.
    pub fn with_json_number_limits(mut self) -> Self {
        self.numbers = Some(NumberGuard::default());
        self
    }

    /// A guide for the answer itself (`response_format`): active from the first token, and the request's
    /// stop strings still apply.
    pub fn answer(constraint: Constraint) -> Self {
        Guide {
            stops_apply: true,
            ..Guide::new(constraint)
        }
    }

    /// Whether the request's stop strings apply while the grammar is active (answers yes, tool calls no).
    pub fn stops_apply(&self) -> bool {
        self.stops_apply
    }

    /// A guide whose grammar starts with `trigger` and applies once the output contains it.
    pub fn triggered(constraint: Constraint, trigger: impl Into<String>) -> Self {
        Guide {
            trigger: Some(trigger.into()),
            active: false,
            ..Guide::new(constraint)
        }
    }

    /// Whether forced tokens are committed without sampling (on by default; off for measurements).
    pub fn set_fast_forward(&mut self, on: bool) {
        self.fast_forward = on;
    }

    /// Whether forced tokens skip sampling.
    pub fn fast_forward(&self) -> bool {
        self.fast_forward
    }

    /// Records the grammar's time for every sampled token (benchmarks; see [`Guide::mask_times`]).
    pub fn record_mask_times(&mut self) {
        self.timings = Some(Vec::with_capacity(1024));
    }

    /// The grammar's time for each sampled token while active (check or mask, and commit).
    pub fn mask_times(&self) -> &[Duration] {
        self.timings.as_deref().unwrap_or(&[])
    }

    /// Whether the engine may sample first and compute a mask only when the grammar rejects the token (on by
    /// default; the engine does it only where that is exact, see [`crate::sample::Sampler::lazy_mask_is_exact`]).
    pub fn set_lazy_mask(&mut self, on: bool) {
        self.lazy = on;
    }

    /// Whether lazy masking is allowed.
    pub fn lazy_mask(&self) -> bool {
        self.lazy && self.active
    }

    /// Sampled tokens the grammar accepted without a mask.
    pub fn lazy_hits(&self) -> usize {
        self.lazy_hits
    }

    /// Whether the grammar allows `token` next (nothing is committed).
    pub(crate) fn allows(&mut self, token: TokenId, tok: &Tokenizer) -> Result<bool, GrammarError> {
        if !self.active {
            return Ok(true);
        }
        let t = self.timings.is_some().then(Instant::now);
        let ok = self
            .numbers
            .is_none_or(|n| n.accepts(tok.token_bytes(token)))
            && self.constraint.validate(&[token])? == 1;
        if let Some(t) = t {
            self.step_time += t.elapsed();
        }
        self.lazy_hits += usize::from(ok);
        Ok(ok)
    }

    /// Tokens committed by fast-forward (without sampling).
    pub fn forced_tokens(&self) -> usize {
        self.forced
    }

    /// The text that switches the grammar on, if it is not on from the start.
    pub fn trigger(&self) -> Option<&str> {
        self.trigger.as_deref()
    }

    /// Whether the grammar currently constrains the output.
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Switches the grammar on, feeding it `tokens` (the trigger and whatever followed it, in the grammar's
    /// own spelling). Returns `false`, changing nothing, if the grammar rejects them.
    pub(crate) fn activate(
        &mut self,
        tokens: &[TokenId],
        tok: &Tokenizer,
    ) -> Result<bool, GrammarError> {
        let ok = self.constraint.validate(tokens)? == tokens.len();
        if ok {
            self.constraint.commit_all(tokens)?;
            self.advance_numbers(tokens, tok);
            self.active = true;
        }
        Ok(ok)
    }

    fn advance_numbers(&mut self, tokens: &[TokenId], tok: &Tokenizer) {
        if let Some(n) = self.numbers.as_mut() {
            for &t in tokens {
                n.advance(tok.token_bytes(t));
            }
        }
    }

    /// Bans what the grammar does not allow (inactive: nothing).
    pub(crate) fn mask_logits(
        &mut self,
        logits: &mut [f32],
        tok: &Tokenizer,
    ) -> Result<(), GrammarError> {
        if !self.active {
            return Ok(());
        }
        let t = self.timings.is_some().then(Instant::now);
        self.constraint.mask_into(&mut self.mask)?;
        let allowed = self.mask.apply(logits);
        if let Some(n) = self.numbers.filter(NumberGuard::in_number) {
            // Inside a number: also ban what would take it past the limits (unless that bans everything).
            let mask = &self.mask;
            let over =
                |i: usize| mask.allows(i as TokenId) && !n.accepts(tok.token_bytes(i as TokenId));
            if (0..logits.len()).filter(|&i| over(i)).count() < allowed {
                for (i, l) in logits.iter_mut().enumerate() {
                    if over(i) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
        if let Some(t) = t {
            self.step_time += t.elapsed();
        }
        Ok(())
    }

    /// Advances past a sampled token (inactive: nothing).
    pub(crate) fn commit(&mut self, token: TokenId, tok: &Tokenizer) -> Result<(), GrammarError> {
        if self.active {
            let t = self.timings.is_some().then(Instant::now);
            self.constraint.commit(token)?;
            self.advance_numbers(&[token], tok);
            if let (Some(t), Some(v)) = (t, self.timings.as_mut()) {
                v.push(self.step_time + t.elapsed());
                self.step_time = Duration::ZERO;
            }
        }
        Ok(())
    }

    /// Commits and returns the tokens the grammar forces next (none when inactive, finished, or with
    /// fast-forward off), at most `limit`.
    pub(crate) fn take_forced(
        &mut self,
        limit: usize,
        out: &mut Vec<TokenId>,
        tok: &Tokenizer,
    ) -> Result<(), GrammarError> {
        out.clear();
        if !self.active || !self.fast_forward || self.constraint.is_stopped() {
            return Ok(());
        }
        let mut forced = self.constraint.forced();
        forced.truncate(limit);
        self.constraint.commit_all(&forced)?;
        self.advance_numbers(&forced, tok);
        self.forced += forced.len();
        out.extend_from_slice(&forced);
        Ok(())
    }

    /// Whether the grammar is complete (only end-of-sequence remains).
    pub fn is_done(&self) -> bool {
        self.active && self.constraint.is_stopped()
    }

    /// The grammar state.
    pub fn constraint(&mut self) -> &mut Constraint {
        &mut self.constraint
    }
}
