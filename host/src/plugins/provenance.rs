//! Where a pulled plugin came from, kept beside it (`NAME.provenance.json`): the reference, the manifest
//! (bytes and digest) whose layer is the installed file, and the signatures found for it. `thorn plugins
//! approve` checks them again, offline, against the policy's trust at that time: a key or identity
//! removed from the policy after the pull no longer approves the plugin, and a file that is not the
//! layer the manifest names is refused.

use anyhow::{Context, Result, bail};
use base64::Engine;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thorn_plugin::sha256_hex;
use thorn_plugin::signing::{self, Evidence, Subject, Trust, Verified};

/// The record.
#[derive(Debug, Serialize, Deserialize)]
pub struct Provenance {
    /// `oci://HOST/REPO[:TAG|@DIGEST]` as pulled.
    pub reference: String,
    /// `HOST/REPO`.
    pub repository: String,
    /// `sha256:...` of the manifest.
    pub manifest_digest: String,
    /// The manifest's bytes, base64.
    pub manifest: String,
    /// The signatures found for it.
    pub evidence: Evidence,
}

/// The record's path for the plugin file `wasm`.
pub fn path(wasm: &Path) -> PathBuf {
    wasm.with_extension("provenance.json")
}

impl Provenance {
    /// The record beside `wasm`, if any.
    pub fn read(wasm: &Path) -> Result<Option<Self>> {
        let p = path(wasm);
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(
                serde_json::from_slice(&b).with_context(|| format!("reading {}", p.display()))?,
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    /// Writes the record beside `wasm` (replacing it atomically).
    pub fn write(&self, wasm: &Path) -> Result<()> {
        let p = path(wasm);
        let dir = p.parent().unwrap_or(Path::new("."));
        let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
        serde_json::to_writer_pretty(&mut tmp, self)?;
        tmp.as_file().sync_all()?;
        tmp.persist(&p)?;
        Ok(())
    }

    /// Checks that `component` is the layer this record's manifest names and that its signatures
    /// satisfy `trust`.
    pub fn check(&self, component: &[u8], trust: &Trust) -> Result<Verified> {
        let manifest = base64::engine::general_purpose::STANDARD
            .decode(&self.manifest)
            .context("the provenance record's manifest")?;
        if format!("sha256:{}", sha256_hex(&manifest)) != self.manifest_digest {
            bail!(
                "the provenance record of {} is damaged (its manifest is not {})",
                self.reference,
                self.manifest_digest
            );
        }
        let m: serde_json::Value = serde_json::from_slice(&manifest)?;
        let layer = format!("sha256:{}", sha256_hex(component));
        if m["layers"][0]["digest"] != layer.as_str() {
            bail!(
                "the installed file (sha256 {}) is not the layer of {} ({})",
                &layer[7..],
                self.reference,
                self.manifest_digest
            );
        }
        Ok(signing::verify(
            &Subject {
                reference: &self.reference,
                repository: &self.repository,
                digest: &self.manifest_digest,
            },
            &self.evidence,
            trust,
        )?)
    }
}
