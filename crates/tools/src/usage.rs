//! How a tool is meant to be used, beyond its schema: example calls and how a result reads as an answer.
//!
//! A small model given only a JSON schema guesses at arguments and then misreports what the tool returned
//! (SmolLM2-135M said "17 * 3 = 45.0" after the calculator returned 51). A tool's author knows better, so a
//! plugin manifest may carry, per function:
//! * [`Example`]s: requests a user might make and the arguments they map to. The agent shows them to the
//!   model as earlier turns of the conversation (a few-shot prompt), and the router reads their wording.
//!   Each is checked against the function's schema when the manifest is read.
//! * an [`AnswerTemplate`]: a Jinja template over `arguments` and `result` that states the result in
//!   words. When the agent routed the call, the rendered template is the answer, so a number the tool
//!   computed reaches the user exactly as computed.
//!
//! * `from_request`: string parameters whose value the request spells out (a key, a file name, a search
//!   term). When the agent routed the call, [`quote_from_request`] narrows each to the request's own
//!   word spans ([`request_spans`]) for decoding, so a small model copies `locker` from "under the key
//!   locker" instead of a value from an example.
//!
//! Templates are the plugin author's, and rendering is bounded: a fuel budget limits the work, the output
//! is capped at [`ANSWER_BYTES`], and a template that fails to render is reported (the model then answers).

use minijinja::{Environment, UndefinedBehavior, Value as Jinja};
use serde_json::Value;
use thiserror::Error;

/// Most bytes of a rendered answer; a longer one is cut at a character boundary and marked.
pub const ANSWER_BYTES: usize = 16 << 10;

/// Fuel for one rendering (minijinja counts roughly one unit per instruction).
const ANSWER_FUEL: u64 = 100_000;

/// Most words in one span of [`request_spans`].
pub const SPAN_WORDS: usize = 8;
/// Most spans offered for one value (the grammar's enum).
pub const MAX_SPANS: usize = 512;
/// Longest span, in bytes: a value a request spells out is short, and the enum must stay far below the
/// schema limits ([`crate::schema_limits`]) whatever the request holds.
pub const SPAN_BYTES: usize = 64;

/// The contiguous word spans of `text` (at most [`SPAN_WORDS`] words and [`SPAN_BYTES`] bytes, at most
/// [`MAX_SPANS`], first occurrence first): words split at white space, each with surrounding quotes and punctuation taken off
/// (`"hunter2".` -> `hunter2`, `README.txt` stays), joined by one space.
pub fn request_spans(text: &str) -> Vec<String> {
    const EDGE: &[char] = &[
        '"', '\'', '`', '“', '”', '‘', '’', '.', ',', '!', '?', ';', ':', '(', ')', '[', ']', '{',
        '}',
    ];
    let words: Vec<&str> = text
        .split_whitespace()
        .map(|w| w.trim_matches(EDGE))
        .filter(|w| !w.is_empty())
        .collect();
    let mut out: Vec<String> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for n in 1..=SPAN_WORDS.min(words.len()) {
        for w in words.windows(n) {
            let span = w.join(" ");
            if span.len() > SPAN_BYTES {
                continue;
            }
            if seen.insert(span.clone()) {
                out.push(span);
                if out.len() == MAX_SPANS {
                    return out;
                }
            }
        }
    }
    out
}

/// `parameters` with each property named in `props` narrowed to `spans` (those its own `minLength` and
/// `maxLength` admit, plus its `default`): an `enum` the decoding grammar enforces. A property that is
/// not a plain string (it has an `enum`, `const`, `pattern` or `format`, or another type) is left alone,
/// and so is one no span fits.
pub fn quote_from_request(parameters: &Value, props: &[String], spans: &[String]) -> Value {
    let mut out = parameters.clone();
    let Some(properties) = out.get_mut("properties").and_then(Value::as_object_mut) else {
        return out;
    };
    for name in props {
        let Some(p) = properties.get_mut(name).and_then(Value::as_object_mut) else {
            continue;
        };
        if p.get("type").and_then(Value::as_str) != Some("string")
            || ["enum", "const", "pattern", "format"]
                .iter()
                .any(|k| p.contains_key(*k))
        {
            continue;
        }
        let min = p.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
        let max = p
            .get("maxLength")
            .and_then(Value::as_u64)
            .unwrap_or(u64::MAX) as usize;
        let mut values: Vec<Value> = Vec::new();
        if let Some(d @ Value::String(_)) = p.get("default") {
            values.push(d.clone());
        }
        values.extend(
            spans
                .iter()
                .filter(|s| (min..=max).contains(&s.chars().count()))
                .filter(|s| p.get("default").and_then(Value::as_str) != Some(s.as_str()))
                .map(|s| Value::String(s.clone())),
        );
        if !values.is_empty() {
            p.insert("enum".into(), Value::Array(values));
        }
    }
    out
}

