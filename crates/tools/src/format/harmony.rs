//! OpenAI's harmony format (gpt-oss): the output is a run of messages, each a header and a body between
//! control tokens, on channels: `analysis` (reasoning), `final` (the answer), `commentary` (preambles, and
//! calls, which name their recipient). After the prompt's `<|start|>assistant`:
//!
//! ```text
//! <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>
//! <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
//! ```
//!
//! The recipient may also stand in the channel header (`<|channel|>commentary to=functions.get_weather
//! <|constrain|>json<|message|>`). One call per message, and a call ends the turn (`<|call|>`), so
//! parallel calls come one per round. The end tokens (`<|call|>`, `<|return|>`) end generation and are
//! not in the text; `<|end|>` ends a message only.

use super::{ParsedCall, ToolError, ToolSet};
use crate::grammar::{control, json_body, text_until};
use crate::parse::tag_prefix_len;
use crate::{CallDelta, CallStreamer};
use serde_json::Value;
use std::fmt::Write as _;

/// Starts a message (after the first, which the prompt started).
pub const START: &str = "<|start|>";
/// Ends a message.
pub const END: &str = "<|end|>";
/// Ends the header; the body follows.
pub const MESSAGE: &str = "<|message|>";
/// Names the channel in a header.
pub const CHANNEL: &str = "<|channel|>";
/// Names the body's format in a call's header (`<|constrain|>json`).
pub const CONSTRAIN: &str = "<|constrain|>";
/// Ends a call message and the turn.
pub const CALL: &str = "<|call|>";
/// Ends the final message and the turn.
pub const RETURN: &str = "<|return|>";
/// What starts a call's recipient (the tool-choice `auto` trigger).
pub const TRIGGER: &str = "to=functions.";
/// Where reasoning starts: the analysis channel's body.
pub const THINK_OPEN: &str = "<|channel|>analysis<|message|>";

/// What the engine writes to end the analysis message when a reasoning budget is spent: the model then
/// goes on with its next message's header.
pub const CLOSE_ANALYSIS: &str = "<|end|><|start|>assistant";

/// The control tokens of the format's syntax (shown in the text).
pub const CONTROLS: [&str; 7] = [START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN];

/// The Lark grammar of a call (one per message whatever `parallel` says), after an optional analysis
/// message; with `answer` (a JSON schema) a final message holding that JSON is the alternative. From the
/// trigger on, the call's recipient, header and JSON arguments; `<|call|>` ends it.
pub fn calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    _parallel: bool,
    answer: Option<&Value>,
) -> String {
    let c = control;
    let mut g = String::new();
    match answer {
        Some(a) => {
            g.push_str("start: analysis? (final | call)\n");
            let _ = writeln!(
                g,
                "final: {} \"final\" {} %json {}",
                c(CHANNEL),
                c(MESSAGE),
                json_body(a)
            );
        }
        None => g.push_str("start: analysis? call\n"),
    }
    // Reasoning is free text up to `<|end|>`.
    let _ = writeln!(
        g,
        "analysis: {} \"analysis\" {} {} {} \"assistant\"",
        c(CHANNEL),
        c(MESSAGE),
        text_until(END),
        c(START)
    );
    let _ = writeln!(
        g,
        "call: (\" \" | {} \"commentary \")? {:?} target {}",
        c(CHANNEL),
        TRIGGER,
        c(CALL)
    );
    // The header after the name, in either order the models write it.
    let _ = writeln!(
        g,
        "tail: \" \"? {k} \"json\" | {ch} \"commentary\" (\" \" {k}? \"json\")?",
        k = c(CONSTRAIN),
        ch = c(CHANNEL)
    );
    let targets: Vec<String> = tools
        .tools()
        .iter()
        .filter(|t| only.is_none_or(|n| n == t.name))
        .map(|t| {
            format!(
                "{} tail {} %json {}",
                Value::from(t.name.as_str()),
                c(MESSAGE),
                json_body(&t.parameters)
            )
        })
        .collect();
    let _ = writeln!(g, "target: {}", targets.join("\n    | "));
    g
}

