//! Continuous batching: many sequences share every forward pass.
//!
//! Each step the scheduler admits waiting requests (first come, first served) while the batch has room and
//! KV pages can be had, then builds one batch: every decoding sequence's pending tokens, then chunks of
//! prompts still prefilling, up to a per-step token budget, so a long prompt never stalls running decodes
//! for more than one chunk. One forward pass runs the lot; each sequence whose last position came back
//! gets its logits and its [`Decoder`] picks the next tokens. Finished sequences leave the batch at once
//! and their KV stays in the prefix cache.
//!
//! When a step cannot get the pages it needs, the youngest running sequence is preempted: its KV goes into
//! the prefix tree (so it is not lost unless memory stays short long enough for eviction to take it), and
//! it goes back to the head of the queue with its decoder intact. On readmission it recomputes whatever
//! was evicted and carries on. Memory pressure slows requests down; it never fails or drops one.

use super::decoder::{Decoder, GuideSlot};
use super::step::{Pass, StepPlan};
use super::{Engine, EngineError, Generation, Request, Timing};
use crate::kv::{KvError, Logits, SeqKv};
use crate::sample::guide::Guide;
use crate::tokenizer::TokenId;
use std::collections::VecDeque;
use std::time::Instant;

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in one batch.
    pub max_batch: usize,
    /// Most tokens in one forward pass (decodes always fit; prompt chunks fill the rest).
    pub step_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batch: 8,
            step_tokens: super::PREFILL_CHUNK,
        }
    }
}

/// Where a sequence's text and result go (called on the engine's thread).
pub trait Sink {
    /// A piece of text that is final.
    fn text(&mut self, text: &str);
    /// The end: the whole generation, or why it failed.
    fn done(self: Box<Self>, result: Result<Generation, EngineError>);
}

/// A request for the scheduler: what to generate, steered by an optional guide, reported to a sink.
pub struct Submission {
    /// The request (prompt tokens included).
    pub request: Request,
    /// The grammar guide, if any.
    pub guide: Option<Box<Guide>>,
    /// Receives text and the result.
    pub sink: Box<dyn Sink>,
}

impl std::fmt::Debug for Submission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submission")
            .field("prompt_tokens", &self.request.prompt.len())
            .finish_non_exhaustive()
    }
}

struct Active<'a> {
    dec: Decoder<'a>,
    sink: Box<dyn Sink + 'a>,
    seq: Option<SeqKv>,
    /// Prompt tokens served from cache at the first admission.
    cached: Option<usize>,
    /// When it was first admitted.
    admitted: Option<Instant>,
    /// When the first logits came back (the end of its prefill).
    first: Option<Instant>,
    preemptions: usize,
}

/// One running sequence's share of the next pass, as planned.
#[derive(Debug, Clone, Copy)]
struct Share {
    /// Its index in the batch.
    i: usize,
    /// Tokens it runs (a tree's nodes included).
    n: usize,
    /// Logits it wants back.
    want: Logits,
    /// Whether it verifies a draft tree after its pending tokens.
    tree: bool,
}

/// Counters of the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Forward passes run.
    pub steps: u64,
    /// Sequences those passes carried, summed (mean batch = this / steps).
    pub batched_sequences: u64,
    /// Sequences preempted for memory.
    pub preemptions: u64,
    /// Sequences finished.
    pub finished: u64,
    /// Tokens in the largest forward pass (bounded by `step_tokens` plus one per other decode).
    pub max_step_tokens: u64,
    /// Where the engine thread's steps spent their wall time.
    pub time: StepTimes,
}

/// Wall time of the scheduler's steps by phase, in nanoseconds (what the server's
/// `thorn_engine_seconds_total` reports). A pass that carries prompt tokens and decodes together is split
/// between `prefill` and `decode` by its share of tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimes {
    /// Forward passes over prompt tokens.
    pub prefill: u64,
    /// Forward passes over generated tokens: decode steps, grammar-forced runs and draft-tree verification.
    pub decode: u64,
    /// Choosing tokens from the logits: sampling, grammar masks and forced tokens, accepting a tree's path,
    /// detokenizing and streaming.
    pub sample: u64,
    /// Admission, planning and drafting trees.
    pub plan: u64,
}

