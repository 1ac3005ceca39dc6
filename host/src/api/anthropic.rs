//! Anthropic's Messages API over the same agent as chat completions: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`, with Anthropic's request and response bodies, stream events and
//! error bodies (what Claude-style agents and the `anthropic` SDK speak).
//!
//! A request has `model`, `max_tokens` (required), `messages` (`user` and `assistant`; content a string or
//! blocks: `text`, `tool_use` on assistant turns, `tool_result` on user turns, and `thinking` blocks,
//! rendered back as the turn's reasoning where the template has a place for it), `system` (a string or text blocks), `tools` (`name`,
//! `description`, `input_schema`; a `thorn:` name asks for a host tool exactly as in chat completions),
//! `tool_choice` (`auto`, `any`, `tool` with a `name`, `none`; `disable_parallel_tool_use`),
//! `stop_sequences`, `temperature` (0 to 1), `top_p`, `top_k`, `stream` and `metadata.user_id` (digested
//! into the audit log's conversation id). The key comes as `x-api-key` or `Authorization: Bearer`.
//!
//! The answer is a `message` whose content is a `thinking` block (when a thinking model reasoned), a
//! `text` block (when the model wrote prose) and a `tool_use` block per client call, with `stop_reason` `end_turn`, `stop_sequence` (and which), `max_tokens` or
//! `tool_use`, and `usage` (`input_tokens` not served from the prefix cache, `cache_read_input_tokens`
//! that were, `output_tokens`). Host calls thorn ran are listed as `thorn_host_tool_calls`. Streamed:
//! `message_start`, `ping`, then per block `content_block_start`, `content_block_delta` (`thinking_delta`,
//! `text_delta`, or `input_json_delta` fragments that concatenate to the call's `input`) and `content_block_stop`, then
//! `message_delta` (stop reason, usage) and `message_stop`; host calls and their results arrive as
//! `thorn_host_tool_call` / `thorn_host_tool_result` events. An error after the stream started is an
//! `error` event.

use super::handler::{Caller, Checked, new_id};
use super::models::route_for;
use super::request::{HOST_TOOL_PREFIX, conversation_of, in_range, sampling, stops, tools_of};
use super::work::{
    CancelOnDrop, Early, Gather, Msg, account, chat_work, collect, pump, send_gathered, spawn,
    started, stream_error,
};
use super::{ApiError, AppState, wire};

mod stream;
use crate::agent::{Event, Finish, Outcome, StreamedCalls, Turn};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use stream::stream_messages;
use thorn_tools::ToolChoice;
use thorn_tools::chat::{FunctionCall, Message, Role, ToolCall};
use tokio::sync::mpsc;

/// A Messages request (fields thorn does not use, such as `anthropic-beta` features, are ignored).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    /// The served model's name (any other is a 404).
    pub model: String,
    /// Most tokens to generate (required, at least 1).
    pub max_tokens: Option<u64>,
    /// The conversation.
    pub messages: Vec<InMessage>,
    /// Instructions: a string or text blocks.
    #[serde(default)]
    pub system: Option<Value>,
    /// Tools.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Stop strings.
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    /// 0 to 1.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Top-k sampling.
    pub top_k: Option<u32>,
    /// Stream events.
    pub stream: Option<bool>,
    /// `user_id`.
    #[serde(default)]
    pub metadata: Option<Value>,
    /// thorn: how host tools are put in front of the model (as on `/v1/chat/completions`).
    #[serde(default)]
    pub thorn_tool_use: Option<wire::ToolUseOpts>,
    /// Extended thinking: `{"type": "enabled", "budget_tokens": N}` or `{"type": "disabled"}`, the
    /// chat template's `enable_thinking` for a reasoning model; the engine closes the think block after
    /// `budget_tokens`.
    #[serde(default)]
    pub thinking: Option<Value>,
}

/// The chat-template variables Anthropic's `thinking` asks for.
fn thinking_kwargs(thinking: Option<&Value>) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut kw = serde_json::Map::new();
    let Some(t) = thinking else {
        return Ok(kw);
    };
    let on = match t.get("type").and_then(Value::as_str) {
        Some("enabled") => true,
        Some("disabled") => false,
        _ => {
            return Err(ApiError::bad(
                "`thinking.type` must be \"enabled\" or \"disabled\"",
                Some("thinking"),
            ));
        }
    };
    kw.insert("enable_thinking".into(), Value::Bool(on));
    Ok(kw)
}

