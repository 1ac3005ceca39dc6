//! The process-wide plugin runtime: [`PluginHost`] (the engine, the WASI linker, the compiled-code cache,
//! the pool's slots) opens components into [`Candidate`]s, which a policy admits as callable [`Plugin`]s.

use crate::manifest::{self, Limits, Manifest};
use crate::sandbox::{self, Shared, State, ToolPre};
use crate::{
    CallReport, Estop, Grant, Plugin, PluginError, Policy, PolicyError, Requests, cache, linker,
};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thorn_tools::ToolSet;
use tokio::sync::Semaphore;
use wasmtime::Engine;
use wasmtime::component::{Component, Linker};

/// How the process-wide runtime is set up.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Where compiled components are cached (`None`: compile on every load). It is created `0700`; a
    /// directory that others could write is not used (a warning, and components compile in memory).
    pub cache_dir: Option<PathBuf>,
    /// Instance slots of the pooling allocator, which is also the most calls in flight at once; 0 means
    /// on-demand allocation (no up-front reservation).
    pub pool_slots: u32,
    /// The largest linear memory any plugin may be granted, in bytes (the pool reserves this per slot).
    pub max_memory: usize,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            cache_dir: None,
            pool_slots: 256,
            max_memory: 1 << 30,
        }
    }
}

/// The process-wide plugin runtime.
pub struct PluginHost {
    engine: Engine,
    linker: Linker<State>,
    config: HostConfig,
    cache: Option<cache::Cache>,
    pooling: bool,
    slots: Arc<Semaphore>,
    pub(crate) handle: tokio::runtime::Handle,
    shared: Arc<Shared>,
    manifest_validator: jsonschema::Validator,
    estop: Arc<Estop>,
    approvals: Arc<crate::Approvals>,
}

impl PluginHost {
    /// Runs `fut` on the host's runtime from synchronous code (from a thread of its own when the
    /// caller is inside a runtime), and a token that keeps that runtime alive for what it spawned.
    pub(crate) fn block_on<F: std::future::Future + Send>(&self, fut: F) -> (F::Output, Arc<Shared>)
    where
        F::Output: Send,
    {
        (
            sandbox::block_on(&self.handle, fut),
            Arc::clone(&self.shared),
        )
    }
}

impl std::fmt::Debug for PluginHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginHost")
            .field("config", &self.config)
            .field("pooling", &self.pooling)
            .finish_non_exhaustive()
    }
}

impl PluginHost {
    /// A runtime with the default configuration that caches compiled components in `cache_dir`.
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Self, PluginError> {
        Self::with_config(HostConfig {
            cache_dir,
            ..HostConfig::default()
        })
    }

    /// A runtime set up as `config` says.
    pub fn with_config(config: HostConfig) -> Result<Self, PluginError> {
        let err = |msg: String| PluginError::Load {
            path: "(engine)".into(),
            msg,
        };
        let (engine, pooling) = sandbox::engine(&config).map_err(|e| err(e.to_string()))?;
        let linker = linker::linker(&engine).map_err(|e| err(format!("{e:#}")))?;
        let cache = config
            .cache_dir
            .as_deref()
            .and_then(|dir| match cache::Cache::open(dir) {
                Ok(c) => Some(c),
                Err(why) => {
                    tracing::warn!(dir = %dir.display(), %why, "not using the compiled-code cache; plugins compile in memory");
                    None
                }
            });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("thorn-plugins")
            // Time for deadlines; IO for the sockets a network grant opens.
            .enable_all()
            .build()
            .map_err(|e| err(e.to_string()))?;
        let schema: Value =
            serde_json::from_str(manifest::MANIFEST_SCHEMA).map_err(|e| err(e.to_string()))?;
        let manifest_validator =
            jsonschema::validator_for(&schema).map_err(|e| err(e.to_string()))?;
        let handle = runtime.handle().clone();
        let shared = Shared::start(&engine, runtime).map_err(|e| err(e.to_string()))?;
        let slots = if pooling {
            config.pool_slots as usize
        } else {
            sandbox::ON_DEMAND_SLOTS
        };
        Ok(PluginHost {
            engine,
            linker,
            cache,
            pooling,
            slots: Arc::new(Semaphore::new(slots)),
            config,
            handle,
            shared: Arc::new(shared),
            manifest_validator,
            estop: Arc::default(),
            approvals: Arc::default(),
        })
    }

    /// The host with `estop` as the e-stop latch of every plugin it loads from now on (by default one
    /// kept in memory, released).
    pub fn with_estop(mut self, estop: Arc<Estop>) -> Self {
        self.estop = estop;
        self
    }

    /// The host with `controls`' e-stop latch and approvals queue for every plugin it loads from now on.
    pub fn with_controls(self, controls: &crate::Controls) -> Self {
        self.with_estop(Arc::clone(&controls.estop))
            .with_approvals(Arc::clone(&controls.approvals))
    }

