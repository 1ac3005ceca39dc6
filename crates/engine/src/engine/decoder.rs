//! One sequence's generation as a state machine: logits in, tokens to run next out.
//!
//! The engine owns the forward passes; a [`Decoder`] owns everything else about a request: the sampler,
//! the grammar guide, stop strings, the streaming detokenizer, and the tokens chosen so far. Each engine
//! step hands it the logits of its last position ([`Decoder::advance`]); it samples (under the grammar's
//! mask), commits the token and whatever the grammar forces after it, streams the text that is final, and
//! says which tokens the next forward pass must run ([`Decoder::pending`]) or that it is done. The same
//! machine serves a lone [`super::Engine::generate_guided`] call and a sequence in a batch of many, so both
//! produce the same tokens.

use super::stop::StopBuffer;
use super::think::{ThinkBudget, ThinkState};
use super::{EngineError, FinishReason, Request};
use crate::model::LogitRows;
use crate::sample::grammar::GrammarError;
use crate::sample::guide::Guide;
use crate::sample::{Sampled, Sampler};
use crate::spec::suffix::SuffixDrafter;
use crate::spec::{DraftTree, PassShape, Speculator};
use crate::tokenizer::{DetokState, TokenId, Tokenizer};

/// The guide a decoder steers by: none, one the caller keeps, or one it owns.
#[derive(Debug)]
pub enum GuideSlot<'g> {
    /// Unconstrained.
    None,
    /// The caller's (it reads counters from it afterwards).
    Borrowed(&'g mut Guide),
    /// Owned by the decoder (a queued request).
    Owned(Box<Guide>),
}

impl GuideSlot<'_> {
    fn get(&self) -> Option<&Guide> {
        match self {
            GuideSlot::None => None,
            GuideSlot::Borrowed(g) => Some(g),
            GuideSlot::Owned(g) => Some(g),
        }
    }

    fn get_mut(&mut self) -> Option<&mut Guide> {
        match self {
            GuideSlot::None => None,
            GuideSlot::Borrowed(g) => Some(g),
            GuideSlot::Owned(g) => Some(g),
        }
    }
}

/// What a finished decoder produced.
#[derive(Debug)]
pub struct Decoded {
    /// Generated tokens (including a final end-of-generation token, if any).
    pub tokens: Vec<TokenId>,
    /// Generated text, cut before any stop string.
    pub text: String,
    /// Per-token sampling details.
    pub sampled: Vec<Sampled>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The request's stop string it ended on, if it did.
    pub stop_string: Option<String>,
    /// Forward passes run for it after the prompt.
    pub forward_passes: usize,
}

/// A request's generation state between engine steps.
#[derive(Debug)]
pub struct Decoder<'g> {
    req: Request,
    guide: GuideSlot<'g>,
    sampler: Sampler,
    lazy_ok: bool,
    /// Prompt and generated tokens, in order; the KV of a prefix of them is in the cache.
    history: Vec<TokenId>,
    prompt_len: usize,
    tokens: Vec<TokenId>,
    sampled: Vec<Sampled>,
    trigger: Option<String>,
    stop: StopBuffer,
    /// Text before the trigger, once the grammar has taken over.
    prose: String,
    /// Bytes generated so far, kept only to locate a trigger inside the tokens.
    gen_bytes: Vec<u8>,
    detok: DetokState,
    delta: String,
    finish: Option<FinishReason>,
    limit: usize,
    /// Tokens chosen but not yet run through the model: the last sampled one plus any the grammar forced
    /// after it. They go through the next forward pass together, so forced tokens cost no step of their own.
    pending: Vec<TokenId>,
    forward_passes: usize,
    step: Vec<Sampled>,
    forced: Vec<TokenId>,
    spec: Option<Box<SpecState>>,
    /// The reasoning budget and where the output is with respect to the think block (none under a
    /// grammar active from the first token, which leaves no room for one).
    think: Option<(ThinkBudget, ThinkState)>,
}

/// A request's speculation: its drafter, the tree in flight and the path accepted from the last one.
#[derive(Debug, Default)]
struct SpecState {
    drafter: SuffixDrafter,
    tree: DraftTree,
    path: Vec<usize>,
}