/// A message of the conversation.
#[derive(Debug, Deserialize)]
pub struct InMessage {
    /// `user` or `assistant`.
    pub role: String,
    /// A string or content blocks.
    pub content: Value,
}

/// Anthropic's error `type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Anthropic's error body for `e`.
pub(super) fn error_body(e: &ApiError) -> Value {
    let msg = match e {
        ApiError::Unauthorized => {
            "invalid API key: send `x-api-key: <key>` or `Authorization: Bearer <key>`".to_owned()
        }
        ApiError::BadRequest {
            msg,
            param: Some(p),
        } => format!("{p}: {msg}"),
        e => e.to_string(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status()), "message": msg}})
}

/// Text of a `system` value or a `tool_result`'s content: a string, or text blocks joined.
fn text_of(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut t = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match b["type"].as_str() {
                    Some("text") => t.push_str(b["text"].as_str().ok_or_else(|| {
                        ApiError::bad(
                            "a text block needs a string `text`",
                            Some(&format!("{param}[{j}]")),
                        )
                    })?),
                    other => {
                        return Err(ApiError::bad(
                            format!(
                                "content blocks of type {other:?} are not supported here (text only)"
                            ),
                            Some(&format!("{param}[{j}].type")),
                        ));
                    }
                }
            }
            Ok(t)
        }
        _ => Err(ApiError::bad(
            "must be a string or an array of text blocks",
            Some(param),
        )),
    }
}

/// The conversation as the agent's messages: `system` first; an assistant turn's `tool_use` blocks become
/// its tool calls; a user turn's `tool_result` blocks become tool messages (before its text, which follows
/// them as a user message).
fn messages_of(system: Option<&Value>, messages: Vec<InMessage>) -> Result<Vec<Message>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        let text = text_of(s, "system")?;
        if !text.is_empty() {
            out.push(Message::system(text));
        }
    }
    if messages.is_empty() {
        return Err(ApiError::bad(
            "at least one message is required",
            Some("messages"),
        ));
    }
    // Tool names by call id, for the tool messages that answer them.
    let mut names: Vec<(String, String)> = Vec::new();
    for (i, m) in messages.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(ApiError::bad(
                    format!(
                        "role {other:?} is not one of \"user\", \"assistant\" (the system prompt is `system`)"
                    ),
                    Some(&format!("messages[{i}].role")),
                ));
            }
        };
        let blocks = match m.content {
            Value::String(s) => {
                out.push(Message::new(role, s));
                continue;
            }
            Value::Array(b) => b,
            _ => {
                return Err(ApiError::bad(
                    "must be a string or an array of content blocks",
                    Some(&format!("messages[{i}].content")),
                ));
            }
        };
        let mut msg = Message::new(role, "");
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            match (b["type"].as_str(), role) {
                (Some("text"), _) => msg.content.push_str(b["text"].as_str().ok_or_else(|| {
                    ApiError::bad("a text block needs a string `text`", Some(&at))
                })?),
                (Some("tool_use"), Role::Assistant) => {
                    let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                        return Err(ApiError::bad(
                            "a tool_use block needs `id` and `name`",
                            Some(&at),
                        ));
                    };
                    let input = match &b["input"] {
                        Value::Null => json!({}),
                        v @ Value::Object(_) => v.clone(),
                        _ => {
                            return Err(ApiError::bad(
                                "`input` must be an object",
                                Some(&format!("{at}.input")),
                            ));
                        }
                    };
                    names.push((id.to_owned(), name.to_owned()));
                    msg.tool_calls.push(ToolCall {
                        id: id.to_owned(),
                        kind: "function",
                        function: FunctionCall {
                            name: name.to_owned(),
                            arguments: input,
                        },
                    });
                }
                (Some("tool_result"), Role::User) => {
                    let Some(id) = b["tool_use_id"].as_str() else {
                        return Err(ApiError::bad(
                            "a tool_result block needs `tool_use_id`",
                            Some(&at),
                        ));
                    };
                    let text = text_of(&b["content"], &format!("{at}.content"))?;
                    // An error result reads as thorn's own tool errors do.
                    let text = if b["is_error"].as_bool() == Some(true) {
                        json!({ "error": text }).to_string()
                    } else {
                        text
                    };
                    let mut tool = Message::new(Role::Tool, text);
                    tool.tool_call_id = Some(id.to_owned());
                    tool.name = names
                        .iter()
                        .rev()
                        .find(|(c, _)| c == id)
                        .map(|(_, n)| n.clone());
                    out.push(tool);
                }
                // Earlier reasoning goes back as the message's reasoning (rendered where the template
                // has a place for it); redacted reasoning has no text to give.
                (Some("thinking"), Role::Assistant) => {
                    if let Some(t) = b["thinking"].as_str() {
                        msg.reasoning_content
                            .get_or_insert_with(String::new)
                            .push_str(t);
                    }
                }
                (Some("redacted_thinking"), Role::Assistant) => {}
                (
                    Some(kind @ ("tool_use" | "tool_result" | "thinking" | "redacted_thinking")),
                    _,
                ) => {
                    return Err(ApiError::bad(
                        format!("a {kind} block does not belong in a {} message", m.role),
                        Some(&format!("{at}.type")),
                    ));
                }
                (other, _) => {
                    return Err(ApiError::bad(
                        format!(
                            "content blocks of type {other:?} are not supported (text, tool_use, tool_result)"
                        ),
                        Some(&format!("{at}.type")),
                    ));
                }
            }
        }
        if role == Role::Assistant || !msg.content.is_empty() {
            out.push(msg);
        }
    }
    Ok(out)
}

