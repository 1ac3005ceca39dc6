//! What a server answers: `chat.completion`, its stream of `chat.completion.chunk`s, `text_completion`,
//! `/v1/models` and error bodies.

use crate::lenient;
use crate::request::ToolCall;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::borrow::Cow;

/// `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: usize,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: usize,
    /// Their sum.
    #[serde(default)]
    pub total_tokens: usize,
    /// Details (thorn always sends them; `None` when a server did not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptDetails {
    /// Prompt tokens served from the KV cache (`None` when a server did not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<usize>,
}

impl Usage {
    /// The usage of `prompt` tokens (`cached` of them from the cache) and `completion` generated ones.
    pub fn new(prompt: usize, cached: usize, completion: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: Some(PromptDetails {
                cached_tokens: Some(cached),
            }),
        }
    }

    /// `prompt_tokens_details.cached_tokens`, where it was given.
    pub fn cached_tokens(&self) -> Option<usize> {
        self.prompt_tokens_details.and_then(|d| d.cached_tokens)
    }
}

/// `chat.completion`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion<'a> {
    /// `chatcmpl-...`.
    #[serde(default)]
    pub id: Cow<'a, str>,
    /// `chat.completion`.
    #[serde(default)]
    pub object: Cow<'a, str>,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The served model's name.
    #[serde(default)]
    pub model: Cow<'a, str>,
    /// The server's build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<Cow<'a, str>>,
    /// The choices (thorn serves one).
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub choices: Vec<ChatChoice<'a>>,
    /// Token counts (thorn always sends them).
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// A choice of a [`ChatCompletion`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice<'a> {
    /// Its place.
    #[serde(default)]
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage<'a>,
    /// Token log-probabilities when asked for (`null` otherwise).
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs<'a>>,
    /// `stop`, `length`, `tool_calls`, ... (thorn always sends one).
    #[serde(default)]
    pub finish_reason: Option<Cow<'a, str>>,
}

/// The assistant's message in an answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage<'a> {
    /// `assistant`.
    #[serde(default)]
    pub role: Cow<'a, str>,
    /// The text (`null` when the answer is only tool calls).
    #[serde(default)]
    pub content: Option<Cow<'a, str>>,
    /// A refusal (thorn: always `null`).
    #[serde(default)]
    pub refusal: Option<Cow<'a, str>>,
    /// Calls for the client to run.
    #[serde(
        default,
        deserialize_with = "lenient::null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tool_calls: Vec<ToolCall<'a>>,
    /// thorn: host (plugin) calls thorn ran during the request, with their results.
    #[serde(
        default,
        deserialize_with = "lenient::null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub thorn_host_tool_calls: Vec<HostCall<'a>>,
    /// What a thinking model reasoned before it answered (absent when it did not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<Cow<'a, str>>,
    /// The same, under the name newer vLLM uses (read only; thorn writes `reasoning_content`).
    #[serde(default, skip_serializing)]
    pub reasoning: Option<Cow<'a, str>>,
    /// thorn: the host functions its tool router showed the model (`[]`: none, it answered without
    /// tools); absent when the request was not routed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thorn_routed_tools: Option<Cow<'a, [String]>>,
}

impl AssistantMessage<'_> {
    /// The reasoning, under either name (`reasoning_content` first).
    pub fn reasoning(&self) -> Option<&str> {
        reasoning(&self.reasoning_content, &self.reasoning)
    }
}

fn reasoning<'s>(a: &'s Option<Cow<'_, str>>, b: &'s Option<Cow<'_, str>>) -> Option<&'s str> {
    [a, b]
        .into_iter()
        .find_map(|r| r.as_deref().filter(|r| !r.is_empty()))
}

/// thorn: a host call it ran (or is about to run), and what came of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostCall<'a> {
    /// The call id.
    pub id: Cow<'a, str>,
    /// The function.
    pub name: Cow<'a, str>,
    /// Its arguments as JSON text.
    #[serde(default, deserialize_with = "lenient::arguments")]
    pub arguments: Cow<'a, str>,
    /// The plugin's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Cow<'a, Value>>,
    /// The error the model was shown instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Cow<'a, str>>,
    /// The error's kind (`timeout`, `arguments`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<Cow<'a, str>>,
}

