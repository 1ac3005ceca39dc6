//! # thorn-tools
//!
//! Tools as the model sees them: the prompt that describes them, the text format of a call, and the
//! validation of every call against its JSON schema.
//!
//! * [`ToolSet`] holds the tools of a request (OpenAI `tools` entries), each with a compiled `jsonschema`
//!   validator. A schema that does not compile is rejected when the set is built, naming the tool.
//! * [`ToolSet::system_prompt`] renders the tool list for models whose chat template does not know tools
//!   (SmolLM2's does not): a `<tools>` JSON block and the instruction to answer with
//!   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes convention, with compact JSON so
//!   a grammar can force most of a call's structure).
//! * [`parse_tool_calls`] splits generated text into prose and calls; [`ToolSet::check`] validates one call
//!   (defence in depth: with constrained decoding a failure here is a bug, and it is reported, never run).
//! * [`guide_spec`] says what a request's output must look like as data: a Lark grammar for its tools,
//!   `tool_choice` and `response_format`, and when it applies. This crate knows no engine: `thorn-guide`
//!   compiles the grammar with the engine's grammar factory.

pub mod chat;
mod choice;
pub mod format;
pub mod grammar;
mod parse;
pub mod route;
mod stream;
pub mod usage;

pub use choice::{ResponseFormat, ToolChoice};
pub use format::{FormatStreamer, ReasoningTags, ToolFormat};
pub use grammar::{GuideSpec, guide_spec};
pub use parse::{CLOSE, OPEN, ParsedCall, complete_calls_prefix, parse_tool_calls, tag_prefix_len};
pub use route::{Ranked, RouteConfig, RouteDoc, Router};
pub use stream::{CallDelta, CallStreamer};
pub use usage::{AnswerError, AnswerTemplate, Example, quote_from_request, request_spans};

use crate::chat::{
    ChatTemplate, FunctionCall, Message, Quote, RenderOptions, Role, TemplateError, ToolCall,
};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;
use thiserror::Error;

/// What can be wrong with a tool definition or a tool call.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ToolError {
    /// A `tools` entry that is not `{"type": "function", "function": {"name", "parameters"?, ...}}`.
    #[error("tool #{index}: {msg}")]
    Definition {
        /// Position in the list.
        index: usize,
        /// What is wrong.
        msg: String,
    },
    /// A parameters schema that does not compile.
    #[error("tool {tool:?}: its parameters schema is invalid: {msg}")]
    Schema {
        /// The tool.
        tool: String,
        /// The compiler's complaint.
        msg: String,
    },
    /// A request option that is malformed or does not fit the tools (`tool_choice`, `response_format`).
    #[error("{0}")]
    Request(String),
    /// Two tools with one name.
    #[error("tool {0:?} is defined twice")]
    Duplicate(String),
    /// Text inside `<tool_call>` that is not a JSON call object.
    #[error("malformed tool call: {0}")]
    Malformed(String),
    /// A call to a tool that is not in the set.
    #[error("the model called unknown tool {0:?}")]
    UnknownTool(String),
    /// Arguments that violate the tool's schema.
    #[error("arguments for {tool:?} do not match its schema: {errors}")]
    Invalid {
        /// The tool.
        tool: String,
        /// The validation errors, joined.
        errors: String,
    },
}

