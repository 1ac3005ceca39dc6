//! The installed plugins: every component in a directory, admitted by the policy, their functions gathered
//! into one tool set, and calls routed by tool name and audited.
//!
//! A file is hashed before anything else: one whose sha256 no policy entry pins is refused without being
//! compiled or asked to `describe()` itself, so an unapproved file costs a read and a hash per start, not a
//! Cranelift compile and a sandboxed run.

use super::{
    AuditLog, CallReport, Caller, McpServer, Plugin, PluginError, PluginHost, Policy, PolicyError,
};
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

/// Whether the decoding grammar can take tool `name` of a tool set (`Err`: why not).
pub type GrammarCheck = dyn Fn(&ToolSet, &str) -> Result<(), String> + Send + Sync;

/// Who provides a tool.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Plugin(usize),
    Server(usize),
}

/// What provides host tools: a sandboxed plugin or an external MCP server.
#[derive(Debug, Clone, Copy)]
pub enum Provider<'a> {
    /// A wasm plugin.
    Plugin(&'a Arc<Plugin>),
    /// An external MCP server (not sandboxed).
    Server(&'a Arc<McpServer>),
}

impl<'a> Provider<'a> {
    /// Its name (a plugin's manifest name, a server's policy name).
    pub fn name(&self) -> &'a str {
        match self {
            Provider::Plugin(p) => p.name(),
            Provider::Server(s) => s.name(),
        }
    }

    /// Its functions.
    pub fn manifest(&self) -> &'a super::Manifest {
        match self {
            Provider::Plugin(p) => p.manifest(),
            Provider::Server(s) => s.manifest(),
        }
    }

    /// Whether it runs in the wasm sandbox.
    pub fn sandboxed(&self) -> bool {
        matches!(self, Provider::Plugin(_))
    }
}

