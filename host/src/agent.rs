//! The agent loop: a conversation in, an answer out, with host tools run along the way.
//!
//! One [`Agent`] serves every request. For each request ([`Turn`]) it renders the conversation with the
//! chat template and the tools, hands the engine thread a job (tokenize, check the context, build the
//! grammar guide for `tool_choice` / `response_format`, generate), and streams the text back. When the reply
//! holds tool calls, the ones that name **host tools** (installed plugins) are run right here: the call and
//! its result (or its error, as a tool message the model can read) join the conversation and the model goes
//! again, until it answers, asks for a **client tool** (returned to the caller, OpenAI semantics), or
//! `max_tool_rounds` is reached (the last round is generated with tools off, so it must answer). Client and
//! host tools mix freely in one request.
//!
//! Nothing here blocks an async thread: the engine is behind [`EngineService`]'s queue and plugins are
//! called with their async API. A request is cancelled by setting its flag (the client went away); the
//! engine stops at its next step.

use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use thiserror::Error;
use thorn_engine::engine::scheduler::{SchedulerConfig, Sink, Submission};
use thorn_engine::engine::service::{EngineService, SubmitError};
use thorn_engine::engine::{Engine, EngineError, FinishReason, Generation, Request};
use thorn_engine::sample::SamplingParams;
use thorn_engine::tokenizer::{TokenId, Tokenizer};
use thorn_guide::{GuideError, ToolGrammars};
use thorn_plugin::{Caller, LiveSet, PluginSet};
use thorn_tools::chat::{ChatTemplate, Message, Role, ToolCall};
use thorn_tools::{CallDelta, CallStreamer, call_id};
use thorn_tools::{OPEN, ResponseFormat, ToolChoice, ToolError, ToolSet, complete_calls_prefix};
use tokio::sync::mpsc;

use crate::upstream::{Delta, Lease, RoundSpec, Target, UpstreamError};

mod tool_use;
pub use tool_use::{Answers, Routing, ToolUse, router_for};

/// Why a request failed (as opposed to a tool failing, which the model is told about).
#[derive(Debug, Error)]
pub enum AgentError {
    /// The prompt does not fit the context.
    #[error(
        "this model's maximum context length is {context} tokens, but the prompt is {prompt} tokens (plus at least 1 to generate)"
    )]
    ContextLength {
        /// Prompt tokens.
        prompt: usize,
        /// The context.
        context: usize,
    },
    /// The prompt is longer in bytes than the context could hold in tokens (checked before tokenizing).
    #[error(
        "the prompt is {bytes} bytes, more than this model's maximum context length of {context} tokens can hold"
    )]
    PromptBytes {
        /// Prompt (or message data) bytes.
        bytes: usize,
        /// The context.
        context: usize,
    },
    /// The engine's queue is full or it stopped.
    #[error(transparent)]
    Busy(#[from] SubmitError),
    /// Bad tools, tool_choice or response_format.
    #[error(transparent)]
    Tools(#[from] ToolError),
    /// A schema that does not compile into a grammar.
    #[error(transparent)]
    Guide(#[from] GuideError),
    /// The chat template refused the conversation.
    #[error(transparent)]
    Template(#[from] thorn_tools::chat::TemplateError),
    /// The model has no chat template, so only raw completions can be served.
    #[error("the model has no chat template: use /v1/completions with a raw prompt")]
    NoTemplate,
    /// The engine refused the request or failed ([`EngineError::is_client_error`] tells which).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The engine job ended without an answer (it panicked).
    #[error("internal error: the engine did not finish the request")]
    Lost,
    /// The upstream serving the request failed or refused it.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
}

/// Which engine serves a turn.
#[derive(Debug, Clone, Default)]
pub enum Route {
    /// The local model.
    #[default]
    Local,
    /// An upstream's model, every round.
    Upstream(Target),
    /// The local model, and this upstream's from the round the local engine cannot serve (the prompt
    /// outgrew its context, its queue is full).
    LocalFirst(Target),
}

/// Who served a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Served {
    /// The model, as clients name it (the local model's name, or `NAME/MODEL`).
    pub model: String,
    /// The upstream that served its last round (`None`: the local engine).
    pub upstream: Option<String>,
    /// Why a local-first request went upstream (`context`, `queue`).
    pub spilled: Option<&'static str>,
}

/// One request to the agent.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Tool definitions shown to the model (OpenAI `tools` entries), client and host tools alike.
    pub tools: Vec<Value>,
    /// Which of them the host runs (names of plugin functions).
    pub host_tools: Vec<String>,
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// `parallel_tool_calls`.
    pub parallel_tool_calls: bool,
    /// `response_format`.
    pub response_format: ResponseFormat,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Most tokens per generation.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Most rounds of host tool calls (default from the agent).
    pub max_tool_rounds: Option<usize>,
    /// Conversation id for the audit log.
    pub conversation: Option<String>,
    /// The id of the API key the request came with (for the audit log).
    pub key_id: Option<String>,
    /// The client's address (for the audit log).
    pub peer: Option<String>,
    /// Return per-token log-probabilities (of the last round).
    pub logprobs: bool,
    /// Whether to speculate (draft and verify); the output is the same either way. Defaults to on, subject
    /// to the server's `--speculation`.
    pub speculation: bool,
    /// How host tools are put in front of the model (`None`: the agent's default, [`Agent::with_tool_use`]).
    pub tool_use: Option<ToolUse>,
    /// The plugins `host_tools` were resolved in ([`Agent::plugins`] when the request arrived): the whole
    /// turn runs in this set even if the served one is replaced meanwhile.
    pub plugins: Arc<PluginSet>,
    /// The engine that serves it.
    pub route: Route,
}

/// One generated token's log-probability, with the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy for partial UTF-8).
    pub token: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// Alternatives: text, bytes, log-probability.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// A host tool call and what came of it.
#[derive(Debug, Clone)]
pub struct HostCall {
    /// The call.
    pub call: ToolCall,
    /// Its result, or the error the model was shown.
    pub result: Result<Value, String>,
    /// The error's kind (`timeout`, `arguments`, ...), when it failed.
    pub error_kind: Option<&'static str>,
}

/// Token counts of a request (all rounds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens, summed over rounds.
    pub prompt_tokens: usize,
    /// Of those, served from the KV cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// Why the answer ended, in OpenAI's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A natural end or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// The answer asks for client tools.
    ToolCalls,
    /// The request was cancelled.
    Cancelled,
}

impl From<FinishReason> for Finish {
    fn from(f: FinishReason) -> Self {
        match f {
            FinishReason::Stop => Finish::Stop,
            FinishReason::Length => Finish::Length,
            FinishReason::Cancelled => Finish::Cancelled,
        }
    }
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// What a request produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The answer's text (all rounds' prose, as streamed).
    pub content: String,
    /// What a thinking model reasoned (all rounds' `<think>` text, as streamed; empty when it did not).
    pub reasoning: String,
    /// Calls for the client to run.
    pub tool_calls: Vec<ToolCall>,
    /// Host tool calls run on the way, in order.
    pub host_calls: Vec<HostCall>,
    /// Why it ended.
    pub finish: Finish,
    /// The stop string the last round ended on, if it did.
    pub stop_string: Option<String>,
    /// Token counts.
    pub usage: Usage,
    /// Per-token log-probabilities of the last round (when asked for).
    pub logprobs: Vec<TokenLogprob>,
    /// Generation rounds run.
    pub rounds: usize,
    /// When the answer's first token was sampled, whatever it was (text, or a tool call's name or
    /// arguments): time to first token counts from the request to this.
    pub first_token: Option<std::time::Instant>,
    /// Where the calls streamed as they were generated ([`Event::CallStart`]) are not exactly the calls
    /// returned (a streaming response must not end as if they were).
    pub streamed: StreamedCalls,
    /// The host functions the tool router offered the model (empty: none, so it answered without tools);
    /// `None` when the request was not routed ([`ToolUse`]).
    pub routed: Option<Vec<String>>,
    /// Who served it.
    pub served: Served,
}