fn forced_sample(token: TokenId) -> Sampled {
    Sampled {
        token,
        // Forced: probability 1 under the constraint.
        logprob: 0.0,
        top: Vec::new(),
    }
}

impl<'g> Decoder<'g> {
    /// A decoder for `req` (its prompt moves into the decoder's history) with at most `context` positions.
    pub fn new(mut req: Request, guide: GuideSlot<'g>, vocab: usize, context: usize) -> Self {
        let sampler = Sampler::new(req.sampling.clone(), vocab);
        let lazy_ok = sampler.lazy_mask_is_exact();
        let trigger = guide
            .get()
            .filter(|g| !g.is_active())
            .and_then(|g| g.trigger().map(str::to_owned));
        let stops_apply = guide.get().is_none_or(Guide::stops_apply) || trigger.is_some();
        let mut stops = if stops_apply {
            req.stop.clone()
        } else {
            Vec::new()
        };
        stops.extend(trigger.clone());
        let think = req
            .think_budget
            .clone()
            .filter(|_| guide.get().is_none_or(|g| !g.is_active()))
            .map(|b| {
                let s = ThinkState::new(&b);
                (b, s)
            });
        let history = std::mem::take(&mut req.prompt);
        let detok = DetokState::showing(&req.shown_controls);
        let prompt_len = history.len();
        let limit = req.max_tokens.min(context.saturating_sub(prompt_len));
        let mut d = Decoder {
            req,
            guide,
            sampler,
            lazy_ok,
            history,
            prompt_len,
            tokens: Vec::new(),
            sampled: Vec::new(),
            trigger,
            stop: StopBuffer::new(stops),
            prose: String::new(),
            gen_bytes: Vec::new(),
            detok,
            delta: String::new(),
            finish: None,
            limit,
            pending: Vec::new(),
            forward_passes: 0,
            step: Vec::with_capacity(16),
            forced: Vec::with_capacity(64),
            spec: None,
            think,
        };
        if d.req.speculate {
            d.spec = Some(Box::default());
        }
        d.check_end();
        d
    }

    /// The request (its prompt has moved into [`Decoder::history`]).
    pub fn request(&self) -> &Request {
        &self.req
    }

    /// Prompt and generated tokens so far.
    pub fn history(&self) -> &[TokenId] {
        &self.history
    }

    /// Prompt tokens.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Whether the next step will draft (this request speculates and is not finished): the engine then
    /// asks the model's MTP head, if it has one, for candidates first.
    pub fn wants_draft(&self) -> bool {
        self.spec.is_some() && self.finish.is_none()
    }

    /// Tokens to run through the model before the next [`Decoder::advance`].
    pub fn pending(&self) -> &[TokenId] {
        &self.pending
    }

    /// Whether generation has ended.
    pub fn is_done(&self) -> bool {
        self.finish.is_some()
    }

    /// Drafts the tree to verify after the pending tokens, in a pass of `pass.base` tokens with
    /// `pass.decisions` sampling decisions; `pass.room` is the room left in the context. No tree when
    /// the request does not speculate, is done, or nothing is worth drafting.
    pub fn draft(
        &mut self,
        sp: &mut Speculator,
        tok: &Tokenizer,
        pass: PassShape,
    ) -> Result<(), EngineError> {
        let Some(st) = self.spec.as_deref_mut() else {
            return Ok(());
        };
        st.tree.clear();
        st.path.clear();
        if self.finish.is_some() {
            return Ok(());
        }
        // The root's own decision takes one of the tokens left.
        let left = self.limit.saturating_sub(self.tokens.len() + 1);
        let pass = PassShape {
            room: pass.room.min(left),
            ..pass
        };
        if pass.room == 0 {
            return Ok(());
        }
        let grammar = self
            .guide
            .get_mut()
            .filter(|g| g.is_active())
            .map(Guide::constraint);
        sp.draft(
            &mut st.drafter,
            &self.history,
            grammar,
            tok,
            pass,
            &mut st.tree,
        )?;
        Ok(())
    }

    /// The draft tree to run after the pending tokens (empty: none).
    pub fn tree(&self) -> &[TokenId] {
        self.spec.as_deref().map_or(&[], |s| &s.tree.tokens)
    }

