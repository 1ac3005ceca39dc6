//! Streaming detokenization that never splits a UTF-8 character.

use super::{TokenId, Tokenizer};

/// Turns a stream of token ids into text deltas.
///
/// Byte-level BPE tokens can end in the middle of a multi-byte character (an emoji is often two tokens).
/// The detokenizer holds such a tail back until the character completes, so every delta it returns is valid
/// UTF-8 and the concatenation of all deltas (plus [`Detokenizer::finish`]) equals the lossy decoding of all
/// ids. Bytes that can never become valid UTF-8 are replaced with U+FFFD as soon as that is certain.
#[derive(Debug)]
pub struct Detokenizer<'t> {
    tok: &'t Tokenizer,
    state: DetokState,
}

impl<'t> Detokenizer<'t> {
    pub(super) fn new(tok: &'t Tokenizer, render_special: bool) -> Self {
        Detokenizer {
            tok,
            state: DetokState::new(render_special),
        }
    }

    /// Adds one token and appends whatever text is now complete to `out`. Returns the bytes appended.
    pub fn push(&mut self, id: TokenId, out: &mut String) -> usize {
        self.state.push(self.tok, id, out)
    }

    /// Whether bytes are being held back (an incomplete character).
    pub fn has_pending(&self) -> bool {
        self.state.has_pending()
    }

    /// Ends the stream: an incomplete tail becomes U+FFFD.
    pub fn finish(&mut self, out: &mut String) {
        self.state.finish(out);
    }
}

/// A [`Detokenizer`] that does not borrow its tokenizer: each call is handed one (for state that lives
/// across engine steps).
#[derive(Debug, Default, Clone)]
pub struct DetokState {
    render_special: bool,
    /// Control tokens rendered even without `render_special`.
    shown: Vec<TokenId>,
    pending: Vec<u8>,
}

impl DetokState {
    /// A fresh stream; `render_special` renders control tokens as text.
    pub fn new(render_special: bool) -> Self {
        DetokState {
            render_special,
            shown: Vec::new(),
            pending: Vec::with_capacity(8),
        }
    }

    /// A fresh stream that renders only the control tokens in `shown` as text.
    pub fn showing(shown: &[TokenId]) -> Self {
        DetokState {
            shown: shown.to_vec(),
            ..DetokState::new(false)
        }
    }

    /// [`Detokenizer::push`] with `tok` as the tokenizer.
    pub fn push(&mut self, tok: &Tokenizer, id: TokenId, out: &mut String) -> usize {
        if !self.render_special && tok.is_control(id) && !self.shown.contains(&id) {
            return 0;
        }
        self.pending.extend_from_slice(tok.token_bytes(id));
        let before = out.len();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // The prefix was just validated by from_utf8; the conversion cannot fail.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid]).unwrap_or_default(),
                    );
                    match e.error_len() {
                        // An incomplete character at the end: keep it for the next token.
                        None => {
                            start = valid;
                            break;
                        }
                        // Bytes that can never start a valid character: replace and go on.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out.len() - before
    }

    /// Whether bytes are being held back (an incomplete character).
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: an incomplete tail becomes U+FFFD.
    pub fn finish(&mut self, out: &mut String) {
        if !self.pending.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
    }
}
