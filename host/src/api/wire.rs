//! OpenAI wire types, kept apart from the domain types they are converted to and from. Requests accept what
//! OpenAI clients send (unknown fields are ignored, as OpenAI does); a known field of the wrong type is a
//! 400 naming it.

use serde::Deserialize;
use serde_json::Value;

mod response;
pub use response::{
    AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatLogprobs, ChunkChoice, Delta,
    FINGERPRINT, FunctionDelta, FunctionOut, Health, HostCallOut, LegacyLogprobs, ModelList,
    ModelObject, PromptDetails, TextChoice, TextCompletion, TokenLogprobOut, ToolCallDelta,
    ToolCallOut, TopLogprobOut, UpstreamHealth, WireUsage,
};

/// `stop`: a string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// As a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// Message `content`: text, or a list of parts of which the text ones are used.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts (`{"type": "text", "text": ...}`).
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    /// `text` (other kinds are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: Option<String>,
}

/// A tool call as the client sends it back in an assistant message.
#[derive(Debug, Clone, Deserialize)]
pub struct WireToolCall {
    /// Its id.
    pub id: String,
    /// `function`.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// The function and its arguments.
    pub function: WireFunction,
}

/// A function call: `arguments` is JSON text.
#[derive(Debug, Clone, Deserialize)]
pub struct WireFunction {
    /// The function.
    pub name: String,
    /// Its arguments, as JSON text.
    #[serde(default)]
    pub arguments: String,
}

/// One message of a chat request.
#[derive(Debug, Clone, Deserialize)]
pub struct WireMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Its content (absent or null for an assistant message that only calls tools).
    #[serde(default)]
    pub content: Option<Content>,
    /// Calls an assistant message made.
    #[serde(default)]
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// The call a tool message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A participant or tool name.
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant message's reasoning, as thorn (and other servers) return it.
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The model name (see `/v1/models`).
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<WireMessage>,
    /// Tools (OpenAI function tools).
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Allow several calls in one answer (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// thorn extension: `false` turns speculative decoding off for this request (same output, for
    /// measurements and debugging).
    #[serde(default)]
    pub speculation: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    #[serde(default)]
    pub response_format: Option<Value>,
    /// Sampling temperature (default 1, as OpenAI).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Seed for reproducible sampling.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Most tokens to generate (legacy name).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// Return log-probabilities.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per token (0-20; needs `logprobs`).
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Number of choices; only 1 is served.
    #[serde(default)]
    pub n: Option<u32>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// OpenAI presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// An end-user id (when no `conversation_id` is given, the audit log records `user-` and a digest of it).
    #[serde(default)]
    pub user: Option<String>,
    /// thorn: top-k sampling.
    #[serde(default)]
    pub top_k: Option<u32>,
    /// thorn: min-p sampling.
    #[serde(default)]
    pub min_p: Option<f32>,
    /// thorn: repetition penalty.
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// thorn: most rounds of host (plugin) tool calls.
    #[serde(default)]
    pub max_tool_rounds: Option<u32>,
    /// thorn: conversation id for the plugin audit log (1 to 128 of `A-Z a-z 0-9 . _ : -`).
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// thorn: how host tools are put in front of the model (default: the server's).
    #[serde(default)]
    pub thorn_tool_use: Option<ToolUseOpts>,
    /// thorn: the model class to serve with when `model` leaves it open: `large` (the `--local-first`
    /// upstream's model) or `small` (the local one).
    #[serde(default)]
    pub thorn_model_class: Option<String>,
}

/// `thorn_tool_use`: each field left out keeps the server's setting (`thorn::agent::ToolUse`).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolUseOpts {
    /// `"lexical"` (the router picks the host functions shown, or none) or `"off"` (the model sees all).
    #[serde(default)]
    pub routing: Option<crate::agent::Routing>,
    /// Show the plugins' example calls.
    #[serde(default)]
    pub examples: Option<bool>,
    /// `"template"` (a routed call's answer template answers) or `"model"`.
    #[serde(default)]
    pub answers: Option<crate::agent::Answers>,
}

impl ToolUseOpts {
    /// `base` with the fields given here replaced.
    pub fn over(self, base: crate::agent::ToolUse) -> crate::agent::ToolUse {
        crate::agent::ToolUse {
            routing: self.routing.unwrap_or(base.routing),
            examples: self.examples.unwrap_or(base.examples),
            answers: self.answers.unwrap_or(base.answers),
        }
    }
}

/// `prompt` of a completion: a string or a list with one string.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    One(String),
    /// A list (only one prompt is served).
    Many(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Most tokens (default 16, as OpenAI).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Temperature (default 1).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Seed.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Stop>,
    /// Alternatives per token (0-5).
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// thorn extension: `false` turns speculative decoding off for this request.
    #[serde(default)]
    pub speculation: Option<bool>,
    /// Number of choices; only 1.
    #[serde(default)]
    pub n: Option<u32>,
    /// Stream.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Echo the prompt (refused: not served).
    #[serde(default)]
    pub echo: Option<bool>,
}
