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
//! `~/.docker/config.json`, its `auths` entries), else anonymous.

use anyhow::{Context, Result, bail};
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::OciImageManifest;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

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

/// Credentials for `registry` from the docker config, else anonymous.
fn auth(registry: &str) -> RegistryAuth {
    use base64::Engine;
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
    let entry = doc["auths"]
        .as_object()
        .into_iter()
        .flatten()
        .find(|(k, _)| {
            k.trim_start_matches("https://")
                .trim_start_matches("http://")
                .trim_end_matches('/')
                == registry
        })
        .and_then(|(_, v)| v["auth"].as_str())
        .and_then(|a| base64::engine::general_purpose::STANDARD.decode(a).ok())
        .and_then(|b| String::from_utf8(b).ok());
    match entry.as_deref().and_then(|s| s.split_once(':')) {
        Some((user, pass)) => RegistryAuth::Basic(user.to_owned(), pass.to_owned()),
        None => RegistryAuth::Anonymous,
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

/// What a pull got: the component and the digest of the manifest it came from.
pub struct Pulled {
    /// The component's bytes (the layer).
    pub component: Vec<u8>,
    /// `sha256:...` of the manifest the layer was named by.
    pub manifest_digest: String,
}

/// Pulls the component at `r`.
pub fn pull(r: &Reference) -> Result<Pulled> {
    let data = runtime()?.block_on(async {
        client(r)
            .pull(r, &auth(r.resolve_registry()), vec![LAYER, LEGACY_LAYER])
            .await
            .with_context(|| format!("pulling {r}"))
    })?;
    let manifest_digest = data
        .digest
        .context("the registry named no manifest digest")?;
    if let Some(want) = r.digest()
        && want != manifest_digest
    {
        bail!("{r}: the registry served the manifest {manifest_digest}, not the one asked for");
    }
    let [layer] = <[ImageLayer; 1]>::try_from(data.layers).map_err(|l| {
        anyhow::anyhow!(
            "{r}: a plugin artifact has one wasm layer, this one has {}",
            l.len()
        )
    })?;
    Ok(Pulled {
        component: layer.data.to_vec(),
        manifest_digest,
    })
}

/// The repository part of a reference as signatures name it: `HOST/REPO`.
pub fn repository(r: &Reference) -> String {
    format!("{}/{}", r.registry(), r.repository())
}

/// The reference of the signatures of the manifest `digest` in `r`'s repository.
fn signature_ref(r: &Reference, digest: &str) -> Reference {
    Reference::with_tag(
        r.registry().to_owned(),
        r.repository().to_owned(),
        super::sign::signature_tag(digest),
    )
}

/// Signs the manifest `r` names now with `key`: pushes the signature artifact; the digest signed.
pub fn sign(r: &Reference, key: &p256::ecdsa::SigningKey) -> Result<String> {
    runtime()?.block_on(async {
        let (c, auth) = (client(r), auth(r.resolve_registry()));
        let digest = match r.digest() {
            Some(d) => d.to_owned(),
            None => c
                .fetch_manifest_digest(r, &auth)
                .await
                .with_context(|| format!("resolving {r}"))?,
        };
        let payload = super::sign::payload(&repository(r), &digest);
        let signature = super::sign::sign(key, &payload);
        let mut notes = BTreeMap::new();
        notes.insert(super::sign::SIGNATURE.to_owned(), signature);
        let layer = ImageLayer::new(payload, super::sign::SIMPLESIGNING.to_owned(), Some(notes));
        let config = Config::new(
            b"{}".to_vec(),
            "application/vnd.oci.image.config.v1+json".to_owned(),
            None,
        );
        let at = signature_ref(r, &digest);
        c.push(&at, &[layer], config, &auth, None)
            .await
            .with_context(|| format!("pushing the signature to {at}"))?;
        Ok(digest)
    })
}

/// The signature layers (payload, signature) stored for the manifest `digest`; `None` when there are
/// none.
pub fn signatures(r: &Reference, digest: &str) -> Result<Option<Vec<super::sign::SignatureLayer>>> {
    let at = signature_ref(r, digest);
    runtime()?.block_on(async {
        let c = client(r);
        match c
            .pull(
                &at,
                &auth(r.resolve_registry()),
                vec![super::sign::SIMPLESIGNING],
            )
            .await
        {
            Ok(data) => Ok(Some(
                data.layers
                    .into_iter()
                    .map(|l| {
                        let sig = l
                            .annotations
                            .as_ref()
                            .and_then(|a| a.get(super::sign::SIGNATURE).cloned());
                        (l.data.to_vec(), sig)
                    })
                    .collect(),
            )),
            Err(e) if format!("{e:#}").contains("manifest unknown") => Ok(None),
            Err(e) => Err(e).with_context(|| format!("pulling the signatures at {at}")),
        }
    })
}
