//! Plugin runtime costs: loading (cold compile vs the `.cwasm` cache), a fresh instance, a fresh instance
//! plus a trivial call (pooling vs on-demand allocation), their p50/p99, and calls per second with 200
//! concurrent callers (without and with the fsynced audit log); and what the agent's approval watch adds
//! to a host call.
//!
//! `cargo bench -p thorn-tests --bench plugins` (criterion groups, then the latency/throughput table).
//! `THORN_BENCH_QUICK=1` shortens everything (a smoke run).

use criterion::{Criterion, criterion_group};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thorn_plugin::{AuditLog, Caller, Grant, HostConfig, Limits, Plugin, PluginHost};
use thorn_tests::plugin_wasm;

fn quick() -> bool {
    std::env::var_os("THORN_BENCH_QUICK").is_some()
}

fn cache_dir() -> PathBuf {
    std::env::temp_dir().join(format!("thorn-bench-cwasm-{}", std::process::id()))
}

fn host(pool_slots: u32, cache: bool) -> PluginHost {
    PluginHost::with_config(HostConfig {
        cache_dir: cache.then(cache_dir),
        pool_slots,
        max_memory: 64 << 20,
    })
    .expect("plugin host")
}

fn calculator(h: &PluginHost) -> Plugin {
    h.load_with(&plugin_wasm("calculator"), Grant::none(Limits::default()))
        .expect("calculator loads")
}

fn args() -> serde_json::Value {
    json!({"expression": "1+2"})
}

fn loading(c: &mut Criterion) {
    let mut g = c.benchmark_group("plugin_load");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(if quick() { 2 } else { 10 }));
    let cold = host(0, false);
    g.bench_function("cold_compile_and_describe", |b| {
        b.iter(|| cold.open(&plugin_wasm("calculator")).expect("opens"))
    });
    let cached = host(0, true);
    cached
        .open(&plugin_wasm("calculator"))
        .expect("warms the cache");
    g.bench_function("cwasm_load_and_describe", |b| {
        b.iter(|| cached.open(&plugin_wasm("calculator")).expect("opens"))
    });
    g.finish();
}

fn calling(c: &mut Criterion) {
    let mut g = c.benchmark_group("plugin_call");
    if quick() {
        g.measurement_time(Duration::from_secs(1))
            .warm_up_time(Duration::from_millis(300));
    }
    for (name, slots) in [("pooling", 256), ("on_demand", 0)] {
        let h = host(slots, true);
        let p = calculator(&h);
        g.bench_function(format!("instantiate/{name}"), |b| {
            b.iter(|| p.ping().expect("instantiates"))
        });
        let a = args();
        g.bench_function(format!("instantiate_and_call/{name}"), |b| {
            b.iter(|| p.call("evaluate", &a).expect("calls"))
        });
    }
    // What the agent adds around a host call so that a wait for approval can be reported (its
    // `host_call`: the request's watch on the approvals queue, a select over the call, the watch and a
    // cancel check that is armed only while a call waits), around a call that is already done; and the
    // same call awaited bare, to subtract.
    let approvals = Arc::new(thorn_plugin::Approvals::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    g.bench_function("agent_wrapper/bare", |b| {
        b.iter(|| rt.block_on(async { std::hint::black_box(async { 1 }.await) }))
    });
    g.bench_function("agent_wrapper/approval_watch", |b| {
        b.iter(|| {
            rt.block_on(async {
                let mut watch = approvals.watch("req_bench");
                let call = async { 1 };
                tokio::pin!(call);
                let waiting = false;
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                loop {
                    tokio::select! {
                        v = &mut call => break std::hint::black_box(v),
                        Some(_) = watch.next() => {}
                        _ = tick.tick(), if waiting => {}
                    }
                }
            })
        })
    });
    g.finish();
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// p50/p99 of one operation over `n` sequential runs.
fn latencies(n: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..n / 10 {
        f();
    }
    let mut v: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    v.sort();
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

/// Calls per second with `callers` concurrent tasks on a 2-worker runtime, `total` calls in all.
fn throughput(p: Arc<Plugin>, callers: usize, total: usize) -> f64 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let per = total / callers;
    let t = Instant::now();
    rt.block_on(async {
        let tasks: Vec<_> = (0..callers)
            .map(|_| {
                let p = Arc::clone(&p);
                tokio::spawn(async move {
                    let a = args();
                    for _ in 0..per {
                        p.call_async(&Caller::default(), "evaluate", &a)
                            .await
                            .0
                            .expect("call succeeds");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
    });
    (per * callers) as f64 / t.elapsed().as_secs_f64()
}

fn report() {
    let n = if quick() { 300 } else { 5000 };
    let total = if quick() { 2000 } else { 40_000 };
    println!(
        "\nplugin latency and throughput (calculator, fresh instance per call; {n} runs each)"
    );
    println!("{:<34} {:>10} {:>10}", "operation", "p50 (us)", "p99 (us)");
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    for (name, slots) in [("pooling", 256), ("on-demand", 0)] {
        let h = host(slots, true);
        let p = calculator(&h);
        let (p50, p99) = latencies(n, || {
            p.ping().expect("instantiates");
        });
        println!(
            "{:<34} {:>10.1} {:>10.1}",
            format!("instantiate ({name})"),
            us(p50),
            us(p99)
        );
        let a = args();
        let (p50, p99) = latencies(n, || {
            p.call("evaluate", &a).expect("calls");
        });
        println!(
            "{:<34} {:>10.1} {:>10.1}",
            format!("instantiate + call ({name})"),
            us(p50),
            us(p99)
        );
    }
    let h = host(0, true);
    let (p50, p99) = latencies(if quick() { 5 } else { 30 }, || {
        h.open(&plugin_wasm("calculator")).expect("opens");
    });
    println!(
        "{:<34} {:>10.1} {:>10.1}",
        "load from .cwasm + describe",
        us(p50),
        us(p99)
    );
    println!("\n200 concurrent callers, 2 runtime workers, {total} calls:");
    for (name, slots) in [("pooling", 256), ("on-demand", 0)] {
        let h = host(slots, true);
        let p = Arc::new(calculator(&h));
        println!(
            "  {:<30} {:>10.0} calls/s",
            name,
            throughput(Arc::clone(&p), 200, total)
        );
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let log = Arc::new(AuditLog::open(&dir.path().join("audit.jsonl")).expect("audit log"));
    let h = host(256, true);
    let p = Arc::new(calculator(&h).with_audit(log));
    println!(
        "  {:<30} {:>10.0} calls/s",
        "pooling + audit log (fsync)",
        throughput(p, 200, total / 4)
    );
}

criterion_group!(benches, loading, calling);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    report();
    let _ = std::fs::remove_dir_all(cache_dir());
}
