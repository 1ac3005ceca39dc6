//! OpenAI's response bodies and stream chunks, serialized in OpenAI's field order, borrowing from the
//! agent's outcome.

use serde::Serialize;
use serde_json::Value;

/// `usage`.
#[derive(Debug, Clone, Serialize)]
pub struct WireUsage {
    /// Prompt tokens (all rounds).
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Details.
    pub prompt_tokens_details: PromptDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Serialize)]
pub struct PromptDetails {
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: usize,
}

impl From<crate::agent::Usage> for WireUsage {
    fn from(u: crate::agent::Usage) -> Self {
        WireUsage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

// ---- Responses: what the server sends, typed like the requests (field order is the wire order). ----

/// The `system_fingerprint` of every completion.
pub const FINGERPRINT: &str = concat!("thorn-", env!("CARGO_PKG_VERSION"));

/// `chat.completion`.
#[derive(Debug, Serialize)]
pub struct ChatCompletion<'a> {
    /// `chatcmpl-...`.
    pub id: &'a str,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: &'a str,
    /// [`FINGERPRINT`].
    pub system_fingerprint: &'static str,
    /// The one choice.
    pub choices: [ChatChoice<'a>; 1],
    /// Token counts.
    pub usage: WireUsage,
}

/// `choices[0]` of a [`ChatCompletion`].
#[derive(Debug, Serialize)]
pub struct ChatChoice<'a> {
    /// Always 0.
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage<'a>,
    /// Token log-probabilities when asked for (`null` otherwise).
    pub logprobs: Option<ChatLogprobs<'a>>,
    /// `stop`, `length`, `tool_calls`, ...
    pub finish_reason: &'static str,
}

/// The assistant's message.
#[derive(Debug, Serialize)]
pub struct AssistantMessage<'a> {
    /// Always `assistant`.
    pub role: &'static str,
    /// The text (`null` when the answer is only tool calls).
    pub content: Option<&'a str>,
    /// Always `null`.
    pub refusal: Option<&'a str>,
    /// Calls for the client to run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut<'a>>,
    /// Host (plugin) calls thorn ran during the request, with their results.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub thorn_host_tool_calls: Vec<HostCallOut<'a>>,
    /// What a thinking model reasoned before it answered (absent when it did not).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
    /// The host functions thorn's tool router showed the model (`[]`: none, it answered without tools);
    /// absent when the request was not routed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thorn_routed_tools: Option<&'a [String]>,
}

/// A tool call as the client sees it.
#[derive(Debug, Serialize)]
pub struct ToolCallOut<'a> {
    /// `call_...`.
    pub id: &'a str,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Name and arguments.
    pub function: FunctionOut<'a>,
}

/// A tool call's function.
#[derive(Debug, Serialize)]
pub struct FunctionOut<'a> {
    /// The function.
    pub name: &'a str,
    /// Its arguments as JSON text.
    pub arguments: String,
}

impl<'a> ToolCallOut<'a> {
    /// The wire form of `c`.
    pub fn of(c: &'a thorn_tools::chat::ToolCall) -> Self {
        ToolCallOut {
            id: &c.id,
            kind: "function",
            function: FunctionOut {
                name: &c.function.name,
                arguments: c.function.arguments.to_string(),
            },
        }
    }
}

/// A streamed piece of a tool call (OpenAI's `choices[].delta.tool_calls[]`).
#[derive(Debug, Serialize)]
pub struct ToolCallDelta<'a> {
    /// Which call of the response it belongs to.
    pub index: usize,
    /// `call_...` (the call's first delta).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<&'a str>,
    /// `function` (the call's first delta).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The name (first delta) and an arguments fragment.
    pub function: FunctionDelta<'a>,
}

/// A streamed piece of a call's function.
#[derive(Debug, Serialize)]
pub struct FunctionDelta<'a> {
    /// The function (the call's first delta).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<&'a str>,
    /// More of the arguments' JSON text (`""` in the first delta).
    pub arguments: &'a str,
}

impl<'a> ToolCallDelta<'a> {
    /// A call's first delta.
    pub fn start(index: usize, id: &'a str, name: &'a str) -> Self {
        ToolCallDelta {
            index,
            id: Some(id),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(name),
                arguments: "",
            },
        }
    }

    /// An arguments fragment of call `index`.
    pub fn arguments(index: usize, text: &'a str) -> Self {
        ToolCallDelta {
            index,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: text,
            },
        }
    }
}

/// A host call thorn ran, and what came of it.
#[derive(Debug, Serialize)]
pub struct HostCallOut<'a> {
    /// The call id.
    pub id: &'a str,
    /// The function.
    pub name: &'a str,
    /// Its arguments as JSON text.
    pub arguments: String,
    /// The plugin's result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<&'a Value>,
    /// The error the model was shown instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'a str>,
    /// The error's kind (`timeout`, `arguments`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<&'static str>,
}

