//! The audit log: every plugin call, as JSON lines, durable *before* the call can have an effect.
//!
//! A call that passes validation writes two lines that share its `call` id: an **intent** line (when, who:
//! conversation, API key id and peer address; which plugin with its sha256, which function, the sha256 of the
//! arguments' JSON text, and the arguments themselves when the policy says so), fsynced before the plugin
//! runs, and an **outcome** line (`ok`, or `error` with its kind and message; duration, fuel, result size),
//! fsynced before the result is handed back. If the intent cannot be made durable the call does not run; if
//! the outcome cannot, the result is withheld. A call refused before it could run (unknown function,
//! arguments against the schema, an invalid caller) writes one outcome line, `rejected`.
//!
//! Lines are whole or absent. Each is written under a lock with one `write`; if that fails the file is cut
//! back to its length before the write, so a torn line is never glued to the next record (and a file left
//! torn by a crash gets a newline when it is reopened). Syncs are group-committed: a caller whose line was
//! already covered by another caller's sync (one that started after the line was written) returns without
//! syncing again, so concurrent calls share one disk flush.
//!
//! The file is created `0600` (an existing one is narrowed to that) and rotated by size: when a line would
//! take it past [`Rotation::max_bytes`], `audit.jsonl` becomes `audit.jsonl.1` (`.1` becomes `.2`, ... up to
//! [`Rotation::keep`]; the oldest is dropped) and a new file is started. One process should write a file;
//! another writer's lines stay whole (appends) but rotation does not coordinate with it.

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
    /// Refused before the plugin ran (unknown function, arguments against the schema, invalid caller).
    Rejected,
    /// The plugin ran (or was about to) and failed (tool error, trap, timeout, limit, busy).
    Error,
}

/// Which of a call's lines a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// The call waits for a person's decision (written and synced before it is listed).
    Pending,
    /// The decision on a pending call: who made it and which.
    Decision,
    /// Written and synced before the plugin runs.
    Intent,
    /// How it ended.
    Outcome,
    /// An operator's change to a plugin (`remove`, `revoke`), written before it is made; `function` names
    /// the change and `args` what it took away.
    Admin,
}

/// One line, as recorded. Intent lines leave the outcome fields out; outcome lines leave `args` out.
#[derive(Debug, Clone, Serialize)]
pub struct Record<'a> {
    /// The call's id, shared by its intent and outcome lines (see [`AuditLog::call_id`]).
    pub call: &'a str,
    /// Intent or outcome.
    pub phase: Phase,
    /// RFC 3339 UTC time the line was made, in milliseconds.
    pub time: String,
    /// The conversation the call belongs to, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation: Option<&'a str>,
    /// The id of the API key the request used, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_id: Option<&'a str>,
    /// The client's address, if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<&'a str>,
    /// Plugin name.
    pub plugin: &'a str,
    /// Plugin file digest.
    pub plugin_sha256: &'a str,
    /// Function called.
    pub function: &'a str,
    /// sha256 of the arguments' compact JSON text.
    pub args_sha256: &'a str,
    /// The arguments, when the policy records them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub args: Option<&'a Value>,
    /// How it ended (outcome lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// The error's kind (`timeout`, `memory_limit`, ...), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<&'static str>,
    /// The error's message, if any (bounded; arguments redacted unless they are recorded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Wall time of the call in microseconds (outcome lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_us: Option<u64>,
    /// Fuel used, when metered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
    /// Size of the result in bytes (outcome lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_bytes: Option<usize>,
    /// The approval's id (pending and decision lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval: Option<&'a str>,
    /// `approve` or `deny` (decision lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<&'static str>,
    /// Who decided: an API key id, `loopback`, `timeout`, `estop`, `cancelled` (decision lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approver: Option<&'a str>,
}

