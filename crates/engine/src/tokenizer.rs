//! Tokenizer: byte-level BPE built in memory from a GGUF's vocabulary and merges.
//!
//! The BPE itself is the `tokenizers` crate (the same code Hugging Face ships), configured like the model's
//! original `tokenizer.json`: a `Digits(individual_digits)` split followed by the GPT-2 byte-level
//! pre-tokenizer regex (`smollm`, `gpt2` and the other GPT-2-regex pre-tokenizers of llama.cpp), or the
//! model's own split regex before the byte-level mapping (`qwen2`, `llama-bpe`).
//!
//! Special tokens are handled here, not by `tokenizers`, because the caller decides per request whether text
//! may contain them ("parse special", as llama.cpp calls it): with it on, every control token's text
//! (`<|im_start|>`) becomes that single token; with it off only user-defined tokens are matched and control
//! text is tokenized as ordinary characters, so a user cannot forge a turn boundary.
//!
//! Chat prompts are rendered from quoted data and tokenized with [`Tokenizer::encode_rendered`], so only
//! the template's own markup becomes control tokens (see `quote`).
//!
//! Decoding goes through a byte table built once at load ([`Tokenizer::token_bytes`]): every token maps to
//! its raw bytes, so decoding is a table walk and the grammar engine can use the same table later.
//! [`Detokenizer`] turns a token stream into text without ever emitting half a UTF-8 character.

mod detok;
mod quote;

pub use detok::{DetokState, Detokenizer};
pub use quote::{DATA_MARK, unquote};

use crate::gguf::{Gguf, GgufError};
use std::collections::HashMap;
use thiserror::Error;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

/// A token id.
pub type TokenId = u32;

/// What can go wrong building or using a tokenizer.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// The GGUF lacks a key or has it in the wrong type.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A tokenizer model or pre-tokenizer thorn does not implement.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// The vocabulary or merges are inconsistent.
    #[error("invalid vocabulary: {0}")]
    Vocab(String),
    /// `tokenizers` failed to encode.
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// llama.cpp's token attribute kinds (GGUF `tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// An ordinary BPE token.
    Normal,
    /// The unknown token.
    Unknown,
    /// A control token (`<|im_start|>`): matched in text only when special parsing is on.
    Control,
    /// A user-defined token: always matched in text.
    UserDefined,
    /// Unused slot.
    Unused,
    /// A raw byte token (`<0x0A>`).
    Byte,
}

impl TokenKind {
    fn from_gguf(t: i32) -> Self {
        match t {
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Normal,
        }
    }
}

/// A loaded tokenizer.
pub struct Tokenizer {
    bpe: tokenizers::Tokenizer,
    tokens: Vec<String>,
    kinds: Vec<TokenKind>,
    bytes: Vec<Box<[u8]>>,
    /// Special tokens (control + user-defined) as (text, id, always_matched), longest text first.
    specials: Vec<(String, TokenId, bool)>,
    special_first_bytes: [bool; 256],
    bos: Option<TokenId>,
    eos: Option<TokenId>,
    eog: Vec<TokenId>,
    add_bos: bool,
    max_token_bytes: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.tokens.len())
            .field("eog", &self.eog)
            .finish()
    }
}

/// Texts of tokens that end a generation in the chat formats thorn knows (llama.cpp's list, in spirit).
const EOG_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|eom_id|>",
    "<|return|>",
    "<|call|>",
];

/// Harmony's turn ends (gpt-oss): with them in the vocabulary `<|end|>` ends a message, not the turn.
const HARMONY_TURN_ENDS: [&str; 2] = ["<|return|>", "<|call|>"];

