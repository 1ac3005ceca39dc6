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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use thiserror::Error;
use thorn_engine::engine::scheduler::SchedulerConfig;
use thorn_engine::engine::service::{EngineService, SubmitError};
use thorn_engine::engine::{Engine, EngineError};
use thorn_engine::tokenizer::Tokenizer;
use thorn_guide::GuideError;
use thorn_plugin::{Caller, LiveSet, PluginSet};
use thorn_tools::chat::{ChatTemplate, Message, Role, ToolCall};
use thorn_tools::{ToolChoice, ToolError, ToolFormat, ToolSet};
use tracing::Instrument;

use crate::upstream::{Lease, Target, UpstreamError};
use split::Counters;

mod local;
mod remote;
mod split;
mod tool_use;
mod turn;

pub use tool_use::{Answers, Routing, ToolUse, router_for};
pub use turn::{
    Event, Finish, HostCall, Outcome, OutputLimits, Route, Served, StreamedCalls, TokenLogprob,
    Turn, Usage,
};

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
    /// How the model's chat template writes a tool call ([`ToolFormat::detect`]; Hermes without one): the
    /// agent's format unless the operator names another ([`Agent::with_tool_format`]).
    pub tool_format: ToolFormat,
}

impl ModelInfo {
    /// The most bytes a prompt that fits the context can have: no token spells more than the longest
    /// vocabulary entry, so a longer text cannot fit whatever it holds.
    pub fn max_prompt_bytes(&self) -> usize {
        self.context
            .saturating_mul(self.tokenizer.max_token_bytes())
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
    /// How the model writes tool calls (the detected format unless the operator named one).
    tool_format: ToolFormat,
    /// Whether a thinking model reasons when a request does not say (`--reasoning`; `None`: as its chat
    /// template does by default).
    reasoning: Option<bool>,
    /// Most reasoning tokens when a request does not say (`--reasoning-budget`).
    reasoning_budget: Option<usize>,
    /// The server's bounds on a round's output.
    output: OutputLimits,
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
        let (template, tool_format) = match engine.gguf().get_str("tokenizer.chat_template") {
            Ok(src) => (Some(ChatTemplate::new(src)?), ToolFormat::detect(src)),
            Err(_) => {
                tracing::warn!("the model has no chat template: only raw completions are served");
                (None, ToolFormat::default())
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
            tool_format,
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
            reasoning: None,
            reasoning_budget: None,
            tool_format: model.tool_format,
            model: Arc::new(model),
            plugins: Arc::new(LiveSet::new(plugins)),
            max_tool_rounds: max_tool_rounds.max(1),
            max_host_calls: Self::MAX_HOST_CALLS,
            raw_special: false,
            tool_use: ToolUse::default(),
            output: OutputLimits::default(),
        }
    }

    /// Bounds what each round may generate: `default` tokens when its request sets no `max_tokens`,
    /// never more than `limit` (`--max-tokens-default`, `--max-tokens-limit`).
    pub fn with_output_limits(mut self, output: OutputLimits) -> Self {
        self.output = output;
        self
    }

    /// The tokens a round of `turn` may generate.
    fn output_tokens(&self, turn: &Turn) -> usize {
        self.output.tokens(turn.max_tokens)
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

    /// Sets whether a thinking model reasons when a request does not say (`--reasoning on|off`; `None`,
    /// `auto`: as its chat template does by default): the template's `enable_thinking` variable.
    pub fn with_reasoning(mut self, on: Option<bool>) -> Self {
        self.reasoning = on;
        self
    }

    /// Sets the most tokens a thinking model writes inside its think block, when a request does not say,
    /// before the engine closes the block for it (`--reasoning-budget`; `None`: no limit).
    pub fn with_reasoning_budget(mut self, tokens: Option<usize>) -> Self {
        self.reasoning_budget = tokens;
        self
    }

    /// The chat-template variables of `turn`: its own, and the server's reasoning default where it
    /// leaves `enable_thinking` out.
    fn template_kwargs(&self, turn: &Turn) -> serde_json::Map<String, serde_json::Value> {
        with_reasoning_default(&turn.template_kwargs, self.reasoning)
    }

    /// Has the model write tool calls in `format` instead of the one detected from its chat template
    /// (`--tool-format`): the grammar, the parser, the streamed deltas and past calls follow it.
    pub fn with_tool_format(mut self, format: ToolFormat) -> Self {
        self.tool_format = format;
        self
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
        let full = Arc::new(ToolSet::new(&turn.tools)?.with_format(self.tool_format)?);
        turn.tool_choice.check(&full)?;
        let max_rounds = tool_rounds(turn.max_tool_rounds, self.max_tool_rounds);
        let mut host_calls_left = self.max_host_calls;
        let caller = Caller {
            conversation: turn.conversation.clone(),
            key_id: turn.key_id.clone(),
            peer: turn.peer.clone(),
            // A fresh id per run: a policy's per-request budget counts by it.
            request: Some(thorn_tools::call_id().replacen("call_", "req_", 1)),
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
            // A span per round (the request's span is its parent): a trace shows where the time went.
            let span = tracing::info_span!(
                "round",
                n = out.rounds + 1,
                engine = match &engine {
                    RoundEngine::Local => "local",
                    RoundEngine::Upstream(_) => "upstream",
                },
                prompt_tokens = tracing::field::Empty,
                completion_tokens = tracing::field::Empty,
                calls = tracing::field::Empty,
            );
            let round = match &engine {
                RoundEngine::Local => {
                    self.local_round(&ctx, routed, &mut counters, on_event)
                        .instrument(span.clone())
                        .await
                }
                RoundEngine::Upstream(up) => {
                    self.upstream_round(&up.0, &ctx, &mut counters, on_event)
                        .instrument(span.clone())
                        .await
                }
            };
            if let Ok(r) = &round {
                span.record("prompt_tokens", r.usage.prompt_tokens);
                span.record("completion_tokens", r.usage.completion_tokens);
                span.record("calls", r.calls.len());
            }
            drop(span);
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
                    let (res, _) = host_call(&turn.plugins, &caller, &call, &cancel, on_event)
                        .instrument(tracing::info_span!(
                            "tool_call",
                            function = %call.function.name,
                            id = %call.id,
                        ))
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
}

/// Runs one host call for `caller`, reporting a wait for approval as [`Event::ApprovalPending`]. A
/// request cancelled while its call waits withdraws the call (denied as cancelled); one cancelled while
/// a motion runs (a function with a deadman) abandons it, and the plugin's stop runs.
async fn host_call(
    plugins: &PluginSet,
    caller: &Caller,
    call: &ToolCall,
    cancel: &AtomicBool,
    on_event: &mut (dyn FnMut(Event) + Send),
) -> (
    Result<serde_json::Value, thorn_plugin::PluginError>,
    thorn_plugin::CallReport,
) {
    let (Some(approvals), Some(request)) = (plugins.approvals(), caller.request.as_deref()) else {
        return plugins
            .call_async(caller, &call.function.name, &call.function.arguments)
            .await;
    };
    let mut watch = approvals.watch(request);
    let motion = plugins.is_motion(&call.function.name);
    let run = plugins.call_async(caller, &call.function.name, &call.function.arguments);
    tokio::pin!(run);
    let mut waiting = motion;
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
    loop {
        tokio::select! {
            out = &mut run => return out,
            Some(p) = watch.next() => {
                waiting = true;
                on_event(Event::ApprovalPending { call_id: call.id.clone(), pending: Box::new(p) });
            }
            _ = tick.tick(), if waiting => {
                if cancel.load(Ordering::Relaxed) {
                    // A call still waiting for its decision ends denied; one already moving is abandoned.
                    let undecided = approvals.waiting_for(request);
                    watch.withdraw();
                    if motion && !undecided {
                        let e = thorn_plugin::PluginError::Deadman {
                            plugin: String::new(),
                            function: call.function.name.clone(),
                            why: "the request was cancelled".into(),
                        };
                        return (Err(e), thorn_plugin::CallReport::default());
                    }
                }
            }
        }
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
/// Rounds of host tool calls a request gets: it may ask for fewer than the operator allows, never more,
/// and at least one (`0` is not "unlimited").
fn tool_rounds(requested: Option<usize>, operator: usize) -> usize {
    requested.map_or(operator, |n| n.min(operator)).max(1)
}
/// `kw` with `enable_thinking` set to `on` where it leaves it out (`None`: left as it is).
fn with_reasoning_default(
    kw: &serde_json::Map<String, serde_json::Value>,
    on: Option<bool>,
) -> serde_json::Map<String, serde_json::Value> {
    let mut kw = kw.clone();
    if let Some(on) = on {
        kw.entry("enable_thinking")
            .or_insert(serde_json::Value::Bool(on));
    }
    kw
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

    #[test]
    fn the_servers_reasoning_default_fills_only_what_a_request_leaves_out() {
        use serde_json::json;
        let none = serde_json::Map::new();
        assert!(with_reasoning_default(&none, None).is_empty());
        assert_eq!(
            serde_json::Value::Object(with_reasoning_default(&none, Some(false))),
            json!({"enable_thinking": false})
        );
        let asked = json!({"enable_thinking": true})
            .as_object()
            .cloned()
            .unwrap();
        assert_eq!(
            serde_json::Value::Object(with_reasoning_default(&asked, Some(false))),
            json!({"enable_thinking": true})
        );
    }
}
