//! `<tool_call>{...}</tool_call>` blocks in generated text.

use super::ToolError;
use serde_json::Value;

/// The opening tag of a call.
pub const OPEN: &str = "<tool_call>";
/// The closing tag of a call.
pub const CLOSE: &str = "</tool_call>";

/// A call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    /// Tool name.
    pub name: String,
    /// Arguments (a JSON object).
    pub arguments: Value,
}

/// Splits `text` into the prose outside any `<tool_call>` block and the calls inside them, in order.
///
/// A block must hold one JSON object `{"name": string, "arguments": object}` (`"parameters"` is accepted as a
/// synonym, and `arguments` may be a JSON string holding the object, as some models write it). An unclosed
/// final block is accepted when its JSON is complete (generation may stop on the closing tag).
pub fn parse_tool_calls(text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
    let mut prose = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        prose.push_str(&rest[..start]);
        let body_start = start + OPEN.len();
        let after = &rest[body_start..];
        // The block ends where its JSON value ends (a string inside it may itself contain the closing tag),
        // then the closing tag; text that is not JSON falls back to the first closing tag.
        let lead = after.len() - after.trim_start().len();
        let mut values = serde_json::Deserializer::from_str(&after[lead..]).into_iter::<Value>();
        let json_end = match values.next() {
            Some(Ok(_)) => Some(lead + values.byte_offset()),
            _ => None,
        };
        let (body, next) = match json_end {
            Some(end) => {
                let tail = after[end..].trim_start();
                if let Some(t) = tail.strip_prefix(CLOSE) {
                    (&after[..end], t)
                } else if tail.is_empty() {
                    (&after[..end], "")
                } else {
                    return Err(ToolError::Malformed(format!(
                        "text after the call's JSON and before {CLOSE}: {:?}",
                        &tail[..tail.len().min(40)]
                    )));
                }
            }
            None => match after.find(CLOSE) {
                Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
                None => (after, ""),
            },
        };
        calls.push(parse_one(body.trim())?);
        rest = next;
    }
    prose.push_str(rest);
    Ok((prose.trim().to_owned(), calls))
}

fn parse_one(body: &str) -> Result<ParsedCall, ToolError> {
    let v: Value =
        serde_json::from_str(body).map_err(|e| ToolError::Malformed(format!("{e} in {body:?}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ToolError::Malformed(format!("{body:?} is not a JSON object")))?;
    let name = obj
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::Malformed(format!("no string \"name\" in {body:?}")))?
        .to_owned();
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str(s)
            .map_err(|e| ToolError::Malformed(format!("arguments string is not JSON: {e}")))?,
        Some(a) => a.clone(),
    };
    if !arguments.is_object() {
        return Err(ToolError::Malformed(format!(
            "arguments of {name:?} are not a JSON object"
        )));
    }
    Ok(ParsedCall { name, arguments })
}

/// The part of a generation cut short (by `max_tokens`) that holds only complete calls: everything before an
/// unfinished last `<tool_call>` block.
pub fn complete_calls_prefix(text: &str) -> &str {
    let Some(at) = text.rfind(OPEN) else {
        return text;
    };
    let last = &text[at..];
    if last.trim_end().ends_with(CLOSE) && parse_tool_calls(last).is_ok() {
        text
    } else {
        &text[..at]
    }
}
