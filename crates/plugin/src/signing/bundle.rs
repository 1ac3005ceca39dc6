//! Keyless signatures: sigstore bundles (a short-lived Fulcio certificate naming the signer's OIDC
//! identity, the signature, and the Rekor entry that timestamps it), checked offline against a pinned
//! [`TrustedRoot`] and the identities (issuer + subject) the policy trusts.
//!
//! Two places hold them. cosign 3 (and `thorn plugins attach`) stores a bundle
//! (`application/vnd.dev.sigstore.bundle.v0.3+json`) as an OCI referrer of the manifest it signs: a
//! message signature over the manifest, or a DSSE envelope whose in-toto statement (predicate
//! [`COSIGN_SIGN_PREDICATE`]) has the manifest's digest as its subject. cosign 2 stores a keyless signature
//! like a keyed one, at the `.sig` tag, with the certificate and the Rekor entry in the layer's
//! annotations ([`CERTIFICATE`], [`REKOR_BUNDLE`]); [`from_cosign_layer`] turns that into a v0.1 bundle so
//! both go through one verifier.
//!
//! The checks: the certificate chains to an authority of the trust root that was valid when the log
//! integrated the entry, with the code-signing usage and an embedded SCT from a CT log of the root; the
//! signature verifies with the certificate's key over the digest asked about (for DSSE, some subject of
//! the statement is that digest); the log entry's body matches the signature and certificate (the sigstore
//! crate's verifier, which does these); the log's signed entry timestamp, inclusion proof and checkpoint
//! verify, and the certificate was valid at that time ([`super::transparency`]); the certificate names a
//! trusted identity.

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::future::Future;
use std::task::{Context, Poll, Waker};
use x509_cert::der::Decode;

use super::root::TrustedRoot;
use super::transparency::{self, Entry, TlogError};
use super::{Rejection, SignatureLayer};

/// A sigstore bundle's media type (v0.3), also the artifact type of its OCI referrer.
pub const BUNDLE_V03: &str = "application/vnd.dev.sigstore.bundle.v0.3+json";
/// The predicate of cosign's DSSE image signatures.
pub const COSIGN_SIGN_PREDICATE: &str = "https://sigstore.dev/cosign/sign/v1";
/// cosign 2's keyless `.sig` layer annotation holding the signing certificate (PEM).
pub const CERTIFICATE: &str = "dev.sigstore.cosign/certificate";
/// cosign 2's keyless `.sig` layer annotation holding the Rekor entry (signed entry timestamp and payload).
pub const REKOR_BUNDLE: &str = "dev.sigstore.cosign/bundle";

/// Fulcio's OIDC issuer extensions: v2 (a DER UTF8String) and the older raw-string one.
const ISSUER_V2: &str = "1.3.6.1.4.1.57264.1.8";
const ISSUER_V1: &str = "1.3.6.1.4.1.57264.1.1";

/// A keyless signer the policy trusts: the OIDC issuer and the subject (the certificate's e-mail or URI
/// name, as cosign's `--certificate-oidc-issuer` and `--certificate-identity` take them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// The OIDC issuer (`https://token.actions.githubusercontent.com`, `https://accounts.google.com`).
    pub issuer: String,
    /// The identity: an e-mail, or a workflow URI such as
    /// `https://github.com/ORG/REPO/.github/workflows/release.yml@refs/tags/v1.0.0`.
    pub subject: String,
}

/// Who a verified bundle says signed, and when the log recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signer {
    /// The identity the certificate names.
    pub identity: Identity,
    /// The log index of the entry.
    pub log_index: u64,
    /// When the log integrated it (Unix seconds).
    pub integrated_time: u64,
}

/// Why a bundle is not a valid signature of the digest.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// Not a bundle, or one missing a part.
    #[error("the sigstore bundle is malformed: {0}")]
    Malformed(String),
    /// The log entry does not vouch for it.
    #[error("{0}")]
    Tlog(#[from] TlogError),
    /// No authority of the trust root was valid when the entry was integrated.
    #[error("no certificate authority of the trust root was valid at {0}")]
    NoAuthority(u64),
    /// The certificate chain, SCT, signature or log body does not verify.
    #[error("the sigstore bundle does not verify: {0}")]
    Verification(String),
    /// A DSSE envelope that is not a cosign signature (an attestation of something else).
    #[error("the sigstore bundle's statement is a {0:?} attestation, not a cosign signature")]
    Predicate(String),
}

