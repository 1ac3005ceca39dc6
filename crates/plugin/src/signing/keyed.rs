//! cosign's keyed format: ECDSA P-256 (SHA-256, ASN.1 DER) over the simple-signing payload that names
//! the artifact's manifest digest, stored in the artifact's repository at the tag `sha256-<hex>.sig` as a
//! layer of type [`SIMPLESIGNING`] whose [`SIGNATURE`] annotation holds the signature (base64): the
//! layout `cosign sign --key` writes.

use base64::Engine;
use p256::ecdsa::signature::{Signer, Verifier};
use p256::ecdsa::{DerSignature, SigningKey, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey, DecodePublicKey};
use serde_json::{Value, json};

use super::{Rejection, SignatureLayer, Subject};

/// The signature layer's media type.
pub const SIMPLESIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation holding the signature.
pub const SIGNATURE: &str = "dev.cosignproject.cosign/signature";

/// A key that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Not a P-256 private key in PEM.
    #[error("not a P-256 private key in PEM (SEC1 or PKCS#8)")]
    Private,
    /// Not a P-256 public key in PEM.
    #[error("not a P-256 public key in PEM")]
    Public,
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

/// What a simple-signing payload names: (repository, manifest digest); `None` for another document.
pub fn named(payload: &[u8]) -> Option<(String, String)> {
    let p = serde_json::from_slice::<Value>(payload).ok()?;
    let critical = &p["critical"];
    Some((
        critical["identity"]["docker-reference"]
            .as_str()?
            .to_owned(),
        critical["image"]["docker-manifest-digest"]
            .as_str()?
            .to_owned(),
    ))
}

/// A P-256 private key from PEM: SEC1 (`EC PRIVATE KEY`, as `openssl ecparam -name prime256v1 -genkey`
/// writes, its `EC PARAMETERS` block before it skipped) or PKCS#8 (`PRIVATE KEY`).
pub fn signing_key(pem: &str) -> Result<SigningKey, KeyError> {
    if let Some(start) = pem.find("-----BEGIN EC PRIVATE KEY-----") {
        let key = p256::SecretKey::from_sec1_pem(&pem[start..]).map_err(|_| KeyError::Private)?;
        return Ok(key.into());
    }
    SigningKey::from_pkcs8_pem(pem).map_err(|_| KeyError::Private)
}

/// A P-256 public key from PEM (`PUBLIC KEY`, as `openssl ec -pubout` writes).
pub fn verifying_key(pem: &str) -> Result<VerifyingKey, KeyError> {
    VerifyingKey::from_public_key_pem(pem.trim()).map_err(|_| KeyError::Public)
}

/// The signature of `payload` (base64 of ASN.1 DER).
pub fn sign(key: &SigningKey, payload: &[u8]) -> String {
    let sig: DerSignature = key.sign(payload);
    base64::engine::general_purpose::STANDARD.encode(sig.as_bytes())
}

/// Checks that a `.sig` layer's payload (keyed or keyless alike) names `subject`.
pub(super) fn names(subject: &Subject<'_>, payload: &[u8]) -> Result<(), Rejection> {
    let (repository, digest) = named(payload).ok_or(Rejection::NotAPayload)?;
    if digest != subject.digest || repository != subject.repository {
        return Err(Rejection::OtherDigest {
            named: format!("{repository}@{digest}"),
        });
    }
    Ok(())
}

/// Checks one keyed signature layer: its payload names `subject` and its signature verifies under one of
/// `keys`; the index of the key that verifies it.
pub(super) fn check(
    subject: &Subject<'_>,
    layer: &SignatureLayer,
    keys: &[VerifyingKey],
) -> Result<usize, Rejection> {
    names(subject, &layer.payload)?;
    let sig = layer
        .annotations
        .get(SIGNATURE)
        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
        .and_then(|b| DerSignature::from_bytes(&b).ok())
        .ok_or(Rejection::BadSignature)?;
    keys.iter()
        .position(|k| k.verify(&layer.payload, &sig).is_ok())
        .ok_or(Rejection::BadSignature)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_signature_verifies_only_for_its_digest_repository_and_key() {
        let k = SigningKey::from_slice(&[7u8; 32]).unwrap();
        let vk = *k.verifying_key();
        let other = *SigningKey::from_slice(&[9u8; 32]).unwrap().verifying_key();
        let (repo, d) = ("127.0.0.1:5000/tools/calc", "sha256:abcd");
        let subject = |repository, digest| Subject {
            reference: "r",
            repository,
            digest,
        };
        let body = payload(repo, d);
        let layer = |payload: Vec<u8>, sig: String| SignatureLayer {
            payload,
            annotations: BTreeMap::from([(SIGNATURE.to_owned(), sig)]),
        };
        let signed = layer(body.clone(), sign(&k, &body));
        check(&subject(repo, d), &signed, &[vk]).unwrap();
        assert!(matches!(
            check(&subject(repo, d), &signed, &[other]),
            Err(Rejection::BadSignature)
        ));
        assert!(matches!(
            check(&subject(repo, "sha256:ffff"), &signed, &[vk]),
            Err(Rejection::OtherDigest { .. })
        ));
        assert!(matches!(
            check(&subject("elsewhere/repo", d), &signed, &[vk]),
            Err(Rejection::OtherDigest { .. })
        ));
        // A payload changed after signing does not verify.
        let mut changed = body.clone();
        changed.push(b' ');
        let forged = layer(changed, sign(&k, &body));
        assert!(check(&subject(repo, d), &forged, &[vk]).is_err());
        assert_eq!(signature_tag("sha256:abcd"), "sha256-abcd.sig");
    }
}
