//! The plugin set a long-running process serves, replaced while it runs.
//!
//! `thorn serve` and `thorn mcp` pick up plugins the operator installs or approves without a restart: a
//! watcher compares the plugin directory and policy file with what it last loaded ([`Fingerprint`]),
//! loads a fresh [`PluginSet`] when they differ, and [`LiveSet::replace`]s the served one. Readers take
//! a snapshot ([`LiveSet::current`]) and keep it for the whole request, so a request never sees half of
//! two sets; calls already running finish in the set they started in. Subscribers ([`LiveSet::subscribe`])
//! learn when the *tool list* changed (a reload that changes nothing visible, such as a re-approved file
//! with the same functions, notifies no one), which is what MCP's `tools/list_changed` needs.

use super::{PluginSet, components};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;
use tokio::sync::watch;

/// The served plugin set and its change notifications.
#[derive(Debug)]
pub struct LiveSet {
    current: RwLock<Arc<PluginSet>>,
    /// Bumped each time the tool list changes.
    changes: watch::Sender<u64>,
}

impl LiveSet {
    /// Serves `set`.
    pub fn new(set: Arc<PluginSet>) -> Self {
        LiveSet {
            current: RwLock::new(set),
            changes: watch::Sender::new(0),
        }
    }

    /// The set now served (a snapshot: a later replace does not change it).
    pub fn current(&self) -> Arc<PluginSet> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Serves `set` from now on; returns whether its tool list differs from the one it replaces (and so
    /// subscribers were told).
    pub fn replace(&self, set: Arc<PluginSet>) -> bool {
        let changed = {
            let mut cur = self.current.write().unwrap_or_else(|e| e.into_inner());
            let changed = cur.tools().definitions() != set.tools().definitions();
            *cur = set;
            changed
        };
        if changed {
            self.changes.send_modify(|n| *n += 1);
        }
        changed
    }

    /// A receiver that wakes each time the tool list changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// What a plugin place looked like: each component file and the policy file, by name, size and
/// modification time. Equal fingerprints mean nothing to reload.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fingerprint(Vec<(PathBuf, u64, Option<SystemTime>)>);

impl Fingerprint {
    /// The fingerprint of the components in `dir` and the policy at `policy` (a missing file counts as
    /// absent, an unreadable directory as empty: the load that follows reports it).
    pub fn of(dir: &Path, policy: &Path) -> Self {
        let mut files = components(dir).unwrap_or_default();
        files.push(policy.to_owned());
        Fingerprint(
            files
                .into_iter()
                .filter_map(|p| {
                    let m = std::fs::metadata(&p).ok()?;
                    Some((p, m.len(), m.modified().ok()))
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_see_new_changed_and_removed_files() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("policy.json");
        let empty = Fingerprint::of(dir.path(), &policy);
        std::fs::write(&policy, "{}").unwrap();
        let with_policy = Fingerprint::of(dir.path(), &policy);
        assert_ne!(empty, with_policy);
        std::fs::write(dir.path().join("a.wasm"), b"\0asm").unwrap();
        std::fs::write(dir.path().join("notes.txt"), b"not a component").unwrap();
        let with_plugin = Fingerprint::of(dir.path(), &policy);
        assert_ne!(with_policy, with_plugin);
        assert_eq!(with_plugin, Fingerprint::of(dir.path(), &policy));
        std::fs::write(dir.path().join("notes.txt"), b"still not one").unwrap();
        assert_eq!(with_plugin, Fingerprint::of(dir.path(), &policy));
        std::fs::write(dir.path().join("a.wasm"), b"\0asm\x01").unwrap();
        assert_ne!(with_plugin, Fingerprint::of(dir.path(), &policy));
        std::fs::remove_file(dir.path().join("a.wasm")).unwrap();
        assert_eq!(
            with_policy.0.len(),
            Fingerprint::of(dir.path(), &policy).0.len()
        );
    }

    #[test]
    fn a_replace_notifies_only_when_the_tools_change() {
        let tool = |name: &str| {
            serde_json::json!({"type": "function", "function": {"name": name,
                "parameters": {"type": "object"}}})
        };
        let live = LiveSet::new(Arc::new(PluginSet::from_tools(&[tool("a")])));
        let mut rx = live.subscribe();
        let before = live.current();
        // The same tools again: served, but no one is told.
        assert!(!live.replace(Arc::new(PluginSet::from_tools(&[tool("a")]))));
        assert!(!rx.has_changed().unwrap());
        assert!(
            !Arc::ptr_eq(&before, &live.current()),
            "the new set is served"
        );
        assert!(live.replace(Arc::new(PluginSet::from_tools(&[tool("a"), tool("b")]))));
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        assert_eq!(live.current().tools().tools().len(), 2);
        // A snapshot taken before a replace keeps its tools.
        assert_eq!(before.tools().tools().len(), 1);
        assert!(live.replace(Arc::new(PluginSet::default())));
        assert!(rx.has_changed().unwrap());
    }
}