/// The verifier is async, but offline it never waits: poll it once.
fn now_or_never<F: Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

fn b64(s: &str) -> Result<Vec<u8>, BundleError> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| BundleError::Malformed(format!("bad base64: {e}")))
}

/// The leaf certificate's DER.
fn leaf(v: &Value) -> Result<Vec<u8>, BundleError> {
    let m = &v["verificationMaterial"];
    let raw = m["certificate"]["rawBytes"]
        .as_str()
        .or_else(|| m["x509CertificateChain"]["certificates"][0]["rawBytes"].as_str())
        .ok_or_else(|| BundleError::Malformed("no signing certificate (a keyed bundle?)".into()))?;
    b64(raw)
}

/// The identities a certificate names: its e-mail/URI subject alternative names, and its issuer.
fn identities(der: &[u8]) -> Result<(Vec<String>, String), BundleError> {
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;
    let cert = x509_cert::Certificate::from_der(der)
        .map_err(|e| BundleError::Malformed(format!("the certificate: {e}")))?;
    let tbs = cert.tbs_certificate();
    let names = match tbs.get_extension::<SubjectAltName>() {
        Ok(Some((_, san))) => san
            .0
            .iter()
            .filter_map(|n| match n {
                GeneralName::Rfc822Name(s) => Some(s.to_string()),
                GeneralName::UniformResourceIdentifier(s) => Some(s.to_string()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let ext = |oid: &str| {
        tbs.extensions()
            .into_iter()
            .flatten()
            .find(|e| e.extn_id.to_string() == oid)
            .map(|e| e.extn_value.as_bytes().to_vec())
    };
    let issuer = match (ext(ISSUER_V2), ext(ISSUER_V1)) {
        (Some(v2), _) => x509_cert::der::asn1::Utf8StringRef::from_der(&v2)
            .map(|s| s.as_str().to_owned())
            .map_err(|e| BundleError::Malformed(format!("the issuer extension: {e}")))?,
        (None, Some(v1)) => String::from_utf8(v1)
            .map_err(|_| BundleError::Malformed("the issuer extension is not text".into()))?,
        (None, None) => {
            return Err(BundleError::Malformed(
                "the certificate names no OIDC issuer (not a Fulcio certificate)".into(),
            ));
        }
    };
    Ok((names, issuer))
}

/// A policy that accepts any certificate: the identity is checked against the policy's list here, after
/// the cryptography, so a refusal can say who signed.
struct AnyIdentity;

impl sigstore::bundle::verify::VerificationPolicy for AnyIdentity {
    fn verify(&self, _: &x509_cert::Certificate) -> sigstore::bundle::verify::policy::PolicyResult {
        Ok(())
    }
}

/// Checks that `bundle` (JSON) signs the SHA-256 `digest`, under `root`, by one of `trusted`.
pub fn check(
    bundle: &[u8],
    digest: &[u8; 32],
    root: &TrustedRoot,
    trusted: &[Identity],
) -> Result<Signer, Rejection> {
    let v: Value =
        serde_json::from_slice(bundle).map_err(|e| BundleError::Malformed(e.to_string()))?;
    let media = v["mediaType"].as_str().unwrap_or_default();
    let v01 = media == "application/vnd.dev.sigstore.bundle+json;version=0.1";
    let entries = v["verificationMaterial"]["tlogEntries"]
        .as_array()
        .filter(|e| e.len() == 1)
        .ok_or_else(|| BundleError::Malformed("not exactly one transparency log entry".into()))?;
    let entry: Entry = serde_json::from_value(entries[0].clone())
        .map_err(|e| BundleError::Malformed(format!("its log entry: {e}")))?;
    let t = transparency::check(&entry, root, !v01).map_err(BundleError::from)?;

    if let Some(payload) = v["dsseEnvelope"]["payload"].as_str() {
        let statement: Value = serde_json::from_slice(&b64(payload)?)
            .map_err(|e| BundleError::Malformed(format!("its statement: {e}")))?;
        let predicate = statement["predicateType"].as_str().unwrap_or_default();
        if predicate != COSIGN_SIGN_PREDICATE {
            return Err(BundleError::Predicate(predicate.to_owned()).into());
        }
    }

    // The authorities valid when the log recorded the entry (the certificate is checked at its own
    // issue time by the verifier, and against the entry's time below).
    let fulcio_certs = root
        .authorities
        .iter()
        .filter(|a| a.valid.contains(t))
        .flat_map(|a| a.chain.iter())
        .map(|c| rustls::pki_types::CertificateDer::from(c.as_slice()))
        .collect::<Vec<_>>();
    if fulcio_certs.is_empty() {
        return Err(BundleError::NoAuthority(t).into());
    }
    let manual = sigstore::trust::ManualTrustRoot {
        fulcio_certs,
        rekor_keys: BTreeMap::new(),
        ctfe_keys: root
            .ctlogs
            .iter()
            .enumerate()
            .map(|(i, k)| (format!("ct{i}"), k.clone()))
            .collect(),
    };
    let verifier = sigstore::bundle::verify::Verifier::new(Default::default(), manual)
        .map_err(|e| BundleError::Verification(format!("the trust root: {e}")))?;
    let parsed: sigstore::bundle::Bundle =
        serde_json::from_value(v.clone()).map_err(|e| BundleError::Malformed(e.to_string()))?;
    now_or_never(verifier.verify_digest_with(
        sigstore::bundle::verify::ArtifactDigest::Sha256(*digest),
        parsed,
        &AnyIdentity,
        true,
    ))
    .ok_or_else(|| BundleError::Verification("the verifier went online".into()))?
    .map_err(|e| BundleError::Verification(chain(&e)))?;

    let (names, issuer) = identities(&leaf(&v)?)?;
    let Some(subject) = names.iter().find(|n| {
        trusted
            .iter()
            .any(|i| i.issuer == issuer && &&i.subject == n)
    }) else {
        return Err(Rejection::Identity {
            subjects: names,
            issuer,
        });
    };
    Ok(Signer {
        identity: Identity {
            issuer,
            subject: subject.clone(),
        },
        log_index: entry.log_index,
        integrated_time: t,
    })
}

/// An error and its causes on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A v0.1 bundle from cosign 2's keyless `.sig` layer (certificate and Rekor entry in annotations), for
/// [`check`] against the SHA-256 of the layer's payload; `None` when the layer has no certificate (a
/// keyed signature).
pub fn from_cosign_layer(layer: &SignatureLayer) -> Option<Result<Vec<u8>, BundleError>> {
    let pem = layer.annotations.get(CERTIFICATE)?;
    Some((|| {
        let malformed = |w: &str| BundleError::Malformed(format!("the keyless signature's {w}"));
        let (_, der) = x509_cert::der::pem::decode_vec(pem.trim().as_bytes())
            .map_err(|_| malformed("certificate"))?;
        let rekor: Value = serde_json::from_str(
            layer
                .annotations
                .get(REKOR_BUNDLE)
                .ok_or_else(|| malformed("Rekor bundle (missing)"))?,
        )
        .map_err(|_| malformed("Rekor bundle"))?;
        let p = &rekor["Payload"];
        let body = p["body"].as_str().ok_or_else(|| malformed("log body"))?;
        let kind: Value = serde_json::from_slice(&b64(body)?).map_err(|_| malformed("log body"))?;
        let log_id = p["logID"]
            .as_str()
            .and_then(crate::host::unhex)
            .ok_or_else(|| malformed("log ID"))?;
        let signature = layer
            .annotations
            .get(super::keyed::SIGNATURE)
            .ok_or_else(|| malformed("signature (missing)"))?;
        let e = base64::engine::general_purpose::STANDARD;
        let bundle = json!({
            "mediaType": "application/vnd.dev.sigstore.bundle+json;version=0.1",
            "verificationMaterial": {
                "x509CertificateChain": {"certificates": [{"rawBytes": e.encode(der)}]},
                "tlogEntries": [{
                    "logIndex": p["logIndex"].as_u64().ok_or_else(|| malformed("log index"))?.to_string(),
                    "logId": {"keyId": e.encode(log_id)},
                    "kindVersion": {"kind": kind["kind"], "version": kind["apiVersion"]},
                    "integratedTime": p["integratedTime"].as_u64().ok_or_else(|| malformed("log time"))?.to_string(),
                    "inclusionPromise": {"signedEntryTimestamp": rekor["SignedEntryTimestamp"]},
                    "canonicalizedBody": body,
                }],
            },
            "messageSignature": {
                "messageDigest": {"algorithm": "SHA2_256", "digest": e.encode(Sha256::digest(&layer.payload))},
                "signature": signature,
            },
        });
        Ok(serde_json::to_vec(&bundle).expect("a JSON value serializes"))
    })())
}
