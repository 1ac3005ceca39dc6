//! Tool plugins: WASI preview 2 components run in wasmtime with no ambient authority.
//!
//! * One [`PluginHost`] per process owns the wasmtime `Engine` (Cranelift, epoch interruption, fuel), the
//!   WASI linker (`linker`: wasmtime-wasi with name lookups limited to the grant and no symlink creation),
//!   an epoch ticker thread and a tokio runtime for synchronous callers. It uses the **pooling allocator**
//!   (instance slots, memories and stacks reserved up front, copy-on-write heap images) when the address
//!   space allows and falls back to on-demand allocation otherwise; a semaphore with one permit per slot
//!   sits in front of it, since an exhausted pool is an error, not back-pressure. Components are compiled
//!   once and cached on disk (`cache`: a private directory, each artifact MACed under a per-host key and
//!   bound to the component's sha256 and the engine), so a restart loads native code in milliseconds
//!   instead of recompiling, and the cache cannot swap an approved plugin's code.
//! * [`PluginHost::open`] compiles (or loads) a component, pre-links it (`InstancePre`), calls its
//!   `describe()` in a sandbox with nothing granted and validates the manifest against
//!   `schemas/tool-manifest.schema.json`. Every function's `parameters` becomes a tool with a compiled
//!   `jsonschema` validator. [`Candidate::admit`] then asks the operator's [`Policy`] (sha256 pin,
//!   capabilities) and yields a callable [`Plugin`]; [`PluginHost::load`] does both.
//! * [`Plugin::call_async`] validates the [`Caller`] and the arguments first (a call that violates the schema
//!   never reaches the plugin), records its intent in the [`AuditLog`] (durable before the plugin runs; a
//!   call that cannot be recorded does not run), waits for a slot (the plugin's own concurrency limit, then
//!   the pool's), then runs the function in a **fresh `Store`** (a trap poisons an instance, so none is
//!   reused): a WASI context holding exactly the grant (preopened directories, env vars, a TCP allow-list;
//!   otherwise no env, args, files or sockets), stdout/stderr captured up to a bound, a memory cap over all
//!   of the store's memories (`limiter`), a cap on its resource-table entries (every open file, socket and
//!   stream is one, so this bounds host descriptors), optional fuel, and a deadline enforced twice: epochs
//!   (the guest yields every tick, and is interrupted after the deadline plus a grace period) and a tokio
//!   timeout around the call (for a guest blocked in a host call such as `sleep`). A result, or the tool's
//!   own error message, larger than the output cap is refused or cut. Every failure is a typed
//!   [`PluginError`]; the host keeps serving. The outcome is recorded and made durable before it is returned.

pub mod audit;
mod cache;
mod caller;
pub mod external;
mod limiter;
mod linker;
pub mod live;
pub mod policy;
mod set;
mod trail;

pub use audit::{AuditError, AuditLog, Outcome, Phase, Record, Rotation};
pub use caller::{Caller, CallerError, MAX_ID_BYTES, validate_conversation_id};
pub use external::McpServer;
pub use limiter::MemoryCap;
pub use live::{Fingerprint, LiveSet};
pub use policy::{
    Access, Grant, NetRule, Policy, PolicyError, Preopen, Requests, ServerSpec, ServerTransport,
};
pub use set::{GrammarCheck, PluginSet, Provider, Refusal, components};

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiserror::Error;
use thorn_tools::{ToolError, ToolSet};
use tokio::sync::Semaphore;
use wasmtime::component::{Component, InstancePre, Linker, ResourceTable, ResourceTableError};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap,
    UpdateDeadline,
};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::sockets::SocketAddrUse;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// The manifest schema every plugin's `describe()` must satisfy.
pub const MANIFEST_SCHEMA: &str = include_str!("../../../schemas/tool-manifest.schema.json");

/// How often the epoch ticker advances.
const TICK: Duration = Duration::from_millis(10);

