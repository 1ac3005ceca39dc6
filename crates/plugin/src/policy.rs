//! The operator's policy: which plugins may load, pinned by sha256, and what each is granted.
//!
//! The file (`schemas/plugin-policy.schema.json`) is validated against its schema when it is read, so a typo
//! is an error naming the field, not a silently ignored grant. A plugin's manifest *asks* for capabilities
//! (directories, env vars, network hosts); [`Policy::grant`] checks every request against the plugin's entry
//! and refuses the whole plugin, naming each missing grant, if any is not covered. What a plugin gets is
//! exactly what it asked for (and was granted): a grant it did not ask for is not handed to it.

use super::{Limits, Manifest, Rotation};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

mod grant;
pub use grant::{Grant, NetRule, Preopen, Requests};

/// The policy file's schema.
pub const POLICY_SCHEMA: &str = include_str!("../../../schemas/plugin-policy.schema.json");

/// Why a policy could not be read, or a plugin is refused by it.
#[derive(Debug, Error)]
pub enum PolicyError {
    /// The file could not be read or written.
    #[error("policy {path}: {msg}")]
    Io {
        /// The policy file.
        path: String,
        /// What failed.
        msg: String,
    },
    /// The file is not a valid policy.
    #[error("policy {path} is invalid: {msg}")]
    Invalid {
        /// The policy file.
        path: String,
        /// Each problem, with where it is.
        msg: String,
    },
    /// The plugin has no entry.
    #[error(
        "plugin {plugin:?} (sha256 {sha256}) is not approved by the policy {policy}; approve it with `thorn plugins approve`"
    )]
    NotApproved {
        /// Its manifest name.
        plugin: String,
        /// Its file's digest.
        sha256: String,
        /// The policy file.
        policy: String,
    },
    /// The plugin's file is not the one approved.
    #[error(
        "plugin {plugin:?} changed: its sha256 is {actual} but the policy pins {pinned}; it stays refused until re-approved (`thorn plugins approve`)"
    )]
    Changed {
        /// Its manifest name.
        plugin: String,
        /// The approved digest.
        pinned: String,
        /// The file's digest.
        actual: String,
    },
    /// The manifest asks for capabilities the policy does not grant.
    #[error("plugin {plugin:?} asks for what the policy does not grant: {}", .missing.join("; "))]
    Denied {
        /// Its manifest name.
        plugin: String,
        /// Each request that is not granted, in words.
        missing: Vec<String>,
    },
    /// A grant cannot be honoured (a granted directory is missing, say).
    #[error("plugin {plugin:?}: {msg}")]
    Grant {
        /// Its manifest name.
        plugin: String,
        /// What is wrong.
        msg: String,
    },
}

/// Limits as written in the file: every field optional, layered over the defaults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsSpec {
    timeout_ms: Option<u64>,
    memory_mib: Option<u64>,
    fuel: Option<u64>,
    stdio_kib: Option<u64>,
    max_output_kib: Option<u64>,
    max_resources: Option<u32>,
    max_concurrent: Option<u32>,
}