    /// The parents of [`Decoder::tree`]'s nodes.
    pub fn tree_parents(&self) -> &[u32] {
        self.spec.as_deref().map_or(&[], |s| &s.tree.parents)
    }

    /// The tree nodes the last [`Decoder::advance_tree`] accepted, in path order.
    pub fn accepted(&self) -> &[usize] {
        self.spec.as_deref().map_or(&[], |s| &s.path)
    }

    /// Consumes a verified tree: `rows` from row `first` on holds the logits of the last pending token
    /// and then of each tree node. Samples at the root exactly as [`Decoder::advance`] does and follows
    /// the tree while it holds the chosen tokens; [`Decoder::accepted`] then lists the nodes kept and
    /// [`Decoder::pending`] what still has to run.
    pub fn advance_tree(
        &mut self,
        rows: &mut LogitRows<'_>,
        first: usize,
        tok: &Tokenizer,
        on_text: &mut dyn FnMut(&str),
        sp: &mut Speculator,
    ) -> Result<(), EngineError> {
        let Some(mut st) = self.spec.take() else {
            return self.advance(rows, first, tok, on_text);
        };
        st.path.clear();
        let mut node: Option<usize> = None;
        let res = loop {
            let row = first + node.map_or(0, |n| n + 1);
            if let Err(e) = self.advance(rows, row, tok, on_text) {
                break Err(e);
            }
            let mut matched = 0;
            let mut at = node;
            while let Some(&t) = self.pending.get(matched) {
                match st.tree.child(at, t) {
                    Some(c) => {
                        st.path.push(c);
                        at = Some(c);
                        matched += 1;
                    }
                    None => break,
                }
            }
            self.pending.drain(..matched);
            if matched == 0 || self.finish.is_some() || !self.pending.is_empty() {
                break Ok(());
            }
            node = at;
        };
        sp.record(&st.tree, &st.path);
        self.spec = Some(st);
        res
    }

    /// Records that the pending tokens went through a forward pass.
    pub fn ran_pending(&mut self) {
        self.pending.clear();
        self.forward_passes += 1;
    }