impl<'a> Record<'a> {
    /// The line of an operator's change `action` to `plugin` (pinned at `plugin_sha256`), taking away
    /// `what`, made from the command line now.
    pub fn admin(
        call: &'a str,
        plugin: &'a str,
        plugin_sha256: &'a str,
        action: &'a str,
        what_sha256: &'a str,
        what: &'a Value,
    ) -> Self {
        Record {
            call,
            phase: Phase::Admin,
            time: Self::now(SystemTime::now()),
            conversation: None,
            key_id: Some("cli"),
            peer: None,
            plugin,
            plugin_sha256,
            function: action,
            args_sha256: what_sha256,
            args: Some(what),
            outcome: None,
            error_kind: None,
            error: None,
            duration_us: None,
            fuel: None,
            result_bytes: None,
            approval: None,
            decision: None,
            approver: None,
        }
    }

    /// The time format used in records.
    pub fn now(t: SystemTime) -> String {
        humantime::format_rfc3339_millis(t).to_string()
    }

    /// A duration in whole microseconds.
    pub fn micros(d: Duration) -> u64 {
        u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
    }
}

/// When the log is rotated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// Rotate when a line would take the file past this many bytes (0: never).
    pub max_bytes: u64,
    /// Rotated files kept (`.1` is the newest); 0 drops the old file at rotation.
    pub keep: u32,
}

impl Default for Rotation {
    fn default() -> Self {
        Rotation {
            max_bytes: 64 << 20,
            keep: 5,
        }
    }
}

/// The file being written and what has gone into it.
#[derive(Debug)]
struct Sink {
    file: Arc<File>,
    /// Lines written so far, over all files (their sequence numbers are 1, 2, ...).
    written: u64,
    /// A failed write could not be cut back: the length the file must be cut to before the next write.
    torn_at: Option<u64>,
    /// Test hook: the next write puts this many bytes of its line and then fails.
    #[cfg(any(test, feature = "faults"))]
    fault: Option<usize>,
}

/// An append-only, fsynced, rotated JSON-lines file.
#[derive(Debug)]
pub struct AuditLog {
    path: PathBuf,
    rotation: Rotation,
    /// Held while a line is written, so lines never interleave.
    sink: Mutex<Sink>,
    /// Held while syncing; holds the number of lines known durable. An async lock, so callers waiting for
    /// a sync yield their worker thread instead of blocking it.
    synced: tokio::sync::Mutex<u64>,
    /// This process's prefix of call ids (random), and the calls numbered so far.
    run: String,
    calls: AtomicU64,
}

