//! What a request asks of the model's output: OpenAI's `tool_choice`, `parallel_tool_calls` and
//! `response_format`, parsed into typed values with errors that say what was wrong.

use super::{ToolError, ToolSet};
use serde_json::Value;

/// OpenAI `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// Never call a tool (the tools are not shown to the model).
    None,
    /// Free text, or tool calls once the model writes the `<tool_call>` trigger (the default).
    #[default]
    Auto,
    /// At least one tool call, nothing else.
    Required,
    /// A call to this function, nothing else.
    Function(String),
}

impl ToolChoice {
    /// Parses `"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}`.
    pub fn from_openai(v: &Value) -> Result<Self, ToolError> {
        let bad = |msg: String| ToolError::Request(format!("tool_choice: {msg}"));
        match v {
            Value::Null => Ok(ToolChoice::Auto),
            Value::String(s) => match s.as_str() {
                "none" => Ok(ToolChoice::None),
                "auto" => Ok(ToolChoice::Auto),
                "required" | "any" => Ok(ToolChoice::Required),
                other => Err(bad(format!(
                    "{other:?} is not one of \"none\", \"auto\", \"required\""
                ))),
            },
            Value::Object(o) => {
                if o.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(bad(
                        "an object choice must have \"type\": \"function\"".into()
                    ));
                }
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("missing \"function\": {\"name\": ...}".into()))?;
                Ok(ToolChoice::Function(name.to_owned()))
            }
            other => Err(bad(format!("unexpected value {other}"))),
        }
    }

    /// A command-line spelling: `none`, `auto`, `required`, or a function name.
    pub fn from_name(name: &str) -> Self {
        match name {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            f => ToolChoice::Function(f.to_owned()),
        }
    }

    /// Checks the choice against the request's tools: a named function must exist, and `required` or a
    /// named function needs at least one tool.
    pub fn check(&self, tools: &ToolSet) -> Result<(), ToolError> {
        match self {
            ToolChoice::Required if tools.is_empty() => Err(ToolError::Request(
                "tool_choice \"required\" needs at least one tool".into(),
            )),
            ToolChoice::Function(name) if tools.get(name).is_none() => Err(ToolError::Request(
                format!("tool_choice names function {name:?}, which is not among the tools"),
            )),
            _ => Ok(()),
        }
    }
}

/// OpenAI `response_format`: the shape of the assistant's text answer.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ResponseFormat {
    /// Free text.
    #[default]
    Text,
    /// Any JSON object.
    JsonObject,
    /// One JSON value matching `schema`.
    JsonSchema {
        /// The schema's name (informative).
        name: String,
        /// The schema.
        schema: Value,
        /// OpenAI strict mode: objects admit only the properties their schema names.
        strict: bool,
    },
}

impl ResponseFormat {
    /// Parses `{"type": "text" | "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}`; the schema is compiled once
    /// here so a bad one is rejected before any decoding.
    pub fn from_openai(v: &Value) -> Result<Self, ToolError> {
        let bad = |msg: &str| ToolError::Request(format!("response_format: {msg}"));
        if v.is_null() {
            return Ok(ResponseFormat::Text);
        }
        match v.get("type").and_then(Value::as_str) {
            Some("text") => Ok(ResponseFormat::Text),
            Some("json_object") => Ok(ResponseFormat::JsonObject),
            Some("json_schema") => {
                let js = v
                    .get("json_schema")
                    .ok_or_else(|| bad("missing \"json_schema\""))?;
                let name = js
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("response")
                    .to_owned();
                let schema = js
                    .get("schema")
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({}));
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(bad("\"schema\" must be a JSON schema object"));
                }
                super::check_schema_size(&schema).map_err(|msg| ToolError::Schema {
                    tool: format!("response_format {name}"),
                    msg,
                })?;
                jsonschema::validator_for(&schema).map_err(|e| ToolError::Schema {
                    tool: format!("response_format {name}"),
                    msg: e.to_string(),
                })?;
                let strict = js.get("strict").and_then(Value::as_bool).unwrap_or(false);
                Ok(ResponseFormat::JsonSchema {
                    name,
                    schema,
                    strict,
                })
            }
            Some(other) => Err(bad(&format!(
                "type {other:?} is not one of \"text\", \"json_object\", \"json_schema\""
            ))),
            None => Err(bad("missing \"type\"")),
        }
    }

    /// The schema the answer must match, if any.
    pub fn schema(&self) -> Option<(Value, bool)> {
        match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some((serde_json::json!({"type": "object"}), false)),
            ResponseFormat::JsonSchema { schema, strict, .. } => Some((schema.clone(), *strict)),
        }
    }
}
