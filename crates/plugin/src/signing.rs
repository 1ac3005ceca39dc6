//! Whose signature a plugin pulled from a registry carries, checked against the operator's policy
//! (`trust`): cosign's keyed signatures ([`keyed`]: ECDSA P-256 keys the policy lists) and keyless ones
//! ([`bundle`]: sigstore bundles, a Fulcio certificate naming an OIDC identity and a Rekor entry, checked
//! offline against a pinned [`TrustedRoot`] and the identities the policy lists).
//!
//! What is verified is always the digest of the manifest whose layer is installed and pinned
//! ([`Subject`]): a signature is looked up by that digest and must name it, so a tag moved to other bytes
//! after signing is refused, not trusted on the strength of the old signature. What was found
//! ([`Evidence`]) is kept beside the installed plugin, so approving it later checks it again, offline,
//! against the policy's trust at that time.

pub mod bundle;
pub mod keyed;
mod root;
mod transparency;

pub use bundle::{BundleError, Identity, Signer};
pub use root::{RootError, TrustedRoot};
pub use transparency::TlogError;

use p256::ecdsa::VerifyingKey;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

use crate::Policy;

/// The artifact a signature must name.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// How it was asked for (`oci://HOST/REPO:TAG`), for messages.
    pub reference: &'a str,
    /// `HOST/REPO`, as simple-signing payloads name it.
    pub repository: &'a str,
    /// `sha256:<hex>` of the manifest whose layer is installed.
    pub digest: &'a str,
}

/// A layer of a `.sig` artifact: its payload and annotations (the signature; for keyless, the certificate
/// and Rekor entry).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignatureLayer {
    /// The payload (simple-signing JSON), base64 when stored.
    #[serde(with = "base64_bytes")]
    pub payload: Vec<u8>,
    /// The layer's annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// The signatures found for a manifest: `.sig` layers and sigstore bundles (JSON) attached as referrers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// Layers at the manifest's `.sig` tag.
    #[serde(default)]
    pub signatures: Vec<SignatureLayer>,
    /// Sigstore bundles referring to the manifest.
    #[serde(default)]
    pub bundles: Vec<String>,
}

impl Evidence {
    /// Whether nothing was found.
    pub fn is_empty(&self) -> bool {
        self.signatures.is_empty() && self.bundles.is_empty()
    }
}

mod base64_bytes {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        base64::engine::general_purpose::STANDARD
            .decode(String::deserialize(d)?)
            .map_err(serde::de::Error::custom)
    }
}

/// Whose signatures the policy trusts.
#[derive(Debug, Clone, Default)]
pub struct Trust {
    /// Keys for keyed signatures.
    pub keys: Vec<VerifyingKey>,
    /// Keyless signers.
    pub identities: Vec<Identity>,
    /// The trust root keyless signatures chain to (present whenever `identities` is not empty).
    pub root: Option<TrustedRoot>,
}

/// A policy's trust that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// A key does not parse.
    #[error("the policy's trust.keys[{index}]: {source}")]
    Key {
        /// Which.
        index: usize,
        /// Why.
        source: keyed::KeyError,
    },
    /// The trust root cannot be read.
    #[error("the policy's trust.trusted_root: {0}")]
    Root(#[from] RootError),
    /// Identities without a trust root.
    #[error("the policy's trust.identities need trust.trusted_root (a sigstore trusted_root.json)")]
    NoRoot,
}

impl Trust {
    /// The trust `policy` states (keys parsed, the trust root read).
    pub fn of(policy: &Policy) -> Result<Self, TrustError> {
        let keys = policy
            .trusted_keys()
            .iter()
            .enumerate()
            .map(|(index, pem)| {
                keyed::verifying_key(pem).map_err(|source| TrustError::Key { index, source })
            })
            .collect::<Result<_, _>>()?;
        let identities = policy.trusted_identities().to_vec();
        let root = match policy.trusted_root() {
            Some(p) => Some(TrustedRoot::load(&p)?),
            None if !identities.is_empty() => return Err(TrustError::NoRoot),
            None => None,
        };
        Ok(Self {
            keys,
            identities,
            root,
        })
    }

    /// Whether the policy trusts no one in particular (nothing is checked).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.identities.is_empty()
    }
}

/// Why one signature is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    /// A `.sig` layer that is not a simple-signing payload.
    #[error("a signature layer is not a simple-signing payload")]
    NotAPayload,
    /// It signs another manifest.
    #[error("it names {named}")]
    OtherDigest {
        /// `HOST/REPO@DIGEST` it names.
        named: String,
    },
    /// A keyed signature that no trusted key verifies.
    #[error("no key the policy trusts verifies it")]
    BadSignature,
    /// A keyless signature by someone the policy does not trust.
    #[error("signed by {subjects:?} (issuer {issuer}), not an identity the policy trusts")]
    Identity {
        /// The identities its certificate names.
        subjects: Vec<String>,
        /// Its OIDC issuer.
        issuer: String,
    },
    /// A keyless signature that does not verify.
    #[error("{0}")]
    Bundle(#[from] BundleError),
    /// A keyed signature, and the policy lists no keys.
    #[error("a keyed signature, and the policy trusts no keys")]
    NoKeys,
    /// A keyless signature, and the policy lists no identities.
    #[error("a keyless signature, and the policy trusts no identities")]
    NoIdentities,
}