/// What can go wrong loading or calling a plugin.
#[derive(Debug, Error)]
pub enum PluginError {
    /// Reading or compiling the component.
    #[error("plugin {path}: {msg}")]
    Load {
        /// The component file.
        path: String,
        /// What failed.
        msg: String,
    },
    /// `describe()` returned something that is not a valid manifest.
    #[error("plugin {path}: invalid manifest: {msg}")]
    Manifest {
        /// The component file.
        path: String,
        /// What is wrong.
        msg: String,
    },
    /// The plugin has no such function.
    #[error("plugin {plugin:?} has no function {function:?}")]
    UnknownFunction {
        /// The plugin.
        plugin: String,
        /// The function asked for.
        function: String,
    },
    /// Arguments that violate the function's schema (the plugin did not run).
    #[error(transparent)]
    Arguments(#[from] ToolError),
    /// The call ran past its time limit and was stopped.
    #[error("plugin {plugin:?} timed out after {after:?} and was stopped")]
    Timeout {
        /// The plugin.
        plugin: String,
        /// The limit.
        after: Duration,
    },
    /// The guest tried to grow its memory past the cap.
    #[error("plugin {plugin:?}: memory limit exceeded ({limit} bytes)")]
    MemoryLimit {
        /// The plugin.
        plugin: String,
        /// The cap.
        limit: usize,
    },
    /// The call used all its fuel.
    #[error("plugin {plugin:?} ran out of fuel ({fuel} units)")]
    Fuel {
        /// The plugin.
        plugin: String,
        /// The budget.
        fuel: u64,
    },
    /// The guest trapped (panic, stack overflow, ...).
    #[error("plugin {plugin:?} crashed: {trap}{}", stderr_suffix(.stderr))]
    Trap {
        /// The plugin.
        plugin: String,
        /// The trap, in words.
        trap: String,
        /// The tail of what the guest wrote to stderr (a panic message, say).
        stderr: String,
    },
    /// The result was larger than allowed or not valid JSON text.
    #[error("plugin {plugin:?} returned an unusable result: {msg}")]
    Output {
        /// The plugin.
        plugin: String,
        /// What is wrong.
        msg: String,
    },
    /// The tool ran and reported an error (for the model to read).
    #[error("{0}")]
    Tool(String),
    /// The operator's policy refuses the plugin.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// No slot freed up within the call's time limit.
    #[error(
        "plugin {plugin:?} is busy: no free slot within {after:?} ({limit} concurrent calls allowed)"
    )]
    Busy {
        /// The plugin.
        plugin: String,
        /// How long the call waited.
        after: Duration,
        /// Its concurrency limit.
        limit: usize,
    },
    /// The call could not be recorded: it did not run (intent), or its result is withheld (outcome).
    #[error(transparent)]
    Audit(#[from] AuditError),
    /// The caller's conversation id, key id or peer address is malformed (an API maps it to 400).
    #[error(transparent)]
    Caller(#[from] CallerError),
    /// An external MCP server could not be started, or failed a call (exited, malformed JSON-RPC).
    #[error("MCP server {server:?}: {msg}")]
    Server {
        /// The server's name in the policy.
        server: String,
        /// What went wrong.
        msg: String,
    },
    /// The guest tried to hold more resources (open files, sockets, streams) than allowed at once.
    #[error("plugin {plugin:?}: resource limit exceeded ({limit} open handles)")]
    ResourceLimit {
        /// The plugin.
        plugin: String,
        /// The cap.
        limit: usize,
    },
}

impl PluginError {
    /// A short stable name for the kind of error (audit log, metrics).
    pub fn kind(&self) -> &'static str {
        match self {
            PluginError::Load { .. } => "load",
            PluginError::Manifest { .. } => "manifest",
            PluginError::UnknownFunction { .. } => "unknown_function",
            PluginError::Arguments(_) => "arguments",
            PluginError::Timeout { .. } => "timeout",
            PluginError::MemoryLimit { .. } => "memory_limit",
            PluginError::Fuel { .. } => "fuel",
            PluginError::Trap { .. } => "trap",
            PluginError::Output { .. } => "output",
            PluginError::Tool(_) => "tool",
            PluginError::Policy(_) => "policy",
            PluginError::Busy { .. } => "busy",
            PluginError::Audit(_) => "audit",
            PluginError::Caller(_) => "caller",
            PluginError::ResourceLimit { .. } => "resource_limit",
            PluginError::Server { .. } => "mcp_server",
        }
    }
}

