//! OpenAI's Responses API over the same agent as chat completions: `POST /v1/responses` (what the openai
//! SDK's `client.responses`, the openai-agents SDK's default model and Codex-style clients speak).
//!
//! A request has `model`, `input` (a string, or items: messages with `role` `user`, `system`, `developer`
//! or `assistant` and text content (`input_text` / `output_text` parts or a string), `function_call`
//! items (an earlier call) and `function_call_output` items (its result)), `instructions` (a system
//! message), `tools` (function tools, `{"type": "function", "name", "description", "parameters",
//! "strict"}`; a `thorn:` name asks for a host tool exactly as in chat completions; custom tools,
//! `{"type": "custom", "name", "description", "format"}`, freeform text in as Codex's `apply_patch`),
//! `tool_choice` (`auto`, `none`, `required`, `{"type": "function" | "custom", "name"}`),
//! `parallel_tool_calls`, `text.format`
//! (`text`, `json_object`, `json_schema` with `name`, `schema`, `strict`), `max_output_tokens`,
//! `temperature`, `top_p`, `reasoning.effort`, `stream`, `user`, `metadata`, `store` and
//! `previous_response_id`: a stored response's conversation (its input and output) continues with the
//! new input; responses are kept in memory, the newest [`STORED`] of them within [`STORED_BYTES`], each
//! for the API key that made it (ids are random, and another key's id is as unknown as a made-up one), and
//! one made with `store: false` is not kept (an unknown id is a 400 naming the field).
//!
//! The answer is a `response` whose `output` holds a `reasoning` item (when a thinking model reasoned), a
//! `message` with an `output_text` part (when the model wrote prose) and a `function_call` item per client
//! call (`arguments` a JSON string; a `custom_tool_call` with its `input` text for a custom tool, whose
//! result comes back as a `custom_tool_call_output` item), `status` `completed` or `incomplete` (`max_output_tokens`), and
//! `usage` with cached input tokens. Host calls thorn ran are listed as `thorn_host_tool_calls`. Streamed
//! as the typed events the SDK reads: `response.created`, `response.in_progress`, per item
//! `response.output_item.added`, its deltas (`response.output_text.delta`,
//! `response.reasoning_text.delta`, `response.function_call_arguments.delta`, whose fragments concatenate
//! to the call's `arguments`, `response.custom_tool_call_input.delta` to its `input`) and `.done` events, then `response.completed` (or `response.incomplete`).

use super::handler::{Caller, Checked, new_id};
use super::models::route_for;
use super::request::{conversation_of, in_range, sampling, template_kwargs, tools_of};
use super::work::{CancelOnDrop, account, chat_work, collect, spawn, started};
use super::{ApiError, AppState, wire};
use crate::agent::{Finish, Outcome, Turn};
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use thorn_tools::chat::Message;

mod input;
mod stream;

use input::{choice_of, format_of, input_messages, tool_defs};

/// The most responses kept for `previous_response_id`.
pub const STORED: usize = 256;
/// The most bytes of conversation the kept responses hold, all together.
pub const STORED_BYTES: usize = 64 << 20;

/// A Responses request (fields thorn does not use, such as `include` or `service_tier`, are ignored).
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    /// The served model's name.
    #[serde(default)]
    pub model: Option<String>,
    /// A string or a list of items.
    #[serde(default)]
    pub input: Option<Value>,
    /// A system message.
    #[serde(default)]
    pub instructions: Option<String>,
    /// Function tools.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `auto`, `none`, `required` or `{"type": "function", "name"}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Several calls at once.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {...}}`.
    #[serde(default)]
    pub text: Option<Value>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// 0 to 2.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// `{"effort": "none" | "minimal" | "low" | "medium" | "high"}`.
    #[serde(default)]
    pub reasoning: Option<Value>,
    /// Stream events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Keep the response for `previous_response_id` (default true).
    #[serde(default)]
    pub store: Option<bool>,
    /// Continue a kept response's conversation.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// The end user (digested into the audit log's conversation id).
    #[serde(default)]
    pub user: Option<String>,
    /// Echoed back.
    #[serde(default)]
    pub metadata: Option<Value>,
    /// thorn: how host tools are put in front of the model (as on `/v1/chat/completions`).
    #[serde(default)]
    pub thorn_tool_use: Option<wire::ToolUseOpts>,
}

