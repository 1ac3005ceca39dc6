//! A pinned sigstore trust root: the `trusted_root.json` of sigstore's protobuf specs (media type
//! `application/vnd.dev.sigstore.trustedroot+json;version=0.1`), as sigstore's TUF repository publishes it
//! and `cosign trusted-root create` writes it for a private deployment. Nothing is fetched: the operator
//! pins the file, and updating it is an operator's step.

use base64::Engine;
use p256::ecdsa::VerifyingKey;
use p256::pkcs8::DecodePublicKey;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Why a trust root cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// The file cannot be read.
    #[error("reading the trust root {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not a trusted root document.
    #[error("the trust root {path} is not a sigstore trusted_root.json: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// A time window (`validFor`) in Unix seconds; an open end is `None`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Window {
    start: u64,
    end: Option<u64>,
}

impl Window {
    pub(super) fn contains(&self, t: u64) -> bool {
        t >= self.start && self.end.is_none_or(|e| t <= e)
    }
}

/// A transparency log's key (Rekor), by the log ID entries name it with.
#[derive(Debug, Clone)]
pub(super) struct LogKey {
    pub(super) id: Vec<u8>,
    pub(super) key: VerifyingKey,
    pub(super) valid: Window,
}

/// A certificate authority (Fulcio): its chain, leaf-most first, in DER.
#[derive(Debug, Clone)]
pub(super) struct Authority {
    pub(super) chain: Vec<Vec<u8>>,
    pub(super) valid: Window,
}

/// The pinned trust root.
#[derive(Debug, Clone)]
pub struct TrustedRoot {
    pub(super) authorities: Vec<Authority>,
    pub(super) tlogs: Vec<LogKey>,
    /// Certificate transparency logs' keys (SPKI DER).
    pub(super) ctlogs: Vec<Vec<u8>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Doc {
    media_type: String,
    #[serde(default)]
    tlogs: Vec<Log>,
    #[serde(default)]
    certificate_authorities: Vec<Ca>,
    #[serde(default)]
    ctlogs: Vec<Log>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Log {
    public_key: PublicKey,
    log_id: LogId,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PublicKey {
    #[serde(default)]
    raw_bytes: String,
    #[serde(default)]
    key_details: String,
    valid_for: Option<ValidFor>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LogId {
    key_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Ca {
    cert_chain: Chain,
    valid_for: Option<ValidFor>,
}

#[derive(Deserialize)]
struct Chain {
    certificates: Vec<Raw>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    raw_bytes: String,
}

#[derive(Deserialize)]
struct ValidFor {
    start: Option<String>,
    end: Option<String>,
}

fn b64(s: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| format!("bad base64: {e}"))
}

fn time(s: &str) -> Result<u64, String> {
    let t = humantime::parse_rfc3339(s).map_err(|e| format!("bad time {s:?}: {e}"))?;
    Ok(t.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs())
}

fn window(v: &Option<ValidFor>) -> Result<Window, String> {
    let Some(v) = v else {
        return Ok(Window {
            start: 0,
            end: None,
        });
    };
    Ok(Window {
        start: v.start.as_deref().map(time).transpose()?.unwrap_or(0),
        end: v.end.as_deref().map(time).transpose()?,
    })
}

impl TrustedRoot {
    /// Reads and checks the trust root at `path`.
    pub fn load(path: &Path) -> Result<Self, RootError> {
        let bytes = std::fs::read(path).map_err(|source| RootError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&bytes).map_err(|why| RootError::Invalid {
            path: path.to_owned(),
            why,
        })
    }

    /// A trust root from the JSON document's bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let doc: Doc = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if !doc
            .media_type
            .starts_with("application/vnd.dev.sigstore.trustedroot")
        {
            return Err(format!("media type {:?}", doc.media_type));
        }
        let mut tlogs = Vec::new();
        for (i, log) in doc.tlogs.iter().enumerate() {
            // Rekor v1's keys are ECDSA P-256; another kind of key cannot vouch for an entry here.
            if log.public_key.key_details != "PKIX_ECDSA_P256_SHA_256" {
                continue;
            }
            let der = b64(&log.public_key.raw_bytes).map_err(|e| format!("tlogs[{i}]: {e}"))?;
            let key = VerifyingKey::from_public_key_der(&der)
                .map_err(|e| format!("tlogs[{i}]: not a P-256 key: {e}"))?;
            tlogs.push(LogKey {
                id: b64(&log.log_id.key_id).map_err(|e| format!("tlogs[{i}]: {e}"))?,
                key,
                valid: window(&log.public_key.valid_for).map_err(|e| format!("tlogs[{i}]: {e}"))?,
            });
        }
        let mut authorities = Vec::new();
        for (i, ca) in doc.certificate_authorities.iter().enumerate() {
            let chain = ca
                .cert_chain
                .certificates
                .iter()
                .map(|c| b64(&c.raw_bytes))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("certificateAuthorities[{i}]: {e}"))?;
            authorities.push(Authority {
                chain,
                valid: window(&ca.valid_for)
                    .map_err(|e| format!("certificateAuthorities[{i}]: {e}"))?,
            });
        }
        let ctlogs = doc
            .ctlogs
            .iter()
            .map(|l| b64(&l.public_key.raw_bytes))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("ctlogs: {e}"))?;
        if authorities.is_empty() {
            return Err("no certificate authority".into());
        }
        if tlogs.is_empty() {
            return Err("no transparency log with an ECDSA P-256 key".into());
        }
        Ok(Self {
            authorities,
            tlogs,
            ctlogs,
        })
    }

    /// The log key an entry names by `id`.
    pub(super) fn tlog(&self, id: &[u8]) -> Option<&LogKey> {
        self.tlogs.iter().find(|l| l.id == id)
    }
}

/// Now in Unix seconds.
pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs()
}
