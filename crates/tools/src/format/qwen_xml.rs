//! Qwen3's XML tool calls (Qwen3-Coder, Qwen3.5/3.6: the hybrid family and the MLPerf Edge Agentic model):
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! A parameter's value is the text between its tags less one newline on each side. A string parameter is
//! that raw text (no quotes, no escapes: it may span lines, but cannot contain `</parameter>`); any other
//! type is JSON (`3`, `true`, `{"a": 1}`; Python's `True`/`False`/`None` are read too, as the chat
//! template writes them through Jinja's `string` filter).

use super::{ParsedCall, ToolError, ToolSet};
use crate::grammar::{calls_head, json_body};
use serde_json::{Map, Value};
use std::fmt::Write as _;

/// Opens a call (as Hermes).
pub const OPEN: &str = "<tool_call>";
/// Closes a call.
pub const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Whether the parameter of schema `s` is written as raw text: its type is `string` alone.
pub(crate) fn is_text(s: Option<&Value>) -> bool {
    s.and_then(|s| s.get("type")).is_some_and(|t| {
        t == "string"
            || t.as_array()
                .is_some_and(|a| a.len() == 1 && a[0] == "string")
    })
}

/// A parameter's value from its raw text, as its schema `s` says.
pub(crate) fn value_of(s: Option<&Value>, raw: &str) -> Result<Value, ToolError> {
    if is_text(s) {
        return Ok(Value::String(raw.to_owned()));
    }
    let t = raw.trim();
    if let Ok(v) = serde_json::from_str::<Value>(t) {
        return Ok(v);
    }
    match t {
        "True" => return Ok(Value::Bool(true)),
        "False" => return Ok(Value::Bool(false)),
        "None" => return Ok(Value::Null),
        _ => {}
    }
    let types = s.and_then(|s| s.get("type"));
    let may_be_text = types.is_none_or(|t| {
        t == "string"
            || t.as_array()
                .is_some_and(|a| a.iter().any(|x| x == "string"))
    });
    if may_be_text {
        Ok(Value::String(raw.to_owned()))
    } else {
        Err(ToolError::Malformed(format!(
            "parameter value {:?} is not JSON of its type",
            &t[..t.floor_char_boundary(40)]
        )))
    }
}

/// The schema of parameter `key` of tool `name` in `tools`.
pub(crate) fn param_schema<'a>(tools: &'a ToolSet, name: &str, key: &str) -> Option<&'a Value> {
    tools.get(name)?.parameters.get("properties")?.get(key)
}

