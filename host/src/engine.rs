//! The engine: a loaded model with its KV cache, turning prompts into tokens.
//!
//! This is the synchronous core that the scheduler (continuous batching, paged KV, prefix cache) will wrap.
//! Today it serves one sequence at a time and already reuses the longest common prefix of the previous
//! prompt+output that is still in the KV cache, so a multi-turn conversation only prefills the new turn.
//!
//! Prompts are prefilled in micro-batches of [`PREFILL_CHUNK`] tokens (weights are read once per batch), then
//! tokens are decoded one at a time; text is streamed through an incremental detokenizer and a stop-string
//! buffer that never emits text that might turn out to be part of a stop string.

pub mod service;
mod stop;

pub use stop::StopBuffer;

use crate::backend::cpu::Cpu;
use crate::gguf::{Gguf, GgufError};
use crate::kv::{KvCache, KvDtype};
use crate::model::ModelError;
use crate::model::llama::{Llama, Logits, Precision, Profile, Scratch};
use crate::sample::grammar::{GrammarError, GrammarFactory};
use crate::sample::guide::Guide;
use crate::sample::{Sampled, Sampler, SamplingParams};
use crate::tokenizer::{TokenId, Tokenizer, TokenizerError};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Tokens per prefill micro-batch.
pub const PREFILL_CHUNK: usize = 256;

/// What can go wrong running the engine.
#[derive(Debug, Error)]
pub enum EngineError {
    /// Loading the file.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// Loading or running the model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Building the tokenizer.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A grammar that does not compile or a matcher failure.
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    /// A request the engine cannot serve (empty prompt, too long, ...).
    #[error("invalid request: {0}")]
    Request(String),
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// CPU threads (0 = one per physical core).
    pub threads: usize,
    /// Context length (KV positions); 0 = the model's training context.
    pub context: usize,
    /// KV cache element type.
    pub kv_dtype: KvDtype,
    /// Arithmetic of the forward pass.
    pub precision: Precision,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: 0,
            context: 4096,
            kv_dtype: KvDtype::F16,
            precision: Precision::Quantized,
        }
    }
}

