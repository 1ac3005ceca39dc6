//! Plugins in OCI registries: `thorn plugins push FILE oci://HOST/REPO:TAG` and `thorn plugins pull
//! oci://HOST/REPO[:TAG|@sha256:DIGEST]`, a component as a Wasm OCI artifact (the CNCF layout wassette
//! and wkg use: one `application/wasm` layer, an `application/vnd.wasm.config.v0+json` config), over the
//! OCI distribution API (`oci-client`).
//!
//! A pull checks every digest on the way: the manifest's against a `@sha256:` reference, the layer's
//! against the manifest (the client refuses a blob whose bytes do not hash to it). The component written
//! to the plugin directory is the layer, so the sha256 the policy pins is the layer digest the manifest
//! names. Registries on loopback are spoken to over plain HTTP, others over HTTPS (the system's roots and
//! `--tls-ca`); credentials come from the docker config (`$DOCKER_CONFIG/config.json`, else
//! `~/.docker/config.json`: its `credHelpers`, `auths` and `credsStore`), else anonymous.

use anyhow::{Context, Result, bail};
use base64::Engine;
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{
    IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE, OciDescriptor,
    OciImageManifest,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use thorn_plugin::signing::{Evidence, SignatureLayer, bundle, keyed};

/// The layer's media type (CNCF Wasm OCI artifact layout).
pub const LAYER: &str = "application/wasm";
/// The config's media type.
pub const CONFIG: &str = "application/vnd.wasm.config.v0+json";
/// The layer type of the older wasm-to-oci layout, accepted on pull.
const LEGACY_LAYER: &str = "application/vnd.wasm.content.layer.v1+wasm";
/// The manifest annotation holding the tool manifest (what `describe()` returned).
pub const TOOL_MANIFEST: &str = "dev.thorn.tool.manifest";

/// `oci://HOST/REPO...` as a reference.
pub fn reference(r: &str) -> Result<Reference> {
    let Some(rest) = r.strip_prefix("oci://") else {
        bail!("{r:?}: a registry reference is written oci://HOST/REPO[:TAG|@sha256:DIGEST]");
    };
    rest.parse::<Reference>()
        .with_context(|| format!("{r:?} is not a registry reference"))
}

/// Whether a registry (`HOST[:PORT]`) is on loopback.
fn is_loopback(registry: &str) -> bool {
    let host = registry
        .rsplit_once(':')
        .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
        .map_or(registry, |(h, _)| h);
    crate::serve::is_loopback(host)
}

fn client(r: &Reference) -> Client {
    let registry = r.resolve_registry().to_owned();
    let protocol = if is_loopback(&registry) {
        ClientProtocol::HttpsExcept(vec![registry])
    } else {
        ClientProtocol::Https
    };
    Client::new(ClientConfig {
        protocol,
        extra_root_certificates: thorn_plugin::tls::extra_roots()
            .iter()
            .map(|c| oci_client::client::Certificate {
                encoding: oci_client::client::CertificateEncoding::Der,
                data: c.to_vec(),
            })
            .collect(),
        ..ClientConfig::default()
    })
}

/// Credentials for `registry` from the docker config: its `credHelpers` entry for the registry, else its
/// `auths` entry, else its `credsStore` (a helper is the program `docker-credential-NAME`, asked with
/// `get`), else anonymous.
fn auth(registry: &str) -> RegistryAuth {
    let path = std::env::var_os("DOCKER_CONFIG")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".docker")))
        .map(|d| d.join("config.json"));
    let Some(doc) = path
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
    else {
        return RegistryAuth::Anonymous;
    };
    let same = |k: &str| {
        k.trim_start_matches("https://")
            .trim_start_matches("http://")
            .trim_end_matches('/')
            == registry
    };
    if let Some(name) = doc["credHelpers"]
        .as_object()
        .and_then(|m| m.iter().find(|(r, _)| same(r)))
        .and_then(|(_, v)| v.as_str())
    {
        return credential_helper(name, registry);
    }
    let entry = doc["auths"]
        .as_object()
        .into_iter()
        .flatten()
        .find(|(k, _)| same(k))
        .and_then(|(_, v)| v["auth"].as_str())
        .and_then(|a| base64::engine::general_purpose::STANDARD.decode(a).ok())
        .and_then(|b| String::from_utf8(b).ok());
    match entry.as_deref().and_then(|s| s.split_once(':')) {
        Some((user, pass)) => RegistryAuth::Basic(user.to_owned(), pass.to_owned()),
        None => match doc["credsStore"].as_str() {
            Some(store) => credential_helper(store, registry),
            None => RegistryAuth::Anonymous,
        },
    }
}