/// Checks that every parameter name of every tool can be written in this format (no `>`, `<` or line
/// breaks: they would end the tag).
pub(crate) fn check_names(tools: &ToolSet) -> Result<(), ToolError> {
    for t in tools.tools() {
        let props = t.parameters.get("properties").and_then(Value::as_object);
        for key in props.into_iter().flat_map(|p| p.keys()) {
            if key.is_empty() || key.contains(['<', '>', '\n', '\r']) {
                return Err(ToolError::Schema {
                    tool: t.name.clone(),
                    msg: format!(
                        "parameter name {key:?} cannot be written in the qwen3_xml tool-call format"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// One call's text in this format: a string parameter's text as it is, any other value as JSON.
pub fn write_call(tools: &ToolSet, name: &str, arguments: &Value) -> String {
    let mut s = format!("{OPEN}\n{FUNCTION}{name}>\n");
    if let Some(args) = arguments.as_object() {
        for (k, v) in args {
            let text = match v {
                Value::String(t) if is_text(param_schema(tools, name, k)) => t.clone(),
                v => v.to_string(),
            };
            let _ = write!(s, "{PARAMETER}{k}>\n{text}\n{PARAMETER_END}\n");
        }
    }
    s.push_str(FUNCTION_END);
    s.push('\n');
    s.push_str(CLOSE);
    s
}

/// The prose and the calls of `text`, in order. A call is `<tool_call>`, `<function=NAME>`, its parameters
/// and `</function>`, then `</tool_call>` (which may be missing at the very end: generation stops there).
pub fn parse(tools: &ToolSet, text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
    let mut prose = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        prose.push_str(&rest[..start]);
        let (call, next) = parse_block(tools, &rest[start + OPEN.len()..])?;
        calls.push(call);
        rest = next;
    }
    prose.push_str(rest);
    Ok((prose.trim().to_owned(), calls))
}

/// The text before the first call that is unfinished or malformed (what a cut-short generation may keep).
pub fn complete_prefix<'a>(tools: &ToolSet, text: &'a str) -> &'a str {
    let mut offset = 0;
    while let Some(start) = text[offset..].find(OPEN) {
        let at = offset + start;
        match parse_block(tools, &text[at + OPEN.len()..]) {
            Ok((_, next)) if text[..text.len() - next.len()].trim_end().ends_with(CLOSE) => {
                offset = text.len() - next.len();
            }
            _ => return &text[..at],
        }
    }
    (1..OPEN.len())
        .rev()
        .find(|&k| text.ends_with(&OPEN[..k]))
        .map_or(text, |k| &text[..text.len() - k])
}

/// One call after its opening tag, and the text after it.
fn parse_block<'a>(tools: &ToolSet, after: &'a str) -> Result<(ParsedCall, &'a str), ToolError> {
    let bad = |what: &str| ToolError::Malformed(format!("qwen3_xml call: {what}"));
    let s = after.trim_start();
    let s = s
        .strip_prefix(FUNCTION)
        .ok_or_else(|| bad("no <function=NAME> after <tool_call>"))?;
    let end = s.find('>').ok_or_else(|| bad("unclosed <function= tag"))?;
    let name = s[..end].trim().to_owned();
    let mut s = &s[end + 1..];
    let mut args = Map::new();
    loop {
        let t = s.trim_start();
        if let Some(after_fn) = t.strip_prefix(FUNCTION_END) {
            let t = after_fn.trim_start();
            let next = t.strip_prefix(CLOSE).unwrap_or(t);
            if next.len() == t.len() && !t.is_empty() {
                return Err(bad("text between </function> and </tool_call>"));
            }
            return Ok((
                ParsedCall {
                    name,
                    arguments: Value::Object(args),
                },
                next,
            ));
        }
        let t = t
            .strip_prefix(PARAMETER)
            .ok_or_else(|| bad("expected <parameter=KEY> or </function>"))?;
        let close = t.find('>').ok_or_else(|| bad("unclosed <parameter= tag"))?;
        let key = t[..close].trim().to_owned();
        let body = &t[close + 1..];
        let end = body
            .find(PARAMETER_END)
            .ok_or_else(|| bad(&format!("parameter {key:?} has no </parameter>")))?;
        let raw = body[..end].strip_prefix('\n').unwrap_or(&body[..end]);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let v = value_of(param_schema(tools, &name, &key), raw)?;
        args.insert(key, v);
        s = &body[end + PARAMETER_END.len()..];
    }
}

/// The Lark grammar of calls (one, or with `parallel` several, each on its own line) to the tools (or just
/// `only`), with `answer` (a JSON schema) as the alternative. Parameters come in their schema's order, the
/// required ones always, the others optionally; a string parameter is any text up to `</parameter>`, any
/// other its schema as compact JSON.
pub fn calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    let mut g = calls_head(answer, parallel, "\n");
    let chosen: Vec<(usize, &crate::Tool)> = tools
        .tools()
        .iter()
        .enumerate()
        .filter(|(_, t)| only.is_none_or(|n| n == t.name))
        .collect();
    let names: Vec<String> = chosen.iter().map(|(i, _)| format!("call_{i}")).collect();
    let _ = writeln!(g, "block: {}", names.join(" | "));
    for (i, t) in chosen {
        let head = lark_str(&format!("{OPEN}\n{FUNCTION}{}>\n", t.name));
        let tail = lark_str(&format!("{FUNCTION_END}\n{CLOSE}"));
        let props = t.parameters.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = t
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut params = String::new();
        for (k, (key, schema)) in props.into_iter().flatten().enumerate() {
            let rule = format!("p_{i}_{k}");
            let opt = if required.contains(&key.as_str()) {
                ""
            } else {
                "?"
            };
            let _ = write!(params, " {rule}{opt}");
            let open = lark_str(&format!("{PARAMETER}{key}>\n"));
            let end = format!("\n{PARAMETER_END}\n");
            if is_text(Some(schema)) {
                let _ = writeln!(g, "{rule}: {open} v_{i}_{k}");
                let _ = writeln!(g, "v_{i}_{k}[suffix={}]: /(.|\\n)*/", lark_str(&end));
            } else {
                let _ = writeln!(g, "{rule}: {open} v_{i}_{k} {}", lark_str(&end));
                let _ = writeln!(g, "v_{i}_{k}: %json {}", json_body(schema));
            }
        }
        let _ = writeln!(g, "call_{i}: {head}{params} {tail}");
    }
    g
}

/// `s` as a Lark string literal (JSON's escapes, which the grammar's strings take).
fn lark_str(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}
