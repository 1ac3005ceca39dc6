//! Constrained decoding: llguidance behind a small seam.
//!
//! [`GrammarFactory`] is built once per model: a token trie over the model's own token bytes (control tokens
//! marked as special, so no grammar can spell them by accident) and an llguidance parser factory.
//! [`Constraint`] is one sequence's matcher: [`Constraint::mask_logits`] bans every token the grammar does
//! not allow, [`Constraint::commit`] advances it, and [`Constraint::forced`] returns the tokens the grammar
//! allows as the only continuation (to be fed without sampling). A grammar that does not compile is an
//! error when it is built, naming the problem; it is never silently dropped.

use crate::tokenizer::{TokenId, Tokenizer};
use crate::tools::ToolSet;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use std::sync::Arc;
use thiserror::Error;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// A grammar that cannot be built or a matcher in an error state.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum GrammarError {
    /// The grammar does not compile.
    #[error("grammar does not compile: {0}")]
    Compile(String),
    /// The matcher rejected a token or failed.
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
}

/// The tokenizer as llguidance sees it.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tok
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// Compiled grammars kept per factory (keyed by the grammar text): a tool set's grammar is compiled once and
/// each request gets a cheap fork.
const CACHE_ENTRIES: usize = 64;

/// One per model: compiles grammars into matchers.
#[derive(Clone)]
pub struct GrammarFactory {
    factory: Arc<ParserFactory>,
    cache: Arc<std::sync::Mutex<std::collections::HashMap<String, Constraint>>>,
}

impl std::fmt::Debug for GrammarFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarFactory").finish_non_exhaustive()
    }
}

impl GrammarFactory {
    /// Builds the token environment from the model's tokenizer.
    pub fn new(tok: Arc<Tokenizer>) -> Result<Self, GrammarError> {
        let n = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as TokenId)
            .map(|id| {
                let bytes = tok.token_bytes(id);
                if tok.is_control(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let eos = tok
            .eos()
            .or_else(|| tok.eog().first().copied())
            .unwrap_or(0);
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tok.bos();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Compile(e.to_string()))?;
        factory.quiet();
        Ok(GrammarFactory {
            factory: Arc::new(factory),
            cache: Arc::default(),
        })
    }

    fn build(&self, g: TopLevelGrammar) -> Result<Constraint, GrammarError> {
        let parser = self
            .factory
            .create_parser(g)
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Constraint { m })
    }

    /// Output must be one JSON value matching `schema`, with compact separators.
    pub fn json_schema(&self, schema: &Value) -> Result<Constraint, GrammarError> {
        self.build(TopLevelGrammar::from_json_schema(compact(schema)))
    }

    /// A Lark grammar (llguidance's dialect, with `%json{...}` for embedded schemas). Compiled grammars are
    /// cached by their text, so the same tool set costs one compile per process.
    pub fn lark(&self, src: &str) -> Result<Constraint, GrammarError> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache.get(src) {
            return Ok(c.fork());
        }
        let c = self.build(TopLevelGrammar::from_lark(src.to_owned()))?;
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(src.to_owned(), c.fork());
        Ok(c)
    }

    /// Grammars in the compile cache.
    pub fn cached(&self) -> usize {
        self.cache.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Exactly one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` for one of `tools`.
    pub fn tool_call(&self, tools: &ToolSet) -> Result<Constraint, GrammarError> {
        let schema = call_schema(tools);
        let body = serde_json::to_string(&compact(&schema))
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        self.lark(&format!(
            "start: \"<tool_call>\" call \"</tool_call>\"\ncall: %json {body}\n"
        ))
    }
}

/// The schema of a call object: `{"name": <const>, "arguments": <that tool's parameters>}`, one branch per tool.
pub fn call_schema(tools: &ToolSet) -> Value {
    let branches: Vec<Value> = tools
        .tools()
        .iter()
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

/// One sequence's grammar state.
pub struct Constraint {
    m: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.m.is_stopped())
            .finish()
    }
}

impl Constraint {
    fn err(e: impl std::fmt::Display) -> GrammarError {
        GrammarError::Matcher(e.to_string())
    }

    /// Sets every disallowed token's logit to -inf. Returns how many tokens are allowed.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<usize, GrammarError> {
        let mask = self.m.compute_mask_or_eos().map_err(Self::err)?;
        let mut allowed = 0;
        for (i, l) in logits.iter_mut().enumerate() {
            if mask.is_allowed(i as TokenId) {
                allowed += 1;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(allowed)
    }

    /// Advances past `token`.
    pub fn commit(&mut self, token: TokenId) -> Result<(), GrammarError> {
        self.m.consume_token(token).map_err(Self::err)
    }

    /// Undoes the last `n` tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.m.rollback(n).map_err(Self::err)
    }

    /// How many leading tokens of `draft` the grammar accepts (nothing is committed).
    pub fn validate(&mut self, draft: &[TokenId]) -> Result<usize, GrammarError> {
        self.m.validate_tokens(draft).map_err(Self::err)
    }

    /// Tokens the grammar forces next (the only allowed continuation), without committing them.
    pub fn forced(&mut self) -> Vec<TokenId> {
        self.m.compute_ff_tokens()
    }

    /// An independent copy (for a draft branch).
    pub fn fork(&self) -> Self {
        Constraint {
            m: self.m.deep_clone(),
        }
    }

    /// Whether the grammar has finished (only end-of-sequence is allowed).
    pub fn is_stopped(&self) -> bool {
        self.m.is_stopped()
    }

    /// Whether the text so far is a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.m.is_accepting().unwrap_or(false)
    }
}
