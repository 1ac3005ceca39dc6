//! What a Responses request's parts mean to the agent: `input` items as messages, tools as tool
//! definitions (custom tools as functions of one string), `tool_choice`, and `text.format`.

use crate::api::ApiError;
use crate::api::request::HOST_TOOL_PREFIX;
use serde_json::{Value, json};
use thorn_tools::chat::{FunctionCall, Message, Role, ToolCall};
use thorn_tools::{ResponseFormat, ToolChoice};

/// The text of a content value: a string, or parts with `text`.
pub(super) fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p["type"].as_str(), p["text"].as_str()) {
                    (Some("input_text" | "output_text" | "text" | "summary_text"), Some(t)) => {
                        s.push_str(t)
                    }
                    (kind, _) => {
                        return Err(ApiError::bad(
                            format!(
                                "content parts of type {kind:?} are not supported (input_text, output_text)"
                            ),
                            Some(&format!("{at}[{j}].type")),
                        ));
                    }
                }
            }
            Ok(s)
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::bad(
            "content must be a string or a list of text parts",
            Some(at),
        )),
    }
}

/// The conversation a request's `input` adds.
pub(super) fn input_messages(input: Option<&Value>) -> Result<Vec<Message>, ApiError> {
    let items = match input {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => return Ok(vec![Message::user(s.as_str())]),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::bad(
                "`input` must be a string or a list of items",
                Some("input"),
            ));
        }
    };
    let mut out: Vec<Message> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        match (item["type"].as_str(), item["role"].as_str()) {
            (Some("message") | None, Some(role)) => {
                let role = match role {
                    "user" => Role::User,
                    "system" | "developer" => Role::System,
                    "assistant" => Role::Assistant,
                    other => {
                        return Err(ApiError::bad(
                            format!(
                                "a message's role {other:?} is not user, system, developer or assistant"
                            ),
                            Some(&format!("{at}.role")),
                        ));
                    }
                };
                let text = text_of(&item["content"], &format!("{at}.content"))?;
                out.push(Message::new(role, text));
            }
            (Some("function_call"), _) => {
                let (Some(call_id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str())
                else {
                    return Err(ApiError::bad(
                        "a function_call item needs `call_id` and `name`",
                        Some(&at),
                    ));
                };
                let arguments = match &item["arguments"] {
                    Value::String(s) => serde_json::from_str(s).map_err(|e| {
                        ApiError::bad(
                            format!("`arguments` is not JSON: {e}"),
                            Some(&format!("{at}.arguments")),
                        )
                    })?,
                    Value::Null => json!({}),
                    v => v.clone(),
                };
                push_call(&mut out, call_id, name, arguments);
            }
            (Some("custom_tool_call"), _) => {
                let (Some(call_id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str())
                else {
                    return Err(ApiError::bad(
                        "a custom_tool_call item needs `call_id` and `name`",
                        Some(&at),
                    ));
                };
                let input = item["input"].as_str().unwrap_or_default();
                push_call(&mut out, call_id, name, json!({"input": input}));
            }
            (Some("function_call_output" | "custom_tool_call_output"), _) => {
                let Some(call_id) = item["call_id"].as_str() else {
                    return Err(ApiError::bad(
                        "an output item needs the `call_id` of its call",
                        Some(&at),
                    ));
                };
                let mut m = Message::new(
                    Role::Tool,
                    text_of(&item["output"], &format!("{at}.output"))?,
                );
                m.tool_call_id = Some(call_id.to_owned());
                out.push(m);
            }
            // Reasoning the client hands back is not rendered again.
            (Some("reasoning"), _) => {}
            (kind, _) => {
                return Err(ApiError::bad(
                    format!(
                        "input items of type {kind:?} are not supported (message, function_call, function_call_output, custom_tool_call, custom_tool_call_output)"
                    ),
                    Some(&format!("{at}.type")),
                ));
            }
        }
    }
    Ok(out)
}

/// Adds an earlier call to the conversation: calls of one turn join the assistant message before them.
fn push_call(out: &mut Vec<Message>, call_id: &str, name: &str, arguments: Value) {
    let call = ToolCall {
        id: call_id.to_owned(),
        kind: "function",
        function: FunctionCall {
            name: name
                .strip_prefix(HOST_TOOL_PREFIX)
                .unwrap_or(name)
                .to_owned(),
            arguments,
        },
    };
    match out.last_mut() {
        Some(m) if m.role == Role::Assistant => m.tool_calls.push(call),
        _ => {
            let mut m = Message::assistant("");
            m.tool_calls.push(call);
            out.push(m);
        }
    }
}

/// The parameters a custom tool's call is given as a function's: its freeform text as `input`.
fn custom_parameters() -> Value {
    json!({"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
        "additionalProperties": false})
}

