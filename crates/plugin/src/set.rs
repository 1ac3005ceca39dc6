//! The installed plugins: every component in a directory, admitted by the policy, their functions gathered
//! into one tool set, and calls routed by tool name and audited.
//!
//! A file is hashed before anything else: one whose sha256 no policy entry pins is refused without being
//! compiled or asked to `describe()` itself, so an unapproved file costs a read and a hash per start, not a
//! Cranelift compile and a sandboxed run.

use super::{AuditLog, CallReport, Caller, Plugin, PluginError, PluginHost, Policy, PolicyError};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thorn_tools::ToolSet;

/// A component that was not loaded, and why.
#[derive(Debug)]
pub struct Refusal {
    /// The component file.
    pub path: PathBuf,
    /// Why.
    pub error: PluginError,
}

/// The plugins of one directory under one policy.
#[derive(Debug, Default)]
pub struct PluginSet {
    plugins: Vec<Arc<Plugin>>,
    by_tool: HashMap<String, usize>,
    tools: ToolSet,
    refused: Vec<Refusal>,
    audit: Option<Arc<AuditLog>>,
}

/// The `.wasm` files of `dir`, sorted (none when it does not exist).
pub fn components(dir: &Path) -> Result<Vec<PathBuf>, PluginError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(PluginError::Load {
                path: dir.display().to_string(),
                msg: e.to_string(),
            });
        }
    };
    let mut out: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "wasm") && p.is_file())
        .collect();
    out.sort();
    Ok(out)
}

/// What a call to a tool no installed plugin provides returns.
fn unknown(tool: &str) -> (Result<Value, PluginError>, CallReport) {
    let e = PluginError::UnknownFunction {
        plugin: "(any installed)".into(),
        function: tool.to_owned(),
    };
    (Err(e), CallReport::default())
}

impl PluginSet {
    /// Loads every `.wasm` in `dir` under `policy`. A plugin the policy refuses (or that fails to load, or
    /// whose function names clash with one already loaded) is skipped and listed in [`PluginSet::refused`];
    /// the others serve. The audit log named by the policy is opened here, and failing to open it is an
    /// error: plugins never run unaudited under a policy file.
    pub fn load_dir(host: &PluginHost, dir: &Path, policy: &Policy) -> Result<Self, PluginError> {
        Self::load_dir_after(host, dir, policy, None)
    }

    /// [`PluginSet::load_dir`] for a set that replaces `previous` while the process runs: when the policy
    /// names the same audit log with the same rotation, the new set writes through `previous`'s handle,
    /// so one process keeps one writer per log (its group commit and rotation stay coordinated) and calls
    /// still running in the old set and new calls share the file safely.
    pub fn load_dir_after(
        host: &PluginHost,
        dir: &Path,
        policy: &Policy,
        previous: Option<&PluginSet>,
    ) -> Result<Self, PluginError> {
        let reuse = |p: &Path| {
            previous
                .and_then(|s| s.audit.as_ref())
                .filter(|log| log.path() == p && log.rotation() == policy.audit_rotation())
                .map(Arc::clone)
        };
        let audit = match policy.audit_path() {
            Some(p) => Some(match reuse(&p) {
                Some(log) => log,
                None => Arc::new(AuditLog::open_with(&p, policy.audit_rotation())?),
            }),
            None => None,
        };
        let mut set = PluginSet {
            audit,
            ..PluginSet::default()
        };
        let mut defs = Vec::new();
        for path in components(dir)? {
            let plugin = match Self::load_one(host, &path, policy) {
                Ok(p) => p,
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "plugin refused");
                    set.refused.push(Refusal { path, error });
                    continue;
                }
            };
            let clash = plugin.manifest().functions.iter().find_map(|f| {
                set.by_tool
                    .get(&f.name)
                    .map(|&i| (f.name.clone(), set.plugins[i].name().to_owned()))
            });
            if let Some((function, other)) = clash {
                let error = PluginError::Load {
                    path: path.display().to_string(),
                    msg: format!(
                        "its function {function:?} has the same name as one of plugin {other:?}"
                    ),
                };
                tracing::warn!(%error, "plugin refused");
                set.refused.push(Refusal { path, error });
                continue;
            }
            let plugin = match &set.audit {
                Some(log) => plugin.with_audit(Arc::clone(log)),
                None => plugin,
            };
            let index = set.plugins.len();
            for f in &plugin.manifest().functions {
                set.by_tool.insert(f.name.clone(), index);
                defs.push(
                    serde_json::json!({"type": "function", "function": {"name": f.name,
                    "description": f.description, "parameters": f.parameters}}),
                );
            }
            tracing::info!(plugin = plugin.name(), path = %path.display(), "plugin loaded");
            set.plugins.push(Arc::new(plugin));
        }
        set.tools = ToolSet::new(&defs).map_err(|e| PluginError::Load {
            path: dir.display().to_string(),
            msg: e.to_string(),
        })?;
        Ok(set)
    }

    /// Reads, hashes and (only if some entry pins that digest) compiles and admits one file.
    fn load_one(host: &PluginHost, path: &Path, policy: &Policy) -> Result<Plugin, PluginError> {
        let bytes = std::fs::read(path).map_err(|e| PluginError::Load {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        let sha256 = super::sha256_hex(&bytes);
        if !policy.pins(&sha256) {
            let stem = path.file_stem().unwrap_or_default().to_string_lossy();
            return Err(PolicyError::NotApproved {
                plugin: stem.into_owned(),
                sha256,
                policy: policy
                    .path()
                    .map_or_else(|| "(none)".into(), |p| p.display().to_string()),
            }
            .into());
        }
        host.open_bytes(path, &bytes)?.admit(policy)
    }

    /// A set with these tool definitions and no plugins behind them (for tests of what reads the tools).
    #[cfg(test)]
    pub(crate) fn from_tools(defs: &[Value]) -> Self {
        PluginSet {
            tools: ToolSet::new(defs).expect("valid test tools"),
            ..PluginSet::default()
        }
    }

    /// The loaded plugins.
    pub fn plugins(&self) -> &[Arc<Plugin>] {
        &self.plugins
    }

    /// The components that were not loaded.
    pub fn refused(&self) -> &[Refusal] {
        &self.refused
    }

    /// Every function of every loaded plugin, as tools.
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// The audit log, if the policy has one.
    pub fn audit(&self) -> Option<&AuditLog> {
        self.audit.as_deref()
    }

    /// The plugin that provides `tool`.
    pub fn plugin_for(&self, tool: &str) -> Option<&Arc<Plugin>> {
        self.by_tool.get(tool).map(|&i| &self.plugins[i])
    }

    /// Calls the plugin that provides `tool`, for `caller`.
    pub async fn call_async(
        &self,
        caller: &Caller,
        tool: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        match self.plugin_for(tool) {
            Some(p) => p.call_async(caller, tool, args).await,
            None => unknown(tool),
        }
    }

    /// [`PluginSet::call_async`], blocking.
    pub fn call(
        &self,
        caller: &Caller,
        tool: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        match self.plugin_for(tool) {
            Some(p) => p.call_reported(caller, tool, args),
            None => unknown(tool),
        }
    }
}