/// Why a pulled artifact is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// No signature at all.
    #[error(
        "{reference}: not signed (no signature at the tag {tag} and no sigstore bundle referring to {digest}); the policy trusts only plugins signed by its keys or identities"
    )]
    Unsigned {
        /// The artifact.
        reference: String,
        /// Where a keyed or cosign 2 signature would be.
        tag: String,
        /// The manifest digest.
        digest: String,
    },
    /// Every signature names another manifest.
    #[error("{reference}: its signatures name {named}, not the manifest pulled ({pulled})")]
    OtherDigest {
        /// The artifact.
        reference: String,
        /// What the first names.
        named: String,
        /// The digest of the manifest pulled.
        pulled: String,
    },
    /// Keyed signatures, none verifying under a trusted key.
    #[error(
        "{reference}: no signature verifies with a key the policy trusts ({n} signature(s) tried)"
    )]
    BadSignature {
        /// The artifact.
        reference: String,
        /// Signatures tried.
        n: usize,
    },
    /// Signatures, none trusted, for the reasons given (one per signature).
    #[error("{reference}: no signature is trusted: {}", list(.reasons))]
    Untrusted {
        /// The artifact.
        reference: String,
        /// Why each was refused.
        reasons: Vec<Rejection>,
    },
}

fn list(r: &[Rejection]) -> String {
    r.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// A trusted signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verified {
    /// Keyed, by the policy's `trust.keys[index]`.
    Key(usize),
    /// Keyless, by a trusted identity.
    Keyless(Signer),
}

impl std::fmt::Display for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verified::Key(i) => write!(f, "signed with trust.keys[{i}]"),
            Verified::Keyless(s) => write!(
                f,
                "signed by {} (issuer {}), transparency log entry {} at {}",
                s.identity.subject,
                s.identity.issuer,
                s.log_index,
                humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_secs(s.integrated_time)
                ),
            ),
        }
    }
}

/// Checks a bundle signing the SHA-256 `digest` against the trusted identities.
fn keyless(bundle: &[u8], digest: &[u8; 32], trust: &Trust) -> Result<Signer, Rejection> {
    match (&trust.root, trust.identities.is_empty()) {
        (Some(root), false) => bundle::check(bundle, digest, root, &trust.identities),
        _ => Err(Rejection::NoIdentities),
    }
}

/// Checks that `evidence` holds a signature of `subject` the policy's `trust` accepts.
pub fn verify(
    subject: &Subject<'_>,
    evidence: &Evidence,
    trust: &Trust,
) -> Result<Verified, VerifyError> {
    if evidence.is_empty() {
        return Err(VerifyError::Unsigned {
            reference: subject.reference.to_owned(),
            tag: keyed::signature_tag(subject.digest),
            digest: subject.digest.to_owned(),
        });
    }
    let digest: Option<[u8; 32]> = subject
        .digest
        .strip_prefix("sha256:")
        .and_then(crate::host::unhex)
        .and_then(|v| v.try_into().ok());
    let mut reasons = Vec::new();
    for layer in &evidence.signatures {
        let outcome = match bundle::from_cosign_layer(layer) {
            None if trust.keys.is_empty() => Err(Rejection::NoKeys),
            None => keyed::check(subject, layer, &trust.keys).map(Verified::Key),
            // cosign 2's keyless layer: its payload names the subject, the bundle signs the payload.
            Some(b) => b.map_err(Rejection::from).and_then(|b| {
                keyed::names(subject, &layer.payload)?;
                keyless(&b, &Sha256::digest(&layer.payload).into(), trust).map(Verified::Keyless)
            }),
        };
        match outcome {
            Ok(v) => return Ok(v),
            Err(r) => reasons.push(r),
        }
    }
    for b in &evidence.bundles {
        let outcome = match &digest {
            Some(d) => keyless(b.as_bytes(), d, trust),
            None => Err(Rejection::Bundle(BundleError::Malformed(format!(
                "the manifest digest {} is not SHA-256",
                subject.digest
            )))),
        };
        match outcome {
            Ok(s) => return Ok(Verified::Keyless(s)),
            Err(r) => reasons.push(r),
        }
    }
    let reference = subject.reference.to_owned();
    if let Some(Rejection::OtherDigest { named }) = reasons.first()
        && reasons
            .iter()
            .all(|r| matches!(r, Rejection::OtherDigest { .. }))
    {
        return Err(VerifyError::OtherDigest {
            reference,
            named: named.clone(),
            pulled: subject.digest.to_owned(),
        });
    }
    if reasons.iter().all(|r| {
        matches!(
            r,
            Rejection::BadSignature | Rejection::OtherDigest { .. } | Rejection::NotAPayload
        )
    }) {
        let n = reasons
            .iter()
            .filter(|r| matches!(r, Rejection::BadSignature))
            .count();
        return Err(VerifyError::BadSignature { reference, n });
    }
    Err(VerifyError::Untrusted { reference, reasons })
}