impl<'a> HostCallOut<'a> {
    /// The wire form of a finished host call.
    pub fn of(h: &'a crate::agent::HostCall) -> Self {
        let (result, error, error_kind) = match &h.result {
            Ok(r) => (Some(r), None, None),
            Err(e) => (None, Some(e.as_str()), h.error_kind),
        };
        HostCallOut {
            id: &h.call.id,
            name: &h.call.function.name,
            arguments: h.call.function.arguments.to_string(),
            result,
            error,
            error_kind,
        }
    }

    /// The wire form of a host call about to run (no outcome yet).
    pub fn started(c: &'a thorn_tools::chat::ToolCall) -> Self {
        HostCallOut {
            id: &c.id,
            name: &c.function.name,
            arguments: c.function.arguments.to_string(),
            result: None,
            error: None,
            error_kind: None,
        }
    }
}

/// Chat `logprobs`.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs<'a> {
    /// One entry per generated token.
    pub content: Vec<TokenLogprobOut<'a>>,
    /// Always `null`.
    pub refusal: Option<&'a str>,
}

/// One token's log-probability and its alternatives.
#[derive(Debug, Serialize)]
pub struct TokenLogprobOut<'a> {
    /// The token's text.
    pub token: &'a str,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: &'a [u8],
    /// The most likely alternatives.
    pub top_logprobs: Vec<TopLogprobOut<'a>>,
}

/// One alternative token.
#[derive(Debug, Serialize)]
pub struct TopLogprobOut<'a> {
    /// Its text.
    pub token: &'a str,
    /// Its log-probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: &'a [u8],
}

impl<'a> ChatLogprobs<'a> {
    /// The wire form of a generation's log-probabilities.
    pub fn of(lp: &'a [crate::agent::TokenLogprob]) -> Self {
        ChatLogprobs {
            content: lp
                .iter()
                .map(|t| TokenLogprobOut {
                    token: &t.token,
                    logprob: t.logprob,
                    bytes: &t.bytes,
                    top_logprobs: t
                        .top
                        .iter()
                        .map(|(tok, b, l)| TopLogprobOut {
                            token: tok,
                            logprob: *l,
                            bytes: b,
                        })
                        .collect(),
                })
                .collect(),
            refusal: None,
        }
    }
}

/// `chat.completion.chunk`.
#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    /// The completion's id.
    pub id: &'a str,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: &'a str,
    /// [`FINGERPRINT`].
    pub system_fingerprint: &'static str,
    /// One choice, or none in the final usage chunk.
    pub choices: Vec<ChunkChoice<'a>>,
    /// Token counts (the final chunk, with `stream_options.include_usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<WireUsage>,
}

/// A chunk's choice.
#[derive(Debug, Serialize)]
pub struct ChunkChoice<'a> {
    /// Always 0.
    pub index: usize,
    /// What is new.
    pub delta: Delta<'a>,
    /// Log-probabilities (the last chunk, when asked for).
    pub logprobs: Option<ChatLogprobs<'a>>,
    /// Set in the last chunk.
    pub finish_reason: Option<&'static str>,
}

/// A streamed delta: only the fields it carries are sent.
#[derive(Debug, Default, Serialize)]
pub struct Delta<'a> {
    /// `assistant` (the first chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    /// New reasoning (a thinking model's `<think>` text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
    /// The client's tool calls as they are generated: a call's first delta has its index, id, type, name
    /// and empty arguments, later ones its index and an arguments fragment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta<'a>>>,
    /// Host tool calls as they are generated, in the same form (thorn runs them; their outcomes follow as
    /// `thorn_host_tool_result`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thorn_host_tool_calls: Option<Vec<ToolCallDelta<'a>>>,
    /// A host call about to run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thorn_host_tool_call: Option<HostCallOut<'a>>,
    /// A host call's outcome.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thorn_host_tool_result: Option<HostCallOut<'a>>,
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
}

/// `text_completion` (and its streamed chunks).
#[derive(Debug, Serialize)]
pub struct TextCompletion<'a> {
    /// `cmpl-...`.
    pub id: &'a str,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: &'a str,
    /// The one choice.
    pub choices: [TextChoice<'a>; 1],
    /// Token counts (the answer, or the last chunk with `include_usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<WireUsage>,
}

impl<'a> TextCompletion<'a> {
    /// A completion (or one streamed chunk of it) with its one choice.
    pub fn new(
        id: &'a str,
        created: u64,
        model: &'a str,
        text: &'a str,
        finish_reason: Option<&'static str>,
        logprobs: Option<LegacyLogprobs>,
        usage: Option<WireUsage>,
    ) -> Self {
        TextCompletion {
            id,
            object: "text_completion",
            created,
            model,
            choices: [TextChoice {
                text,
                index: 0,
                logprobs,
                finish_reason,
            }],
            usage,
        }
    }
}