/// A generation request.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<TokenId>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop strings: generation ends before the first occurrence, which is not returned.
    pub stop: Vec<String>,
    /// Extra stop tokens besides the model's end-of-generation tokens.
    pub stop_tokens: Vec<TokenId>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Set from another thread to stop generating (a client went away); checked before every step.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Request {
    /// A greedy request for `max_tokens` tokens.
    pub fn greedy(prompt: Vec<TokenId>, max_tokens: usize) -> Self {
        Request {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            stop_tokens: vec![],
            ignore_eos: false,
            cancel: None,
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the context was reached.
    Length,
    /// [`Request::cancel`] was set.
    Cancelled,
}

impl FinishReason {
    /// Its name in words (`stop`, `length`, `cancelled`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Timings and counts of one generation.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Decode forward passes (fewer than tokens when a grammar forced some).
    pub forward_passes: usize,
    /// Time to prefill the uncached prompt.
    pub prefill: Duration,
    /// Time spent decoding.
    pub decode: Duration,
}

impl Stats {
    /// Prefilled tokens per second.
    pub fn prefill_tps(&self) -> f64 {
        (self.prompt_tokens - self.cached_tokens) as f64 / self.prefill.as_secs_f64().max(1e-9)
    }

    /// Decoded tokens per second (the first token comes from the prefill).
    pub fn decode_tps(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// The result of a generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated tokens (including a final end-of-generation token, if any).
    pub tokens: Vec<TokenId>,
    /// Generated text, cut before any stop string; end-of-generation tokens are not rendered.
    pub text: String,
    /// Per-token sampling details (log-probabilities).
    pub sampled: Vec<Sampled>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Timings.
    pub stats: Stats,
}

/// A loaded model ready to generate.
#[derive(Debug)]
pub struct Engine {
    cpu: Cpu,
    model: Llama,
    tokenizer: Arc<Tokenizer>,
    grammar: std::sync::OnceLock<GrammarFactory>,
    gguf: Arc<Gguf>,
    kv: KvCache,
    scratch: Scratch,
    /// The tokens whose KV the cache holds, in order.
    cached: Vec<TokenId>,
    logits: Vec<f32>,
}

impl Engine {
    /// Loads the GGUF at `path`.
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Self, EngineError> {
        let gguf = Arc::new(Gguf::open(path)?);
        Self::from_gguf(gguf, cfg)
    }

    /// Builds an engine from a parsed GGUF.
    pub fn from_gguf(gguf: Arc<Gguf>, cfg: &EngineConfig) -> Result<Self, EngineError> {
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf)?);
        let mut model = Llama::load(Arc::clone(&gguf))?;
        model.set_precision(cfg.precision);
        let ctx = if cfg.context == 0 {
            model.config().ctx_train
        } else {
            cfg.context
        };
        let kv = model.new_cache(ctx, cfg.kv_dtype);
        Ok(Engine {
            cpu: Cpu::new(cfg.threads),
            tokenizer,
            grammar: std::sync::OnceLock::new(),
            gguf,
            kv,
            scratch: Scratch::default(),
            cached: Vec::new(),
            logits: Vec::new(),
            model,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The grammar factory for this model's vocabulary (built on first use).
    pub fn grammars(&self) -> Result<&GrammarFactory, GrammarError> {
        if let Some(g) = self.grammar.get() {
            return Ok(g);
        }
        let g = GrammarFactory::new(Arc::clone(&self.tokenizer))?;
        Ok(self.grammar.get_or_init(|| g))
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The model file.
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// The CPU backend.
    pub fn cpu(&self) -> &Cpu {
        &self.cpu
    }

    /// Context capacity in tokens.
    pub fn context(&self) -> usize {
        self.kv.capacity()
    }

    /// Turns per-stage timing of the forward pass on (fresh counters) or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.scratch.profile = on.then(Profile::default);
    }

    /// The per-stage timings collected since profiling was turned on.
    pub fn profile(&self) -> Option<&Profile> {
        self.scratch.profile.as_ref()
    }

    /// Drops the KV cache contents.
    pub fn reset(&mut self) {
        self.kv.truncate(0);
        self.cached.clear();
    }

    /// Makes the cache hold `prompt` and leaves the last position's logits in `self.logits`.
    /// Returns how many prompt tokens were reused from the cache.
    pub fn prefill(&mut self, prompt: &[TokenId]) -> Result<usize, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::Request("the prompt is empty".into()));
        }
        if prompt.len() >= self.kv.capacity() {
            return Err(EngineError::Request(format!(
                "the prompt has {} tokens; the context holds {}",
                prompt.len(),
                self.kv.capacity()
            )));
        }
        // Reuse the common prefix, but always recompute at least the last token (its logits are needed).
        let lcp = self
            .cached
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        self.kv.truncate(lcp);
        self.cached.truncate(lcp);
        let mut pos = lcp;
        while pos < prompt.len() {
            let end = (pos + PREFILL_CHUNK).min(prompt.len());
            let want = if end == prompt.len() {
                Logits::Last
            } else {
                Logits::None
            };
            let chunk = &prompt[pos..end];
            let out = self
                .model
                .forward(&self.cpu, &mut self.kv, chunk, want, &mut self.scratch);
            let out = match out {
                Ok(o) => o,
                Err(e) => {
                    self.reset();
                    return Err(e.into());
                }
            };
            if want == Logits::Last {
                self.logits.clear();
                self.logits.extend_from_slice(out);
            }
            self.cached.extend_from_slice(chunk);
            pos = end;
        }
        Ok(lcp)
    }

    /// The logits after the last prefill or step.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Generates for `req`, calling `on_text` with each piece of text as soon as it is final.
    pub fn generate(
        &mut self,
        req: &Request,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation, EngineError> {
        self.generate_guided(req, None, on_text)
    }

    /// [`Engine::generate`] steered by `guide`: once its grammar is active (from the start, or from the
    /// moment the output contains its trigger) every token is restricted to what the grammar allows, tokens
    /// the grammar forces are committed without sampling and ride in the next forward pass, and generation
    /// ends when the grammar is complete.
    ///
    /// Stop strings apply to text outside tool calls: up to a trigger, or throughout for a guide that
    /// constrains the answer itself (`response_format`). `on_text` receives everything, tool-call markup
    /// included; splitting it into content and calls is [`crate::tools::ToolSet::reply`]'s job.
    pub fn generate_guided(
        &mut self,
        req: &Request,
        mut guide: Option<&mut Guide>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation, EngineError> {
        let vocab = self.model.config().vocab;
        if let Some(&bad) = req
            .prompt
            .iter()
            .chain(&req.stop_tokens)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(EngineError::Request(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let t0 = Instant::now();
        let cached_tokens = self.prefill(&req.prompt)?;
        let prefill = t0.elapsed();
        let t1 = Instant::now();
        let mut sampler = Sampler::new(req.sampling.clone(), vocab);
        let lazy_ok = sampler.lazy_mask_is_exact();
        let mut history: Vec<TokenId> = req.prompt.clone();
        let mut tokens = Vec::new();
        let mut sampled_all = Vec::new();
        let trigger = guide
            .as_deref()
            .filter(|g| !g.is_active())
            .and_then(|g| g.trigger().map(str::to_owned));
        let stops_apply = guide.as_deref().is_none_or(Guide::stops_apply) || trigger.is_some();
        let mut stops = if stops_apply {
            req.stop.clone()
        } else {
            Vec::new()
        };
        stops.extend(trigger.clone());
        let mut stop = StopBuffer::new(stops);
        // Text before the trigger, once the grammar has taken over.
        let mut prose = String::new();
        // Bytes generated so far, kept only to locate a trigger inside the tokens.
        let mut gen_bytes: Vec<u8> = Vec::new();
        let Engine {
            cpu,
            model,
            tokenizer,
            kv,
            scratch,
            cached,
            logits: last_logits,
            ..
        } = self;
        let mut detok = tokenizer.detokenizer(false);
        let mut delta = String::new();
        let mut finish = FinishReason::Length;
        let limit = req.max_tokens.min(kv.capacity() - req.prompt.len());
        // Tokens chosen but not yet run through the model: the last sampled one, plus any the grammar
        // forced after it. They go through the next forward pass together (a mini-prefill), so forced
        // tokens cost no decode step of their own.
        let mut pending: Vec<TokenId> = Vec::new();
        let mut forward_passes = 0usize;
        let mut step: Vec<Sampled> = Vec::with_capacity(16);
        let mut forced: Vec<TokenId> = Vec::with_capacity(64);
        let forced_sample = |token| Sampled {
            token,
            // Forced: probability 1 under the constraint.
            logprob: 0.0,
            top: Vec::new(),
        };
        'decode: while tokens.len() < limit {
            if req.cancelled() {
                finish = FinishReason::Cancelled;
                break;
            }
            if !pending.is_empty() {
                let out = model.forward(cpu, kv, &pending, Logits::Last, scratch)?;
                forward_passes += 1;
                last_logits.clear();
                last_logits.extend_from_slice(out);
                cached.append(&mut pending);
            }
            sampler.process(last_logits, &history);
            let s = match guide.as_deref_mut() {
                None => sampler.pick(last_logits),
                // Sample first; compute the mask only if the grammar rejects the token (exact here).
                Some(g) if lazy_ok && g.lazy_mask() => {
                    let s = sampler.pick(last_logits);
                    if g.allows(s.token, tokenizer)? {
                        s
                    } else {
                        g.mask_logits(last_logits, tokenizer)?;
                        sampler.pick(last_logits)
                    }
                }
                Some(g) => {
                    g.mask_logits(last_logits, tokenizer)?;
                    sampler.pick(last_logits)
                }
            };
            step.clear();
            step.push(s);
            if let Some(g) = guide.as_deref_mut() {
                g.commit(step[0].token, tokenizer)?;
                g.take_forced(
                    limit.saturating_sub(tokens.len() + 1),
                    &mut forced,
                    tokenizer,
                )?;
                step.extend(forced.iter().map(|&t| forced_sample(t)));
            }
            let mut i = 0;
            while i < step.len() {
                let s = std::mem::replace(&mut step[i], forced_sample(0));
                i += 1;
                let tok = s.token;
                tokens.push(tok);
                history.push(tok);
                sampled_all.push(s);
                let eog =
                    !req.ignore_eos && (tokenizer.is_eog(tok) || req.stop_tokens.contains(&tok));
                if eog {
                    finish = FinishReason::Stop;
                    break 'decode;
                }
                if trigger.is_some() && !tokenizer.is_control(tok) {
                    gen_bytes.extend_from_slice(tokenizer.token_bytes(tok));
                }
                delta.clear();
                detok.push(tok, &mut delta);
                if !stop.push(&delta, on_text) {
                    pending.push(tok);
                    continue;
                }
                let (Some(trig), Some(g)) = (trigger.as_deref(), guide.as_deref_mut()) else {
                    finish = FinishReason::Stop;
                    break 'decode;
                };
                if stop.matched() != Some(trig) || g.is_active() {
                    finish = FinishReason::Stop;
                    break 'decode;
                }
                // The trigger: hand it (and whatever followed it inside this token) to the grammar.
                prose = std::mem::replace(&mut stop, StopBuffer::new(Vec::new())).finish(on_text);
                let tail = trigger_tail(&gen_bytes, trig.as_bytes());
                let kept = std::str::from_utf8(tail)
                    .ok()
                    .map(|t| tokenizer.encode(t, false))
                    .transpose()?
                    .map(|toks| g.activate(&toks, tokenizer))
                    .transpose()?
                    .unwrap_or(false);
                if kept {
                    stop.push(std::str::from_utf8(tail).unwrap_or(trig), on_text);
                    pending.push(tok);
                } else {
                    // This token carries bytes past the trigger that the grammar rejects: re-spell the
                    // token's text up to the end of the trigger and let the grammar continue from there.
                    let bytes = tokenizer.token_bytes(tok);
                    let cut = bytes.len().checked_sub(tail.len() - trig.len());
                    let head = cut
                        .and_then(|c| std::str::from_utf8(&bytes[..c]).ok())
                        .ok_or_else(|| {
                            GrammarError::Matcher(format!(
                                "cannot re-spell the token that completed the trigger {trig:?}"
                            ))
                        })?;
                    let respelled = tokenizer.encode(head, false)?;
                    tokens.pop();
                    history.pop();
                    sampled_all.pop();
                    tokens.extend_from_slice(&respelled);
                    history.extend_from_slice(&respelled);
                    sampled_all.extend(respelled.iter().map(|&t| forced_sample(t)));
                    pending.extend_from_slice(&respelled);
                    let trig_toks = tokenizer.encode(trig, false)?;
                    if !g.activate(&trig_toks, tokenizer)? {
                        return Err(GrammarError::Matcher(format!(
                            "the grammar does not start with its trigger {trig:?}"
                        ))
                        .into());
                    }
                    stop.push(trig, on_text);
                }
                detok = tokenizer.detokenizer(false);
                // What the grammar forces right after the trigger joins this step.
                g.take_forced(limit.saturating_sub(tokens.len()), &mut forced, tokenizer)?;
                step.extend(forced.iter().map(|&t| forced_sample(t)));
            }
            if guide.as_deref().is_some_and(Guide::is_done) {
                finish = FinishReason::Stop;
                break;
            }
        }
        if finish == FinishReason::Length {
            delta.clear();
            detok.finish(&mut delta);
            stop.push(&delta, on_text);
        }
        prose.push_str(&stop.finish(on_text));
        let text = prose;
        let stats = Stats {
            forward_passes,
            prompt_tokens: req.prompt.len(),
            cached_tokens,
            generated: tokens.len(),
            prefill,
            decode: t1.elapsed(),
        };
        Ok(Generation {
            tokens,
            text,
            sampled: sampled_all,
            finish,
            stats,
        })
    }

    /// Runs `tokens` (appended to the cache) through the model and returns the last position's logits, as one
    /// decode step does (benchmarks replay a fixed text this way).
    pub fn step(&mut self, tokens: &[TokenId]) -> Result<&mut [f32], EngineError> {
        let out = self.model.forward(
            &self.cpu,
            &mut self.kv,
            tokens,
            Logits::Last,
            &mut self.scratch,
        )?;
        self.logits.clear();
        self.logits.extend_from_slice(out);
        self.cached.extend_from_slice(tokens);
        Ok(&mut self.logits)
    }

    /// Runs `tokens` through the model without sampling (benchmarks): returns the time the forward pass took.
    pub fn eval(&mut self, tokens: &[TokenId]) -> Result<Duration, EngineError> {
        let t = Instant::now();
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            self.model.forward(
                &self.cpu,
                &mut self.kv,
                chunk,
                Logits::Last,
                &mut self.scratch,
            )?;
            self.cached.extend_from_slice(chunk);
        }
        Ok(t.elapsed())
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
