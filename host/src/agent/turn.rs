//! A turn's domain types: the request the agent serves ([`Turn`]), what it produces ([`Outcome`]) and
//! what a streaming caller sees on the way ([`Event`]).

use serde_json::Value;
use std::sync::Arc;
use thorn_engine::engine::FinishReason;
use thorn_engine::sample::SamplingParams;
use thorn_plugin::PluginSet;
use thorn_tools::chat::{Message, ToolCall};
use thorn_tools::{ResponseFormat, ToolChoice};

use super::ToolUse;
use crate::upstream::Target;

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
    /// More chat-template variables (`chat_template_kwargs`, `enable_thinking` from `reasoning_effort`
    /// or Anthropic's `thinking`), checked by `thorn_tools::chat::check_kwargs`; the agent's reasoning
    /// default fills `enable_thinking` when they leave it out.
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Most tokens a thinking model writes inside its think block before the engine closes it (`None`:
    /// the agent's default, [`Agent::with_reasoning_budget`]).
    pub reasoning_budget: Option<usize>,
}

impl Turn {
    /// A turn over `messages`, its host tools resolved in `plugins`, with OpenAI's defaults for the rest:
    /// no tools, `tool_choice: auto` with parallel calls, a text answer, default sampling, no limit on
    /// tokens but the context's, no stop strings, the agent's tool rounds and tool use, speculation on,
    /// no log-probabilities, nothing for the audit log, served by the local model. Callers set what their
    /// request says with struct update syntax (`Turn { tools, ..Turn::new(messages, plugins) }`).
    pub fn new(messages: Vec<Message>, plugins: Arc<PluginSet>) -> Self {
        Turn {
            messages,
            tools: Vec::new(),
            host_tools: Vec::new(),
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            response_format: ResponseFormat::Text,
            sampling: SamplingParams::default(),
            max_tokens: usize::MAX,
            stop: Vec::new(),
            max_tool_rounds: None,
            conversation: None,
            key_id: None,
            peer: None,
            logprobs: false,
            speculation: true,
            tool_use: None,
            plugins,
            route: Route::Local,
            template_kwargs: serde_json::Map::new(),
            reasoning_budget: None,
        }
    }
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
    /// A host call waits for a person's approval (the policy says so): it runs once someone allowed
    /// to approves it at `/v1/thorn/approvals/ID`, and is denied when its time runs out.
    ApprovalPending {
        /// The tool call's id (as in [`Event::HostCall`]).
        call_id: String,
        /// The waiting call, with the approval's id.
        pending: Box<thorn_plugin::Pending>,
    },
}

/// The server's bounds on what one round may generate (`--max-tokens-default`, `--max-tokens-limit`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputLimits {
    /// The most tokens of a round whose request sets no `max_tokens` (`None`: up to the context).
    pub default: Option<usize>,
    /// The most tokens of any round, whatever its request asks (`None`: no bound but the context).
    pub limit: Option<usize>,
}

impl OutputLimits {
    /// The tokens a round may generate when its request asked for `asked` (`usize::MAX`: did not say).
    pub fn tokens(&self, asked: usize) -> usize {
        let wanted = match asked {
            usize::MAX => self.default.unwrap_or(usize::MAX),
            n => n,
        };
        wanted.min(self.limit.unwrap_or(usize::MAX))
    }
}

#[cfg(test)]
mod output_tests {
    use super::OutputLimits;

    #[test]
    fn a_request_without_max_tokens_gets_the_default_and_none_passes_the_limit() {
        let l = OutputLimits {
            default: Some(1024),
            limit: Some(4096),
        };
        assert_eq!(l.tokens(usize::MAX), 1024);
        assert_eq!(l.tokens(10), 10);
        assert_eq!(l.tokens(100_000), 4096);
        let open = OutputLimits::default();
        assert_eq!(open.tokens(usize::MAX), usize::MAX);
        assert_eq!(open.tokens(7), 7);
        let capped = OutputLimits {
            default: Some(8192),
            limit: Some(100),
        };
        assert_eq!(
            capped.tokens(usize::MAX),
            100,
            "the limit bounds the default too"
        );
    }
}