/// Kept responses' conversations, oldest first out.
#[derive(Debug, Default)]
pub struct ResponseStore {
    inner: Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    /// Per response id: the key that made it, its conversation and that conversation's bytes.
    map: HashMap<String, (Option<String>, Vec<Message>, usize)>,
    order: VecDeque<String>,
    bytes: usize,
}

impl ResponseStore {
    /// The conversation of response `id`, if it is kept and was made with the API key `key` (its id).
    pub fn get(&self, id: &str, key: Option<&str>) -> Option<Vec<Message>> {
        let k = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        k.map
            .get(id)
            .filter(|(owner, _, _)| owner.as_deref() == key)
            .map(|(_, m, _)| m.clone())
    }

    /// Keeps `messages` as the conversation of response `id`, made with the API key `key`, dropping the
    /// oldest past the limits.
    pub fn put(&self, id: String, key: Option<String>, messages: Vec<Message>) {
        let bytes: usize = messages.iter().map(Message::data_len).sum();
        if bytes > STORED_BYTES {
            return;
        }
        let mut k = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while k.order.len() >= STORED || k.bytes + bytes > STORED_BYTES {
            let Some(old) = k.order.pop_front() else {
                break;
            };
            if let Some((_, _, b)) = k.map.remove(&old) {
                k.bytes -= b;
            }
        }
        k.bytes += bytes;
        k.order.push_back(id.clone());
        k.map.insert(id, (key, messages, bytes));
    }
}

/// What a response echoes of its request.
#[derive(Debug, Clone)]
pub(super) struct Echo {
    instructions: Option<String>,
    tools: Vec<Value>,
    tool_choice: Value,
    parallel: bool,
    text: Value,
    max_output_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    previous_response_id: Option<String>,
    store: bool,
    metadata: Value,
    created_at: u64,
    /// The request's `reasoning` (`effort`, `summary`), echoed.
    reasoning: Value,
    /// The custom tools' names: their calls are `custom_tool_call` items.
    custom: Vec<String>,
    /// Namespaced functions and their namespaces: their calls name them.
    namespaced: Vec<(String, String)>,
    /// The hosted tools left out.
    ignored: Vec<String>,
}

/// The agent's turn for a Responses request, what the response echoes, and whether it streams.
fn turn_of(
    st: &AppState,
    r: ResponsesRequest,
    caller: &Caller,
) -> Result<(Turn, Echo, bool), ApiError> {
    let route = route_for(st, r.model.as_deref(), None, caller.key.as_ref())?;
    if r.max_output_tokens == Some(0) {
        return Err(ApiError::bad(
            "`max_output_tokens` must be at least 1",
            Some("max_output_tokens"),
        ));
    }
    in_range(r.temperature, 0.0, 2.0, "temperature")?;
    let sampling = sampling(r.temperature, r.top_p, None, None, None)?;
    let plugins = st.agent.plugins();
    let given_tools = r.tools.clone().unwrap_or_default();
    let given = tool_defs(&given_tools)?;
    if !given.ignored.is_empty() {
        tracing::info!(tools = ?given.ignored, "hosted tools left out of a Responses request");
    }
    let (tools, host_tools) = tools_of(&plugins, given.defs, caller.key.as_ref())?;
    let tool_choice = choice_of(r.tool_choice.as_ref())?;
    let response_format = format_of(r.text.as_ref())?;
    let effort = r.reasoning.as_ref().and_then(|v| v["effort"].as_str());
    let template_kwargs = template_kwargs(effort, None).map_err(|e| match e {
        ApiError::BadRequest { msg, .. } => ApiError::bad(msg, Some("reasoning.effort")),
        e => e,
    })?;
    let mut messages = match &r.previous_response_id {
        Some(id) => st.responses.get(id, caller.key.as_ref().map(|k| k.id())).ok_or_else(|| {
            ApiError::bad(
                format!(
                    "no response {id:?} is kept here (made with store: false, evicted, or unknown)"
                ),
                Some("previous_response_id"),
            )
        })?,
        None => Vec::new(),
    };
    messages.extend(input_messages(r.input.as_ref())?);
    if messages.is_empty() {
        return Err(ApiError::bad("`input` is empty", Some("input")));
    }
    let mut all = Vec::with_capacity(messages.len() + 1);
    if let Some(i) = &r.instructions {
        all.push(Message::system(i.as_str()));
    }
    all.extend(messages);
    let echo = Echo {
        instructions: r.instructions.clone(),
        tools: given_tools,
        tool_choice: r.tool_choice.clone().unwrap_or(json!("auto")),
        parallel: r.parallel_tool_calls.unwrap_or(true),
        text: r
            .text
            .clone()
            .unwrap_or(json!({"format": {"type": "text"}})),
        max_output_tokens: r.max_output_tokens,
        temperature: r.temperature,
        top_p: r.top_p,
        previous_response_id: r.previous_response_id.clone(),
        store: r.store.unwrap_or(true),
        metadata: r.metadata.clone().unwrap_or(json!({})),
        created_at: crate::api::unix_now(),
        reasoning: json!({
            "effort": r.reasoning.as_ref().map_or(Value::Null, |v| v["effort"].clone()),
            "summary": r.reasoning.as_ref().map_or(Value::Null, |v| v["summary"].clone()),
        }),
        custom: given.custom,
        namespaced: given.namespaced,
        ignored: given.ignored,
    };
    let turn = Turn {
        tools,
        host_tools,
        tool_choice,
        parallel_tool_calls: echo.parallel,
        response_format,
        sampling,
        max_tokens: r
            .max_output_tokens
            .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        conversation: conversation_of(None, r.user)?,
        key_id: caller.key.as_ref().map(|k| k.id().to_owned()),
        peer: caller.peer.map(|p| p.to_string()),
        tool_use: r
            .thorn_tool_use
            .map(|o| wire::tool_use_over(o, st.agent.tool_use())),
        route,
        template_kwargs,
        ..Turn::new(all, plugins)
    };
    Ok((turn, echo, r.stream.unwrap_or(false)))
}