/// Anthropic tools as chat-completion tool definitions (`thorn:` names are host tools, resolved by
/// [`tools_of`]).
fn tool_defs(tools: Vec<Value>) -> Result<Vec<Value>, ApiError> {
    tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let at = format!("tools[{i}]");
            if t["type"].as_str().is_some_and(|k| k != "custom") {
                return Err(ApiError::bad(
                    format!(
                        "tools of type {:?} are not supported (custom tools with an input_schema)",
                        t["type"]
                    ),
                    Some(&format!("{at}.type")),
                ));
            }
            let Some(name) = t["name"].as_str() else {
                return Err(ApiError::bad("a tool needs a `name`", Some(&at)));
            };
            if name.starts_with(HOST_TOOL_PREFIX) {
                return Ok(json!({"type": "function", "function": {"name": name}}));
            }
            let schema = match &t["input_schema"] {
                v @ Value::Object(_) => v.clone(),
                _ => {
                    return Err(ApiError::bad(
                        "a tool needs an `input_schema` object",
                        Some(&format!("{at}.input_schema")),
                    ));
                }
            };
            let mut f = json!({"name": name, "parameters": schema});
            if let Some(d) = t["description"].as_str() {
                f["description"] = json!(d);
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect()
}

/// `tool_choice`: the choice and whether parallel calls are allowed.
fn choice_of(v: Option<&Value>) -> Result<(ToolChoice, bool), ApiError> {
    let Some(v) = v else {
        return Ok((ToolChoice::Auto, true));
    };
    let parallel = !v["disable_parallel_tool_use"].as_bool().unwrap_or(false);
    let choice = match v["type"].as_str() {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => match v["name"].as_str() {
            Some(n) => {
                ToolChoice::Function(n.strip_prefix(HOST_TOOL_PREFIX).unwrap_or(n).to_owned())
            }
            None => {
                return Err(ApiError::bad(
                    "`tool` needs a `name`",
                    Some("tool_choice.name"),
                ));
            }
        },
        _ => {
            return Err(ApiError::bad(
                "`type` must be \"auto\", \"any\", \"tool\" or \"none\"",
                Some("tool_choice.type"),
            ));
        }
    };
    Ok((choice, parallel))
}

/// The agent's turn for a Messages request.
fn turn_of(st: &AppState, r: MessagesRequest, caller: &Caller) -> Result<(Turn, bool), ApiError> {
    let route = route_for(st, Some(&r.model), None, caller.key.as_ref())?;
    let max_tokens = match r.max_tokens {
        Some(n) if n >= 1 => n,
        Some(_) => {
            return Err(ApiError::bad(
                "`max_tokens` must be at least 1",
                Some("max_tokens"),
            ));
        }
        None => {
            return Err(ApiError::bad(
                "`max_tokens` is required",
                Some("max_tokens"),
            ));
        }
    };
    in_range(r.temperature, 0.0, 1.0, "temperature")?;
    let mut sampling = sampling(r.temperature, r.top_p, None, None, None)?;
    sampling.top_k = r.top_k.unwrap_or(0) as usize;
    let plugins = st.agent.plugins();
    let (tools, host_tools) = tools_of(
        &plugins,
        tool_defs(r.tools.unwrap_or_default())?,
        caller.key.as_ref(),
    )?;
    let (tool_choice, parallel) = choice_of(r.tool_choice.as_ref())?;
    let user = r
        .metadata
        .as_ref()
        .and_then(|m| m["user_id"].as_str())
        .map(str::to_owned);
    let stop = stops(r.stop_sequences.map(wire::Stop::Many)).map_err(|e| match e {
        ApiError::BadRequest { msg, .. } => ApiError::bad(msg, Some("stop_sequences")),
        e => e,
    })?;
    let turn = Turn {
        tools,
        host_tools,
        tool_choice,
        parallel_tool_calls: parallel,
        sampling,
        max_tokens: usize::try_from(max_tokens).unwrap_or(usize::MAX),
        stop,
        conversation: conversation_of(None, user)?,
        key_id: caller.key.as_ref().map(|k| k.id().to_owned()),
        peer: caller.peer.map(|p| p.to_string()),
        tool_use: r
            .thorn_tool_use
            .map(|o| wire::tool_use_over(o, st.agent.tool_use())),
        route,
        template_kwargs: thinking_kwargs(r.thinking.as_ref())?,
        reasoning_budget: r
            .thinking
            .as_ref()
            .and_then(|t| t["budget_tokens"].as_u64())
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        ..Turn::new(messages_of(r.system.as_ref(), r.messages)?, plugins)
    };
    Ok((turn, r.stream.unwrap_or(false)))
}

/// `stop_reason` and `stop_sequence`.
fn stop_of(out: &Outcome) -> (&'static str, Option<&str>) {
    match out.finish {
        Finish::ToolCalls => ("tool_use", None),
        Finish::Length => ("max_tokens", None),
        Finish::Stop | Finish::Cancelled => match &out.stop_string {
            Some(s) => ("stop_sequence", Some(s.as_str())),
            None => ("end_turn", None),
        },
    }
}

fn usage_of(out: &Outcome) -> Value {
    let u = out.usage;
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}

/// The answer as a `message`.
fn message_json(id: &str, out: &Outcome) -> Value {
    let mut content = Vec::new();
    if !out.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": out.reasoning, "signature": ""}));
    }
    if !out.content.is_empty() {
        content.push(json!({"type": "text", "text": out.content}));
    }
    for c in &out.tool_calls {
        content.push(
            json!({"type": "tool_use", "id": c.id, "name": c.function.name,
            "input": c.function.arguments}),
        );
    }
    let (reason, seq) = stop_of(out);
    let mut m = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": out.served.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage_of(out),
    });
    if !out.host_calls.is_empty() {
        m["thorn_host_tool_calls"] = json!(
            out.host_calls
                .iter()
                .map(wire::host_call)
                .collect::<Vec<_>>()
        );
    }
    m
}

