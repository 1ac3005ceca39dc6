//! Gemma's tool calls: a call is `call:NAME{key:value,...}` between control tokens, keys bare, strings
//! between quote tokens, numbers and `true`/`false` bare, objects and arrays as in JSON. Two dialects:
//!
//! ```text
//! Gemma 4:       <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
//! FunctionGemma: <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>
//! ```
//!
//! The templates write arguments with their keys sorted (`dictsort`), and so does the grammar. Parallel
//! calls follow each other. Values are read by a transducer into JSON text ([`ToJson`]), so the parser
//! and the streamed deltas share one reading and the deltas join to the parsed arguments as every
//! format's do.

use super::{ParsedCall, ToolError, ToolSet};
use crate::grammar::{calls_head, control, text_until};
use crate::parse::tag_prefix_len;
use crate::{CallDelta, CallStreamer};
use serde_json::Value;
use std::fmt::Write as _;

/// A dialect's delimiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dialect {
    /// Opens a call (the tool-choice `auto` trigger).
    pub open: &'static str,
    /// Closes a call.
    pub close: &'static str,
    /// Quotes a string on both sides.
    pub quote: &'static str,
}

/// Gemma 4's.
pub const GEMMA4: Dialect = Dialect {
    open: "<|tool_call>",
    close: "<tool_call|>",
    quote: "<|\"|>",
};

/// FunctionGemma's.
pub const FUNCTION_GEMMA: Dialect = Dialect {
    open: "<start_function_call>",
    close: "<end_function_call>",
    quote: "<escape>",
};

/// What follows the opening token.
const CALL: &str = "call:";

/// Gemma 4's reasoning block (`<|channel>thought\n...<channel|>`).
pub const THINK_OPEN: &str = "<|channel>thought\n";
/// See [`THINK_OPEN`].
pub const THINK_CLOSE: &str = "<channel|>";

impl Dialect {
    /// The Lark grammar of calls: one (with `parallel`, one or more), with `answer` (a JSON schema) as the
    /// alternative.
    pub fn calls_grammar(
        self,
        tools: &ToolSet,
        only: Option<&str>,
        parallel: bool,
        answer: Option<&Value>,
    ) -> String {
        let mut g = calls_head(answer, parallel, "");
        let mut rules = Rules {
            quote: self.quote,
            out: String::new(),
            next: 0,
            any: false,
        };
        let calls: Vec<String> = tools
            .tools()
            .iter()
            .filter(|t| only.is_none_or(|n| n == t.name))
            .map(|t| {
                let args = rules.object_of(&t.parameters);
                format!("{} {args}", Value::from(t.name.as_str()))
            })
            .collect();
        let _ = writeln!(
            g,
            "block: {} {:?} call {}",
            control(self.open),
            CALL,
            control(self.close)
        );
        let _ = writeln!(g, "call: {}", calls.join("\n    | "));
        g.push_str(&rules.out);
        g
    }

    /// The prose before the first call and the calls.
    pub fn parse(self, text: &str) -> Result<(String, Vec<ParsedCall>), ToolError> {
        let Some(start) = text.find(self.open) else {
            return Ok((text.trim().to_owned(), Vec::new()));
        };
        let mut calls = Vec::new();
        let mut rest = &text[start..];
        while let Some(r) = rest.strip_prefix(self.open) {
            let (call, after) = self.read_call(r)?;
            calls.push(call);
            rest = after.trim_start();
        }
        if !rest.is_empty() {
            return Err(ToolError::Malformed(format!(
                "text after the gemma calls: {:?}",
                &rest[..rest.floor_char_boundary(40)]
            )));
        }
        Ok((text[..start].trim().to_owned(), calls))
    }

