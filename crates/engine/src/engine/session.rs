//! A sequence driven by hand, one forward pass at a time, without sampling.
//!
//! Benchmarks replay fixed token streams (`pp512`, `tg128` at a depth) and logit tests compare one
//! position's logits against a reference; neither wants a sampler, a decoder or a queue. A [`Session`]
//! borrows the engine, owns one sequence and runs its passes through the same executor as the scheduler
//! ([`Engine::execute`]), so what it measures is what serving runs. Its state lives here, not in the
//! engine: dropping the session leaves its tokens in the prefix cache like any finished sequence.

use super::step::StepPlan;
use super::{Engine, EngineError, PREFILL_CHUNK};
use crate::kv::{Logits, SeqKv};
use crate::tokenizer::TokenId;
use std::time::{Duration, Instant};

/// A hand-driven sequence on an engine ([`Engine::session`]).
#[derive(Debug)]
pub struct Session<'e> {
    engine: &'e mut Engine,
    /// Always `Some` between calls.
    seq: Option<SeqKv>,
    /// The tokens its positions hold.
    tokens: Vec<TokenId>,
    /// The last pass's last-position logits.
    logits: Vec<f32>,
    plan: StepPlan,
}

impl Engine {
    /// Starts an empty hand-driven sequence ([`Session`]).
    pub fn session(&mut self) -> Session<'_> {
        let seq = self.kv.acquire(&[]);
        Session {
            engine: self,
            seq: Some(seq),
            tokens: Vec::new(),
            logits: Vec::new(),
            plan: StepPlan::default(),
        }
    }
}

impl Session<'_> {
    /// Makes the sequence hold `prompt`, reusing the longest prefix of it that is cached (the sequence's
    /// earlier tokens go to the cache first, so a prompt that extends them reuses them all), and leaves the
    /// last position's logits in [`Session::logits`]. Returns how many prompt tokens came from the cache.
    pub fn prefill(&mut self, prompt: &[TokenId]) -> Result<usize, EngineError> {
        let e = &mut *self.engine;
        e.check_prompt(prompt)?;
        if let Some(old) = self.seq.take() {
            e.kv.release(old, Some(&self.tokens));
        }
        self.tokens.clear();
        let mut seq = Some(e.kv.acquire(prompt));
        let hit = seq.as_ref().map_or(0, SeqKv::len);
        let mut pos = hit;
        let mut result = Ok(hit);
        while pos < prompt.len() {
            let s = seq.as_ref().expect("the session's sequence");
            // Chunks end where a hybrid model snapshots its state.
            let end =
                e.kv.chunk_end(s, prompt, pos, (pos + PREFILL_CHUNK).min(prompt.len()));
            let want = if end == prompt.len() {
                Logits::Last
            } else {
                Logits::None
            };
            if let Err(err) = e.run_alone(
                &mut self.plan,
                &mut seq,
                &prompt[pos..end],
                want,
                &mut self.logits,
            ) {
                // What was computed stays: a retry (or the next turn) resumes from there.
                result = Err(err);
                break;
            }
            let s = seq.as_ref().expect("the session's sequence");
            if end < prompt.len() && e.kv.snapshot_point(s, prompt, end) {
                e.kv.snapshot(s, prompt);
            }
            pos = end;
        }
        let s = seq.as_ref().expect("the session's sequence");
        self.tokens.extend_from_slice(&prompt[..s.len()]);
        if result.is_ok() {
            // The end of every prompt is a snapshot point (the next request often re-renders what follows).
            e.kv.snapshot(s, prompt);
        }
        self.seq = seq;
        result
    }

    /// The last position's logits after the last [`Session::prefill`] or [`Session::step`].
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Runs `tokens` after the sequence's positions and returns the last one's logits, as a decode step
    /// does (benchmarks replay a fixed text this way).
    pub fn step(&mut self, tokens: &[TokenId]) -> Result<&mut [f32], EngineError> {
        let e = &mut *self.engine;
        let len = self.tokens.len();
        if len + tokens.len() > e.context {
            return Err(EngineError::ContextFull {
                len,
                add: tokens.len(),
                context: e.context,
            });
        }
        let r = e.run_alone(
            &mut self.plan,
            &mut self.seq,
            tokens,
            Logits::Last,
            &mut self.logits,
        );
        let ran = self.seq.as_ref().map_or(len, SeqKv::len) - len;
        self.tokens.extend_from_slice(&tokens[..ran]);
        r?;
        Ok(&mut self.logits)
    }

    /// Runs `tokens` after the sequence's positions without sampling (benchmarks), in prefill-sized
    /// passes: returns the time the forward passes took.
    pub fn eval(&mut self, tokens: &[TokenId]) -> Result<Duration, EngineError> {
        let t = Instant::now();
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            self.step(chunk)?;
        }
        Ok(t.elapsed())
    }

    /// Positions the sequence holds.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The engine, for reading its counters between passes.
    pub fn engine(&self) -> &Engine {
        self.engine
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if let Some(seq) = self.seq.take() {
            self.engine.kv.release(seq, Some(&self.tokens));
        }
    }
}
