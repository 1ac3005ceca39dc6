//! Tool plugins: WASI preview 2 components run in wasmtime with no ambient authority.
//!
//! * One [`PluginHost`] per process owns the wasmtime `Engine` (Cranelift, epoch interruption, fuel), the
//!   WASI linker, an epoch ticker thread and a tokio runtime for calls. Components are compiled once and
//!   cached on disk as `.cwasm`, keyed by the component's sha256 and the engine's compatibility hash, so a
//!   restart loads native code in milliseconds instead of recompiling.
//! * [`PluginHost::load`] compiles (or loads) a component, pre-links it (`InstancePre`), calls its
//!   `describe()` and validates the manifest against `schemas/tool-manifest.schema.json`. Every function's
//!   `parameters` becomes a tool with a compiled `jsonschema` validator.
//! * [`Plugin::call`] validates the arguments first (a call that violates the schema never reaches the
//!   plugin), then runs the function in a **fresh `Store`** (a trap poisons an instance, so none is reused):
//!   a deny-by-default WASI context (no env, args, preopens or sockets; stdout/stderr captured up to a bound),
//!   a memory cap, optional fuel, and a deadline enforced twice: epochs (the guest yields every tick, and is
//!   interrupted after the deadline plus a grace period) and a tokio timeout around the call (for a guest
//!   blocked in a host call such as `sleep`). Every failure is a typed [`PluginError`]; the host keeps
//!   serving.

use super::{ToolError, ToolSet};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiserror::Error;
use wasmtime::component::{Component, InstancePre, Linker, ResourceTable};
use wasmtime::{Config, Engine, Store, StoreLimits, StoreLimitsBuilder, Trap, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

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
    /// Linear-memory cap in bytes.
    pub memory: usize,
    /// Fuel budget (`None` = unmetered; epochs still bound the time).
    pub fuel: Option<u64>,
    /// Bytes of stdout and of stderr kept (beyond it the guest's writes fail).
    pub stdio: usize,
    /// Largest result accepted, in bytes.
    pub max_output: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(5),
            memory: 64 << 20,
            fuel: None,
            stdio: 64 << 10,
            max_output: 1 << 20,
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
    limits: StoreLimits,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// The process-wide plugin runtime.
pub struct PluginHost {
    engine: Engine,
    linker: Linker<State>,
    cache_dir: Option<PathBuf>,
    runtime: tokio::runtime::Runtime,
    manifest_validator: jsonschema::Validator,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for PluginHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginHost")
            .field("cache_dir", &self.cache_dir)
            .finish_non_exhaustive()
    }
}