    /// One call (after its opening token) and the text after its closing token.
    fn read_call(self, text: &str) -> Result<(ParsedCall, &str), ToolError> {
        let malformed = |m: &str| ToolError::Malformed(format!("gemma call: {m}"));
        let r = text
            .strip_prefix(CALL)
            .ok_or_else(|| malformed("no \"call:\""))?;
        let brace = r.find('{').ok_or_else(|| malformed("no arguments"))?;
        let name = r[..brace].trim();
        if name.is_empty() || name.contains(self.close) {
            return Err(malformed("no function name"));
        }
        let mut json = String::new();
        let mut t = ToJson::new(self.quote);
        let end = t
            .push(&r[brace..], &mut json)
            .ok_or_else(|| malformed("arguments not closed"))?;
        let arguments: Value = serde_json::from_str(&json)
            .map_err(|e| malformed(&format!("arguments {json:?}: {e}")))?;
        if !arguments.is_object() {
            return Err(malformed("arguments are not an object"));
        }
        let after = r[brace + end..].trim_start();
        let after = after
            .strip_prefix(self.close)
            .ok_or_else(|| malformed("no closing token"))?;
        let call = ParsedCall {
            name: name.to_owned(),
            arguments,
        };
        Ok((call, after))
    }

    /// The text up to the end of the last complete call.
    pub fn complete_prefix(self, text: &str) -> &str {
        let Some(start) = text.find(self.open) else {
            return &text[..text.len() - tag_prefix_len(text, self.open)];
        };
        let mut good = start;
        let mut rest = &text[start..];
        while let Some(r) = rest.strip_prefix(self.open) {
            match self.read_call(r) {
                Ok((_, after)) => {
                    good = text.len() - after.len();
                    rest = after.trim_start();
                }
                Err(_) => break,
            }
        }
        &text[..good]
    }

    /// One call's text as the templates write it (keys sorted).
    pub fn write_call(self, name: &str, arguments: &Value) -> String {
        let mut s = format!("{}{CALL}{name}", self.open);
        self.write_value(arguments, &mut s);
        s.push_str(self.close);
        s
    }

    fn write_value(self, v: &Value, s: &mut String) {
        match v {
            Value::String(t) => {
                s.push_str(self.quote);
                s.push_str(t);
                s.push_str(self.quote);
            }
            Value::Object(m) => {
                s.push('{');
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        s.push(',');
                    }
                    s.push_str(k);
                    s.push(':');
                    self.write_value(&m[k], s);
                }
                s.push('}');
            }
            Value::Array(a) => {
                s.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        s.push(',');
                    }
                    self.write_value(x, s);
                }
                s.push(']');
            }
            other => s.push_str(&other.to_string()),
        }
    }

    /// The control tokens of the dialect's syntax.
    pub fn controls(self) -> [&'static str; 3] {
        [self.open, self.close, self.quote]
    }
}

/// The grammar rules a schema's values need, in the dialect's syntax.
struct Rules {
    quote: &'static str,
    out: String,
    next: usize,
    /// Whether the `any` rule (a value of any type) has been written.
    any: bool,
}

impl Rules {
    fn rule(&mut self, body: &str) -> String {
        let name = format!("v{}", self.next);
        self.next += 1;
        let _ = writeln!(self.out, "{name}: {body}");
        name
    }

    fn string(&self) -> String {
        format!("({} {})", control(self.quote), text_until(self.quote))
    }

    /// A literal value (`const`, `enum`).
    fn literal(&self, v: &Value) -> String {
        match v {
            Value::String(s) => format!(
                "{} {} {}",
                control(self.quote),
                Value::from(s.as_str()),
                control(self.quote)
            ),
            other => Value::from(other.to_string()).to_string(),
        }
    }

    fn any(&mut self) -> String {
        if !self.any {
            self.any = true;
            let s = self.string();
            let _ = writeln!(
                self.out,
                "any: {s} | NUMBER | \"true\" | \"false\" | \"null\" | \"{{\" (KEY \":\" any (\",\" KEY \":\" any)*)? \"}}\" | \"[\" (any (\",\" any)*)? \"]\"\n\
                 KEY: /[A-Za-z_][A-Za-z0-9_.-]*/\n\
                 NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n\
                 INTEGER: /-?(0|[1-9][0-9]*)/"
            );
        }
        "any".into()
    }