/// Asks the credential helper `docker-credential-NAME` for `registry` (the docker credential helper
/// protocol: the server on stdin, `{"Username", "Secret"}` on stdout; the user `<token>` means the secret
/// is an identity token). A helper that is missing or has nothing for the registry: anonymous.
fn credential_helper(name: &str, registry: &str) -> RegistryAuth {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let program = format!("docker-credential-{name}");
    let Ok(mut child) = Command::new(&program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        tracing::warn!(
            "the docker config names the credential helper {program}, which cannot be run"
        );
        return RegistryAuth::Anonymous;
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(registry.as_bytes());
    }
    let Ok(out) = child.wait_with_output() else {
        return RegistryAuth::Anonymous;
    };
    let Some(v) = out
        .status
        .success()
        .then(|| serde_json::from_slice::<Value>(&out.stdout).ok())
        .flatten()
    else {
        return RegistryAuth::Anonymous;
    };
    match (v["Username"].as_str(), v["Secret"].as_str()) {
        (Some("<token>"), Some(token)) => RegistryAuth::Bearer(token.to_owned()),
        (Some(user), Some(secret)) => RegistryAuth::Basic(user.to_owned(), secret.to_owned()),
        _ => RegistryAuth::Anonymous,
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Pushes the component `bytes` (its tool manifest `manifest`) to `r`; the manifest's digest.
pub fn push(r: &Reference, bytes: Vec<u8>, manifest: &Value) -> Result<String> {
    let layer = ImageLayer::new(bytes, LAYER.to_owned(), None);
    let config = json!({
        "created": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "architecture": "wasm",
        "os": "wasip2",
        "layerDigests": [layer.sha256_digest()],
        "component": {"exports": ["thorn:tool/tool"]},
    });
    let config = Config::new(serde_json::to_vec(&config)?, CONFIG.to_owned(), None);
    let mut notes = BTreeMap::new();
    for (k, field) in [
        ("org.opencontainers.image.title", "name"),
        ("org.opencontainers.image.version", "version"),
        ("org.opencontainers.image.description", "description"),
    ] {
        if let Some(v) = manifest[field].as_str() {
            notes.insert(k.to_owned(), v.to_owned());
        }
    }
    notes.insert(TOOL_MANIFEST.to_owned(), manifest.to_string());
    let m = OciImageManifest::build(std::slice::from_ref(&layer), &config, Some(notes));
    runtime()?.block_on(async {
        let (c, auth) = (client(r), auth(r.resolve_registry()));
        c.push(r, &[layer], config, &auth, Some(m))
            .await
            .with_context(|| format!("pushing to {r}"))?;
        // The digest as the registry has it (the manifest it will serve).
        c.fetch_manifest_digest(r, &auth)
            .await
            .with_context(|| format!("reading back the manifest digest of {r}"))
    })
}

/// What a pull got: the component, and the manifest it came from (its bytes and digest).
pub struct Pulled {
    /// The component's bytes (the layer).
    pub component: Vec<u8>,
    /// `sha256:...` of the manifest the layer was named by.
    pub manifest_digest: String,
    /// The manifest as the registry served it (its SHA-256 is `manifest_digest`).
    pub manifest: Vec<u8>,
}

/// The most bytes a manifest, a signature layer or a bundle may have (a component has its own cap).
const SMALL: usize = 1 << 20;
/// The most signature artifacts read for one manifest.
const MAX_REFERRERS: usize = 16;

/// The most bytes a component layer may have.
const MAX_COMPONENT: usize = 256 << 20;

/// `sha256:<hex>`, as OCI names a blob.
fn sha256(b: &[u8]) -> String {
    format!("sha256:{}", thorn_plugin::sha256_hex(b))
}

/// Pulls the blob `d` of `r`'s repository, at most `cap` bytes, its digest checked.
async fn blob(c: &Client, r: &Reference, d: &OciDescriptor, cap: usize) -> Result<Vec<u8>> {
    if d.size < 0 || d.size as usize > cap {
        bail!(
            "{r}: the blob {} is {} bytes (at most {cap} taken)",
            d.digest,
            d.size
        );
    }
    let mut out = Vec::with_capacity(d.size as usize);
    c.pull_blob(r, d, &mut out)
        .await
        .with_context(|| format!("pulling {} from {r}", d.digest))?;
    if sha256(&out) != d.digest {
        bail!("{r}: the blob {} does not hash to its digest", d.digest);
    }
    Ok(out)
}

/// The manifest media types asked for.
const MANIFESTS: &[&str] = &[OCI_IMAGE_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE];

/// The manifest at `r` (raw, digest checked) as an OCI image manifest.
async fn manifest(
    c: &Client,
    r: &Reference,
    auth: &RegistryAuth,
) -> Result<(Vec<u8>, String, OciImageManifest)> {
    let (raw, digest) = c
        .pull_manifest_raw(r, auth, MANIFESTS)
        .await
        .with_context(|| format!("pulling the manifest of {r}"))?;
    checked(r, raw.to_vec(), digest)
}

/// A manifest `r` served as `raw` under `digest`: size capped, its digest checked (also against a
/// `@sha256:` reference), parsed.
fn checked(
    r: &Reference,
    raw: Vec<u8>,
    digest: String,
) -> Result<(Vec<u8>, String, OciImageManifest)> {
    if raw.len() > SMALL {
        bail!("{r}: the manifest is {} bytes", raw.len());
    }
    if sha256(&raw) != digest {
        bail!("{r}: the registry served a manifest that does not hash to its digest {digest}");
    }
    if let Some(want) = r.digest()
        && want != digest
    {
        bail!("{r}: the registry served the manifest {digest}, not the one asked for");
    }
    let m: OciImageManifest = serde_json::from_slice(&raw)
        .with_context(|| format!("{r}: the manifest is not an OCI image manifest"))?;
    Ok((raw, digest, m))
}

/// Pulls the component at `r`.
pub fn pull(r: &Reference) -> Result<Pulled> {
    runtime()?.block_on(async {
        let (c, auth) = (client(r), auth(r.resolve_registry()));
        let (raw, manifest_digest, m) = manifest(&c, r, &auth).await?;
        let [layer] = m.layers.as_slice() else {
            bail!(
                "{r}: a plugin artifact has one wasm layer, this one has {}",
                m.layers.len()
            );
        };
        if layer.media_type != LAYER && layer.media_type != LEGACY_LAYER {
            bail!(
                "{r}: the layer is {:?}, not a wasm component ({LAYER})",
                layer.media_type
            );
        }
        let component = blob(&c, r, layer, MAX_COMPONENT).await?;
        Ok(Pulled {
            component,
            manifest_digest,
            manifest: raw,
        })
    })
}

/// The repository part of a reference as signatures name it: `HOST/REPO`.
pub fn repository(r: &Reference) -> String {
    format!("{}/{}", r.registry(), r.repository())
}

/// `r`'s repository at `tag`.
fn at_tag(r: &Reference, tag: String) -> Reference {
    Reference::with_tag(r.registry().to_owned(), r.repository().to_owned(), tag)
}

/// `r`'s repository at `digest`.
fn at_digest(r: &Reference, digest: &str) -> Reference {
    Reference::with_digest(
        r.registry().to_owned(),
        r.repository().to_owned(),
        digest.to_owned(),
    )
}

/// The digest `r` names now (resolving a tag).
async fn resolve(c: &Client, r: &Reference, auth: &RegistryAuth) -> Result<String> {
    match r.digest() {
        Some(d) => Ok(d.to_owned()),
        None => c
            .fetch_manifest_digest(r, auth)
            .await
            .with_context(|| format!("resolving {r}")),
    }
}

/// Signs the manifest `r` names now with `key`: pushes the signature artifact; the digest signed.
pub fn sign(r: &Reference, key: &p256::ecdsa::SigningKey) -> Result<String> {
    runtime()?.block_on(async {
        let (c, auth) = (client(r), auth(r.resolve_registry()));
        let digest = resolve(&c, r, &auth).await?;
        let payload = keyed::payload(&repository(r), &digest);
        let signature = keyed::sign(key, &payload);
        let mut notes = BTreeMap::new();
        notes.insert(keyed::SIGNATURE.to_owned(), signature);
        let layer = ImageLayer::new(payload, keyed::SIMPLESIGNING.to_owned(), Some(notes));
        let config = Config::new(
            b"{}".to_vec(),
            "application/vnd.oci.image.config.v1+json".to_owned(),
            None,
        );
        let at = at_tag(r, keyed::signature_tag(&digest));
        c.push(&at, &[layer], config, &auth, None)
            .await
            .with_context(|| format!("pushing the signature to {at}"))?;
        Ok(digest)
    })
}

/// Whether an error is the registry saying it has no such manifest.
fn unknown(e: &oci_client::errors::OciDistributionError) -> bool {
    let s = format!("{e:#}");
    s.contains("manifest unknown") || s.contains("MANIFEST_UNKNOWN") || s.contains("404")
}

/// The signatures stored for the manifest `digest` of `r`'s repository: the layers at its `.sig` tag
/// (keyed, and cosign 2's keyless) and the sigstore bundles that refer to it (the referrers API, else
/// the referrers tag); each read with a size cap.
pub fn evidence(r: &Reference, digest: &str) -> Result<Evidence> {
    runtime()?.block_on(async {
        let (c, auth) = (client(r), auth(r.resolve_registry()));
        let mut found = Evidence::default();
        let sig = at_tag(r, keyed::signature_tag(digest));
        match c.pull_manifest_raw(&sig, &auth, MANIFESTS).await {
            Ok((raw, sig_digest)) => {
                let (_, _, m) = checked(&sig, raw.to_vec(), sig_digest)?;
                for l in m.layers.iter().take(MAX_REFERRERS) {
                    if l.media_type != keyed::SIMPLESIGNING {
                        continue;
                    }
                    found.signatures.push(SignatureLayer {
                        payload: blob(&c, &sig, l, SMALL).await?,
                        annotations: l
                            .annotations
                            .clone()
                            .unwrap_or_default()
                            .into_iter()
                            .collect(),
                    });
                }
            }
            Err(e) if unknown(&e) => {}
            Err(e) => return Err(e).with_context(|| format!("pulling the signatures at {sig}")),
        }
        let subject = at_digest(r, digest);
        c.store_auth_if_needed(r.resolve_registry(), &auth).await;
        let index = c
            .pull_referrers(&subject, Some(bundle::BUNDLE_V03))
            .await
            .with_context(|| format!("listing the artifacts that refer to {subject}"))?;
        for entry in index.manifests.iter().take(MAX_REFERRERS) {
            let at = at_digest(r, &entry.digest);
            let (_, _, m) = manifest(&c, &at, &auth).await?;
            if m.subject.as_ref().is_none_or(|s| s.digest != digest) {
                continue;
            }
            for l in &m.layers {
                if l.media_type == bundle::BUNDLE_V03 {
                    let b = blob(&c, &at, l, SMALL).await?;
                    found.bundles.push(
                        String::from_utf8(b)
                            .with_context(|| format!("{at}: a bundle that is not text"))?,
                    );
                }
            }
        }
        Ok(found)
    })
}

/// Attaches the sigstore bundle `json` to the manifest `r` names, as cosign 3 does: an OCI 1.1
/// referrer (the bundle as its one layer, `subject` the manifest), listed in the referrers tag where the
/// registry has no referrers API. The referrer's digest.
pub fn attach(r: &Reference, json: &[u8]) -> Result<String> {
    let doc: Value = serde_json::from_slice(json).context("the bundle is not JSON")?;
    let media = doc["mediaType"].as_str().unwrap_or_default();
    if !media.starts_with("application/vnd.dev.sigstore.bundle") {
        bail!("not a sigstore bundle (its mediaType is {media:?})");
    }
    let content = if doc.get("dsseEnvelope").is_some() {
        "dsse-envelope"
    } else {
        "message-signature"
    };
    runtime()?.block_on(async {
        let (c, auth) = (client(r), auth(r.resolve_registry()));
        let (raw, digest, m) = manifest(&c, r, &auth).await?;
        let layer = OciDescriptor {
            media_type: bundle::BUNDLE_V03.to_owned(),
            digest: sha256(json),
            size: json.len() as i64,
            ..OciDescriptor::default()
        };
        let empty = OciDescriptor {
            media_type: "application/vnd.oci.empty.v1+json".to_owned(),
            digest: sha256(b"{}"),
            size: 2,
            ..OciDescriptor::default()
        };
        c.push_blob(r, json.to_vec(), &layer.digest)
            .await
            .with_context(|| format!("pushing the bundle to {r}"))?;
        c.push_blob(r, b"{}".to_vec(), &empty.digest)
            .await
            .with_context(|| format!("pushing the empty config to {r}"))?;
        let mut notes = BTreeMap::from([
            ("dev.sigstore.bundle.content".to_owned(), content.to_owned()),
            (
                "org.opencontainers.image.created".to_owned(),
                humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            ),
        ]);
        if let Some(p) = doc["dsseEnvelope"]["payload"]
            .as_str()
            .and_then(|p| base64::engine::general_purpose::STANDARD.decode(p).ok())
            .and_then(|p| serde_json::from_slice::<Value>(&p).ok())
            .and_then(|s| s["predicateType"].as_str().map(str::to_owned))
        {
            notes.insert("dev.sigstore.bundle.predicateType".to_owned(), p);
        }
        let referrer = json!({
            "schemaVersion": 2,
            "mediaType": OCI_IMAGE_MEDIA_TYPE,
            "artifactType": bundle::BUNDLE_V03,
            "config": empty,
            "layers": [layer],
            "subject": {"mediaType": m.media_type.as_deref().unwrap_or(OCI_IMAGE_MEDIA_TYPE),
                "digest": digest, "size": raw.len()},
            "annotations": notes,
        });
        let body = serde_json::to_vec(&referrer)?;
        let referrer_digest = sha256(&body);
        let content_type =
            |t: &str| reqwest::header::HeaderValue::from_str(t).expect("a media type");
        c.push_manifest_raw(
            &at_digest(r, &referrer_digest),
            body.clone(),
            content_type(OCI_IMAGE_MEDIA_TYPE),
        )
        .await
        .with_context(|| format!("pushing the bundle's manifest to {r}"))?;
        // A registry with the referrers API lists it now; otherwise add it to the referrers tag.
        let subject = at_digest(r, &digest);
        let listed = c
            .pull_referrers(&subject, None)
            .await
            .with_context(|| format!("listing the artifacts that refer to {subject}"))?;
        if !listed.manifests.iter().any(|e| e.digest == referrer_digest) {
            let mut index = serde_json::to_value(&listed)?;
            index["schemaVersion"] = json!(2);
            index["mediaType"] = json!(OCI_IMAGE_INDEX_MEDIA_TYPE);
            let mut entries = index["manifests"].as_array().cloned().unwrap_or_default();
            entries.push(
                json!({"mediaType": OCI_IMAGE_MEDIA_TYPE, "digest": referrer_digest,
                "size": body.len(), "artifactType": bundle::BUNDLE_V03, "annotations": notes}),
            );
            index["manifests"] = json!(entries);
            let tag = at_tag(r, digest.replace(':', "-"));
            c.push_manifest_raw(
                &tag,
                serde_json::to_vec(&index)?,
                content_type(OCI_IMAGE_INDEX_MEDIA_TYPE),
            )
            .await
            .with_context(|| format!("updating the referrers tag {tag}"))?;
        }
        Ok(referrer_digest)
    })
}