impl AuditLog {
    /// Opens (creating) the log at `path` for appending, rotated at the default size.
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        Self::open_with(path, Rotation::default())
    }

    /// Opens (creating) the log at `path` for appending, rotated as `rotation` says.
    pub fn open_with(path: &Path, rotation: Rotation) -> Result<Self, AuditError> {
        let err = |e: std::io::Error| AuditError {
            path: path.display().to_string(),
            msg: e.to_string(),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let file = open_file(path).map_err(err)?;
        let mut run = [0u8; 8];
        getrandom::fill(&mut run).map_err(|e| err(std::io::Error::other(e.to_string())))?;
        Ok(AuditLog {
            path: path.to_owned(),
            rotation,
            sink: Mutex::new(Sink {
                file: Arc::new(file),
                written: 0,
                torn_at: None,
                #[cfg(any(test, feature = "faults"))]
                fault: None,
            }),
            synced: tokio::sync::Mutex::new(0),
            run: crate::host::hex(&run),
            calls: AtomicU64::new(0),
        })
    }

    /// Where it writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// When it rotates.
    pub fn rotation(&self) -> Rotation {
        self.rotation
    }

    /// A fresh call id: this process's random prefix and a counter, unique across restarts.
    pub fn call_id(&self) -> String {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        format!("{}-{n}", self.run)
    }

    fn err(&self, msg: String) -> AuditError {
        AuditError {
            path: self.path.display().to_string(),
            msg,
        }
    }

    /// Writes one record's line (not yet durable); returns its sequence number.
    fn write(&self, record: &Record<'_>) -> Result<u64, AuditError> {
        let mut line = serde_json::to_vec(record).map_err(|e| self.err(e.to_string()))?;
        line.push(b'\n');
        // A poisoned lock only means another writer panicked mid-write; the sink's state is still whole.
        let mut sink = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        let io = |e: std::io::Error| self.err(e.to_string());
        if let Some(len) = sink.torn_at {
            sink.file
                .set_len(len)
                .map_err(|e| self.err(format!("cannot cut back a torn line: {e}")))?;
            sink.torn_at = None;
        }
        let mut len = sink.file.metadata().map_err(io)?.len();
        let max = self.rotation.max_bytes;
        if max > 0 && len > 0 && len + line.len() as u64 > max {
            self.rotate(&mut sink).map_err(io)?;
            len = 0;
        }
        if let Err(e) = put(&mut sink, &line) {
            // Cut the partial line off (an append-mode file still allows it), or remember to before the next.
            if sink.file.set_len(len).is_err() {
                sink.torn_at = Some(len);
            }
            return Err(io(e));
        }
        sink.written += 1;
        Ok(sink.written)
    }

    /// Moves the current file to `.1` (shifting the older ones) and starts a new one. The old file is synced
    /// first, so every line written before the rotation is durable.
    fn rotate(&self, sink: &mut Sink) -> std::io::Result<()> {
        sink.file.sync_data()?;
        let nth = |n: u32| {
            let mut s = self.path.clone().into_os_string();
            s.push(format!(".{n}"));
            PathBuf::from(s)
        };
        if self.rotation.keep == 0 {
            std::fs::remove_file(&self.path)?;
        } else {
            for n in (1..self.rotation.keep).rev() {
                match std::fs::rename(nth(n), nth(n + 1)) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            std::fs::rename(&self.path, nth(1))?;
        }
        sink.file = Arc::new(open_file(&self.path)?);
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    }

    /// The file to sync and the lines it covers once synced.
    fn to_sync(&self) -> (Arc<File>, u64) {
        let sink = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        (Arc::clone(&sink.file), sink.written)
    }

    /// Appends one record and makes it durable (blocking; not from inside an async runtime).
    pub fn append(&self, record: &Record<'_>) -> Result<(), AuditError> {
        let mine = self.write(record)?;
        let mut synced = self.synced.blocking_lock();
        if *synced >= mine {
            return Ok(()); // a sync that started after our write covered it
        }
        // Everything written before this sync starts is covered by it (lines of a file rotated away were
        // synced by the rotation).
        let (file, upto) = self.to_sync();
        file.sync_data().map_err(|e| self.err(e.to_string()))?;
        *synced = upto;
        Ok(())
    }

    /// Appends one record from where nothing can wait for it (a `Drop`): the line is written now, and made
    /// durable on a blocking thread of the current runtime (or here, outside one).
    pub fn append_detached(&self, record: &Record<'_>) -> Result<(), AuditError> {
        self.write(record)?;
        let (file, _) = self.to_sync();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || {
                    if let Err(e) = file.sync_data() {
                        tracing::error!(error = %e, "an audit line cannot be synced");
                    }
                });
                Ok(())
            }
            Err(_) => file.sync_data().map_err(|e| self.err(e.to_string())),
        }
    }

    /// Makes the next write fail after `bytes` bytes of its line (fault injection: the `faults` feature,
    /// for tests of what happens when a record cannot be written).
    #[cfg(any(test, feature = "faults"))]
    pub fn fail_next_write(&self, bytes: usize) {
        self.sink.lock().unwrap_or_else(|e| e.into_inner()).fault = Some(bytes);
    }

    /// [`AuditLog::append`] for async callers: the sync runs on a blocking thread, and while it runs other
    /// calls go on and queue their lines, which the next sync then covers together.
    pub async fn append_async(&self, record: &Record<'_>) -> Result<(), AuditError> {
        let mine = self.write(record)?;
        let mut synced = self.synced.lock().await;
        if *synced >= mine {
            return Ok(());
        }
        let (file, upto) = self.to_sync();
        tokio::task::spawn_blocking(move || file.sync_data())
            .await
            .map_err(|e| self.err(e.to_string()))?
            .map_err(|e| self.err(e.to_string()))?;
        *synced = upto;
        Ok(())
    }
}

