//! The compiled-code cache: native code for a component, tied to the component it was compiled from.
//!
//! Loading a `.cwasm` runs whatever native code it holds, so the cache must not be a way around the sha256
//! pin: whoever could write a file there would otherwise replace an approved plugin's code while
//! `plugins list` and the audit log still show the approved digest. Two checks close that:
//!
//! * **The directory must be private.** [`Cache::open`] creates it `0700` and refuses (the host then
//!   compiles in memory, with a warning) a directory not owned by the current user or writable by group or
//!   others, or one below a directory that someone else could rename it out of (not owned by the user or
//!   root, and writable by others without the sticky bit).
//! * **Every artifact carries a MAC.** A file is the artifact followed by a 32-byte HMAC-SHA256 tag under a
//!   per-host secret key (`cache.key` in the directory, 32 random bytes, `0600`) over the component's
//!   sha256, the engine's compatibility hash and the artifact. [`Cache::load`] reads the file once, checks
//!   the tag and hands back exactly the bytes it checked; a tag that does not verify (a flipped byte,
//!   another plugin's artifact under this name, a file from another host) is ignored with a warning and the
//!   component is recompiled, overwriting it.

use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Bytes of the tag at the end of every file.
const TAG: usize = 32;
/// Bytes of the key.
const KEY: usize = 32;
/// The key file's name inside the cache directory.
const KEY_FILE: &str = "cache.key";
/// Domain separation: what the tag is over.
const CONTEXT: &[u8] = b"thorn compiled component v1\0";

/// A trusted cache directory and its key.
pub(super) struct Cache {
    dir: PathBuf,
    key: [u8; KEY],
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache").field("dir", &self.dir).finish()
    }
}

impl Cache {
    /// Opens (creating) `dir` as the cache, or says why it cannot be trusted.
    pub(super) fn open(dir: &Path) -> Result<Cache, String> {
        let mut b = std::fs::DirBuilder::new();
        b.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(dir)
            .map_err(|e| format!("cannot create it: {e}"))?;
        let dir = dir
            .canonicalize()
            .map_err(|e| format!("cannot resolve it: {e}"))?;
        #[cfg(unix)]
        trusted(&dir)?;
        let key = key(&dir.join(KEY_FILE))?;
        Ok(Cache { dir, key })
    }

    /// The directory.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of the component with digest `sha` for an engine with compatibility hash `engine`.
    pub(super) fn file(&self, sha: &str, engine: u64) -> PathBuf {
        self.dir.join(format!("{sha}-{engine:016x}.cwasm"))
    }

    fn tag(&self, sha: &str, engine: u64, artifact: &[u8]) -> [u8; TAG] {
        hmac_sha256(
            &self.key,
            &[
                CONTEXT,
                sha.as_bytes(),
                b"\0",
                &engine.to_le_bytes(),
                artifact,
            ],
        )
    }

    /// The verified artifact cached for `sha`, if there is one (a missing, unreadable or forged file is
    /// `None`; the caller recompiles).
    pub(super) fn load(&self, sha: &str, engine: u64) -> Option<Vec<u8>> {
        let file = self.file(sha, engine);
        let mut bytes = match std::fs::read(&file) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(file = %file.display(), error = %e, "cannot read a cached component; recompiling");
                return None;
            }
        };
        let ok = bytes.len() >= TAG && {
            let (artifact, tag) = bytes.split_at(bytes.len() - TAG);
            same(&self.tag(sha, engine, artifact), tag)
        };
        if !ok {
            tracing::warn!(file = %file.display(), "a cached component does not verify (tampered, or from another host); recompiling");
            return None;
        }
        bytes.truncate(bytes.len() - TAG);
        Some(bytes)
    }

    /// Caches `artifact` for `sha`, with its tag, atomically (a temporary file renamed over the name).
    pub(super) fn store(&self, sha: &str, engine: u64, artifact: &[u8]) -> std::io::Result<()> {
        let mut tmp = tempfile::NamedTempFile::new_in(&self.dir)?;
        tmp.write_all(artifact)?;
        tmp.write_all(&self.tag(sha, engine, artifact))?;
        tmp.as_file().sync_data()?;
        tmp.persist(self.file(sha, engine)).map_err(|e| e.error)?;
        Ok(())
    }
}

