//! Constrained decoding: llguidance behind a small seam.
//!
//! [`GrammarFactory`] is built once per model: a token trie over the model's own token bytes (control tokens
//! marked as special, so no grammar can spell them by accident) and an llguidance parser factory.
//! [`Constraint`] is one sequence's matcher: [`Constraint::mask_logits`] bans every token the grammar does
//! not allow, [`Constraint::commit`] advances it, and [`Constraint::forced`] returns the tokens the grammar
//! allows as the only continuation (to be fed without sampling). A grammar that does not compile is an
//! error when it is built, naming the problem; it is never silently dropped.

use crate::tokenizer::{TokenId, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
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

/// A token bitset (bit `t` set = token `t` allowed), reused across steps so masking allocates nothing on our
/// side of the seam.
#[derive(Debug, Clone, Default)]
pub struct Mask {
    words: Vec<u32>,
}

impl Mask {
    /// Whether token `t` is allowed.
    pub fn allows(&self, t: TokenId) -> bool {
        self.words
            .get(t as usize / 32)
            .is_some_and(|w| w >> (t % 32) & 1 == 1)
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The 32-bit words, token `32 * i + b` at bit `b` of word `i`.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Sets every logit the mask bans to -inf (the word-wise loop skips over all-allowed and all-banned
    /// runs). Returns how many tokens remain.
    pub fn apply(&self, logits: &mut [f32]) -> usize {
        let mut allowed = 0;
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            let w = self.words.get(i).copied().unwrap_or(0);
            match w {
                0 => chunk.fill(f32::NEG_INFINITY),
                u32::MAX => allowed += chunk.len(),
                _ => {
                    for (b, l) in chunk.iter_mut().enumerate() {
                        if w >> b & 1 == 0 {
                            *l = f32::NEG_INFINITY;
                        } else {
                            allowed += 1;
                        }
                    }
                }
            }
        }
        allowed
    }
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
    tok: Arc<Tokenizer>,
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
        let env: TokEnv = Arc::new(Env {
            trie,
            tok: Arc::clone(&tok),
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Compile(e.to_string()))?;
        factory.quiet();
        Ok(GrammarFactory {
            factory: Arc::new(factory),
            tok,
            cache: Arc::default(),
        })
    }

    /// Compiles a Lark grammar without the cache (for one-off checks, such as finding which tool of a set
    /// makes the set's grammar fail).
    pub fn lark_uncached(&self, src: &str) -> Result<Constraint, GrammarError> {
        self.build(TopLevelGrammar::from_lark(src.to_owned()))
    }

    fn build(&self, g: TopLevelGrammar) -> Result<Constraint, GrammarError> {
        // The compiler works on client schemas: a panic in it is a refused schema, not a dead thread.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(g)
        }))
        .map_err(|_| {
            tracing::error!("the grammar compiler panicked on a schema");
            GrammarError::Compile("the grammar compiler failed on this schema".into())
        })?
        .map_err(|e| GrammarError::Compile(client_message(&e.to_string())))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(GrammarError::Compile(client_message(&e)));
        }
        Ok(Constraint { m })
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

    /// The control token whose text is `text`, if the model's vocabulary has one (a grammar names it as
    /// `<[ID]>`).
    pub fn control_token(&self, text: &str) -> Option<TokenId> {
        self.tok.control_id(text)
    }

    /// Grammars in the compile cache.
    pub fn cached(&self) -> usize {
        self.cache.lock().map(|c| c.len()).unwrap_or(0)
    }
}

/// A compiler message fit for a client: its first lines, at most 400 bytes, and never a panic message or
/// backtrace (those are logged, not returned).
pub(crate) fn client_message(msg: &str) -> String {
    if msg.contains("panicked") || msg.contains("backtrace") || msg.contains("RUST_BACKTRACE") {
        tracing::warn!(error = %msg, "grammar compiler failure");
        return "the grammar compiler failed on this schema".into();
    }
    let lines: Vec<&str> = msg.lines().take(3).collect();
    let text = lines.join(" ");
    let cut = text.floor_char_boundary(400);
    if cut < text.len() {
        format!("{}...", &text[..cut])
    } else {
        text
    }
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
        GrammarError::Matcher(client_message(&e.to_string()))
    }

    /// Writes the tokens allowed next into `mask` (its buffer is reused; once the grammar is done, only
    /// end-of-sequence is allowed).
    ///
    /// llguidance 1.9 hands its mask back as a fresh 6 KB `SimpleVob` per call (its API has no
    /// write-into variant); that one allocation is inside the library, and this side copies it into the
    /// caller's buffer without allocating.
    pub fn mask_into(&mut self, mask: &mut Mask) -> Result<(), GrammarError> {
        let vob = self.m.compute_mask_or_eos().map_err(Self::err)?;
        mask.words.clear();
        mask.words.extend_from_slice(vob.as_slice());
        Ok(())
    }

    /// Sets every disallowed token's logit to -inf, using `mask` as scratch. Returns how many tokens are
    /// allowed.
    pub fn mask_logits(
        &mut self,
        logits: &mut [f32],
        mask: &mut Mask,
    ) -> Result<usize, GrammarError> {
        self.mask_into(mask)?;
        Ok(mask.apply(logits))
    }

    /// Advances past several tokens.
    pub fn commit_all(&mut self, tokens: &[TokenId]) -> Result<(), GrammarError> {
        self.m.consume_tokens(tokens).map_err(Self::err)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiler_messages_reach_clients_short_and_without_panics() {
        let panic = "thread 'engine' panicked at src/lib.rs:1:1:\nindex out of bounds\nstack backtrace:\n 0: x";
        assert_eq!(
            client_message(panic),
            "the grammar compiler failed on this schema"
        );
        let long = format!("{}\nline 2\nline 3\nline 4", "é".repeat(500));
        let m = client_message(&long);
        assert!(
            m.len() <= 403 && m.ends_with("...") && !m.contains("line 4"),
            "{m}"
        );
        assert_eq!(client_message("unknown rule foo"), "unknown rule foo");
    }

    #[test]
    fn masks_apply_word_by_word() {
        let m = Mask {
            words: vec![u32::MAX, 0, 0b101],
        };
        let mut logits = vec![1.0f32; 70];
        assert_eq!(m.apply(&mut logits), 32 + 2);
        assert!(logits[..32].iter().all(|l| *l == 1.0));
        assert!(logits[32..64].iter().all(|l| l.is_infinite()));
        assert_eq!(logits[64], 1.0);
        assert!(logits[65].is_infinite());
        assert_eq!(logits[66], 1.0);
        assert!(m.allows(66) && !m.allows(65) && !m.allows(1000));
        assert_eq!(m.count(), 34);
    }
}