/// What a message is, by its header.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    /// The analysis channel.
    Reasoning,
    /// A final or commentary message to the user.
    Content,
    /// A call to the named function.
    Call(String),
}

impl Kind {
    fn of(header: &str) -> Kind {
        if let Some(i) = header.find(TRIGGER) {
            let name = &header[i + TRIGGER.len()..];
            let end = name
                .find(|c: char| c.is_whitespace() || c == '<')
                .unwrap_or(name.len());
            Kind::Call(name[..end].to_owned())
        } else if header.contains("analysis") {
            Kind::Reasoning
        } else {
            Kind::Content
        }
    }
}

/// One message of the output.
#[derive(Debug)]
struct Msg<'a> {
    /// Where it starts in the text.
    at: usize,
    kind: Kind,
    body: &'a str,
}

/// The tokens that end a body (`<|start|>` too: a model may start the next message without ending).
const BODY_ENDS: [&str; 4] = [END, CALL, RETURN, START];

/// The messages of `text`; text without any message syntax is one content message.
fn messages(text: &str) -> Vec<Msg<'_>> {
    if !text.contains(MESSAGE) {
        return vec![Msg {
            at: 0,
            kind: Kind::Content,
            body: text,
        }];
    }
    let mut out = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let rest = &text[at..];
        let Some(h) = rest.find(MESSAGE) else {
            break;
        };
        let header = &rest[..h];
        let body_start = h + MESSAGE.len();
        let body_rest = &rest[body_start..];
        let (len, end_len) = BODY_ENDS
            .iter()
            .filter_map(|e| {
                body_rest
                    .find(e)
                    .map(|i| (i, if *e == START { 0 } else { e.len() }))
            })
            .min()
            .unwrap_or((body_rest.len(), 0));
        out.push(Msg {
            at,
            kind: Kind::of(header),
            body: &body_rest[..len],
        });
        at += body_start + len + end_len;
    }
    out
}

/// The answer (final and commentary messages to the user, joined) and the calls of `text`; reasoning is
/// not part of either.
pub fn parse(text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
    let mut content = String::new();
    let mut calls = Vec::new();
    for m in messages(text) {
        match m.kind {
            Kind::Reasoning => {}
            Kind::Content => content.push_str(m.body),
            Kind::Call(name) => {
                let arguments: Value = serde_json::from_str(m.body.trim())
                    .map_err(|e| ToolError::Malformed(format!("harmony call to {name:?}: {e}")))?;
                if !arguments.is_object() {
                    return Err(ToolError::Malformed(format!(
                        "arguments of {name:?} are not a JSON object"
                    )));
                }
                calls.push(ParsedCall { name, arguments });
            }
        }
    }
    Ok((content.trim().to_owned(), calls))
}

/// The text before the first call whose arguments are not yet a whole JSON object.
pub fn complete_prefix(text: &str) -> &str {
    for m in messages(text) {
        if let Kind::Call(_) = m.kind {
            let whole = serde_json::from_str::<Value>(m.body.trim()).is_ok_and(|v| v.is_object());
            if !whole {
                return &text[..m.at];
            }
        }
    }
    text
}

/// One call's text as the gpt-oss template writes it.
pub fn write_call(name: &str, arguments: &Value) -> String {
    format!("{START}assistant {TRIGGER}{name}{CHANNEL}commentary json{MESSAGE}{arguments}{CALL}")
}

/// The developer-message block that teaches the format to a model whose template does not render tools.
pub fn instructions(list: &str) -> String {
    format!(
        "# Tools\n\nYou may call these functions (JSON Schema definitions):\n{list}\n\n\
         Calls to these tools must go to the commentary channel: 'functions'. Write a call as a message to \
         functions.NAME on the commentary channel whose body is the JSON arguments."
    )
}

/// What the streaming lexer makes of the output.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Reasoning (the analysis channel).
    Reasoning(String),
    /// Answer text (final and commentary messages to the user).
    Content(String),
    /// A call's progress.
    Call(CallDelta),
}

