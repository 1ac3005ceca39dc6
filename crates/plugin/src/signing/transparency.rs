//! The transparency log entry a sigstore bundle carries (Rekor v1), checked offline against the pinned
//! log keys: the signed entry timestamp (the log's promise that it integrated this body at this time,
//! which makes the time trustworthy) and, where present, the Merkle inclusion proof up to a checkpoint
//! the log signed (RFC 9162's verification algorithm; the checkpoint is a signed note).
//!
//! The sigstore crate checks that the entry's body matches the bundle's signature and certificate, but
//! not these two signatures; without them a forged entry could date a signature from a stolen,
//! long-expired certificate into its validity window.

use base64::Engine;
use p256::ecdsa::DerSignature;
use p256::ecdsa::signature::Verifier;
use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};

use super::root::{LogKey, TrustedRoot, now};
use crate::host::hex;

/// How far in the future an entry's time may be (clock skew).
const SKEW_S: u64 = 300;

/// Why a log entry does not vouch for a signature.
#[derive(Debug, thiserror::Error)]
pub enum TlogError {
    /// The bundle's entry does not parse.
    #[error("its transparency log entry is malformed: {0}")]
    Malformed(String),
    /// No log in the trust root has this ID.
    #[error("its transparency log entry is from a log the trust root does not name")]
    UnknownLog,
    /// The log's key was not valid when the entry says it was integrated.
    #[error("its transparency log entry's time ({0}) is outside the log key's validity")]
    KeyNotValid(u64),
    /// The entry claims a time in the future.
    #[error("its transparency log entry is dated in the future ({0})")]
    Future(u64),
    /// No signed entry timestamp (a Rekor v2 entry, timed by a timestamp authority: not supported).
    #[error(
        "its transparency log entry has no signed entry timestamp (Rekor v2 entries with RFC 3161 timestamps are not supported)"
    )]
    NoPromise,
    /// The signed entry timestamp does not verify.
    #[error("its signed entry timestamp does not verify with the log's key")]
    BadPromise,
    /// A bundle version that must carry an inclusion proof carries none.
    #[error("its transparency log entry has no inclusion proof")]
    NoProof,
    /// The inclusion proof does not lead to the root it states.
    #[error("its inclusion proof does not verify")]
    BadProof,
    /// The checkpoint is missing, not signed by the log, or names another tree.
    #[error("its checkpoint does not verify: {0}")]
    BadCheckpoint(&'static str),
}