fn stderr_suffix(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!(" (stderr: {s})")
    }
}

/// Per-call limits (the operator's policy sets them per plugin).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Wall-clock limit of one call.
    pub timeout: Duration,
    /// Linear-memory cap in bytes, over all of an instance's memories together.
    pub memory: usize,
    /// Fuel budget (`None` = unmetered; epochs still bound the time).
    pub fuel: Option<u64>,
    /// Bytes of stdout and of stderr kept (beyond it the guest's writes fail).
    pub stdio: usize,
    /// Largest result accepted, in bytes; a longer error message from the tool is cut to it.
    pub max_output: usize,
    /// Resource-table entries (open files, directories, sockets, streams, ...) a call may hold at once.
    pub max_resources: usize,
    /// Calls of this plugin that may run at once (more wait, within their time limit).
    pub max_concurrent: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(5),
            memory: 64 << 20,
            fuel: None,
            stdio: 64 << 10,
            max_output: 1 << 20,
            max_resources: 256,
            max_concurrent: 16,
        }
    }
}

/// One function a plugin exports.
#[derive(Debug, Clone)]
pub struct FunctionDef {
    /// Its name inside the plugin.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON schema of its arguments.
    pub parameters: Value,
    /// JSON schema of its result, if declared.
    pub returns: Option<Value>,
    /// Example requests and their arguments (each valid against `parameters`).
    pub examples: Vec<thorn_tools::Example>,
    /// How a result reads as an answer.
    pub answer: Option<thorn_tools::AnswerTemplate>,
    /// String parameters whose value the request spells out (each a top-level `"type": "string"`
    /// property of `parameters`).
    pub from_request: Vec<String>,
    /// What a call does, as hints for clients (MCP tool annotations).
    pub annotations: Annotations,
}

/// A function's MCP tool annotations: hints for clients (an agent asking a person before a destructive
/// call), never what the host enforces (the policy is).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Annotations {
    /// `readOnlyHint`: it changes nothing.
    pub read_only: Option<bool>,
    /// `destructiveHint`: it may change or destroy something irreversibly.
    pub destructive: Option<bool>,
    /// `idempotentHint`: calling it again with the same arguments does nothing more.
    pub idempotent: Option<bool>,
    /// `openWorldHint`: it reaches outside the host.
    pub open_world: Option<bool>,
}

impl Annotations {
    /// From a manifest's `annotations` object (already validated against the manifest schema).
    pub fn from_manifest(v: &Value) -> Self {
        let hint = |k: &str| v.get(k).and_then(Value::as_bool);
        Annotations {
            read_only: hint("readOnlyHint"),
            destructive: hint("destructiveHint"),
            idempotent: hint("idempotentHint"),
            open_world: hint("openWorldHint"),
        }
    }

    /// Whether any hint is given.
    pub fn is_empty(&self) -> bool {
        *self == Annotations::default()
    }
}

/// A validated manifest.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// Plugin name.
    pub name: String,
    /// Plugin version.
    pub version: String,
    /// What it is for.
    pub description: String,
    /// Its functions.
    pub functions: Vec<FunctionDef>,
    /// What it asks for.
    pub capabilities: Value,
}

