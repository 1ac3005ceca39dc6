//! Tool schemas as grammars: the tool-call grammar of a tool set, and the [`GuideSpec`] a request's tools,
//! `tool_choice`, `parallel_tool_calls` and `response_format` make.
//!
//! | tools / choice | response_format | grammar | active |
//! |---|---|---|---|
//! | none, or `none` | text | — (no guide) | |
//! | none, or `none` | json_object / json_schema | the answer's schema | from the first token |
//! | `auto` | text | tool-call blocks | at the format's trigger (`<tool_call>`) |
//! | `auto` | json_object / json_schema | answer \| tool-call blocks | from the first token |
//! | `required` | any | tool-call blocks | from the first token |
//! | named function | any | one block for that function | from the first token |
//!
//! The engine knows grammars and guides, not tools: this module turns tools into a Lark grammar, as data
//! (a [`GuideSpec`]); the `thorn-guide` crate compiles it with the engine's grammar factory (cached by its
//! text, so a tool set costs one compile per process) and names the tool whose schema cannot be enforced.

use crate::{ResponseFormat, ToolChoice, ToolError, ToolSet};
use serde_json::{Value, json};

/// The grammar a request's output must follow and when it applies: what [`guide_spec`] makes of a
/// request, for the engine's grammar factory to compile into a guide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuideSpec {
    /// The Lark grammar (llguidance's dialect, with `%json{...}` for embedded schemas).
    pub lark: String,
    /// The text that switches the grammar on once the output contains it (`None`: from the first token).
    pub trigger: Option<&'static str>,
    /// The grammar is the answer itself (`response_format` without tools): the request's stop strings
    /// still apply, and no tool is in it to blame when it does not compile.
    pub answer: bool,
    /// Keep JSON number literals within `f64` range beside the grammar.
    pub json_number_limits: bool,
}

/// The grammar for a request, or `None` when its output is free text. Rejects a `tool_choice` that does
/// not fit the tools.
pub fn guide_spec(
    tools: &ToolSet,
    choice: &ToolChoice,
    parallel: bool,
    format: &ResponseFormat,
) -> Result<Option<GuideSpec>, ToolError> {
    choice.check(tools)?;
    let answer = format.schema().map(|(s, _)| s);
    let use_tools = !tools.is_empty() && *choice != ToolChoice::None;
    if !use_tools {
        return Ok(answer.map(|schema| GuideSpec {
            lark: answer_grammar(&schema),
            trigger: None,
            answer: true,
            json_number_limits: true,
        }));
    }
    let (lark, trigger) = match choice {
        ToolChoice::Function(name) => (calls_grammar(tools, Some(name), false, None), None),
        ToolChoice::Required => (calls_grammar(tools, None, parallel, None), None),
        _ => match &answer {
            Some(schema) => (calls_grammar(tools, None, parallel, Some(schema)), None),
            None => (
                calls_grammar(tools, None, parallel, None),
                Some(tools.format().trigger()),
            ),
        },
    };
    Ok(Some(GuideSpec {
        lark,
        trigger,
        answer: false,
        json_number_limits: true,
    }))
}

/// Marks a control token in a grammar (see [`control`]).
const CONTROL_MARK: char = '\u{1}';

/// A control token in a grammar, by its text (Mistral's `[TOOL_CALLS]`, harmony's `<|call|>`): written
/// between two U+0001 marks, a form no string a grammar quotes can hold (JSON and Lark strings escape
/// control characters), and resolved against the model's vocabulary by [`resolve_controls`].
pub fn control(text: &str) -> String {
    format!("{CONTROL_MARK}{text}{CONTROL_MARK}")
}

/// Marks free text up to a delimiter in a grammar (see [`text_until`]).
const UNTIL_MARK: char = '\u{2}';

/// Free text and then `delimiter` (which ends it: Gemma's closing `<|"|>`, harmony's `<|end|>`),
/// resolved by [`resolve_controls`]: where the delimiter is a control token, any text and then that
/// token; where it is text, one lexeme of any text that does not contain it and then the delimiter (so
/// the lexer never takes the delimiter for more of the text, and the text can always end).
pub fn text_until(delimiter: &str) -> String {
    format!("{UNTIL_MARK}{delimiter}{UNTIL_MARK}")
}