/// A log entry as a bundle carries it (protobuf JSON: 64-bit integers as strings).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Entry {
    #[serde(deserialize_with = "int")]
    pub(super) log_index: u64,
    pub(super) log_id: LogId,
    #[serde(deserialize_with = "int")]
    pub(super) integrated_time: u64,
    pub(super) inclusion_promise: Option<Promise>,
    pub(super) inclusion_proof: Option<Proof>,
    pub(super) canonicalized_body: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct LogId {
    pub(super) key_id: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Promise {
    pub(super) signed_entry_timestamp: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Proof {
    #[serde(deserialize_with = "int")]
    log_index: u64,
    root_hash: String,
    #[serde(deserialize_with = "int")]
    tree_size: u64,
    #[serde(default)]
    hashes: Vec<String>,
    checkpoint: Option<Checkpoint>,
}

#[derive(Debug, Deserialize)]
pub(super) struct Checkpoint {
    envelope: String,
}

fn int<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        S(String),
        U(u64),
    }
    match N::deserialize(d)? {
        N::U(n) => Ok(n),
        N::S(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

fn b64(s: &str) -> Result<Vec<u8>, TlogError> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| TlogError::Malformed(format!("bad base64: {e}")))
}

/// What the log signed as the signed entry timestamp: the canonical JSON (RFC 8785: keys sorted, no
/// space) of the entry's body, time, log ID (hex) and index.
pub(super) fn promise_payload(body_b64: &str, time: u64, log_id: &[u8], index: u64) -> String {
    format!(
        r#"{{"body":"{body_b64}","integratedTime":{time},"logID":"{}","logIndex":{index}}}"#,
        hex(log_id)
    )
}

/// RFC 9162's leaf hash.
pub(super) fn leaf_hash(leaf: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update([0u8])
        .chain_update(leaf)
        .finalize()
        .into()
}

/// RFC 9162's interior node hash.
pub(super) fn node_hash(left: &[u8], right: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update([1u8])
        .chain_update(left)
        .chain_update(right)
        .finalize()
        .into()
}

/// The root an inclusion proof leads to from `leaf` at `index` in a tree of `size` (RFC 9162
/// 2.1.3.2); `None` when the proof has the wrong length for that position.
pub(super) fn proof_root(
    index: u64,
    size: u64,
    leaf: [u8; 32],
    proof: &[[u8; 32]],
) -> Option<[u8; 32]> {
    if index >= size {
        return None;
    }
    let (mut f, mut s, mut r) = (index, size - 1, leaf);
    for p in proof {
        if s == 0 {
            return None;
        }
        if f & 1 == 1 || f == s {
            r = node_hash(p, &r);
            while f & 1 == 0 && f != 0 {
                f >>= 1;
                s >>= 1;
            }
        } else {
            r = node_hash(&r, p);
        }
        f >>= 1;
        s >>= 1;
    }
    (s == 0).then_some(r)
}

/// Checks a signed note (`origin\nsize\nroot\n[...]\n\n— name base64(hint || signature)\n`) with the
/// log's key; the tree size and root it states.
fn checkpoint(envelope: &str, log: &LogKey) -> Result<(u64, Vec<u8>), TlogError> {
    let (text, sigs) = envelope
        .split_once("\n\n")
        .ok_or(TlogError::BadCheckpoint("not a signed note"))?;
    let text = format!("{text}\n");
    let signed = sigs.lines().any(|line| {
        let Some(rest) = line.strip_prefix("\u{2014} ") else {
            return false;
        };
        let Some(sig) = rest
            .rsplit_once(' ')
            .and_then(|(_, s)| base64::engine::general_purpose::STANDARD.decode(s).ok())
        else {
            return false;
        };
        sig.len() > 4
            && sig[..4] == log.id[..4.min(log.id.len())]
            && DerSignature::from_bytes(&sig[4..])
                .is_ok_and(|s| log.key.verify(text.as_bytes(), &s).is_ok())
    });
    if !signed {
        return Err(TlogError::BadCheckpoint("no signature by the log's key"));
    }
    let mut lines = text.lines().skip(1);
    let size = lines
        .next()
        .and_then(|l| l.parse().ok())
        .ok_or(TlogError::BadCheckpoint("no tree size"))?;
    let root = lines
        .next()
        .and_then(|l| base64::engine::general_purpose::STANDARD.decode(l).ok())
        .ok_or(TlogError::BadCheckpoint("no root hash"))?;
    Ok((size, root))
}

/// Checks `entry` against the trust root's logs; the time the log vouches it integrated the entry.
/// `require_proof`: the bundle's version requires an inclusion proof (v0.2 and later).
pub(super) fn check(
    entry: &Entry,
    root: &TrustedRoot,
    require_proof: bool,
) -> Result<u64, TlogError> {
    let id = b64(&entry.log_id.key_id)?;
    let log = root.tlog(&id).ok_or(TlogError::UnknownLog)?;
    let t = entry.integrated_time;
    if !log.valid.contains(t) {
        return Err(TlogError::KeyNotValid(t));
    }
    if t > now() + SKEW_S {
        return Err(TlogError::Future(t));
    }
    let body = b64(&entry.canonicalized_body)?;
    let promise = entry
        .inclusion_promise
        .as_ref()
        .ok_or(TlogError::NoPromise)?;
    let set = DerSignature::from_bytes(&b64(&promise.signed_entry_timestamp)?)
        .map_err(|_| TlogError::BadPromise)?;
    let signed = promise_payload(
        &base64::engine::general_purpose::STANDARD.encode(&body),
        t,
        &id,
        entry.log_index,
    );
    log.key
        .verify(signed.as_bytes(), &set)
        .map_err(|_| TlogError::BadPromise)?;
    match &entry.inclusion_proof {
        None if require_proof => Err(TlogError::NoProof),
        None => Ok(t),
        Some(p) => {
            let hashes = p
                .hashes
                .iter()
                .map(|h| {
                    b64(h)?
                        .try_into()
                        .map_err(|_| TlogError::Malformed("a proof hash is not 32 bytes".into()))
                })
                .collect::<Result<Vec<[u8; 32]>, _>>()?;
            let want = b64(&p.root_hash)?;
            let got = proof_root(p.log_index, p.tree_size, leaf_hash(&body), &hashes)
                .ok_or(TlogError::BadProof)?;
            if got[..] != want[..] {
                return Err(TlogError::BadProof);
            }
            let c = p
                .checkpoint
                .as_ref()
                .ok_or(TlogError::BadCheckpoint("missing"))?;
            let (size, root_hash) = checkpoint(&c.envelope, log)?;
            if size != p.tree_size || root_hash != want {
                return Err(TlogError::BadCheckpoint("it names another tree"));
            }
            Ok(t)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 9162's tree hash of `leaves` (test oracle).
    fn mth(leaves: &[[u8; 32]]) -> [u8; 32] {
        if leaves.len() == 1 {
            return leaves[0];
        }
        let k = leaves.len().next_power_of_two() / 2;
        node_hash(&mth(&leaves[..k]), &mth(&leaves[k..]))
    }

    /// RFC 9162's audit path for leaf `m` (test oracle).
    fn path(m: usize, leaves: &[[u8; 32]]) -> Vec<[u8; 32]> {
        if leaves.len() == 1 {
            return vec![];
        }
        let k = leaves.len().next_power_of_two() / 2;
        if m < k {
            let mut p = path(m, &leaves[..k]);
            p.push(mth(&leaves[k..]));
            p
        } else {
            let mut p = path(m - k, &leaves[k..]);
            p.push(mth(&leaves[..k]));
            p
        }
    }

    #[test]
    fn inclusion_proofs_lead_to_the_root_for_every_leaf_of_every_tree_size() {
        for n in 1..=17usize {
            let leaves: Vec<[u8; 32]> = (0..n).map(|i| leaf_hash(&[i as u8])).collect();
            let root = mth(&leaves);
            for m in 0..n {
                let p = path(m, &leaves);
                assert_eq!(
                    proof_root(m as u64, n as u64, leaves[m], &p),
                    Some(root),
                    "{m}/{n}"
                );
                // Another leaf, another position, or a shortened proof does not reach it.
                let other = leaf_hash(b"x");
                assert_ne!(proof_root(m as u64, n as u64, other, &p), Some(root));
                if n > 1 {
                    assert_ne!(
                        proof_root(((m + 1) % n) as u64, n as u64, leaves[m], &p),
                        Some(root)
                    );
                    assert_ne!(
                        proof_root(m as u64, n as u64, leaves[m], &p[1..]),
                        Some(root)
                    );
                }
            }
            assert_eq!(proof_root(n as u64, n as u64, leaves[0], &[]), None);
        }
    }

    #[test]
    fn the_promise_payload_is_canonical_json() {
        let s = promise_payload("eyJ9", 7, &[0xab, 0x01], 42);
        assert_eq!(
            s,
            r#"{"body":"eyJ9","integratedTime":7,"logID":"ab01","logIndex":42}"#
        );
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["logIndex"], 42);
    }
}