/// The conversation a response leaves for `previous_response_id`: its input (without the instructions,
/// which a later request gives again) and the assistant's answer.
fn kept_conversation(turn_messages: &[Message], instructions: bool, out: &Outcome) -> Vec<Message> {
    let mut m: Vec<Message> = turn_messages[usize::from(instructions)..].to_vec();
    let mut answer = Message::assistant(out.content.as_str());
    answer.tool_calls = out.tool_calls.clone();
    m.push(answer);
    m
}

/// Ids of a response's output items.
#[derive(Debug, Clone)]
pub(super) struct ItemIds {
    reasoning: String,
    message: String,
}

impl ItemIds {
    fn new() -> Self {
        ItemIds {
            reasoning: new_id("rs").replacen('-', "_", 1),
            message: new_id("msg").replacen('-', "_", 1),
        }
    }
}

/// A function call's item id.
fn call_item_id(call_id: &str) -> String {
    format!("fc_{}", call_id.trim_start_matches("call_"))
}

fn reasoning_item(ids: &ItemIds, text: &str) -> Value {
    json!({"type": "reasoning", "id": ids.reasoning, "summary": [],
        "content": [{"type": "reasoning_text", "text": text}]})
}

fn message_item(ids: &ItemIds, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": ids.message, "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// A client call's output item: a `function_call` (naming its namespace, if it has one), or a
/// `custom_tool_call` with its freeform `input`; `args` the arguments' JSON text.
fn call_item(echo: &Echo, call_id: &str, name: &str, args: &str, status: &str) -> Value {
    let id = call_item_id(call_id);
    if echo.custom.iter().any(|c| c == name) {
        let input = serde_json::from_str::<Value>(args)
            .ok()
            .and_then(|v| v["input"].as_str().map(str::to_owned))
            .unwrap_or_default();
        return json!({"type": "custom_tool_call", "id": id, "call_id": call_id, "name": name,
            "input": input, "status": status});
    }
    let mut item = json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
        "arguments": args, "status": status});
    if let Some((_, ns)) = echo.namespaced.iter().find(|(n, _)| n == name) {
        item["namespace"] = json!(ns);
    }
    item
}