/// The grammar with its [`control`] tokens and [`text_until`]s resolved: a control token becomes
/// `<[ID]>` (that token and no spelling of its text) where `id_of` finds its text as a control token of
/// the model's vocabulary, else the text itself as a literal (a model without the token writes it as
/// text).
pub fn resolve_controls<'a>(
    lark: &'a str,
    id_of: &dyn Fn(&str) -> Option<u32>,
) -> std::borrow::Cow<'a, str> {
    if !lark.contains(CONTROL_MARK) && !lark.contains(UNTIL_MARK) {
        return lark.into();
    }
    let mut terminals: Vec<String> = Vec::new();
    let mut out = String::with_capacity(lark.len());
    let mut parts = lark.split(UNTIL_MARK);
    out.push_str(parts.next().unwrap_or_default());
    while let Some(delim) = parts.next() {
        match id_of(delim) {
            Some(id) => out.push_str(&format!("/(?s:.*)/ <[{id}]>")),
            None => {
                let d = Value::from(delim).to_string();
                let def = format!("(/(?s:.*)/ & ~(/(?s:.*)/ {d} /(?s:.*)/)) {d}");
                let k = match terminals.iter().position(|t| *t == def) {
                    Some(k) => k,
                    None => {
                        terminals.push(def);
                        terminals.len() - 1
                    }
                };
                out.push_str(&format!("TEXT_UNTIL_{k}"));
            }
        }
        out.push_str(parts.next().unwrap_or_default());
    }
    for (k, def) in terminals.iter().enumerate() {
        out.push_str(&format!("\nTEXT_UNTIL_{k}: {def}\n"));
    }
    let lark = out;
    let mut out = String::with_capacity(lark.len());
    let mut parts = lark.split(CONTROL_MARK);
    out.push_str(parts.next().unwrap_or_default());
    while let Some(text) = parts.next() {
        match id_of(text) {
            Some(id) => out.push_str(&format!("<[{id}]>")),
            None => out.push_str(&Value::from(text).to_string()),
        }
        out.push_str(parts.next().unwrap_or_default());
    }
    out.into()
}

/// The Lark grammar of an answer that must be one JSON value matching `schema`, with compact separators.
/// Objects that list their properties admit only those (see [`close_objects`]).
pub fn answer_grammar(schema: &Value) -> String {
    format!("start: %json {}\n", json_body(schema))
}

/// The Lark grammar for tool calls in the tool set's format ([`ToolSet::format`]): one call (or several,
/// with `parallel`) to the tools (or just `only`); with `answer`, a JSON answer matching that schema is the
/// alternative. The grammar of one tool alone (`only`) is what a tool set's failing grammar is searched
/// with for the culprit.
pub fn calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    tools.format().calls_grammar(tools, only, parallel, answer)
}

/// [`calls_grammar`] for Hermes: `<tool_call>...</tool_call>` blocks of one JSON call object each.
pub(crate) fn hermes_calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    parallel: bool,
    answer: Option<&Value>,
) -> String {
    let call = json_body(&call_schema(tools, only));
    let mut g = calls_head(answer, parallel, "");
    g.push_str("block: \"<tool_call>\" call \"</tool_call>\"\n");
    g.push_str(&format!("call: %json {call}\n"));
    g
}

/// The head every format's calls grammar starts with: `start` (the calls, or with `answer` a JSON answer
/// matching that schema as the alternative) and `calls`, one `block`, or with `parallel` several with
/// `separator` between them. The format's grammar then defines `block`.
pub(crate) fn calls_head(answer: Option<&Value>, parallel: bool, separator: &str) -> String {
    let mut g = start_rule(answer);
    match (parallel, separator) {
        (false, _) => g.push_str("calls: block\n"),
        (true, "") => g.push_str("calls: block+\n"),
        (true, sep) => g.push_str(&format!("calls: block ({} block)*\n", Value::from(sep))),
    }
    g
}