/// One example of a function's use.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// What a user might ask.
    pub request: String,
    /// The arguments that request maps to.
    pub arguments: Value,
}

/// A template that does not compile or render.
#[derive(Debug, Error)]
pub enum AnswerError {
    /// The source does not parse.
    #[error("answer template does not compile: {0:#}")]
    Compile(minijinja::Error),
    /// Rendering failed (or ran out of fuel).
    #[error("answer template failed to render: {0:#}")]
    Render(minijinja::Error),
}

/// A compiled answer template: `{{ arguments.expression }} = {{ result.value | num }}`.
///
/// The context has `arguments` (the call's) and `result` (what the function returned). Missing fields are
/// empty rather than errors, so `{% if result %}` handles a `null` result. Besides minijinja's builtins,
/// the filter `num` prints a number plainly: integers without a fraction, others to at most six decimals.
pub struct AnswerTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for AnswerTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AnswerTemplate").field(&self.source).finish()
    }
}

impl Clone for AnswerTemplate {
    fn clone(&self) -> Self {
        Self::new(&self.source).expect("a compiled template compiles again")
    }
}

impl AnswerTemplate {
    /// Compiles `source`.
    pub fn new(source: &str) -> Result<Self, AnswerError> {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Chainable);
        env.set_fuel(Some(ANSWER_FUEL));
        env.set_recursion_limit(32);
        env.add_filter("num", num);
        env.add_template_owned("answer", source.to_owned())
            .map_err(AnswerError::Compile)?;
        Ok(AnswerTemplate {
            env,
            source: source.to_owned(),
        })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The answer for a call with `arguments` that returned `result`, trimmed and capped at
    /// [`ANSWER_BYTES`].
    pub fn render(&self, arguments: &Value, result: &Value) -> Result<String, AnswerError> {
        let t = self
            .env
            .get_template("answer")
            .map_err(AnswerError::Render)?;
        let ctx = minijinja::context! {
            arguments => Jinja::from_serialize(arguments),
            result => Jinja::from_serialize(result),
        };
        let text = t.render(ctx).map_err(AnswerError::Render)?;
        Ok(cap(text.trim()))
    }
}

/// `text` cut to [`ANSWER_BYTES`] at a character boundary, with a mark when cut.
fn cap(text: &str) -> String {
    if text.len() <= ANSWER_BYTES {
        return text.to_owned();
    }
    let mut end = ANSWER_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} …", &text[..end])
}

/// The `num` filter: `51.0` -> `51`, `6.2137119` -> `6.213712`, `1e-9` -> `0.000000001`; anything that is
/// not a number is printed as it is.
fn num(v: Jinja) -> String {
    match f64::try_from(v.clone()) {
        Ok(x) => plain_number(x),
        Err(_) => v.to_string(),
    }
}