/// Writes `line` with one call (or, under test, fails partway as told).
fn put(sink: &mut Sink, line: &[u8]) -> std::io::Result<()> {
    #[cfg(any(test, feature = "faults"))]
    if let Some(n) = sink.fault.take() {
        (&*sink.file).write_all(&line[..n.min(line.len())])?;
        return Err(std::io::Error::other("injected write failure"));
    }
    (&*sink.file).write_all(line)
}

/// Opens `path` for appending, creating it `0600`; an existing regular file is narrowed to `0600`, and one
/// left ending in a torn line (a crash mid-write) gets a newline so the next record starts on its own line.
/// Never through a symbolic link, and only a regular file: a FIFO (whose open for writing would wait for a
/// reader, holding the server's start), a device or a directory is refused with an error that says so.
fn open_file(path: &Path) -> std::io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.create(true).append(true).read(true);
    #[cfg(unix)]
    {
        use rustix::fs::OFlags;
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
        // NONBLOCK: opening a FIFO returns at once (and is then refused below); no effect on a file.
        o.custom_flags((OFlags::NOFOLLOW | OFlags::NONBLOCK).bits() as i32);
    }
    let file = o.open(path).map_err(|e| {
        #[cfg(unix)]
        if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) {
            return std::io::Error::other(
                "is a symbolic link: the audit log is never opened through one (name the file itself)",
            );
        }
        e
    })?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other(format!(
            "is not a regular file ({}): the audit log must be one",
            kind_of(&meta)
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(path = %path.display(), "the audit log was readable by others; narrowing it to 0600");
            file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        }
        let len = meta.len();
        let mut last = [0u8; 1];
        if len > 0 {
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut last, len - 1)?;
            if last[0] != b'\n' {
                (&file).write_all(b"\n")?;
            }
        }
    }
    Ok(file)
}

