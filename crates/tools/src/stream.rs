//! Tool calls as they are generated: the text from the first `<tool_call>` on, fed piece by piece, turned
//! into the deltas a streaming client renders (OpenAI's `tool_calls` deltas, Anthropic's `input_json_delta`).
//!
//! A call starts ([`CallDelta::Begin`]) once its `"name"` string is complete; its arguments then arrive as
//! fragments of **the compact JSON text that `serde_json::Value::to_string` gives for the parsed
//! arguments** ([`CallDelta::Arguments`]), so the fragments concatenate to exactly the `arguments` of the
//! non-streamed reply, whatever whitespace or escapes the model wrote: the value is re-serialized as it is
//! lexed (whitespace dropped, each decoded string character escaped as serde_json escapes it, each number
//! or literal re-printed through serde_json once it ends). A fragment ends with every key, string, number
//! or literal and with every piece of text fed, so a call arrives in several deltas even when speculation
//! or a forced run commits all of it in one step, and a long string streams as it is generated.
//!
//! The streamer accepts the forms [`crate::parse_tool_calls`] accepts: `"parameters"` for `"arguments"`,
//! arguments given as a JSON string holding the object (sent whole when that string ends), arguments before
//! the name (held until the name is known), no arguments (`{}`). It never fails: text that is not a call
//! yields no deltas, and the agent compares what was streamed with the validated reply, so a mismatch is
//! reported instead of silently sent. The streamer allocates only for the name and the pieces it emits.

/// What a streamed call brings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallDelta {
    /// Call `index` (0 for the first call in the text) starts: its name is complete.
    Begin {
        /// Its place among the text's calls.
        index: usize,
        /// The tool's name.
        name: String,
    },
    /// More of call `index`'s arguments (compact JSON text).
    Arguments {
        /// Its place among the text's calls.
        index: usize,
        /// The fragment.
        text: String,
    },
    /// Call `index`'s JSON object closed: its arguments are complete.
    End {
        /// Its place among the text's calls.
        index: usize,
    },
}

/// A lexed JSON piece, as the call structure sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Tok {
    Open(char),
    Close(char),
    Colon,
    Comma,
    StrStart,
    StrChar(char),
    StrEnd,
    /// A number or literal ended; its text is in `Lexer::scalar`.
    Scalar,
}

/// String escapes being read.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
enum Esc {
    #[default]
    None,
    Backslash,
    /// `\u` and `n` hex digits read, their value so far.
    Unicode(u8, u32),
}

/// An incremental JSON lexer (no validation of structure: the call reader follows it).
#[derive(Debug, Default)]
struct Lexer {
    in_str: bool,
    esc: Esc,
    /// A high surrogate waiting for its low half.
    high: Option<u32>,
    scalar: String,
}

impl Lexer {
    /// Feeds one character; `emit` gets the pieces it completes (a scalar ends at the next delimiter, which
    /// is then lexed too).
    fn push(&mut self, c: char, emit: &mut impl FnMut(Tok, &str)) {
        if self.in_str {
            self.push_str_char(c, emit);
            return;
        }
        let delimiter = matches!(c, '{' | '}' | '[' | ']' | ':' | ',' | '"') || c.is_whitespace();
        if !delimiter {
            self.scalar.push(c);
            return;
        }
        if !self.scalar.is_empty() {
            emit(Tok::Scalar, &self.scalar);
            self.scalar.clear();
        }
        match c {
            '{' | '[' => emit(Tok::Open(c), ""),
            '}' | ']' => emit(Tok::Close(c), ""),
            ':' => emit(Tok::Colon, ""),
            ',' => emit(Tok::Comma, ""),
            '"' => {
                self.in_str = true;
                self.esc = Esc::None;
                emit(Tok::StrStart, "");
            }
            _ => {}
        }
    }

    fn push_str_char(&mut self, c: char, emit: &mut impl FnMut(Tok, &str)) {
        match self.esc {
            Esc::None => match c {
                '"' => {
                    if self.high.take().is_some() {
                        emit(Tok::StrChar(char::REPLACEMENT_CHARACTER), "");
                    }
                    self.in_str = false;
                    emit(Tok::StrEnd, "");
                }
                '\\' => self.esc = Esc::Backslash,
                _ => self.decoded(c as u32, emit),
            },
            Esc::Backslash => {
                self.esc = Esc::None;
                let ch = match c {
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'n' => '\n',
                    'r' => '\r',
                    't' => '\t',
                    'u' => {
                        self.esc = Esc::Unicode(0, 0);
                        return;
                    }
                    other => other,
                };
                self.decoded(ch as u32, emit);
            }
            Esc::Unicode(n, v) => {
                let v = (v << 4) | c.to_digit(16).unwrap_or(0);
                if n == 3 {
                    self.esc = Esc::None;
                    self.decoded(v, emit);
                } else {
                    self.esc = Esc::Unicode(n + 1, v);
                }
            }
        }
    }

