//! The engine: a loaded model with its KV cache, turning prompts into tokens.
//!
//! Its KV lives in a paged cache with a radix tree of cached prefixes ([`crate::kv`]): every request reuses
//! the longest prefix of its tokens that any earlier request left in memory, so a multi-turn conversation
//! only prefills the new turn, and interleaved conversations do not evict each other until memory runs
//! short.
//!
//! There is one step loop. A planner decides what the next forward pass carries ([`StepPlan`]: each
//! sequence's tokens as a chain or a draft tree, and the logits it wants) and [`Engine::execute`] runs it.
//! The [`scheduler`] plans for many sequences at once (the server's engine thread, [`service`], and
//! [`Engine::generate_batch`]); [`Engine::generate_guided`] is the same scheduler with one submission; a
//! [`Session`] drives one sequence by hand for benchmarks and logit tests. Each sequence's sampling,
//! grammar, speculation and text live in its [`Decoder`]; every generation ends through one finish path.
//!
//! Prompts are prefilled in micro-batches of [`PREFILL_CHUNK`] tokens (weights are read once per batch), then
//! tokens are decoded; text is streamed through an incremental detokenizer and a stop-string buffer that
//! never emits text that might turn out to be part of a stop string.

mod decoder;
pub mod scheduler;
pub mod service;
mod session;
pub mod step;
mod stop;
pub mod think;

pub use decoder::{Decoded, Decoder, GuideSlot};
pub use session::Session;
pub use step::{Pass, Ran, StepPlan};

pub use stop::StopBuffer;

use scheduler::{Scheduler, SchedulerConfig, Sink};

use crate::backend::{Device, DeviceError, DeviceKind};
use crate::gguf::{Gguf, GgufError};
use crate::kv::{Batch, KvCache, KvConfig, KvDtype, KvError, KvStats, Recurrent, SeqKv};
use crate::model::llama::{Logits, Precision, Profile};
use crate::model::{Model, ModelError, Scratch};
use crate::sample::grammar::{GrammarError, GrammarFactory};
use crate::sample::guide::Guide;
use crate::sample::{Sampled, SamplingParams};
use crate::spec::{SpecConfig, SpecStats, Speculator};
use crate::tokenizer::{TokenId, Tokenizer, TokenizerError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Most stop strings per request.
pub const MAX_STOPS: usize = 16;
/// Most bytes of one stop string.
pub const MAX_STOP_BYTES: usize = 256;

/// Tokens per prefill micro-batch.
pub const PREFILL_CHUNK: usize = 256;

/// What can go wrong running the engine. [`EngineError::is_client_error`] tells a bad request (the client's
/// fault) from a failure of the engine or its model (ours).
#[derive(Debug, Error)]
pub enum EngineError {
    /// Loading the file.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// Loading or running the model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The device cannot be opened.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Building the tokenizer.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The tokenizer names more tokens than the model has rows (a broken file).
    #[error("the tokenizer has {tokenizer} tokens, the model {model}")]
    VocabMismatch {
        /// Tokens the tokenizer knows.
        tokenizer: usize,
        /// Rows of the model's embedding.
        model: usize,
    },
    /// A grammar that does not compile or a matcher failure.
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    /// A request with no prompt tokens.
    #[error("invalid request: the prompt is empty")]
    EmptyPrompt,
    /// A prompt that leaves no room in the context.
    #[error("invalid request: the prompt has {prompt} tokens; the context holds {context}")]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Context positions.
        context: usize,
    },
    /// A token id the model does not have.
    #[error("invalid request: token id {token} is outside the vocabulary ({vocab})")]
    TokenOutOfVocab {
        /// The id.
        token: TokenId,
        /// The vocabulary size.
        vocab: usize,
    },
    /// Too many stop strings, or one too long.
    #[error(
        "invalid request: at most {MAX_STOPS} stop strings of at most {MAX_STOP_BYTES} bytes each"
    )]
    Stops,
    /// Appending tokens to the current sequence would pass the context (the lone-sequence API).
    #[error("invalid request: context full: {len} + {add} tokens > {context}")]
    ContextFull {
        /// Tokens in the sequence.
        len: usize,
        /// Tokens to append.
        add: usize,
        /// Context positions.
        context: usize,
    },
    /// KV memory ran out.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A forward pass failed; every sequence in its batch ends with this error (shared).
    #[error("forward pass failed: {0}")]
    Forward(#[source] Arc<ModelError>),
    /// The engine thread could not be started.
    #[error("engine thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The engine failed (a bug); the request is lost but the engine keeps serving.
    #[error("internal engine error: {0}")]
    Internal(String),
}

