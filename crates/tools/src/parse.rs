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
/// synonym, and `arguments` may be a JSON string holding the object, as some models write it). A block ends
/// where its JSON value ends, so a string argument may itself contain `</tool_call>`. An unclosed final block
/// is accepted when its JSON is complete (generation may stop on the closing tag).
pub fn parse_tool_calls(text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
    let mut prose = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        prose.push_str(&rest[..start]);
        let block = split_block(&rest[start + OPEN.len()..])?;
        calls.push(parse_one(block.body.trim())?);
        rest = block.next;
    }
    prose.push_str(rest);
    Ok((prose.trim().to_owned(), calls))
}

/// The part of a generation cut short (by `max_tokens`) that holds only complete calls: everything before
/// the first block that is unfinished (no closing tag after its JSON) or malformed.
pub fn complete_calls_prefix(text: &str) -> &str {
    let mut offset = 0;
    while let Some(start) = text[offset..].find(OPEN) {
        let at = offset + start;
        match split_block(&text[at + OPEN.len()..]) {
            Ok(b) if b.closed && parse_one(b.body.trim()).is_ok() => {
                offset = text.len() - b.next.len();
            }
            _ => return &text[..at],
        }
    }
    // An opening tag cut off in the middle ("<tool_") is not prose either.
    (1..OPEN.len())
        .rev()
        .find(|&k| text.ends_with(&OPEN[..k]))
        .map_or(text, |k| &text[..text.len() - k])
}

/// One block after its opening tag.
struct Block<'a> {
    /// The JSON text.
    body: &'a str,
    /// What follows the block.
    next: &'a str,
    /// Whether the closing tag was there.
    closed: bool,
}

/// Finds where the block that starts at `after` (just past `<tool_call>`) ends: where its JSON value ends,
/// then the closing tag. Text that is not JSON falls back to the first closing tag (and fails to parse).
fn split_block(after: &str) -> Result<Block<'_>, ToolError> {
    let lead = after.len() - after.trim_start().len();
    let mut values = serde_json::Deserializer::from_str(&after[lead..]).into_iter::<Value>();
    let json_end = match values.next() {
        Some(Ok(_)) => Some(lead + values.byte_offset()),
        _ => None,
    };
    let Some(end) = json_end else {
        return Ok(match after.find(CLOSE) {
            Some(end) => Block {
                body: &after[..end],
                next: &after[end + CLOSE.len()..],
                closed: true,
            },
            None => Block {
                body: after,
                next: "",
                closed: false,
            },
        });
    };
    let tail = after[end..].trim_start();
    if let Some(next) = tail.strip_prefix(CLOSE) {
        Ok(Block {
            body: &after[..end],
            next,
            closed: true,
        })
    } else if tail.is_empty() {
        Ok(Block {
            body: &after[..end],
            next: "",
            closed: false,
        })
    } else {
        Err(ToolError::Malformed(format!(
            "text after the call's JSON and before {CLOSE}: {:?}",
            &tail[..tail.floor_char_boundary(40)]
        )))
    }
}

fn parse_one(body: &str) -> Result<ParsedCall, ToolError> {
    let v: Value =
        serde_json::from_str(body).map_err(|e| ToolError::Malformed(format!("{e} in {body:?}")))?;
    call_object(v)
}

/// A call written as a JSON object: a string `"name"` and the arguments under `"arguments"` (or Llama's
/// `"parameters"`), an object or a JSON string holding one (none: `{}`). Every JSON call format reads
/// its calls through this.
pub(crate) fn call_object(v: Value) -> Result<ParsedCall, ToolError> {
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::Malformed(format!("no string \"name\" in {v}")))?
        .to_owned();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
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

/// How long the longest end of `s` is that is the start of `tag` but not all of it: text to hold back
/// while it may still become the tag (a streamed trigger, an end token cut between two pieces).
pub fn tag_prefix_len(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}