/// How the tool calls streamed during a request relate to the ones it returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StreamedCalls {
    /// Every streamed call is a returned or run call, with the same id, name and arguments.
    #[default]
    Exact,
    /// Generation stopped at `max_tokens` inside a call: it was streamed in part and is not returned.
    Truncated,
    /// The reply failed validation after its calls were streamed, or parsed to other calls (a bug: the
    /// grammar guarantees valid calls); the message says what differed.
    Mismatch(String),
}

/// What a streaming caller sees as it happens.
#[derive(Debug, Clone)]
pub enum Event {
    /// The first round's prompt was accepted (it fits, the grammar compiled): the answer starts.
    Started {
        /// Its tokens (0 when an upstream serves it: its count arrives with the usage).
        prompt_tokens: usize,
        /// The model serving it, as clients name it.
        model: String,
    },
    /// Answer text.
    Content(String),
    /// Reasoning text: what a thinking model writes inside `<think>` before it answers.
    Reasoning(String),
    /// A tool call is being generated: its name is complete. `host`: a host tool (run by thorn, then its
    /// result streams as [`Event::HostResult`]); `index` counts the request's client calls and its host
    /// calls separately, from 0.
    CallStart {
        /// Whether thorn runs it.
        host: bool,
        /// Its place among the request's calls of its kind.
        index: usize,
        /// The call id it is returned (or run) with.
        id: String,
        /// The tool's name.
        name: String,
    },
    /// More of a call's arguments: compact JSON text; a call's fragments concatenate to exactly its
    /// returned `arguments` (unless [`Outcome::streamed`] says otherwise).
    CallArguments {
        /// Whether thorn runs it.
        host: bool,
        /// Its place among the request's calls of its kind.
        index: usize,
        /// The fragment.
        text: String,
    },
    /// A host tool is being called.
    HostCall(Box<ToolCall>),
    /// A host tool returned (or failed).
    HostResult(Box<HostCall>),
}

/// What a generation reports to its caller as it goes.
enum Piece<'a> {
    Started(usize),
    Text(&'a str),
}

/// What the engine thread reports for one generation.
enum Gen {
    Started(usize),
    Text(String),
    Done(Box<Result<(Generation, Vec<TokenLogprob>), AgentError>>),
}

/// Streams a batched sequence's text and result back to the request's task.
struct GenSink {
    tx: mpsc::UnboundedSender<Gen>,
    tokenizer: Arc<thorn_engine::tokenizer::Tokenizer>,
    logprobs: bool,
}

impl Sink for GenSink {
    fn text(&mut self, text: &str) {
        let _ = self.tx.send(Gen::Text(text.to_owned()));
    }

    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        let out = result.map_err(AgentError::from).map(|generation| {
            let tok = &self.tokenizer;
            let piece = |id| {
                let bytes = tok.token_bytes(id).to_vec();
                (String::from_utf8_lossy(&bytes).into_owned(), bytes)
            };
            let lp = if self.logprobs {
                generation
                    .sampled
                    .iter()
                    .map(|s| {
                        let (token, bytes) = piece(s.token);
                        TokenLogprob {
                            token,
                            bytes,
                            logprob: s.logprob,
                            top: s
                                .top
                                .iter()
                                .map(|&(id, lp)| {
                                    let (t, b) = piece(id);
                                    (t, b, lp)
                                })
                                .collect(),
                        }
                    })
                    .collect()
            } else {
                Vec::new()
            };
            (generation, lp)
        });
        let _ = self.tx.send(Gen::Done(Box::new(out)));
    }
}

/// The model-facing pieces the agent needs besides the engine.
#[derive(Debug)]
pub struct ModelInfo {
    /// Served model name.
    pub name: String,
    /// Its chat template (`None` for a base model without one: only raw completions are served).
    pub template: Option<ChatTemplate>,
    /// `bos_token` text.
    pub bos: String,
    /// `eos_token` text.
    pub eos: String,
    /// Context length in tokens.
    pub context: usize,
    /// The tokenizer (prompts are tokenized off the engine thread).
    pub tokenizer: Arc<Tokenizer>,
}

impl ModelInfo {
    /// The most bytes a prompt that fits the context can have: no token spells more than the longest
    /// vocabulary entry, so a longer text cannot fit whatever it holds.
    pub fn max_prompt_bytes(&self) -> usize {
        self.context
            .saturating_mul(self.tokenizer.max_token_bytes())
    }
}

/// A prompt to tokenize.
enum PromptText {
    /// Rendered from the chat template over quoted data: only the template's markup is control tokens.
    Chat(String),
    /// A raw `/v1/completions` prompt: control-token text is plain text unless the operator opted in.
    Raw(String),
}

impl PromptText {
    fn len(&self) -> usize {
        match self {
            PromptText::Chat(t) | PromptText::Raw(t) => t.len(),
        }
    }
}

/// The agent: engine, model facts and installed plugins, shared by all requests.
#[derive(Debug, Clone)]
pub struct Agent {
    engine: EngineService,
    model: Arc<ModelInfo>,
    plugins: Arc<LiveSet>,
    max_tool_rounds: usize,
    max_host_calls: usize,
    raw_special: bool,
    tool_use: ToolUse,
}

/// Where a thinking model's reasoning starts and ends.
const THINK_OPEN: &str = "<think>";
/// See [`THINK_OPEN`].
const THINK_CLOSE: &str = "</think>";

/// The part of a generation that answers (calls included): after the reasoning, if the model reasoned
/// (`opened`: the prompt opened the reasoning block itself).
fn answer_part(text: &str, opened: bool) -> &str {
    let starts = opened || text.trim_start().starts_with(THINK_OPEN);
    if !starts {
        return text;
    }
    match text.find(THINK_CLOSE) {
        Some(i) => text[i + THINK_CLOSE.len()..].trim_start(),
        None => "",
    }
}

/// The longest suffix of `s` that is a proper prefix of `tag` (text to hold back: it may become the tag).
fn tag_prefix_len(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// Whether the [`Splitter`] is in a reasoning block.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum Think {
    /// At the start: the output may open one.
    #[default]
    Maybe,
    /// Inside one.
    Inside,
    /// Past it, or there was none.
    Off,
}

/// What the [`Splitter`] makes of generated text.
enum Split {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A streamed tool call's progress.
    Call(CallDelta),
}

/// Splits streamed text into answer text and tool calls: text that might be the start of `<tool_call>` is
/// held back until it is known not to be; everything from the trigger on is not content but goes to the
/// [`CallStreamer`], which turns it into call deltas.
#[derive(Debug, Default)]
struct Splitter {
    held: String,
    in_calls: bool,
    calls: CallStreamer,
    think: Think,
    /// Reasoning (or the output's start) held back: it may be the start of a tag.
    think_held: String,
}

impl Splitter {
    /// A splitter for a round whose prompt already opened the reasoning block (`opened`).
    fn new(opened: bool) -> Self {
        Splitter {
            think: if opened { Think::Inside } else { Think::Maybe },
            ..Splitter::default()
        }
    }

    fn push(&mut self, text: &str, active: bool, out: &mut dyn FnMut(Split)) {
        if self.think != Think::Off {
            let Some(rest) = self.reason(text, out) else {
                return;
            };
            if !rest.is_empty() {
                self.answer(&rest, active, out);
            }
            return;
        }
        self.answer(text, active, out);
    }