impl EngineError {
    /// Whether the request was at fault (an HTTP 400), rather than the engine or its model (a 5xx). KV
    /// exhaustion and grammar failures are neither wholly: the API maps those itself.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            EngineError::EmptyPrompt
                | EngineError::PromptTooLong { .. }
                | EngineError::TokenOutOfVocab { .. }
                | EngineError::Stops
                | EngineError::ContextFull { .. }
        )
    }
}

impl EngineError {
    /// The error for each other sequence of a pass that failed with this one: a failed forward pass is
    /// shared as it is; anything else (a bug: the plan reserved its pages) as an internal error.
    pub(crate) fn shared(&self) -> EngineError {
        match self {
            EngineError::Forward(e) => EngineError::Forward(Arc::clone(e)),
            EngineError::Kv(e) => EngineError::Kv(*e),
            other => EngineError::Internal(other.to_string()),
        }
    }
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The device the model runs on.
    pub device: DeviceKind,
    /// CPU threads (0 = one per physical core).
    pub threads: usize,
    /// CUDA graphs on a GPU device (see `backend::Device::set_graphs`).
    pub cuda_graphs: bool,
    /// Q4_1 weights packed for aligned loads on a GPU device (see `backend::Device::set_packed_weights`).
    pub packed_weights: bool,
    /// Programmatic dependent launch on a GPU device of sm_90 or later (see `backend::Device::set_pdl`).
    pub pdl: bool,
    /// Where a GPU device caches its compiled kernels (`None`: compiled at every start). The default is
    /// [`default_kernel_cache`](crate::backend::default_kernel_cache), `kernels/` under thorn's cache
    /// directory from the environment; the host passes the one under its `--cache-dir`.
    pub kernel_cache: Option<PathBuf>,
    /// The CPU attention kernels' products (f32 by default; bf16 where the CPU has them).
    pub attention: crate::backend::AttentionMath,
    /// Context length (KV positions); 0 = the model's training context.
    pub context: usize,
    /// KV cache element type.
    pub kv_dtype: KvDtype,
    /// KV cache memory budget in bytes (0 = room for four full contexts).
    pub kv_memory: usize,
    /// Positions per KV page.
    pub page_size: usize,
    /// Whether finished requests leave their generated tokens in the prefix cache (not only the prompt).
    pub cache_output: bool,
    /// Arithmetic of the forward pass.
    pub precision: Precision,
    /// Speculative decoding.
    pub speculation: SpecConfig,
    /// Bytes of the KV memory set aside for recurrent-state snapshots of hybrid models (0 = a quarter of
    /// it, or room for 32 snapshots with the automatic KV budget).
    pub state_memory: usize,
    /// A hybrid model snapshots its recurrent state every this many positions of a long prefill.
    pub snapshot_interval: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            device: DeviceKind::Cpu,
            threads: 0,
            cuda_graphs: true,
            packed_weights: true,
            pdl: false,
            kernel_cache: crate::backend::default_kernel_cache(),
            attention: crate::backend::AttentionMath::F32,
            context: 4096,
            kv_dtype: KvDtype::F16,
            kv_memory: 0,
            page_size: KvConfig::PAGE_SIZE,
            cache_output: true,
            precision: Precision::Quantized,
            speculation: SpecConfig::default(),
            state_memory: 0,
            snapshot_interval: KvConfig::SNAPSHOT_INTERVAL,
        }
    }
}

/// When a generation's phases happened, for its [`Stats`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: usize,
    /// When the first token was sampled.
    pub first_token: Option<Instant>,
    /// Time to prefill the uncached prompt.
    pub prefill: Duration,
    /// Time spent decoding.
    pub decode: Duration,
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
    /// Whether this request may speculate (when the engine does; the output is the same either way).
    pub speculate: bool,
    /// A thinking model's reasoning budget: the engine closes the think block when it is spent.
    pub think_budget: Option<think::ThinkBudget>,
    /// Control tokens the output shows as their text (a tool-call format's syntax, such as Mistral's
    /// `[TOOL_CALLS]` or harmony's `<|channel|>`); every other control token is left out of the text.
    pub shown_controls: Vec<TokenId>,
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
            speculate: true,
            think_budget: None,
            shown_controls: vec![],
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
    /// When the first token was sampled (the end of the prefill), if one was.
    pub first_token: Option<Instant>,
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
    /// The request's stop string it ended on ([`FinishReason::Stop`] from a stop string, not a token).
    pub stop_string: Option<String>,
    /// Timings.
    pub stats: Stats,
}

