//! A reasoning token budget: when a thinking model has written `tokens` tokens inside its think block and
//! not closed it, the engine writes the closing tag for it and the model goes on to answer.
//!
//! Where the block is, and so where the tag is forced, is a function of the tokens generated so far (their
//! text), tracked as each token is taken: plain decoding and the verification of a draft tree take the same
//! tokens one by one, so they force the tag at the same token and speculation still changes nothing.

use crate::tokenizer::TokenId;

/// A request's reasoning budget.
#[derive(Debug, Clone, PartialEq)]
pub struct ThinkBudget {
    /// Most tokens the model writes inside the block.
    pub tokens: usize,
    /// The prompt opened the block (a template whose generation prompt ends with the opening tag); else
    /// it opens when the output starts with `open`.
    pub opened: bool,
    /// The opening tag (`<think>`).
    pub open: String,
    /// The closing tag (`</think>`): written by the model, it ends the block.
    pub close: String,
    /// What the engine writes when the budget is spent: the closing tag in the model's own tokens (with the
    /// line breaks its template puts around it).
    pub close_tokens: Vec<TokenId>,
}

/// Where a generation is with respect to its think block.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ThinkState {
    /// Not yet known whether the output opens a block: its leading text so far.
    Maybe(String),
    /// Inside the block from generated token `since` on; `tail`: the last bytes of its text, where a
    /// closing tag split over tokens is found.
    Inside { since: usize, tail: String },
    /// Past the block, or there was none.
    Done,
}

impl ThinkState {
    /// The state before the first generated token.
    pub(crate) fn new(b: &ThinkBudget) -> Self {
        if b.opened {
            ThinkState::Inside {
                since: 0,
                tail: String::new(),
            }
        } else {
            ThinkState::Maybe(String::new())
        }
    }

    /// After the `n`-th generated token, whose text is `text`.
    pub(crate) fn push(&mut self, b: &ThinkBudget, n: usize, text: &str) {
        match self {
            ThinkState::Maybe(held) => {
                held.push_str(text);
                let t = held.trim_start();
                if let Some(rest) = t.strip_prefix(b.open.as_str()) {
                    let rest = rest.to_owned();
                    *self = ThinkState::Inside {
                        since: n,
                        tail: String::new(),
                    };
                    self.push(b, n, &rest);
                } else if !b.open.starts_with(t) {
                    *self = ThinkState::Done;
                }
            }
            ThinkState::Inside { tail, .. } => {
                tail.push_str(text);
                if tail.contains(b.close.as_str()) {
                    *self = ThinkState::Done;
                } else if tail.len() > b.close.len() {
                    let mut cut = tail.len() - b.close.len();
                    while !tail.is_char_boundary(cut) {
                        cut += 1;
                    }
                    tail.drain(..cut);
                }
            }
            ThinkState::Done => {}
        }
    }

    /// Whether the budget is spent with the block still open, after `n` generated tokens.
    pub(crate) fn spent(&self, b: &ThinkBudget, n: usize) -> bool {
        matches!(self, ThinkState::Inside { since, .. } if n.saturating_sub(*since) >= b.tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(opened: bool) -> ThinkBudget {
        ThinkBudget {
            tokens: 3,
            opened,
            open: "<think>".into(),
            close: "</think>".into(),
            close_tokens: vec![1, 2],
        }
    }

    #[test]
    fn the_block_is_found_in_the_text_whatever_the_tokens() {
        let b = budget(false);
        let mut s = ThinkState::new(&b);
        // The opening tag over two tokens, after a space.
        s.push(&b, 1, " <thi");
        assert!(matches!(s, ThinkState::Maybe(_)));
        s.push(&b, 2, "nk>so");
        assert_eq!(
            s,
            ThinkState::Inside {
                since: 2,
                tail: "so".into()
            }
        );
        assert!(!s.spent(&b, 4) && s.spent(&b, 5));
        // The closing tag over two tokens ends it.
        s.push(&b, 3, " done</th");
        s.push(&b, 4, "ink>\n");
        assert_eq!(s, ThinkState::Done);
        assert!(!s.spent(&b, 100));
        // No block: nothing is ever forced.
        let mut s = ThinkState::new(&b);
        s.push(&b, 1, "Hello");
        assert_eq!(s, ThinkState::Done);
        // A prompt that opened the block counts from the first token.
        let b = budget(true);
        let s = ThinkState::new(&b);
        assert!(!s.spent(&b, 2) && s.spent(&b, 3));
    }
}
