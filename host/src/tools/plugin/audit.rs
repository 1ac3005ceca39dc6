//! The audit log: every plugin call, one JSON line, durable before the caller sees the result.
//!
//! A line records when, which conversation, which plugin (name and sha256), which function, the sha256 of
//! the arguments' JSON text (and, when the policy says so, the arguments themselves), the outcome
//! (`ok`, `rejected` before the plugin ran, or `error` with its kind and message), the duration and the fuel
//! used. The file is opened in append mode; each line is written whole under a lock and is covered by an
//! `fdatasync` before [`AuditLog::append`] returns, so a crash right after a tool's effect still leaves its
//! record. Syncs are group-committed: a caller whose line was already covered by another caller's sync
//! (one that started after the line was written) returns without syncing again, so concurrent calls share
//! one disk flush. A call whose record cannot be written fails: an unaudited result is never handed back.

use serde::Serialize;
use serde_json::Value;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use thiserror::Error;

/// The audit log could not be opened or written.
#[derive(Debug, Error)]
#[error("audit log {path}: {msg}")]
pub struct AuditError {
    /// The file.
    pub path: String,
    /// What failed.
    pub msg: String,
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The plugin returned a result.
    Ok,
    /// Refused before the plugin ran (unknown function, arguments against the schema, busy).
    Rejected,
    /// The plugin ran and failed (tool error, trap, timeout, limit).
    Error,
}

/// One call, as recorded.
#[derive(Debug, Clone, Serialize)]
pub struct Record<'a> {
    /// RFC 3339 UTC time the call started, in milliseconds.
    pub time: String,
    /// The conversation the call belongs to, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation: Option<&'a str>,
    /// Plugin name.
    pub plugin: &'a str,
    /// Plugin file digest.
    pub plugin_sha256: &'a str,
    /// Function called.
    pub function: &'a str,
    /// sha256 of the arguments' compact JSON text.
    pub args_sha256: String,
    /// The arguments, when the policy records them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub args: Option<&'a Value>,
    /// How it ended.
    pub outcome: Outcome,
    /// The error's kind (`timeout`, `memory_limit`, ...), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<&'static str>,
    /// The error's message, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Wall time of the call in microseconds.
    pub duration_us: u64,
    /// Fuel used, when metered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
    /// Size of the result in bytes (0 when none).
    pub result_bytes: usize,
}

impl Record<'_> {
    /// The time format used in records.
    pub fn now(t: SystemTime) -> String {
        humantime::format_rfc3339_millis(t).to_string()
    }

    /// A duration in whole microseconds.
    pub fn micros(d: Duration) -> u64 {
        u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
    }
}

/// An append-only, fsynced JSON-lines file.
#[derive(Debug)]
pub struct AuditLog {
    path: PathBuf,
    /// Held while a line is written, so lines never interleave.
    file: Mutex<File>,
    /// Lines written so far (their sequence numbers are 1, 2, ...).
    written: AtomicU64,
    /// Held while syncing; holds the number of lines known durable. An async lock, so callers waiting for
    /// a sync yield their worker thread instead of blocking it.
    synced: tokio::sync::Mutex<u64>,
    /// A second handle to the file, for syncing without holding the write lock.
    sync_handle: Arc<File>,
}

impl AuditLog {
    /// Opens (creating) the log at `path` for appending.
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        let err = |e: std::io::Error| AuditError {
            path: path.display().to_string(),
            msg: e.to_string(),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(err)?;
        Ok(AuditLog {
            path: path.to_owned(),
            sync_handle: Arc::new(file.try_clone().map_err(err)?),
            file: Mutex::new(file),
            written: AtomicU64::new(0),
            synced: tokio::sync::Mutex::new(0),
        })
    }

    /// Where it writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one record's line (not yet durable); returns its sequence number.
    fn write(&self, record: &Record<'_>) -> Result<u64, AuditError> {
        let mut line = serde_json::to_vec(record).map_err(|e| self.err(e.to_string()))?;
        line.push(b'\n');
        // A poisoned lock only means another writer panicked mid-write; the file handle is still fine.
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        f.write_all(&line).map_err(|e| self.err(e.to_string()))?;
        Ok(self.written.fetch_add(1, Ordering::SeqCst) + 1)
    }

    fn err(&self, msg: String) -> AuditError {
        AuditError {
            path: self.path.display().to_string(),
            msg,
        }
    }