/// What speculation a model can verify: hybrids verify chains (their recurrent state cannot branch).
fn fit_speculation(model: &Model, mut cfg: SpecConfig) -> SpecConfig {
    if model.is_hybrid() {
        cfg.top_k = 1;
    }
    cfg
}

/// A loaded model ready to generate.
#[derive(Debug)]
pub struct Engine {
    device: Device,
    model: Model,
    tokenizer: Arc<Tokenizer>,
    grammar: std::sync::OnceLock<GrammarFactory>,
    gguf: Arc<Gguf>,
    kv: KvCache,
    /// Positions one sequence may use.
    context: usize,
    batch: Batch,
    scratch: Scratch,
    spec: Speculator,
    /// The recurrent states of a pass's sequences, moved out of them for the forward pass (hybrids).
    states: Vec<Recurrent>,
    /// The one-token batch of an MTP draft.
    mtp_batch: Batch,
}

impl Engine {
    /// Loads the GGUF at `path`.
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Self, EngineError> {
        let gguf = Arc::new(Gguf::open(path)?);
        Self::from_gguf(gguf, cfg)
    }

    /// Builds an engine from a parsed GGUF, on the device `cfg` names.
    pub fn from_gguf(gguf: Arc<Gguf>, cfg: &EngineConfig) -> Result<Self, EngineError> {
        let device = cfg.device.open(cfg.threads, cfg.kernel_cache.as_deref())?;
        device.set_packed_weights(cfg.packed_weights);
        let model = Model::from_gguf(Arc::clone(&gguf), &device)?;
        Self::with_model(gguf, model, device, cfg)
    }

