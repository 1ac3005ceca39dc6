//! Who a plugin call is made for: the conversation, the API key and the peer address, as the audit log
//! records them.
//!
//! Every field is client-influenced (a conversation id is chosen by the client, a peer address comes off the
//! socket), so each is bounded and restricted to a small alphabet before it reaches the log: one request
//! cannot write an unbounded line or forge a record with a newline or a quote. The API layer calls
//! [`validate_conversation_id`] on the request and answers 400 on [`CallerError`]; [`Caller::validate`] is
//! checked again before every call, which is refused (and audited without the offending field) otherwise.

use thiserror::Error;

/// The longest id or address accepted, in bytes.
pub const MAX_ID_BYTES: usize = 128;

/// A caller field that is too long, empty or has characters outside its alphabet.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid {field}: {reason}")]
pub struct CallerError {
    /// Which field (`conversation id`, `key id`, `peer address`).
    pub field: &'static str,
    /// What is wrong with it (never the value itself, which may be huge).
    pub reason: String,
}

/// Who a call is made for. Every field is optional: the CLI knows none of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    /// The conversation (client-chosen): at most [`MAX_ID_BYTES`] bytes of `[A-Za-z0-9._:-]`.
    pub conversation: Option<String>,
    /// The id of the API key the request authenticated with (never the key itself); same alphabet.
    pub key_id: Option<String>,
    /// The peer's socket address, e.g. `127.0.0.1:50123` or `[::1]:50123`.
    pub peer: Option<String>,
    /// The request (one agent run, all its rounds) the call is part of: a per-request budget counts by it.
    pub request: Option<String>,
}

impl Caller {
    /// Checks every field that is set.
    pub fn validate(&self) -> Result<(), CallerError> {
        if let Some(c) = &self.conversation {
            validate_conversation_id(c)?;
        }
        if let Some(k) = &self.key_id {
            check("key id", k, is_id_char)?;
        }
        if let Some(p) = &self.peer {
            check("peer address", p, |b| is_id_char(b) || b"[]%".contains(&b))?;
        }
        if let Some(r) = &self.request {
            check("request id", r, is_id_char)?;
        }
        Ok(())
    }

    /// The fields that are valid (the others dropped), for recording a refused call.
    pub fn valid_parts(&self) -> Caller {
        let keep = |v: &Option<String>, ok: fn(&str) -> bool| v.clone().filter(|s| ok(s));
        Caller {
            conversation: keep(&self.conversation, |s| validate_conversation_id(s).is_ok()),
            key_id: keep(&self.key_id, |s| check("", s, is_id_char).is_ok()),
            peer: keep(&self.peer, |s| {
                check("", s, |b| is_id_char(b) || b"[]%".contains(&b)).is_ok()
            }),
            request: keep(&self.request, |s| check("", s, is_id_char).is_ok()),
        }
    }
}

/// Whether `id` may be used as a conversation id: 1 to [`MAX_ID_BYTES`] bytes of `[A-Za-z0-9._:-]`.
pub fn validate_conversation_id(id: &str) -> Result<(), CallerError> {
    check("conversation id", id, is_id_char)
}

fn is_id_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"._:-".contains(&b)
}

fn check(field: &'static str, s: &str, ok: impl Fn(u8) -> bool) -> Result<(), CallerError> {
    let bad = |reason: String| Err(CallerError { field, reason });
    if s.is_empty() {
        return bad("empty".into());
    }
    if s.len() > MAX_ID_BYTES {
        return bad(format!(
            "{} bytes, more than the limit of {MAX_ID_BYTES}",
            s.len()
        ));
    }
    match s.bytes().position(|b| !ok(b)) {
        Some(i) => bad(format!("a character not allowed at byte {i}")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_bounded_and_plain() {
        assert!(validate_conversation_id("conv-1.a:b_C").is_ok());
        assert!(validate_conversation_id(&"a".repeat(MAX_ID_BYTES)).is_ok());
        let long = validate_conversation_id(&"a".repeat(4 << 20)).unwrap_err();
        assert_eq!(long.field, "conversation id");
        assert!(long.to_string().len() < 200, "{long}");
        for bad in ["", "a b", "a\nb", "a\"b", "é", "a/b"] {
            assert!(validate_conversation_id(bad).is_err(), "{bad:?}");
        }
        let c = Caller {
            conversation: Some("ok".into()),
            key_id: Some("key 1".into()),
            peer: Some("[::1]:8080".into()),
            request: None,
        };
        assert_eq!(c.validate().unwrap_err().field, "key id");
        let kept = c.valid_parts();
        assert_eq!(
            (
                kept.conversation.as_deref(),
                kept.key_id,
                kept.peer.as_deref()
            ),
            (Some("ok"), None, Some("[::1]:8080"))
        );
        assert!(Caller::default().validate().is_ok());
    }
}