    /// The grammar expression of a value matching `schema` (looser than the schema where the dialect
    /// has no way to say it: the call is validated against the schema after it is parsed).
    fn value(&mut self, schema: &Value) -> String {
        let Some(o) = schema.as_object() else {
            return self.any();
        };
        if let Some(c) = o.get("const") {
            return self.literal(c);
        }
        if let Some(Value::Array(e)) = o.get("enum") {
            let alts: Vec<String> = e.iter().map(|v| self.literal(v)).collect();
            return format!("({})", alts.join(" | "));
        }
        for k in ["anyOf", "oneOf"] {
            if let Some(Value::Array(bs)) = o.get(k) {
                let alts: Vec<String> = bs.iter().map(|b| self.value(b)).collect();
                return format!("({})", alts.join(" | "));
            }
        }
        let types: Vec<&str> = match o.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => return self.any(),
        };
        let alts: Vec<String> = types
            .into_iter()
            .map(|t| match t {
                "string" => self.string(),
                "integer" => {
                    self.any();
                    "INTEGER".into()
                }
                "number" => {
                    self.any();
                    "NUMBER".into()
                }
                "boolean" => "(\"true\" | \"false\")".into(),
                "null" => "\"null\"".into(),
                "object" => self.object_of(schema),
                "array" => {
                    let item = match o.get("items") {
                        Some(i) => self.value(i),
                        None => self.any(),
                    };
                    format!("\"[\" ({item} (\",\" {item})*)? \"]\"")
                }
                _ => self.any(),
            })
            .collect();
        format!("({})", alts.join(" | "))
    }

    /// An object: its listed properties in sorted key order, the required ones always, the others if the
    /// model writes them; an object without a list takes any keys.
    fn object_of(&mut self, schema: &Value) -> String {
        let Some(props) = schema.get("properties").and_then(Value::as_object) else {
            self.any();
            return "\"{\" (KEY \":\" any (\",\" KEY \":\" any)*)? \"}\"".into();
        };
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut keys: Vec<(&String, &Value)> = props.iter().collect();
        keys.sort_by(|a, b| a.0.cmp(b.0));
        if keys.is_empty() {
            return "\"{\" \"}\"".into();
        }
        // tail[i]: a non-empty list of the properties from i on (every required one among them).
        let mut tail: Option<String> = None;
        for (i, (k, v)) in keys.iter().enumerate().rev() {
            let p = format!("{} \":\" {}", Value::from(k.to_string()), self.value(v));
            let later_required = keys[i + 1..]
                .iter()
                .any(|(k, _)| required.contains(&k.as_str()));
            let mut alts = Vec::new();
            match &tail {
                Some(t) if later_required => alts.push(format!("{p} \",\" {t}")),
                Some(t) => alts.push(format!("{p} (\",\" {t})?")),
                None => alts.push(p),
            }
            if let Some(t) = &tail
                && !required.contains(&k.as_str())
            {
                alts.push(t.clone());
            }
            tail = Some(self.rule(&alts.join(" | ")));
        }
        let first = tail.unwrap_or_default();
        if keys.iter().any(|(k, _)| required.contains(&k.as_str())) {
            format!("\"{{\" {first} \"}}\"")
        } else {
            format!("\"{{\" {first}? \"}}\"")
        }
    }
}

/// Where a [`ToJson`] is inside a value.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Frame {
    Object,
    Array,
}

/// Reads a dialect's value text into JSON text as it arrives: bare keys quoted, quoted strings escaped as
/// JSON, `none`/`None`/`True`/`False` as JSON's literals, the rest as it is.
#[derive(Debug)]
pub struct ToJson {
    quote: &'static str,
    stack: Vec<Frame>,
    expect_key: bool,
    in_str: bool,
    word: String,
    /// Text that may be the start of a quote token.
    held: String,
    done: bool,
}

impl ToJson {
    /// A reader of one value whose strings are quoted by `quote`.
    pub fn new(quote: &'static str) -> Self {
        ToJson {
            quote,
            stack: Vec::new(),
            expect_key: false,
            in_str: false,
            word: String::new(),
            held: String::new(),
            done: false,
        }
    }

    /// Reads `text`, writing JSON to `out`; returns where in `text` the value ended, once it has.
    pub fn push(&mut self, text: &str, out: &mut String) -> Option<usize> {
        if self.done {
            return Some(0);
        }
        for (i, c) in text.char_indices() {
            if !self.held.is_empty() || c == '<' {
                self.held.push(c);
                if self.held == self.quote {
                    self.held.clear();
                    self.quote_token(out);
                } else if !self.quote.starts_with(self.held.as_str()) {
                    // Not a quote after all: ordinary text.
                    let held = std::mem::take(&mut self.held);
                    for h in held.chars() {
                        self.char(h, out);
                    }
                }
            } else {
                self.char(c, out);
            }
            if self.done {
                return Some(i + c.len_utf8());
            }
        }
        None
    }