/// The plugins of one directory under one policy, and the external MCP servers the policy names. What
/// was refused is in [`PluginSet::refused`] (and in the debug log): the caller says it once, its way.
#[derive(Debug, Default)]
pub struct PluginSet {
    plugins: Vec<Arc<Plugin>>,
    servers: Vec<Arc<McpServer>>,
    by_tool: HashMap<String, Slot>,
    tools: ToolSet,
    refused: Vec<Refusal>,
    audit: Option<Arc<AuditLog>>,
    approvals: Option<Arc<crate::Approvals>>,
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
        Self::load_checked(host, dir, policy, previous, Some(&|_, _| Ok(())))
    }

    /// [`PluginSet::load_dir_after`] with `grammar`, which says whether the decoding grammar can take one
    /// tool of a tool set (its name given): an external MCP server's tool it refuses is left out, with
    /// its reason among the refusals, so a schema the grammar compiler cannot take is refused when the
    /// set loads, not when a request names the server. `None`: the set is not for a model (`thorn mcp`
    /// serves only the sandboxed plugins), so the policy's external servers are not started at all.
    pub fn load_checked(
        host: &PluginHost,
        dir: &Path,
        policy: &Policy,
        previous: Option<&PluginSet>,
        grammar: Option<&GrammarCheck>,
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
            approvals: Some(Arc::clone(host.approvals())),
            ..PluginSet::default()
        };
        let mut defs = Vec::new();
        for path in components(dir)? {
            let plugin = match Self::load_one(host, &path, policy) {
                Ok(p) => p,
                Err(error) => {
                    tracing::debug!(path = %path.display(), %error, "plugin refused");
                    set.refused.push(Refusal { path, error });
                    continue;
                }
            };
            let clash = plugin.manifest().functions.iter().find_map(|f| {
                set.by_tool
                    .get(&f.name)
                    .map(|&s| (f.name.clone(), set.provider(s).name().to_owned()))
            });
            if let Some((function, other)) = clash {
                let error = PluginError::Load {
                    path: path.display().to_string(),
                    msg: format!(
                        "its function {function:?} has the same name as one of plugin {other:?}"
                    ),
                };
                tracing::debug!(%error, "plugin refused");
                set.refused.push(Refusal { path, error });
                continue;
            }
            let plugin = match &set.audit {
                Some(log) => plugin.with_audit(Arc::clone(log)),
                None => plugin,
            };
            let index = set.plugins.len();
            for f in &plugin.manifest().functions {
                set.by_tool.insert(f.name.clone(), Slot::Plugin(index));
                defs.push(crate::manifest::tool_definition(f));
            }
            tracing::info!(plugin = plugin.name(), path = %path.display(), "plugin loaded");
            set.plugins.push(Arc::new(plugin));
        }
        let servers = match grammar {
            Some(_) => policy
                .mcp_server_names()
                .into_iter()
                .zip(policy.mcp_servers())
                .collect(),
            None => Vec::new(),
        };
        let grammar = grammar.unwrap_or(&|_, _| Ok(()));
        for (name, spec) in servers {
            let shown = PathBuf::from(format!("mcp_servers.{name}"));
            let spec = match spec {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "MCP server refused");
                    set.refused.push(Refusal {
                        path: shown,
                        error: e.into(),
                    });
                    continue;
                }
            };
            // A server whose entry did not change keeps running across a reload.
            let running = previous
                .into_iter()
                .flat_map(|p| p.servers.iter())
                .find(|s| *s.spec() == spec && s.audit_is(set.audit.as_ref()));
            if let Some(old) = running
                && old
                    .manifest()
                    .functions
                    .iter()
                    .all(|f| !set.by_tool.contains_key(&f.name))
            {
                let index = set.servers.len();
                for f in &old.manifest().functions {
                    set.by_tool.insert(f.name.clone(), Slot::Server(index));
                    defs.push(crate::manifest::tool_definition(f));
                }
                set.servers.push(Arc::clone(old));
                continue;
            }
            let server = match McpServer::connect_on(host, spec) {
                Ok(s) => s,
                Err(error) => {
                    tracing::debug!(%error, "MCP server refused");
                    set.refused.push(Refusal { path: shown, error });
                    continue;
                }
            };
            for why in server.refused() {
                let error = PluginError::Server {
                    server: server.name().to_owned(),
                    msg: format!("tool {why}; refused"),
                };
                set.refused.push(Refusal {
                    path: shown.clone(),
                    error,
                });
            }
            let server = match &set.audit {
                Some(log) => server.with_audit(Arc::clone(log)),
                None => server,
            }
            .with_estop(Arc::clone(host.estop()))
            .with_approvals(Arc::clone(host.approvals()));
            let index = set.servers.len();
            let mut kept = Vec::new();
            for f in &server.manifest().functions {
                if let Err(why) = grammar(server.tools(), &f.name) {
                    let error = PluginError::Server {
                        server: server.name().to_owned(),
                        msg: format!(
                            "its tool {:?} has a schema the decoding grammar cannot take ({why}); refused",
                            f.name
                        ),
                    };
                    tracing::debug!(%error, "MCP tool refused");
                    set.refused.push(Refusal {
                        path: shown.clone(),
                        error,
                    });
                    continue;
                }
                if let Some(&other) = set.by_tool.get(&f.name) {
                    let error = PluginError::Server {
                        server: server.name().to_owned(),
                        msg: format!(
                            "its tool {:?} has the same name as one of {:?}; refused (nothing shadows)",
                            f.name,
                            set.provider(other).name()
                        ),
                    };
                    tracing::debug!(%error, "MCP tool refused");
                    set.refused.push(Refusal {
                        path: shown.clone(),
                        error,
                    });
                    continue;
                }
                set.by_tool.insert(f.name.clone(), Slot::Server(index));
                kept.push(f.name.clone());
                defs.push(crate::manifest::tool_definition(f));
            }
            tracing::info!(
                server = server.name(),
                tools = kept.len(),
                "MCP server connected"
            );
            set.servers.push(Arc::new(server.keep_only(&kept)));
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

    /// The connected external MCP servers.
    pub fn servers(&self) -> &[Arc<McpServer>] {
        &self.servers
    }

    /// Every provider of host tools: the plugins, then the servers.
    pub fn providers(&self) -> impl Iterator<Item = Provider<'_>> {
        self.plugins
            .iter()
            .map(Provider::Plugin)
            .chain(self.servers.iter().map(Provider::Server))
    }

    /// The provider named `name` (a plugin's or a server's name).
    pub fn provider_named(&self, name: &str) -> Option<Provider<'_>> {
        self.providers().find(|p| p.name() == name)
    }

    fn provider(&self, slot: Slot) -> Provider<'_> {
        match slot {
            Slot::Plugin(i) => Provider::Plugin(&self.plugins[i]),
            Slot::Server(i) => Provider::Server(&self.servers[i]),
        }
    }

    /// Who provides host tool `tool`.
    pub fn provider_for(&self, tool: &str) -> Option<Provider<'_>> {
        self.by_tool.get(tool).map(|&s| self.provider(s))
    }

    /// The components that were not loaded.
    pub fn refused(&self) -> &[Refusal] {
        &self.refused
    }

    /// Every function of every loaded plugin, as tools.
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// The approvals queue its calls wait in (that of the host it was loaded on).
    pub fn approvals(&self) -> Option<&Arc<crate::Approvals>> {
        self.approvals.as_ref()
    }

    /// The audit log, if the policy has one.
    pub fn audit(&self) -> Option<&AuditLog> {
        self.audit.as_deref()
    }

    /// The plugin that provides `tool`.
    pub fn plugin_for(&self, tool: &str) -> Option<&Arc<Plugin>> {
        match self.by_tool.get(tool) {
            Some(&Slot::Plugin(i)) => Some(&self.plugins[i]),
            _ => None,
        }
    }

    /// Calls the plugin that provides `tool`, for `caller`.
    pub async fn call_async(
        &self,
        caller: &Caller,
        tool: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        match self.provider_for(tool) {
            Some(Provider::Plugin(p)) => match p.deadman(tool) {
                Some(dm) => crate::deadman::call(p, dm, caller, tool, args).await,
                None => p.call_async(caller, tool, args).await,
            },
            Some(Provider::Server(s)) => s.call_async(caller, tool, args).await,
            None => unknown(tool),
        }
    }

    /// Whether `tool` is a motion with a deadman (its call is abandoned, and the motion stopped, when
    /// its request is cancelled).
    pub fn is_motion(&self, tool: &str) -> bool {
        self.plugin_for(tool)
            .is_some_and(|p| p.deadman(tool).is_some())
    }

    /// [`PluginSet::call_async`], blocking.
    pub fn call(
        &self,
        caller: &Caller,
        tool: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        match self.provider_for(tool) {
            Some(Provider::Plugin(p)) => {
                let p = Arc::clone(p);
                crate::sandbox::block_on(&p.handle.clone(), async {
                    self.call_async(caller, tool, args).await
                })
            }
            Some(Provider::Server(s)) => s.call_blocking(caller, tool, args),
            None => unknown(tool),
        }
    }
}
