//! Server metrics in the Prometheus text format (`GET /metrics`): requests by endpoint and status, tokens,
//! prompt tokens served from the cache, time to first token and time per output token histograms, queue
//! depth, cancellations, plugin calls and failures, and the engine's wall time by phase.

use crate::histogram::Histogram;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Histogram bucket upper bounds, in seconds.
const TTFT_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TPOT_BUCKETS: [f64; 10] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0,
];

/// The engine's side of the metrics, read once per scrape.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineGauges {
    /// Requests waiting.
    pub queue_depth: usize,
    /// Sequences generating.
    pub running: usize,
    /// Scheduler counters.
    pub scheduler: thorn_engine::engine::scheduler::SchedulerStats,
    /// KV cache counters.
    pub kv: thorn_engine::kv::KvStats,
    /// Speculation counters.
    pub spec: thorn_engine::spec::SpecStats,
}

impl EngineGauges {
    /// Reads them from the engine service.
    pub fn of(e: &thorn_engine::engine::service::EngineService) -> Self {
        let (scheduler, kv, spec) = e.stats();
        EngineGauges {
            queue_depth: e.waiting(),
            running: e.running(),
            scheduler,
            kv,
            spec,
        }
    }
}

/// The server's counters.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    plugin_calls: Mutex<BTreeMap<(String, String), u64>>,
    routed: Mutex<BTreeMap<(String, &'static str), u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cancelled: AtomicU64,
    ttft: Histogram,
    tpot: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            plugin_calls: Mutex::default(),
            routed: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            ttft: Histogram::new(&TTFT_BUCKETS),
            tpot: Histogram::new(&TPOT_BUCKETS),
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// A request served upstream, and why it went there (`model`: it named the upstream's model;
    /// `context`, `queue`: a local-first request the local engine could not take).
    pub fn routed(&self, upstream: &str, reason: &'static str) {
        let mut m = self.routed.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((upstream.to_owned(), reason)).or_default() += 1;
    }

    /// A request to `endpoint` answered with `status`.
    pub fn request(&self, endpoint: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((endpoint.to_owned(), status)).or_default() += 1;
    }

    /// Tokens of one finished request.
    pub fn tokens(&self, usage: &crate::agent::Usage) {
        self.prompt_tokens
            .fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(usage.cached_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(usage.completion_tokens as u64, Ordering::Relaxed);
    }

    /// Time to first token.
    pub fn ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    /// Time per output token after the first.
    pub fn tpot(&self, seconds: f64) {
        self.tpot.observe(seconds);
    }

    /// A request cancelled by its client.
    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// How many requests were cancelled.
    pub fn cancelled_count(&self) -> u64 {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// A plugin call and its outcome (`ok` or an error kind).
    pub fn plugin_call(&self, tool: &str, outcome: &str) {
        let mut m = self.plugin_calls.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((tool.to_owned(), outcome.to_owned())).or_default() += 1;
    }

    /// The Prometheus text, with the engine's gauges and counters.
    pub fn render(&self, engine: &EngineGauges) -> String {
        let (queue_depth, busy) = (engine.queue_depth, engine.running > 0);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP thorn_requests_total HTTP requests by endpoint and status.\n# TYPE thorn_requests_total counter"
        );
        for ((e, s), n) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "thorn_requests_total{{endpoint=\"{}\",status=\"{s}\"}} {n}",
                escape(e)
            );
        }
        for (name, help, v) in [
            (
                "thorn_prompt_tokens_total",
                "Prompt tokens processed (all agent rounds).",
                &self.prompt_tokens,
            ),
            (
                "thorn_cached_prompt_tokens_total",
                "Prompt tokens served from the KV cache.",
                &self.cached_tokens,
            ),
            (
                "thorn_completion_tokens_total",
                "Tokens generated.",
                &self.completion_tokens,
            ),
            (
                "thorn_cancelled_requests_total",
                "Requests whose client went away before the end.",
                &self.cancelled,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        self.ttft.render(
            "thorn_time_to_first_token_seconds",
            "Time from request to its first generated token (text or tool call).",
            &mut out,
        );
        self.tpot.render(
            "thorn_time_per_output_token_seconds",
            "Decode time per generated token after the first.",
            &mut out,
        );
        let _ = writeln!(
            out,
            "# HELP thorn_queue_depth Requests waiting for the engine.\n# TYPE thorn_queue_depth gauge\nthorn_queue_depth {queue_depth}"
        );
        let _ = writeln!(
            out,
            "# HELP thorn_engine_busy Whether the engine is generating.\n# TYPE thorn_engine_busy gauge\nthorn_engine_busy {}",
            u8::from(busy)
        );
        let (sched, kv) = (&engine.scheduler, &engine.kv);
        let _ = writeln!(
            out,
            "# HELP thorn_engine_seconds_total Wall time of the engine's steps by phase: forward passes over \
             prompt tokens (prefill) and over generated ones (decode, forced runs, draft-tree verification), \
             choosing tokens (sampling, grammar, detokenizing), and planning (admission, drafting trees).\n\
             # TYPE thorn_engine_seconds_total counter"
        );
        let t = sched.time;
        for (phase, ns) in [
            ("prefill", t.prefill),
            ("decode", t.decode),
            ("sample", t.sample),
            ("plan", t.plan),
        ] {
            let _ = writeln!(
                out,
                "thorn_engine_seconds_total{{phase=\"{phase}\"}} {}",
                ns as f64 / 1e9
            );
        }
        for (name, kind, help, v) in [
            (
                "thorn_running_sequences",
                "gauge",
                "Sequences in the batch.",
                engine.running as u64,
            ),
            (
                "thorn_batch_steps_total",
                "counter",
                "Batched forward passes.",
                sched.steps,
            ),
            (
                "thorn_batch_sequences_total",
                "counter",
                "Sequences those passes carried, summed (mean batch = this / steps).",
                sched.batched_sequences,
            ),
            (
                "thorn_preemptions_total",
                "counter",
                "Sequences preempted because KV memory ran short.",
                sched.preemptions,
            ),
            (
                "thorn_kv_pages",
                "gauge",
                "KV cache pages in the pool.",
                kv.pages_total as u64,
            ),
            (
                "thorn_kv_pages_used",
                "gauge",
                "KV cache pages in use (running sequences and cached prefixes).",
                kv.pages_used as u64,
            ),
            (
                "thorn_kv_pages_cached",
                "gauge",
                "KV cache pages held by the prefix tree.",
                kv.pages_cached as u64,
            ),
            (
                "thorn_kv_page_bytes",
                "gauge",
                "Bytes per KV page.",
                kv.page_bytes as u64,
            ),
            (
                "thorn_kv_hit_tokens_total",
                "counter",
                "Prompt tokens served from the prefix cache.",
                kv.hit_tokens,
            ),
            (
                "thorn_kv_computed_tokens_total",
                "counter",
                "Tokens run through the model (prefill and decode).",
                kv.computed_tokens,
            ),
            (
                "thorn_kv_evicted_pages_total",
                "counter",
                "KV pages freed by evicting cached prefixes.",
                kv.evicted_pages,
            ),
            (
                "thorn_kv_evicted_nodes_total",
                "counter",
                "Prefix-tree nodes evicted.",
                kv.evicted_nodes,
            ),
            (
                "thorn_kv_snapshots",
                "gauge",
                "Recurrent-state snapshots held by the prefix cache (hybrid models).",
                kv.snapshots.held as u64,
            ),
            (
                "thorn_kv_snapshot_bytes",
                "gauge",
                "Bytes those snapshots take (of a budget of thorn_kv_snapshot_budget_bytes).",
                kv.snapshots.bytes as u64,
            ),
            (
                "thorn_kv_snapshot_budget_bytes",
                "gauge",
                "Bytes of the KV memory set aside for recurrent-state snapshots.",
                kv.snapshots.budget as u64,
            ),
            (
                "thorn_kv_snapshots_restored_total",
                "counter",
                "Sequences that resumed from a recurrent-state snapshot.",
                kv.snapshots.restored,
            ),
            (
                "thorn_kv_snapshots_evicted_total",
                "counter",
                "Recurrent-state snapshots evicted for room.",
                kv.snapshots.evicted,
            ),
            (
                "thorn_spec_trees_total",
                "counter",
                "Draft trees verified (speculative decoding).",
                engine.spec.trees,
            ),
            (
                "thorn_spec_drafted_tokens_total",
                "counter",
                "Draft-tree tokens run through the model (drafted and grammar-forced).",
                engine.spec.drafted,
            ),
            (
                "thorn_spec_accepted_tokens_total",
                "counter",
                "Draft-tree tokens the model agreed with (acceptance = accepted / drafted).",
                engine.spec.accepted,
            ),
            (
                "thorn_decode_passes_total",
                "counter",
                "Forward passes that produced tokens, per finished request (tokens per pass = \
                 thorn_decode_tokens_total / this).",
                engine.spec.passes,
            ),
            (
                "thorn_decode_tokens_total",
                "counter",
                "Tokens generated by finished requests.",
                engine.spec.tokens,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP thorn_plugin_calls_total Host tool (plugin) calls by tool and outcome.\n# TYPE thorn_plugin_calls_total counter"
        );
        let calls = self.plugin_calls.lock().unwrap_or_else(|p| p.into_inner());
        for ((t, o), n) in calls.iter() {
            let _ = writeln!(
                out,
                "thorn_plugin_calls_total{{tool=\"{}\",outcome=\"{}\"}} {n}",
                escape(t),
                escape(o)
            );
        }
        let failures: u64 = calls
            .iter()
            .filter(|((_, o), _)| o != "ok")
            .map(|(_, n)| n)
            .sum();
        let _ = writeln!(
            out,
            "# HELP thorn_plugin_failures_total Host tool calls that failed.\n# TYPE thorn_plugin_failures_total counter\nthorn_plugin_failures_total {failures}"
        );
        let _ = writeln!(
            out,
            "# HELP thorn_routed_total Requests served by an upstream, by why they went there (model: they named its model; context, queue: local-first overflow).\n# TYPE thorn_routed_total counter"
        );
        for ((u, why), n) in self.routed.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(
                out,
                "thorn_routed_total{{upstream=\"{}\",reason=\"{why}\"}} {n}",
                escape(u)
            );
        }
        out
    }
}

/// Which of an upstream's histograms.
type PickHistogram = fn(&crate::upstream::UpstreamStats) -> &Histogram;

/// One sample line per upstream under one `HELP`/`TYPE` header: `value` gives it (`None`: no line).
fn per_upstream(
    out: &mut String,
    upstreams: &crate::upstream::Upstreams,
    name: &str,
    kind: &str,
    help: &str,
    value: impl Fn(&crate::upstream::Upstream) -> Option<String>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for u in upstreams.iter() {
        if let Some(v) = value(u) {
            let _ = writeln!(out, "{name}{{upstream=\"{}\"}} {v}", escape(u.name()));
        }
    }
}

/// Each upstream's counters: rounds by outcome, latency to the response's start and of whole rounds,
/// requests in flight, the circuit and the last health check.
pub fn render_upstreams(upstreams: &crate::upstream::Upstreams, out: &mut String) {
    if upstreams.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "# HELP thorn_upstream_requests_total Generation rounds sent to an upstream, by outcome.\n# TYPE thorn_upstream_requests_total counter"
    );
    for u in upstreams.iter() {
        for (outcome, n) in u.stats().outcomes() {
            let _ = writeln!(
                out,
                "thorn_upstream_requests_total{{upstream=\"{}\",outcome=\"{outcome}\"}} {n}",
                escape(u.name())
            );
        }
    }
    per_upstream(
        out,
        upstreams,
        "thorn_upstream_errors_total",
        "counter",
        "Rounds that failed at an upstream (any outcome but ok and cancelled).",
        |u| {
            let outcomes = u.stats().outcomes();
            let errors = outcomes
                .iter()
                .filter(|(o, _)| !matches!(**o, "ok" | "cancelled"))
                .map(|(_, n)| n);
            Some(errors.sum::<u64>().to_string())
        },
    );
    let histograms: [(&str, &str, PickHistogram); 2] = [
        (
            "thorn_upstream_first_byte_seconds",
            "Time until an upstream's response started.",
            |s| &s.first_byte,
        ),
        (
            "thorn_upstream_round_seconds",
            "Time of a whole generation round at an upstream.",
            |s| &s.latency,
        ),
    ];
    for (name, help, pick) in histograms {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for u in upstreams.iter() {
            pick(u.stats()).rows(name, &format!("upstream=\"{}\",", escape(u.name())), out);
        }
    }
    per_upstream(
        out,
        upstreams,
        "thorn_upstream_in_flight",
        "gauge",
        "Requests an upstream is serving.",
        |u| Some(u.stats().in_flight.load(Ordering::Relaxed).to_string()),
    );
    per_upstream(
        out,
        upstreams,
        "thorn_upstream_circuit_open",
        "gauge",
        "Whether an upstream's circuit is open (1) or half open (0.5).",
        |u| {
            let v = match u.circuit() {
                "open" => "1",
                "half_open" => "0.5",
                _ => "0",
            };
            Some(v.to_owned())
        },
    );
    per_upstream(
        out,
        upstreams,
        "thorn_upstream_up",
        "gauge",
        "Whether an upstream's last health check answered.",
        |u| u.health().up.map(|up| u8::from(up).to_string()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 400);
        m.ttft(0.03);
        m.tpot(0.009);
        m.plugin_call("evaluate", "ok");
        m.plugin_call("spin", "timeout");
        m.tokens(&crate::agent::Usage {
            prompt_tokens: 10,
            cached_tokens: 4,
            completion_tokens: 3,
        });
        let t = m.render(&EngineGauges {
            queue_depth: 2,
            running: 1,
            spec: thorn_engine::spec::SpecStats {
                trees: 3,
                drafted: 10,
                accepted: 7,
                passes: 5,
                tokens: 12,
                ..thorn_engine::spec::SpecStats::default()
            },
            ..EngineGauges::default()
        });
        assert!(
            t.contains("thorn_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2")
        );
        assert!(t.contains("thorn_time_to_first_token_seconds_bucket{le=\"0.05\"} 1"));
        assert!(t.contains("thorn_time_to_first_token_seconds_bucket{le=\"0.025\"} 0"));
        assert!(t.contains("thorn_time_to_first_token_seconds_count 1"));
        assert!(t.contains("thorn_cached_prompt_tokens_total 4"));
        assert!(t.contains("thorn_queue_depth 2"));
        assert!(t.contains("thorn_plugin_failures_total 1"));
        assert!(t.contains("thorn_engine_busy 1"));
        assert!(
            t.contains("# TYPE thorn_kv_hit_tokens_total counter\nthorn_kv_hit_tokens_total 0")
        );
        assert!(t.contains("thorn_spec_accepted_tokens_total 7"));
        assert!(t.contains("thorn_spec_drafted_tokens_total 10"));
        assert!(t.contains("thorn_decode_passes_total 5\n"));
    }
}