/// Nanoseconds of a duration, saturating.
fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The batch scheduler; runs on the engine's thread. `'a` bounds what its sequences borrow (a lone
/// generation's guide and callback); the server's scheduler owns everything (`'static`).
#[derive(Default)]
pub struct Scheduler<'a> {
    cfg: SchedulerConfig,
    waiting: VecDeque<Active<'a>>,
    running: Vec<Active<'a>>,
    stats: SchedulerStats,
    /// The next pass as planned: each running sequence's share.
    plan: Vec<Share>,
    /// The planned step handed to the engine (its sequences moved in for the pass).
    step: StepPlan,
    /// Where the number of waiting sequences is published as soon as admission changes it (the server's
    /// queue limit reads it), so a sequence that finishes within its first step never still counts as
    /// waiting when its client hears the answer and sends the next request.
    waiting_gauge: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
}

impl std::fmt::Debug for Scheduler<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl<'a> Scheduler<'a> {
    /// An idle scheduler.
    pub fn new(cfg: SchedulerConfig) -> Self {
        Scheduler {
            cfg: SchedulerConfig {
                max_batch: cfg.max_batch.max(1),
                step_tokens: cfg.step_tokens.max(1),
            },
            ..Scheduler::default()
        }
    }

    /// Publishes [`Self::waiting`] to `gauge` after every admission.
    pub fn set_waiting_gauge(&mut self, gauge: std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        self.waiting_gauge = Some(gauge);
    }

    /// Sequences waiting for admission.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences in the batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether there is anything to do.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// Queues a request (checked against the engine's vocabulary and context first).
    pub fn submit(&mut self, engine: &Engine, sub: Submission) {
        let Submission {
            request,
            guide,
            sink,
        } = sub;
        let slot = match guide {
            Some(g) => GuideSlot::Owned(g),
            None => GuideSlot::None,
        };
        self.enqueue(engine, request, slot, sink);
    }

    /// [`Scheduler::submit`] for a request whose guide and sink may borrow from the caller.
    pub(crate) fn enqueue(
        &mut self,
        engine: &Engine,
        request: Request,
        slot: GuideSlot<'a>,
        sink: Box<dyn Sink + 'a>,
    ) {
        if let Err(e) = engine.check_request(&request) {
            sink.done(Err(e));
            return;
        }
        let dec = Decoder::new(request, slot, engine.model.vocab(), engine.context);
        self.waiting.push_back(Active {
            dec,
            sink,
            seq: None,
            cached: None,
            admitted: None,
            first: None,
            preemptions: 0,
        });
    }

    /// Ends every sequence with `err` (the engine failed under them). Their KV is released when
    /// `release_kv`; after a panic it is not (the cache is rebuilt instead, its state being unknown).
    pub fn fail_all(
        &mut self,
        engine: &mut Engine,
        release_kv: bool,
        err: impl Fn() -> EngineError,
    ) {
        for a in self.running.drain(..).chain(self.waiting.drain(..)) {
            if let (Some(seq), true) = (a.seq, release_kv) {
                engine.kv.release(seq, None);
            }
            a.sink.done(Err(err()));
        }
    }

    /// Runs one step: admission, one batched forward pass, sampling. Returns whether it did anything.
    pub fn step(&mut self, engine: &mut Engine) -> bool {
        let t0 = Instant::now();
        let ran = self.step_inner(engine, t0);
        if let Some((t_pass, t_sampled)) = ran.1 {
            self.stats.time.sample += nanos(t_sampled - t_pass);
        } else if ran.0 {
            self.stats.time.plan += nanos(t0.elapsed());
        }
        ran.0
    }