    /// Takes a reasoning block off the front of the output: `None` while inside it (or still unsure
    /// whether one starts), else the answer text after it.
    fn reason(&mut self, text: &str, out: &mut dyn FnMut(Split)) -> Option<String> {
        self.think_held.push_str(text);
        if self.think == Think::Maybe {
            let t = self.think_held.trim_start();
            if let Some(after) = t.strip_prefix(THINK_OPEN) {
                self.think_held = after.to_owned();
                self.think = Think::Inside;
            } else if THINK_OPEN.starts_with(t) {
                return None;
            } else {
                self.think = Think::Off;
                return Some(std::mem::take(&mut self.think_held));
            }
        }
        if let Some(i) = self.think_held.find(THINK_CLOSE) {
            let reasoning = self.think_held[..i].to_owned();
            let rest = self.think_held[i + THINK_CLOSE.len()..]
                .trim_start()
                .to_owned();
            self.think_held.clear();
            self.think = Think::Off;
            if !reasoning.is_empty() {
                out(Split::Reasoning(reasoning));
            }
            return Some(rest);
        }
        let cut = self.think_held.len() - tag_prefix_len(&self.think_held, THINK_CLOSE);
        if cut > 0 {
            let r: String = self.think_held.drain(..cut).collect();
            out(Split::Reasoning(r));
        }
        None
    }

    fn answer(&mut self, text: &str, active: bool, out: &mut dyn FnMut(Split)) {
        if !active {
            out(Split::Content(text.to_owned()));
            return;
        }
        if self.in_calls {
            self.calls.push(text, &mut |d| out(Split::Call(d)));
            return;
        }
        self.held.push_str(text);
        if let Some(i) = self.held.find(OPEN) {
            let before = self.held[..i].to_owned();
            self.in_calls = true;
            let calls = self.held.split_off(i);
            self.held.clear();
            if !before.is_empty() {
                out(Split::Content(before));
            }
            self.calls.push(&calls, &mut |d| out(Split::Call(d)));
            return;
        }
        // Keep the longest suffix that is a prefix of the trigger.
        let cut = self.held.len() - tag_prefix_len(&self.held, OPEN);
        if cut > 0 {
            let emit: String = self.held.drain(..cut).collect();
            out(Split::Content(emit));
        }
    }

    fn finish(&mut self, out: &mut dyn FnMut(Split)) {
        match self.think {
            // Output shorter than the tag: it was answer text.
            Think::Maybe if !self.think_held.is_empty() => {
                out(Split::Content(std::mem::take(&mut self.think_held)))
            }
            // Reasoning cut off (max_tokens): what there is of it.
            Think::Inside if !self.think_held.is_empty() => {
                out(Split::Reasoning(std::mem::take(&mut self.think_held)))
            }
            _ => {}
        }
        if !self.in_calls && !self.held.is_empty() {
            out(Split::Content(std::mem::take(&mut self.held)));
        }
        *self = Splitter::default();
    }
}

/// A call one round streamed.
#[derive(Debug, Clone)]
struct Streamed {
    /// The id it was streamed with.
    id: String,
    /// The tool's name.
    name: String,
    /// Whether thorn runs it.
    host: bool,
    /// Its index among the request's calls of its kind.
    index: usize,
    /// The arguments text streamed so far.
    args: String,
}

/// The calls one round streamed.
#[derive(Debug, Default)]
struct RoundCalls {
    calls: Vec<Streamed>,
}

impl RoundCalls {
    /// Checks the round's validated calls against what was streamed and gives them the streamed ids.
    /// `truncated`: generation stopped at `max_tokens`, so the last streamed call may be cut off.
    fn settle(&self, calls: &mut [ToolCall], truncated: bool) -> StreamedCalls {
        let streamed = &self.calls;
        if streamed.len() < calls.len() || (streamed.len() > calls.len() + usize::from(truncated)) {
            return StreamedCalls::Mismatch(format!(
                "{} calls streamed, {} returned",
                streamed.len(),
                calls.len()
            ));
        }
        for (c, s) in calls.iter_mut().zip(streamed) {
            let want = c.function.arguments.to_string();
            if c.function.name != s.name || want != s.args {
                return StreamedCalls::Mismatch(format!(
                    "streamed {}({}), returned {}({want})",
                    s.name, s.args, c.function.name
                ));
            }
            c.id.clone_from(&s.id);
        }
        if streamed.len() > calls.len() {
            StreamedCalls::Truncated
        } else {
            StreamedCalls::Exact
        }
    }
}

impl Agent {
    /// Moves `engine` onto its own thread (at most `queue` requests waiting) and builds the agent around it:
    /// the model is served as `name`, and `plugins` are the host tools.
    pub fn start(
        engine: Engine,
        name: String,
        plugins: Arc<PluginSet>,
        queue: usize,
        max_tool_rounds: usize,
    ) -> Result<Self, AgentError> {
        Self::start_with(
            engine,
            name,
            plugins,
            queue,
            max_tool_rounds,
            SchedulerConfig::default(),
        )
    }

    /// [`Agent::start`] with the batch scheduler's limits.
    pub fn start_with(
        engine: Engine,
        name: String,
        plugins: Arc<PluginSet>,
        queue: usize,
        max_tool_rounds: usize,
        sched: SchedulerConfig,
    ) -> Result<Self, AgentError> {
        // A base model without a template still serves raw completions.
        let template = match engine.gguf().get_str("tokenizer.chat_template") {
            Ok(src) => Some(ChatTemplate::new(src)?),
            Err(_) => {
                tracing::warn!("the model has no chat template: only raw completions are served");
                None
            }
        };
        let tok = engine.tokenizer();
        let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_owned();
        let info = ModelInfo {
            name,
            template,
            bos: text_of(tok.bos()),
            eos: text_of(tok.eos()),
            context: engine.context(),
            tokenizer: engine.tokenizer_arc(),
        };
        let service = EngineService::with_scheduler(engine, queue, sched)
            .map_err(|e| AgentError::Engine(EngineError::Spawn(e)))?;
        Ok(Self::new(service, info, plugins, max_tool_rounds))
    }

    /// An agent over a running engine, with these plugins as host tools.
    pub fn new(
        engine: EngineService,
        model: ModelInfo,
        plugins: Arc<PluginSet>,
        max_tool_rounds: usize,
    ) -> Self {
        Agent {
            engine,
            model: Arc::new(model),
            plugins: Arc::new(LiveSet::new(plugins)),
            max_tool_rounds: max_tool_rounds.max(1),
            max_host_calls: Self::MAX_HOST_CALLS,
            raw_special: false,
            tool_use: ToolUse::default(),
        }
    }

    /// Sets how host tools are put in front of the model when a request does not say
    /// ([`ToolUse::default`]: routed, with examples, answered by templates).
    pub fn with_tool_use(mut self, tool_use: ToolUse) -> Self {
        self.tool_use = tool_use;
        self
    }

    /// The default [`ToolUse`].
    pub fn tool_use(&self) -> ToolUse {
        self.tool_use
    }

    /// Default most host tool calls per request (all rounds together).
    pub const MAX_HOST_CALLS: usize = 32;

    /// Sets the most host tool calls one request may make (all rounds together); calls past it are not
    /// run and the model is told so.
    pub fn with_max_host_calls(mut self, n: usize) -> Self {
        self.max_host_calls = n;
        self
    }

    /// Lets `/v1/completions` prompts spell control tokens (`<|im_start|>`) as text. Off by default: a
    /// raw prompt's control-token text is tokenized as ordinary characters.
    pub fn with_raw_special(mut self, on: bool) -> Self {
        self.raw_special = on;
        self
    }

    /// The engine service.
    pub fn engine(&self) -> &EngineService {
        &self.engine
    }

    /// The model facts.
    pub fn model(&self) -> &ModelInfo {
        &self.model
    }

    /// The plugins served now (a snapshot: a request keeps the one it started with, [`Turn::plugins`]).
    pub fn plugins(&self) -> Arc<PluginSet> {
        self.plugins.current()
    }

    /// The served plugin set itself: what a watcher replaces when the operator installs or approves a
    /// plugin, and what MCP sessions subscribe to.
    pub fn live_plugins(&self) -> &Arc<LiveSet> {
        &self.plugins
    }