/// One tool: its name, description and parameters schema, with the compiled validator.
pub struct Tool {
    /// Function name.
    pub name: String,
    /// What it does (shown to the model).
    pub description: String,
    /// JSON schema of the arguments object.
    pub parameters: Value,
    /// OpenAI `strict`: the arguments admit only the properties the schema names.
    pub strict: bool,
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for Tool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The tools of one request.
#[derive(Debug, Default)]
pub struct ToolSet {
    tools: Vec<Tool>,
    /// The definitions as given, for prompts and templates.
    definitions: Vec<Value>,
    /// How the model writes a call.
    format: ToolFormat,
}

impl ToolSet {
    /// Builds a set from OpenAI-style `tools` entries, compiling every parameters schema.
    pub fn new(defs: &[Value]) -> Result<Self, ToolError> {
        let mut tools: Vec<Tool> = Vec::with_capacity(defs.len());
        for (index, def) in defs.iter().enumerate() {
            let bad = |msg: &str| ToolError::Definition {
                index,
                msg: msg.to_owned(),
            };
            if def
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| t != "function")
            {
                return Err(bad("only tools of type \"function\" are supported"));
            }
            let f = def
                .get("function")
                .ok_or_else(|| bad("missing \"function\""))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("missing function name"))?;
            if name.is_empty()
                || name.len() > 64
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
            {
                return Err(bad(&format!(
                    "function name {name:?} must be 1-64 characters of [A-Za-z0-9_.-]"
                )));
            }
            if tools.iter().any(|t| t.name == name) {
                return Err(ToolError::Duplicate(name.to_owned()));
            }
            let description = f
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            let parameters = f
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
            if !parameters.is_object() {
                return Err(ToolError::Schema {
                    tool: name.to_owned(),
                    msg: "parameters must be a JSON object schema".into(),
                });
            }
            check_schema_size(&parameters).map_err(|msg| ToolError::Schema {
                tool: name.to_owned(),
                msg,
            })?;
            let validator =
                jsonschema::validator_for(&parameters).map_err(|e| ToolError::Schema {
                    tool: name.to_owned(),
                    msg: e.to_string(),
                })?;
            let strict = f.get("strict").and_then(Value::as_bool).unwrap_or(false);
            tools.push(Tool {
                name: name.to_owned(),
                description,
                parameters,
                strict,
                validator,
            });
        }
        Ok(ToolSet {
            tools,
            definitions: defs.to_vec(),
            format: ToolFormat::default(),
        })
    }

    /// The set for a model that writes calls in `format` (grammar, parser, streamer and prompt follow it).
    /// Fails when a tool cannot be called in that format.
    pub fn with_format(mut self, format: ToolFormat) -> Result<Self, ToolError> {
        format.check(&self)?;
        self.format = format;
        Ok(self)
    }

    /// How the model writes a call.
    pub fn format(&self) -> ToolFormat {
        self.format
    }

    /// A streaming lexer of this set's calls.
    pub fn streamer(&self) -> FormatStreamer {
        self.format.streamer(self)
    }

    /// The part of a cut-short generation that holds only complete calls (see [`complete_calls_prefix`]).
    pub fn complete_prefix<'a>(&self, text: &'a str) -> &'a str {
        self.format.complete_prefix(self, text)
    }

    /// Whether there are no tools.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Decodes and validates tool `name` under `parameters` instead of its own schema from now on; the
    /// prompt still shows the definition as given. For a per-request narrowing of a schema (a routed call
    /// whose quoted values must come from the request), so `parameters` should admit a subset of what the
    /// tool's schema admits. On an error the set is unchanged.
    pub fn narrow(&mut self, name: &str, parameters: Value) -> Result<(), ToolError> {
        let Some(t) = self.tools.iter_mut().find(|t| t.name == name) else {
            return Err(ToolError::UnknownTool(name.to_owned()));
        };
        check_schema_size(&parameters).map_err(|msg| ToolError::Schema {
            tool: name.to_owned(),
            msg,
        })?;
        t.validator = jsonschema::validator_for(&parameters).map_err(|e| ToolError::Schema {
            tool: name.to_owned(),
            msg: e.to_string(),
        })?;
        t.parameters = parameters;
        Ok(())
    }

    /// The tools.
    pub fn tools(&self) -> &[Tool] {
        &self.tools
    }

    /// The definitions as given (what a tool-aware chat template receives as `tools`).
    pub fn definitions(&self) -> &[Value] {
        &self.definitions
    }

    /// The tool named `name`.
    pub fn get(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The system-prompt block that describes the tools (compact JSON) and the call format to a model whose
    /// template does not.
    pub fn system_prompt(&self) -> String {
        let list = serde_json::to_string(&self.definitions).unwrap_or_else(|_| "[]".into());
        self.format.instructions(&list)
    }

    /// The conversation as a template that does not know tools must see it: the tool list appended to the
    /// system message (or a new one), each assistant tool call written out in the set's format after its
    /// content, and each tool result wrapped in `<tool_response>` tags. A template that knows tools gets
    /// the messages unchanged (and the definitions as `tools`). Either way call ids take the form the
    /// format's templates need ([`ToolFormat::template_id`]).
    pub fn messages_for(&self, template_knows_tools: bool, messages: &[Message]) -> Vec<Message> {
        let mut out = messages.to_vec();
        for m in &mut out {
            for c in &mut m.tool_calls {
                c.id = self.format.template_id(&c.id);
            }
            if let Some(id) = &mut m.tool_call_id {
                *id = self.format.template_id(id);
            }
        }
        if template_knows_tools {
            return out;
        }
        for m in &mut out {
            match m.role {
                Role::Assistant if !m.tool_calls.is_empty() => {
                    for c in m.tool_calls.drain(..) {
                        let call =
                            self.format
                                .write_call(self, &c.function.name, &c.function.arguments);
                        m.content.push_str(&call);
                    }
                }
                Role::Tool => {
                    m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
                }
                _ => {}
            }
        }
        if self.is_empty() {
            return out;
        }
        let block = self.system_prompt();
        match out.first_mut() {
            Some(m) if m.role == Role::System => m.content = format!("{}\n\n{block}", m.content),
            _ => out.insert(0, Message::system(block)),
        }
        out
    }

    /// Renders a conversation with these tools through the model's chat template, as a prompt that ends with
    /// the assistant header: tools as the template's `tools` if it knows them, else in the set's format
    /// by [`ToolSet::messages_for`]. Every string of the messages and tools goes through `quote` (the
    /// tokenizer's data quoting), so the result is for `Tokenizer::encode_rendered`.
    pub fn render(
        &self,
        template: &ChatTemplate,
        messages: &[Message],
        bos_token: &str,
        eos_token: &str,
        quote: Quote<'_>,
    ) -> Result<String, TemplateError> {
        self.render_with(template, messages, bos_token, eos_token, quote, None)
    }

    /// [`ToolSet::render`] with more template variables (a request's `chat_template_kwargs`, such as
    /// `enable_thinking`; see [`chat::check_kwargs`]).
    pub fn render_with(
        &self,
        template: &ChatTemplate,
        messages: &[Message],
        bos_token: &str,
        eos_token: &str,
        quote: Quote<'_>,
        kwargs: Option<&serde_json::Map<String, Value>>,
    ) -> Result<String, TemplateError> {
        let knows = template.knows_tools();
        let msgs = self.messages_for(knows, messages);
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: (knows && !self.is_empty()).then_some(self.definitions.as_slice()),
            bos_token,
            eos_token,
            quote: Some(quote),
            kwargs,
        };
        template.render(&msgs, &opts)
    }

    /// Checks a parsed call: the tool exists and the arguments satisfy its schema.
    pub fn check(&self, call: &ParsedCall) -> Result<(), ToolError> {
        let tool = self
            .get(&call.name)
            .ok_or_else(|| ToolError::UnknownTool(call.name.clone()))?;
        let errors: Vec<String> = tool
            .validator
            .iter_errors(&call.arguments)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ToolError::Invalid {
                tool: call.name.clone(),
                errors: errors.join("; "),
            })
        }
    }
}

