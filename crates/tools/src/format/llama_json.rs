//! Llama 3.x's JSON tool calls (Llama 3.1, 3.2, 3.3): the answer is the call itself, a bare JSON object
//! with the arguments under `"parameters"`, several separated by `; `, after an optional `<|python_tag|>`:
//!
//! ```text
//! {"name": "get_weather", "parameters": {"city": "Paris"}}
//! ```

use super::{ParsedCall, ToolError, ToolSet};
use crate::grammar::{call_schema_keyed, calls_head, json_body};
use crate::parse::{call_object as call_of, tag_prefix_len};
use serde_json::{Value, json};
use std::fmt::Write as _;

/// What starts a call (a tool-choice `auto` grammar switches on there).
pub const TRIGGER: &str = "{\"name\"";
/// What the model may write before its calls (a control token in Llama 3's vocabulary).
pub const PYTHON_TAG: &str = "<|python_tag|>";

/// The Lark grammar of calls (one, or with `parallel` several separated by `; `), with `answer` (a JSON
/// schema) as the alternative.
pub fn calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    let mut g = calls_head(answer, parallel, "; ");
    let call = call_schema_keyed(tools, only, "parameters");
    let _ = writeln!(g, "block: %json {}", json_body(&call));
    g
}

/// The prose (before any call) and the calls of `text`: from its first call object (after an optional
/// `<|python_tag|>`) on, objects separated by `;`.
pub fn parse(text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
    let (prose, mut rest) = match text.find(TRIGGER) {
        Some(i) => (&text[..i], &text[i..]),
        None => return Ok((text.trim().to_owned(), Vec::new())),
    };
    let prose = prose.trim().trim_end_matches(PYTHON_TAG).trim();
    let mut calls = Vec::new();
    loop {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = match values.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) => return Err(ToolError::Malformed(format!("llama3_json call: {e}"))),
            None => break,
        };
        let end = values.byte_offset();
        calls.push(call_of(v)?);
        rest = rest[end..].trim_start();
        match rest.strip_prefix(';') {
            Some(r) => rest = r.trim_start(),
            None if rest.is_empty() => break,
            None => {
                return Err(ToolError::Malformed(format!(
                    "text after a llama3_json call: {:?}",
                    &rest[..rest.floor_char_boundary(40)]
                )));
            }
        }
    }
    Ok((prose.to_owned(), calls))
}

/// The text before the first call that is unfinished or malformed.
pub fn complete_prefix(text: &str) -> &str {
    let Some(start) = text.find(TRIGGER) else {
        // A trigger cut off in the middle is not prose either.
        return &text[..text.len() - tag_prefix_len(text, TRIGGER)];
    };
    let mut rest = &text[start..];
    let mut good = start;
    loop {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match values.next() {
            Some(Ok(v)) if call_of(v.clone()).is_ok() => {
                let end = values.byte_offset();
                good = text.len() - rest.len() + end;
                let after = rest[end..].trim_start();
                match after.strip_prefix(';') {
                    Some(r) if r.trim_start().starts_with(TRIGGER) => rest = r.trim_start(),
                    _ => return &text[..good],
                }
            }
            _ => return &text[..good],
        }
    }
}

/// One call's text in this format.
pub fn write_call(name: &str, arguments: &Value) -> String {
    json!({"name": name, "parameters": arguments}).to_string()
}

/// The system-prompt block that teaches the format (Llama 3.1's own wording for JSON tool calls).
pub fn instructions(list: &str) -> String {
    format!(
        "Given the following functions, please respond with a JSON for a function call with its proper arguments \
         that best answers the given prompt.\n\nRespond in the format {{\"name\": function name, \"parameters\": \
         dictionary of argument name and its value}}. Do not use variables.\n\n{list}"
    )
}