/// A text completion's choice.
#[derive(Debug, Serialize)]
pub struct TextChoice<'a> {
    /// The text (new text, in a chunk).
    pub text: &'a str,
    /// Always 0.
    pub index: usize,
    /// Legacy log-probabilities when asked for.
    pub logprobs: Option<LegacyLogprobs>,
    /// Set at the end.
    pub finish_reason: Option<&'static str>,
}

/// The legacy completions `logprobs` object.
#[derive(Debug, Serialize)]
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

impl LegacyLogprobs {
    /// The legacy form of a generation's log-probabilities.
    pub fn of(lp: &[crate::agent::TokenLogprob]) -> Self {
        let mut offset = 0usize;
        let mut text_offset = Vec::with_capacity(lp.len());
        for t in lp {
            text_offset.push(offset);
            offset += t.token.len();
        }
        LegacyLogprobs {
            tokens: lp.iter().map(|t| t.token.clone()).collect(),
            token_logprobs: lp.iter().map(|t| t.logprob).collect(),
            top_logprobs: lp
                .iter()
                .map(|t| {
                    t.top
                        .iter()
                        .map(|(tok, _, l)| (tok.clone(), Value::from(*l)))
                        .collect()
                })
                .collect(),
            text_offset,
        }
    }
}

/// A model entry of `/v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelObject {
    /// The name a request uses.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// When the server started (Unix seconds).
    pub created: u64,
    /// `thorn` (the local model, or the `auto` route), or the upstream's name.
    pub owned_by: String,
    /// Context length in tokens (the local model's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_length: Option<usize>,
}

/// `/v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The local model first, then `auto` (with `--local-first`), then each upstream's models.
    pub data: Vec<ModelObject>,
}

/// An upstream in `/health`.
#[derive(Debug, Serialize)]
pub struct UpstreamHealth {
    /// Its name.
    pub name: String,
    /// Whether its last health check answered (`null`: not checked yet).
    pub up: Option<bool>,
    /// What its last health check met, when it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `closed`, `open` or `half_open`.
    pub circuit: &'static str,
    /// Requests it is serving.
    pub in_flight: u64,
    /// Its models.
    pub models: Vec<String>,
}

/// `/health`.
#[derive(Debug, Serialize)]
pub struct Health<'a> {
    /// Always `ok`.
    pub status: &'static str,
    /// The served model's name.
    pub model: &'a str,
    /// Requests waiting for the engine.
    pub queue_depth: usize,
    /// Whether the engine is generating.
    pub busy: bool,
    /// Loaded plugins.
    pub plugins: usize,
    /// External MCP servers connected.
    pub mcp_servers: usize,
    /// Upstream engines (their state never changes `status`: the local model serves on).
    pub upstreams: Vec<UpstreamHealth>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn responses_keep_openais_field_order_and_nulls() {
        let call = thorn_tools::chat::ToolCall {
            id: "call_1".into(),
            kind: "function",
            function: thorn_tools::chat::FunctionCall {
                name: "f".into(),
                arguments: json!({"a": 1}),
            },
        };
        let out = ChatCompletion {
            id: "chatcmpl-x",
            object: "chat.completion",
            created: 7,
            model: "m",
            system_fingerprint: "fp",
            choices: [ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant",
                    content: None,
                    refusal: None,
                    tool_calls: vec![ToolCallOut::of(&call)],
                    thorn_host_tool_calls: vec![],
                    reasoning_content: None,
                    thorn_routed_tools: None,
                },
                logprobs: None,
                finish_reason: "tool_calls",
            }],
            usage: WireUsage::from(crate::agent::Usage::default()),
        };
        assert_eq!(
            serde_json::to_string(&out).unwrap(),
            concat!(
                r#"{"id":"chatcmpl-x","object":"chat.completion","created":7,"model":"m","#,
                r#""system_fingerprint":"fp","choices":[{"index":0,"message":{"role":"assistant","#,
                r#""content":null,"refusal":null,"tool_calls":[{"id":"call_1","type":"function","#,
                r#""function":{"name":"f","arguments":"{\"a\":1}"}}]},"logprobs":null,"#,
                r#""finish_reason":"tool_calls"}],"usage":{"prompt_tokens":0,"completion_tokens":0,"#,
                r#""total_tokens":0,"prompt_tokens_details":{"cached_tokens":0}}}"#
            )
        );
        // A streamed delta carries only its own fields: a call's first delta its index, id, type and name
        // with empty arguments, later ones the index and a fragment.
        let d = Delta {
            tool_calls: Some(vec![ToolCallDelta::start(0, "call_1", "f")]),
            ..Delta::default()
        };
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            r#"{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]}"#
        );
        let d = Delta {
            thorn_host_tool_calls: Some(vec![ToolCallDelta::arguments(2, "{\"a\":")]),
            ..Delta::default()
        };
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            r#"{"thorn_host_tool_calls":[{"index":2,"function":{"arguments":"{\"a\":"}}]}"#
        );
        assert_eq!(serde_json::to_string(&Delta::default()).unwrap(), "{}");
    }
}