    /// The host with `approvals` as the approvals queue of every plugin it loads from now on (by default
    /// one of its own).
    pub fn with_approvals(mut self, approvals: Arc<crate::Approvals>) -> Self {
        self.approvals = approvals;
        self
    }

    /// The approvals queue of the plugins this host loads.
    pub fn approvals(&self) -> &Arc<crate::Approvals> {
        &self.approvals
    }

    /// The e-stop latch of the plugins this host loads.
    pub fn estop(&self) -> &Arc<Estop> {
        &self.estop
    }

    /// Whether the pooling allocator is in use.
    pub fn pooling(&self) -> bool {
        self.pooling
    }

    /// The configuration.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// The compiled-code cache in use: the configured directory, or `None` when there is none or it could
    /// not be trusted.
    pub fn cache_dir(&self) -> Option<&Path> {
        self.cache.as_ref().map(cache::Cache::dir)
    }

    /// Compiles `bytes`, or loads the native code compiled earlier for the same bytes and engine (verified
    /// against its MAC; on a mismatch it is recompiled and overwritten).
    fn component(&self, path: &Path, bytes: &[u8], sha: &str) -> Result<Component, PluginError> {
        let err = |msg: String| PluginError::Load {
            path: path.display().to_string(),
            msg,
        };
        let Some(cache) = &self.cache else {
            return Component::new(&self.engine, bytes).map_err(|e| err(format!("{e:#}")));
        };
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut h);
        let engine = h.finish();
        if let Some(native) = cache.load(sha, engine) {
            match load_precompiled(&self.engine, &native) {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(plugin = %path.display(), error = %e, "recompiling a stale cached component")
                }
            }
        }
        let native = self
            .engine
            .precompile_component(bytes)
            .map_err(|e| err(format!("{e:#}")))?;
        if let Err(e) = cache.store(sha, engine, &native) {
            tracing::warn!(dir = %cache.dir().display(), error = %e, "cannot cache a compiled component");
        }
        load_precompiled(&self.engine, &native).map_err(|e| err(format!("{e:#}")))
    }

    /// Compiles (or loads) a component and reads its manifest, granting it nothing: enough to inspect
    /// or approve it. [`Candidate::admit`] makes it callable.
    pub fn open(&self, path: &Path) -> Result<Candidate, PluginError> {
        let bytes = std::fs::read(path).map_err(|e| PluginError::Load {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        self.open_bytes(path, &bytes)
    }

    /// [`PluginHost::open`] of a component already read (`path` names it): the bytes hashed are the bytes
    /// compiled, with no second read of the file.
    pub fn open_bytes(&self, path: &Path, bytes: &[u8]) -> Result<Candidate, PluginError> {
        let shown = path.display().to_string();
        // A core module (what wasm32-unknown-unknown or wasm32-wasip1 builds) is not a component: say
        // how to build one rather than pass on the parser's complaint.
        if wasm_kind(bytes) == Some(WasmKind::Module) {
            return Err(PluginError::Load {
                path: shown,
                msg: "it is a core WebAssembly module, not a component: build it for the wasm32-wasip2 target (`cargo build --release --target wasm32-wasip2`, or `thorn plugins build`)".into(),
            });
        }
        let sha = sha256_hex(bytes);
        let component = self.component(path, bytes, &sha)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::Load {
                path: shown.clone(),
                msg: format!("it needs imports the host does not provide: {e:#}"),
            })?;
        let name = path
            .file_stem()
            .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
        // A component that does not implement the `tool` world (an export missing, or of another type)
        // is refused before anything runs, whichever export is wrong.
        let pre = ToolPre::new(pre).map_err(|e| PluginError::Manifest {
            path: shown.clone(),
            msg: format!(
                "the component does not implement the thorn:tool world (plugins/sdk/wit/tool.wit): {}",
                sandbox::classify(e, &name, &Limits::default(), "")
            ),
        })?;
        let mut plugin = Plugin {
            name,
            sha256: sha,
            path: path.to_owned(),
            pre,
            grant: Grant::none(Limits::default()),
            manifest: Manifest {
                name: String::new(),
                version: String::new(),
                description: String::new(),
                functions: Vec::new(),
                capabilities: Value::Null,
            },
            tools: ToolSet::default(),
            engine: self.engine.clone(),
            handle: self.handle.clone(),
            _shared: Arc::clone(&self.shared),
            slots: Arc::clone(&self.slots),
            own: Arc::new(Semaphore::new(1)),
            audit: None,
            estop: Arc::clone(&self.estop),
            approvals: Arc::clone(&self.approvals),
            rate: crate::RateState::default(),
            max_memory: self.config.max_memory,
            lookup_names: Vec::new().into(),
        };
        let text = plugin
            .block_on(plugin.run(None, "", &mut CallReport::default()))
            .map_err(|e| PluginError::Manifest {
                path: shown.clone(),
                msg: format!("describe() failed: {e}"),
            })?;
        let manifest = manifest::parse(&self.manifest_validator, &shown, &text)?;
        let defs: Vec<Value> = manifest
            .functions
            .iter()
            .map(manifest::tool_definition)
            .collect();
        plugin.tools = ToolSet::new(&defs).map_err(|e| PluginError::Manifest {
            path: shown.clone(),
            msg: e.to_string(),
        })?;
        manifest::check_usage(&manifest, &plugin.tools).map_err(|msg| PluginError::Manifest {
            path: shown.clone(),
            msg,
        })?;
        plugin.name = manifest.name.clone();
        plugin.manifest = manifest;
        Ok(Candidate { plugin })
    }

    /// Opens a component and admits it under `policy`.
    pub fn load(&self, path: &Path, policy: &Policy) -> Result<Plugin, PluginError> {
        self.open(path)?.admit(policy)
    }

    /// Opens a component and gives it `grant` without asking a policy (tests, benchmarks, embedders that
    /// decide themselves).
    pub fn load_with(&self, path: &Path, grant: Grant) -> Result<Plugin, PluginError> {
        self.open(path)?.admit_with(grant)
    }
}

