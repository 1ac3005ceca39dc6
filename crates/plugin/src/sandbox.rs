//! The sandbox every call runs in: the wasmtime engine (epoch interruption, fuel, the pooling allocator),
//! the guest interface generated from the `tool` WIT world, the per-call store holding exactly a grant, and
//! the translation of what went wrong in it into a [`PluginError`].

use crate::{Grant, HostConfig, Limits, MemoryCap, NetRule, PluginError, PolicyError, limiter};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use wasmtime::component::{ResourceTable, ResourceTableError};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap,
    UpdateDeadline,
};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::sockets::SocketAddrUse;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// The guest interface, generated from `plugins/sdk/wit/tool.wit` (world `tool`): a changed world changes
/// these types, and every use of them has to follow.
mod bindings {
    wasmtime::component::bindgen!({
        path: "../../plugins/sdk/wit",
        world: "tool",
        exports: { default: async },
    });
}

pub(crate) use bindings::ToolPre;

/// How often the epoch ticker advances.
const TICK: Duration = Duration::from_millis(10);

/// Per-call state of a store.
pub(crate) struct State {
    pub(crate) wasi: WasiCtx,
    pub(crate) table: ResourceTable,
    limits: limiter::Budget,
    /// The host names the guest may look up (see `linker`).
    pub(crate) lookup_names: Arc<[String]>,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Calls in flight at once when the on-demand allocator is used.
pub(crate) const ON_DEMAND_SLOTS: usize = 1024;

/// What must live as long as any plugin: the epoch ticker (a guest only yields, and is only interrupted,
/// while epochs advance) and the runtime synchronous calls run on. Every [`Plugin`](crate::Plugin) holds it, so
/// dropping the [`PluginHost`](crate::PluginHost) first is harmless.
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

impl Shared {
    /// Starts the thread that advances `engine`'s epoch every tick, and keeps `runtime`; both stop when
    /// the last holder drops it.
    pub(crate) fn start(
        engine: &Engine,
        runtime: tokio::runtime::Runtime,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (e2, s2) = (engine.clone(), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("thorn-epoch".into())
            .spawn(move || {
                while !s2.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    e2.increment_epoch();
                }
            })?;
        Ok(Shared {
            runtime: Some(runtime),
            stop,
        })
    }
}

/// Runs `fut` to completion on `handle`'s runtime from synchronous code, from a thread of its own when
/// the caller is itself inside a tokio runtime (where blocking in place is not allowed).
pub(crate) fn block_on<F: std::future::Future + Send>(
    handle: &tokio::runtime::Handle,
    fut: F,
) -> F::Output
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

/// The engine every plugin runs in (Cranelift, epoch interruption, fuel), with the pooling allocator when
/// `config` asks for slots and the address space allows them (the flag says whether it is in use), else
/// with on-demand allocation.
pub(crate) fn engine(config: &HostConfig) -> wasmtime::Result<(Engine, bool)> {
    let mut cfg = Config::new();
    cfg.epoch_interruption(true);
    cfg.consume_fuel(true);
    let mut pooled = None;
    if config.pool_slots > 0 {
        let mut c = cfg.clone();
        c.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling_config(config)));
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
        None => Engine::new(&cfg)?,
    };
    Ok((engine, pooling))
}

/// A fresh store holding exactly the grant, and its captured stdout and stderr.
pub(crate) fn store(
    engine: &Engine,
    plugin: &str,
    grant: &Grant,
    lookup_names: &Arc<[String]>,
) -> Result<(Store<State>, MemoryOutputPipe, MemoryOutputPipe), PluginError> {
    let g = grant;
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
                plugin: plugin.to_owned(),
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
        b.allow_ip_name_lookup(!lookup_names.is_empty());
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
        engine,
        State {
            wasi: b.build(),
            table,
            limits: limiter::Budget::new(lim.memory),
            lookup_names: Arc::clone(lookup_names),
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

/// Turns a wasmtime error into the error a user can act on.
pub(crate) fn classify(
    e: wasmtime::Error,
    plugin: &str,
    lim: &Limits,
    stderr: &str,
) -> PluginError {
    let plugin = plugin.to_owned();
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