/// thorn: a host call waiting for a person's approval (decided at `/v1/thorn/approvals/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalPending<'a> {
    /// The approval's id (what a decision names).
    pub id: Cow<'a, str>,
    /// The tool call's id.
    pub call_id: Cow<'a, str>,
    /// The plugin (or MCP server) that would run it.
    pub plugin: Cow<'a, str>,
    /// The function.
    pub function: Cow<'a, str>,
    /// Its arguments.
    pub arguments: Cow<'a, Value>,
    /// Seconds since the Unix epoch when it is denied if nobody decides.
    pub expires_at: u64,
}

/// Chat `logprobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs<'a> {
    /// One entry per generated token.
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub content: Vec<TokenLogprob<'a>>,
    /// Always `null` (thorn).
    #[serde(default)]
    pub refusal: Option<Cow<'a, str>>,
}

/// One token's log-probability and its alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob<'a> {
    /// The token's text.
    pub token: Cow<'a, str>,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes (thorn always sends them; `None`: the text's).
    #[serde(default)]
    pub bytes: Option<Cow<'a, [u8]>>,
    /// The most likely alternatives.
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub top_logprobs: Vec<TopLogprob<'a>>,
}

/// One alternative token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob<'a> {
    /// Its text.
    pub token: Cow<'a, str>,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes (`None`: the text's).
    #[serde(default)]
    pub bytes: Option<Cow<'a, [u8]>>,
}

/// `chat.completion.chunk`, one event of a streamed answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatChunk<'a> {
    /// The completion's id.
    #[serde(default)]
    pub id: Cow<'a, str>,
    /// `chat.completion.chunk`.
    #[serde(default)]
    pub object: Cow<'a, str>,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The served model's name.
    #[serde(default)]
    pub model: Cow<'a, str>,
    /// The server's build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<Cow<'a, str>>,
    /// One choice, or none in the final usage chunk.
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub choices: Vec<ChunkChoice<'a>>,
    /// Token counts (the final chunk, with `stream_options.include_usage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// An error reported mid-stream (`{"error": {"message": ...}}`; read only, as servers word it).
    #[serde(default, skip_serializing)]
    pub error: Option<Value>,
}

/// A chunk's choice.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkChoice<'a> {
    /// Its place.
    #[serde(default)]
    pub index: usize,
    /// What is new.
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub delta: Delta<'a>,
    /// Log-probabilities (thorn: in the last chunk, when asked for).
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs<'a>>,
    /// Set in the last chunk.
    #[serde(default)]
    pub finish_reason: Option<Cow<'a, str>>,
}

/// A streamed delta: only the fields it carries are sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta<'a> {
    /// `assistant` (the first chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Cow<'a, str>>,
    /// New text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Cow<'a, str>>,
    /// New reasoning (a thinking model's `<think>` text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<Cow<'a, str>>,
    /// The same, under the name newer vLLM uses (read only).
    #[serde(default, skip_serializing)]
    pub reasoning: Option<Cow<'a, str>>,
    /// The client's tool calls as they are generated: a call's first delta has its index, id, type, name
    /// and empty arguments, later ones its index and an arguments fragment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta<'a>>>,
    /// thorn: host tool calls as they are generated, in the same form (thorn runs them; their outcomes
    /// follow as `thorn_host_tool_result`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thorn_host_tool_calls: Option<Vec<ToolCallDelta<'a>>>,
    /// thorn: a host call about to run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thorn_host_tool_call: Option<HostCall<'a>>,
    /// thorn: a host call's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thorn_host_tool_result: Option<HostCall<'a>>,
    /// thorn: a host call waiting for a person's approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thorn_approval_pending: Option<ApprovalPending<'a>>,
}

impl<'a> Delta<'a> {
    /// A delta carrying one piece of a call: under `thorn_host_tool_calls` for a host call, else
    /// `tool_calls`.
    pub fn call(host: bool, piece: ToolCallDelta<'a>) -> Self {
        let calls = Some(vec![piece]);
        if host {
            Delta {
                thorn_host_tool_calls: calls,
                ..Delta::default()
            }
        } else {
            Delta {
                tool_calls: calls,
                ..Delta::default()
            }
        }
    }

    /// The new reasoning, under either name (`reasoning_content` first; a server sending both sends
    /// the same text twice).
    pub fn reasoning(&self) -> Option<&str> {
        reasoning(&self.reasoning_content, &self.reasoning)
    }
}