/// A request's tools as the agent takes them.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Tools {
    /// Chat-completion tool definitions.
    pub(super) defs: Vec<Value>,
    /// The custom tools' names: their calls are `custom_tool_call` items.
    pub(super) custom: Vec<String>,
    /// Each namespaced function's name and its namespace (its calls name the namespace).
    pub(super) namespaced: Vec<(String, String)>,
    /// The types of the hosted tools left out (web search, file search, code interpreter and the
    /// like: tools OpenAI runs on its side, which thorn does not have).
    pub(super) ignored: Vec<String>,
}

/// Responses tools as the agent's: function tools as they are; a `custom` tool (freeform text in, as
/// Codex's `apply_patch`) as a function of one string, `input`, whose calls go back as `custom_tool_call`
/// items (its `format`, text or a Lark or regex grammar, is accepted; the text is not constrained by that
/// grammar: the client checks what it receives, as it must anyway); a `namespace`'s functions as
/// functions; hosted tools left out (listed in the response as `thorn_ignored_tools`, so a client such as
/// Codex, which offers web search by default, still runs).
pub(super) fn tool_defs(tools: &[Value]) -> Result<Tools, ApiError> {
    let mut out = Tools::default();
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        match t["type"].as_str() {
            Some("function" | "custom") => out.defs.push(tool_def(t, &at, &mut out.custom)?),
            Some("namespace") => {
                let Some(ns) = t["name"].as_str() else {
                    return Err(ApiError::bad("a namespace needs a `name`", Some(&at)));
                };
                let members = t["tools"].as_array().map(Vec::as_slice).unwrap_or_default();
                for (j, m) in members.iter().enumerate() {
                    let at = format!("{at}.tools[{j}]");
                    if !matches!(m["type"].as_str(), Some("function" | "custom")) {
                        return Err(ApiError::bad(
                            format!(
                                "a namespace's tools of type {} are not supported here (function, custom)",
                                m["type"]
                            ),
                            Some(&format!("{at}.type")),
                        ));
                    }
                    let def = tool_def(m, &at, &mut out.custom)?;
                    let name = def["function"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    out.namespaced.push((name, ns.to_owned()));
                    out.defs.push(def);
                }
            }
            Some(hosted) => out.ignored.push(hosted.to_owned()),
            None => {
                return Err(ApiError::bad(
                    "a tool needs a `type`",
                    Some(&format!("{at}.type")),
                ));
            }
        }
    }
    Ok(out)
}

/// One function or custom tool as a chat-completion tool definition (a custom one's name joins `custom`).
fn tool_def(t: &Value, at: &str, custom: &mut Vec<String>) -> Result<Value, ApiError> {
    let kind = t["type"].as_str().unwrap_or_default();
    let Some(name) = t["name"].as_str() else {
        return Err(ApiError::bad(
            format!("a {kind} tool needs a `name`"),
            Some(at),
        ));
    };
    let mut f = json!({"name": name});
    if !t["description"].is_null() {
        f["description"] = t["description"].clone();
    }
    if kind == "custom" {
        f["parameters"] = custom_parameters();
        custom.push(name.to_owned());
    } else {
        for k in ["parameters", "strict"] {
            if !t[k].is_null() {
                f[k] = t[k].clone();
            }
        }
    }
    Ok(json!({"type": "function", "function": f}))
}

/// `tool_choice` as the agent's.
pub(super) fn choice_of(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let bad = |m: &str| ApiError::bad(m, Some("tool_choice"));
    Ok(match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => {
                return Err(bad(
                    "`tool_choice` must be auto, none, required or a function",
                ));
            }
        },
        Some(v) if v["type"] == "function" || v["type"] == "custom" => match v["name"].as_str() {
            Some(n) => {
                ToolChoice::Function(n.strip_prefix(HOST_TOOL_PREFIX).unwrap_or(n).to_owned())
            }
            None => return Err(bad("a function `tool_choice` needs a `name`")),
        },
        Some(_) => {
            return Err(bad(
                "`tool_choice` must be auto, none, required or a function",
            ));
        }
    })
}

