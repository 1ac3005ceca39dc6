//! Tool schemas as grammars: the tool-call grammar of a tool set, and the [`Guide`] a request's tools,
//! `tool_choice`, `parallel_tool_calls` and `response_format` make.
//!
//! | tools / choice | response_format | grammar | active |
//! |---|---|---|---|
//! | none, or `none` | text | — (no guide) | |
//! | none, or `none` | json_object / json_schema | the answer's schema | from the first token |
//! | `auto` | text | tool-call blocks | at the `<tool_call>` trigger |
//! | `auto` | json_object / json_schema | answer \| tool-call blocks | from the first token |
//! | `required` | any | tool-call blocks | from the first token |
//! | named function | any | one block for that function | from the first token |
//!
//! The engine knows grammars and guides, not tools: this module turns tools into a Lark grammar and the
//! engine's [`GrammarFactory`] compiles it (cached by its text, so a tool set costs one compile per process).

use crate::{OPEN, ResponseFormat, ToolChoice, ToolError, ToolSet};
use serde_json::{Value, json};
use thorn_engine::sample::grammar::{Constraint, GrammarError, GrammarFactory, json_body};
use thorn_engine::sample::guide::Guide;

/// The tool-call grammars of a [`GrammarFactory`].
pub trait ToolGrammars {
    /// Exactly one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` for one of `tools`.
    fn tool_call(&self, tools: &ToolSet) -> Result<Constraint, GrammarError>;

    /// Compiles every tool's call grammar, so a schema the compiler cannot enforce is rejected when the tool
    /// set arrives, with an error naming the tool and the feature. The union is compiled (and cached) first;
    /// only when it fails are the tools compiled one by one to find the culprit.
    fn check_tools(&self, tools: &ToolSet) -> Result<(), GrammarError>;

    /// The guide for a request, or `None` when its output is free text. Rejects a `tool_choice` that does
    /// not fit the tools and any schema the grammar compiler cannot enforce (naming the tool).
    fn guide(
        &self,
        tools: &ToolSet,
        choice: &ToolChoice,
        parallel: bool,
        format: &ResponseFormat,
    ) -> Result<Option<Guide>, GuideError>;
}

impl ToolGrammars for GrammarFactory {
    fn tool_call(&self, tools: &ToolSet) -> Result<Constraint, GrammarError> {
        self.lark(&calls_grammar(tools, None, false, None)?)
    }

    fn check_tools(&self, tools: &ToolSet) -> Result<(), GrammarError> {
        if tools.is_empty() || self.tool_call(tools).is_ok() {
            return Ok(());
        }
        for t in tools.tools() {
            let one = calls_grammar(tools, Some(&t.name), false, None)?;
            if let Err(e) = self.lark_uncached(&one) {
                let msg = match e {
                    GrammarError::Compile(m) | GrammarError::Matcher(m) => m,
                    GrammarError::Tool { msg, .. } => msg,
                };
                return Err(GrammarError::Tool {
                    tool: t.name.clone(),
                    msg,
                });
            }
        }
        // Each tool compiles alone but the union does not: report the union's error.
        self.tool_call(tools).map(drop)
    }

    fn guide(
        &self,
        tools: &ToolSet,
        choice: &ToolChoice,
        parallel: bool,
        format: &ResponseFormat,
    ) -> Result<Option<Guide>, GuideError> {
        choice.check(tools)?;
        let answer = format.schema().map(|(s, _)| s);
        let use_tools = !tools.is_empty() && *choice != ToolChoice::None;
        if !use_tools {
            return Ok(match answer {
                Some(schema) => {
                    Some(Guide::answer(self.json_schema(&schema)?).with_json_number_limits())
                }
                None => None,
            });
        }
        let (grammar, trigger) = match choice {
            ToolChoice::Function(name) => (calls_grammar(tools, Some(name), false, None)?, None),
            ToolChoice::Required => (calls_grammar(tools, None, parallel, None)?, None),
            _ => match &answer {
                Some(schema) => (calls_grammar(tools, None, parallel, Some(schema))?, None),
                None => (calls_grammar(tools, None, parallel, None)?, Some(OPEN)),
            },
        };
        // One compile on the happy path; on failure, find the tool to blame.
        let constraint = self
            .lark(&grammar)
            .map_err(|e| match self.check_tools(tools) {
                Err(named) => named,
                Ok(()) => e,
            })?;
        Ok(Some(
            match trigger {
                Some(t) => Guide::triggered(constraint, t),
                None => Guide::new(constraint),
            }
            .with_json_number_limits(),
        ))
    }
}

/// The Lark grammar for tool calls: one `<tool_call>...</tool_call>` block (or several, with `parallel`) for
/// the tools (or just `only`); with `answer`, a JSON answer matching that schema is the alternative.
pub fn calls_grammar(
    tools: &ToolSet,
    only: Option<&str>,
    parallel: bool,
    answer: Option<&Value>,
) -> Result<String, GrammarError> {
    let schema = call_schema(tools, only);
    let call = json_body(&schema)?;
    let repeat = if parallel { "+" } else { "" };
    let mut g = String::new();
    match answer {
        Some(a) => {
            g.push_str("start: answer | calls\n");
            g.push_str(&format!("answer: %json {}\n", json_body(a)?));
        }
        None => g.push_str("start: calls\n"),
    }
    g.push_str(&format!("calls: block{repeat}\n"));
    g.push_str("block: \"<tool_call>\" call \"</tool_call>\"\n");
    g.push_str(&format!("call: %json {call}\n"));
    Ok(g)
}

/// The schema of a call object: `{"name": <const>, "arguments": <that tool's parameters>}`, one branch per tool
/// (or only the tool named `only`).
pub fn call_schema(tools: &ToolSet, only: Option<&str>) -> Value {
    let branches: Vec<Value> = tools
        .tools()
        .iter()
        .filter(|t| only.is_none_or(|n| n == t.name))
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
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

/// Why a request's output constraint cannot be built.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum GuideError {
    /// The request's tool options are wrong.
    #[error(transparent)]
    Tool(#[from] ToolError),
    /// A schema cannot be compiled into a grammar.
    #[error(transparent)]
    Grammar(#[from] GrammarError),
}
