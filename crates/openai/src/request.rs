//! What a client sends: `POST /v1/chat/completions` and `POST /v1/completions` bodies, and the messages
//! and tool calls a conversation carries.

use crate::lenient;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::borrow::Cow;

/// `stop`: a string or a list of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// Message `content`: text, or a list of parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content<'a> {
    /// Plain text.
    Text(Cow<'a, str>),
    /// Content parts (`{"type": "text", "text": ...}`).
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// `text`, `image_url`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// A tool call: in an assistant message a client sends back, or in an answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall<'a> {
    /// `call_...`.
    pub id: Cow<'a, str>,
    /// `function` (always sent; a client may leave it out).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<Cow<'a, str>>,
    /// The function and its arguments.
    pub function: Function<'a>,
}

impl<'a> ToolCall<'a> {
    /// A function call with its arguments as JSON text.
    pub fn function(
        id: impl Into<Cow<'a, str>>,
        name: impl Into<Cow<'a, str>>,
        arguments: impl Into<Cow<'a, str>>,
    ) -> Self {
        ToolCall {
            id: id.into(),
            kind: Some(Cow::Borrowed("function")),
            function: Function {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

/// A function call: `arguments` is JSON text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Function<'a> {
    /// The function.
    pub name: Cow<'a, str>,
    /// Its arguments, as JSON text (absent: `""`; an object is read as its text).
    #[serde(default, deserialize_with = "lenient::arguments")]
    pub arguments: Cow<'a, str>,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message<'a> {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: Cow<'a, str>,
    /// Its content (`null` for an assistant message that only calls tools).
    #[serde(default)]
    pub content: Option<Content<'a>>,
    /// Calls an assistant message made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall<'a>>>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<Cow<'a, str>>,
    /// A participant or tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Cow<'a, str>>,
    /// An assistant message's reasoning, as thorn (and other servers) return it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<Cow<'a, str>>,
}

impl<'a> Message<'a> {
    /// A message of `role` with text `content` and nothing else.
    pub fn text(role: impl Into<Cow<'a, str>>, content: impl Into<Cow<'a, str>>) -> Self {
        Message {
            role: role.into(),
            content: Some(Content::Text(content.into())),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/chat/completions`. Every field but `messages` may be left out; a client sets what it
/// needs over [`Default`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest<'a> {
    /// The model name (see `/v1/models`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<Cow<'a, str>>,
    /// The conversation.
    pub messages: Vec<Message<'a>>,
    /// Stream server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Tools (OpenAI function tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Cow<'a, [Value]>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    /// Allow several calls in one answer (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// thorn: `false` turns speculative decoding off for this request (same output, for measurements and
    /// debugging).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
    /// Sampling temperature (default 1, as OpenAI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Seed for reproducible sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// OpenAI presence penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// Top-k sampling (thorn, vLLM, SGLang and llama-server take it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// Min-p sampling (as `top_k`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Repetition penalty (as `top_k`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// Most tokens to generate (legacy name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Most tokens to generate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Return log-probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// Alternatives per token (0-20; needs `logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    /// Number of choices (thorn serves 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// An end-user id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// thorn: most rounds of host (plugin) tool calls (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tool_rounds: Option<u32>,
    /// thorn: conversation id for the plugin audit log (1 to 128 of `A-Z a-z 0-9 . _ : -`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<String>,
    /// thorn: how host tools are put in front of the model (default: the server's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thorn_tool_use: Option<ToolUseOpts>,
    /// thorn: the model class to serve with when `model` leaves it open: `large` (the `--local-first`
    /// upstream's model) or `small` (the local one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thorn_model_class: Option<String>,
    /// More chat-template variables (vLLM's and SGLang's `chat_template_kwargs`), such as
    /// `{"enable_thinking": false}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// How much a reasoning model thinks: `none` switches its reasoning off, `minimal`, `low`, `medium`
    /// and `high` on (and reach the template as `reasoning_effort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
}

/// thorn's `thorn_tool_use`: each field left out keeps the server's setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolUseOpts {
    /// Which host functions the model is shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<ToolRouting>,
    /// Show the plugins' example calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<bool>,
    /// Who words the answer after a routed call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answers: Option<ToolAnswers>,
}

/// `thorn_tool_use.routing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolRouting {
    /// The model sees every requested tool and decides.
    Off,
    /// The router picks the host functions shown, or none.
    Lexical,
}

/// `thorn_tool_use.answers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolAnswers {
    /// The model words the answer from the results.
    Model,
    /// A routed call's answer template answers, where the function has one.
    Template,
}

/// A completion's `prompt`: a string or a list of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    One(String),
    /// A list (thorn serves one).
    Many(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Most tokens (default 16, as OpenAI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Temperature (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Alternatives per token (0-5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// thorn: `false` turns speculative decoding off for this request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<bool>,
    /// Number of choices (thorn serves 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// Stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Presence penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// Echo the prompt (thorn refuses it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
}
