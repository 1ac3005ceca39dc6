//! The wire: OpenAI's types (from `thorn-openai`, shared with the upstream and benchmark clients), the
//! conversions from the agent's outcome to them, and thorn's own `/health` body.
//!
//! Requests accept what OpenAI clients send (unknown fields are ignored, as OpenAI does); a known field of
//! the wrong type is a 400 naming it.

use crate::agent::{
    Answers, HostCall as AgentHostCall, Routing, TokenLogprob as AgentLogprob, ToolUse,
};
use serde::Serialize;
use serde_json::Value;
use std::borrow::Cow;

pub use thorn_openai::{
    ApprovalPending, AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatLogprobs,
    ChatRequest, ChunkChoice, CompletionRequest, Content, Delta, ErrorDetail, ErrorResponse,
    HostCall, LegacyLogprobs, Message, ModelList, ModelObject, Prompt, Stop, TextCompletion,
    TokenLogprob, ToolAnswers, ToolCall, ToolCallDelta, ToolRouting, ToolUseOpts, TopLogprob,
    Usage,
};

/// The `system_fingerprint` of every completion.
pub const FINGERPRINT: &str = concat!("thorn-", env!("CARGO_PKG_VERSION"));

impl From<ToolRouting> for Routing {
    fn from(r: ToolRouting) -> Self {
        match r {
            ToolRouting::Off => Routing::Off,
            ToolRouting::Lexical => Routing::Lexical,
        }
    }
}

impl From<ToolAnswers> for Answers {
    fn from(a: ToolAnswers) -> Self {
        match a {
            ToolAnswers::Model => Answers::Model,
            ToolAnswers::Template => Answers::Template,
        }
    }
}

/// `base` with the fields `opts` gives replaced.
pub fn tool_use_over(opts: ToolUseOpts, base: ToolUse) -> ToolUse {
    ToolUse {
        routing: opts.routing.map_or(base.routing, Routing::from),
        examples: opts.examples.unwrap_or(base.examples),
        answers: opts.answers.map_or(base.answers, Answers::from),
    }
}

/// The wire form of the agent's token counts.
pub fn usage(u: crate::agent::Usage) -> Usage {
    Usage::new(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
}

/// The wire form of a call for the client to run.
pub fn tool_call(c: &thorn_tools::chat::ToolCall) -> ToolCall<'_> {
    ToolCall::function(
        c.id.as_str(),
        c.function.name.as_str(),
        c.function.arguments.to_string(),
    )
}

/// The wire form of a finished host call.
pub fn host_call(h: &AgentHostCall) -> HostCall<'_> {
    let (result, error, error_kind) = match &h.result {
        Ok(r) => (Some(Cow::Borrowed(r)), None, None),
        Err(e) => (None, Some(Cow::Borrowed(e.as_str())), h.error_kind),
    };
    HostCall {
        result,
        error,
        error_kind: error_kind.map(Cow::Borrowed),
        ..host_call_started(&h.call)
    }
}

/// The wire form of a host call about to run (no outcome yet).
pub fn host_call_started(c: &thorn_tools::chat::ToolCall) -> HostCall<'_> {
    HostCall {
        id: Cow::Borrowed(&c.id),
        name: Cow::Borrowed(&c.function.name),
        arguments: Cow::Owned(c.function.arguments.to_string()),
        result: None,
        error: None,
        error_kind: None,
    }
}

/// A call waiting for approval, as streams show it.
pub fn approval_pending<'a>(call_id: &'a str, p: &'a thorn_plugin::Pending) -> ApprovalPending<'a> {
    ApprovalPending {
        id: Cow::Borrowed(&p.id),
        call_id: Cow::Borrowed(call_id),
        plugin: Cow::Borrowed(&p.plugin),
        function: Cow::Borrowed(&p.function),
        arguments: Cow::Borrowed(&p.arguments),
        expires_at: p.expires_at,
    }
}

/// The wire form of a generation's log-probabilities.
pub fn chat_logprobs(lp: &[AgentLogprob]) -> ChatLogprobs<'_> {
    ChatLogprobs {
        content: lp
            .iter()
            .map(|t| TokenLogprob {
                token: Cow::Borrowed(&t.token),
                logprob: t.logprob,
                bytes: Some(Cow::Borrowed(&t.bytes)),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|(tok, b, l)| TopLogprob {
                        token: Cow::Borrowed(tok),
                        logprob: *l,
                        bytes: Some(Cow::Borrowed(b)),
                    })
                    .collect(),
            })
            .collect(),
        refusal: None,
    }
}

/// The legacy completions form of a generation's log-probabilities.
pub fn legacy_logprobs(lp: &[AgentLogprob]) -> LegacyLogprobs {
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
    /// The e-stop latch.
    pub estop: thorn_plugin::EstopState,
    /// Host calls waiting for a person's approval (`/v1/thorn/approvals` lists them).
    pub approvals_pending: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_agents_calls_and_counts_take_the_wire_form() {
        let call = thorn_tools::chat::ToolCall {
            id: "call_1".into(),
            kind: "function",
            function: thorn_tools::chat::FunctionCall {
                name: "f".into(),
                arguments: json!({"a": 1}),
            },
        };
        assert_eq!(
            serde_json::to_string(&tool_call(&call)).unwrap(),
            r#"{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}"#
        );
        assert_eq!(
            serde_json::to_string(&host_call_started(&call)).unwrap(),
            r#"{"id":"call_1","name":"f","arguments":"{\"a\":1}"}"#
        );
        let u = crate::agent::Usage {
            prompt_tokens: 5,
            cached_tokens: 2,
            completion_tokens: 3,
        };
        assert_eq!(
            serde_json::to_value(usage(u)).unwrap(),
            json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                   "prompt_tokens_details": {"cached_tokens": 2}})
        );
    }
}