    /// [`Self::step`], returning whether it did anything and, when a pass ran, when it ended and when its
    /// tokens were chosen (the phases before the pass are added here).
    fn step_inner(
        &mut self,
        engine: &mut Engine,
        t0: Instant,
    ) -> (bool, Option<(Instant, Instant)>) {
        self.sweep_cancelled(engine);
        self.admit(engine);
        // Before any sequence of this step can finish and answer its client.
        if let Some(g) = &self.waiting_gauge {
            g.store(self.waiting.len(), std::sync::atomic::Ordering::SeqCst);
        }
        if self.running.is_empty() {
            return (false, None);
        }
        if let Err(e) = self.plan(engine) {
            // Only a single sequence that cannot fit even alone gets here.
            let a = self.running.remove(self.plan_victim());
            self.finish(engine, a, Some(e.into()));
            return (true, None);
        }
        if self.plan.is_empty() {
            return (true, None);
        }
        self.stats.steps += 1;
        self.stats.batched_sequences += self.plan.len() as u64;
        // Move the planned sequences into the step: decodes (with their trees) and prompt chunks.
        self.step.clear();
        for &Share { i, n, want, tree } in &self.plan {
            let a = &mut self.running[i];
            let seq = a.seq.take().expect("running sequences hold KV");
            if want != Logits::None && a.dec.wants_top_candidates() {
                self.step.top_candidates = true;
            }
            if tree {
                let d = &a.dec;
                self.step
                    .push_tree(i, seq, d.pending(), d.tree(), d.tree_parents(), want);
            } else {
                let from = seq.len();
                self.step
                    .push(i, seq, &a.dec.history()[from..from + n], want);
            }
        }
        self.stats.max_step_tokens = self.stats.max_step_tokens.max(self.step.tokens() as u64);
        // Prompt tokens of the pass: shares of sequences whose prompt is not all in yet.
        let prompt: usize = self
            .plan
            .iter()
            .filter(|p| !p.tree && self.running[p.i].first.is_none())
            .map(|p| p.n)
            .sum();
        let total = self.step.tokens().max(1);
        let t_pass = Instant::now();
        self.stats.time.plan += nanos(t_pass - t0);
        let pass = engine.execute(&mut self.step);
        let t_done = Instant::now();
        let pass_ns = nanos(t_done - t_pass);
        let share = |n: usize| u128::try_from(n).unwrap_or(u128::MAX);
        let prefill_ns =
            u64::try_from(u128::from(pass_ns) * share(prompt.min(total)) / share(total))
                .unwrap_or(pass_ns);
        self.stats.time.prefill += prefill_ns;
        self.stats.time.decode += pass_ns - prefill_ns;
        let pass = match pass {
            Ok(p) => p,
            Err(e) => {
                for ran in self.step.drain() {
                    self.running[ran.owner].seq = Some(ran.seq);
                }
                let mut idx: Vec<usize> = self.plan.drain(..).map(|p| p.i).collect();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    let a = self.running.remove(i);
                    self.finish(engine, a, Some(e.shared()));
                }
                return (true, Some((t_done, Instant::now())));
            }
        };
        let Pass {
            logits: mut out,
            kv,
            tokenizer,
            spec,
            ..
        } = pass;
        let mut row = 0;
        let now = Instant::now();
        let mut done = Vec::new();
        for ran in self.step.drain() {
            let (i, mut seq, n, want) = (ran.owner, ran.seq, ran.tokens, ran.want);
            let a = &mut self.running[i];
            let k = match want {
                Logits::None => {
                    // A prefill chunk that ended where a hybrid model keeps a snapshot.
                    let hist = a.dec.history();
                    if kv.snapshot_point(&seq, hist, seq.len()) {
                        kv.snapshot(&seq, hist);
                    }
                    a.seq = Some(seq);
                    continue;
                }
                Logits::Last => 1,
                Logits::Tail(k) => k,
                Logits::All => n,
            };
            let first = row;
            row += k;
            if !a.dec.pending().is_empty() {
                a.dec.ran_pending();
            }
            if a.first.is_none() {
                // The prompt is in: share its full pages with requests that arrive while this one runs.
                kv.commit(&seq, &a.dec.history()[..seq.len()]);
                a.first = Some(now);
            }
            let sink = &mut a.sink;
            let res = if ran.tree {
                let r = a
                    .dec
                    .advance_tree(&mut out, first, tokenizer, &mut |t| sink.text(t), spec);
                // Keep the accepted path of the tree, stored after the pending tokens (the last of which
                // is the first of the `k` rows).
                let from = seq.len() + 1 - k;
                kv.keep_path(&mut seq, from, a.dec.accepted());
                r
            } else {
                a.dec
                    .advance(&mut out, first, tokenizer, &mut |t| sink.text(t))
            };
            a.seq = Some(seq);
            if let Err(e) = res {
                done.push((i, Some(e)));
            } else if a.dec.is_done() {
                done.push((i, None));
            }
        }
        done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        for (i, err) in done {
            let a = self.running.remove(i);
            self.finish(engine, a, err);
        }
        (true, Some((t_done, Instant::now())))
    }

    fn sweep_cancelled(&mut self, engine: &mut Engine) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].dec.request().cancelled() {
                let mut a = self.waiting.remove(i).expect("index in range");
                a.dec.cancel();
                self.finish(engine, a, None);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].dec.request().cancelled() {
                let mut a = self.running.remove(i);
                a.dec.cancel();
                self.finish(engine, a, None);
            } else {
                i += 1;
            }
        }
    }

    /// Admits waiting sequences while the batch has room and their prompts' pages can be had.
    fn admit(&mut self, engine: &mut Engine) {
        while self.running.len() < self.cfg.max_batch {
            let Some(mut a) = self.waiting.pop_front() else {
                return;
            };
            if a.dec.is_done() {
                // Nothing to generate (max_tokens 0, or cancelled while queued).
                self.finish(engine, a, None);
                continue;
            }
            let target = a.dec.history();
            let mut seq = engine.kv.acquire(target);
            a.cached.get_or_insert(seq.len());
            // The whole prompt's pages up front, so an admitted prefill never stalls half way.
            if let Err(e) = engine.kv.reserve(&mut seq, target.len()) {
                engine.kv.release(seq, None);
                if self.running.is_empty() {
                    // It cannot fit even alone (a prompt larger than the whole KV budget).
                    self.finish(engine, a, Some(e.into()));
                    continue;
                }
                self.waiting.push_front(a);
                return;
            }
            a.seq = Some(seq);
            a.admitted.get_or_insert_with(Instant::now);
            self.running.push(a);
        }
    }

    /// Chooses each running sequence's share of the next batch and reserves its pages, preempting the
    /// youngest sequences when pages run out.
    fn plan(&mut self, engine: &mut Engine) -> Result<(), KvError> {
        loop {
            self.plan.clear();
            let mut budget = self.cfg.step_tokens;
            // Decodes first (they are what users wait on), then prompt chunks, oldest first.
            for decoding in [true, false] {
                for (i, a) in self.running.iter().enumerate() {
                    let seq = a.seq.as_ref().expect("running sequences hold KV");
                    let left = a.dec.history().len() - seq.len();
                    let is_decode = a.first.is_some() && left <= a.dec.pending().len().max(1);
                    if is_decode != decoding || left == 0 {
                        continue;
                    }
                    let n = if decoding {
                        // A grammar-forced run takes at most what is left of the step's budget (one
                        // token at least), so a long `const` cannot stall the sequences batched with it;
                        // the rest rides in the next steps.
                        left.min(budget.max(1))
                    } else {
                        // Prompt chunks end where a hybrid model snapshots its state.
                        let from = seq.len();
                        let hist = a.dec.history();
                        engine
                            .kv
                            .chunk_end(seq, hist, from, from + left.min(budget))
                            - from
                    };
                    if n == 0 {
                        continue;
                    }
                    budget = budget.saturating_sub(n);
                    let want = if n == left {
                        Logits::Last
                    } else {
                        Logits::None
                    };
                    self.plan.push(Share {
                        i,
                        n,
                        want,
                        tree: false,
                    });
                }
            }
            self.draft_trees(engine)?;
            // Reserve pages; on failure preempt the youngest and plan again.
            let mut short = None;
            for &Share { i, n, .. } in &self.plan {
                let seq = self.running[i]
                    .seq
                    .as_mut()
                    .expect("running sequences hold KV");
                let len = seq.len() + n;
                if let Err(e) = engine.kv.reserve(seq, len) {
                    short = Some(e);
                    break;
                }
            }
            let Some(e) = short else {
                return Ok(());
            };
            if self.running.len() <= 1 {
                return Err(e);
            }
            let victim = self.plan_victim();
            let mut a = self.running.remove(victim);
            let seq = a.seq.take().expect("running sequences hold KV");
            let done = seq.len();
            engine.kv.release(seq, Some(&a.dec.history()[..done]));
            a.preemptions += 1;
            self.stats.preemptions += 1;
            tracing::debug!(
                "KV memory short: preempted a sequence ({done} positions cached for its return)"
            );
            self.waiting.push_front(a);
        }
    }

    /// Gives decoding sequences draft trees, sized for the batch as planned so far (a tree must pay for
    /// what it adds to everyone's pass).
    fn draft_trees(&mut self, engine: &mut Engine) -> Result<(), KvError> {
        if !engine.spec.cfg.enabled {
            return Ok(());
        }
        let mut base: usize = self.plan.iter().map(|p| p.n).sum();
        let decisions = self
            .plan
            .iter()
            .filter(|p| p.want == Logits::Last)
            .count()
            .max(1) as f32;
        for item in &mut self.plan {
            let Share { i, n, want, .. } = *item;
            let a = &mut self.running[i];
            if want != Logits::Last || a.dec.pending().len() != n || a.first.is_none() {
                continue;
            }
            let seq = a.seq.as_mut().expect("running sequences hold KV");
            let shape = crate::spec::PassShape {
                base,
                decisions,
                room: engine.context.saturating_sub(seq.len() + n),
            };
            if a.dec.wants_draft() && n == 1 {
                engine.mtp_propose(seq, a.dec.pending()[0]);
            }
            if let Err(e) = a.dec.draft(&mut engine.spec, &engine.tokenizer, shape) {
                // Drafting is an optimisation: a failure only means no tree this step.
                tracing::debug!("drafting failed: {e}");
                continue;
            }
            let t = a.dec.tree().len();
            if t > 0 {
                *item = Share {
                    i,
                    n: n + t,
                    want: Logits::Tail(t + 1),
                    tree: true,
                };
                base += t;
            }
        }
        Ok(())
    }

    /// The sequence to give up when memory is short: the most recently admitted.
    fn plan_victim(&self) -> usize {
        self.running.len() - 1
    }

    /// Ends a sequence: its KV goes to the prefix cache and its sink gets the result.
    fn finish(&mut self, engine: &mut Engine, a: Active<'a>, err: Option<EngineError>) {
        let Active {
            dec,
            mut sink,
            seq,
            cached,
            admitted,
            first,
            ..
        } = a;
        if let Some(seq) = seq {
            engine.release_sequence(seq, &dec);
        }
        self.stats.finished += 1;
        if let Some(e) = err {
            sink.done(Err(e));
            return;
        }
        let now = Instant::now();
        let started = first.unwrap_or(now);
        let timing = Timing {
            cached_tokens: cached.unwrap_or(0),
            first_token: first,
            prefill: started.saturating_duration_since(admitted.unwrap_or(started)),
            decode: now.saturating_duration_since(started),
        };
        let g = engine.finish_sequence(dec, &mut |t| sink.text(t), timing);
        sink.done(Ok(g));
    }
}