    /// Tokenizes a prompt off the engine thread (and off the async workers), after a byte-length check
    /// that rejects what cannot fit the context without tokenizing it at all.
    async fn encode(&self, prompt: PromptText) -> Result<Vec<TokenId>, AgentError> {
        let context = self.model.context;
        let ids = self.tokenize(prompt).await?;
        if ids.len() + 1 > context {
            return Err(AgentError::ContextLength {
                prompt: ids.len(),
                context,
            });
        }
        Ok(ids)
    }

    /// Tokenizes a prompt off the engine thread, after the byte-length check (no context check).
    async fn tokenize(&self, prompt: PromptText) -> Result<Vec<TokenId>, AgentError> {
        let context = self.model.context;
        let bytes = prompt.len();
        if bytes > self.model.max_prompt_bytes() {
            return Err(AgentError::PromptBytes { bytes, context });
        }
        let tok = Arc::clone(&self.model.tokenizer);
        let raw_special = self.raw_special;
        let ids = tokio::task::spawn_blocking(move || match &prompt {
            PromptText::Chat(t) => tok.encode_rendered(t),
            PromptText::Raw(t) => tok.encode(t, raw_special),
        })
        .await
        .map_err(|_| AgentError::Lost)?
        .map_err(EngineError::from)?;
        Ok(ids)
    }

    /// The tokens `turn`'s first round would prompt the model with (its conversation and the tools it
    /// shows, rendered by the chat template), whether or not they fit the context.
    pub async fn count_tokens(&self, turn: &Turn) -> Result<usize, AgentError> {
        let all = ToolSet::new(&turn.tools)?;
        turn.tool_choice.check(&all)?;
        let shown = if turn.tool_choice == ToolChoice::None {
            ToolSet::default()
        } else {
            all
        };
        let text = self.render(&shown, &turn.messages)?;
        Ok(self.tokenize(PromptText::Chat(text)).await?.len())
    }

    /// The prompt text of `messages` with `shown` tools, from the chat template over quoted data, after
    /// a byte-length check that refuses data the context cannot hold before rendering it.
    fn render(&self, shown: &ToolSet, messages: &[Message]) -> Result<String, AgentError> {
        let template = self.model.template.as_ref().ok_or(AgentError::NoTemplate)?;
        let data: usize = messages.iter().map(Message::data_len).sum();
        if data > self.model.max_prompt_bytes() {
            return Err(AgentError::PromptBytes {
                bytes: data,
                context: self.model.context,
            });
        }
        let tok = &self.model.tokenizer;
        Ok(
            shown.render(template, messages, &self.model.bos, &self.model.eos, &|s| {
                tok.quote(s)
            })?,
        )
    }