/// `start`: the format's `calls`, or with `answer` a JSON answer matching that schema as the alternative.
pub(crate) fn start_rule(answer: Option<&Value>) -> String {
    match answer {
        Some(a) => format!("start: answer | calls\nanswer: %json {}\n", json_body(a)),
        None => "start: calls\n".to_owned(),
    }
}

/// The schema of a call object: `{"name": <const>, "arguments": <that tool's parameters>}`, one branch per tool
/// (or only the tool named `only`).
pub fn call_schema(tools: &ToolSet, only: Option<&str>) -> Value {
    call_schema_keyed(tools, only, "arguments")
}

/// [`call_schema`] with the arguments under `key` (Llama 3 writes them as `"parameters"`).
pub(crate) fn call_schema_keyed(tools: &ToolSet, only: Option<&str>, key: &str) -> Value {
    let branches: Vec<Value> = tools
        .tools()
        .iter()
        .filter(|t| only.is_none_or(|n| n == t.name))
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key],
                "additionalProperties": false
            })
        })
        .collect();
    if branches.len() == 1 {
        branches.into_iter().next().unwrap_or_default()
    } else {
        json!({"anyOf": branches})
    }
}

/// A schema as the text of a Lark `%json` body: closed objects, compact separators.
pub fn json_body(schema: &Value) -> String {
    let mut s = schema.clone();
    close_objects(&mut s);
    // A `Value` always serializes (its keys are strings, its numbers finite): `Display` is the compact form.
    compact(&s).to_string()
}

/// Makes every object schema that lists `properties` (and says nothing about other properties) admit only
/// those: `additionalProperties: false`. The grammar's language stays a subset of the schema's, so every
/// constrained output still validates against the original schema, but the model can no longer invent keys
/// (and more of each call is forced). Branches of `allOf` are left alone (closing them would make their
/// intersection reject every property).
pub fn close_objects(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    if obj.contains_key("properties")
        && !obj.contains_key("additionalProperties")
        && !obj.contains_key("patternProperties")
        && !obj.contains_key("unevaluatedProperties")
    {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, v) in obj.iter_mut() {
        match key.as_str() {
            "properties" | "$defs" | "definitions" | "patternProperties" => {
                if let Some(m) = v.as_object_mut() {
                    m.values_mut().for_each(close_objects);
                }
            }
            "items" | "additionalProperties" | "not" | "if" | "then" | "else" | "contains" => {
                close_objects(v)
            }
            "anyOf" | "oneOf" | "prefixItems" => {
                if let Some(a) = v.as_array_mut() {
                    a.iter_mut().for_each(close_objects);
                }
            }
            "allOf" => {
                // Close what is inside the branches, not the branches themselves.
                if let Some(a) = v.as_array_mut() {
                    for b in a.iter_mut().filter_map(Value::as_object_mut) {
                        for (k, inner) in b.iter_mut() {
                            if k == "properties" {
                                if let Some(m) = inner.as_object_mut() {
                                    m.values_mut().for_each(close_objects);
                                }
                            } else if k == "items" {
                                close_objects(inner);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// Adds llguidance's compact-JSON options (no free whitespace, `,` and `:` separators): most of a call's
/// structure then has exactly one spelling, so the grammar can force it.
fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Some(obj) = s.as_object_mut() {
        obj.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"}),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_objects_closes_listed_properties_only() {
        let mut s = json!({"type": "object", "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
            "c": {"type": "object"},
            "d": {"type": "object", "properties": {"z": {}}, "additionalProperties": {"type": "string"}},
            "e": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]}
        }});
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["a"]["additionalProperties"], json!(false));
        assert_eq!(
            s["properties"]["b"]["items"]["additionalProperties"],
            json!(false)
        );
        assert!(
            s["properties"]["c"].get("additionalProperties").is_none(),
            "no list: open"
        );
        assert_eq!(
            s["properties"]["d"]["additionalProperties"],
            json!({"type": "string"})
        );
        assert!(
            s["properties"]["e"]["allOf"][0]
                .get("additionalProperties")
                .is_none()
        );
    }
}