/// Pre-tokenizers with their own split regex (as in the models' `tokenizer.json`).
const REGEX_PRE: &[(&str, &str)] = &[
    (
        "qwen2",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        "llama-bpe",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// Pre-tokenizers that are the GPT-2 regex with digits split one by one.
const DIGIT_SPLIT_PRE: &[&str] = &[
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "gpt-2",
    "default",
];

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF's `tokenizer.ggml.*` keys.
    pub fn from_gguf(g: &Gguf) -> Result<Self, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::Unsupported(format!(
                "tokenizer.ggml.model = {model:?} (thorn reads gpt2 BPE)"
            )));
        }
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let kinds: Vec<TokenKind> = match g.get_i32_array("tokenizer.ggml.token_type") {
            Ok(t) if t.len() == tokens.len() => {
                t.iter().map(|&k| TokenKind::from_gguf(k)).collect()
            }
            Ok(t) => {
                return Err(TokenizerError::Vocab(format!(
                    "{} token types for {} tokens",
                    t.len(),
                    tokens.len()
                )));
            }
            Err(GgufError::MissingKey(_)) => vec![TokenKind::Normal; tokens.len()],
            Err(e) => return Err(e.into()),
        };
        let merges = g.get_str_array("tokenizer.ggml.merges")?;
        let n_tokens = tokens.len();
        let id = |key: &str| g.get_u32(key).ok().filter(|&i| (i as usize) < n_tokens);
        let add_bos = g.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(false);
        let mut t = Self::new(tokens, kinds, merges, pre)?;
        t.bos = id("tokenizer.ggml.bos_token_id");
        t.eos = id("tokenizer.ggml.eos_token_id");
        t.add_bos = add_bos;
        let eot = id("tokenizer.ggml.eot_token_id");
        t.eog = t.eos.into_iter().chain(eot).collect();
        for (i, (text, kind)) in t.tokens.iter().zip(&t.kinds).enumerate() {
            if *kind == TokenKind::Control
                && EOG_TEXTS.contains(&text.as_str())
                && !t.eog.contains(&(i as u32))
            {
                t.eog.push(i as TokenId);
            }
        }
        if HARMONY_TURN_ENDS.iter().all(|e| t.control_id(e).is_some())
            && let Some(end) = t.control_id("<|end|>")
            && Some(end) != t.eos
        {
            t.eog.retain(|&i| i != end);
        }
        t.eog.sort_unstable();
        Ok(t)
    }

    /// Builds a byte-level BPE tokenizer from its parts (tiny in-code vocabularies in tests use this too).
    /// `merges` are `"left right"` strings in priority order.
    pub fn new(
        tokens: Vec<String>,
        kinds: Vec<TokenKind>,
        merges: &[String],
        pre: &str,
    ) -> Result<Self, TokenizerError> {
        if tokens.len() != kinds.len() || tokens.is_empty() || tokens.len() > u32::MAX as usize {
            return Err(TokenizerError::Vocab(format!(
                "{} tokens, {} kinds",
                tokens.len(),
                kinds.len()
            )));
        }
        let regex = REGEX_PRE.iter().find(|r| r.0 == pre).map(|r| r.1);
        let digits = if DIGIT_SPLIT_PRE.contains(&pre) {
            true
        } else if pre == "gpt2" || regex.is_some() {
            false
        } else {
            return Err(TokenizerError::Unsupported(format!(
                "pre-tokenizer {pre:?}"
            )));
        };

        let mut vocab = ahash::AHashMap::with_capacity(tokens.len());
        for (i, (t, k)) in tokens.iter().zip(&kinds).enumerate() {
            // Special tokens are matched by us before BPE runs; BPE only needs the ordinary vocabulary.
            if matches!(k, TokenKind::Normal | TokenKind::Byte | TokenKind::Unknown) {
                vocab.insert(t.clone(), i as u32);
            }
        }
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| TokenizerError::Vocab(format!("merge {m:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A merge whose parts or result are not tokens can never apply (llama.cpp skips them too; some
        // converters write placeholders).
        let merges: Vec<(String, String)> = merges
            .into_iter()
            .filter(|(a, b)| {
                vocab.contains_key(a)
                    && vocab.contains_key(b)
                    && vocab.contains_key(&format!("{a}{b}"))
            })
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Vocab(e.to_string()))?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, false, true);
        if let Some(re) = regex {
            // The model's own split regex, then byte-level mapping without the GPT-2 regex.
            let split = Split::new(
                SplitPattern::Regex(re.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Vocab(format!("pre-tokenizer {pre:?}: {e}")))?;
            tk.with_pre_tokenizer(Some(Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, false, false).into(),
            ])));
        } else if digits {
            tk.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                byte_level.into(),
            ])));
        } else {
            tk.with_pre_tokenizer(Some(byte_level));
        }

        let unicode_to_byte = byte_decoder();
        let bytes: Vec<Box<[u8]>> = tokens
            .iter()
            .zip(&kinds)
            .map(|(t, k)| match k {
                TokenKind::Normal | TokenKind::Unknown => t
                    .chars()
                    .map(|c| unicode_to_byte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| t.as_bytes().to_vec()),
                TokenKind::Byte => parse_byte_token(t)
                    .map(|b| vec![b])
                    .unwrap_or_else(|| t.as_bytes().to_vec()),
                _ => t.as_bytes().to_vec(),
            })
            .map(Vec::into_boxed_slice)
            .collect();

        let mut specials: Vec<(String, TokenId, bool)> = tokens
            .iter()
            .zip(&kinds)
            .enumerate()
            .filter(|(_, (t, k))| {
                matches!(k, TokenKind::Control | TokenKind::UserDefined) && !t.is_empty()
            })
            .map(|(i, (t, k))| (t.clone(), i as TokenId, *k == TokenKind::UserDefined))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut special_first_bytes = [false; 256];
        for (t, _, _) in &specials {
            special_first_bytes[usize::from(t.as_bytes()[0])] = true;
        }
        let max_token_bytes = bytes.iter().map(|b| b.len()).max().unwrap_or(1).max(1);
        Ok(Tokenizer {
            max_token_bytes,
            bpe: tk,
            tokens,
            kinds,
            bytes,
            specials,
            special_first_bytes,
            bos: None,
            eos: None,
            eog: Vec::new(),
            add_bos: false,
        })
    }

    /// Tokenizes `text`. With `parse_special`, control-token texts become control tokens. No BOS is added;
    /// see [`Tokenizer::add_bos`].
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<TokenId>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut plain_start = 0;
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if self.special_first_bytes[usize::from(bytes[i])] {
                let rest = &text[i..];
                let hit = self.specials.iter().find(|(t, _, always)| {
                    (parse_special || *always) && rest.starts_with(t.as_str())
                });
                if let Some((t, id, _)) = hit {
                    self.encode_plain(&text[plain_start..i], &mut out)?;
                    out.push(*id);
                    i += t.len();
                    plain_start = i;
                    continue;
                }
            }
            i += 1;
        }
        self.encode_plain(&text[plain_start..], &mut out)?;
        Ok(out)
    }

    /// Tokenizes generated text the way it was generated: the texts of the control tokens in `shown` (those
    /// the output shows, see `Request::shown_controls`) become those tokens, the rest is plain text.
    pub fn encode_showing(
        &self,
        text: &str,
        shown: &[TokenId],
    ) -> Result<Vec<TokenId>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut rest = text;
        loop {
            let next = shown
                .iter()
                .filter_map(|&id| {
                    let t = std::str::from_utf8(self.token_bytes(id)).ok()?;
                    Some((rest.find(t).filter(|_| !t.is_empty())?, t.len(), id))
                })
                .min_by_key(|&(at, len, _)| (at, std::cmp::Reverse(len)));
            let Some((at, len, id)) = next else { break };
            self.encode_plain(&rest[..at], &mut out)?;
            out.push(id);
            rest = &rest[at + len..];
        }
        self.encode_plain(rest, &mut out)?;
        Ok(out)
    }

    /// The control token whose text is exactly `text`, if the vocabulary has one.
    pub fn control_id(&self, text: &str) -> Option<TokenId> {
        self.specials
            .iter()
            .find(|(t, id, _)| t == text && self.is_control(*id))
            .map(|(_, id, _)| *id)
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<TokenId>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        let enc = self
            .bpe
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// The raw bytes of one token (control tokens render as their text). Out-of-range ids give no bytes.
    pub fn token_bytes(&self, id: TokenId) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], |b| b)
    }

    /// Concatenated bytes of `ids`; `render_special` decides whether control tokens appear as their text.
    pub fn decode_bytes(&self, ids: &[TokenId], render_special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            if render_special || !self.is_control(id) {
                out.extend_from_slice(self.token_bytes(id));
            }
        }
        out
    }

    /// Decodes `ids` to text; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD.
    pub fn decode(&self, ids: &[TokenId], render_special: bool) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, render_special)).into_owned()
    }

    /// Whether `id` is a control token.
    pub fn is_control(&self, id: TokenId) -> bool {
        self.kinds.get(id as usize) == Some(&TokenKind::Control)
    }

    /// The vocabulary entry of `id` as stored in the GGUF.
    pub fn token_text(&self, id: TokenId) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a token whose vocabulary entry is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<TokenId> {
        self.tokens
            .iter()
            .position(|t| t == text)
            .map(|i| i as TokenId)
    }

    /// Bytes of the longest token: a text longer than `n` times this has more than `n` tokens.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn bos(&self) -> Option<TokenId> {
        self.bos
    }

    /// End-of-sequence token, if the model has one.
    pub fn eos(&self) -> Option<TokenId> {
        self.eos
    }

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// End-of-generation tokens: EOS, EOT and the control tokens that close a turn.
    pub fn eog(&self) -> &[TokenId] {
        &self.eog
    }

    /// Whether `id` ends a generation.
    pub fn is_eog(&self, id: TokenId) -> bool {
        self.eog.contains(&id)
    }

    /// A fresh streaming detokenizer for this vocabulary.
    pub fn detokenizer(&self, render_special: bool) -> Detokenizer<'_> {
        Detokenizer::new(self, render_special)
    }
}

/// `<0x0A>` -> 0x0A.
fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// GPT-2's byte-to-unicode table, inverted: printable bytes map to themselves, the other 68 bytes to
/// U+0100.. in order.
fn byte_decoder() -> HashMap<char, u8> {
    let mut m = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("U+0100..U+0143 are chars")
        };
        m.insert(c, b);
    }
    m
}

#[cfg(test)]
mod tests;
