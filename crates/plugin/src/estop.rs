//! The e-stop latch: while it is latched, a call that may move or change anything is refused before it
//! reaches its plugin (a typed `estopped` error the model sees), and calls of that kind already running
//! are interrupted. What always runs: functions the manifest marks `"stop": true` (what makes an actuator
//! safe: the arm's `stop`, `home`) and functions marked read-only (`readOnlyHint`). A function with no
//! such mark is refused: an actuator fails closed.
//!
//! The latch is kept in a file (written whole and synced before the latch changes), so a latched e-stop
//! is still latched after a restart; a state file that cannot be read latches it (fail closed) and says
//! why. One latch per process, owned by the [`crate::PluginHost`] that runs every plugin.

use crate::manifest::FunctionDef;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

/// Why the latch's state could not be kept.
#[derive(Debug, thiserror::Error)]
#[error("e-stop state {path}: {msg}")]
pub struct EstopError {
    /// The state file.
    pub path: String,
    /// What went wrong.
    pub msg: String,
}

/// The latch's state, as `/health` and `GET /v1/thorn/estop` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EstopState {
    /// Whether it is latched.
    pub latched: bool,
    /// Seconds since the Unix epoch when it last changed (`None`: never).
    pub since: Option<u64>,
    /// Who changed it last (an API key id, `cli`, `signal`, or why it latched itself).
    pub by: Option<String>,
}

/// The e-stop latch (see the module docs).
#[derive(Debug)]
pub struct Estop {
    latched: AtomicBool,
    state: Mutex<EstopState>,
    path: Option<PathBuf>,
    /// Wakes the calls waiting to be interrupted when it latches.
    latching: tokio::sync::Notify,
}

impl Default for Estop {
    fn default() -> Self {
        Estop::in_memory()
    }
}

impl Estop {
    /// A latch kept only in memory (released at start).
    pub fn in_memory() -> Self {
        Estop {
            latched: AtomicBool::new(false),
            state: Mutex::new(EstopState {
                latched: false,
                since: None,
                by: None,
            }),
            path: None,
            latching: tokio::sync::Notify::new(),
        }
    }

    /// The latch kept in the file `path`: latched now if it was latched when the process last ran, or if
    /// the file cannot be read (a missing file is a released latch).
    pub fn load(path: &Path) -> Self {
        let state = match std::fs::read(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => EstopState {
                latched: false,
                since: None,
                by: None,
            },
            read => match read
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<EstopState>(&b).map_err(|e| e.to_string()))
            {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "the e-stop state cannot be read: latched until released");
                    EstopState {
                        latched: true,
                        since: Some(now()),
                        by: Some(format!("unreadable state file: {e}")),
                    }
                }
            },
        };
        if state.latched {
            tracing::warn!(path = %path.display(), by = ?state.by, "the e-stop is latched");
        }
        Estop {
            latched: AtomicBool::new(state.latched),
            state: Mutex::new(state),
            path: Some(path.to_owned()),
            latching: tokio::sync::Notify::new(),
        }
    }

    /// Whether it is latched.
    pub fn latched(&self) -> bool {
        self.latched.load(Ordering::SeqCst)
    }

    /// Its state.
    pub fn state(&self) -> EstopState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Latches (`on`) or releases it, for `by`. The new state is in the file before it takes effect; when
    /// it cannot be written, latching still takes effect (fail closed) and the error is returned, and
    /// releasing does not.
    pub fn set(&self, on: bool, by: &str) -> Result<EstopState, EstopError> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let next = EstopState {
            latched: on,
            since: Some(now()),
            by: Some(by.to_owned()),
        };
        let written = self.path.as_deref().map_or(Ok(()), |p| write(p, &next));
        match (&written, on) {
            (Err(_), false) => {}
            _ => {
                self.latched.store(on, Ordering::SeqCst);
                *st = next.clone();
                if on {
                    self.latching.notify_waiters();
                }
                tracing::warn!(latched = on, by, "e-stop");
            }
        }
        written.map(|()| next)
    }

    /// Returns once it is latched (at once if it is).
    pub async fn until_latched(&self) {
        loop {
            let woken = self.latching.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.latched() {
                return;
            }
            woken.await;
        }
    }

    /// Whether `f` may run while the latch is latched: it makes an actuator safe, or changes nothing.
    pub fn always_runs(f: &FunctionDef) -> bool {
        f.stop || f.annotations.read_only == Some(true)
    }
}

/// Writes `state` to `path` whole: a temporary file beside it, synced, renamed over it, the directory
/// synced.
fn write(path: &Path, state: &EstopState) -> Result<(), EstopError> {
    let err = |e: std::io::Error| EstopError {
        path: path.display().to_string(),
        msg: e.to_string(),
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(err)?;
    serde_json::to_writer(&mut tmp, state).map_err(|e| err(e.into()))?;
    tmp.as_file().sync_all().map_err(err)?;
    tmp.persist(path).map_err(|e| err(e.error))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latched_estop_stays_latched_across_restarts_and_an_unreadable_one_latches() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("estop.json");
        let e = Estop::load(&path);
        assert!(!e.latched(), "no file: released");
        e.set(true, "cli").unwrap();
        assert!(e.latched());
        let again = Estop::load(&path);
        assert!(again.latched(), "latched stays latched");
        assert_eq!(again.state().by.as_deref(), Some("cli"));
        again.set(false, "key-1").unwrap();
        assert!(!Estop::load(&path).latched());
        std::fs::write(&path, "{not json").unwrap();
        let broken = Estop::load(&path);
        assert!(broken.latched(), "fail closed");
        assert!(broken.state().by.unwrap().contains("unreadable"));
    }

    #[test]
    fn latching_takes_effect_even_when_it_cannot_be_written_but_releasing_does_not() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the state file should be: writes fail.
        let path = dir.path().join("estop.json");
        std::fs::create_dir_all(path.join("x")).unwrap();
        let e = Estop {
            path: Some(path),
            ..Estop::in_memory()
        };
        assert!(e.set(true, "signal").is_err());
        assert!(e.latched(), "latched anyway");
        assert!(e.set(false, "cli").is_err());
        assert!(e.latched(), "not released without its record");
    }
}
