//! A sigstore instance made for a test: a Fulcio-like CA (root and intermediate), a CT log and a Rekor
//! log, each with its own P-256 key, that issue short-lived code-signing certificates for any identity,
//! log signatures and return sigstore bundles (v0.3, a message signature or a DSSE envelope) and cosign
//! 2's keyless `.sig` annotations, with the `trusted_root.json` that pins them. Everything is built here,
//! from the formats' specifications: no sigstore service is reached.

use base64::Engine;
use p256::ecdsa::signature::Signer as _;
use p256::ecdsa::signature::hazmat::PrehashSigner;
use p256::ecdsa::{DerSignature, SigningKey};
use p256::pkcs8::{DecodePrivateKey, EncodePublicKey};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// What a bundle's DSSE variant signs: cosign's image-signature predicate.
pub const COSIGN_SIGN_PREDICATE: &str = "https://sigstore.dev/cosign/sign/v1";

/// How a bundle signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// A message signature over the artifact (its SHA-256).
    Message,
    /// A DSSE envelope over an in-toto statement naming the artifact, with this predicate type.
    Dsse(&'static str),
}

/// A signing to make, and what to get wrong on purpose.
#[derive(Debug, Clone)]
pub struct Signing {
    /// The OIDC issuer the certificate names.
    pub issuer: String,
    /// The identity (e-mail or URI) the certificate names.
    pub subject: String,
    /// Message signature or DSSE.
    pub content: Content,
    /// The log's integrated time minus the certificate's `notBefore` (seconds; a Fulcio certificate is
    /// valid for 600).
    pub signed_after_s: i64,
}

impl Signing {
    /// A message signature by `subject` at `issuer`, a minute into the certificate's life.
    pub fn by(issuer: &str, subject: &str) -> Self {
        Signing {
            issuer: issuer.to_owned(),
            subject: subject.to_owned(),
            content: Content::Message,
            signed_after_s: 60,
        }
    }
}

/// The test's sigstore.
pub struct TestSigstore {
    root: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    intermediate: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    ct: SigningKey,
    rekor: SigningKey,
    /// The log's leaves (entry bodies), so inclusion proofs are real.
    leaves: Vec<[u8; 32]>,
    serial: u8,
}

fn p256_key() -> (rcgen::KeyPair, SigningKey) {
    let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("a P-256 key");
    let sk = SigningKey::from_pkcs8_der(&kp.serialize_der()).expect("the same key for p256");
    (kp, sk)
}

fn spki(k: &SigningKey) -> Vec<u8> {
    k.verifying_key()
        .to_public_key_der()
        .expect("SPKI")
        .as_bytes()
        .to_vec()
}

fn time(unix: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(unix).expect("a time")
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs() as i64
}

/// The content of the first element of a DER SEQUENCE (a certificate's TBSCertificate, with its header).
fn first_element(der: &[u8]) -> &[u8] {
    fn header(b: &[u8]) -> (usize, usize) {
        // (header length, content length) of the element at the start of `b`.
        match b[1] {
            n if n < 0x80 => (2, n as usize),
            n => {
                let k = (n & 0x7f) as usize;
                let len = b[2..2 + k]
                    .iter()
                    .fold(0usize, |a, &x| (a << 8) | x as usize);
                (2 + k, len)
            }
        }
    }
    let (outer, _) = header(der);
    let inner = &der[outer..];
    let (h, len) = header(inner);
    &inner[..h + len]
}

/// DER of a UTF8String.
fn utf8_string(s: &str) -> Vec<u8> {
    assert!(s.len() < 128, "a short string");
    let mut v = vec![0x0c, s.len() as u8];
    v.extend_from_slice(s.as_bytes());
    v
}

fn pem(der: &[u8]) -> String {
    let b = B64.encode(der);
    let mut s = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b.as_bytes().chunks(64) {
        s.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        s.push('\n');
    }
    s.push_str("-----END CERTIFICATE-----\n");
    s
}

/// RFC 9162's hashes (the log's tree).
fn leaf_hash(b: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update([0u8])
        .chain_update(b)
        .finalize()
        .into()
}

fn node(l: &[u8; 32], r: &[u8; 32]) -> [u8; 32] {
    Sha256::new()
        .chain_update([1u8])
        .chain_update(l)
        .chain_update(r)
        .finalize()
        .into()
}

fn tree_hash(leaves: &[[u8; 32]]) -> [u8; 32] {
    if leaves.len() == 1 {
        return leaves[0];
    }
    let k = leaves.len().next_power_of_two() / 2;
    node(&tree_hash(&leaves[..k]), &tree_hash(&leaves[k..]))
}

