//! API keys: who a request is, and which host tools and endpoints it may use.
//!
//! Keys are kept as their SHA-256 digests, never as text, and a presented key is hashed and compared with
//! every stored digest in constant time (no early exit, no length leak), so response timing says nothing
//! about how much of a key was right. Each key has an id (recorded in the audit log, never the secret), an
//! optional allow-list of host tools (plugin names or plugin function names; absent = every installed
//! plugin), an optional allow-list of upstream engines (absent = every `--upstream`; `[]` = none, so its
//! requests stay local), whether it may read `/metrics`, whether it is an operator's (`operator`:
//! it may latch and release the e-stop), and whether it may decide calls waiting for approval
//! (`approve`: list them, approve or deny them; never its own requests' calls unless the policy allows).
//!
//! The key file (`thorn serve --api-keys FILE`) is JSON:
//! `{"keys": [{"id": "robot-1", "sha256": "<hex of the key>", "tools": ["calculator"], "upstreams": [],
//! "metrics": false, "operator": false, "approve": false}]}`
//! (`printf %s "$KEY" | sha256sum` gives the digest). Keys given on the command line (`--api-key`) or in
//! `THORN_API_KEYS` may use every tool, read `/metrics`, operate the e-stop and decide approvals.

use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::path::Path;
use thiserror::Error;

/// A key file that cannot be used.
#[derive(Debug, Error)]
pub enum KeyError {
    /// The file cannot be read.
    #[error("cannot read the API key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid key file.
    #[error("invalid API key file {path}: {msg}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },
}

/// One accepted key.
#[derive(Debug, Clone)]
pub struct ApiKey {
    id: String,
    digest: [u8; 32],
    tools: Option<Vec<String>>,
    upstreams: Option<Vec<String>>,
    metrics: bool,
    operator: bool,
    approve: bool,
}

impl ApiKey {
    /// A key given as its secret text: every host tool, `/metrics` allowed.
    pub fn new(id: impl Into<String>, secret: &str) -> Self {
        ApiKey {
            id: id.into(),
            digest: Sha256::digest(secret.as_bytes()).into(),
            tools: None,
            upstreams: None,
            metrics: true,
            operator: true,
            approve: true,
        }
    }

    /// Limits the key to these upstream engines (`--upstream` names; empty: none).
    pub fn with_upstreams(mut self, upstreams: Vec<String>) -> Self {
        self.upstreams = Some(upstreams);
        self
    }

    /// Whether the key may have its requests served by the upstream `name`.
    pub fn may_use_upstream(&self, name: &str) -> bool {
        self.upstreams
            .as_ref()
            .is_none_or(|u| u.iter().any(|n| n == name))
    }

    /// Limits the key to these host tools (plugin or function names).
    pub fn with_tools(mut self, tools: Vec<String>) -> Self {
        self.tools = Some(tools);
        self
    }

    /// Whether the key may read `/metrics`.
    pub fn with_metrics(mut self, on: bool) -> Self {
        self.metrics = on;
        self
    }

    /// The key's id (what the audit log records).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether the key may run the host tool `function` of plugin `plugin`.
    pub fn may_use(&self, plugin: &str, function: &str) -> bool {
        self.tools
            .as_ref()
            .is_none_or(|t| t.iter().any(|n| n == plugin || n == function))
    }

    /// Whether the key may read `/metrics`.
    pub fn may_read_metrics(&self) -> bool {
        self.metrics
    }

    /// Whether the key is an operator's (it may latch and release the e-stop).
    pub fn may_operate(&self) -> bool {
        self.operator
    }

    /// Whether the key is an operator's.
    pub fn with_operator(mut self, on: bool) -> Self {
        self.operator = on;
        self
    }

    /// Whether the key may decide calls waiting for approval.
    pub fn may_approve(&self) -> bool {
        self.approve
    }

    /// Whether the key may decide calls waiting for approval.
    pub fn with_approve(mut self, on: bool) -> Self {
        self.approve = on;
        self
    }
}

/// The accepted keys (none: no authentication).
#[derive(Debug, Clone, Default)]
pub struct Keys {
    keys: Vec<ApiKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    keys: Vec<KeyEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    id: String,
    sha256: String,
    #[serde(default)]
    tools: Option<Vec<String>>,
    #[serde(default)]
    upstreams: Option<Vec<String>>,
    #[serde(default)]
    metrics: bool,
    #[serde(default)]
    operator: bool,
    #[serde(default)]
    approve: bool,
}

