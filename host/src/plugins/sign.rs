//! Signatures of plugin artifacts in cosign's keyed format: ECDSA P-256 (SHA-256, ASN.1 DER) over the
//! simple-signing payload that names the artifact's manifest digest, stored in the same repository at the
//! tag `sha256-<hex>.sig` as a layer of type `application/vnd.dev.cosign.simplesigning.v1+json` whose
//! `dev.cosignproject.cosign/signature` annotation holds the signature (base64): the layout `cosign sign
//! --key` writes (interoperation with the cosign binary itself is not tested here).
//!
//! The digest verified is the digest of the manifest whose layer `pull` checked and installs: the
//! signatures are looked up by that digest, and each payload must name it, so a tag moved to other bytes
//! after signing is refused, not trusted on the strength of the old signature.

use anyhow::{Context, Result};
use base64::Engine;
use p256::ecdsa::signature::{Signer, Verifier};
use p256::ecdsa::{DerSignature, SigningKey, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey, DecodePublicKey};
use serde_json::{Value, json};

/// A signature layer as stored: its payload, and the signature its annotation holds (if any).
pub type SignatureLayer = (Vec<u8>, Option<String>);

/// The signature layer's media type.
pub const SIMPLESIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation holding the signature.
pub const SIGNATURE: &str = "dev.cosignproject.cosign/signature";

/// Why a pulled artifact is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// No signature artifact for the manifest's digest.
    #[error(
        "{reference}: not signed (no signature at the tag {tag}); the policy trusts only plugins signed by its keys"
    )]
    Unsigned {
        /// The artifact.
        reference: String,
        /// Where its signature would be.
        tag: String,
    },
    /// Signatures exist at the tag, but none names the manifest pulled.
    #[error("{reference}: its signatures name {named}, not the manifest pulled ({pulled})")]
    OtherDigest {
        /// The artifact.
        reference: String,
        /// The digest the payloads name.
        named: String,
        /// The digest of the manifest pulled.
        pulled: String,
    },
    /// No signature verifies under a trusted key.
    #[error(
        "{reference}: no signature verifies with a key the policy trusts ({n} signature(s) tried)"
    )]
    BadSignature {
        /// The artifact.
        reference: String,
        /// Signatures tried.
        n: usize,
    },
}

/// The tag a manifest's signatures are stored at.
pub fn signature_tag(manifest_digest: &str) -> String {
    format!("{}.sig", manifest_digest.replace(':', "-"))
}

/// The simple-signing payload for `repository` (`HOST/REPO`) at `manifest_digest`.
pub fn payload(repository: &str, manifest_digest: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "critical": {
            "identity": {"docker-reference": repository},
            "image": {"docker-manifest-digest": manifest_digest},
            "type": "cosign container image signature",
        },
        "optional": null,
    }))
    .expect("a JSON value serializes")
}

/// A P-256 private key from PEM: SEC1 (`EC PRIVATE KEY`, as `openssl ecparam -name prime256v1 -genkey`
/// writes, its `EC PARAMETERS` block before it skipped) or PKCS#8 (`PRIVATE KEY`).
pub fn signing_key(pem: &str) -> Result<SigningKey> {
    if let Some(start) = pem.find("-----BEGIN EC PRIVATE KEY-----") {
        let sec1 = &pem[start..];
        let key = p256::SecretKey::from_sec1_pem(sec1).context("not a P-256 SEC1 private key")?;
        return Ok(key.into());
    }
    SigningKey::from_pkcs8_pem(pem).context("not a P-256 private key in PEM (SEC1 or PKCS#8)")
}

/// A P-256 public key from PEM (`PUBLIC KEY`, as `openssl ec -pubout` writes).
pub fn verifying_key(pem: &str) -> Result<VerifyingKey> {
    VerifyingKey::from_public_key_pem(pem.trim()).context("not a P-256 public key in PEM")
}

/// The signature of `payload` (base64 of ASN.1 DER).
pub fn sign(key: &SigningKey, payload: &[u8]) -> String {
    let sig: DerSignature = key.sign(payload);
    base64::engine::general_purpose::STANDARD.encode(sig.as_bytes())
}

/// Checks the signature layers found at a manifest's signature tag: some payload names `digest` and
/// `repository` and its signature verifies under one of `keys`.
pub fn verify(
    reference: &str,
    repository: &str,
    digest: &str,
    layers: &[SignatureLayer],
    keys: &[VerifyingKey],
) -> Result<(), VerifyError> {
    let mut named = None;
    let mut tried = 0;
    for (body, sig) in layers {
        let Ok(p) = serde_json::from_slice::<Value>(body) else {
            continue;
        };
        let critical = &p["critical"];
        let says = critical["image"]["docker-manifest-digest"]
            .as_str()
            .unwrap_or_default();
        if says != digest || critical["identity"]["docker-reference"] != repository {
            named = Some(says.to_owned());
            continue;
        }
        let Some(sig) = sig
            .as_deref()
            .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
            .and_then(|b| DerSignature::from_bytes(&b).ok())
        else {
            tried += 1;
            continue;
        };
        tried += 1;
        if keys.iter().any(|k| k.verify(body, &sig).is_ok()) {
            return Ok(());
        }
    }
    match (tried, named) {
        (0, Some(named)) => Err(VerifyError::OtherDigest {
            reference: reference.to_owned(),
            named,
            pulled: digest.to_owned(),
        }),
        (n, _) => Err(VerifyError::BadSignature {
            reference: reference.to_owned(),
            n,
        }),
    }
}

/// The keys a policy trusts, parsed (a key that does not parse is an error naming it).
pub fn trusted(pems: &[String]) -> Result<Vec<VerifyingKey>> {
    pems.iter()
        .enumerate()
        .map(|(i, p)| verifying_key(p).with_context(|| format!("the policy's trust.keys[{i}]")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SigningKey {
        SigningKey::from_slice(&[7u8; 32]).unwrap()
    }

    #[test]
    fn a_signature_verifies_only_for_its_digest_repository_and_key() {
        let k = key();
        let vk = *k.verifying_key();
        let other = *SigningKey::from_slice(&[9u8; 32]).unwrap().verifying_key();
        let (repo, d) = ("127.0.0.1:5000/tools/calc", "sha256:abcd");
        let body = payload(repo, d);
        let layer = vec![(body.clone(), Some(sign(&k, &body)))];
        verify("r", repo, d, &layer, &[vk]).unwrap();
        assert!(matches!(
            verify("r", repo, d, &layer, &[other]),
            Err(VerifyError::BadSignature { n: 1, .. })
        ));
        assert!(matches!(
            verify("r", repo, "sha256:ffff", &layer, &[vk]),
            Err(VerifyError::OtherDigest { .. })
        ));
        assert!(matches!(
            verify("r", "elsewhere/repo", d, &layer, &[vk]),
            Err(VerifyError::OtherDigest { .. })
        ));
        // A payload changed after signing does not verify.
        let mut changed = body.clone();
        changed.push(b' ');
        let forged = vec![(changed, Some(sign(&k, &body)))];
        assert!(verify("r", repo, d, &forged, &[vk]).is_err());
        assert_eq!(signature_tag("sha256:abcd"), "sha256-abcd.sig");
    }
}