    /// Appends one record and makes it durable (blocking; not from inside an async runtime).
    pub fn append(&self, record: &Record<'_>) -> Result<(), AuditError> {
        let mine = self.write(record)?;
        let mut synced = self.synced.blocking_lock();
        if *synced >= mine {
            return Ok(()); // a sync that started after our write covered it
        }
        // Everything written before this sync starts is covered by it.
        let upto = self.written.load(Ordering::SeqCst);
        self.sync_handle
            .sync_data()
            .map_err(|e| self.err(e.to_string()))?;
        *synced = upto;
        Ok(())
    }

    /// [`AuditLog::append`] for async callers: the sync runs on a blocking thread, and while it runs other
    /// calls go on and queue their lines, which the next sync then covers together.
    pub async fn append_async(&self, record: &Record<'_>) -> Result<(), AuditError> {
        let mine = self.write(record)?;
        let mut synced = self.synced.lock().await;
        if *synced >= mine {
            return Ok(());
        }
        let upto = self.written.load(Ordering::SeqCst);
        let file = Arc::clone(&self.sync_handle);
        tokio::task::spawn_blocking(move || file.sync_data())
            .await
            .map_err(|e| self.err(e.to_string()))?
            .map_err(|e| self.err(e.to_string()))?;
        *synced = upto;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/audit.jsonl");
        let log = AuditLog::open(&path).unwrap();
        let args = serde_json::json!({"a": 1});
        for (i, outcome) in [Outcome::Ok, Outcome::Error].into_iter().enumerate() {
            log.append(&Record {
                time: Record::now(SystemTime::UNIX_EPOCH + Duration::from_millis(1500)),
                conversation: Some("c1"),
                plugin: "p",
                plugin_sha256: "ab",
                function: "f",
                args_sha256: "cd".into(),
                args: (i == 0).then_some(&args),
                outcome,
                error_kind: (i == 1).then_some("timeout"),
                error: None,
                duration_us: 12,
                fuel: None,
                result_bytes: 3,
            })
            .unwrap();
        }
        // Reopening appends, never truncates.
        drop(log);
        let log = AuditLog::open(&path).unwrap();
        assert_eq!(log.path(), path);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["time"], "1970-01-01T00:00:01.500Z");
        assert_eq!(lines[0]["args"]["a"], 1);
        assert_eq!(lines[0]["outcome"], "ok");
        assert!(lines[1].get("args").is_none());
        assert_eq!(lines[1]["error_kind"], "timeout");
    }

    #[test]
    fn concurrent_appends_stay_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let log = AuditLog::open(&path).unwrap();
        let big = "x".repeat(10_000);
        std::thread::scope(|s| {
            for t in 0..8 {
                let (log, big) = (&log, &big);
                s.spawn(move || {
                    for i in 0..50 {
                        let conv = format!("t{t}-{i}");
                        log.append(&Record {
                            time: Record::now(SystemTime::now()),
                            conversation: Some(&conv),
                            plugin: "p",
                            plugin_sha256: "ab",
                            function: big,
                            args_sha256: String::new(),
                            args: None,
                            outcome: Outcome::Ok,
                            error_kind: None,
                            error: None,
                            duration_us: 1,
                            fuel: None,
                            result_bytes: 0,
                        })
                        .unwrap();
                    }
                });
            }
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let mut seen: Vec<String> = text
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                v["conversation"].as_str().unwrap().to_owned()
            })
            .collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 400);
        assert_eq!(*log.synced.blocking_lock(), 400);
    }

    #[test]
    fn async_appends_share_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let log = Arc::new(AuditLog::open(&dir.path().join("audit.jsonl")).unwrap());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        rt.block_on(async {
            let tasks: Vec<_> = (0..64)
                .map(|i| {
                    let log = Arc::clone(&log);
                    tokio::spawn(async move {
                        let conv = format!("c{i}");
                        let r = Record {
                            time: Record::now(SystemTime::now()),
                            conversation: Some(&conv),
                            plugin: "p",
                            plugin_sha256: "ab",
                            function: "f",
                            args_sha256: String::new(),
                            args: None,
                            outcome: Outcome::Ok,
                            error_kind: None,
                            error: None,
                            duration_us: 1,
                            fuel: None,
                            result_bytes: 0,
                        };
                        log.append_async(&r).await.unwrap();
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        let text = std::fs::read_to_string(log.path()).unwrap();
        assert_eq!(text.lines().count(), 64);
        assert_eq!(*log.synced.blocking_lock(), 64);
    }
}