    /// Runs one generation on the engine thread, streaming its text through `on_text`. A `copying`
    /// generation (a routed call, whose arguments come from the request) is greedy and runs without
    /// repetition penalties: its arguments are read off the request, so sampling only adds errors (`thorn
    /// chat`'s temperature 0.7 turned `17 * 3` into `17 / 3` one time in three), and penalties exist to
    /// stop prose from looping, where here they push the model off the very words it must copy (`17 * 3`
    /// became `24*3` under the CLI's 1.1). The rounds after it sample as the request asks.
    #[expect(clippy::too_many_arguments, reason = "one round's inputs, spelled out")]
    async fn generate(
        &self,
        prompt: PromptText,
        tools: Arc<ToolSet>,
        choice: ToolChoice,
        turn: &Turn,
        copying: bool,
        cancel: &Arc<AtomicBool>,
        on: &mut (dyn FnMut(Piece<'_>) + Send),
    ) -> Result<(Generation, Vec<TokenLogprob>), AgentError> {
        let prompt = self.encode(prompt).await?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Gen>();
        let parallel = turn.parallel_tool_calls;
        let format = turn.response_format.clone();
        let mut req = Request {
            max_tokens: turn.max_tokens,
            sampling: turn.sampling.clone(),
            stop: turn.stop.clone(),
            cancel: Some(Arc::clone(cancel)),
            speculate: turn.speculation,
            ..Request::greedy(prompt, turn.max_tokens)
        };
        if copying {
            req.sampling.temperature = 0.0;
            req.sampling.repetition_penalty = 1.0;
            req.sampling.presence_penalty = 0.0;
            req.sampling.frequency_penalty = 0.0;
        }
        let logprobs = turn.logprobs;
        self.engine.generate(Box::new(move |engine: &mut Engine| {
            let prepared = (|| -> Result<Submission, AgentError> {
                let guide = engine
                    .grammars()
                    .map_err(EngineError::from)?
                    .guide(&tools, &choice, parallel, &format)?;
                let _ = tx.send(Gen::Started(req.prompt.len()));
                Ok(Submission {
                    request: std::mem::replace(&mut req, Request::greedy(Vec::new(), 0)),
                    guide: guide.map(Box::new),
                    sink: Box::new(GenSink {
                        tx: tx.clone(),
                        tokenizer: engine.tokenizer_arc(),
                        logprobs,
                    }),
                })
            })();
            match prepared {
                Ok(sub) => Some(sub),
                Err(e) => {
                    let _ = tx.send(Gen::Done(Box::new(Err(e))));
                    None
                }
            }
        }))?;
        while let Some(ev) = rx.recv().await {
            match ev {
                Gen::Started(n) => on(Piece::Started(n)),
                Gen::Text(t) => on(Piece::Text(&t)),
                Gen::Done(out) => return *out,
            }
        }
        Err(AgentError::Lost)
    }

    /// Continues raw `prompt` text (no chat template, no tools; `turn.messages` is ignored).
    pub async fn complete(
        &self,
        prompt: String,
        turn: &Turn,
        cancel: Arc<AtomicBool>,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) -> Result<Outcome, AgentError> {
        let mut content = String::new();
        let (generation, logprobs) = self
            .generate(
                PromptText::Raw(prompt),
                Arc::new(ToolSet::default()),
                ToolChoice::None,
                turn,
                false,
                &cancel,
                &mut |p| match p {
                    Piece::Started(n) => on_event(Event::Started {
                        prompt_tokens: n,
                        model: self.model.name.clone(),
                    }),
                    Piece::Text(t) => {
                        content.push_str(t);
                        on_event(Event::Content(t.to_owned()));
                    }
                },
            )
            .await?;
        Ok(Outcome {
            content,
            reasoning: String::new(),
            tool_calls: Vec::new(),
            host_calls: Vec::new(),
            finish: generation.finish.into(),
            stop_string: generation.stop_string.clone(),
            usage: Usage {
                prompt_tokens: generation.stats.prompt_tokens,
                cached_tokens: generation.stats.cached_tokens,
                completion_tokens: generation.stats.generated,
            },
            logprobs,
            rounds: 1,
            first_token: generation.stats.first_token,
            streamed: StreamedCalls::Exact,
            routed: None,
            served: Served {
                model: self.model.name.clone(),
                upstream: None,
                spilled: None,
            },
        })
    }

    /// Serves `turn`, reporting progress through `on_event`.
    ///
    /// Each round runs on the turn's engine ([`Route`]): the local engine thread, or an upstream (its
    /// calls validated here, [`Agent::upstream_round`]). A local-first turn whose round cannot be served
    /// locally (the prompt outgrew the context, the queue is full) goes on upstream from that round,
    /// with the conversation as it stands.
    pub async fn run(
        &self,
        turn: Turn,
        cancel: Arc<AtomicBool>,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) -> Result<Outcome, AgentError> {
        let full = Arc::new(ToolSet::new(&turn.tools)?);
        turn.tool_choice.check(&full)?;
        let max_rounds = tool_rounds(turn.max_tool_rounds, self.max_tool_rounds);
        let mut host_calls_left = self.max_host_calls;
        let caller = Caller {
            conversation: turn.conversation.clone(),
            key_id: turn.key_id.clone(),
            peer: turn.peer.clone(),
        };
        let policy = turn.tool_use.unwrap_or(self.tool_use);
        let (mut engine, mut fallback) = match &turn.route {
            Route::Local => (RoundEngine::Local, None),
            Route::Upstream(t) => (
                RoundEngine::Upstream(Box::new((t.clone(), t.upstream.lease()?))),
                None,
            ),
            Route::LocalFirst(t) => (RoundEngine::Local, Some(t.clone())),
        };
        // The router shapes a round for a small local model; an upstream gets the request as asked.
        let plan = match engine {
            RoundEngine::Local => tool_use::plan(&turn.plugins, &full, &turn, policy)?,
            RoundEngine::Upstream(_) => tool_use::Plan::as_asked(&full, &turn),
        };
        // The round the router shaped is the first; what follows it is decided when it ends.
        let mut routed_round = plan.routed.as_ref().is_some_and(|r| !r.is_empty());
        let mut all = plan.shown;
        let mut messages = turn.messages.clone();
        tool_use::insert_examples(&mut messages, plan.examples);
        let mut choice = plan.choice;
        let mut out = Outcome {
            content: String::new(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            host_calls: Vec::new(),
            finish: Finish::Stop,
            stop_string: None,
            usage: Usage::default(),
            logprobs: Vec::new(),
            rounds: 0,
            first_token: None,
            streamed: StreamedCalls::Exact,
            routed: plan.routed,
            served: self.served_by(&engine),
        };
        // Calls streamed so far, client and host, each counted from 0 (a client's deltas carry these).
        let mut counters = Counters::default();
        let none = Arc::new(ToolSet::default());
        loop {
            let routed = std::mem::take(&mut routed_round);
            let last = out.rounds == max_rounds;
            if last && out.rounds > 0 {
                // The tool budget is spent: this round must answer.
                choice = ToolChoice::None;
            }
            let shown = if choice == ToolChoice::None {
                Arc::clone(&none)
            } else {
                Arc::clone(&all)
            };
            let ctx = RoundCtx {
                messages: &messages,
                all: &all,
                shown: &shown,
                choice: &choice,
                turn: &turn,
                calls_possible: choice != ToolChoice::None && !all.is_empty(),
                first_round: out.rounds == 0,
                cancel: &cancel,
            };
            let round = match &engine {
                RoundEngine::Local => {
                    self.local_round(&ctx, routed, &mut counters, on_event)
                        .await
                }
                RoundEngine::Upstream(up) => {
                    self.upstream_round(&up.0, &ctx, &mut counters, on_event)
                        .await
                }
            };
            let round = match round {
                Err(e) if fallback.is_some() && spill_reason(&e).is_some() => {
                    let reason = spill_reason(&e);
                    let target = fallback.take().expect("checked");
                    let lease = match target.upstream.lease() {
                        Ok(l) => l,
                        Err(refused) => {
                            tracing::warn!(error = %refused, "a local-first request cannot go upstream");
                            return Err(e);
                        }
                    };
                    tracing::info!(upstream = %target.upstream.name(), reason, "local-first: the request goes upstream");
                    if out.rounds == 0 {
                        // Nothing was generated yet: the upstream gets the request as the client asked.
                        all = Arc::clone(&full);
                        choice = turn.tool_choice.clone();
                        messages = turn.messages.clone();
                        out.routed = None;
                    }
                    engine = RoundEngine::Upstream(Box::new((target, lease)));
                    out.served = self.served_by(&engine);
                    out.served.spilled = reason;
                    continue;
                }
                r => r?,
            };
            let calls_possible = ctx.calls_possible;
            out.rounds += 1;
            out.content.push_str(&round.content);
            out.reasoning.push_str(&round.reasoning);
            out.first_token = out.first_token.or(round.first_token);
            out.usage.prompt_tokens += round.usage.prompt_tokens;
            out.usage.cached_tokens += round.usage.cached_tokens;
            out.usage.completion_tokens += round.usage.completion_tokens;
            out.logprobs = round.logprobs;
            out.finish = round.finish;
            out.stop_string = round.stop_string;
            if out.streamed == StreamedCalls::Exact {
                out.streamed = round.streamed;
            }
            if round.finish == Finish::Cancelled || !calls_possible {
                return Ok(out);
            }
            if round.calls.is_empty() && round.rejected.is_empty() {
                return Ok(out);
            }
            let (host, client): (Vec<ToolCall>, Vec<ToolCall>) = round
                .calls
                .into_iter()
                .partition(|c| turn.host_tools.contains(&c.function.name));
            let rejected = round.rejected;
            if host.is_empty() && rejected.is_empty() {
                out.tool_calls = client;
                out.finish = Finish::ToolCalls;
                return Ok(out);
            }
            // Run the host calls, tell the model what they returned (and what was wrong with a call
            // that failed validation), and go again.
            let ran_from = out.host_calls.len();
            let mut assistant = Message::assistant(round.content.trim());
            assistant.reasoning_content = (!round.reasoning.is_empty()).then_some(round.reasoning);
            assistant.tool_calls = host
                .iter()
                .chain(&client)
                .chain(rejected.iter().map(|(c, _)| c))
                .cloned()
                .collect();
            messages.push(assistant);
            let tool_message = |call: &ToolCall, text: String| {
                let mut m = Message::new(Role::Tool, text);
                m.tool_call_id = Some(call.id.clone());
                m.name = Some(call.function.name.clone());
                m
            };
            let error_text = |e: &str| serde_json::json!({ "error": e }).to_string();
            for call in host {
                on_event(Event::HostCall(Box::new(call.clone())));
                let (error_kind, result) = if host_calls_left == 0 {
                    // Not run: the request's host-call budget is spent.
                    (
                        Some("call_budget"),
                        Err(format!(
                            "not run: this request already made its {} host tool calls",
                            self.max_host_calls
                        )),
                    )
                } else {
                    host_calls_left -= 1;
                    let (res, _) = turn
                        .plugins
                        .call_async(&caller, &call.function.name, &call.function.arguments)
                        .await;
                    (
                        res.as_ref().err().map(|e| e.kind()),
                        res.map_err(|e| e.to_string()),
                    )
                };
                let text = match &result {
                    Ok(v) => v.to_string(),
                    Err(e) => error_text(e),
                };
                messages.push(tool_message(&call, text));
                let hc = HostCall {
                    call,
                    result,
                    error_kind,
                };
                on_event(Event::HostResult(Box::new(hc.clone())));
                out.host_calls.push(hc);
            }
            // A call that failed validation reaches no plugin and no client: the model is told why.
            let resend = !rejected.is_empty();
            for (call, why) in rejected {
                let why = format!("not run: {why}");
                messages.push(tool_message(&call, error_text(&why)));
                if turn.host_tools.contains(&call.function.name) {
                    let hc = HostCall {
                        call,
                        result: Err(why),
                        error_kind: Some("arguments"),
                    };
                    on_event(Event::HostResult(Box::new(hc.clone())));
                    out.host_calls.push(hc);
                } else {
                    tracing::warn!(tool = %call.function.name, error = %why, "an invalid client tool call goes back to the model");
                }
            }
            if resend {
                // The reply's valid client calls wait for the corrected ones, so the client gets the
                // reply's calls together or none of them.
                for call in &client {
                    let why = "not sent: another call of this reply was invalid; make this call again with the corrected one";
                    messages.push(tool_message(call, error_text(why)));
                }
            } else if !client.is_empty() {
                out.tool_calls = client;
                out.finish = Finish::ToolCalls;
                return Ok(out);
            }
            if cancel.load(Ordering::Relaxed) {
                out.finish = Finish::Cancelled;
                return Ok(out);
            }
            // A required or named choice was met by the calls made; the model may now answer.
            if !resend && matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
                choice = ToolChoice::Auto;
            }
            if routed {
                // The router's call is made: its template answers, else the model does, without tools.
                if policy.answers == Answers::Template
                    && let Some(text) =
                        tool_use::template_answer(&turn.plugins, &out.host_calls[ran_from..])
                {
                    if !out.content.is_empty() {
                        out.content.push('\n');
                        on_event(Event::Content("\n".into()));
                    }
                    out.content.push_str(&text);
                    on_event(Event::Content(text));
                    out.finish = Finish::Stop;
                    out.stop_string = None;
                    return Ok(out);
                }
                choice = ToolChoice::None;
            }
        }
    }

    /// Who serves the rounds of `engine`.
    fn served_by(&self, engine: &RoundEngine) -> Served {
        match engine {
            RoundEngine::Local => Served {
                model: self.model.name.clone(),
                upstream: None,
                spilled: None,
            },
            RoundEngine::Upstream(up) => Served {
                model: up.0.exposed(),
                upstream: Some(up.0.upstream.name().to_owned()),
                spilled: None,
            },
        }
    }

    /// One round on the local engine: the conversation rendered by the chat template, generated on the
    /// engine thread, its text split into answer, reasoning and calls as it streams, the calls parsed
    /// and validated when it ends.
    async fn local_round(
        &self,
        r: &RoundCtx<'_>,
        routed: bool,
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) -> Result<RoundResult, AgentError> {
        let prompt_text = self.render(r.shown, r.messages)?;
        // A thinking model's template may open the reasoning block in the prompt itself.
        let opened = prompt_text.trim_end().ends_with(THINK_OPEN);
        let mut splitter = Splitter::new(opened);
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut round_calls = RoundCalls::default();
        let generation = {
            let round = &mut content;
            let round_r = &mut reasoning;
            let streamed = &mut round_calls;
            let host_tools = &r.turn.host_tools;
            let first_round = r.first_round;
            let model = &self.model.name;
            let mut emit = |ev: Event| {
                match &ev {
                    Event::Content(s) => round.push_str(s),
                    Event::Reasoning(s) => round_r.push_str(s),
                    _ => {}
                }
                on_event(ev);
            };
            let mut split = |piece: Split, emit: &mut dyn FnMut(Event)| match piece {
                Split::Content(s) => emit(Event::Content(s)),
                Split::Reasoning(s) => emit(Event::Reasoning(s)),
                Split::Call(CallDelta::Begin { name, .. }) => {
                    let host = host_tools.contains(&name);
                    let index = counters.next(host);
                    let id = call_id();
                    streamed.calls.push(Streamed {
                        id: id.clone(),
                        name: name.clone(),
                        host,
                        index,
                        args: String::new(),
                    });
                    emit(Event::CallStart {
                        host,
                        index,
                        id,
                        name,
                    });
                }
                Split::Call(CallDelta::Arguments { index, text }) => {
                    if let Some(s) = streamed.calls.get_mut(index) {
                        s.args.push_str(&text);
                        emit(Event::CallArguments {
                            host: s.host,
                            index: s.index,
                            text,
                        });
                    }
                }
                Split::Call(CallDelta::End { .. }) => {}
            };
            let calls_possible = r.calls_possible;
            let g = self
                .generate(
                    PromptText::Chat(prompt_text),
                    Arc::clone(r.shown),
                    r.choice.clone(),
                    r.turn,
                    routed,
                    r.cancel,
                    &mut |piece| match piece {
                        Piece::Started(n) if first_round => emit(Event::Started {
                            prompt_tokens: n,
                            model: model.clone(),
                        }),
                        Piece::Started(_) => {}
                        Piece::Text(t) => {
                            splitter.push(t, calls_possible, &mut |p| split(p, &mut emit))
                        }
                    },
                )
                .await;
            splitter.finish(&mut |p| split(p, &mut emit));
            g
        };
        let (generation, logprobs) = generation?;
        let mut res = RoundResult {
            content,
            reasoning,
            calls: Vec::new(),
            rejected: Vec::new(),
            finish: generation.finish.into(),
            stop_string: generation.stop_string.clone(),
            usage: Usage {
                prompt_tokens: generation.stats.prompt_tokens,
                cached_tokens: generation.stats.cached_tokens,
                completion_tokens: generation.stats.generated,
            },
            logprobs,
            first_token: generation.stats.first_token,
            streamed: StreamedCalls::Exact,
        };
        if generation.finish == FinishReason::Cancelled || !r.calls_possible {
            return Ok(res);
        }
        // Calls are read from the answer only, never from the reasoning before it.
        let answer = answer_part(&generation.text, opened);
        let truncated = generation.finish == FinishReason::Length;
        let text = if truncated {
            complete_calls_prefix(answer)
        } else {
            answer
        };
        match r.shown.reply(text) {
            Ok(mut reply) => {
                res.streamed = round_calls.settle(&mut reply.calls, truncated);
                res.calls = reply.calls;
            }
            Err(e) => {
                tracing::warn!(error = %e, "unparseable tool calls are returned as text");
                if !round_calls.calls.is_empty() {
                    res.streamed = StreamedCalls::Mismatch(format!(
                        "the streamed tool calls failed validation: {e}"
                    ));
                }
            }
        }
        Ok(res)
    }

    /// One round upstream: the conversation and tools sent to `target`, its answer streamed back (text
    /// and reasoning as they come; a host call's deltas as they come, re-serialized as the local
    /// engine's are; a client call's once the round's calls are all known valid, since a stream cannot
    /// take a call back), then every call parsed and validated against its schema here. An invalid one
    /// is returned as rejected, for the model to be told.
    async fn upstream_round(
        &self,
        target: &Target,
        r: &RoundCtx<'_>,
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) -> Result<RoundResult, AgentError> {
        let turn = r.turn;
        let spec = RoundSpec {
            model: &target.model,
            messages: r.messages,
            tools: r.all.definitions(),
            tool_choice: r.choice,
            parallel_tool_calls: turn.parallel_tool_calls,
            response_format: &turn.response_format,
            sampling: &turn.sampling,
            max_tokens: (turn.max_tokens != usize::MAX).then_some(turn.max_tokens),
            stop: &turn.stop,
            logprobs: turn.logprobs,
        };
        let mut calls: Vec<UpCall> = Vec::new();
        let first_round = r.first_round;
        let exposed = target.exposed();
        let o = {
            let calls = &mut calls;
            let counters = &mut *counters;
            let on_event = &mut *on_event;
            target
                .upstream
                .round(&spec, r.cancel, &mut |d| match d {
                    Delta::Accepted => {
                        if first_round {
                            on_event(Event::Started {
                                prompt_tokens: 0,
                                model: exposed.clone(),
                            });
                        }
                    }
                    Delta::Content(s) => on_event(Event::Content(s.to_owned())),
                    Delta::Reasoning(s) => on_event(Event::Reasoning(s.to_owned())),
                    Delta::Call {
                        index,
                        name,
                        arguments,
                    } => {
                        if calls.len() <= index {
                            calls.resize_with(index + 1, UpCall::default);
                        }
                        let c = &mut calls[index];
                        if let Some(n) = name {
                            c.name.push_str(n);
                        }
                        if let Some(a) = arguments {
                            c.feed(a, &turn.host_tools, counters, on_event);
                        }
                    }
                })
                .await?
        };
        let finish = if o.cancelled {
            Finish::Cancelled
        } else if o.finish.as_deref() == Some("length") {
            Finish::Length
        } else {
            Finish::Stop
        };
        let mut res = RoundResult {
            content: o.content,
            reasoning: o.reasoning,
            calls: Vec::new(),
            rejected: Vec::new(),
            finish,
            stop_string: None,
            usage: o.usage.map_or_else(Usage::default, |u| Usage {
                prompt_tokens: u.prompt,
                cached_tokens: u.cached,
                completion_tokens: u.completion,
            }),
            logprobs: o
                .logprobs
                .into_iter()
                .map(|l| TokenLogprob {
                    token: l.token,
                    bytes: l.bytes,
                    logprob: l.logprob,
                    top: l.top,
                })
                .collect(),
            first_token: o.first_token,
            streamed: StreamedCalls::Exact,
        };
        if o.cancelled {
            return Ok(res);
        }
        if !r.calls_possible {
            if !o.calls.is_empty() {
                tracing::warn!(upstream = %target.upstream.name(), calls = o.calls.len(), "calls from an upstream told not to call tools are dropped");
            }
            return Ok(res);
        }
        let truncated = finish == Finish::Length;
        // Buffered client deltas, in order, released when the round's calls all validated.
        let mut held: Vec<(ToolCall, Vec<String>)> = Vec::new();
        for (raw, mut up) in o.calls.into_iter().zip(
            calls
                .into_iter()
                .chain(std::iter::repeat_with(UpCall::default)),
        ) {
            up.close(&raw.name, &turn.host_tools, counters, on_event);
            let text = raw.arguments.trim();
            let parsed = if text.is_empty() {
                Ok(serde_json::json!({}))
            } else {
                serde_json::from_str::<Value>(text)
            };
            let call = |arguments: Value| ToolCall {
                id: up.id.clone().unwrap_or_else(call_id),
                kind: "function",
                function: thorn_tools::chat::FunctionCall {
                    name: raw.name.clone(),
                    arguments,
                },
            };
            match parsed {
                // Cut off by max_tokens: not a call (as locally); a host call's deltas went out.
                Err(_) if truncated => {
                    if up.host {
                        res.streamed = StreamedCalls::Truncated;
                    }
                }
                Err(e) => res.rejected.push((
                    call(serde_json::json!({})),
                    format!(
                        "the arguments are not valid JSON ({e}): {}",
                        crate::upstream::wire::clip(text, 200)
                    ),
                )),
                Ok(arguments) => {
                    let check = r.all.check(&thorn_tools::ParsedCall {
                        name: raw.name.clone(),
                        arguments: arguments.clone(),
                    });
                    let c = call(arguments);
                    match check {
                        Err(e) => res.rejected.push((c, e.to_string())),
                        Ok(()) if up.host => res.calls.push(c),
                        Ok(()) => {
                            held.push((c.clone(), std::mem::take(&mut up.fragments)));
                            res.calls.push(c);
                        }
                    }
                }
            }
        }
        if res.rejected.is_empty() {
            for (c, fragments) in held {
                let index = counters.next(false);
                on_event(Event::CallStart {
                    host: false,
                    index,
                    id: c.id.clone(),
                    name: c.function.name.clone(),
                });
                // The fragments as they were streamed when they spell the arguments exactly, else whole.
                let whole = c.function.arguments.to_string();
                let fragments = if fragments.concat() == whole {
                    fragments
                } else {
                    vec![whole]
                };
                for text in fragments {
                    on_event(Event::CallArguments {
                        host: false,
                        index,
                        text,
                    });
                }
            }
        }
        Ok(res)
    }
}

/// The engine a turn's rounds run on.
enum RoundEngine {
    /// The local engine thread.
    Local,
    /// An upstream, with the turn's hold on one of its slots.
    Upstream(Box<(Target, Lease)>),
}

/// The local errors a local-first turn answers by going upstream: `context` (the conversation outgrew
/// the local context) and `queue` (the local engine's queue is full).
fn spill_reason(e: &AgentError) -> Option<&'static str> {
    match e {
        AgentError::ContextLength { .. }
        | AgentError::PromptBytes { .. }
        | AgentError::Engine(EngineError::PromptTooLong { .. }) => Some("context"),
        AgentError::Busy(SubmitError::Full { .. }) => Some("queue"),
        _ => None,
    }
}

/// What one round works from.
struct RoundCtx<'a> {
    /// The conversation so far.
    messages: &'a [Message],
    /// The turn's tools (what calls are validated against).
    all: &'a Arc<ToolSet>,
    /// The tools shown this round (none when it must answer).
    shown: &'a Arc<ToolSet>,
    /// This round's choice.
    choice: &'a ToolChoice,
    /// The request.
    turn: &'a Turn,
    /// Whether this round may call tools.
    calls_possible: bool,
    /// Whether it is the turn's first (which reports [`Event::Started`]).
    first_round: bool,
    /// The request's cancel flag.
    cancel: &'a Arc<AtomicBool>,
}

