//! The Berkeley Function Calling Leaderboard (BFCL v4) questions as thorn requests.
//!
//! A BFCL file is JSON Lines: each record has an `id`, a `question` (one turn of chat messages) and a list of
//! `function` documents written in the Gorilla type vocabulary (`dict`, `float`, `tuple`, `any`, Java and
//! JavaScript names). [`load`] reads a file and [`to_tool`] turns each document into an OpenAI `tools` entry
//! the way the upstream and MLPerf harnesses do: types mapped to JSON Schema (`float` → `number`, `dict` →
//! `object`, `tuple` → `array`, `any` → `string`, unknown → `string`), `parameters.type` forced to `object`,
//! dots in names replaced by underscores, and " This is a float type value." appended to float descriptions.
//! Field names and rules follow the upstream `bfcl_eval` package (`thorn data pull bfcl` fetches its data).

pub mod check;
pub mod run;

pub use check::{Answer, Category, Verdict, check, load_answers};

use serde_json::{Value, json};
use std::path::Path;
use thiserror::Error;
use thorn_tools::chat::{Message, Role};

/// A file that cannot be read as BFCL questions.
#[derive(Debug, Error)]
pub enum BfclError {
    /// Reading the file.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A line that is not a question record.
    #[error("{path}:{line}: {msg}")]
    Record {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        msg: String,
    },
}

/// One BFCL question.
#[derive(Debug, Clone)]
pub struct Question {
    /// Record id (`simple_python_0`).
    pub id: String,
    /// The chat messages of its single turn.
    pub messages: Vec<Message>,
    /// Its functions as OpenAI `tools` entries.
    pub tools: Vec<Value>,
    /// The function documents as written (the checker's reference for types and required parameters).
    pub functions: Vec<Value>,
}

/// The records of a JSON Lines file, each with a constructor for an error at its line.
pub(crate) fn records(
    path: &Path,
) -> Result<Vec<(Value, impl Fn(String) -> BfclError + use<>)>, BfclError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| BfclError::Io {
        path: p.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let (path, line_no) = (p.clone(), i + 1);
        let bad = move |msg: String| BfclError::Record {
            path: path.clone(),
            line: line_no,
            msg,
        };
        let rec: Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        out.push((rec, bad));
    }
    Ok(out)
}

/// Reads every question of a BFCL JSON Lines file.
pub fn load(path: &Path) -> Result<Vec<Question>, BfclError> {
    let mut out = Vec::new();
    for (rec, bad) in records(path)? {
        let id = rec["id"]
            .as_str()
            .ok_or_else(|| bad("no string \"id\"".into()))?
            .to_owned();
        let turn = rec["question"]
            .get(0)
            .and_then(Value::as_array)
            .ok_or_else(|| bad("\"question\" is not a list of turns".into()))?;
        let mut messages = Vec::with_capacity(turn.len());
        for m in turn {
            let role = match m["role"].as_str() {
                Some("system") => Role::System,
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                Some("tool") => Role::Tool,
                other => return Err(bad(format!("unknown role {other:?}"))),
            };
            messages.push(Message::new(role, m["content"].as_str().unwrap_or("")));
        }
        let functions: Vec<Value> = rec["function"].as_array().cloned().unwrap_or_default();
        let tools = functions.iter().map(to_tool).collect();
        out.push(Question {
            id,
            messages,
            tools,
            functions,
        });
    }
    Ok(out)
}

/// A BFCL function document as an OpenAI `tools` entry.
pub fn to_tool(doc: &Value) -> Value {
    let name = doc["name"].as_str().unwrap_or("").replace('.', "_");
    let mut params = map_schema(doc.get("parameters").unwrap_or(&json!({})));
    if let Some(o) = params.as_object_mut() {
        o.insert("type".into(), json!("object"));
    }
    json!({"type": "function", "function": {
        "name": name,
        "description": doc["description"].as_str().unwrap_or(""),
        "parameters": params,
    }})
}

/// JSON Schema for a Gorilla type name.
fn json_type(t: &str) -> &'static str {
    match t {
        "string" | "String" | "any" | "char" => "string",
        "integer" | "int" | "long" | "short" | "byte" | "Bigint" => "integer",
        "float" | "double" | "number" => "number",
        "boolean" | "bool" | "Boolean" => "boolean",
        "array" | "tuple" | "list" | "Array" | "ArrayList" | "Queue" | "Stack" => "array",
        "dict" | "object" | "HashMap" | "Hashtable" => "object",
        _ => "string",
    }
}

fn map_schema(s: &Value) -> Value {
    let Some(obj) = s.as_object() else {
        return s.clone();
    };
    let mut out = serde_json::Map::with_capacity(obj.len());
    for (k, v) in obj {
        let v = match k.as_str() {
            "type" => match v.as_str() {
                Some(t) => json!(json_type(t)),
                None => v.clone(),
            },
            "properties" => match v.as_object() {
                Some(props) => Value::Object(
                    props
                        .iter()
                        .map(|(name, p)| (name.clone(), map_schema(p)))
                        .collect(),
                ),
                None => v.clone(),
            },
            "items" => map_schema(v),
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    if obj.get("type").and_then(Value::as_str) == Some("float") {
        let d = obj.get("description").and_then(Value::as_str).unwrap_or("");
        out.insert(
            "description".into(),
            json!(format!("{d} This is a float type value.").trim_start()),
        );
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_gorilla_types_and_names() {
        let t = to_tool(&json!({"name": "math.hypot", "description": "d",
            "parameters": {"type": "dict", "properties": {
                "x": {"type": "float", "description": "X."},
                "p": {"type": "tuple", "items": {"type": "HashMap"}},
                "q": {"type": "dict", "properties": {"r": {"type": "weird"}}}},
            "required": ["x"]}}));
        let f = &t["function"];
        assert_eq!(f["name"], "math_hypot");
        let p = &f["parameters"];
        assert_eq!(p["type"], "object");
        assert_eq!(p["properties"]["x"]["type"], "number");
        assert_eq!(
            p["properties"]["x"]["description"],
            "X. This is a float type value."
        );
        assert_eq!(p["properties"]["p"]["type"], "array");
        assert_eq!(p["properties"]["p"]["items"]["type"], "object");
        assert_eq!(p["properties"]["q"]["properties"]["r"]["type"], "string");
        assert_eq!(p["required"], json!(["x"]));
    }
}