/// A sink that collects everything (tests and batch jobs).
#[derive(Debug, Default)]
pub struct Collect {
    /// Text so far.
    pub text: String,
    /// The result, once done.
    pub result: Option<Result<Generation, EngineError>>,
}

/// A [`Collect`] shared with the code that waits on it.
pub type SharedCollect = std::sync::Arc<std::sync::Mutex<Collect>>;

impl Sink for SharedCollect {
    fn text(&mut self, text: &str) {
        if let Ok(mut c) = self.lock() {
            c.text.push_str(text);
        }
    }

    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        if let Ok(mut c) = self.lock() {
            c.result = Some(result);
        }
    }
}

impl Engine {
    /// Checks a request against this engine (prompt present, tokens in the vocabulary, room to generate).
    pub fn check_request(&self, req: &Request) -> Result<(), EngineError> {
        let vocab = self.model.vocab();
        self.check_prompt(&req.prompt)?;
        if let Some(&bad) = req
            .prompt
            .iter()
            .chain(&req.stop_tokens)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(EngineError::TokenOutOfVocab { token: bad, vocab });
        }
        // Stop strings are matched against held-back text every token: bound their size here, where
        // that cost is spent.
        if req.stop.len() > super::MAX_STOPS
            || req.stop.iter().any(|s| s.len() > super::MAX_STOP_BYTES)
        {
            return Err(EngineError::Stops);
        }
        Ok(())
    }

    /// Checks that a prompt has tokens and leaves room in the context.
    pub(crate) fn check_prompt(&self, prompt: &[TokenId]) -> Result<(), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= self.context {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                context: self.context,
            });
        }
        Ok(())
    }

    /// Runs `subs` to completion together on a scheduler (tests and offline batch jobs); returns each one's
    /// text and result in order, and the scheduler's counters.
    #[expect(
        clippy::type_complexity,
        reason = "results in request order plus counters"
    )]
    pub fn generate_batch(
        &mut self,
        subs: Vec<(Request, Option<Box<Guide>>)>,
        cfg: SchedulerConfig,
    ) -> (
        Vec<(String, Result<Generation, EngineError>)>,
        SchedulerStats,
    ) {
        let mut sched = Scheduler::new(cfg);
        let outs: Vec<SharedCollect> = subs.iter().map(|_| SharedCollect::default()).collect();
        for ((request, guide), out) in subs.into_iter().zip(&outs) {
            sched.submit(
                self,
                Submission {
                    request,
                    guide,
                    sink: Box::new(std::sync::Arc::clone(out)),
                },
            );
        }
        while !sched.is_idle() {
            sched.step(self);
        }
        let results = outs
            .into_iter()
            .map(|o| {
                let mut c = o
                    .lock()
                    .map(|mut c| std::mem::take(&mut *c))
                    .unwrap_or_default();
                let r = c.result.take().unwrap_or_else(|| {
                    Err(EngineError::Internal("the sequence never finished".into()))
                });
                (c.text, r)
            })
            .collect();
        (results, sched.stats())
    }
}