    /// Ends generation early (cancelled by the caller).
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
    }

    fn check_end(&mut self) {
        if self.finish.is_some() {
            return;
        }
        if self.tokens.len() >= self.limit {
            self.finish = Some(FinishReason::Length);
        } else if self.req.cancelled() {
            self.finish = Some(FinishReason::Cancelled);
        }
    }

    /// Consumes row `i` of `rows`, the logits of the last position (masked and modified in place), and
    /// chooses the next token(s); text that is final goes to `on_text`. A greedy pick the grammar allows
    /// reads only the row's best where the device reduced it (see [`LogitRows::best`]).
    pub fn advance(
        &mut self,
        rows: &mut LogitRows<'_>,
        i: usize,
        tok: &Tokenizer,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<(), EngineError> {
        if self.finish.is_some() {
            return Ok(());
        }
        debug_assert!(self.pending.is_empty(), "pending tokens were not run");
        if let Some((b, st)) = &self.think
            && st.spent(b, self.tokens.len())
        {
            // The budget is spent inside the block: the closing tag instead of a pick.
            let close = b.close_tokens.clone();
            for t in close {
                if let Some(f) = self.take_token(forced_sample(t), tok, on_text)? {
                    self.finish = Some(f);
                    return Ok(());
                }
            }
            // Written: the block is over whatever the tag's text did to the tracking.
            if let Some((_, st)) = &mut self.think {
                *st = ThinkState::Done;
            }
            self.check_end();
            return Ok(());
        }
        let s = match self.pick_best(rows, i, tok)? {
            Some(s) => s,
            None => match self.pick_top(rows, i) {
                Some(s) => s,
                None => self.pick_row(rows.row(i), tok)?,
            },
        };
        self.commit(s, tok, on_text)
    }

    /// Whether its picks read only a row's top-k candidates (see [`Decoder::pick_top`]), which a GPU then
    /// finds where the logits are.
    pub fn wants_top_candidates(&self) -> bool {
        self.guide.get().is_none()
            && self
                .sampler
                .draws_from_top(crate::backend::Device::TOP_CANDIDATES)
    }

    /// The pick from row `i`'s top-k candidates and log-normaliser alone (see
    /// [`Sampler::draws_from_top`]: the pick the row itself gives), when no grammar constrains it and the
    /// device found them; else `None` and the row itself is read.
    fn pick_top(&mut self, rows: &mut LogitRows<'_>, i: usize) -> Option<Sampled> {
        if !self.wants_top_candidates() {
            return None;
        }
        let lse = rows.best(i)?.lse;
        let top = rows.candidates(i)?;
        Some(self.sampler.pick_from_top(top.iter(), lse))
    }

    /// The pick from row `i`'s best alone, when that is all the sampler needs (greedy, nothing added to
    /// the logits, no alternatives reported), the device reduced the row, and the grammar (if any, when
    /// checking a token is exact) allows the token; else `None` and the row itself is read.
    fn pick_best(
        &mut self,
        rows: &mut LogitRows<'_>,
        i: usize,
        tok: &Tokenizer,
    ) -> Result<Option<Sampled>, EngineError> {
        if !self.sampler.needs_only_best() {
            return Ok(None);
        }
        let Some(b) = rows.best(i) else {
            return Ok(None);
        };
        if let Some(g) = self.guide.get_mut()
            && !(self.lazy_ok && g.lazy_mask() && g.allows(b.token, tok)?)
        {
            return Ok(None);
        }
        Ok(Some(Sampled {
            token: b.token,
            logprob: b.logit - b.lse,
            top: Vec::new(),
        }))
    }

    /// The pick from a whole row (modified in place by bias, penalties and the grammar's mask).
    fn pick_row(&mut self, logits: &mut [f32], tok: &Tokenizer) -> Result<Sampled, EngineError> {
        self.sampler.process(logits, &self.history);
        let lazy_ok = self.lazy_ok;
        Ok(match self.guide.get_mut() {
            None => self.sampler.pick(logits),
            // Sample first; compute the mask only if the grammar rejects the token (exact here).
            Some(g) if lazy_ok && g.lazy_mask() => {
                let s = self.sampler.pick(logits);
                if g.allows(s.token, tok)? {
                    s
                } else {
                    g.mask_logits(logits, tok)?;
                    self.sampler.pick(logits)
                }
            }
            Some(g) => {
                g.mask_logits(logits, tok)?;
                self.sampler.pick(logits)
            }
        })
    }

    /// Takes the chosen token and any the grammar forces after it.
    fn commit(
        &mut self,
        s: Sampled,
        tok: &Tokenizer,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<(), EngineError> {
        self.step.clear();
        self.step.push(s);
        if let Some(g) = self.guide.get_mut() {
            g.commit(self.step[0].token, tok)?;
            g.take_forced(
                self.limit.saturating_sub(self.tokens.len() + 1),
                &mut self.forced,
                tok,
            )?;
            self.step
                .extend(self.forced.iter().map(|&t| forced_sample(t)));
        }
        let mut i = 0;
        while i < self.step.len() {
            let s = std::mem::replace(&mut self.step[i], forced_sample(0));
            i += 1;
            if let Some(f) = self.take_token(s, tok, on_text)? {
                self.finish = Some(f);
                return Ok(());
            }
        }
        if self.guide.get().is_some_and(Guide::is_done) {
            self.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        self.check_end();
        Ok(())
    }

    /// Commits one chosen token; returns why generation ends, if it does here.
    fn take_token(
        &mut self,
        s: Sampled,
        tok: &Tokenizer,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Option<FinishReason>, EngineError> {
        let t = s.token;
        self.tokens.push(t);
        self.history.push(t);
        self.sampled.push(s);
        let eog = !self.req.ignore_eos && (tok.is_eog(t) || self.req.stop_tokens.contains(&t));
        if eog {
            return Ok(Some(FinishReason::Stop));
        }
        if self.trigger.is_some() && (!tok.is_control(t) || self.req.shown_controls.contains(&t)) {
            self.gen_bytes.extend_from_slice(tok.token_bytes(t));
        }
        self.delta.clear();
        self.detok.push(tok, t, &mut self.delta);
        if let Some((b, st)) = &mut self.think {
            st.push(b, self.tokens.len(), &self.delta);
        }
        if !self.stop.push(&self.delta, on_text) {
            self.pending.push(t);
            return Ok(None);
        }
        let (Some(trig), Some(g)) = (self.trigger.clone(), self.guide.get_mut()) else {
            return Ok(Some(FinishReason::Stop));
        };
        if self.stop.matched() != Some(trig.as_str()) || g.is_active() {
            return Ok(Some(FinishReason::Stop));
        }
        // The trigger: hand it (and whatever followed it inside this token) to the grammar.
        self.prose = std::mem::replace(&mut self.stop, StopBuffer::new(Vec::new())).finish(on_text);
        let tail = trigger_tail(&self.gen_bytes, trig.as_bytes());
        let kept = std::str::from_utf8(tail)
            .ok()
            .map(|x| tok.encode_showing(x, &self.req.shown_controls))
            .transpose()?
            .map(|toks| g.activate(&toks, tok))
            .transpose()?
            .unwrap_or(false);
        if kept {
            self.stop
                .push(std::str::from_utf8(tail).unwrap_or(&trig), on_text);
            self.pending.push(t);
        } else {
            // This token carries bytes past the trigger that the grammar rejects: re-spell the token's
            // text up to the end of the trigger and let the grammar continue from there.
            let bytes = tok.token_bytes(t);
            let cut = bytes.len().checked_sub(tail.len() - trig.len());
            let head = cut
                .and_then(|c| std::str::from_utf8(&bytes[..c]).ok())
                .ok_or_else(|| {
                    GrammarError::Matcher(format!(
                        "cannot re-spell the token that completed the trigger {trig:?}"
                    ))
                })?;
            let respelled = tok.encode_showing(head, &self.req.shown_controls)?;
            self.tokens.pop();
            self.history.pop();
            self.sampled.pop();
            self.tokens.extend_from_slice(&respelled);
            self.history.extend_from_slice(&respelled);
            self.sampled
                .extend(respelled.iter().map(|&x| forced_sample(x)));
            self.pending.extend_from_slice(&respelled);
            let trig_toks = tok.encode_showing(&trig, &self.req.shown_controls)?;
            if !g.activate(&trig_toks, tok)? {
                return Err(GrammarError::Matcher(format!(
                    "the grammar does not start with its trigger {trig:?}"
                ))
                .into());
            }
            self.stop.push(&trig, on_text);
        }
        self.detok = DetokState::showing(&self.req.shown_controls);
        // What the grammar forces right after the trigger joins this step.
        g.take_forced(
            self.limit.saturating_sub(self.tokens.len()),
            &mut self.forced,
            tok,
        )?;
        self.step
            .extend(self.forced.iter().map(|&x| forced_sample(x)));
        Ok(None)
    }

    /// Flushes the text still held back and returns what was generated.
    pub fn finish(mut self, on_text: &mut dyn FnMut(&str)) -> Decoded {
        let finish = self.finish.unwrap_or(FinishReason::Length);
        if finish == FinishReason::Length {
            self.delta.clear();
            self.detok.finish(&mut self.delta);
            self.stop.push(&self.delta, on_text);
        }
        // Only the request's own stop strings (the tool-call trigger ends prose the same way).
        let stop_string = self
            .stop
            .matched()
            .filter(|m| self.req.stop.iter().any(|s| s == m))
            .map(str::to_owned);
        let mut text = self.prose;
        text.push_str(&self.stop.finish(on_text));
        Decoded {
            tokens: self.tokens,
            text,
            sampled: self.sampled,
            finish,
            stop_string,
            forward_passes: self.forward_passes,
        }
    }
}

/// The generated bytes from the last occurrence of `trigger` on.
fn trigger_tail<'a>(bytes: &'a [u8], trigger: &[u8]) -> &'a [u8] {
    let at = bytes
        .windows(trigger.len().max(1))
        .rposition(|w| w == trigger)
        .unwrap_or(bytes.len().saturating_sub(trigger.len()));
    &bytes[at..]
}

#[cfg(test)]
mod tests;
