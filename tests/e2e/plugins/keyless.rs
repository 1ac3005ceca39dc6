//! Keyless signatures (sigstore bundles, and cosign 2's keyless `.sig` layers) checked against a test
//! sigstore: what verifies, and each way a signature is refused, with its typed reason.

use serde_json::Value;
use sha2::{Digest, Sha256};
use thorn_plugin::signing::{
    BundleError, Evidence, Identity, Rejection, SignatureLayer, Subject, TlogError, Trust,
    TrustedRoot, Verified, VerifyError, keyed, verify,
};
use thorn_tests::sigstore::{COSIGN_SIGN_PREDICATE, Content, Signing, TestSigstore};

const ISSUER: &str = "https://token.actions.githubusercontent.com";
const RELEASE: &str =
    "https://github.com/acme/tools/.github/workflows/release.yml@refs/tags/v1.0.0";
const REPO: &str = "registry.example/acme/calculator";

struct Case {
    sigstore: TestSigstore,
    digest: [u8; 32],
    shown: String,
}

impl Case {
    fn new() -> Self {
        Case {
            sigstore: TestSigstore::new(),
            digest: Sha256::digest(b"a manifest").into(),
            shown: format!("sha256:{}", thorn_tests::sha256_hex(b"a manifest")),
        }
    }

    fn subject(&self) -> Subject<'_> {
        Subject {
            reference: "oci://registry.example/acme/calculator:1.0",
            repository: REPO,
            digest: &self.shown,
        }
    }

    fn trust(&self, identities: &[(&str, &str)]) -> Trust {
        Trust {
            keys: vec![],
            identities: identities
                .iter()
                .map(|(i, s)| Identity {
                    issuer: (*i).to_owned(),
                    subject: (*s).to_owned(),
                })
                .collect(),
            root: Some(TrustedRoot::parse(self.sigstore.trusted_root().as_bytes()).unwrap()),
        }
    }

    /// [`Case::trust`] in `identities`, under this sigstore's trust root as `edit` changes it.
    fn trust_edited(&self, identities: &[(&str, &str)], edit: impl FnOnce(&mut Value)) -> Trust {
        let mut root: Value = serde_json::from_str(&self.sigstore.trusted_root()).unwrap();
        edit(&mut root);
        Trust {
            root: Some(TrustedRoot::parse(root.to_string().as_bytes()).unwrap()),
            ..self.trust(identities)
        }
    }

    fn bundles(&self, b: &[String], trust: &Trust) -> Result<Verified, VerifyError> {
        verify(
            &self.subject(),
            &Evidence {
                signatures: vec![],
                bundles: b.to_vec(),
            },
            trust,
        )
    }

    /// The one reason a lone signature was refused.
    fn refused(&self, b: &str, trust: &Trust) -> Rejection {
        match self.bundles(&[b.to_owned()], trust) {
            Err(VerifyError::Untrusted { mut reasons, .. }) if reasons.len() == 1 => {
                reasons.remove(0)
            }
            other => panic!("expected one rejection, got {other:?}"),
        }
    }
}

fn edit(bundle: &str, f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(bundle).unwrap();
    f(&mut v);
    v.to_string()
}

#[test]
fn a_keyless_bundle_verifies_for_the_digest_it_signs_by_a_trusted_identity() {
    let mut c = Case::new();
    let trust = c.trust(&[(ISSUER, RELEASE)]);
    for content in [Content::Message, Content::Dsse(COSIGN_SIGN_PREDICATE)] {
        let s = Signing {
            content,
            ..Signing::by(ISSUER, RELEASE)
        };
        let b = c.sigstore.bundle(&c.digest, &s);
        match c.bundles(&[b], &trust) {
            Ok(Verified::Keyless(signer)) => {
                assert_eq!(signer.identity.subject, RELEASE);
                assert_eq!(signer.identity.issuer, ISSUER);
                assert!(signer.log_index >= 1_000_000, "{signer:?}");
            }
            other => panic!("{content:?}: {other:?}"),
        }
    }
    // An e-mail identity.
    let google = "https://accounts.google.com";
    let b = c
        .sigstore
        .bundle(&c.digest, &Signing::by(google, "dev@acme.example"));
    let t = c.trust(&[(ISSUER, RELEASE), (google, "dev@acme.example")]);
    assert!(matches!(c.bundles(&[b], &t), Ok(Verified::Keyless(_))));
}