/// Limits on what a client's schema may ask the grammar engine to spell or compile: a `const` or `enum`
/// is forced token by token and a `pattern` becomes an automaton, so their size is bounded where the
/// schema arrives, with a message that names the limit.
pub mod schema_limits {
    /// Most bytes of one `const` value's JSON text.
    pub const CONST_BYTES: usize = 4096;
    /// Most entries of one `enum`.
    pub const ENUM_ENTRIES: usize = 1024;
    /// Most bytes of one `enum`'s JSON text.
    pub const ENUM_BYTES: usize = 64 << 10;
    /// Most bytes of one `pattern` (or `patternProperties` key).
    pub const PATTERN_BYTES: usize = 1024;
    /// Deepest nesting of a schema.
    pub const DEPTH: usize = 64;
}

/// Checks a schema against [`schema_limits`].
pub fn check_schema_size(schema: &Value) -> Result<(), String> {
    use schema_limits as l;
    fn walk(v: &Value, depth: usize) -> Result<(), String> {
        if depth > l::DEPTH {
            return Err(format!("the schema nests deeper than {} levels", l::DEPTH));
        }
        match v {
            Value::Object(o) => {
                for (k, x) in o {
                    match k.as_str() {
                        "const" if x.to_string().len() > l::CONST_BYTES => {
                            return Err(format!(
                                "a \"const\" is longer than {} bytes",
                                l::CONST_BYTES
                            ));
                        }
                        "enum" => {
                            let n = x.as_array().map_or(0, Vec::len);
                            if n > l::ENUM_ENTRIES || x.to_string().len() > l::ENUM_BYTES {
                                return Err(format!(
                                    "an \"enum\" has more than {} entries or {} bytes",
                                    l::ENUM_ENTRIES,
                                    l::ENUM_BYTES
                                ));
                            }
                        }
                        "pattern" if x.as_str().is_some_and(|p| p.len() > l::PATTERN_BYTES) => {
                            return Err(format!(
                                "a \"pattern\" is longer than {} bytes",
                                l::PATTERN_BYTES
                            ));
                        }
                        "patternProperties"
                            if x.as_object()
                                .is_some_and(|p| p.keys().any(|k| k.len() > l::PATTERN_BYTES)) =>
                        {
                            return Err(format!(
                                "a \"patternProperties\" pattern is longer than {} bytes",
                                l::PATTERN_BYTES
                            ));
                        }
                        _ => {}
                    }
                    walk(x, depth + 1)?;
                }
                Ok(())
            }
            Value::Array(a) => a.iter().try_for_each(|x| walk(x, depth + 1)),
            _ => Ok(()),
        }
    }
    walk(schema, 0)
}

