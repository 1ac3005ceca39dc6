//! A request's wire form turned into the agent's [`Turn`]: messages, tools (the `thorn:` host tools
//! resolved against the plugins and the key's allow-list), `tool_choice`, `response_format`, sampling,
//! stops and limits, each checked with a 400 that names the offending field.

use super::handler::Caller;
use super::models::{check_model_name, route_for};
use super::{ApiError, AppState, wire};
use crate::agent::{Route, Turn};
use crate::auth::ApiKey;
use serde_json::{Value, json};
use std::borrow::Cow;
use std::sync::Arc;
use thorn_engine::sample::SamplingParams;
use thorn_tools::chat::{FunctionCall, Message, Role, ToolCall};
use thorn_tools::{ResponseFormat, ToolChoice};

pub(super) fn role_of(s: &str, i: usize) -> Result<Role, ApiError> {
    Ok(match s {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        other => {
            return Err(ApiError::bad(
                format!("unknown role {other:?}"),
                Some(&format!("messages[{i}].role")),
            ));
        }
    })
}

pub(super) fn messages_of(wire: Vec<wire::Message<'static>>) -> Result<Vec<Message>, ApiError> {
    if wire.is_empty() {
        return Err(ApiError::bad(
            "`messages` must not be empty",
            Some("messages"),
        ));
    }
    let mut out = Vec::with_capacity(wire.len());
    for (i, m) in wire.into_iter().enumerate() {
        let role = role_of(&m.role, i)?;
        let content = match m.content {
            None => String::new(),
            Some(wire::Content::Text(t)) => t.into_owned(),
            Some(wire::Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad(
                            format!(
                                "content parts of type {:?} are not supported (text only)",
                                p.kind
                            ),
                            Some(&format!("messages[{i}].content")),
                        ));
                    }
                    t.push_str(p.text.as_deref().unwrap_or(""));
                }
                t
            }
        };
        let mut msg = Message::new(role, content);
        for (j, c) in m.tool_calls.unwrap_or_default().into_iter().enumerate() {
            let args = if c.function.arguments.trim().is_empty() {
                json!({})
            } else {
                serde_json::from_str(&c.function.arguments).map_err(|e| {
                    ApiError::bad(
                        format!("tool call arguments are not JSON: {e}"),
                        Some(&format!("messages[{i}].tool_calls[{j}].function.arguments")),
                    )
                })?
            };
            msg.tool_calls.push(ToolCall {
                id: c.id.into_owned(),
                kind: "function",
                function: FunctionCall {
                    name: c.function.name.into_owned(),
                    arguments: args,
                },
            });
        }
        msg.tool_call_id = m.tool_call_id.map(Cow::into_owned);
        msg.name = m.name.map(Cow::into_owned);
        msg.reasoning_content = m
            .reasoning_content
            .filter(|_| role == Role::Assistant)
            .map(Cow::into_owned);
        out.push(msg);
    }
    Ok(out)
}

/// The namespace that asks for a host tool.
pub const HOST_TOOL_PREFIX: &str = "thorn:";

/// Splits the request's tools into definitions for the model and the names the host runs. Host tools are
/// the `thorn:`-named ones only (a plugin name first, else a function name); `key` limits which.
pub(super) fn tools_of(
    plugins: &thorn_plugin::PluginSet,
    tools: Vec<Value>,
    key: Option<&ApiKey>,
) -> Result<(Vec<Value>, Vec<String>), ApiError> {
    let mut client = Vec::new();
    let mut defs = Vec::new();
    let mut host: Vec<String> = Vec::new();
    for (i, t) in tools.into_iter().enumerate() {
        let param = format!("tools[{i}]");
        let name = t["function"]["name"].as_str().unwrap_or("").to_owned();
        if t["type"] != "function" || name.is_empty() {
            return Err(ApiError::bad(
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                Some(&param),
            ));
        }
        let Some(wanted) = name.strip_prefix(HOST_TOOL_PREFIX) else {
            client.push(name);
            defs.push(t);
            continue;
        };
        let functions: Vec<(&str, &str)> = if let Some(p) = plugins.provider_named(wanted) {
            p.manifest()
                .functions
                .iter()
                .map(|f| (p.name(), f.name.as_str()))
                .collect()
        } else if let Some(p) = plugins.provider_for(wanted) {
            vec![(p.name(), wanted)]
        } else {
            return Err(ApiError::bad(
                format!("{name:?}: no installed plugin or plugin function is called {wanted:?}"),
                Some(&param),
            ));
        };
        for (plugin, function) in functions {
            if let Some(k) = key.filter(|k| !k.may_use(plugin, function)) {
                return Err(ApiError::Forbidden(format!(
                    "the API key {:?} may not use the host tool {function:?} (plugin {plugin:?})",
                    k.id()
                )));
            }
            if host.iter().any(|h| h == function) {
                continue;
            }
            let def = plugins
                .tools()
                .definitions()
                .iter()
                .find(|d| d["function"]["name"] == function)
                .ok_or_else(|| ApiError::Internal(format!("no definition for {function:?}")))?;
            host.push(function.to_owned());
            defs.push(def.clone());
        }
    }
    if let Some(c) = client.iter().find(|c| host.contains(c)) {
        return Err(ApiError::bad(
            format!("the client tool {c:?} has the name of a requested host tool; rename one"),
            Some("tools"),
        ));
    }
    Ok((defs, host))
}

