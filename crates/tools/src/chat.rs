//! Conversations and their rendering into the model's prompt text.
//!
//! [`Message`] is the domain type (separate from the OpenAI wire types that arrive later in `api/`).
//! [`ChatTemplate`] renders a conversation with the model's own Jinja template (`tokenizer.chat_template`
//! in the GGUF), so the prompt is byte-for-byte what the model was trained on.

mod template;

pub use template::{
    ChatTemplate, KWARGS_MAX, Quote, RESERVED, RenderOptions, TemplateError, check_kwargs,
};

use serde::Serialize;

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions for the model.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// Its name in OpenAI's chat format (and in chat templates).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A call the assistant asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    /// Call id, echoed by the tool message that answers it.
    pub id: String,
    /// Always `"function"` (HF templates read `tool_call.type`).
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// The function part of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments as a JSON value (templates render it with `tojson`).
    pub arguments: serde_json::Value,
}

/// One message of a conversation, shaped like the HF chat-template `messages` entries.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    /// Author.
    pub role: Role,
    /// Text (templates expect a string, so it is `""` rather than absent when a message only calls tools).
    pub content: String,
    /// Tool calls made by an assistant message.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a tool message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Name of the tool that produced a tool message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's reasoning (what a thinking model wrote inside `<think>`), rendered back where
    /// the template has a place for it (templates read `message.reasoning_content`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message with just a role and text.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// Bytes of data this message carries (content, call names and arguments, ids): a lower bound on what
    /// it adds to a rendered prompt.
    pub fn data_len(&self) -> usize {
        let calls: usize = self
            .tool_calls
            .iter()
            .map(|c| c.id.len() + c.function.name.len() + json_len(&c.function.arguments))
            .sum();
        self.content.len()
            + calls
            + self.tool_call_id.as_ref().map_or(0, String::len)
            + self.name.as_ref().map_or(0, String::len)
            + self.reasoning_content.as_ref().map_or(0, String::len)
    }

    /// This message with every string quoted as data ([`RenderOptions::quote`]).
    pub fn quoted(&self, q: Quote<'_>) -> Message {
        let s = |t: &str| q(t).unwrap_or_else(|| t.to_owned());
        Message {
            role: self.role,
            content: s(&self.content),
            tool_calls: self
                .tool_calls
                .iter()
                .map(|c| ToolCall {
                    id: s(&c.id),
                    kind: c.kind,
                    function: FunctionCall {
                        name: s(&c.function.name),
                        arguments: quote_json(&c.function.arguments, q),
                    },
                })
                .collect(),
            tool_call_id: self.tool_call_id.as_deref().map(s),
            name: self.name.as_deref().map(s),
            reasoning_content: self.reasoning_content.as_deref().map(s),
        }
    }
}

/// Bytes of the strings in `v` (a lower bound on its JSON text).
fn json_len(v: &serde_json::Value) -> usize {
    use serde_json::Value;
    match v {
        Value::String(t) => t.len(),
        Value::Array(a) => a.iter().map(json_len).sum(),
        Value::Object(o) => o.iter().map(|(k, x)| k.len() + json_len(x)).sum(),
        _ => 1,
    }
}

/// `v` with every string (keys included) quoted as data.
pub fn quote_json(v: &serde_json::Value, q: Quote<'_>) -> serde_json::Value {
    use serde_json::Value;
    let s = |t: &str| q(t).unwrap_or_else(|| t.to_owned());
    match v {
        Value::String(t) => Value::String(s(t)),
        Value::Array(a) => Value::Array(a.iter().map(|x| quote_json(x, q)).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, x)| (s(k), quote_json(x, q))).collect())
        }
        other => other.clone(),
    }
}