impl Drop for PluginHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl PluginHost {
    /// A runtime that caches compiled components in `cache_dir` (none: compile on every load).
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Self, PluginError> {
        let err = |msg: String| PluginError::Load {
            path: "(engine)".into(),
            msg,
        };
        let mut cfg = Config::new();
        cfg.epoch_interruption(true);
        cfg.consume_fuel(true);
        let engine = Engine::new(&cfg).map_err(|e| err(e.to_string()))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| err(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("thorn-plugins")
            .enable_time()
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
        Ok(PluginHost {
            engine,
            linker,
            cache_dir,
            runtime,
            manifest_validator,
            stop,
        })
    }

    /// Compiles `bytes`, or loads the native code compiled earlier for the same bytes and engine.
    fn component(&self, path: &Path, bytes: &[u8], sha: &str) -> Result<Component, PluginError> {
        let err = |msg: String| PluginError::Load {
            path: path.display().to_string(),
            msg,
        };
        let Some(dir) = &self.cache_dir else {
            return Component::new(&self.engine, bytes).map_err(|e| err(format!("{e:#}")));
        };
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut h);
        let file = dir.join(format!("{sha}-{:016x}.cwasm", h.finish()));
        if file.is_file() {
            match load_precompiled(&self.engine, &file) {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "recompiling a stale .cwasm")
                }
            }
        }
        let native = self
            .engine
            .precompile_component(bytes)
            .map_err(|e| err(format!("{e:#}")))?;
        std::fs::create_dir_all(dir).map_err(|e| err(format!("cache dir: {e}")))?;
        let tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| err(e.to_string()))?;
        std::fs::write(tmp.path(), &native).map_err(|e| err(e.to_string()))?;
        tmp.persist(&file).map_err(|e| err(e.to_string()))?;
        load_precompiled(&self.engine, &file).map_err(|e| err(format!("{e:#}")))
    }

    /// Loads a component, checks its manifest and prepares it for calls.
    pub fn load(&self, path: &Path, limits: Limits) -> Result<Plugin, PluginError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| PluginError::Load {
            path: shown.clone(),
            msg: e.to_string(),
        })?;
        let sha = hex(&Sha256::digest(&bytes));
        let component = self.component(path, &bytes, &sha)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::Load {
                path: shown.clone(),
                msg: format!("it needs imports the host does not provide: {e:#}"),
            })?;
        let mut plugin = Plugin {
            name: String::new(),
            sha256: sha,
            pre,
            limits,
            manifest: Manifest {
                name: String::new(),
                version: String::new(),
                description: String::new(),
                functions: Vec::new(),
                capabilities: Value::Null,
            },
            tools: ToolSet::default(),
            engine: self.engine.clone(),
            handle: self.runtime.handle().clone(),
        };
        let text = plugin.run(None, "").map_err(|e| PluginError::Manifest {
            path: shown.clone(),
            msg: format!("describe() failed: {e}"),
        })?;
        let manifest = self.manifest(&shown, &text)?;
        let defs: Vec<Value> = manifest
            .functions
            .iter()
            .map(|f| {
                serde_json::json!({"type": "function", "function": {"name": f.name,
                    "description": f.description, "parameters": f.parameters}})
            })
            .collect();
        plugin.tools = ToolSet::new(&defs).map_err(|e| PluginError::Manifest {
            path: shown.clone(),
            msg: e.to_string(),
        })?;
        plugin.name = manifest.name.clone();
        plugin.manifest = manifest;
        Ok(plugin)
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
        let functions = v["functions"]
            .as_array()
            .map(|fs| {
                fs.iter()
                    .map(|f| FunctionDef {
                        name: f["name"].as_str().unwrap_or("").to_owned(),
                        description: f["description"].as_str().unwrap_or("").to_owned(),
                        parameters: f["parameters"].clone(),
                        returns: f.get("returns").cloned(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Manifest {
            name: s("name"),
            version: s("version"),
            description: s("description"),
            functions,
            capabilities: v.get("capabilities").cloned().unwrap_or(Value::Null),
        })
    }
}

#[expect(
    unsafe_code,
    reason = "loading native code wasmtime compiled for this engine"
)]
fn load_precompiled(engine: &Engine, file: &Path) -> wasmtime::Result<Component> {
    // SAFETY: the file is in thorn's own cache directory, written (atomically, via rename) only by
    // `Engine::precompile_component` of an engine with the same compatibility hash, which is part of its name;
    // wasmtime additionally checks the header and rejects artifacts of another version or configuration.
    unsafe { Component::deserialize_file(engine, file) }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A loaded plugin.
pub struct Plugin {
    name: String,
    sha256: String,
    pre: InstancePre<State>,
    limits: Limits,
    manifest: Manifest,
    tools: ToolSet,
    engine: Engine,
    handle: tokio::runtime::Handle,
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
    /// Wall time of the call.
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

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Its functions as tools (for prompts, grammars and validation).
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// Calls `function` with `args` (validated against its schema first).
    pub fn call(&self, function: &str, args: &Value) -> Result<Value, PluginError> {
        self.call_reported(function, args).0
    }

    /// [`Plugin::call`], with the call's report (time, fuel, captured output) even when it fails.
    pub fn call_reported(
        &self,
        function: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        if self.tools.get(function).is_none() {
            let e = PluginError::UnknownFunction {
                plugin: self.name.clone(),
                function: function.to_owned(),
            };
            return (Err(e), CallReport::default());
        }
        let call = super::ParsedCall {
            name: function.to_owned(),
            arguments: args.clone(),
        };
        if let Err(e) = self.tools.check(&call) {
            return (Err(e.into()), CallReport::default());
        }
        let mut report = CallReport::default();
        let out = self
            .run_with(Some(function), &args.to_string(), &mut report)
            .and_then(|text| {
                serde_json::from_str(&text).map_err(|e| PluginError::Output {
                    plugin: self.name.clone(),
                    msg: format!("the result is not JSON: {e}"),
                })
            });
        (out, report)
    }

    fn run(&self, function: Option<&str>, args: &str) -> Result<String, PluginError> {
        self.run_with(function, args, &mut CallReport::default())
    }

    /// One fresh instance, one export call (`describe` when `function` is `None`).
    fn run_with(
        &self,
        function: Option<&str>,
        args: &str,
        report: &mut CallReport,
    ) -> Result<String, PluginError> {
        let lim = &self.limits;
        let stdout = MemoryOutputPipe::new(lim.stdio);
        let stderr = MemoryOutputPipe::new(lim.stdio);
        let wasi = WasiCtxBuilder::new()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .build();
        let limits = StoreLimitsBuilder::new()
            .memory_size(lim.memory)
            .memories(4)
            .instances(32)
            .tables(32)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(
            &self.engine,
            State {
                wasi,
                table: ResourceTable::new(),
                limits,
            },
        );
        store.limiter(|s| &mut s.limits);
        let fuel = lim.fuel.unwrap_or(u64::MAX);
        let _ = store.set_fuel(fuel);
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
        let t0 = Instant::now();
        let pre = self.pre.clone();
        let fname = function.map(str::to_owned);
        let args = args.to_owned();
        let fut = async move {
            let instance = pre.instantiate_async(&mut store).await?;
            let out: Result<String, String> = match fname {
                None => {
                    let f = instance.get_typed_func::<(), (String,)>(&mut store, "describe")?;
                    Ok(f.call_async(&mut store, ()).await?.0)
                }
                Some(name) => {
                    let f = instance
                        .get_typed_func::<(String, String), (Result<String, String>,)>(
                            &mut store, "call",
                        )?;
                    f.call_async(&mut store, (name, args)).await?.0
                }
            };
            let used = store.get_fuel().ok().map(|left| fuel - left);
            wasmtime::Result::Ok((out, used))
        };
        let res = self
            .handle
            .block_on(async { tokio::time::timeout(lim.timeout, fut).await });
        report.duration = t0.elapsed();
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
        let text = out.map_err(PluginError::Tool)?;
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
        let tail: String = {
            let t = stderr.trim();
            let start = t.len().saturating_sub(300);
            let start = (start..t.len())
                .find(|&i| t.is_char_boundary(i))
                .unwrap_or(t.len());
            t[start..].to_owned()
        };
        match e.downcast_ref::<Trap>() {
            Some(Trap::OutOfFuel) => PluginError::Fuel {
                plugin,
                fuel: self.limits.fuel.unwrap_or(u64::MAX),
            },
            Some(Trap::Interrupt) => PluginError::Timeout {
                plugin,
                after: self.limits.timeout,
            },
            Some(t) => PluginError::Trap {
                plugin,
                trap: t.to_string(),
                stderr: tail,
            },
            None => {
                let msg = format!("{e:#}");
                if msg.contains("forcing trap when growing memory") {
                    PluginError::MemoryLimit {
                        plugin,
                        limit: self.limits.memory,
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