impl Keys {
    /// Keys from secrets (`--api-key`), with ids `key-1`, `key-2`, ...
    pub fn from_secrets<S: AsRef<str>>(secrets: &[S]) -> Self {
        Keys {
            keys: secrets
                .iter()
                .enumerate()
                .map(|(i, s)| ApiKey::new(format!("key-{}", i + 1), s.as_ref()))
                .collect(),
        }
    }

    /// Adds a key.
    pub fn push(&mut self, key: ApiKey) {
        self.keys.push(key);
    }

    /// Reads a key file (see the module docs).
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
            path: p.clone(),
            source,
        })?;
        Self::parse(&text).map_err(|msg| KeyError::Invalid { path: p, msg })
    }

    /// Parses a key file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let f: KeyFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let mut keys = Keys::default();
        for e in f.keys {
            if e.id.is_empty() || e.id.len() > 64 || !e.id.bytes().all(is_id_byte) {
                return Err(format!(
                    "key id {:?}: use 1 to 64 of A-Z a-z 0-9 . _ : -",
                    e.id
                ));
            }
            if keys.keys.iter().any(|k| k.id == e.id) {
                return Err(format!("key id {:?} appears twice", e.id));
            }
            let digest = parse_digest(&e.sha256)
                .ok_or_else(|| format!("key {:?}: sha256 must be 64 hex digits", e.id))?;
            keys.keys.push(ApiKey {
                id: e.id,
                digest,
                tools: e.tools,
                upstreams: e.upstreams,
                metrics: e.metrics,
                operator: e.operator,
                approve: e.approve,
            });
        }
        Ok(keys)
    }

    /// Adds every key of `other`.
    pub fn merge(&mut self, other: Keys) {
        self.keys.extend(other.keys);
    }

    /// Whether any key is configured (authentication is on).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key `presented` is, if any: every stored digest is compared, in constant time.
    pub fn check(&self, presented: &str) -> Option<&ApiKey> {
        let d: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut found = None;
        for k in &self.keys {
            if ct_eq(&k.digest, &d) {
                found = Some(k);
            }
        }
        found
    }
}

fn is_id_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Equality of two digests without data-dependent branches.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_by_digest_only() {
        let k = Keys::from_secrets(&["alpha", "beta"]);
        assert_eq!(k.check("beta").map(ApiKey::id), Some("key-2"));
        assert!(k.check("bet").is_none() && k.check("betaa").is_none() && k.check("").is_none());
        assert!(!format!("{k:?}").contains("alpha"), "secrets are not kept");
    }

    #[test]
    fn key_files_give_ids_tool_lists_and_metrics_rights() {
        let sha = |s: &str| {
            Sha256::digest(s.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        let text = format!(
            r#"{{"keys": [{{"id": "robot-1", "sha256": "{}", "tools": ["calculator", "read_file"]}},
                {{"id": "ops", "sha256": "{}", "tools": [], "metrics": true}}]}}"#,
            sha("r0b0t"),
            sha("0ps")
        );
        let keys = Keys::parse(&text).unwrap();
        let robot = keys.check("r0b0t").unwrap();
        assert_eq!(robot.id(), "robot-1");
        assert!(robot.may_use("calculator", "evaluate"));
        assert!(robot.may_use("files", "read_file"));
        assert!(!robot.may_use("memory", "remember"));
        assert!(!robot.may_read_metrics());
        let ops = keys.check("0ps").unwrap();
        assert!(ops.may_read_metrics() && !ops.may_use("calculator", "evaluate"));
        // No upstream list: every upstream; a list: those only (empty: none).
        assert!(robot.may_use_upstream("big"));
        let text = format!(
            r#"{{"keys": [{{"id": "edge", "sha256": "{}", "upstreams": []}},
                {{"id": "lab", "sha256": "{}", "upstreams": ["big"]}}]}}"#,
            sha("e"),
            sha("l")
        );
        let keys = Keys::parse(&text).unwrap();
        assert!(!keys.check("e").unwrap().may_use_upstream("big"));
        let lab = keys.check("l").unwrap();
        assert!(lab.may_use_upstream("big") && !lab.may_use_upstream("other"));
        for bad in [
            r#"{"keys": [{"id": "a", "sha256": "xyz"}]}"#,
            r#"{"keys": [{"id": "a b", "sha256": "00"}]}"#,
            r#"{"keys": [{"id": "a", "sha256": "00", "extra": 1}]}"#,
        ] {
            assert!(Keys::parse(bad).is_err(), "{bad}");
        }
    }
}