/// The audit log's conversation id: `conversation_id` (checked: 1 to 128 of `A-Z a-z 0-9 . _ : -`), else
/// `user-` and a digest of OpenAI's free-form `user` field (so any `user` value is accepted and none is
/// written to the log verbatim).
pub(super) fn conversation_of(
    id: Option<String>,
    user: Option<String>,
) -> Result<Option<String>, ApiError> {
    use sha2::Digest;
    if let Some(id) = id {
        thorn_plugin::validate_conversation_id(&id)
            .map_err(|e| ApiError::bad(e.to_string(), Some("conversation_id")))?;
        return Ok(Some(id));
    }
    Ok(user.map(|u| {
        let d = sha2::Sha256::digest(u.as_bytes());
        let hex: String = d[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("user-{hex}")
    }))
}

pub(super) fn in_range(v: Option<f32>, lo: f32, hi: f32, name: &str) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::bad(
            format!("`{name}` must be between {lo} and {hi}, got {x}"),
            Some(name),
        )),
        _ => Ok(()),
    }
}

pub(super) struct Shape {
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) logprobs: bool,
}

pub(super) fn sampling(
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<i64>,
    presence: Option<f32>,
    frequency: Option<f32>,
) -> Result<SamplingParams, ApiError> {
    in_range(temperature, 0.0, 2.0, "temperature")?;
    in_range(top_p, 0.0, 1.0, "top_p")?;
    in_range(presence, -2.0, 2.0, "presence_penalty")?;
    in_range(frequency, -2.0, 2.0, "frequency_penalty")?;
    Ok(SamplingParams {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        seed: seed.map(|s| s as u64),
        presence_penalty: presence.unwrap_or(0.0),
        frequency_penalty: frequency.unwrap_or(0.0),
        ..SamplingParams::default()
    })
}

pub(super) fn stops(stop: Option<wire::Stop>) -> Result<Vec<String>, ApiError> {
    let v = stop.map(wire::Stop::into_vec).unwrap_or_default();
    use thorn_engine::engine::{MAX_STOP_BYTES, MAX_STOPS};
    if v.len() > MAX_STOPS || v.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            format!(
                "`stop` takes up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_BYTES} bytes"
            ),
            Some("stop"),
        ));
    }
    Ok(v)
}

/// Parses a chat request body as the server does (for tools and fuzzing: the same errors, the same paths).
pub fn parse_chat_request(body: &[u8]) -> Result<wire::ChatRequest<'static>, ApiError> {
    super::handler::parse_body(body)
}

/// The agent's turn for a chat request, checked as the server checks it, for a server of `model` with
/// `plugins` installed and no API keys.
pub fn chat_turn(
    model: &str,
    plugins: Arc<thorn_plugin::PluginSet>,
    r: wire::ChatRequest<'static>,
) -> Result<Turn, ApiError> {
    check_model_name(model, r.model.as_deref())?;
    turn_from(plugins, r, &Caller::default(), Route::Local).map(|(t, _)| t)
}

pub(super) fn turn_of(
    st: &AppState,
    r: wire::ChatRequest<'static>,
    caller: &Caller,
) -> Result<(Turn, Shape), ApiError> {
    let opts = r.thorn_tool_use;
    let route = route_for(
        st,
        r.model.as_deref(),
        r.thorn_model_class.as_deref(),
        caller.key.as_ref(),
    )?;
    let (mut turn, shape) = turn_from(st.agent.plugins(), r, caller, route)?;
    turn.tool_use = opts.map(|o| wire::tool_use_over(o, st.agent.tool_use()));
    Ok((turn, shape))
}

