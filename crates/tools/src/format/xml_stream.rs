//! Qwen3 XML tool calls as they are generated, turned into [`CallDelta`]s whose argument fragments
//! concatenate to exactly the compact JSON of the parsed call's arguments (`{"key":value,...}` in the order
//! written), as the Hermes streamer's do: a string parameter streams its text as it arrives (JSON-escaped,
//! a trailing newline held back until it is known not to be the one before `</parameter>`), any other
//! parameter is sent whole when it ends, as the parser reads it.

use super::qwen_xml::{self, CLOSE, OPEN};
use crate::stream::escape_into;
use crate::{CallDelta, ToolSet};
use serde_json::Value;
use std::collections::HashMap;

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Where the reader is.
#[derive(Debug, Clone, PartialEq)]
enum At {
    /// Between calls.
    Outside,
    /// After `<tool_call>`, before `<function=`.
    Head,
    /// Reading the function's name (up to `>`).
    Name,
    /// Between parameters: a tag is being read.
    Between,
    /// Reading a parameter's key (up to `>`).
    Key,
    /// In a parameter's value; `first`: nothing of it seen yet (its leading newline is dropped).
    Value { first: bool },
    /// After `</function>`.
    Tail,
}

/// Turns the text of Qwen3 XML calls into [`CallDelta`]s as it arrives.
#[derive(Debug)]
pub struct XmlStreamer {
    /// Per tool, which parameters are raw text.
    text_params: HashMap<String, Vec<String>>,
    at: At,
    /// Text read but not yet decided on (a tag being matched, a held-back value tail).
    buf: String,
    name: String,
    key: String,
    /// The current parameter is raw text (streamed), else gathered in `buf` until its end.
    text: bool,
    params: usize,
    pending: String,
    begun: bool,
    index: usize,
}

impl XmlStreamer {
    /// A streamer for calls to `tools`.
    pub fn new(tools: &ToolSet) -> Self {
        let text_params = tools
            .tools()
            .iter()
            .map(|t| {
                let keys = t
                    .parameters
                    .get("properties")
                    .and_then(Value::as_object)
                    .map(|p| {
                        p.iter()
                            .filter(|(_, s)| qwen_xml::is_text(Some(s)))
                            .map(|(k, _)| k.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                (t.name.clone(), keys)
            })
            .collect();
        XmlStreamer {
            text_params,
            at: At::Outside,
            buf: String::new(),
            name: String::new(),
            key: String::new(),
            text: false,
            params: 0,
            pending: String::new(),
            begun: false,
            index: 0,
        }
    }

    /// Calls begun so far.
    pub fn begun(&self) -> usize {
        self.index + usize::from(self.begun)
    }

    /// Feeds generated text; `out` gets the deltas it completes.
    pub fn push(&mut self, text: &str, out: &mut dyn FnMut(CallDelta)) {
        for c in text.chars() {
            self.buf.push(c);
            self.step(out);
        }
        self.flush(out);
    }

    fn flush(&mut self, out: &mut dyn FnMut(CallDelta)) {
        if self.begun && !self.pending.is_empty() {
            out(CallDelta::Arguments {
                index: self.index,
                text: std::mem::take(&mut self.pending),
            });
        }
    }

    /// Acts on `buf` after a character was added.
    fn step(&mut self, out: &mut dyn FnMut(CallDelta)) {
        match self.at.clone() {
            At::Outside => {
                if self.buf.ends_with(OPEN) {
                    self.buf.clear();
                    self.at = At::Head;
                } else if self.buf.len() > OPEN.len() {
                    let cut = self.buf.len() - OPEN.len();
                    let cut = (cut..=self.buf.len())
                        .find(|&i| self.buf.is_char_boundary(i))
                        .unwrap_or(cut);
                    self.buf.drain(..cut);
                }
            }
            At::Head => {
                let t = self.buf.trim_start();
                if t == FUNCTION {
                    self.buf.clear();
                    self.at = At::Name;
                } else if !FUNCTION.starts_with(t) {
                    // Not a call this reader knows: wait for the next one.
                    self.buf.clear();
                    self.at = At::Outside;
                }
            }
            At::Name => {
                if self.buf.ends_with('>') {
                    self.buf.pop();
                    self.name = self.buf.trim().to_owned();
                    self.buf.clear();
                    self.begun = true;
                    self.params = 0;
                    out(CallDelta::Begin {
                        index: self.index,
                        name: self.name.clone(),
                    });
                    self.pending.push('{');
                    self.at = At::Between;
                }
            }
            At::Between => {
                let t = self.buf.trim_start();
                if t == PARAMETER {
                    self.buf.clear();
                    self.at = At::Key;
                } else if t == FUNCTION_END {
                    self.buf.clear();
                    self.pending.push('}');
                    self.flush(out);
                    out(CallDelta::End { index: self.index });
                    self.begun = false;
                    self.index += 1;
                    self.at = At::Tail;
                } else if !PARAMETER.starts_with(t) && !FUNCTION_END.starts_with(t) {
                    self.buf.clear();
                    self.at = At::Outside;
                }
            }
            At::Key => {
                if self.buf.ends_with('>') {
                    self.buf.pop();
                    self.key = self.buf.trim().to_owned();
                    self.buf.clear();
                    if self.params > 0 {
                        self.pending.push(',');
                    }
                    self.params += 1;
                    self.pending
                        .push_str(&Value::String(self.key.clone()).to_string());
                    self.pending.push(':');
                    self.text = self
                        .text_params
                        .get(&self.name)
                        .is_some_and(|k| k.contains(&self.key));
                    if self.text {
                        self.pending.push('"');
                    }
                    self.at = At::Value { first: true };
                }
            }
            At::Value { first } => {
                if first {
                    self.at = At::Value { first: false };
                    if self.buf == "\n" {
                        self.buf.clear();
                        return;
                    }
                }
                if let Some(raw) = self.buf.strip_suffix(PARAMETER_END) {
                    let raw = raw.strip_suffix('\n').unwrap_or(raw).to_owned();
                    self.buf.clear();
                    if self.text {
                        for c in raw.chars() {
                            escape_into(c, &mut self.pending);
                        }
                        self.pending.push('"');
                    } else {
                        // As the parser reads it (a value it cannot read streams as text; the reply's
                        // validation then reports it).
                        let v = qwen_xml::value_of(None, &raw)
                            .unwrap_or_else(|_| Value::String(raw.clone()));
                        self.pending.push_str(&v.to_string());
                    }
                    self.at = At::Between;
                } else if self.text {
                    // Stream what cannot be the start of "\n</parameter>".
                    let keep = held_tail(&self.buf);
                    let cut = self.buf.len() - keep;
                    if cut > 0 {
                        let done: String = self.buf.drain(..cut).collect();
                        for c in done.chars() {
                            escape_into(c, &mut self.pending);
                        }
                    }
                }
            }
            At::Tail => {
                let t = self.buf.trim_start();
                if t == CLOSE || !CLOSE.starts_with(t) {
                    self.buf.clear();
                    self.at = At::Outside;
                }
            }
        }
    }
}

/// How much of the end of a string value must wait: a suffix that may still become `\n</parameter>`.
fn held_tail(s: &str) -> usize {
    let tag = "\n</parameter>";
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..]))
        .or_else(|| {
            // "</parameter>" without the newline before it.
            (1..PARAMETER_END.len().min(s.len() + 1)).rev().find(|&k| {
                s.is_char_boundary(s.len() - k) && PARAMETER_END.starts_with(&s[s.len() - k..])
            })
        })
        .unwrap_or(0)
}
