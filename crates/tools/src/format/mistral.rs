//! Mistral's tool calls (Mistral 7B v0.3, Nemo, Small 3.x, Devstral): the control token `[TOOL_CALLS]`
//! and a JSON array of call objects, each with its arguments under `"arguments"`:
//!
//! ```text
//! [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
//! ```
//!
//! The newer models (Small 3.2, Devstral, Magistral) write each call as `[TOOL_CALLS]NAME[ARGS]{...}`
//! instead ([`args_calls_grammar`] and the `args_` functions: format `mistral_args`).
//!
//! Parallel calls are more objects in the same array. The templates write past calls back with an `"id"`
//! of exactly nine letters and digits (Nemo refuses any other), so the ids a conversation carries are
//! given a nine-character form when it is rendered ([`template_id`]).

use super::{ParsedCall, ToolError, ToolSet};
use crate::grammar::{call_schema, control, json_body, start_rule};
use crate::parse::{call_object as call_of, tag_prefix_len};
use crate::{CallDelta, CallStreamer};
use serde_json::{Value, json};
use std::fmt::Write as _;

/// The control token that starts the calls (and the tool-choice `auto` trigger).
pub const OPEN: &str = "[TOOL_CALLS]";

/// The Lark grammar of the calls: `[TOOL_CALLS]` and an array of one call object (with `parallel`, one or
/// more), with `answer` (a JSON schema) as the alternative.
pub fn calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    let mut g = start_rule(answer);
    let more = if parallel { " (\", \" call)*" } else { "" };
    // Nemo's template writes `[TOOL_CALLS][`, Small 3's `[TOOL_CALLS] [`.
    let _ = writeln!(g, "calls: {} \" \"? \"[\" call{more} \"]\"", control(OPEN));
    let _ = writeln!(g, "call: %json {}", json_body(&call_schema(tools, only)));
    g
}

/// The prose before the calls and the calls: after each `[TOOL_CALLS]`, an array of call objects (or one
/// bare object). A last array cut short after a complete object still gives that object (see
/// [`complete_prefix`]).
pub fn parse(text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
    let Some(start) = text.find(OPEN) else {
        return Ok((text.trim().to_owned(), Vec::new()));
    };
    let prose = text[..start].trim().to_owned();
    let mut calls = Vec::new();
    let mut rest = &text[start..];
    while let Some(r) = rest.strip_prefix(OPEN) {
        let (objects, after) = read_calls(r.trim_start())?;
        calls.extend(objects);
        rest = after.trim_start();
    }
    if !rest.is_empty() {
        return Err(ToolError::Malformed(format!(
            "text after the mistral calls: {:?}",
            &rest[..rest.floor_char_boundary(40)]
        )));
    }
    Ok((prose, calls))
}

/// The calls of one `[TOOL_CALLS]` section and the text after it.
fn read_calls(text: &str) -> Result<(Vec<ParsedCall>, &str), ToolError> {
    let malformed = |e: &dyn std::fmt::Display| ToolError::Malformed(format!("mistral call: {e}"));
    if text.starts_with('{') {
        let (v, end) = first_value(text).map_err(|e| malformed(&e))?;
        return Ok((vec![call_of(v)?], &text[end..]));
    }
    let Some(mut rest) = text.strip_prefix('[') else {
        return Err(malformed(&"no array of calls after [TOOL_CALLS]"));
    };
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix(']') {
            return Ok((calls, r));
        }
        if rest.is_empty() && !calls.is_empty() {
            // Cut short after a complete call (the closing bracket never came).
            return Ok((calls, rest));
        }
        let (v, end) = first_value(rest).map_err(|e| malformed(&e))?;
        calls.push(call_of(v)?);
        rest = rest[end..].trim_start();
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with(']') && !rest.is_empty() {
            return Err(malformed(&"calls not separated by \",\""));
        }
    }
}

/// The first JSON value of `text` and where it ends.
fn first_value(text: &str) -> Result<(Value, usize), String> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    match values.next() {
        Some(Ok(v)) => Ok((v, values.byte_offset())),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no call object".into()),
    }
}