#[test]
fn keyless_bundles_are_refused_for_another_digest_identity_authority_or_log() {
    let mut c = Case::new();
    let trust = c.trust(&[(ISSUER, RELEASE)]);
    let good = c.sigstore.bundle(&c.digest, &Signing::by(ISSUER, RELEASE));

    // A signature of another manifest.
    let other: [u8; 32] = Sha256::digest(b"another manifest").into();
    for content in [Content::Message, Content::Dsse(COSIGN_SIGN_PREDICATE)] {
        let s = Signing {
            content,
            ..Signing::by(ISSUER, RELEASE)
        };
        let b = c.sigstore.bundle(&other, &s);
        assert!(
            matches!(
                c.refused(&b, &trust),
                Rejection::Bundle(BundleError::Verification(_))
            ),
            "{content:?}"
        );
    }
    // Another workflow of the same repository, and the same name from another issuer.
    let b = c.sigstore.bundle(
        &c.digest,
        &Signing::by(
            ISSUER,
            "https://github.com/acme/tools/.github/workflows/pr.yml@refs/pull/9/merge",
        ),
    );
    match c.refused(&b, &trust) {
        Rejection::Identity { subjects, issuer } => {
            assert_eq!(issuer, ISSUER);
            assert!(
                subjects[0].ends_with("pr.yml@refs/pull/9/merge"),
                "{subjects:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    let b = c.sigstore.bundle(
        &c.digest,
        &Signing::by("https://issuer.evil.example", RELEASE),
    );
    assert!(matches!(c.refused(&b, &trust), Rejection::Identity { .. }));

    // Signed by another sigstore: its log is not pinned.
    let mut stranger = TestSigstore::new();
    let b = stranger.bundle(&c.digest, &Signing::by(ISSUER, RELEASE));
    assert!(matches!(
        c.refused(&b, &trust),
        Rejection::Bundle(BundleError::Tlog(TlogError::UnknownLog))
    ));
    // The pinned log, but certificates from another authority.
    let foreign_ca = c.trust_edited(&[(ISSUER, RELEASE)], |root| {
        root["certificateAuthorities"] = serde_json::from_str::<Value>(&stranger.trusted_root())
            .unwrap()["certificateAuthorities"]
            .clone();
    });
    assert!(matches!(
        c.refused(&good, &foreign_ca),
        Rejection::Bundle(BundleError::Verification(_))
    ));

    // No CT log pinned: the certificate's SCT vouches for nothing.
    let no_ct = c.trust_edited(&[(ISSUER, RELEASE)], |root| {
        root["ctlogs"] = serde_json::json!([]);
    });
    assert!(matches!(
        c.refused(&good, &no_ct),
        Rejection::Bundle(BundleError::Verification(_))
    ));

    // A DSSE statement that is not a signature (an attestation of something else about the artifact).
    let s = Signing {
        content: Content::Dsse("https://slsa.dev/provenance/v1"),
        ..Signing::by(ISSUER, RELEASE)
    };
    let b = c.sigstore.bundle(&c.digest, &s);
    assert!(matches!(
        c.refused(&b, &trust),
        Rejection::Bundle(BundleError::Predicate(_))
    ));

    // Signed after the ten-minute certificate expired (a stolen key, used later).
    let s = Signing {
        signed_after_s: 900,
        ..Signing::by(ISSUER, RELEASE)
    };
    let b = c.sigstore.bundle(&c.digest, &s);
    assert!(matches!(
        c.refused(&b, &trust),
        Rejection::Bundle(BundleError::Verification(_))
    ));

    // No identities trusted: a keyless signature does not count for keys.
    let keys_only = Trust {
        identities: vec![],
        root: None,
        keys: vec![
            *p256::ecdsa::SigningKey::from_slice(&[3u8; 32])
                .unwrap()
                .verifying_key(),
        ],
    };
    assert!(matches!(
        c.refused(&good, &keys_only),
        Rejection::NoIdentities
    ));

    // The good one still verifies beside refused ones, whatever the order.
    let many = [b.clone(), good.clone()];
    assert!(matches!(c.bundles(&many, &trust), Ok(Verified::Keyless(_))));
}

#[test]
fn the_log_entry_must_be_signed_included_and_checkpointed_by_the_pinned_log() {
    let mut c = Case::new();
    let trust = c.trust(&[(ISSUER, RELEASE)]);
    let good = c.sigstore.bundle(&c.digest, &Signing::by(ISSUER, RELEASE));
    let entry = "/verificationMaterial/tlogEntries/0";
    let tlog = |b: &str| match c.refused(b, &trust) {
        Rejection::Bundle(BundleError::Tlog(e)) => e,
        other => panic!("{other:?}"),
    };
    // Another time than the log signed (moving a signature into its certificate's life).
    let b = edit(&good, |v| {
        let t: u64 = v.pointer(entry).unwrap()["integratedTime"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        v.pointer_mut(entry).unwrap()["integratedTime"] = (t - 30).to_string().into();
    });
    assert!(matches!(tlog(&b), TlogError::BadPromise));
    // A signed entry timestamp from another key.
    let stranger = TestSigstore::new().bundle(&c.digest, &Signing::by(ISSUER, RELEASE));
    let b = edit(&good, |v| {
        v.pointer_mut(entry).unwrap()["inclusionPromise"] =
            serde_json::from_str::<Value>(&stranger)
                .unwrap()
                .pointer(entry)
                .unwrap()["inclusionPromise"]
                .clone();
    });
    assert!(matches!(tlog(&b), TlogError::BadPromise));
    // An inclusion proof with a changed hash.
    let b = edit(&good, |v| {
        let h = &mut v.pointer_mut(entry).unwrap()["inclusionProof"]["hashes"][0];
        *h = base64_of(&[7u8; 32]).into();
    });
    assert!(matches!(tlog(&b), TlogError::BadProof));
    // A checkpoint whose signature is not the log's.
    let b = edit(&good, |v| {
        let cp = &mut v.pointer_mut(entry).unwrap()["inclusionProof"]["checkpoint"]["envelope"];
        let s = cp.as_str().unwrap().to_owned();
        let (text, _) = s.split_once("\n\n").unwrap();
        *cp = format!(
            "{text}\n\n\u{2014} rekor.invalid {}\n",
            base64_of(&[1u8; 70])
        )
        .into();
    });
    assert!(matches!(tlog(&b), TlogError::BadCheckpoint(_)));
    // No inclusion proof in a v0.3 bundle.
    let b = edit(&good, |v| {
        v.pointer_mut(entry)
            .unwrap()
            .as_object_mut()
            .unwrap()
            .remove("inclusionProof");
    });
    assert!(matches!(tlog(&b), TlogError::NoProof));
    // No signed entry timestamp (a Rekor v2 entry): not supported, refused.
    let b = edit(&good, |v| {
        v.pointer_mut(entry)
            .unwrap()
            .as_object_mut()
            .unwrap()
            .remove("inclusionPromise");
    });
    assert!(matches!(tlog(&b), TlogError::NoPromise));
    // The untouched bundle verifies.
    assert!(c.bundles(&[good], &trust).is_ok());
}

fn base64_of(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

#[test]
fn cosign_2_keyless_signature_layers_verify_through_the_same_checks() {
    let mut c = Case::new();
    let trust = c.trust(&[(ISSUER, RELEASE)]);
    let layer = |c: &mut Case, digest: &str, s: &Signing| {
        let payload = keyed::payload(REPO, digest);
        let annotations = c.sigstore.cosign_annotations(&payload, s);
        SignatureLayer {
            payload,
            annotations,
        }
    };
    let sigs = |layers: Vec<SignatureLayer>| Evidence {
        signatures: layers,
        bundles: vec![],
    };
    let shown = c.shown.clone();
    let good = layer(&mut c, &shown, &Signing::by(ISSUER, RELEASE));
    match verify(&c.subject(), &sigs(vec![good.clone()]), &trust) {
        Ok(Verified::Keyless(s)) => assert_eq!(s.identity.subject, RELEASE),
        other => panic!("{other:?}"),
    }
    // A payload naming another manifest.
    let other = layer(
        &mut c,
        "sha256:0000000000000000000000000000000000000000000000000000000000000000",
        &Signing::by(ISSUER, RELEASE),
    );
    assert!(matches!(
        verify(&c.subject(), &sigs(vec![other]), &trust),
        Err(VerifyError::OtherDigest { .. })
    ));
    // Its signature swapped for another layer's: the log body no longer matches.
    let mut swapped = good.clone();
    let again = layer(&mut c, &shown, &Signing::by(ISSUER, RELEASE));
    swapped.annotations.insert(
        keyed::SIGNATURE.to_owned(),
        again.annotations[keyed::SIGNATURE].clone(),
    );
    match verify(&c.subject(), &sigs(vec![swapped]), &trust) {
        Err(VerifyError::Untrusted { reasons, .. }) => assert!(
            matches!(
                reasons[..],
                [Rejection::Bundle(BundleError::Verification(_))]
            ),
            "{reasons:?}"
        ),
        other => panic!("{other:?}"),
    }
    // Signed by someone else.
    let stranger = layer(&mut c, &shown, &Signing::by(ISSUER, "mallory@evil.example"));
    match verify(&c.subject(), &sigs(vec![stranger]), &trust) {
        Err(e @ VerifyError::Untrusted { .. }) => {
            assert!(e.to_string().contains("mallory@evil.example"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_policy_with_identities_needs_a_trust_root_and_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.json");
    let identities = serde_json::json!([{"issuer": ISSUER, "subject": RELEASE}]);
    let policy = |trust: Value| {
        thorn_plugin::Policy::parse(&path, &serde_json::json!({ "trust": trust }).to_string())
    };
    let e = policy(serde_json::json!({ "identities": identities })).unwrap_err();
    assert!(e.to_string().contains("trusted_root"), "{e}");
    let p =
        policy(serde_json::json!({"identities": identities, "trusted_root": "root.json"})).unwrap();
    // Relative to the policy's directory; missing is an error naming it.
    let e = Trust::of(&p).unwrap_err();
    assert!(e.to_string().contains("root.json"), "{e}");
    std::fs::write(
        dir.path().join("root.json"),
        TestSigstore::new().trusted_root(),
    )
    .unwrap();
    let t = Trust::of(&p).unwrap();
    assert_eq!(t.identities.len(), 1);
    assert!(t.root.is_some() && !t.is_empty());
    std::fs::write(
        dir.path().join("root.json"),
        "{\"mediaType\": \"text/plain\"}",
    )
    .unwrap();
    assert!(Trust::of(&p).is_err());
}