/// `POST /v1/messages`.
pub(super) async fn messages(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Checked(req): Checked<MessagesRequest>,
) -> Result<Response, ApiError> {
    let (turn, stream) = turn_of(&st, req, &caller)?;
    let t0 = Instant::now();
    let (mut rx, cancel) = spawn(&st, chat_work(turn));
    let guard = CancelOnDrop(cancel);
    let early = started(&st, &mut rx).await?;
    let id = new_id("msg").replacen('-', "_", 1);
    if stream {
        Ok(stream_messages(Arc::clone(&st), rx, guard, id, t0, early))
    } else {
        let out = match early.outcome() {
            Some(o) => o,
            None => collect(&st, &mut rx).await?,
        };
        account(&st, &out, t0);
        drop(guard);
        Ok(Json(message_json(&id, &out)).into_response())
    }
}

/// `POST /v1/messages/count_tokens`: the prompt tokens the request would start with.
pub(super) async fn count_tokens(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Checked(mut req): Checked<MessagesRequest>,
) -> Result<Response, ApiError> {
    // A Messages request without the generation fields (those it has are ignored).
    req.max_tokens = Some(1);
    let (turn, _) = turn_of(&st, req, &caller)?;
    if !matches!(turn.route, crate::agent::Route::Local) {
        return Err(ApiError::bad(
            "token counting is served for the local model only",
            Some("model"),
        ));
    }
    let n = st.agent.count_tokens(&turn).await.map_err(ApiError::from)?;
    Ok(Json(json!({ "input_tokens": n })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: Value) -> Vec<InMessage> {
        serde_json::from_value::<Vec<Value>>(v)
            .unwrap()
            .into_iter()
            .map(|m| InMessage {
                role: m["role"].as_str().unwrap().to_owned(),
                content: m["content"].clone(),
            })
            .collect()
    }

    #[test]
    fn thinking_switches_the_templates_reasoning() {
        assert!(thinking_kwargs(None).unwrap().is_empty());
        let on = thinking_kwargs(Some(&json!({"type": "enabled", "budget_tokens": 1024}))).unwrap();
        assert_eq!(Value::Object(on), json!({"enable_thinking": true}));
        let off = thinking_kwargs(Some(&json!({"type": "disabled"}))).unwrap();
        assert_eq!(Value::Object(off), json!({"enable_thinking": false}));
        assert!(thinking_kwargs(Some(&json!({"type": "maybe"}))).is_err());
        assert!(thinking_kwargs(Some(&json!("on"))).is_err());
    }

    #[test]
    fn blocks_become_the_agents_messages() {
        let system = json!([{"type": "text", "text": "Be brief."}]);
        let m = messages_of(
            Some(&system),
            msgs(json!([
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "down", "is_error": true},
                    {"type": "text", "text": "Thanks"}]}
            ])),
        )
        .unwrap();
        let roles: Vec<Role> = m.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                Role::System,
                Role::User,
                Role::Assistant,
                Role::Tool,
                Role::Tool,
                Role::User
            ]
        );
        assert_eq!(m[0].content, "Be brief.");
        assert_eq!(m[2].content, "Let me check.");
        assert_eq!(m[2].reasoning_content.as_deref(), Some("hm"));
        assert_eq!(
            m[2].tool_calls[0].function.arguments,
            json!({"city": "Paris"})
        );
        assert_eq!(m[3].content, "21C");
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m[4].content, r#"{"error":"down"}"#);
        assert_eq!(m[5].content, "Thanks");
    }

    #[test]
    fn unsupported_blocks_and_roles_are_named() {
        let bad = |v: Value| match messages_of(None, msgs(v)) {
            Err(ApiError::BadRequest { param, .. }) => param.unwrap(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            bad(json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])),
            "messages[0].content[0].type"
        );
        assert_eq!(
            bad(json!([{"role": "system", "content": "x"}])),
            "messages[0].role"
        );
        assert_eq!(
            bad(
                json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}])
            ),
            "messages[0].content[0].type"
        );
        assert!(messages_of(None, Vec::new()).is_err());
    }

    #[test]
    fn tools_and_tool_choice_map_to_the_chat_forms() {
        let defs = tool_defs(vec![
            json!({"name": "f", "description": "d", "input_schema": {"type": "object"}}),
            json!({"name": "thorn:calculator"}),
        ])
        .unwrap();
        assert_eq!(
            defs[0],
            json!({"type": "function", "function": {"name": "f", "description": "d",
            "parameters": {"type": "object"}}})
        );
        assert_eq!(
            defs[1],
            json!({"type": "function", "function": {"name": "thorn:calculator"}})
        );
        assert!(tool_defs(vec![json!({"type": "web_search_20250305", "name": "w"})]).is_err());
        assert!(tool_defs(vec![json!({"name": "f"})]).is_err());
        assert_eq!(choice_of(None).unwrap(), (ToolChoice::Auto, true));
        assert_eq!(
            choice_of(Some(
                &json!({"type": "any", "disable_parallel_tool_use": true})
            ))
            .unwrap(),
            (ToolChoice::Required, false)
        );
        assert_eq!(
            choice_of(Some(&json!({"type": "tool", "name": "f"})))
                .unwrap()
                .0,
            ToolChoice::Function("f".into())
        );
        assert_eq!(
            choice_of(Some(&json!({"type": "none"}))).unwrap().0,
            ToolChoice::None
        );
        assert!(choice_of(Some(&json!({"type": "tool"}))).is_err());
    }

    #[test]
    fn errors_have_anthropics_shape() {
        let b = error_body(&ApiError::bad("nope", Some("max_tokens")));
        assert_eq!(
            b,
            json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "max_tokens: nope"}})
        );
        assert_eq!(
            error_body(&ApiError::Unauthorized)["error"]["type"],
            "authentication_error"
        );
        assert_eq!(
            error_body(&ApiError::ModelNotFound("m".into()))["error"]["type"],
            "not_found_error"
        );
        assert_eq!(
            error_body(&ApiError::Busy("q".into()))["error"]["type"],
            "rate_limit_error"
        );
        assert_eq!(
            error_body(&ApiError::Internal("x".into()))["error"]["type"],
            "api_error"
        );
    }
}