/// The text up to the end of the last complete call (a partial `[TOOL_CALLS]` is not prose either).
pub fn complete_prefix(text: &str) -> &str {
    let Some(start) = text.find(OPEN) else {
        return &text[..text.len() - tag_prefix_len(text, OPEN)];
    };
    let mut good = start;
    let mut at = start;
    while let Some(r) = text[at..].strip_prefix(OPEN) {
        let mut rest = r.trim_start();
        let Some(r) = rest.strip_prefix('[') else {
            return &text[..good];
        };
        rest = r;
        loop {
            rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix(']') {
                good = text.len() - r.len();
                at = text.len() - r.trim_start().len();
                break;
            }
            match first_value(rest) {
                Ok((v, end)) if call_of(v.clone()).is_ok() => {
                    good = text.len() - rest.len() + end;
                    rest = rest[end..].trim_start();
                    rest = rest.strip_prefix(',').unwrap_or(rest);
                }
                _ => return &text[..good],
            }
        }
    }
    &text[..good]
}

/// One call's text in this format.
pub fn write_call(name: &str, arguments: &Value) -> String {
    format!("{OPEN}{}", json!([{"name": name, "arguments": arguments}]))
}

/// A call id as Mistral's templates require it: nine letters and digits. An id that already is one stays;
/// any other is given one derived from it (the same id always gives the same form, so a conversation's
/// prompt stays a prefix of the next round's).
pub fn template_id(id: &str) -> String {
    if id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return id.to_owned();
    }
    // FNV-1a over the id, written in base 62.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    const DIGITS: &[u8; 62] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..9)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            d
        })
        .collect()
}

/// The control token between a call's name and its arguments in the newer form
/// (`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`: Mistral Small 3.2, Devstral, Magistral).
pub const ARGS: &str = "[ARGS]";
/// The control token before a past call's id in that form (`[TOOL_CALLS]name[CALL_ID]a1b2c3d4e[ARGS]{}`).
pub const CALL_ID: &str = "[CALL_ID]";

/// The Lark grammar of calls in the newer form: `[TOOL_CALLS]NAME[ARGS]{...}` per call (with `parallel`
/// one or more, back to back), an id after `[CALL_ID]` allowed as the templates write past calls.
pub fn args_calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    let mut g = crate::grammar::calls_head(answer, parallel, "");
    let _ = writeln!(g, "block: {} call", control(OPEN));
    let _ = writeln!(g, "id: {} /[A-Za-z0-9]{{9}}/", control(CALL_ID));
    let calls: Vec<String> = tools
        .tools()
        .iter()
        .filter(|t| only.is_none_or(|n| n == t.name))
        .map(|t| {
            format!(
                "{} id? {} %json {}",
                Value::from(t.name.as_str()),
                control(ARGS),
                json_body(&t.parameters)
            )
        })
        .collect();
    let _ = writeln!(g, "call: {}", calls.join("\n    | "));
    g
}

/// The prose before the calls and the calls of the newer form.
pub fn args_parse(text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
    let Some(start) = text.find(OPEN) else {
        return Ok((text.trim().to_owned(), Vec::new()));
    };
    let mut calls = Vec::new();
    let mut rest = &text[start..];
    while let Some(r) = rest.strip_prefix(OPEN) {
        let (call, after) = args_call(r)?;
        calls.push(call);
        rest = after.trim_start();
    }
    if !rest.is_empty() {
        return Err(ToolError::Malformed(format!(
            "text after the mistral calls: {:?}",
            &rest[..rest.floor_char_boundary(40)]
        )));
    }
    Ok((text[..start].trim().to_owned(), calls))
}