/// What one round produced, whichever engine ran it.
struct RoundResult {
    /// Its answer text, as streamed.
    content: String,
    /// Its reasoning, as streamed.
    reasoning: String,
    /// Its valid calls.
    calls: Vec<ToolCall>,
    /// Its calls that failed validation, with why (upstream rounds only: the local grammar makes
    /// every call valid).
    rejected: Vec<(ToolCall, String)>,
    finish: Finish,
    stop_string: Option<String>,
    usage: Usage,
    logprobs: Vec<TokenLogprob>,
    first_token: Option<std::time::Instant>,
    /// How its streamed calls relate to its calls.
    streamed: StreamedCalls,
}

/// The request's streamed calls so far, client and host each counted from 0.
#[derive(Debug, Default)]
struct Counters {
    client: usize,
    host: usize,
}

impl Counters {
    /// The next index for a call of this kind.
    fn next(&mut self, host: bool) -> usize {
        let c = if host {
            &mut self.host
        } else {
            &mut self.client
        };
        *c += 1;
        *c - 1
    }
}

/// An upstream call as it streams: its name, and once its arguments start, a [`CallStreamer`] that
/// re-serializes them (so the fragments spell exactly the validated call's `arguments`).
#[derive(Debug, Default)]
struct UpCall {
    name: String,
    /// Set when it began (its id).
    id: Option<String>,
    host: bool,
    /// Its index among the request's calls of its kind (host calls: assigned when they begin).
    index: usize,
    streamer: CallStreamer,
    /// A client call's argument fragments, held until the round validates.
    fragments: Vec<String>,
}