/// A streamed piece of a tool call (`choices[].delta.tool_calls[]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCallDelta<'a> {
    /// Which call of the answer it belongs to (thorn always sends it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// `call_...` (the call's first delta).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Cow<'a, str>>,
    /// `function` (the call's first delta).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<Cow<'a, str>>,
    /// The name (first delta) and an arguments fragment.
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub function: FunctionDelta<'a>,
}

/// A streamed piece of a call's function.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionDelta<'a> {
    /// The function (the call's first delta).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Cow<'a, str>>,
    /// More of the arguments' JSON text (thorn: `""` in the first delta; an object is read as its text).
    #[serde(
        default,
        deserialize_with = "lenient::arguments_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub arguments: Option<Cow<'a, str>>,
}

impl<'a> ToolCallDelta<'a> {
    /// A call's first delta: index, id, type and name, with empty arguments.
    pub fn start(index: usize, id: &'a str, name: &'a str) -> Self {
        ToolCallDelta {
            index: Some(index),
            id: Some(Cow::Borrowed(id)),
            kind: Some(Cow::Borrowed("function")),
            function: FunctionDelta {
                name: Some(Cow::Borrowed(name)),
                arguments: Some(Cow::Borrowed("")),
            },
        }
    }

    /// An arguments fragment of call `index`.
    pub fn arguments(index: usize, text: &'a str) -> Self {
        ToolCallDelta {
            index: Some(index),
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: Some(Cow::Borrowed(text)),
            },
        }
    }
}

/// `text_completion` (and its streamed chunks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextCompletion<'a> {
    /// `cmpl-...`.
    #[serde(default)]
    pub id: Cow<'a, str>,
    /// `text_completion`.
    #[serde(default)]
    pub object: Cow<'a, str>,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The served model's name.
    #[serde(default)]
    pub model: Cow<'a, str>,
    /// The choices (thorn serves one).
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub choices: Vec<TextChoice<'a>>,
    /// Token counts (the answer, or the last chunk with `include_usage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl<'a> TextCompletion<'a> {
    /// A completion (or one streamed chunk of it) with its one choice.
    pub fn new(
        id: &'a str,
        created: u64,
        model: &'a str,
        text: &'a str,
        finish_reason: Option<&'a str>,
        logprobs: Option<LegacyLogprobs>,
        usage: Option<Usage>,
    ) -> Self {
        TextCompletion {
            id: Cow::Borrowed(id),
            object: Cow::Borrowed("text_completion"),
            created,
            model: Cow::Borrowed(model),
            choices: vec![TextChoice {
                text: Cow::Borrowed(text),
                index: 0,
                logprobs,
                finish_reason: finish_reason.map(Cow::Borrowed),
            }],
            usage,
        }
    }
}

/// A text completion's choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextChoice<'a> {
    /// The text (new text, in a chunk).
    #[serde(default)]
    pub text: Cow<'a, str>,
    /// Its place.
    #[serde(default)]
    pub index: usize,
    /// Legacy log-probabilities when asked for.
    #[serde(default)]
    pub logprobs: Option<LegacyLogprobs>,
    /// Set at the end.
    #[serde(default)]
    pub finish_reason: Option<Cow<'a, str>>,
}

/// The legacy completions `logprobs` object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LegacyLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// Alternatives per token, text -> log-probability.
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    /// Each token's byte offset in the text.
    pub text_offset: Vec<usize>,
}

/// A model entry of `/v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelObject {
    /// The name a request uses.
    pub id: String,
    /// `model`.
    #[serde(default)]
    pub object: Cow<'static, str>,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// Who serves it.
    #[serde(default)]
    pub owned_by: String,
    /// thorn (and llama-server, vLLM as `max_model_len`): its context length in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<usize>,
}

/// `/v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    #[serde(default)]
    pub object: Cow<'static, str>,
    /// The models.
    #[serde(default, deserialize_with = "lenient::null_default")]
    pub data: Vec<ModelObject>,
}

/// An error body: `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse<'a> {
    /// The error.
    pub error: ErrorDetail<'a>,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail<'a> {
    /// For a person.
    pub message: Cow<'a, str>,
    /// `invalid_request_error`, `server_error`, ...
    #[serde(rename = "type", default)]
    pub kind: Cow<'a, str>,
    /// The request field at fault.
    #[serde(default)]
    pub param: Option<Cow<'a, str>>,
    /// A machine-readable code.
    #[serde(default)]
    pub code: Option<Cow<'a, str>>,
}