impl LimitsSpec {
    fn apply(&self, l: &mut Limits) {
        if let Some(v) = self.timeout_ms {
            l.timeout = Duration::from_millis(v);
        }
        if let Some(v) = self.memory_mib {
            l.memory = (v as usize) << 20;
        }
        if let Some(v) = self.fuel {
            l.fuel = Some(v);
        }
        if let Some(v) = self.stdio_kib {
            l.stdio = (v as usize) << 10;
        }
        if let Some(v) = self.max_output_kib {
            l.max_output = (v as usize) << 10;
        }
        if let Some(v) = self.max_resources {
            l.max_resources = v as usize;
        }
        if let Some(v) = self.max_concurrent {
            l.max_concurrent = v as usize;
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditSpec {
    path: Option<String>,
    #[serde(default)]
    arguments: bool,
    max_mib: Option<u64>,
    keep: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FsGrant {
    guest: String,
    host: String,
    access: Access,
}

/// Directory access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Access {
    /// Read only.
    #[serde(rename = "read")]
    Read,
    /// Read and write.
    #[serde(rename = "read-write")]
    ReadWrite,
}

impl Access {
    fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::ReadWrite => "read-write",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    sha256: String,
    #[serde(default)]
    filesystem: Vec<FsGrant>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    env_from_host: Vec<String>,
    #[serde(default)]
    network: Vec<String>,
    #[serde(default)]
    limits: LimitsSpec,
    audit_arguments: Option<bool>,
    #[serde(default)]
    rates: BTreeMap<String, Value>,
    approval: Option<String>,
    approval_timeout_ms: Option<u64>,
    approve_own: Option<bool>,
    #[serde(default)]
    functions: BTreeMap<String, ApprovalSpec>,
}

/// An approval rule as written (a plugin's, or one function's over it).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApprovalSpec {
    approval: Option<String>,
    approval_timeout_ms: Option<u64>,
    approve_own: Option<bool>,
    deadman_ms: Option<u64>,
}

impl ApprovalSpec {
    /// This rule over `base`.
    fn over(&self, base: &crate::ApprovalRule) -> crate::ApprovalRule {
        crate::ApprovalRule {
            mode: self
                .approval
                .as_deref()
                .and_then(crate::approval::Mode::parse)
                .unwrap_or(base.mode),
            timeout: self
                .approval_timeout_ms
                .map_or(base.timeout, Duration::from_millis),
            approve_own: self.approve_own.unwrap_or(base.approve_own),
        }
    }

    /// A whole entry's rules.
    fn rules(
        plugin: &ApprovalSpec,
        functions: &BTreeMap<String, ApprovalSpec>,
    ) -> crate::ApprovalRules {
        let base = plugin.over(&crate::ApprovalRule::default());
        crate::ApprovalRules {
            functions: functions
                .iter()
                .map(|(f, s)| (f.clone(), s.over(&base)))
                .collect(),
            plugin: base,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    defaults: LimitsSpec,
    #[serde(default)]
    audit: AuditSpec,
    #[serde(default)]
    plugins: BTreeMap<String, Entry>,
    #[serde(default)]
    mcp_servers: BTreeMap<String, ServerEntry>,
    #[serde(default)]
    trust: TrustSpec,
}

/// Whose signatures a pulled plugin must carry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrustSpec {
    #[serde(default)]
    keys: Vec<String>,
    #[serde(default)]
    identities: Vec<crate::signing::Identity>,
    trusted_root: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServerEntry {
    #[serde(default)]
    command: Vec<String>,
    cwd: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    env_from_host: Vec<String>,
    url: Option<String>,
    bearer_env: Option<String>,
    bearer_file: Option<String>,
    tools: Vec<String>,
    timeout_ms: Option<u64>,
    startup_timeout_ms: Option<u64>,
    max_output_kib: Option<u64>,
    max_concurrent: Option<u32>,
    audit_arguments: Option<bool>,
    approval: Option<String>,
    approval_timeout_ms: Option<u64>,
    approve_own: Option<bool>,
}

/// How an external MCP server is reached.
#[derive(Clone, PartialEq, Eq)]
pub enum ServerTransport {
    /// A process thorn starts, speaking MCP on its stdin and stdout.
    Stdio {
        /// The program.
        program: PathBuf,
        /// Its arguments.
        args: Vec<String>,
        /// Its working directory.
        cwd: Option<PathBuf>,
        /// Its whole environment (PATH, the policy's variables, and the host variables it names).
        env: Vec<(String, String)>,
    },
    /// A server already running, over MCP's Streamable HTTP.
    Http {
        /// Its endpoint.
        url: String,
        /// The bearer token sent with every request (from the host environment or a file).
        bearer: Option<String>,
    },
}

impl std::fmt::Debug for ServerTransport {
    /// Names only: environment values and tokens may be credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerTransport::Stdio {
                program, args, env, ..
            } => f
                .debug_struct("Stdio")
                .field("program", program)
                .field("args", args)
                .field("env", &env.iter().map(|(k, _)| k).collect::<Vec<_>>())
                .finish_non_exhaustive(),
            ServerTransport::Http { url, bearer } => f
                .debug_struct("Http")
                .field("url", url)
                .field("bearer", &bearer.as_ref().map(|_| "[redacted]"))
                .finish(),
        }
    }
}

/// An external MCP server the policy names: how to reach it and what of it may be used. It runs outside
/// the wasm sandbox, so these are all the bounds it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSpec {
    /// Its name in the policy (the prefix of its tools' names).
    pub name: String,
    /// How it is reached.
    pub transport: ServerTransport,
    /// The server's tools that may be used (`None`: every tool it lists).
    pub tools: Option<Vec<String>>,
    /// Limit of one call.
    pub timeout: Duration,
    /// Limit of starting it (or starting it again) and listing its tools.
    pub startup: Duration,
    /// Largest result accepted, in bytes.
    pub max_output: usize,
    /// Calls in flight at once.
    pub max_concurrent: usize,
    /// Whether calls' arguments go into the audit log.
    pub audit_arguments: bool,
    /// Which of its calls wait for a person's approval.
    pub approval: crate::ApprovalRule,
    /// The sha256 of the entry as written, credentials left out (the audit log's `plugin_sha256`:
    /// which configuration ran).
    pub sha256: String,
}