impl UpCall {
    /// Begins the call (its name is complete once arguments arrive) and streams it.
    fn begin(
        &mut self,
        name: &str,
        host_tools: &[String],
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) {
        if self.id.is_some() {
            return;
        }
        if self.name.is_empty() {
            self.name = name.to_owned();
        }
        let id = call_id();
        self.host = host_tools.contains(&self.name);
        if self.host {
            self.index = counters.next(true);
            on_event(Event::CallStart {
                host: true,
                index: self.index,
                id: id.clone(),
                name: self.name.clone(),
            });
        }
        self.id = Some(id);
        let head = format!(
            "{OPEN}{{\"name\":{},\"arguments\":",
            serde_json::Value::String(self.name.clone())
        );
        self.push(&head, on_event);
    }

    fn push(&mut self, text: &str, on_event: &mut (dyn FnMut(Event) + Send)) {
        let (host, index) = (self.host, self.index);
        let fragments = &mut self.fragments;
        self.streamer.push(text, &mut |d| {
            if let CallDelta::Arguments { text, .. } = d {
                if host {
                    on_event(Event::CallArguments { host, index, text });
                } else {
                    fragments.push(text);
                }
            }
        });
    }

    /// More arguments text.
    fn feed(
        &mut self,
        text: &str,
        host_tools: &[String],
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) {
        let name = self.name.clone();
        self.begin(&name, host_tools, counters, on_event);
        self.push(text, on_event);
    }

    /// The call ended: a call that never sent arguments begins now; the re-serializer is flushed.
    fn close(
        &mut self,
        name: &str,
        host_tools: &[String],
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) {
        self.begin(name, host_tools, counters, on_event);
        self.push("}", on_event);
    }
}

