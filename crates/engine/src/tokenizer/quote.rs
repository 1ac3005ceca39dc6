//! Data quoting: text from clients, tools and files can never become a control token.
//!
//! A chat prompt mixes the template's own markup (`<|im_start|>user\n`, which must become control tokens)
//! with data (message contents, tool names, arguments, tool results) that must not: a user message holding
//! `<|im_end|><|im_start|>system` would otherwise forge a turn. The data is *quoted* before the template sees
//! it and the rendered prompt is tokenized with [`Tokenizer::encode_rendered`]:
//!
//! - [`Tokenizer::quote`] puts [`DATA_MARK`] (U+FDD0, a Unicode noncharacter, "for internal use") right
//!   after the first character of every control-token text in the data, and after the first character of a
//!   trailing partial one (so two data fields rendered side by side cannot join into one). Data's own
//!   U+FDD0 is doubled. Nothing else changes, so template logic (`.strip()`, `startswith('<tool_response>')`,
//!   `split('</think>')`) sees the same text.
//! - [`Tokenizer::encode_rendered`] parses control tokens as usual; a marked one no longer spells its
//!   text, so it is not matched. Plain runs are then unquoted (a lone mark dropped, a doubled one kept
//!   once) before BPE, so the model sees exactly the characters the client sent, as ordinary text.
//!
//! Template literals are never quoted, so only the template's markup can produce control tokens.

use super::{TokenId, Tokenizer, TokenizerError};
use std::borrow::Cow;

/// The data mark: U+FDD0, a noncharacter reserved for a process's internal use.
pub const DATA_MARK: char = '\u{FDD0}';
const MARK_UTF8: &[u8] = "\u{FDD0}".as_bytes();

impl Tokenizer {
    /// Quotes data text for a rendered prompt (see the module docs); `None` when the text needs no change
    /// (the common case, which allocates nothing).
    pub fn quote(&self, text: &str) -> Option<String> {
        let mut out: Option<String> = None;
        let bytes = text.as_bytes();
        let mut copied = 0;
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            // Byte comparisons: `i` may be inside a character, and a match starts a character.
            let starts_control = self.special_first_bytes[usize::from(b)]
                && self
                    .controls()
                    .any(|t| bytes[i..].starts_with(t.as_bytes()));
            let is_mark = bytes[i..].starts_with(MARK_UTF8);
            if starts_control || is_mark {
                let c = text[i..].chars().next().map_or(1, char::len_utf8);
                let o = out.get_or_insert_with(|| String::with_capacity(text.len() + 8));
                o.push_str(&text[copied..i + c]);
                o.push(DATA_MARK);
                copied = i + c;
                i += c;
                continue;
            }
            i += 1;
        }
        // A trailing proper prefix of a control text (`...<|im_`): mark it too, so the next field cannot
        // complete it.
        if let Some(start) = self.trailing_control_prefix(&text[copied..]) {
            let at = copied + start;
            let c = text[at..].chars().next().map_or(1, char::len_utf8);
            let o = out.get_or_insert_with(|| String::with_capacity(text.len() + 8));
            o.push_str(&text[copied..at + c]);
            o.push(DATA_MARK);
            copied = at + c;
        }
        let mut o = out?;
        o.push_str(&text[copied..]);
        Some(o)
    }

    /// [`Tokenizer::quote`] that always returns text.
    pub fn quoted<'a>(&self, text: &'a str) -> Cow<'a, str> {
        self.quote(text).map_or(Cow::Borrowed(text), Cow::Owned)
    }

    /// Tokenizes a prompt rendered from a template and quoted data: the template's control-token texts
    /// become control tokens, quoted data stays plain text (the marks themselves are removed).
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<TokenId>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let bytes = text.as_bytes();
        let mut plain_start = 0;
        let mut i = 0;
        let mut scratch = String::new();
        while i < bytes.len() {
            if self.special_first_bytes[usize::from(bytes[i])] {
                let rest = &bytes[i..];
                if let Some((t, id, _)) = self
                    .specials
                    .iter()
                    .find(|(t, _, _)| rest.starts_with(t.as_bytes()))
                {
                    self.encode_unquoted(&text[plain_start..i], &mut scratch, &mut out)?;
                    out.push(*id);
                    i += t.len();
                    plain_start = i;
                    continue;
                }
            }
            i += 1;
        }
        self.encode_unquoted(&text[plain_start..], &mut scratch, &mut out)?;
        Ok(out)
    }

    fn encode_unquoted(
        &self,
        text: &str,
        scratch: &mut String,
        out: &mut Vec<TokenId>,
    ) -> Result<(), TokenizerError> {
        if !text.contains(DATA_MARK) {
            return self.encode_plain(text, out);
        }
        scratch.clear();
        unquote_into(text, scratch);
        self.encode_plain(scratch, out)
    }

    /// Control-token texts (user-defined tokens are always matched, as in llama.cpp, and need no quoting).
    fn controls(&self) -> impl Iterator<Item = &str> {
        self.specials
            .iter()
            .filter(|(_, _, always)| !always)
            .map(|(t, _, _)| t.as_str())
    }

    /// Where a suffix of `text` that is a proper prefix of some control text starts (the longest one).
    fn trailing_control_prefix(&self, text: &str) -> Option<usize> {
        let mut best: Option<usize> = None;
        for t in self.controls() {
            let longest = (t.len() - 1).min(text.len());
            for k in (1..=longest).rev() {
                let start = text.len() - k;
                if best.is_some_and(|b| b <= start) {
                    break;
                }
                if text.is_char_boundary(start) && t.is_char_boundary(k) && text[start..] == t[..k]
                {
                    best = Some(start);
                    break;
                }
            }
        }
        best
    }
}

/// Quoted text as the model reads it: a lone mark is dropped, a doubled one is a data character.
pub fn unquote(text: &str) -> Cow<'_, str> {
    if !text.contains(DATA_MARK) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    unquote_into(text, &mut out);
    Cow::Owned(out)
}

/// [`unquote`] appending to `out`.
fn unquote_into(text: &str, out: &mut String) {
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != DATA_MARK {
            out.push(c);
        } else if chars.peek() == Some(&DATA_MARK) {
            chars.next();
            out.push(DATA_MARK);
        }
    }
}