pub(super) fn turn_from(
    plugins: Arc<thorn_plugin::PluginSet>,
    r: wire::ChatRequest<'static>,
    caller: &Caller,
    route: Route,
) -> Result<(Turn, Shape), ApiError> {
    if r.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only n = 1 is supported", Some("n")));
    }
    let top_logprobs = r.top_logprobs.unwrap_or(0);
    if top_logprobs > 20 {
        return Err(ApiError::bad(
            "`top_logprobs` must be at most 20",
            Some("top_logprobs"),
        ));
    }
    let logprobs = r.logprobs.unwrap_or(false);
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::bad(
            "`top_logprobs` needs `logprobs: true`",
            Some("top_logprobs"),
        ));
    }
    in_range(r.min_p, 0.0, 1.0, "min_p")?;
    let mut sampling = sampling(
        r.temperature,
        r.top_p,
        r.seed,
        r.presence_penalty,
        r.frequency_penalty,
    )?;
    sampling.top_k = r.top_k.unwrap_or(0) as usize;
    sampling.min_p = r.min_p.unwrap_or(0.0);
    sampling.repetition_penalty = r.repetition_penalty.unwrap_or(1.0);
    sampling.top_logprobs = top_logprobs as usize;
    let (tools, host_tools) = tools_of(
        &plugins,
        r.tools.map(Cow::into_owned).unwrap_or_default(),
        caller.key.as_ref(),
    )?;
    let tool_choice = match &r.tool_choice {
        None => ToolChoice::Auto,
        Some(v) => ToolChoice::from_openai(v)
            .map_err(|e| ApiError::bad(e.to_string(), Some("tool_choice")))?,
    };
    let response_format = match &r.response_format {
        None => ResponseFormat::Text,
        Some(v) => ResponseFormat::from_openai(v)
            .map_err(|e| ApiError::bad(e.to_string(), Some("response_format")))?,
    };
    let max_tokens = r.max_completion_tokens.or(r.max_tokens);
    if max_tokens == Some(0) {
        return Err(ApiError::bad(
            "`max_tokens` must be at least 1",
            Some("max_tokens"),
        ));
    }
    let shape = Shape {
        stream: r.stream.unwrap_or(false),
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
        logprobs,
    };
    let turn = Turn {
        tools,
        host_tools,
        tool_choice,
        parallel_tool_calls: r.parallel_tool_calls.unwrap_or(true),
        response_format,
        sampling,
        max_tokens: max_tokens.map_or(usize::MAX, |n| n as usize),
        stop: stops(r.stop)?,
        max_tool_rounds: match r.max_tool_rounds {
            // Zero rounds of host calls would still run the first (the last round is the one without
            // tools): refused rather than read as one.
            Some(0) => {
                return Err(ApiError::bad(
                    "`max_tool_rounds` must be at least 1 (for no host calls, leave out `thorn:` tools or \
                     send tool_choice none)",
                    Some("max_tool_rounds"),
                ));
            }
            n => n.map(|n| n as usize),
        },
        conversation: conversation_of(r.conversation_id, r.user)?,
        key_id: caller.key.as_ref().map(|k| k.id().to_owned()),
        peer: caller.peer.map(|p| p.to_string()),
        logprobs,
        speculation: r.speculation.unwrap_or(true),
        // `tool_use` is set by `turn_of`, over the server's default.
        route,
        template_kwargs: template_kwargs(r.reasoning_effort.as_deref(), r.chat_template_kwargs)?,
        ..Turn::new(messages_of(r.messages)?, plugins)
    };
    Ok((turn, shape))
}

/// A request's chat-template variables: `reasoning_effort` (`none`: `enable_thinking` false; `minimal`
/// to `high`: true, and the effort itself), then `chat_template_kwargs` over them; checked
/// (`thorn_tools::chat::check_kwargs`).
pub(super) fn template_kwargs(
    effort: Option<&str>,
    kwargs: Option<serde_json::Map<String, Value>>,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut kw = serde_json::Map::new();
    match effort {
        None => {}
        Some("none") => {
            kw.insert("enable_thinking".into(), Value::Bool(false));
        }
        Some(e @ ("minimal" | "low" | "medium" | "high")) => {
            kw.insert("enable_thinking".into(), Value::Bool(true));
            kw.insert("reasoning_effort".into(), Value::String(e.to_owned()));
        }
        Some(e) => {
            return Err(ApiError::bad(
                format!("`reasoning_effort` {e:?} is not one of none, minimal, low, medium, high"),
                Some("reasoning_effort"),
            ));
        }
    }
    if let Some(extra) = kwargs {
        thorn_tools::chat::check_kwargs(&extra)
            .map_err(|e| ApiError::bad(e, Some("chat_template_kwargs")))?;
        kw.extend(extra);
    }
    Ok(kw)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kw(v: Value) -> Option<serde_json::Map<String, Value>> {
        v.as_object().cloned()
    }

    #[test]
    fn reasoning_effort_and_template_kwargs_become_template_variables() {
        assert!(template_kwargs(None, None).unwrap().is_empty());
        assert_eq!(
            Value::Object(template_kwargs(Some("none"), None).unwrap()),
            json!({"enable_thinking": false})
        );
        assert_eq!(
            Value::Object(template_kwargs(Some("high"), None).unwrap()),
            json!({"enable_thinking": true, "reasoning_effort": "high"})
        );
        // The explicit kwargs win over what reasoning_effort implies.
        assert_eq!(
            Value::Object(
                template_kwargs(Some("low"), kw(json!({"enable_thinking": false, "x": 1})))
                    .unwrap()
            ),
            json!({"enable_thinking": false, "reasoning_effort": "low", "x": 1})
        );
        for (effort, kwargs, param) in [
            (Some("max"), None, "reasoning_effort"),
            (None, kw(json!({"tools": []})), "chat_template_kwargs"),
            (None, kw(json!({"1st": true})), "chat_template_kwargs"),
        ] {
            match template_kwargs(effort, kwargs) {
                Err(ApiError::BadRequest { param: p, .. }) => assert_eq!(p.as_deref(), Some(param)),
                other => panic!("{effort:?}: {other:?}"),
            }
        }
    }
}