    /// Builds an engine around `model` (loaded elsewhere for `device`, e.g. from a Hugging Face checkpoint),
    /// with the tokenizer and chat template of `gguf`.
    pub fn with_model(
        gguf: Arc<Gguf>,
        mut model: Model,
        device: Device,
        cfg: &EngineConfig,
    ) -> Result<Self, EngineError> {
        device.set_graphs(cfg.cuda_graphs);
        device.set_attention(cfg.attention);
        if cfg.pdl && !device.set_pdl(true) {
            tracing::info!(
                "programmatic dependent launch asked for: {} does not have it",
                device.name()
            );
        }
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf)?);
        if tokenizer.vocab_size() > model.vocab() {
            return Err(EngineError::VocabMismatch {
                tokenizer: tokenizer.vocab_size(),
                model: model.vocab(),
            });
        }
        model.set_precision(cfg.precision);
        let ctx = if cfg.context == 0 {
            model.ctx_train()
        } else {
            cfg.context
        };
        let shape = model.kv_shape();
        let snapshot = 4 * shape.recurrent;
        let (memory, state_memory) = match (cfg.kv_memory, cfg.state_memory) {
            (0, 0) => {
                let states = 32 * snapshot;
                (
                    4 * ctx * shape.bytes_per_position(cfg.kv_dtype) + states,
                    states,
                )
            }
            (0, s) => (4 * ctx * shape.bytes_per_position(cfg.kv_dtype) + s, s),
            (m, 0) => (m, m / 4),
            (m, s) => (m, s.min(m)),
        };
        let turn_token = ["<|im_start|>", "<|start_header_id|>", "<start_of_turn>"]
            .into_iter()
            .find_map(|t| tokenizer.token_id(t).filter(|&id| tokenizer.is_control(id)));
        let kv = KvCache::on(
            &device,
            shape,
            KvConfig {
                dtype: cfg.kv_dtype,
                page_size: cfg.page_size,
                memory,
                cache_output: cfg.cache_output,
                state_memory,
                snapshot_interval: cfg.snapshot_interval,
                turn_token,
            },
        )?;
        let spec = Speculator::new(fit_speculation(&model, cfg.speculation.clone()));
        Ok(Engine {
            device,
            tokenizer,
            grammar: std::sync::OnceLock::new(),
            gguf,
            context: ctx.min(kv.capacity()),
            kv,
            batch: Batch::default(),
            scratch: Scratch::default(),
            spec,
            states: Vec::new(),
            mtp_batch: Batch::default(),
            model,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The tokenizer, shared.
    pub fn tokenizer_arc(&self) -> Arc<Tokenizer> {
        Arc::clone(&self.tokenizer)
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
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The model file.
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Context capacity in tokens (positions one sequence may use).
    pub fn context(&self) -> usize {
        self.context
    }

    /// The KV cache's counters.
    pub fn kv_stats(&self) -> KvStats {
        self.kv.stats()
    }

    /// The KV cache's configuration.
    pub fn kv_config(&self) -> &KvConfig {
        self.kv.config()
    }

    /// Speculation's counters.
    pub fn spec_stats(&self) -> SpecStats {
        self.spec.stats
    }

    /// Speculation's configuration.
    pub fn spec_config(&self) -> &SpecConfig {
        &self.spec.cfg
    }

    /// Changes how to speculate (calibration and store are kept, and so is a measured cost model unless
    /// `cfg` asks for another fixed cost).
    pub fn set_speculation(&mut self, cfg: SpecConfig) {
        if cfg.fixed_cost != self.spec.cfg.fixed_cost {
            self.spec.cost = crate::spec::CostModel::for_config(&cfg);
        }
        self.spec.cfg = fit_speculation(&self.model, cfg);
    }

    /// Exchanges the engine's speculator with `other` (benchmarks compare configurations, each with its
    /// own store and calibration).
    pub fn swap_speculator(&mut self, other: &mut Speculator) {
        std::mem::swap(&mut self.spec, other);
        self.spec.cfg = fit_speculation(&self.model, self.spec.cfg.clone());
    }

    /// The speculator (cost model, calibration, store).
    pub fn speculator(&self) -> &Speculator {
        &self.spec
    }

    /// Measures the cost of forward passes of 1 to 64 tokens, which sizes draft trees (they are measured
    /// while serving too; this gives the first trees a measured shape). Uses a scratch sequence that is
    /// not cached. Takes on the order of a hundred decode steps. Does nothing with a fixed cost model.
    pub fn calibrate_speculation(&mut self) -> Result<(), EngineError> {
        const SIZES: [usize; 12] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64];
        if self.spec.cost.is_fixed() {
            return Ok(());
        }
        let vocab = self.model.vocab() as u32;
        let ctx: Vec<TokenId> = (0..256u32)
            .map(|i| (100 + i) % vocab)
            .take(self.context.saturating_sub(80).min(256))
            .collect();
        if ctx.is_empty() {
            return Ok(());
        }
        let mut seq = Some(self.kv.acquire(&[]));
        let (mut plan, mut logits) = (StepPlan::default(), Vec::new());
        let mut times = [[0f64; 3]; SIZES.len()];
        let res = (|| {
            self.run_alone(&mut plan, &mut seq, &ctx, Logits::None, &mut logits)?;
            let s = seq.as_ref().expect("the scratch sequence");
            let start = s.len();
            // A recurrent state cannot be cut back: each timed pass starts from a copy.
            let saved = s.rec.clone();
            // A warm-up round, then three timed ones; the median of each size is kept.
            for rep in 0..4 {
                for (i, n) in SIZES.into_iter().enumerate() {
                    let toks = &ctx[..n.min(ctx.len())];
                    let t = Instant::now();
                    let want = Logits::Tail(toks.len());
                    self.run_alone(&mut plan, &mut seq, toks, want, &mut logits)?;
                    if rep > 0 {
                        times[i][rep - 1] = t.elapsed().as_secs_f64();
                    }
                    let s = seq.as_mut().expect("the scratch sequence");
                    s.rec.clone_from(&saved);
                    self.kv.truncate(s, start);
                }
            }
            Ok(())
        })();
        if let Some(seq) = seq {
            self.kv.release(seq, None);
        }
        for (i, n) in SIZES.into_iter().enumerate() {
            let mut t = times[i];
            t.sort_by(f64::total_cmp);
            self.spec.cost.set(n, t[1]);
        }
        res
    }

    /// Turns per-stage timing of the forward pass on (fresh counters) or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.scratch.llama.profile = on.then(Profile::default);
    }

    /// The per-stage timings collected since profiling was turned on (Llama models).
    pub fn profile(&self) -> Option<&Profile> {
        self.scratch.llama.profile.as_ref()
    }

    /// Drops every cached prefix.
    pub fn reset(&mut self) {
        self.kv.clear();
    }

    /// Throws the KV cache away and starts a fresh one (after a panic left its state unknown).
    pub fn rebuild_kv(&mut self) {
        match KvCache::on(&self.device, self.model.kv_shape(), *self.kv.config()) {
            Ok(kv) => self.kv = kv,
            Err(e) => {
                tracing::error!("rebuilding the KV cache: {e}; clearing it instead");
                self.kv.clear();
            }
        }
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
    /// included; splitting it into content and calls is `thorn_tools::ToolSet::reply`'s job.
    pub fn generate_guided(
        &mut self,
        req: &Request,
        guide: Option<&mut Guide>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation, EngineError> {
        let mut result = None;
        {
            // The scheduler checks the request and reports a bad one through the sink.
            let mut sched = Scheduler::new(SchedulerConfig {
                max_batch: 1,
                step_tokens: PREFILL_CHUNK,
            });
            let slot = guide.map_or(GuideSlot::None, GuideSlot::Borrowed);
            let sink = Box::new(Lone {
                on_text,
                result: &mut result,
            });
            sched.enqueue(self, req.clone(), slot, sink);
            while !sched.is_idle() {
                sched.step(self);
            }
        }
        result.unwrap_or_else(|| Err(EngineError::Internal("the sequence never finished".into())))
    }

    /// Returns a sequence's KV to the cache when its generation ends (finished or failed): what it holds
    /// stays reusable by later prompts, generated tokens included unless `cache_output` is off.
    pub(crate) fn release_sequence(&mut self, seq: SeqKv, dec: &Decoder<'_>) {
        let keep = if self.kv.config().cache_output {
            seq.len()
        } else {
            seq.len().min(dec.prompt_len())
        };
        self.kv.release(seq, Some(&dec.history()[..keep]));
    }

    /// The one finish path of a generation, lone or scheduled: flushes the decoder's held-back text to
    /// `on_text`, counts its passes for the speculation statistics, adds its tokens to the suffix drafter's
    /// store, and returns the [`Generation`] with `timing`'s times. Its KV is released first
    /// ([`Engine::release_sequence`]).
    pub(crate) fn finish_sequence(
        &mut self,
        dec: Decoder<'_>,
        on_text: &mut dyn FnMut(&str),
        timing: Timing,
    ) -> Generation {
        let prompt_tokens = dec.prompt_len();
        let speculated = dec.request().speculate && self.spec.cfg.enabled;
        let d = dec.finish(on_text);
        self.spec.stats.passes += d.forward_passes as u64 + 1;
        self.spec.stats.tokens += d.tokens.len() as u64;
        if speculated {
            self.spec.store.add(&d.tokens, &self.tokenizer);
        }
        let stats = Stats {
            forward_passes: d.forward_passes,
            prompt_tokens,
            cached_tokens: timing.cached_tokens,
            generated: d.tokens.len(),
            first_token: timing.first_token.filter(|_| !d.tokens.is_empty()),
            prefill: timing.prefill,
            decode: timing.decode,
        };
        Generation {
            tokens: d.tokens,
            text: d.text,
            sampled: d.sampled,
            finish: d.finish,
            stop_string: d.stop_string,
            stats,
        }
    }

    /// Asks the model's MTP head (if any, and speculation is on) for the token after `next`, the token
    /// about to run at `seq`'s next position; its top candidates go to the speculator's
    /// [`crate::spec::draft::HeadDrafter`], which proposes them in the coming draft like any other source.
    /// A failure only means no candidates this step.
    pub(crate) fn mtp_propose(&mut self, seq: &mut SeqKv, next: TokenId) {
        const TOP: usize = 2;
        if !self.model.has_mtp() || !self.spec.cfg.enabled {
            return;
        }
        if self.kv.reserve(seq, seq.len() + 1).is_err() {
            return;
        }
        self.mtp_batch.clear();
        self.mtp_batch.push(seq, &[next], Logits::Last);
        let logits = match self.model.mtp_draft(
            &self.device,
            self.kv.pool_mut(),
            &mut self.mtp_batch,
            std::slice::from_ref(&seq.rec),
            &mut self.scratch,
        ) {
            Ok(l) if !l.is_empty() => l,
            Ok(_) => return,
            Err(e) => {
                tracing::debug!("MTP draft failed: {e}");
                return;
            }
        };
        // Softmax probabilities of the top candidates.
        let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
        let mut top = [(0u32, f32::NEG_INFINITY); TOP];
        for (i, &l) in logits.iter().enumerate() {
            if l > top[TOP - 1].1 {
                top[TOP - 1] = (i as u32, l);
                top.sort_by(|a, b| b.1.total_cmp(&a.1));
            }
        }
        self.spec
            .set_head(top.iter().map(|&(t, l)| (t, (l - max).exp() / sum)));
    }
}

/// The sink of a lone generation ([`Engine::generate_guided`]): text to the caller's callback, the result
/// into the caller's slot.
struct Lone<'a> {
    on_text: &'a mut dyn FnMut(&str),
    result: &'a mut Option<Result<Generation, EngineError>>,
}

impl Sink for Lone<'_> {
    fn text(&mut self, text: &str) {
        (self.on_text)(text);
    }

    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        *self.result = Some(result);
    }
}