/// `text.format` as the agent's answer format.
pub(super) fn format_of(text: Option<&Value>) -> Result<ResponseFormat, ApiError> {
    let f = match text.map(|t| &t["format"]) {
        None | Some(Value::Null) => return Ok(ResponseFormat::Text),
        Some(f) => f,
    };
    let as_chat = match f["type"].as_str() {
        Some("json_schema") => json!({"type": "json_schema", "json_schema": {
            "name": f["name"].as_str().unwrap_or("answer"), "schema": f["schema"],
            "strict": f["strict"].as_bool().unwrap_or(false)}}),
        _ => f.clone(),
    };
    ResponseFormat::from_openai(&as_chat)
        .map_err(|e| ApiError::bad(e.to_string(), Some("text.format")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_become_the_agents_messages() {
        let m = input_messages(Some(&json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                {"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "thorn:clock", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "It is 21 C."}]}
        ])))
        .unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(
            (m[0].role, m[0].content.as_str()),
            (Role::System, "Be brief.")
        );
        assert_eq!(m[1].content, "Weather in Paris?");
        assert_eq!(m[2].role, Role::Assistant);
        assert_eq!(
            m[2].tool_calls.len(),
            2,
            "one turn's calls join one message"
        );
        assert_eq!(
            m[2].tool_calls[0].function.arguments,
            json!({"city": "Paris"})
        );
        assert_eq!(m[2].tool_calls[1].function.name, "clock");
        assert_eq!(
            (m[3].role, m[3].tool_call_id.as_deref()),
            (Role::Tool, Some("call_1"))
        );
        assert_eq!(m[4].content, "It is 21 C.");
        assert_eq!(input_messages(Some(&json!("hi"))).unwrap()[0].content, "hi");
        for (bad, param) in [
            (json!([{"role": "robot", "content": "x"}]), "input[0].role"),
            (
                json!([{"type": "input_image", "image_url": "x"}]),
                "input[0].type",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_image"}]}]),
                "input[0].content[0].type",
            ),
            (
                json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]),
                "input[0].arguments",
            ),
            (
                json!([{"type": "function_call_output", "output": "x"}]),
                "input[0]",
            ),
            (json!(5), "input"),
        ] {
            match input_messages(Some(&bad)) {
                Err(ApiError::BadRequest { param: p, .. }) => {
                    assert_eq!(p.as_deref(), Some(param), "{bad}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn tools_choices_and_formats_map_to_the_agents() {
        let Tools { defs, custom, .. } = tool_defs(&[json!({"type": "function", "name": "f",
            "description": "d", "parameters": {"type": "object"}, "strict": true})])
        .unwrap();
        assert!(custom.is_empty());
        assert_eq!(
            defs[0],
            json!({"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object"}, "strict": true}})
        );
        // Hosted tools are left out and listed; a tool without a type is an error.
        let t = tool_defs(&[
            json!({"type": "web_search", "external_web_access": false}),
            json!({"type": "namespace", "name": "agents", "tools": [
                {"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]}),
        ])
        .unwrap();
        assert_eq!(t.ignored, vec!["web_search".to_owned()]);
        assert_eq!(t.defs[0]["function"]["name"], "close_agent");
        assert_eq!(
            t.namespaced,
            vec![("close_agent".to_owned(), "agents".to_owned())]
        );
        assert!(tool_defs(&[json!({"name": "x"})]).is_err());
        assert_eq!(
            choice_of(Some(&json!("required"))).unwrap(),
            ToolChoice::Required
        );
        assert_eq!(
            choice_of(Some(&json!({"type": "function", "name": "thorn:clock"}))).unwrap(),
            ToolChoice::Function("clock".into())
        );
        assert!(choice_of(Some(&json!("sometimes"))).is_err());
        assert_eq!(format_of(None).unwrap(), ResponseFormat::Text);
        let f = format_of(Some(&json!({"format": {"type": "json_schema", "name": "a",
            "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}})))
        .unwrap();
        assert!(f.schema().is_some());
        assert!(format_of(Some(&json!({"format": {"type": "yaml"}}))).is_err());
    }

    #[test]
    fn custom_tools_are_functions_of_one_string_and_their_items_round_trip() {
        let Tools { defs, custom, .. } =
            tool_defs(&[json!({"type": "custom", "name": "apply_patch",
            "description": "Patch files.", "format": {"type": "grammar", "syntax": "lark",
            "definition": "start: /.+/"}})])
            .unwrap();
        assert_eq!(custom, vec!["apply_patch".to_owned()]);
        assert_eq!(
            defs[0]["function"]["parameters"]["required"],
            json!(["input"])
        );
        assert_eq!(defs[0]["function"]["description"], "Patch files.");
        assert_eq!(
            choice_of(Some(&json!({"type": "custom", "name": "apply_patch"}))).unwrap(),
            ToolChoice::Function("apply_patch".into())
        );
        let m = input_messages(Some(&json!([
            {"role": "user", "content": "Patch it."},
            {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "call_9", "output": "Done."}
        ])))
        .unwrap();
        assert_eq!(
            m[1].tool_calls[0].function.arguments,
            json!({"input": "*** Begin Patch"})
        );
        assert_eq!(
            (
                m[2].role,
                m[2].tool_call_id.as_deref(),
                m[2].content.as_str()
            ),
            (Role::Tool, Some("call_9"), "Done.")
        );
        assert!(
            input_messages(Some(&json!([{"type": "custom_tool_call", "input": "x"}]))).is_err()
        );
    }
}