/// The operator's policy.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// Where it was read from (`None`: no file, nothing approved).
    path: Option<PathBuf>,
    file: PolicyFile,
}

impl Policy {
    /// No policy: every plugin is refused as not approved.
    pub fn none() -> Self {
        Policy::default()
    }

    /// Reads and validates a policy file. A missing file is an empty policy (nothing approved) that
    /// `approve` will create.
    pub fn load(path: &Path) -> Result<Self, PolicyError> {
        let shown = path.display().to_string();
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Policy {
                    path: Some(path.to_owned()),
                    file: PolicyFile::default(),
                });
            }
            Err(e) => {
                return Err(PolicyError::Io {
                    path: shown,
                    msg: e.to_string(),
                });
            }
        };
        Self::parse(path, &text)
    }

    /// Parses policy text (`path` names it and anchors relative host paths).
    pub fn parse(path: &Path, text: &str) -> Result<Self, PolicyError> {
        let invalid = |msg: String| PolicyError::Invalid {
            path: path.display().to_string(),
            msg,
        };
        let doc: Value = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let schema: Value =
            serde_json::from_str(POLICY_SCHEMA).map_err(|e| invalid(e.to_string()))?;
        let validator = jsonschema::validator_for(&schema).map_err(|e| invalid(e.to_string()))?;
        let errors: Vec<String> = validator
            .iter_errors(&doc)
            .map(|e| format!("{e} at {}", e.instance_path()))
            .collect();
        if !errors.is_empty() {
            return Err(invalid(errors.join("; ")));
        }
        let file: PolicyFile = serde_json::from_value(doc).map_err(|e| invalid(e.to_string()))?;
        Ok(Policy {
            path: Some(path.to_owned()),
            file,
        })
    }

    /// The file it came from.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    fn shown(&self) -> String {
        self.path
            .as_ref()
            .map_or_else(|| "(none)".into(), |p| p.display().to_string())
    }

    /// `p` resolved against the policy file's directory.
    fn host_path(&self, p: &str) -> PathBuf {
        let p = Path::new(p);
        match self.path.as_deref().and_then(Path::parent) {
            Some(base) if p.is_relative() => base.join(p),
            _ => p.to_owned(),
        }
    }

    /// The audit log's path (default: `audit.jsonl` beside the policy), if there is a policy file.
    pub fn audit_path(&self) -> Option<PathBuf> {
        let own = self.file.audit.path.as_deref().map(|p| self.host_path(p));
        own.or_else(|| {
            self.path
                .as_deref()
                .map(|p| p.with_file_name("audit.jsonl"))
        })
    }

    /// How the audit log is rotated (the file's `audit.max_mib` and `audit.keep` over the defaults).
    pub fn audit_rotation(&self) -> Rotation {
        let d = Rotation::default();
        Rotation {
            max_bytes: self.file.audit.max_mib.map_or(d.max_bytes, |m| m << 20),
            keep: self.file.audit.keep.unwrap_or(d.keep),
        }
    }

    /// The external MCP servers it names, in name order: each one's spec, or why it cannot be used (a
    /// credential that is not there).
    pub fn mcp_servers(&self) -> Vec<Result<ServerSpec, PolicyError>> {
        self.file
            .mcp_servers
            .iter()
            .map(|(name, e)| self.server_spec(name, e))
            .collect()
    }

    /// The names of the external MCP servers it names, in the order of [`Policy::mcp_servers`].
    pub fn mcp_server_names(&self) -> Vec<&str> {
        self.file.mcp_servers.keys().map(String::as_str).collect()
    }

    fn server_spec(&self, name: &str, e: &ServerEntry) -> Result<ServerSpec, PolicyError> {
        let refuse = |msg: String| PolicyError::Grant {
            plugin: name.to_owned(),
            msg,
        };
        let transport = match (&e.url, e.command.first()) {
            (Some(url), None) => {
                let bearer = match (&e.bearer_env, &e.bearer_file) {
                    (Some(var), _) => Some(std::env::var(var).map_err(|_| {
                        refuse(format!(
                            "its bearer_env {var} is not set in thorn's environment"
                        ))
                    })?),
                    (None, Some(file)) => {
                        let path = self.host_path(file);
                        let text = std::fs::read_to_string(&path).map_err(|err| {
                            refuse(format!(
                                "cannot read its bearer_file {}: {err}",
                                path.display()
                            ))
                        })?;
                        Some(text.trim().to_owned())
                    }
                    (None, None) => None,
                };
                ServerTransport::Http {
                    url: url.clone(),
                    bearer,
                }
            }
            (None, Some(first)) => {
                let program = if first.contains('/') {
                    self.host_path(first)
                } else {
                    PathBuf::from(first)
                };
                let mut env: Vec<(String, String)> = std::env::var("PATH")
                    .map(|p| vec![("PATH".to_owned(), p)])
                    .unwrap_or_default();
                env.extend(e.env.iter().map(|(k, v)| (k.clone(), v.clone())));
                for k in &e.env_from_host {
                    if let Ok(v) = std::env::var(k) {
                        env.push((k.clone(), v));
                    }
                }
                ServerTransport::Stdio {
                    program,
                    args: e.command[1..].to_vec(),
                    cwd: Some(
                        e.cwd
                            .as_deref()
                            .map_or_else(|| self.host_path("."), |c| self.host_path(c)),
                    ),
                    env,
                }
            }
            _ => return Err(refuse("give exactly one of `command` and `url`".into())),
        };
        let entry = serde_json::json!({"command": e.command, "cwd": e.cwd,
            "env": e.env.keys().collect::<Vec<_>>(), "env_from_host": e.env_from_host,
            "url": e.url, "tools": e.tools});
        Ok(ServerSpec {
            name: name.to_owned(),
            transport,
            tools: (e.tools.iter().all(|t| t != "*")).then(|| e.tools.clone()),
            timeout: Duration::from_millis(e.timeout_ms.unwrap_or(10_000)),
            startup: Duration::from_millis(e.startup_timeout_ms.unwrap_or(30_000)),
            max_output: e.max_output_kib.map_or(256 << 10, |k| (k as usize) << 10),
            max_concurrent: e.max_concurrent.unwrap_or(4).max(1) as usize,
            audit_arguments: e.audit_arguments.unwrap_or(self.file.audit.arguments),
            approval: ApprovalSpec {
                approval: e.approval.clone(),
                approval_timeout_ms: e.approval_timeout_ms,
                approve_own: e.approve_own,
                deadman_ms: None,
            }
            .over(&crate::ApprovalRule::default()),
            sha256: super::sha256_hex(entry.to_string().as_bytes()),
        })
    }

    /// Whether any entry pins `sha256` (a file no entry pins is refused without being compiled).
    pub fn pins(&self, sha256: &str) -> bool {
        self.file.plugins.values().any(|e| e.sha256 == sha256)
    }

    /// The public keys (PEM) whose signature a pulled plugin must carry (`trust.keys`; none: no check).
    pub fn trusted_keys(&self) -> &[String] {
        &self.file.trust.keys
    }

    /// The keyless signers a pulled plugin may be signed by (`trust.identities`).
    pub fn trusted_identities(&self) -> &[crate::signing::Identity] {
        &self.file.trust.identities
    }

    /// The pinned sigstore trust root (`trust.trusted_root`, resolved against the policy's directory).
    pub fn trusted_root(&self) -> Option<PathBuf> {
        self.file
            .trust
            .trusted_root
            .as_deref()
            .map(|p| self.host_path(p))
    }

    /// The pinned digest of `plugin`, if it has an entry.
    pub fn pinned(&self, plugin: &str) -> Option<&str> {
        self.file.plugins.get(plugin).map(|e| e.sha256.as_str())
    }

    /// The plugins with an entry.
    pub fn plugins(&self) -> impl Iterator<Item = &str> {
        self.file.plugins.keys().map(String::as_str)
    }

    /// The default limits (the file's `defaults` over the built-in ones).
    pub fn default_limits(&self) -> Limits {
        let mut l = Limits::default();
        self.file.defaults.apply(&mut l);
        l
    }

    /// Decides whether the plugin `manifest` (file digest `sha256`) may load, and what it gets.
    pub fn grant(&self, manifest: &Manifest, sha256: &str) -> Result<Grant, PolicyError> {
        let plugin = manifest.name.clone();
        // `thorn plugins grant` before `approve` leaves an all-zero pin: granted, not yet approved.
        let entry = self
            .file
            .plugins
            .get(&plugin)
            .filter(|e| e.sha256.bytes().any(|b| b != b'0'));
        let Some(entry) = entry else {
            return Err(PolicyError::NotApproved {
                plugin,
                sha256: sha256.to_owned(),
                policy: self.shown(),
            });
        };
        if entry.sha256 != sha256 {
            return Err(PolicyError::Changed {
                plugin,
                pinned: entry.sha256.clone(),
                actual: sha256.to_owned(),
            });
        }
        let req = Requests::of(manifest);
        let mut missing = Vec::new();
        let mut grant = Grant {
            limits: self.default_limits(),
            audit_arguments: entry.audit_arguments.unwrap_or(self.file.audit.arguments),
            ..Grant::default()
        };
        entry.limits.apply(&mut grant.limits);
        let own = ApprovalSpec {
            approval: entry.approval.clone(),
            approval_timeout_ms: entry.approval_timeout_ms,
            approve_own: entry.approve_own,
            deadman_ms: None,
        };
        grant.approval = ApprovalSpec::rules(&own, &entry.functions);
        grant.deadman = entry
            .functions
            .iter()
            .filter_map(|(f, s)| Some((f.clone(), Duration::from_millis(s.deadman_ms?))))
            .collect();
        grant.rates = entry
            .rates
            .iter()
            .map(|(f, v)| (f.clone(), crate::RateRules::from_policy(v)))
            .collect();
        for (guest, access) in &req.filesystem {
            let g = entry
                .filesystem
                .iter()
                .find(|g| g.guest.trim_end_matches('/') == guest.trim_end_matches('/'));
            match g {
                None => missing.push(format!("directory {guest} ({})", access.as_str())),
                Some(g) if *access == Access::ReadWrite && g.access == Access::Read => missing
                    .push(format!(
                        "directory {guest} read-write (the policy grants it read-only)"
                    )),
                Some(g) => {
                    let host = self.host_path(&g.host);
                    if !host.is_dir() {
                        return Err(PolicyError::Grant {
                            plugin,
                            msg: format!(
                                "the directory granted as {guest}, {}, does not exist",
                                host.display()
                            ),
                        });
                    }
                    grant.preopens.push(Preopen {
                        host,
                        guest: guest.clone(),
                        write: *access == Access::ReadWrite,
                    });
                }
            }
        }
        for name in &req.env {
            if let Some(v) = entry.env.get(name) {
                grant.env.push((name.clone(), v.clone()));
            } else if entry.env_from_host.contains(name) {
                match std::env::var(name) {
                    Ok(v) => grant.env.push((name.clone(), v)),
                    Err(_) => {
                        return Err(PolicyError::Grant {
                            plugin,
                            msg: format!(
                                "env {name} is granted from the host's environment, which does not set it"
                            ),
                        });
                    }
                }
            } else {
                missing.push(format!("env {name}"));
            }
        }
        for want in &req.network {
            let Some((host, port)) = NetRule::parse(want) else {
                missing.push(format!("network {want} (not host:port)"));
                continue;
            };
            let covered = entry.network.iter().any(|g| {
                NetRule::parse(g).is_some_and(|(gh, gp)| gh == host && (gp.is_none() || gp == port))
            });
            if covered {
                grant.network.push(NetRule::resolve(host, port));
            } else {
                missing.push(format!("network {want}"));
            }
        }
        if !missing.is_empty() {
            return Err(PolicyError::Denied { plugin, missing });
        }
        Ok(grant)
    }

    /// Pins `plugin` to `sha256` in the policy file at `path` (creating the file or the entry, keeping
    /// everything else as it is), written atomically.
    pub fn approve(path: &Path, plugin: &str, sha256: &str) -> Result<(), PolicyError> {
        Self::edit(path, plugin, |entry| {
            entry.insert("sha256".into(), Value::String(sha256.to_owned()));
        })
    }

    /// Edits the entry of `plugin` in the policy file at `path` (created when missing, with an all-zero
    /// pin that no file matches), then validates the result and writes it atomically; on any error the file
    /// is left as it was.
    pub fn edit(
        path: &Path,
        plugin: &str,
        f: impl FnOnce(&mut serde_json::Map<String, Value>),
    ) -> Result<(), PolicyError> {
        Self::rewrite(path, |doc, io| {
            let entry = plugins_of(doc, io)?
                .entry(plugin)
                .or_insert_with(|| serde_json::json!({"sha256": "0".repeat(64)}));
            let entry = entry
                .as_object_mut()
                .ok_or_else(|| io(format!("`plugins.{plugin}` is not an object")))?;
            f(entry);
            Ok(())
        })
    }

    /// Removes the entry of `plugin` from the policy file at `path` (its pin and grants: installed
    /// again, it needs approval again), written atomically. Whether there was one.
    pub fn remove(path: &Path, plugin: &str) -> Result<bool, PolicyError> {
        if !path.exists() {
            return Ok(false);
        }
        let mut removed = false;
        Self::rewrite(path, |doc, io| {
            removed = plugins_of(doc, io)?.remove(plugin).is_some();
            Ok(())
        })?;
        Ok(removed)
    }

    /// Reads the policy file at `path` (an empty document when there is none), lets `f` change it, checks
    /// that the result loads, and replaces the file atomically; on any error the file is left as it was.
    fn rewrite(
        path: &Path,
        f: impl FnOnce(&mut Value, &dyn Fn(String) -> PolicyError) -> Result<(), PolicyError>,
    ) -> Result<(), PolicyError> {
        let io = |msg: String| PolicyError::Io {
            path: path.display().to_string(),
            msg,
        };
        let mut doc: Value = match std::fs::read_to_string(path) {
            Ok(t) => serde_json::from_str(&t).map_err(|e| io(format!("not JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::json!({}),
            Err(e) => return Err(io(e.to_string())),
        };
        f(&mut doc, &io)?;
        let text = serde_json::to_string_pretty(&doc).map_err(|e| io(e.to_string()))?;
        // Refuse to write a file that would not load.
        Self::parse(path, &text)?;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| io(e.to_string()))?;
        let tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| io(e.to_string()))?;
        std::fs::write(tmp.path(), text + "\n").map_err(|e| io(e.to_string()))?;
        tmp.persist(path).map_err(|e| io(e.to_string()))?;
        Ok(())
    }
}

/// The `plugins` object of a policy document (made when missing).
fn plugins_of<'a>(
    doc: &'a mut Value,
    io: &dyn Fn(String) -> PolicyError,
) -> Result<&'a mut serde_json::Map<String, Value>, PolicyError> {
    doc.as_object_mut()
        .ok_or_else(|| io("not a JSON object".into()))?
        .entry("plugins")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()
        .ok_or_else(|| io("`plugins` is not an object".into()))
}

#[cfg(test)]
mod tests;