/// One call of the newer form (after its `[TOOL_CALLS]`) and the text after it.
fn args_call(text: &str) -> Result<(ParsedCall, &str), ToolError> {
    let malformed = |e: &dyn std::fmt::Display| ToolError::Malformed(format!("mistral call: {e}"));
    let a = text
        .find(ARGS)
        .ok_or_else(|| malformed(&"no [ARGS] after the name"))?;
    let header = &text[..a];
    let name = header.split(CALL_ID).next().unwrap_or_default().trim();
    if name.is_empty() || name.contains(OPEN) {
        return Err(malformed(&"no function name before [ARGS]"));
    }
    let body = &text[a + ARGS.len()..];
    let (arguments, end) = first_value(body).map_err(|e| malformed(&e))?;
    if !arguments.is_object() {
        return Err(ToolError::Malformed(format!(
            "arguments of {name:?} are not a JSON object"
        )));
    }
    let call = ParsedCall {
        name: name.to_owned(),
        arguments,
    };
    Ok((call, &body[end..]))
}

/// The text up to the end of the last complete call of the newer form.
pub fn args_complete_prefix(text: &str) -> &str {
    let Some(start) = text.find(OPEN) else {
        return complete_prefix(text);
    };
    let mut good = start;
    let mut rest = &text[start..];
    while let Some(r) = rest.strip_prefix(OPEN) {
        match args_call(r) {
            Ok((_, after)) => {
                good = text.len() - after.len();
                rest = after.trim_start();
            }
            Err(_) => break,
        }
    }
    &text[..good]
}

/// One call's text in the newer form.
pub fn args_write_call(name: &str, arguments: &Value) -> String {
    format!("{OPEN}{name}{ARGS}{arguments}")
}

/// Where the [`ArgsStreamer`] is.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum At {
    /// Before the first `[TOOL_CALLS]`.
    #[default]
    Outside,
    /// In a call's name (and id), before `[ARGS]`.
    Name,
    /// In a call's arguments.
    Args,
}

/// The streaming lexer of the newer form: each `[TOOL_CALLS]NAME[ARGS]{...}` is fed to a JSON call
/// streamer as `{"name": NAME, "arguments": {...}}`, so its deltas join to the parsed arguments as every
/// format's do. Text that may be the start of the next `[TOOL_CALLS]` is held back until it is known.
#[derive(Debug, Default)]
pub struct ArgsStreamer {
    at: At,
    held: String,
    calls: CallStreamer,
}

impl ArgsStreamer {
    /// A lexer at the start of the output.
    pub fn new() -> Self {
        ArgsStreamer {
            calls: CallStreamer::bare(),
            ..ArgsStreamer::default()
        }
    }

    /// Feeds generated text; `out` gets the deltas it completes.
    pub fn push(&mut self, text: &str, out: &mut dyn FnMut(CallDelta)) {
        self.held.push_str(text);
        loop {
            match self.at {
                At::Outside => match self.held.find(OPEN) {
                    Some(i) => {
                        self.held.drain(..i + OPEN.len());
                        self.at = At::Name;
                    }
                    None => {
                        let keep = tag_prefix_len(&self.held, OPEN);
                        self.held.drain(..self.held.len() - keep);
                        return;
                    }
                },
                At::Name => {
                    let Some(i) = self.held.find(ARGS) else {
                        return;
                    };
                    let name = self.held[..i]
                        .split(CALL_ID)
                        .next()
                        .unwrap_or_default()
                        .trim();
                    let open = format!("{{\"name\":{},\"arguments\":", Value::from(name));
                    self.calls.push(&open, out);
                    self.held.drain(..i + ARGS.len());
                    self.at = At::Args;
                }
                At::Args => match self.held.find(OPEN) {
                    Some(i) => {
                        let args: String = self.held.drain(..i + OPEN.len()).collect();
                        self.calls.push(&args[..i], out);
                        self.calls.push("}", out);
                        self.at = At::Name;
                    }
                    None => {
                        let take = self.held.len() - tag_prefix_len(&self.held, OPEN);
                        let args: String = self.held.drain(..take).collect();
                        self.calls.push(&args, out);
                        return;
                    }
                },
            }
        }
    }

    /// Calls begun so far.
    pub fn begun(&self) -> usize {
        self.calls.begun()
    }
}