fn audit_path(m: usize, leaves: &[[u8; 32]]) -> Vec<[u8; 32]> {
    if leaves.len() == 1 {
        return vec![];
    }
    let k = leaves.len().next_power_of_two() / 2;
    let (mut p, other) = if m < k {
        (audit_path(m, &leaves[..k]), tree_hash(&leaves[k..]))
    } else {
        (audit_path(m - k, &leaves[k..]), tree_hash(&leaves[..k]))
    };
    p.push(other);
    p
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A signed certificate timestamp list (RFC 6962) as the extension's DER content.
fn sct_extension(ct: &SigningKey, issuer_spki: &[u8], precert_tbs: &[u8], at_ms: u64) -> Vec<u8> {
    let log_id: [u8; 32] = Sha256::digest(spki(ct)).into();
    let mut signed = vec![0u8, 0u8]; // v1, certificate_timestamp
    signed.extend_from_slice(&at_ms.to_be_bytes());
    signed.extend_from_slice(&1u16.to_be_bytes()); // precert_entry
    signed.extend_from_slice(&Sha256::digest(issuer_spki));
    signed.extend_from_slice(&(precert_tbs.len() as u32).to_be_bytes()[1..]);
    signed.extend_from_slice(precert_tbs);
    signed.extend_from_slice(&0u16.to_be_bytes()); // no extensions
    let sig: DerSignature = ct.sign(&signed);
    let mut sct = vec![0u8];
    sct.extend_from_slice(&log_id);
    sct.extend_from_slice(&at_ms.to_be_bytes());
    sct.extend_from_slice(&0u16.to_be_bytes());
    sct.extend_from_slice(&[4, 3]); // sha256, ecdsa
    sct.extend_from_slice(&(sig.as_bytes().len() as u16).to_be_bytes());
    sct.extend_from_slice(sig.as_bytes());
    let mut list = ((sct.len() + 2) as u16).to_be_bytes().to_vec();
    list.extend_from_slice(&(sct.len() as u16).to_be_bytes());
    list.extend_from_slice(&sct);
    // The extension's value is an OCTET STRING holding the TLS-encoded list.
    let mut octets = vec![0x04];
    if list.len() < 128 {
        octets.push(list.len() as u8);
    } else {
        octets.extend_from_slice(&[0x81, list.len() as u8]);
    }
    octets.extend_from_slice(&list);
    octets
}

impl Default for TestSigstore {
    fn default() -> Self {
        Self::new()
    }
}

impl TestSigstore {
    /// A new instance: fresh keys for the CA, the CT log and the Rekor log.
    pub fn new() -> Self {
        let ca = |name: &str| {
            let mut params =
                rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name.to_owned());
            params.key_usages = vec![
                rcgen::KeyUsagePurpose::KeyCertSign,
                rcgen::KeyUsagePurpose::CrlSign,
            ];
            params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::CodeSigning];
            params.not_before = time(now() - 86_400 * 365);
            params.not_after = time(now() + 86_400 * 365);
            params
        };
        let root = rcgen::CertifiedIssuer::self_signed(ca("thorn test sigstore"), p256_key().0)
            .expect("the root");
        let intermediate = rcgen::CertifiedIssuer::signed_by(
            ca("thorn test sigstore intermediate"),
            p256_key().0,
            &root,
        )
        .expect("the intermediate");
        // Earlier entries of the log, so proofs have a path.
        let leaves = (0..5u8).map(|i| leaf_hash(&[i])).collect();
        TestSigstore {
            root,
            intermediate,
            ct: p256_key().1,
            rekor: p256_key().1,
            leaves,
            serial: 0,
        }
    }

    /// The Rekor log's ID (SHA-256 of its key).
    pub fn log_id(&self) -> [u8; 32] {
        Sha256::digest(spki(&self.rekor)).into()
    }

    /// The `trusted_root.json` that pins this instance.
    pub fn trusted_root(&self) -> String {
        let key = |k: &SigningKey| {
            json!({"rawBytes": B64.encode(spki(k)), "keyDetails": "PKIX_ECDSA_P256_SHA_256",
                "validFor": {"start": "2020-01-01T00:00:00Z"}})
        };
        json!({
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            "tlogs": [{"baseUrl": "https://rekor.invalid", "hashAlgorithm": "SHA2_256",
                "publicKey": key(&self.rekor), "logId": {"keyId": B64.encode(self.log_id())}}],
            "certificateAuthorities": [{"subject": {"organization": "thorn", "commonName": "test"},
                "uri": "https://fulcio.invalid",
                "certChain": {"certificates": [
                    {"rawBytes": B64.encode(self.intermediate.der())},
                    {"rawBytes": B64.encode(self.root.der())}]},
                "validFor": {"start": "2020-01-01T00:00:00Z"}}],
            "ctlogs": [{"baseUrl": "https://ct.invalid", "hashAlgorithm": "SHA2_256",
                "publicKey": key(&self.ct),
                "logId": {"keyId": B64.encode(Sha256::digest(spki(&self.ct)))}}],
            "timestampAuthorities": [],
        })
        .to_string()
    }

    /// A Fulcio-like certificate for `s`, valid for ten minutes from `not_before`, with an embedded SCT:
    /// its DER and key.
    fn certificate(&mut self, s: &Signing, not_before: i64) -> (Vec<u8>, SigningKey) {
        let (kp, sk) = p256_key();
        self.serial += 1;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        let name = rcgen::string::Ia5String::try_from(s.subject.clone()).expect("an IA5 name");
        params.subject_alt_names = vec![if s.subject.contains("://") {
            rcgen::SanType::URI(name)
        } else {
            rcgen::SanType::Rfc822Name(name)
        }];
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::CodeSigning];
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&[1, self.serial]));
        params.not_before = time(not_before);
        params.not_after = time(not_before + 600);
        params.custom_extensions = vec![
            rcgen::CustomExtension::from_oid_content(
                &[1, 3, 6, 1, 4, 1, 57264, 1, 1],
                s.issuer.as_bytes().to_vec(),
            ),
            rcgen::CustomExtension::from_oid_content(
                &[1, 3, 6, 1, 4, 1, 57264, 1, 8],
                utf8_string(&s.issuer),
            ),
        ];
        // The precertificate: the same certificate without the SCT list, which the SCT signs.
        let pre = params.signed_by(&kp, &self.intermediate).expect("precert");
        let tbs = first_element(pre.der()).to_vec();
        let issuer_spki = spki(
            &SigningKey::from_pkcs8_der(&self.intermediate.key().serialize_der()).expect("key"),
        );
        params
            .custom_extensions
            .push(rcgen::CustomExtension::from_oid_content(
                &[1, 3, 6, 1, 4, 1, 11129, 2, 4, 2],
                sct_extension(&self.ct, &issuer_spki, &tbs, not_before as u64 * 1000),
            ));
        let cert = params
            .signed_by(&kp, &self.intermediate)
            .expect("certificate");
        (cert.der().to_vec(), sk)
    }

    /// Appends `body` to the log at `t`: the entry (protobuf JSON) with its signed entry timestamp,
    /// inclusion proof and checkpoint.
    fn log(&mut self, body: &[u8], kind: &str, t: i64) -> Value {
        self.leaves.push(leaf_hash(body));
        let index = self.leaves.len() - 1;
        let global = 1_000_000 + index as u64;
        let size = self.leaves.len();
        let root = tree_hash(&self.leaves);
        let promise = format!(
            r#"{{"body":"{}","integratedTime":{t},"logID":"{}","logIndex":{global}}}"#,
            B64.encode(body),
            hex(&self.log_id())
        );
        let set: DerSignature = self.rekor.sign(promise.as_bytes());
        let note = format!("rekor.invalid - 1\n{size}\n{}\n", B64.encode(root));
        let sig: DerSignature = self.rekor.sign(note.as_bytes());
        let mut hinted = self.log_id()[..4].to_vec();
        hinted.extend_from_slice(sig.as_bytes());
        let envelope = format!("{note}\n\u{2014} rekor.invalid {}\n", B64.encode(hinted));
        json!({
            "logIndex": global.to_string(),
            "logId": {"keyId": B64.encode(self.log_id())},
            "kindVersion": {"kind": kind, "version": "0.0.1"},
            "integratedTime": t.to_string(),
            "inclusionPromise": {"signedEntryTimestamp": B64.encode(set.as_bytes())},
            "inclusionProof": {
                "logIndex": index.to_string(),
                "rootHash": B64.encode(root),
                "treeSize": size.to_string(),
                "hashes": audit_path(index, &self.leaves).iter().map(|h| B64.encode(h)).collect::<Vec<_>>(),
                "checkpoint": {"envelope": envelope},
            },
            "canonicalizedBody": B64.encode(body),
        })
    }

    /// A v0.3 bundle signing the SHA-256 `digest` as `s` asks.
    pub fn bundle(&mut self, digest: &[u8; 32], s: &Signing) -> String {
        let t = now() - 5;
        let (cert, key) = self.certificate(s, t - s.signed_after_s);
        let cert_pem = B64.encode(pem(&cert));
        let (content, body, kind) = match s.content {
            Content::Message => {
                let sig: DerSignature = key.sign_prehash(digest).expect("sign");
                let sig = B64.encode(sig.as_bytes());
                let body = json!({"apiVersion": "0.0.1", "kind": "hashedrekord", "spec": {
                    "data": {"hash": {"algorithm": "sha256", "value": hex(digest)}},
                    "signature": {"content": sig, "publicKey": {"content": cert_pem}}}});
                let content = json!({"messageSignature": {
                    "messageDigest": {"algorithm": "SHA2_256", "digest": B64.encode(digest)},
                    "signature": sig}});
                (content, body, "hashedrekord")
            }
            Content::Dsse(predicate) => {
                let statement = json!({"_type": "https://in-toto.io/Statement/v1",
                    "subject": [{"name": "artifact", "digest": {"sha256": hex(digest)}}],
                    "predicateType": predicate, "predicate": {}})
                .to_string();
                let payload_type = "application/vnd.in-toto+json";
                let pae = format!(
                    "DSSEv1 {} {payload_type} {} {statement}",
                    payload_type.len(),
                    statement.len()
                );
                let sig: DerSignature = key.sign(pae.as_bytes());
                let envelope = sigstore_protobuf_specs::io::intoto::Envelope {
                    payload: statement.as_bytes().to_vec(),
                    payload_type: payload_type.to_owned(),
                    signatures: vec![sigstore_protobuf_specs::io::intoto::Signature {
                        sig: sig.as_bytes().to_vec(),
                        keyid: String::new(),
                    }],
                };
                let envelope_json = serde_json::to_vec(&envelope).expect("the envelope");
                let body = json!({"apiVersion": "0.0.1", "kind": "dsse", "spec": {
                    "envelopeHash": {"algorithm": "sha256", "value": hex(&Sha256::digest(&envelope_json))},
                    "payloadHash": {"algorithm": "sha256", "value": hex(&Sha256::digest(statement.as_bytes()))},
                    "signatures": [{"signature": B64.encode(sig.as_bytes()), "verifier": cert_pem}]}});
                let content = json!({"dsseEnvelope":
                    serde_json::to_value(&envelope).expect("the envelope")});
                (content, body, "dsse")
            }
        };
        let entry = self.log(
            serde_json::to_string(&body).expect("body").as_bytes(),
            kind,
            t,
        );
        let mut bundle = json!({
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {
                "certificate": {"rawBytes": B64.encode(&cert)},
                "tlogEntries": [entry],
            },
        });
        for (k, v) in content.as_object().expect("content") {
            bundle[k] = v.clone();
        }
        bundle.to_string()
    }

    /// cosign 2's keyless `.sig` layer annotations for `payload` (a simple-signing payload) signed as
    /// `s` asks: the signature, the certificate and the Rekor bundle.
    pub fn cosign_annotations(&mut self, payload: &[u8], s: &Signing) -> BTreeMap<String, String> {
        let t = now() - 5;
        let (cert, key) = self.certificate(s, t - s.signed_after_s);
        let sig: DerSignature = key.sign(payload);
        let sig = B64.encode(sig.as_bytes());
        let body = json!({"apiVersion": "0.0.1", "kind": "hashedrekord", "spec": {
            "data": {"hash": {"algorithm": "sha256", "value": hex(&Sha256::digest(payload))}},
            "signature": {"content": sig, "publicKey": {"content": B64.encode(pem(&cert))}}}})
        .to_string();
        let entry = self.log(body.as_bytes(), "hashedrekord", t);
        let rekor = json!({"SignedEntryTimestamp": entry["inclusionPromise"]["signedEntryTimestamp"],
            "Payload": {"body": entry["canonicalizedBody"], "integratedTime": t,
                "logIndex": entry["logIndex"].as_str().expect("index").parse::<u64>().expect("index"),
                "logID": hex(&self.log_id())}});
        BTreeMap::from([
            ("dev.cosignproject.cosign/signature".to_owned(), sig),
            ("dev.sigstore.cosign/certificate".to_owned(), pem(&cert)),
            ("dev.sigstore.cosign/bundle".to_owned(), rekor.to_string()),
        ])
    }
}
