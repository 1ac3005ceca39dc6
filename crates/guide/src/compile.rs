//! The tool-call grammars of the engine's [`GrammarFactory`]: a request's [`GuideSpec`] compiled into a
//! [`Guide`], and the errors that name the tool whose schema the compiler refused.

use thorn_engine::sample::grammar::{Constraint, GrammarError, GrammarFactory};
use thorn_engine::sample::guide::Guide;
use thorn_engine::tokenizer::{TokenId, Tokenizer};
use thorn_tools::grammar::{GuideSpec, calls_grammar, guide_spec, resolve_controls};
use thorn_tools::{ResponseFormat, ToolChoice, ToolError, ToolFormat, ToolSet};

/// The tool-call grammars of a [`GrammarFactory`].
pub trait ToolGrammars {
    /// Exactly one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` for one of `tools`.
    fn tool_call(&self, tools: &ToolSet) -> Result<Constraint, GrammarError>;

    /// Compiles every tool's call grammar, so a schema the compiler cannot enforce is rejected when the tool
    /// set arrives, with an error naming the tool and the feature. The union is compiled (and cached) first;
    /// only when it fails are the tools compiled one by one to find the culprit.
    fn check_tools(&self, tools: &ToolSet) -> Result<(), ToolGrammarError>;

    /// The guide for a request, or `None` when its output is free text. Rejects a `tool_choice` that does
    /// not fit the tools and any schema the grammar compiler cannot enforce (naming the tool). Which
    /// grammar applies when is `thorn_tools::grammar`'s table.
    fn guide(
        &self,
        tools: &ToolSet,
        choice: &ToolChoice,
        parallel: bool,
        format: &ResponseFormat,
    ) -> Result<Option<Guide>, GuideError>;
}

/// The control tokens of `format`'s syntax that the model's vocabulary has: a request decoded in that
/// format shows them as text (`Request::shown_controls`), so its parser sees them.
pub fn shown_controls(tok: &Tokenizer, format: ToolFormat) -> Vec<TokenId> {
    format
        .controls()
        .iter()
        .filter_map(|t| tok.control_id(t))
        .collect()
}

/// The grammar with its control tokens resolved against the model's vocabulary.
fn resolved<'a>(f: &GrammarFactory, lark: &'a str) -> std::borrow::Cow<'a, str> {
    resolve_controls(lark, &|text| f.control_token(text))
}

impl ToolGrammars for GrammarFactory {
    fn tool_call(&self, tools: &ToolSet) -> Result<Constraint, GrammarError> {
        self.lark(&resolved(self, &calls_grammar(tools, None, false, None)))
    }

    fn check_tools(&self, tools: &ToolSet) -> Result<(), ToolGrammarError> {
        if tools.is_empty() || self.tool_call(tools).is_ok() {
            return Ok(());
        }
        for t in tools.tools() {
            let one = calls_grammar(tools, Some(&t.name), false, None);
            if let Err(e) = self.lark_uncached(&resolved(self, &one)) {
                let msg = match e {
                    GrammarError::Compile(m) | GrammarError::Matcher(m) => m,
                };
                return Err(ToolGrammarError::Tool {
                    tool: t.name.clone(),
                    msg,
                });
            }
        }
        // Each tool compiles alone but the union does not: report the union's error.
        self.tool_call(tools)
            .map(drop)
            .map_err(ToolGrammarError::Grammar)
    }

    fn guide(
        &self,
        tools: &ToolSet,
        choice: &ToolChoice,
        parallel: bool,
        format: &ResponseFormat,
    ) -> Result<Option<Guide>, GuideError> {
        let Some(spec) = guide_spec(tools, choice, parallel, format)? else {
            return Ok(None);
        };
        // One compile on the happy path; on failure, find the tool to blame (an answer has none).
        let constraint = self.lark(&resolved(self, &spec.lark)).map_err(|e| {
            if spec.answer {
                return ToolGrammarError::Grammar(e);
            }
            match self.check_tools(tools) {
                Err(named) => named,
                Ok(()) => ToolGrammarError::Grammar(e),
            }
        })?;
        Ok(Some(build(constraint, &spec)))
    }
}

/// The guide a compiled spec makes.
fn build(constraint: Constraint, spec: &GuideSpec) -> Guide {
    let guide = if spec.answer {
        Guide::answer(constraint)
    } else {
        match spec.trigger {
            Some(t) => Guide::triggered(constraint, t),
            None => Guide::new(constraint),
        }
    };
    if spec.json_number_limits {
        guide.with_json_number_limits()
    } else {
        guide
    }
}

/// A tool set's grammar that cannot be built.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ToolGrammarError {
    /// The grammar does not compile (and no single tool is to blame).
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    /// One tool's parameters schema uses something the grammar compiler does not support.
    #[error("tool {tool:?}: its parameters schema cannot be enforced: {msg}")]
    Tool {
        /// The tool.
        tool: String,
        /// The compiler's complaint (it names the feature).
        msg: String,
    },
}

/// Why a request's output constraint cannot be built.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum GuideError {
    /// The request's tool options are wrong.
    #[error(transparent)]
    Tool(#[from] ToolError),
    /// A schema cannot be compiled into a grammar.
    #[error(transparent)]
    Grammar(#[from] ToolGrammarError),
}

impl From<GrammarError> for GuideError {
    fn from(e: GrammarError) -> Self {
        GuideError::Grammar(ToolGrammarError::Grammar(e))
    }
}