/// Where the [`HarmonyStreamer`] is.
#[derive(Debug, Default)]
enum At {
    /// In a header (the text so far is in `held`).
    #[default]
    Header,
    /// In a body of this kind.
    Body(Kind),
}

/// The streaming lexer of harmony output: headers read whole, bodies streamed by their channel (reasoning,
/// answer text, or a call's arguments, whose deltas join to the parsed arguments as every format's do).
/// Text that may be the start of an end token is held back until it is known.
#[derive(Debug, Default)]
pub struct HarmonyStreamer {
    at: At,
    held: String,
    calls: CallStreamer,
    /// Whether any message syntax has been seen (text before it may still be plain answer text).
    framed: bool,
}

impl HarmonyStreamer {
    /// A lexer at the start of the assistant's turn.
    pub fn new() -> Self {
        HarmonyStreamer {
            calls: CallStreamer::bare(),
            ..HarmonyStreamer::default()
        }
    }

    /// Feeds generated text; `out` gets the parts it completes.
    pub fn push(&mut self, text: &str, out: &mut dyn FnMut(Part)) {
        self.held.push_str(text);
        loop {
            match &self.at {
                At::Header => {
                    let Some(h) = self.held.find(MESSAGE) else {
                        // Output that never frames a message (a model without the syntax) is answer text.
                        if !self.framed && !may_be_header(&self.held) {
                            self.at = At::Body(Kind::Content);
                            self.framed = true;
                            continue;
                        }
                        return;
                    };
                    self.framed = true;
                    let kind = Kind::of(&self.held[..h]);
                    self.held.drain(..h + MESSAGE.len());
                    if let Kind::Call(name) = &kind {
                        let open =
                            format!("{{\"name\":{},\"arguments\":", Value::from(name.as_str()));
                        self.calls.push(&open, &mut |d| out(Part::Call(d)));
                    }
                    self.at = At::Body(kind);
                }
                At::Body(kind) => {
                    let end = BODY_ENDS
                        .iter()
                        .filter_map(|e| self.held.find(e).map(|i| (i, *e)))
                        .min();
                    let (take, done) = match end {
                        Some((i, e)) => (i, Some(e)),
                        None => (self.held.len() - held_back(&self.held), None),
                    };
                    if take > 0 {
                        let piece: String = self.held.drain(..take).collect();
                        emit(kind, piece, &mut self.calls, out);
                    }
                    let Some(e) = done else { return };
                    if let Kind::Call(_) = kind {
                        self.calls.push("}", &mut |d| out(Part::Call(d)));
                    }
                    let skip = if e == START { START.len() } else { e.len() };
                    self.held.drain(..skip);
                    self.at = At::Header;
                }
            }
        }
    }

    /// Ends the output: a body cut short gives what it has (a call's arguments stay as streamed).
    pub fn finish(&mut self, out: &mut dyn FnMut(Part)) {
        if let At::Body(kind) = &self.at
            && !self.held.is_empty()
        {
            let piece = std::mem::take(&mut self.held);
            emit(kind, piece, &mut self.calls, out);
        }
        self.held.clear();
        self.at = At::Header;
        self.framed = false;
    }

    /// Calls begun so far.
    pub fn begun(&self) -> usize {
        self.calls.begun()
    }
}

fn emit(kind: &Kind, piece: String, calls: &mut CallStreamer, out: &mut dyn FnMut(Part)) {
    match kind {
        Kind::Reasoning => out(Part::Reasoning(piece)),
        Kind::Content => out(Part::Content(piece)),
        Kind::Call(_) => calls.push(&piece, &mut |d| out(Part::Call(d))),
    }
}

/// Whether the output so far may be a message's header (the first one starts with its channel or, as the
/// template writes calls, with the recipient).
fn may_be_header(s: &str) -> bool {
    [CHANNEL, START, " to=functions.", TRIGGER]
        .iter()
        .any(|h| s.starts_with(h) || h.starts_with(s))
}

/// How much of the end of `s` may be the start of an end token.
fn held_back(s: &str) -> usize {
    BODY_ENDS
        .iter()
        .map(|e| tag_prefix_len(s, e))
        .max()
        .unwrap_or(0)
}