/// Calls that failed validation after constrained decoding: each one is a bug (grammar and validator
/// disagree), logged and counted here.
static VALIDATION_FAILURES: AtomicU64 = AtomicU64::new(0);

/// How many calls have failed validation in this process (see [`ToolSet::reply`]).
pub fn validation_failures() -> u64 {
    VALIDATION_FAILURES.load(Ordering::Relaxed)
}

/// An assistant turn split into its text and its validated tool calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The text outside any tool call (trimmed).
    pub content: String,
    /// The calls, in order, each with a fresh id.
    pub calls: Vec<ToolCall>,
}

impl ToolSet {
    /// Parses generated text into prose and calls and validates every call (tool exists, arguments match its
    /// schema). Text from a constrained decode should always pass; a failure is counted as a bug
    /// ([`validation_failures`]), logged, and returned so the agent loop can tell the model what was wrong.
    pub fn reply(&self, text: &str) -> Result<Reply, ToolError> {
        let (content, parsed) = self.format.parse(self, text)?;
        let mut calls = Vec::with_capacity(parsed.len());
        for call in parsed {
            if let Err(e) = self.check(&call) {
                VALIDATION_FAILURES.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "a tool call failed validation");
                return Err(e);
            }
            calls.push(ToolCall {
                id: call_id(),
                kind: "function",
                function: FunctionCall {
                    name: call.name,
                    arguments: call.arguments,
                },
            });
        }
        Ok(Reply { content, calls })
    }
}

/// A fresh call id: `call_` and 24 hex digits: 64 random bits from the OS and a process-wide counter, so ids
/// never repeat within a process and are not guessable across them.
pub fn call_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let random = getrandom::u64().unwrap_or_else(|_| {
        // No OS randomness (never seen on the supported systems): the clock still separates processes.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ u64::from(std::process::id()).rotate_left(32)
    });
    format!("call_{random:016x}{:08x}", n as u32)
}

#[cfg(test)]
mod tests;