/// A number as a person writes it (see [`num`]).
pub fn plain_number(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    if x.fract() == 0.0 && x.abs() < 1e15 {
        return format!("{x:.0}");
    }
    // Six decimals, or as many significant digits as a small number needs.
    let digits = if x.abs() >= 1e-6 {
        6
    } else {
        (-x.abs().log10().floor()) as usize + 6
    };
    let s = format!("{x:.digits$}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn spans_are_the_requests_words() {
        let s = request_spans("Save key \"wifi\", value hunter2. Read README.txt!");
        for want in [
            "wifi",
            "hunter2",
            "README.txt",
            "Save key",
            "value hunter2 Read",
        ] {
            assert!(s.iter().any(|x| x == want), "{want:?} in {s:?}");
        }
        assert!(!s.iter().any(|x| x.contains('"') || x.ends_with('.')));
        assert!(request_spans("").is_empty());
        let long = "w ".repeat(2000);
        assert_eq!(request_spans(&long).len(), SPAN_WORDS, "repeats count once");
        let many: String = (0..2000).map(|i| format!("w{i} ")).collect();
        assert_eq!(request_spans(&many).len(), MAX_SPANS);
        // However long the request, the spans fit a schema's enum.
        let huge = format!("{} key {}", "x".repeat(100_000), "y".repeat(70));
        assert_eq!(request_spans(&huge), ["key"]);
        let spans = request_spans(&"abcdefgh ".repeat(5000));
        let params = json!({"type": "object", "properties": {"k": {"type": "string"}}});
        let q = quote_from_request(&params, &["k".to_owned()], &spans);
        assert!(crate::check_schema_size(&q).is_ok());
    }

    #[test]
    fn only_plain_strings_are_quoted_from_the_request() {
        let params = json!({"type": "object", "properties": {
            "key": {"type": "string", "minLength": 2},
            "path": {"type": "string", "default": "."},
            "expr": {"type": "string", "pattern": "^[0-9]+$"},
            "n": {"type": "integer"}}});
        let spans: Vec<String> = ["a", "locker", "the key"].map(String::from).to_vec();
        let props: Vec<String> = ["key", "path", "expr", "n", "absent"]
            .map(String::from)
            .to_vec();
        let q = quote_from_request(&params, &props, &spans);
        assert_eq!(q["properties"]["key"]["enum"], json!(["locker", "the key"]));
        assert_eq!(
            q["properties"]["path"]["enum"],
            json!([".", "a", "locker", "the key"])
        );
        assert_eq!(q["properties"]["expr"], params["properties"]["expr"]);
        assert_eq!(q["properties"]["n"], params["properties"]["n"]);
    }

    #[test]
    fn numbers_print_plainly() {
        assert_eq!(plain_number(51.0), "51");
        assert_eq!(plain_number(-3.0), "-3");
        assert_eq!(plain_number(6.213_711_922), "6.213712");
        assert_eq!(plain_number(0.5), "0.5");
        assert_eq!(plain_number(1e20), "100000000000000000000");
        assert_eq!(plain_number(1.5e-9), "0.0000000015");
        assert_eq!(plain_number(-1e-12), "-0.000000000001");
        assert_eq!(plain_number(f64::NAN), "NaN");
    }

    #[test]
    fn a_template_states_the_result() {
        let t =
            AnswerTemplate::new("{{ arguments.expression }} = {{ result.value | num }}").unwrap();
        assert_eq!(
            t.render(&json!({"expression": "17 * 3"}), &json!({"value": 51.0}))
                .unwrap(),
            "17 * 3 = 51"
        );
        // Missing fields are empty, so a template can test for them.
        let t = AnswerTemplate::new(
            "{% if result %}{{ arguments.key }} is {{ result.value }}{% else %}nothing under {{ arguments.key }}{% endif %}",
        )
        .unwrap();
        assert_eq!(
            t.render(&json!({"key": "wifi"}), &Value::Null).unwrap(),
            "nothing under wifi"
        );
        assert_eq!(
            t.render(&json!({"key": "wifi"}), &json!({"value": "x"}))
                .unwrap(),
            "wifi is x"
        );
        let list =
            AnswerTemplate::new("{{ result | map(attribute='name') | join(', ') }}").unwrap();
        assert_eq!(
            list.render(&json!({}), &json!([{"name": "a"}, {"name": "b"}]))
                .unwrap(),
            "a, b"
        );
    }

    #[test]
    fn rendering_is_bounded() {
        assert!(matches!(
            AnswerTemplate::new("{{ unclosed"),
            Err(AnswerError::Compile(_))
        ));
        // Endless work runs out of fuel.
        let spin = AnswerTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        )
        .unwrap();
        assert!(matches!(
            spin.render(&json!({}), &json!({})),
            Err(AnswerError::Render(_))
        ));
        // A huge result is cut.
        let echo = AnswerTemplate::new("{{ result }}").unwrap();
        let out = echo
            .render(&json!({}), &json!("é".repeat(ANSWER_BYTES)))
            .unwrap();
        assert!(
            out.len() <= ANSWER_BYTES + 4 && out.ends_with(" …"),
            "{}",
            out.len()
        );
        // A rendering error is an error, not a panic.
        let bad = AnswerTemplate::new("{{ result.value + 'x' }}").unwrap();
        assert!(bad.render(&json!({}), &json!({"value": 1})).is_err());
    }
}