fn usage_of(out: &Outcome) -> Value {
    let u = out.usage;
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The `response` object: `out` finished (or `None` while in progress).
pub(super) fn response_json(
    id: &str,
    model: &str,
    echo: &Echo,
    ids: &ItemIds,
    out: Option<&Outcome>,
) -> Value {
    let (status, incomplete, output, usage) = match out {
        None => ("in_progress", Value::Null, Vec::new(), Value::Null),
        Some(o) => {
            let mut output = Vec::new();
            if !o.reasoning.is_empty() {
                output.push(reasoning_item(ids, &o.reasoning));
            }
            if !o.content.is_empty() || o.tool_calls.is_empty() {
                output.push(message_item(ids, &o.content, "completed"));
            }
            output.extend(o.tool_calls.iter().map(|c| {
                let args = c.function.arguments.to_string();
                call_item(echo, &c.id, &c.function.name, &args, "completed")
            }));
            let (status, incomplete) = match o.finish {
                Finish::Length => ("incomplete", json!({"reason": "max_output_tokens"})),
                _ => ("completed", Value::Null),
            };
            (status, incomplete, output, usage_of(o))
        }
    };
    let mut r = json!({
        "id": id,
        "object": "response",
        "created_at": echo.created_at,
        "status": status,
        "error": null,
        "incomplete_details": incomplete,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": echo.parallel,
        "previous_response_id": echo.previous_response_id,
        "reasoning": echo.reasoning,
        "store": echo.store,
        "temperature": echo.temperature.unwrap_or(1.0),
        "text": echo.text,
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p.unwrap_or(1.0),
        "truncation": "disabled",
        "usage": usage,
        "metadata": echo.metadata,
    });
    if !echo.ignored.is_empty() {
        r["thorn_ignored_tools"] = json!(echo.ignored);
    }
    if let Some(o) = out
        && !o.host_calls.is_empty()
    {
        r["thorn_host_tool_calls"] =
            json!(o.host_calls.iter().map(wire::host_call).collect::<Vec<_>>());
    }
    r
}

/// `POST /v1/responses`.
pub(super) async fn responses(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Checked(req): Checked<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let (turn, echo, stream) = turn_of(&st, req, &caller)?;
    let kept_input = echo.store.then(|| turn.messages.clone());
    let owner = turn.key_id.clone();
    let t0 = Instant::now();
    let (mut rx, cancel) = spawn(&st, chat_work(turn));
    let guard = CancelOnDrop(cancel);
    let early = started(&st, &mut rx).await?;
    // Random: it names a stored conversation (`resp_` and the random part of a call id).
    let id = format!(
        "resp_{}",
        thorn_tools::call_id().trim_start_matches("call_")
    );
    let keep = {
        let st = Arc::clone(&st);
        let id = id.clone();
        let instructions = echo.instructions.is_some();
        move |out: &Outcome| {
            if let Some(input) = &kept_input {
                st.responses.put(
                    id.clone(),
                    owner.clone(),
                    kept_conversation(input, instructions, out),
                );
            }
        }
    };
    if stream {
        return Ok(stream::stream_response(
            Arc::clone(&st),
            rx,
            guard,
            id,
            echo,
            t0,
            early,
            keep,
        ));
    }
    let out = match early.outcome() {
        Some(o) => o,
        None => collect(&st, &mut rx).await?,
    };
    account(&st, &out, t0);
    drop(guard);
    keep(&out);
    let model = out.served.model.clone();
    Ok(Json(response_json(
        &id,
        &model,
        &echo,
        &ItemIds::new(),
        Some(&out),
    ))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_keeps_the_newest_within_its_limits() {
        let s = ResponseStore::default();
        for i in 0..STORED + 3 {
            s.put(format!("r{i}"), None, vec![Message::user(format!("m{i}"))]);
        }
        assert!(
            s.get("r0", None).is_none() && s.get("r2", None).is_none(),
            "the oldest went"
        );
        let last = format!("r{}", STORED + 2);
        assert_eq!(
            s.get(&last, None).unwrap()[0].content,
            format!("m{}", STORED + 2)
        );
        // One too big for the whole budget is not kept (and drops nothing).
        s.put(
            "huge".into(),
            None,
            vec![Message::user("x".repeat(STORED_BYTES + 1))],
        );
        assert!(s.get("huge", None).is_none() && s.get("r3", None).is_some());
        // A response is its key's: another key (or none) does not see it.
        s.put(
            "mine".into(),
            Some("robot".into()),
            vec![Message::user("secret")],
        );
        assert!(s.get("mine", Some("robot")).is_some());
        assert!(s.get("mine", Some("ops")).is_none() && s.get("mine", None).is_none());
    }
}