/// The key at `path`, created (32 random bytes, `0600`) if missing; an existing key must be a private
/// regular file of the right size.
fn key(path: &Path) -> Result<[u8; KEY], String> {
    for _ in 0..2 {
        match std::fs::symlink_metadata(path) {
            Ok(meta) => {
                if !meta.is_file() {
                    return Err(format!("{} is not a regular file", path.display()));
                }
                #[cfg(unix)]
                {
                    use std::os::unix::fs::MetadataExt;
                    if meta.uid() != euid() || meta.mode() & 0o077 != 0 {
                        return Err(format!(
                            "{} must be owned by this user and mode 0600",
                            path.display()
                        ));
                    }
                }
                let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
                return bytes
                    .try_into()
                    .map_err(|_| format!("{} is not a {KEY}-byte key", path.display()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut key = [0u8; KEY];
                getrandom::fill(&mut key).map_err(|e| format!("no random key: {e}"))?;
                let mut o = std::fs::OpenOptions::new();
                o.write(true).create_new(true);
                #[cfg(unix)]
                std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
                match o.open(path) {
                    Ok(mut f) => {
                        f.write_all(&key)
                            .and_then(|()| f.sync_all())
                            .map_err(|e| format!("{}: {e}", path.display()))?;
                        return Ok(key);
                    }
                    // Another process created it first: read theirs.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(format!("{}: {e}", path.display())),
                }
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
    Err(format!("{} keeps changing", path.display()))
}

#[cfg(unix)]
fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Whether `dir` (canonical) is safe to load native code from: owned by this user and writable by no one
/// else, below directories no one else can rename it out of.
#[cfg(unix)]
fn trusted(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let me = euid();
    let meta = |p: &Path| std::fs::metadata(p).map_err(|e| format!("{}: {e}", p.display()));
    let m = meta(dir)?;
    if m.uid() != me {
        return Err(format!(
            "{} is owned by uid {}, not this user ({me})",
            dir.display(),
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 {
        return Err(format!(
            "{} is writable by group or others (mode {:o})",
            dir.display(),
            m.mode() & 0o7777
        ));
    }
    for a in dir.ancestors().skip(1) {
        let m = meta(a)?;
        let sticky = m.mode() & 0o1000 != 0;
        if (m.uid() != me && m.uid() != 0) || (m.mode() & 0o022 != 0 && !sticky) {
            return Err(format!(
                "its parent {} is not safe (owned by uid {}, mode {:o})",
                a.display(),
                m.uid(),
                m.mode() & 0o7777
            ));
        }
    }
    Ok(())
}

/// HMAC-SHA256 (RFC 2104) of the concatenation of `parts` under `key` (at most one block, 64 bytes).
fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut k = [0u8; 64];
    k[..key.len()].copy_from_slice(key);
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Compares two tags without an early exit.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        let tag = hmac_sha256(b"Jefe", &[b"what do ya ", b"want for nothing?"]);
        assert_eq!(
            crate::host::hex(&tag),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn artifacts_verify_only_under_their_name_and_key() {
        let root = tempfile::tempdir().unwrap();
        let c = Cache::open(&root.path().join("cwasm")).unwrap();
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        assert_eq!(c.load(&a, 1), None);
        c.store(&a, 1, b"native code of a").unwrap();
        c.store(&b, 1, b"native code of b").unwrap();
        assert_eq!(c.load(&a, 1).as_deref(), Some(&b"native code of a"[..]));
        // Another engine's name, another component's file, a flipped byte: none verifies.
        assert_eq!(c.load(&a, 2), None);
        std::fs::copy(c.file(&b, 1), c.file(&a, 1)).unwrap();
        assert_eq!(c.load(&a, 1), None);
        c.store(&a, 1, b"native code of a").unwrap();
        let mut bytes = std::fs::read(c.file(&a, 1)).unwrap();
        bytes[3] ^= 1;
        std::fs::write(c.file(&a, 1), &bytes).unwrap();
        assert_eq!(c.load(&a, 1), None);
        // The same directory reopened keeps its key; a fresh directory's key does not accept the file.
        c.store(&a, 1, b"native code of a").unwrap();
        let again = Cache::open(&root.path().join("cwasm")).unwrap();
        assert!(again.load(&a, 1).is_some());
        let other = Cache::open(&root.path().join("other")).unwrap();
        std::fs::copy(c.file(&a, 1), other.file(&a, 1)).unwrap();
        assert_eq!(other.load(&a, 1), None);
    }

    #[cfg(unix)]
    #[test]
    fn shared_directories_and_loose_keys_are_not_trusted() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("cwasm");
        let c = Cache::open(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(KEY_FILE)), 0o600);
        drop(c);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = Cache::open(&dir).unwrap_err();
        assert!(e.contains("writable by group or others"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(dir.join(KEY_FILE), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        let e = Cache::open(&dir).unwrap_err();
        assert!(e.contains("0600"), "{e}");
        // Below a directory others may write (no sticky bit): someone could swap the whole cache.
        let shared = root.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = Cache::open(&shared.join("cwasm")).unwrap_err();
        assert!(e.contains("parent"), "{e}");
    }
}