/// What kind of file `meta` describes, in words.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record<'a>(call: &'a str, conv: Option<&'a str>, function: &'a str) -> Record<'a> {
        Record {
            call,
            phase: Phase::Outcome,
            time: Record::now(SystemTime::now()),
            conversation: conv,
            key_id: None,
            peer: None,
            plugin: "p",
            plugin_sha256: "ab",
            function,
            args_sha256: "cd",
            args: None,
            outcome: Some(Outcome::Ok),
            error_kind: None,
            error: None,
            duration_us: Some(1),
            fuel: None,
            result_bytes: Some(0),
            approval: None,
            decision: None,
            approver: None,
        }
    }

    fn lines(path: &Path) -> Vec<Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn appends_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/audit.jsonl");
        let log = AuditLog::open(&path).unwrap();
        let args = serde_json::json!({"a": 1});
        let id = log.call_id();
        log.append(&Record {
            phase: Phase::Intent,
            time: Record::now(SystemTime::UNIX_EPOCH + Duration::from_millis(1500)),
            key_id: Some("k1"),
            peer: Some("127.0.0.1:9"),
            args: Some(&args),
            outcome: None,
            duration_us: None,
            result_bytes: None,
            ..record(&id, Some("c1"), "f")
        })
        .unwrap();
        log.append(&Record {
            outcome: Some(Outcome::Error),
            error_kind: Some("timeout"),
            ..record(&id, Some("c1"), "f")
        })
        .unwrap();
        assert_ne!(log.call_id(), id);
        // Reopening appends, never truncates.
        drop(log);
        let log = AuditLog::open(&path).unwrap();
        assert_eq!(log.path(), path);
        let lines = lines(&path);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["time"], "1970-01-01T00:00:01.500Z");
        assert_eq!(lines[0]["phase"], "intent");
        assert_eq!(lines[0]["args"]["a"], 1);
        assert_eq!(lines[0]["key_id"], "k1");
        assert_eq!(lines[0]["peer"], "127.0.0.1:9");
        assert!(lines[0].get("outcome").is_none());
        assert_eq!(lines[1]["phase"], "outcome");
        assert_eq!(lines[1]["call"], lines[0]["call"]);
        assert_eq!(lines[1]["outcome"], "error");
        assert!(lines[1].get("args").is_none());
        assert_eq!(lines[1]["error_kind"], "timeout");
    }

    #[cfg(unix)]
    #[test]
    fn the_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        drop(AuditLog::open(&path).unwrap());
        assert_eq!(mode(&path), 0o600);
        let old = dir.path().join("old.jsonl");
        std::fs::write(&old, "{}\n").unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(AuditLog::open(&old).unwrap());
        assert_eq!(mode(&old), 0o600);
    }

    #[test]
    fn a_failed_write_leaves_no_partial_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let log = AuditLog::open(&path).unwrap();
        log.append(&record("a-1", Some("first"), "f")).unwrap();
        log.sink.lock().unwrap().fault = Some(17);
        let e = log.append(&record("a-2", Some("torn"), "f")).unwrap_err();
        assert!(e.msg.contains("injected"), "{e}");
        log.append(&record("a-3", Some("third"), "f")).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("torn"), "{text}");
        let convs: Vec<String> = lines(&path)
            .iter()
            .map(|l| l["conversation"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(convs, ["first", "third"]);
        // A file a crash left torn is terminated when reopened, so the next line stands alone.
        drop(log);
        std::fs::write(&path, "{\"call\":\"x-1\"}\n{\"cal").unwrap();
        let log = AuditLog::open(&path).unwrap();
        log.append(&record("b-1", Some("after"), "f")).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["conversation"], "after");
        assert_eq!(text.lines().count(), 3);
    }

    #[test]
    fn rotates_by_size_and_keeps_n() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let rotation = Rotation {
            max_bytes: 1000,
            keep: 2,
        };
        let log = AuditLog::open_with(&path, rotation).unwrap();
        let pad = "x".repeat(300);
        for i in 0..20 {
            let conv = format!("c{i}");
            log.append(&record("r-1", Some(&conv), &pad)).unwrap();
        }
        let nth = |n: u32| dir.path().join(format!("audit.jsonl.{n}"));
        assert!(nth(1).is_file() && nth(2).is_file());
        assert!(!nth(3).exists());
        for p in [path.clone(), nth(1), nth(2)] {
            assert!(std::fs::metadata(&p).unwrap().len() <= 1000, "{p:?}");
            assert!(!lines(&p).is_empty());
        }
        let newest = lines(&path);
        assert_eq!(newest.last().unwrap()["conversation"], "c19");
        let older = lines(&nth(1));
        let n = |v: &Value| {
            v["conversation"].as_str().unwrap()[1..]
                .parse::<u32>()
                .unwrap()
        };
        assert_eq!(n(older.last().unwrap()) + 1, n(&newest[0]));
        assert_eq!(*log.synced.blocking_lock(), 20);
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
                        log.append(&record("c-1", Some(&conv), big)).unwrap();
                    }
                });
            }
        });
        let mut seen: Vec<String> = lines(&path)
            .iter()
            .map(|v| v["conversation"].as_str().unwrap().to_owned())
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
                        log.append_async(&record("s-1", Some(&conv), "f"))
                            .await
                            .unwrap();
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        assert_eq!(lines(log.path()).len(), 64);
        assert_eq!(*log.synced.blocking_lock(), 64);
    }

    #[cfg(unix)]
    #[test]
    fn the_log_is_never_opened_through_a_symlink_nor_as_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        // A symlink to a file elsewhere: refused, and the target is untouched.
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "keep\n").unwrap();
        let link = dir.path().join("audit.jsonl");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let Err(e) = AuditLog::open(&link) else {
            panic!("a symlink is refused")
        };
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep\n");
        // A FIFO: refused at once (opening one to write would wait for a reader), saying what it is.
        let fifo = dir.path().join("fifo.jsonl");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(AuditLog::open(&fifo).err().map(|e| e.to_string()));
        });
        let e = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("opening a FIFO returns instead of waiting for a reader")
            .expect("a FIFO is refused");
        assert!(e.contains("not a regular file (a FIFO)"), "{e}");
        // A directory too.
        let Err(e) = AuditLog::open(dir.path()) else {
            panic!("a directory is refused")
        };
        assert!(e.to_string().to_lowercase().contains("directory"), "{e}");
    }
}