/// A compiled component whose manifest has been read, not yet admitted by a policy.
#[derive(Debug)]
pub struct Candidate {
    plugin: Plugin,
}

impl Candidate {
    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.plugin.manifest
    }

    /// The component's sha256.
    pub fn sha256(&self) -> &str {
        &self.plugin.sha256
    }

    /// What the manifest asks for.
    pub fn requests(&self) -> Requests {
        Requests::of(&self.plugin.manifest)
    }

    /// Admits it if `policy` approves this file and grants what it asks for.
    pub fn admit(self, policy: &Policy) -> Result<Plugin, PluginError> {
        let grant = policy.grant(&self.plugin.manifest, &self.plugin.sha256)?;
        self.admit_with(grant)
    }

    /// Admits it with `grant`.
    pub fn admit_with(mut self, grant: Grant) -> Result<Plugin, PluginError> {
        let p = &mut self.plugin;
        if grant.limits.memory > p.max_memory {
            return Err(PolicyError::Grant {
                plugin: p.name.clone(),
                msg: format!(
                    "its memory limit, {} MiB, is above the host's per-plugin maximum of {} MiB",
                    grant.limits.memory >> 20,
                    p.max_memory >> 20
                ),
            }
            .into());
        }
        p.own = Arc::new(Semaphore::new(grant.limits.max_concurrent.max(1)));
        p.lookup_names = grant
            .network
            .iter()
            .filter(|r| r.host.parse::<std::net::IpAddr>().is_err())
            .map(|r| r.host.clone())
            .collect::<Vec<_>>()
            .into();
        p.grant = grant;
        Ok(self.plugin)
    }
}

#[expect(
    unsafe_code,
    reason = "loading native code wasmtime compiled for this engine"
)]
fn load_precompiled(engine: &Engine, native: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `native` is either what `Engine::precompile_component` of this engine just returned, or the
    // bytes read back from the cache whose HMAC under this host's private key verified (`cache::Cache::load`,
    // which returns exactly the bytes it checked, so the file cannot change in between); the tag binds them
    // to this component's sha256 and this engine's compatibility hash. wasmtime additionally checks the
    // header and rejects artifacts of another version or configuration.
    unsafe { Component::deserialize(engine, native) }
}

/// The lowercase hex sha256 of `bytes` (a component's identity in the policy and the audit log).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex string; `None` for an odd length or a non-hex digit.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

/// What a `.wasm` file holds, by its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WasmKind {
    /// A core module (version 1).
    Module,
    /// A component (layer 1).
    Component,
}

/// The kind of WebAssembly binary `bytes` is, `None` when it is not one.
fn wasm_kind(bytes: &[u8]) -> Option<WasmKind> {
    match bytes.get(..8)? {
        [0, b'a', b's', b'm', 1, 0, 0, 0] => Some(WasmKind::Module),
        [0, b'a', b's', b'm', _, _, 1, 0] => Some(WasmKind::Component),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let b = [0u8, 0x7f, 0xab, 0xff];
        assert_eq!(hex(&b), "007fabff");
        assert_eq!(unhex("007fabff").as_deref(), Some(&b[..]));
        assert_eq!(unhex("007FABFF").as_deref(), Some(&b[..]));
        assert_eq!(unhex(""), Some(vec![]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex("é1"), None);
    }

    #[test]
    fn a_core_module_and_a_component_are_told_apart_by_their_header() {
        assert_eq!(wasm_kind(b"\0asm\x01\0\0\0"), Some(WasmKind::Module));
        assert_eq!(
            wasm_kind(b"\0asm\x0d\0\x01\0rest"),
            Some(WasmKind::Component)
        );
        assert_eq!(wasm_kind(b"\0asm"), None);
        assert_eq!(wasm_kind(b"not wasm at all"), None);
    }
}