/// Per-call state of a store.
struct State {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: limiter::Budget,
    /// The host names the guest may look up (see `linker`).
    lookup_names: Arc<[String]>,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

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

/// Calls in flight at once when the on-demand allocator is used.
const ON_DEMAND_SLOTS: usize = 1024;

/// What must live as long as any plugin: the epoch ticker (a guest only yields, and is only interrupted,
/// while epochs advance) and the runtime synchronous calls run on. Every [`Plugin`] holds it, so dropping
/// the [`PluginHost`] first is harmless.
pub(crate) struct Shared {
    runtime: Option<tokio::runtime::Runtime>,
    stop: Arc<AtomicBool>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(rt) = self.runtime.take() {
            // The last holder may be an async task; a runtime must not be dropped (blocking) there.
            rt.shutdown_background();
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
    handle: tokio::runtime::Handle,
    shared: Arc<Shared>,
    manifest_validator: jsonschema::Validator,
}

/// A host function as a tool-set (OpenAI `tools`) definition.
fn tool_definition(f: &FunctionDef) -> Value {
    serde_json::json!({"type": "function", "function": {"name": f.name,
        "description": f.description, "parameters": f.parameters}})
}

/// Runs `fut` to completion on `handle`'s runtime from synchronous code, from a thread of its own when
/// the caller is itself inside a tokio runtime (where blocking in place is not allowed).
fn block_on<F: std::future::Future + Send>(handle: &tokio::runtime::Handle, fut: F) -> F::Output
where
    F::Output: Send,
{
    if tokio::runtime::Handle::try_current().is_ok() {
        std::thread::scope(|s| {
            s.spawn(|| handle.block_on(fut))
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    } else {
        handle.block_on(fut)
    }
}

impl PluginHost {
    /// Runs `fut` on the host's runtime from synchronous code (from a thread of its own when the
    /// caller is inside a runtime), and a token that keeps that runtime alive for what it spawned.
    pub(crate) fn block_on<F: std::future::Future + Send>(&self, fut: F) -> (F::Output, Arc<Shared>)
    where
        F::Output: Send,
    {
        (block_on(&self.handle, fut), Arc::clone(&self.shared))
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

fn pooling_config(c: &HostConfig) -> PoolingAllocationConfig {
    let n = c.pool_slots;
    let mut p = PoolingAllocationConfig::default();
    // A Rust wasip2 component is a handful of core instances (the program, wasi-libc shims) with one
    // memory; leave room for components composed of several modules.
    p.total_component_instances(n)
        .total_core_instances(n.saturating_mul(8))
        .max_core_instances_per_component(16)
        .total_memories(n.saturating_mul(2))
        .max_memories_per_component(2)
        .total_tables(n.saturating_mul(8))
        .max_tables_per_component(16)
        .total_stacks(n)
        .max_memory_size(c.max_memory);
    p
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
        let mut cfg = Config::new();
        cfg.epoch_interruption(true);
        cfg.consume_fuel(true);
        let mut pooled = None;
        if config.pool_slots > 0 {
            let mut c = cfg.clone();
            c.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling_config(&config)));
            match Engine::new(&c) {
                Ok(e) => pooled = Some(e),
                // Typically too little address space (39-bit VA) or a strict overcommit setting.
                Err(e) => tracing::warn!(
                    error = %e,
                    slots = config.pool_slots,
                    "the pooling allocator is unavailable; plugins use on-demand allocation"
                ),
            }
        }
        let pooling = pooled.is_some();
        let engine = match pooled {
            Some(e) => e,
            None => Engine::new(&cfg).map_err(|e| err(e.to_string()))?,
        };
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
            serde_json::from_str(MANIFEST_SCHEMA).map_err(|e| err(e.to_string()))?;
        let manifest_validator =
            jsonschema::validator_for(&schema).map_err(|e| err(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (e2, s2) = (engine.clone(), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("thorn-epoch".into())
            .spawn(move || {
                while !s2.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    e2.increment_epoch();
                }
            })
            .map_err(|e| err(e.to_string()))?;
        let slots = if pooling {
            config.pool_slots as usize
        } else {
            ON_DEMAND_SLOTS
        };
        Ok(PluginHost {
            engine,
            linker,
            cache,
            pooling,
            slots: Arc::new(Semaphore::new(slots)),
            config,
            handle: runtime.handle().clone(),
            shared: Arc::new(Shared {
                runtime: Some(runtime),
                stop,
            }),
            manifest_validator,
        })
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
        let sha = sha256_hex(bytes);
        let component = self.component(path, bytes, &sha)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::Load {
                path: shown.clone(),
                msg: format!("it needs imports the host does not provide: {e:#}"),
            })?;
        let mut plugin = Plugin {
            name: path
                .file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned()),
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
            max_memory: self.config.max_memory,
            lookup_names: Vec::new().into(),
        };
        let text = plugin
            .block_on(plugin.run(None, "", &mut CallReport::default()))
            .map_err(|e| PluginError::Manifest {
                path: shown.clone(),
                msg: format!("describe() failed: {e}"),
            })?;
        let manifest = self.manifest(&shown, &text)?;
        let defs: Vec<Value> = manifest.functions.iter().map(tool_definition).collect();
        plugin.tools = ToolSet::new(&defs).map_err(|e| PluginError::Manifest {
            path: shown.clone(),
            msg: e.to_string(),
        })?;
        check_usage(&manifest, &plugin.tools).map_err(|msg| PluginError::Manifest {
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

    fn manifest(&self, path: &str, text: &str) -> Result<Manifest, PluginError> {
        let bad = |msg: String| PluginError::Manifest {
            path: path.to_owned(),
            msg,
        };
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let errors: Vec<String> = self
            .manifest_validator
            .iter_errors(&v)
            .map(|e| format!("{e} at {}", e.instance_path()))
            .collect();
        if !errors.is_empty() {
            return Err(bad(errors.join("; ")));
        }
        let s = |k: &str| v[k].as_str().unwrap_or("").to_owned();
        let mut functions = Vec::new();
        for f in v["functions"].as_array().into_iter().flatten() {
            let name = f["name"].as_str().unwrap_or("").to_owned();
            let examples = f["examples"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| thorn_tools::Example {
                    request: e["request"].as_str().unwrap_or("").to_owned(),
                    arguments: e["arguments"].clone(),
                })
                .collect();
            let answer = match f["answer"].as_str() {
                Some(src) => Some(
                    thorn_tools::AnswerTemplate::new(src)
                        .map_err(|e| bad(format!("function {name:?}: {e}")))?,
                ),
                None => None,
            };
            let from_request: Vec<String> = f["from_request"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p.as_str().map(str::to_owned))
                .collect();
            functions.push(FunctionDef {
                annotations: Annotations::from_manifest(&f["annotations"]),
                from_request,
                description: f["description"].as_str().unwrap_or("").to_owned(),
                parameters: f["parameters"].clone(),
                returns: f.get("returns").cloned(),
                examples,
                answer,
                name,
            });
        }
        Ok(Manifest {
            name: s("name"),
            version: s("version"),
            description: s("description"),
            functions,
            capabilities: v.get("capabilities").cloned().unwrap_or(Value::Null),
        })
    }
}

/// Checks what a manifest says about using its functions against their schemas: every example must be a
/// call the model could make (it is shown to the model as one), and `from_request` may name only string
/// parameters.
fn check_usage(manifest: &Manifest, tools: &ToolSet) -> Result<(), String> {
    for f in &manifest.functions {
        for (i, e) in f.examples.iter().enumerate() {
            let call = thorn_tools::ParsedCall {
                name: f.name.clone(),
                arguments: e.arguments.clone(),
            };
            tools.check(&call).map_err(|err| {
                format!(
                    "function {:?}: example {i} does not fit its parameters: {err}",
                    f.name
                )
            })?;
        }
        if let Some(p) = f
            .from_request
            .iter()
            .find(|p| f.parameters["properties"][p.as_str()]["type"] != "string")
        {
            return Err(format!(
                "function {:?}: from_request names {p:?}, which is not a string parameter",
                f.name
            ));
        }
    }
    Ok(())
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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A loaded plugin, ready to call. Cheap to share behind an `Arc`; calls may run concurrently.
pub struct Plugin {
    name: String,
    sha256: String,
    path: PathBuf,
    pre: InstancePre<State>,
    grant: Grant,
    manifest: Manifest,
    tools: ToolSet,
    engine: Engine,
    handle: tokio::runtime::Handle,
    _shared: Arc<Shared>,
    slots: Arc<Semaphore>,
    own: Arc<Semaphore>,
    audit: Option<Arc<AuditLog>>,
    max_memory: usize,
    /// The granted host names (not addresses): the only names the guest may look up.
    lookup_names: Arc<[String]>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.name)
            .field("sha256", &self.sha256)
            .finish_non_exhaustive()
    }
}

/// What one call produced besides its result.
#[derive(Debug, Clone, Default)]
pub struct CallReport {
    /// Wall time of the call, waiting for a slot included.
    pub duration: Duration,
    /// Fuel used (when metered).
    pub fuel: Option<u64>,
    /// What the guest wrote to stdout and stderr (bounded).
    pub stdout: String,
    /// See `stdout`.
    pub stderr: String,
}

impl Plugin {
    /// The plugin's name (from its manifest).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The component's sha256.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// What it was granted.
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// Its functions as tools (for prompts, grammars and validation).
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// Records every call in `log` from now on.
    pub fn with_audit(mut self, log: Arc<AuditLog>) -> Self {
        self.audit = Some(log);
        self
    }

    /// Runs `fut` to completion from synchronous code, on the host's runtime (from a thread of its own
    /// when the caller is itself inside a tokio runtime, where blocking in place is not allowed).
    fn block_on<F: std::future::Future + Send>(&self, fut: F) -> F::Output
    where
        F::Output: Send,
    {
        block_on(&self.handle, fut)
    }

    /// Calls `function` with `args` (validated against its schema first), blocking until it ends.
    pub fn call(&self, function: &str, args: &Value) -> Result<Value, PluginError> {
        self.call_reported(&Caller::default(), function, args).0
    }

    /// [`Plugin::call`] for `caller`, with the call's report (time, fuel, captured output) even when it
    /// fails.
    pub fn call_reported(
        &self,
        caller: &Caller,
        function: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        self.block_on(self.call_async(caller, function, args))
    }

    /// Instantiates the plugin once under its limits and drops the instance without calling anything:
    /// a health check, and the cost every call pays on top of its own work.
    pub fn ping(&self) -> Result<Duration, PluginError> {
        self.block_on(async {
            let t0 = Instant::now();
            let mut store = self.store()?.0;
            self.pre
                .instantiate_async(&mut store)
                .await
                .map_err(|e| self.classify(e, ""))?;
            Ok(t0.elapsed())
        })
    }

    /// Calls `function` with `args` for `caller`: validation, the intent record, a slot, a fresh instance,
    /// the outcome record ([`trail::audited`]).
    pub async fn call_async(
        &self,
        caller: &Caller,
        function: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        let callee = trail::Callee {
            name: &self.name,
            sha256: &self.sha256,
            audit_arguments: self.grant.audit_arguments,
        };
        let admit = || self.admit_call(function, args);
        let run = |()| async {
            let mut report = CallReport::default();
            let (out, bytes) = match self.acquire().await {
                Err(e) => (Err(e), 0),
                Ok(_permits) => {
                    let text = self
                        .run(Some(function), &args.to_string(), &mut report)
                        .await;
                    let bytes = text.as_ref().map_or(0, String::len);
                    let value = text.and_then(|t| {
                        serde_json::from_str(&t).map_err(|e| PluginError::Output {
                            plugin: self.name.clone(),
                            msg: format!("the result is not JSON: {e}"),
                        })
                    });
                    (value, bytes)
                }
            };
            (out, bytes, report)
        };
        trail::audited(
            self.audit.as_deref(),
            callee,
            caller,
            function,
            args,
            admit,
            run,
        )
        .await
    }

    /// Checks the function exists and the arguments satisfy its schema.
    fn admit_call(&self, function: &str, args: &Value) -> Result<(), PluginError> {
        if self.tools.get(function).is_none() {
            return Err(PluginError::UnknownFunction {
                plugin: self.name.clone(),
                function: function.to_owned(),
            });
        }
        let call = thorn_tools::ParsedCall {
            name: function.to_owned(),
            arguments: args.clone(),
        };
        self.tools.check(&call)?;
        Ok(())
    }

    /// Waits (at most the call's time limit) for one of the plugin's own slots and then a pool slot.
    async fn acquire(
        &self,
    ) -> Result<
        (
            tokio::sync::SemaphorePermit<'_>,
            tokio::sync::SemaphorePermit<'_>,
        ),
        PluginError,
    > {
        let wait = self.grant.limits.timeout;
        let busy = || PluginError::Busy {
            plugin: self.name.clone(),
            after: wait,
            limit: self.grant.limits.max_concurrent,
        };
        let both = async {
            let a = self.own.acquire().await.ok()?;
            let b = self.slots.acquire().await.ok()?;
            Some((a, b))
        };
        match tokio::time::timeout(wait, both).await {
            Ok(Some(p)) => Ok(p),
            _ => Err(busy()),
        }
    }

    /// A fresh store holding exactly the grant, and its captured stdout and stderr.
    fn store(&self) -> Result<(Store<State>, MemoryOutputPipe, MemoryOutputPipe), PluginError> {
        let g = &self.grant;
        let lim = &g.limits;
        let stdout = MemoryOutputPipe::new(lim.stdio);
        let stderr = MemoryOutputPipe::new(lim.stdio);
        let mut b = WasiCtxBuilder::new();
        b.stdout(stdout.clone()).stderr(stderr.clone());
        for (k, v) in &g.env {
            b.env(k, v);
        }
        for p in &g.preopens {
            let perms = if p.write {
                FsPerms::ReadWrite
            } else {
                FsPerms::ReadOnly
            };
            b.preopened_dir(&p.host, &p.guest, perms).map_err(|e| {
                PluginError::Policy(PolicyError::Grant {
                    plugin: self.name.clone(),
                    msg: format!(
                        "cannot open the granted directory {}: {e}",
                        p.host.display()
                    ),
                })
            })?;
        }
        if !g.network.is_empty() {
            let rules: Arc<[NetRule]> = g.network.clone().into();
            b.allow_tcp(true);
            // Lookups of the granted names only (`linker` filters every other name before it resolves).
            b.allow_ip_name_lookup(!self.lookup_names.is_empty());
            b.socket_addr_check(move |addr, use_| {
                let ok = match use_ {
                    // The implicit bind to an ephemeral port that precedes every connect.
                    SocketAddrUse::TcpBind => addr.ip().is_unspecified() && addr.port() == 0,
                    SocketAddrUse::TcpConnect => rules.iter().any(|r| r.allows(addr)),
                    _ => false,
                };
                Box::pin(async move { ok })
            });
        }
        let mut table = ResourceTable::new();
        table.set_max_capacity(lim.max_resources);
        let mut store = Store::new(
            &self.engine,
            State {
                wasi: b.build(),
                table,
                limits: limiter::Budget::new(lim.memory),
                lookup_names: Arc::clone(&self.lookup_names),
            },
        );
        store.limiter(|s| &mut s.limits);
        let _ = store.set_fuel(lim.fuel.unwrap_or(u64::MAX));
        // Yield to the executor every tick (so the tokio timeout can fire), and interrupt for good a grace
        // period after the deadline (a guest that never yields cannot outlive it).
        let hard = Instant::now() + lim.timeout + Duration::from_millis(500);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            Ok(if Instant::now() >= hard {
                UpdateDeadline::Interrupt
            } else {
                UpdateDeadline::Yield(1)
            })
        });
        Ok((store, stdout, stderr))
    }

    /// One fresh instance, one export call (`describe` when `function` is `None`).
    async fn run(
        &self,
        function: Option<&str>,
        args: &str,
        report: &mut CallReport,
    ) -> Result<String, PluginError> {
        let lim = &self.grant.limits;
        let (mut store, stdout, stderr) = self.store()?;
        let fuel = lim.fuel.unwrap_or(u64::MAX);
        let fut = async {
            let instance = self.pre.instantiate_async(&mut store).await?;
            let out: Result<String, String> = match function {
                None => {
                    let f = instance.get_typed_func::<(), (String,)>(&mut store, "describe")?;
                    Ok(f.call_async(&mut store, ()).await?.0)
                }
                Some(name) => {
                    let f = instance.get_typed_func::<(&str, &str), (Result<String, String>,)>(
                        &mut store, "call",
                    )?;
                    f.call_async(&mut store, (name, args)).await?.0
                }
            };
            let used = store.get_fuel().ok().map(|left| fuel - left);
            wasmtime::Result::Ok((out, used))
        };
        let res = tokio::time::timeout(lim.timeout, fut).await;
        report.stdout = String::from_utf8_lossy(&stdout.contents()).into_owned();
        report.stderr = String::from_utf8_lossy(&stderr.contents()).into_owned();
        let plugin = || self.name.clone();
        let (out, used) = match res {
            Err(_) => {
                return Err(PluginError::Timeout {
                    plugin: plugin(),
                    after: lim.timeout,
                });
            }
            Ok(Err(e)) => return Err(self.classify(e, &report.stderr)),
            Ok(Ok(v)) => v,
        };
        report.fuel = lim.fuel.and(used);
        let text = out.map_err(|e| PluginError::Tool(trail::truncate(e, lim.max_output)))?;
        if text.len() > lim.max_output {
            return Err(PluginError::Output {
                plugin: plugin(),
                msg: format!(
                    "{} bytes, more than the limit of {}",
                    text.len(),
                    lim.max_output
                ),
            });
        }
        Ok(text)
    }

    /// Turns a wasmtime error into the error a user can act on.
    fn classify(&self, e: wasmtime::Error, stderr: &str) -> PluginError {
        let plugin = self.name.clone();
        let lim = &self.grant.limits;
        let tail: String = {
            let t = stderr.trim();
            let start = t.len().saturating_sub(300);
            let start = (start..t.len())
                .find(|&i| t.is_char_boundary(i))
                .unwrap_or(t.len());
            t[start..].to_owned()
        };
        if e.downcast_ref::<MemoryCap>().is_some() {
            return PluginError::MemoryLimit {
                plugin,
                limit: lim.memory,
            };
        }
        if matches!(
            e.downcast_ref::<ResourceTableError>(),
            Some(ResourceTableError::Full)
        ) {
            return PluginError::ResourceLimit {
                plugin,
                limit: lim.max_resources,
            };
        }
        match e.downcast_ref::<Trap>() {
            Some(Trap::OutOfFuel) => PluginError::Fuel {
                plugin,
                fuel: lim.fuel.unwrap_or(u64::MAX),
            },
            Some(Trap::Interrupt) => PluginError::Timeout {
                plugin,
                after: lim.timeout,
            },
            Some(t) => PluginError::Trap {
                plugin,
                trap: t.to_string(),
                stderr: tail,
            },
            None => {
                let msg = format!("{e:#}");
                if msg.contains("memory limit exceeded") {
                    PluginError::MemoryLimit {
                        plugin,
                        limit: lim.memory,
                    }
                } else if msg.contains("resource table has no free keys") {
                    PluginError::ResourceLimit {
                        plugin,
                        limit: lim.max_resources,
                    }
                } else if msg.contains("utf-8") || msg.contains("utf8") || msg.contains("UTF-8") {
                    PluginError::Output {
                        plugin,
                        msg: format!("the result is not valid UTF-8 ({msg})"),
                    }
                } else {
                    PluginError::Trap {
                        plugin,
                        trap: msg,
                        stderr: tail,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod usage_tests {
    use super::*;
    use serde_json::json;

    fn manifest(examples: Vec<thorn_tools::Example>, from_request: &[&str]) -> (Manifest, ToolSet) {
        let parameters = json!({"type": "object", "properties": {"key": {"type": "string"},
            "n": {"type": "integer"}}, "required": ["key"], "additionalProperties": false});
        let tools = ToolSet::new(&[json!({"type": "function", "function": {"name": "f",
            "description": "", "parameters": parameters}})])
        .unwrap();
        let m = Manifest {
            name: "p".into(),
            version: "1".into(),
            description: String::new(),
            functions: vec![FunctionDef {
                name: "f".into(),
                description: String::new(),
                parameters,
                returns: None,
                examples,
                answer: None,
                from_request: from_request.iter().map(|s| (*s).to_owned()).collect(),
                annotations: Annotations::default(),
            }],
            capabilities: Value::Null,
        };
        (m, tools)
    }

    fn example(arguments: Value) -> thorn_tools::Example {
        thorn_tools::Example {
            request: "r".into(),
            arguments,
        }
    }

    #[test]
    fn examples_must_fit_the_schema_and_from_request_names_strings() {
        let (m, t) = manifest(vec![example(json!({"key": "a", "n": 1}))], &["key"]);
        assert_eq!(check_usage(&m, &t), Ok(()));
        let (m, t) = manifest(vec![example(json!({"n": 1}))], &[]);
        let e = check_usage(&m, &t).unwrap_err();
        assert!(e.contains("example 0 does not fit"), "{e}");
        let (m, t) = manifest(vec![], &["n"]);
        assert!(
            check_usage(&m, &t)
                .unwrap_err()
                .contains("not a string parameter")
        );
        let (m, t) = manifest(vec![], &["absent"]);
        assert!(check_usage(&m, &t).is_err());
    }
}