    /// One decoded string character (a UTF-16 half when it came from a `\u` escape). Surrogate pairs
    /// written as two escapes join; a lone half becomes U+FFFD (serde_json rejects it, so the reply's
    /// parse fails and the mismatch is reported).
    fn decoded(&mut self, ch: u32, emit: &mut impl FnMut(Tok, &str)) {
        if (0xD800..0xDC00).contains(&ch) {
            if self.high.replace(ch).is_some() {
                emit(Tok::StrChar(char::REPLACEMENT_CHARACTER), "");
            }
            return;
        }
        let ch = match self.high.take() {
            Some(h) if (0xDC00..0xE000).contains(&ch) => {
                0x10000 + ((h - 0xD800) << 10) + (ch - 0xDC00)
            }
            Some(_) => {
                emit(Tok::StrChar(char::REPLACEMENT_CHARACTER), "");
                ch
            }
            None => ch,
        };
        emit(
            Tok::StrChar(char::from_u32(ch).unwrap_or(char::REPLACEMENT_CHARACTER)),
            "",
        );
    }
}

/// Appends `c` as serde_json writes it inside a string.
pub(crate) fn escape_into(c: char, out: &mut String) {
    match c {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        '\u{8}' => out.push_str("\\b"),
        '\u{c}' => out.push_str("\\f"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if (c as u32) < 0x20 => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(HEX[(c as usize) >> 4] as char);
            out.push(HEX[(c as usize) & 0xf] as char);
        }
        c => out.push(c),
    }
}

/// What the value after a key of the call object is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Field {
    Name,
    Arguments,
    Other,
}

/// Where the reader is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum At {
    /// Between calls: `matched` bytes of the opening tag seen.
    Outside { matched: usize },
    /// Inside a call (the lexer drives).
    Call,
}

/// Turns the text of tool calls into [`CallDelta`]s as it arrives.
#[derive(Debug)]
pub struct CallStreamer {
    at: At,
    lex: Lexer,
    /// Nesting inside the call (1: the call object itself).
    depth: usize,
    /// The next string at depth 1 is a key.
    want_key: bool,
    key: String,
    field: Option<Field>,
    /// Depth at which the arguments value started (it ends when a close brings depth back to it).
    args_from: Option<usize>,
    /// Arguments given as a JSON string: its decoded text.
    args_string: Option<String>,
    args_seen: bool,
    name: Option<String>,
    name_buf: String,
    reading_name: bool,
    /// Arguments text not yet sent (before the name is known, or gathered within one push).
    pending: String,
    begun: bool,
    index: usize,
    /// Calls are bare JSON objects (Llama 3's `{"name": ..., "parameters": ...}`): an object opened
    /// between calls starts one, no tag around it.
    bare: bool,
}

impl Default for CallStreamer {
    fn default() -> Self {
        CallStreamer {
            at: At::Outside { matched: 0 },
            lex: Lexer::default(),
            depth: 0,
            want_key: false,
            key: String::new(),
            field: None,
            args_from: None,
            args_string: None,
            args_seen: false,
            name: None,
            name_buf: String::new(),
            reading_name: false,
            pending: String::new(),
            begun: false,
            index: 0,
            bare: false,
        }
    }
}

impl CallStreamer {
    /// Feeds generated text (from the first opening tag on, or any part of what follows it); `out` gets
    /// the deltas it completes (an arguments fragment at each key, string, number or literal, and at the
    /// end of the text).
    pub fn push(&mut self, text: &str, out: &mut dyn FnMut(CallDelta)) {
        for c in text.chars() {
            if self.bare && c == '{' && matches!(self.at, At::Outside { .. }) {
                self.start_call();
            }
            match self.at {
                At::Outside { .. } if self.bare => {}
                At::Outside { matched } => {
                    let open = crate::OPEN.as_bytes();
                    let matched = if open[matched] as char == c {
                        matched + 1
                    } else if open[0] as char == c {
                        1
                    } else {
                        0
                    };
                    if matched == open.len() {
                        self.start_call();
                    } else {
                        self.at = At::Outside { matched };
                    }
                }
                At::Call => {
                    let mut lex = std::mem::take(&mut self.lex);
                    lex.push(c, &mut |t, scalar| self.on(t, scalar, out));
                    self.lex = lex;
                }
            }
        }
        self.flush(out);
    }