/// Rounds of host tool calls a request gets: it may ask for fewer than the operator allows, never more,
/// and at least one (`0` is not "unlimited").
fn tool_rounds(requested: Option<usize>, operator: usize) -> usize {
    requested.map_or(operator, |n| n.min(operator)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_context_and_queue_failures_spill_upstream() {
        let ctx = AgentError::ContextLength {
            prompt: 900,
            context: 512,
        };
        assert_eq!(spill_reason(&ctx), Some("context"));
        let bytes = AgentError::PromptBytes {
            bytes: 1 << 20,
            context: 512,
        };
        assert_eq!(spill_reason(&bytes), Some("context"));
        let full = AgentError::Busy(SubmitError::Full { capacity: 4 });
        assert_eq!(spill_reason(&full), Some("queue"));
        // A bad request, a stopped engine or a failed pass is not the upstream's to answer.
        assert_eq!(spill_reason(&AgentError::NoTemplate), None);
        assert_eq!(spill_reason(&AgentError::Busy(SubmitError::Stopped)), None);
        assert_eq!(
            spill_reason(&AgentError::Engine(EngineError::Internal("bug".into()))),
            None
        );
    }

    #[test]
    fn a_request_cannot_raise_the_operators_tool_rounds() {
        assert_eq!(tool_rounds(None, 8), 8);
        assert_eq!(tool_rounds(Some(3), 8), 3);
        assert_eq!(tool_rounds(Some(1_000_000), 8), 8);
        assert_eq!(tool_rounds(Some(0), 8), 1, "0 is not unlimited");
        assert_eq!(tool_rounds(Some(usize::MAX), 1), 1);
    }

    fn split(pieces: &[&str]) -> (String, bool) {
        let (content, calls) = split_all(pieces);
        (content, !calls.is_empty() || pieces.concat().contains(OPEN))
    }

    /// Content, and the calls' deltas, of streamed pieces.
    fn split_all(pieces: &[&str]) -> (String, Vec<CallDelta>) {
        let mut s = Splitter::default();
        let (mut got, mut calls) = (String::new(), Vec::new());
        let mut take = |p: Split| match p {
            Split::Content(t) => got.push_str(&t),
            Split::Reasoning(_) => panic!("no reasoning here"),
            Split::Call(d) => calls.push(d),
        };
        for p in pieces {
            s.push(p, true, &mut take);
        }
        s.finish(&mut take);
        (got, calls)
    }

    /// Content, reasoning and call deltas of streamed pieces, for a prompt that did or did not open the
    /// reasoning block.
    fn split_thinking(opened: bool, pieces: &[&str]) -> (String, String, usize) {
        let mut s = Splitter::new(opened);
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), 0);
        let mut take = |p: Split| match p {
            Split::Content(t) => content.push_str(&t),
            Split::Reasoning(t) => reasoning.push_str(&t),
            Split::Call(CallDelta::Begin { .. }) => calls += 1,
            Split::Call(_) => {}
        };
        for p in pieces {
            s.push(p, true, &mut take);
        }
        s.finish(&mut take);
        (content, reasoning, calls)
    }

    #[test]
    fn splitter_takes_the_reasoning_off_the_front() {
        // Opened by the model, split anywhere, then a call.
        assert_eq!(
            split_thinking(
                false,
                &[
                    "\n<thi",
                    "nk>Let me <tool_call> think.</th",
                    "ink>\n\nSure. <tool_call>{\"name\":\"f\"}"
                ]
            ),
            ("Sure. ".into(), "Let me <tool_call> think.".into(), 1)
        );
        // Opened by the prompt.
        assert_eq!(
            split_thinking(true, &["Hm.", "</think>", "Hi"]),
            ("Hi".into(), "Hm.".into(), 0)
        );
        // No reasoning: a `<` at the start is text; so is a short answer.
        assert_eq!(
            split_thinking(false, &["<", "b>"]),
            ("<b>".into(), String::new(), 0)
        );
        assert_eq!(
            split_thinking(false, &["<t"]),
            ("<t".into(), String::new(), 0)
        );
        // Cut off inside the reasoning: it is all reasoning.
        assert_eq!(
            split_thinking(false, &["<think>still going</"]),
            (String::new(), "still going</".into(), 0)
        );
        // The reply's calls are read after the reasoning only.
        assert_eq!(answer_part("<think>a <tool_call></think> b", false), "b");
        assert_eq!(answer_part("x</think>y", true), "y");
        assert_eq!(answer_part("<think>unfinished", false), "");
        assert_eq!(
            answer_part("plain </think> text", false),
            "plain </think> text"
        );
    }

    #[test]
    fn splitter_streams_the_calls_it_holds_back() {
        let (content, calls) = split_all(&[
            "Sure. <tool",
            "_call>{\"name\":\"add\",\"argu",
            "ments\":{\"a\":1,",
            "\"b\":2}}</tool_call><tool_call>{\"name\":\"neg\",\"arguments\":{\"x\":3}}</tool_call>",
        ]);
        assert_eq!(content, "Sure. ");
        let text = |i: usize| -> String {
            calls
                .iter()
                .filter_map(|d| match d {
                    CallDelta::Arguments { index, text } if *index == i => Some(text.as_str()),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(
            calls[0],
            CallDelta::Begin {
                index: 0,
                name: "add".into()
            }
        );
        assert_eq!(text(0), "{\"a\":1,\"b\":2}");
        assert_eq!(text(1), "{\"x\":3}");
        // The first call's arguments arrived in a fragment per key and value (`{"a"`, `:1`, `,` at the
        // end of its piece, `"b"`, `:2`, `}`).
        let pieces = calls
            .iter()
            .filter(|d| matches!(d, CallDelta::Arguments { index: 0, .. }))
            .count();
        assert_eq!(pieces, 6);
        assert_eq!(calls.last(), Some(&CallDelta::End { index: 1 }));
    }

    fn call(name: &str, args: Value) -> ToolCall {
        ToolCall {
            id: "call_x".into(),
            kind: "function",
            function: thorn_tools::chat::FunctionCall {
                name: name.into(),
                arguments: args,
            },
        }
    }

    #[test]
    fn streamed_calls_settle_against_the_reply() {
        let s = |id: &str, name: &str, host, args: &str| Streamed {
            id: id.into(),
            name: name.into(),
            host,
            index: 0,
            args: args.into(),
        };
        let streamed = RoundCalls {
            calls: vec![
                s("call_a", "f", false, "{\"a\":1}"),
                s("call_b", "g", true, "{\"b\":"),
            ],
        };
        // The truncated second call is not returned; the first gets its streamed id.
        let mut calls = vec![call("f", serde_json::json!({"a": 1}))];
        assert_eq!(streamed.settle(&mut calls, true), StreamedCalls::Truncated);
        assert_eq!(calls[0].id, "call_a");
        // Without truncation the missing call is a mismatch, and so are other arguments.
        assert!(matches!(
            streamed.settle(&mut calls, false),
            StreamedCalls::Mismatch(_)
        ));
        let one = RoundCalls {
            calls: streamed.calls[..1].to_vec(),
        };
        let mut other = vec![call("f", serde_json::json!({"a": 2}))];
        assert!(matches!(
            one.settle(&mut other, false),
            StreamedCalls::Mismatch(_)
        ));
        let mut same = vec![call("f", serde_json::json!({"a": 1}))];
        assert_eq!(one.settle(&mut same, false), StreamedCalls::Exact);
    }

    #[test]
    fn splitter_holds_back_what_may_start_a_call() {
        assert_eq!(
            split(&["Hello ", "wor", "ld"]),
            ("Hello world".into(), false)
        );
        assert_eq!(
            split(&[
                "Let me check. <tool",
                "_call>{\"name\":",
                "\"x\"}</tool_call>"
            ]),
            ("Let me check. ".into(), true)
        );
        // A `<` that turns out not to start the trigger is released.
        assert_eq!(split(&["a <", "b"]), ("a <b".into(), false));
        assert_eq!(split(&["x <tool"]), ("x <tool".into(), false));
        assert_eq!(split(&["<tool_call>{}"]), (String::new(), true));
        assert_eq!(split(&["é<", "tool_call>"]), ("é".into(), true));
    }
}