    fn quote_token(&mut self, out: &mut String) {
        if self.in_str {
            out.push('"');
            self.in_str = false;
        } else {
            self.flush(out);
            out.push('"');
            self.in_str = true;
        }
    }

    fn char(&mut self, c: char, out: &mut String) {
        if self.in_str {
            crate::stream::escape_into(c, out);
            return;
        }
        match c {
            '{' | '[' => {
                self.flush(out);
                out.push(c);
                self.stack.push(if c == '{' {
                    Frame::Object
                } else {
                    Frame::Array
                });
                self.expect_key = c == '{';
            }
            '}' | ']' => {
                self.flush(out);
                out.push(c);
                self.stack.pop();
                self.expect_key = false;
                self.done = self.stack.is_empty();
            }
            ':' => {
                if !self.word.is_empty() {
                    out.push_str(&Value::from(std::mem::take(&mut self.word)).to_string());
                }
                out.push(':');
                self.expect_key = false;
            }
            ',' => {
                self.flush(out);
                out.push(',');
                self.expect_key = self.stack.last() == Some(&Frame::Object);
            }
            c if c.is_whitespace() => {}
            c => self.word.push(c),
        }
    }

    /// Ends a bare word: a value's literal (a key waits for its `:`).
    fn flush(&mut self, out: &mut String) {
        if self.word.is_empty() || self.expect_key {
            return;
        }
        let w = std::mem::take(&mut self.word);
        out.push_str(match w.as_str() {
            "True" => "true",
            "False" => "false",
            "none" | "None" => "null",
            other => other,
        });
    }
}

/// Where a [`GemmaStreamer`] is.
#[derive(Debug)]
enum At {
    /// Outside a call.
    Outside,
    /// After the opening token, reading `call:NAME` up to the arguments' `{`.
    Head,
    /// In the arguments.
    Args(ToJson),
}

/// The streaming lexer of a Gemma dialect: each call fed to a JSON call streamer as `{"name": NAME,
/// "arguments": ...}` through [`ToJson`].
#[derive(Debug)]
pub struct GemmaStreamer {
    dialect: Dialect,
    at: At,
    held: String,
    calls: CallStreamer,
}

impl GemmaStreamer {
    /// A lexer of `dialect` at the start of the output.
    pub fn new(dialect: Dialect) -> Self {
        GemmaStreamer {
            dialect,
            at: At::Outside,
            held: String::new(),
            calls: CallStreamer::bare(),
        }
    }

    /// Feeds generated text; `out` gets the deltas it completes.
    pub fn push(&mut self, text: &str, out: &mut dyn FnMut(CallDelta)) {
        self.held.push_str(text);
        loop {
            match &mut self.at {
                At::Outside => match self.held.find(self.dialect.open) {
                    Some(i) => {
                        self.held.drain(..i + self.dialect.open.len());
                        self.at = At::Head;
                    }
                    None => {
                        let keep = tag_prefix_len(&self.held, self.dialect.open);
                        self.held.drain(..self.held.len() - keep);
                        return;
                    }
                },
                At::Head => {
                    let Some(b) = self.held.find('{') else { return };
                    let head = &self.held[..b];
                    let name = head.strip_prefix(CALL).unwrap_or(head).trim();
                    let open = format!("{{\"name\":{},\"arguments\":", Value::from(name));
                    self.calls.push(&open, out);
                    self.held.drain(..b);
                    self.at = At::Args(ToJson::new(self.dialect.quote));
                }
                At::Args(t) => {
                    let mut json = String::new();
                    let end = t.push(&self.held, &mut json);
                    self.calls.push(&json, out);
                    match end {
                        Some(e) => {
                            self.calls.push("}", out);
                            self.held.drain(..e);
                            self.at = At::Outside;
                        }
                        None => {
                            self.held.clear();
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Calls begun so far.
    pub fn begun(&self) -> usize {
        self.calls.begun()
    }
}