    /// Calls begun so far.
    pub fn begun(&self) -> usize {
        self.index + usize::from(self.begun)
    }

    /// A streamer of bare JSON calls (Llama 3's): each object written between calls is one, with no tag
    /// around it.
    pub fn bare() -> Self {
        CallStreamer {
            bare: true,
            ..CallStreamer::default()
        }
    }

    fn start_call(&mut self) {
        let (index, bare) = (self.index, self.bare);
        *self = CallStreamer {
            at: At::Call,
            index,
            bare,
            ..CallStreamer::default()
        };
    }

    fn flush(&mut self, out: &mut dyn FnMut(CallDelta)) {
        if self.begun && !self.pending.is_empty() {
            out(CallDelta::Arguments {
                index: self.index,
                text: std::mem::take(&mut self.pending),
            });
        }
    }

    fn on(&mut self, t: Tok, scalar: &str, out: &mut dyn FnMut(CallDelta)) {
        if self.args_from.is_some() {
            self.on_arguments(t, scalar, out);
            return;
        }
        if let Some(s) = &mut self.args_string {
            match t {
                Tok::StrChar(c) => s.push(c),
                Tok::StrEnd => {
                    let text = std::mem::take(s);
                    self.args_string = None;
                    // The reply parses the string as JSON; stream what that parse serializes to.
                    let v = serde_json::from_str::<serde_json::Value>(&text)
                        .map(|v| v.to_string())
                        .unwrap_or(text);
                    self.pending.push_str(&v);
                    self.after_value();
                }
                _ => {}
            }
            return;
        }
        if self.reading_name {
            match t {
                Tok::StrChar(c) => self.name_buf.push(c),
                Tok::StrEnd => {
                    self.reading_name = false;
                    if self.name.is_none() {
                        let name = std::mem::take(&mut self.name_buf);
                        self.name = Some(name.clone());
                        self.begun = true;
                        out(CallDelta::Begin {
                            index: self.index,
                            name,
                        });
                        self.flush(out);
                    }
                    self.after_value();
                }
                _ => {}
            }
            return;
        }
        match t {
            Tok::Open(c) => {
                self.depth += 1;
                if self.depth == 1 && c == '{' {
                    self.want_key = true;
                } else if self.depth == 2 && self.field == Some(Field::Arguments) {
                    self.args_from = Some(1);
                    self.args_seen = true;
                    self.pending.push(c);
                }
            }
            Tok::Close(_) => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 1 {
                    self.after_value();
                } else if self.depth == 0 {
                    self.end_call(out);
                }
            }
            Tok::Colon => {}
            Tok::Comma => {
                if self.depth == 1 {
                    self.want_key = true;
                    self.field = None;
                }
            }
            Tok::StrStart => {
                if self.depth != 1 {
                } else if self.want_key {
                    self.key.clear();
                } else {
                    match self.field {
                        Some(Field::Name) => {
                            self.reading_name = true;
                            self.name_buf.clear();
                        }
                        Some(Field::Arguments) => {
                            self.args_seen = true;
                            self.args_string = Some(String::new());
                        }
                        _ => {}
                    }
                }
            }
            Tok::StrChar(c) => {
                if self.depth == 1 && self.want_key {
                    self.key.push(c);
                }
            }
            Tok::StrEnd => {
                if self.depth == 1 && self.want_key {
                    self.want_key = false;
                    self.field = Some(match self.key.as_str() {
                        "name" => Field::Name,
                        "arguments" | "parameters" if !self.args_seen => Field::Arguments,
                        _ => Field::Other,
                    });
                } else if self.depth == 1 {
                    self.after_value();
                }
            }
            Tok::Scalar => {
                if self.depth == 1 {
                    self.after_value();
                }
            }
        }
    }

    /// A value at depth 1 ended.
    fn after_value(&mut self) {
        self.field = None;
    }

    fn on_arguments(&mut self, t: Tok, scalar: &str, out: &mut dyn FnMut(CallDelta)) {
        let p = &mut self.pending;
        match t {
            Tok::Open(c) => {
                self.depth += 1;
                p.push(c);
            }
            Tok::Close(c) => {
                self.depth = self.depth.saturating_sub(1);
                p.push(c);
                if Some(self.depth) == self.args_from {
                    self.args_from = None;
                    self.after_value();
                    self.flush(out);
                }
            }
            Tok::Colon => p.push(':'),
            Tok::Comma => p.push(','),
            Tok::StrStart => p.push('"'),
            Tok::StrEnd => {
                p.push('"');
                self.flush(out);
            }
            Tok::StrChar(c) => escape_into(c, p),
            Tok::Scalar => {
                match serde_json::from_str::<serde_json::Value>(scalar) {
                    Ok(v) => p.push_str(&v.to_string()),
                    Err(_) => p.push_str(scalar),
                }
                self.flush(out);
            }
        }
    }

    fn end_call(&mut self, out: &mut dyn FnMut(CallDelta)) {
        if self.begun {
            if !self.args_seen {
                self.pending.push_str("{}");
            }
            self.flush(out);
            out(CallDelta::End { index: self.index });
            self.index += 1;
        }
        let (index, bare) = (self.index, self.bare);
        *self = CallStreamer {
            index,
            bare,
            ..CallStreamer::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// Streams `pieces`, returning (name, reassembled arguments, fragments, ended) per call.
    fn stream(pieces: &[&str]) -> Vec<(String, String, usize, bool)> {
        let mut s = CallStreamer::default();
        let mut calls: Vec<(String, String, usize, bool)> = Vec::new();
        for p in pieces {
            s.push(p, &mut |d| match d {
                CallDelta::Begin { index, name } => {
                    assert_eq!(index, calls.len());
                    calls.push((name, String::new(), 0, false));
                }
                CallDelta::Arguments { index, text } => {
                    assert!(!text.is_empty());
                    let c = &mut calls[index];
                    assert!(!c.3, "arguments after the end");
                    c.1.push_str(&text);
                    c.2 += 1;
                }
                CallDelta::End { index } => calls[index].3 = true,
            });
        }
        calls
    }

    /// Every split of `text` into characters streams to exactly what the reply parser gives.
    fn agrees_with_the_parser(text: &str) {
        let (_, parsed) = crate::parse_tool_calls(text).expect("parses");
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        for got in [stream(&pieces), stream(&[text])] {
            assert_eq!(got.len(), parsed.len(), "{text}");
            for (g, p) in got.iter().zip(&parsed) {
                assert_eq!(g.0, p.name, "{text}");
                assert_eq!(g.1, p.arguments.to_string(), "{text}");
                assert!(g.3, "{text}: ended");
            }
        }
    }

    #[test]
    fn deltas_reassemble_to_the_parsed_call() {
        for text in [
            r#"<tool_call>{"name":"calc","arguments":{"a":1,"b":[2,3.5,-0.25e2],"op":"mul"}}</tool_call>"#,
            "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"q\": \"caf\\u00e9 \\\"x\\\" \\/ \\ud83d\\ude00\\n\"}}\n</tool_call>",
            r#"<tool_call>{"arguments":{"x":true,"y":null,"z":{}},"name":"late"}</tool_call>"#,
            r#"<tool_call>{"name":"p","parameters":{"k":1E3}}</tool_call>"#,
            r#"<tool_call>{"name":"s","arguments":"{\"n\": 5}"}</tool_call>"#,
            r#"<tool_call>{"name":"none"}</tool_call>"#,
            r#"<tool_call>{"name":"a","arguments":{"t":"</tool_call>"}}</tool_call><tool_call>{"name":"b","arguments":{"u":[{"v":"w"}]}}</tool_call>"#,
            "<tool_call>{\"name\":\"ctl\",\"arguments\":{\"c\":\"\\u0001\\t\\b\\f\\r\u{7f}é\"}}",
        ] {
            agrees_with_the_parser(text);
        }
    }

    #[test]
    fn a_string_argument_streams_as_it_is_written() {
        let text = r#"<tool_call>{"name":"write","arguments":{"body":"hello world"}}</tool_call>"#;
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        let got = stream(&pieces);
        assert_eq!(got.len(), 1);
        // `{"body":"` then each of the 11 characters, then `"}`: one fragment per piece that adds text.
        assert!(got[0].2 >= 11, "{got:?}");
        assert_eq!(got[0].1, r#"{"body":"hello world"}"#);
    }

    #[test]
    fn nothing_is_streamed_before_the_name_or_outside_calls() {
        let mut s = CallStreamer::default();
        let mut seen = Vec::new();
        s.push(
            r#"prose <tool_ {"name":"x"} <tool_call>{"arguments":{"a":1"#,
            &mut |d| seen.push(d),
        );
        assert!(seen.is_empty(), "{seen:?}");
        s.push(r#"},"name":"f"}"#, &mut |d| seen.push(d));
        assert_eq!(
            seen,
            vec![
                CallDelta::Begin {
                    index: 0,
                    name: "f".into()
                },
                CallDelta::Arguments {
                    index: 0,
                    text: r#"{"a":1}"#.into()
                },
                CallDelta::End { index: 0 },
            ]
        );
        // A whole call in one piece still arrives in a fragment per key and value.
        let mut s = CallStreamer::default();
        let mut parts = Vec::new();
        s.push(
            r#"<tool_call>{"name":"f","arguments":{"city":"Paris","n":2}}</tool_call>"#,
            &mut |d| {
                if let CallDelta::Arguments { text, .. } = d {
                    parts.push(text)
                }
            },
        );
        assert_eq!(parts, [r#"{"city""#, r#":"Paris""#, r#","n""#, ":2", "}"]);
        assert_eq!(s.begun(), 1);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// JSON values a model could write as arguments.
        fn value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(|n| serde_json::json!(n)),
                (-1e6f64..1e6).prop_map(|f| serde_json::json!(f)),
                "[ -~\\n\\t\u{e9}\u{1F600}\u{1}]{0,12}".prop_map(Value::String),
            ];
            leaf.prop_recursive(3, 24, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    prop::collection::vec(("[a-z_]{1,6}", inner), 0..4)
                        .prop_map(|kv| { Value::Object(kv.into_iter().collect()) }),
                ]
            })
        }

        /// `v` written as a model might: pretty or compact, strings with some characters escaped
        /// (`\uXXXX`, `\/`) that serde_json would write literally.
        fn write(v: &Value, pretty: bool, escape_all: bool) -> String {
            let text = if pretty {
                serde_json::to_string_pretty(v).unwrap()
            } else {
                serde_json::to_string(v).unwrap()
            };
            if !escape_all {
                return text;
            }
            // Re-escape every non-ASCII character and `/` inside strings (outside strings there are none).
            let mut out = String::new();
            for c in text.chars() {
                match c {
                    '/' => out.push_str("\\/"),
                    c if !c.is_ascii() => {
                        let mut buf = [0u16; 2];
                        for u in c.encode_utf16(&mut buf) {
                            out.push_str(&format!("\\u{u:04X}"));
                        }
                    }
                    c => out.push(c),
                }
            }
            out
        }

        proptest! {
            #[test]
            fn any_arguments_in_any_pieces_reassemble_to_the_parse(
                args in prop::collection::vec(("[a-z]{1,5}", value()), 0..5),
                pretty in any::<bool>(),
                escape_all in any::<bool>(),
                cuts in prop::collection::vec(0usize..400, 0..12),
            ) {
                let args = Value::Object(args.into_iter().collect());
                let call = serde_json::json!({"name": "f", "arguments": args});
                let text = format!("<tool_call>{}</tool_call>", write(&call, pretty, escape_all));
                // Split at character boundaries near the cuts.
                let mut at: Vec<usize> = cuts
                    .iter()
                    .map(|&c| text.floor_char_boundary(c.min(text.len())))
                    .collect();
                at.sort_unstable();
                at.dedup();
                let mut pieces = Vec::new();
                let mut from = 0;
                for a in at {
                    pieces.push(&text[from..a]);
                    from = a;
                }
                pieces.push(&text[from..]);
                let got = stream(&pieces);
                let (_, parsed) = crate::parse_tool_calls(&text).unwrap();
                prop_assert_eq!(got.len(), 1);
                prop_assert_eq!(&got[0].0, "f");
                prop_assert_eq!(&got[0].1, &parsed[0].arguments.to_string());
                prop_assert!(got[0].3);
            }
        }
    }

    #[test]
    fn a_truncated_call_streams_what_it_has() {
        let got = stream(&[r#"<tool_call>{"name":"f","arguments":{"a":"lo"#]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1, r#"{"a":"lo"#);
        assert!(!got[0].3);
        let v: Result<Value, _> = serde_json::from_str(&got[0].1);
        assert!(v.is_err());
    }
}
