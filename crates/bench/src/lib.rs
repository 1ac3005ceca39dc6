//! # thorn-bench
//!
//! thorn's benchmarks, as the `thorn bench ...` commands run them, and the BFCL data set with its AST
//! checker. This crate is tooling for the CLI (its functions report with `anyhow`, as binaries do); nothing on
//! the serving path depends on it.
//!
//! `thorn bench engine`: the llama-bench measurements (pp, tg, tg at depth) on thorn's own engine.
//! `thorn bench grammar`: constrained tool calls over BFCL ([`grammar`]).
//! `thorn bench spec`: speculative decoding on BFCL tool calls and trajectory turns ([`spec`]).
//! `thorn bench bfcl` and `thorn bench agentic`: BFCL accuracy and the MLPerf Edge Agentic replay against any
//! OpenAI-compatible endpoint ([`bfcl::run`], [`agentic`]), so thorn and its peers are measured by the same code.
//! `thorn bench tasks`: whether the agent uses the example plugins when it should, and only then ([`tasks`]).

pub mod agentic;
pub mod bfcl;
pub mod chart;
mod client;
pub mod grammar;
pub mod spec;
pub mod tasks;

pub use client::EndpointArgs;

use anyhow::{Context, Result};
use std::path::Path;
use std::time::Duration;
use thorn_engine::engine::{Engine, EngineConfig};
use thorn_engine::model::llama::Stage;

/// Deterministic token ids spread over the vocabulary (llama-bench also feeds arbitrary tokens).
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = thorn_engine::sample::Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What `thorn bench engine` measures (its flags; the device and threads are the engine's own options).
#[derive(clap::Args, Debug, Clone)]
pub struct EngineBench {
    /// Prompt tokens for the prefill measurement.
    #[arg(
        long = "prompt-tokens",
        value_name = "PROMPT_TOKENS",
        default_value_t = 512
    )]
    pub pp: usize,
    /// Tokens for each decode measurement.
    #[arg(long = "gen-tokens", value_name = "GEN_TOKENS", default_value_t = 128)]
    pub tg: usize,
    /// Context depths to measure prefill and decode at (besides 0).
    #[arg(long, value_delimiter = ',', default_value = "1024,3000")]
    pub depths: Vec<usize>,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// CUDA graphs on a GPU: a decode step's launches replayed as one graph.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub cuda_graphs: bool,
    /// Q4_1 weights packed for the GPU kernels' aligned loads (false: as the GGUF file lays them out).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub packed_weights: bool,
    /// Programmatic dependent launch on a GPU of sm_90 or later: each kernel may start while the one
    /// before it finishes.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub pdl: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// KV cache element types to measure, one table each (f16, f32, fp8).
    #[arg(
        long = "kv-dtype",
        value_name = "KV_DTYPE",
        value_delimiter = ',',
        default_value = "f16"
    )]
    pub kv_dtypes: Vec<thorn_engine::kv::KvDtype>,
    /// Positions per KV page.
    #[arg(long, default_value_t = thorn_engine::kv::KvConfig::PAGE_SIZE)]
    pub page_size: usize,
    /// Also decode this many sequences at once (continuous batching), e.g. 4,8: aggregate tok/s.
    #[arg(long = "batch", value_name = "BATCH", value_delimiter = ',')]
    pub batches: Vec<usize>,
    /// Prompt tokens of each batched sequence: the depth its decode starts at (all prompts are prefilled
    /// in one step before the decode is timed).
    #[arg(long = "batch-depth", value_name = "TOKENS", default_value_t = 32)]
    pub batch_depth: usize,
    /// On a GPU: time every kernel of the decode steps at depth 0 and at the deepest depth (graphs off,
    /// an event pair around each launch) and print the time per kernel name.
    #[arg(long)]
    pub kernel_times: bool,
}

/// One row of `--kernel-times`: a kernel's launches and time per decode step.
struct KernelRow {
    name: &'static str,
    launches: f64,
    us: f64,
}

/// `--kernel-times` at one depth: microseconds per step in all, and per kernel, slowest first.
fn kernel_times(e: &mut Engine, depth: usize, steps: usize) -> Result<(f64, Vec<KernelRow>)> {
    let vocab = e.model().vocab();
    e.reset();
    let mut s = e.session();
    if depth > 0 {
        s.eval(&tokens(depth, vocab, 600))?;
    }
    let dev = s.engine().device();
    // From here on (the depth's prefill is not timed): the decode steps.
    dev.time_kernels(true).context("--kernel-times")?;
    for t in tokens(steps, vocab, 700) {
        s.eval(&[t])?;
    }
    let dev = s.engine().device();
    let t = dev.kernel_times()?;
    dev.time_kernels(false)?;
    let n = steps as f64;
    let mut rows: Vec<KernelRow> = t
        .kernels
        .iter()
        .map(|(&name, &(launches, secs))| KernelRow {
            name,
            launches: launches as f64 / n,
            us: secs * 1e6 / n,
        })
        .collect();
    rows.sort_by(|a, b| b.us.total_cmp(&a.us));
    Ok((t.total() * 1e6 / n, rows))
}

/// `thorn bench engine`: prefill and decode speed, llama-bench style, once per KV element type, on the
/// device, threads and kernel cache of `base` (the rest of the configuration is the benchmark's).
pub fn engine(path: &Path, b: &EngineBench, base: &EngineConfig) -> Result<()> {
    let (pp, tg, reps) = (b.pp, b.tg, b.reps.max(1));
    let max_depth = b.depths.iter().copied().max().unwrap_or(0);
    // A context for the deepest sequence; the KV pool holds 4 of them: enough for every batched sequence.
    let (batch_seq, batch_max) = (b.batch_depth.max(1) + tg + 16, b.batches.iter().max());
    let context = ((max_depth + pp.max(tg)) + 16)
        .max(batch_max.map_or(0, |&n| batch_seq.max((n * batch_seq).div_ceil(4))))
        .next_multiple_of(256);
    let mut rows: Vec<(String, &'static str, f64, Vec<f64>)> = Vec::new();
    let mut profiled = None;
    for &dtype in &b.kv_dtypes {
        let cfg = EngineConfig {
            cuda_graphs: b.cuda_graphs,
            packed_weights: b.packed_weights,
            pdl: b.pdl,
            context,
            kv_dtype: dtype,
            page_size: b.page_size,
            ..base.clone()
        };
        let mut e =
            Engine::load(path, &cfg).with_context(|| format!("loading {}", path.display()))?;
        if b.kernel_times && e.device().graph_stats().is_none() {
            anyhow::bail!("--kernel-times times a GPU's kernels: run it with --device cuda");
        }
        let vocab = e.model().vocab();
        let kv = dtype.name();

        // Warm-up: one short prefill and a few decode steps (page in weights, spin up the pool).
        e.reset();
        let mut s = e.session();
        s.eval(&tokens(64, vocab, 1))?;
        for t in tokens(8, vocab, 2) {
            s.eval(&[t])?;
        }
        drop(s);

        let mut pp_runs = Vec::new();
        for r in 0..reps {
            e.reset();
            let d = e.session().eval(&tokens(pp, vocab, 10 + r as u64))?;
            pp_runs.push(pp as f64 / d.as_secs_f64());
        }
        rows.push((format!("pp{pp}"), kv, median(pp_runs.clone()), pp_runs));
        // Prefill at depth (llama-bench's `-p N -d D`): `pp` new tokens after `depth` of context, the shape
        // of an agent's later turns. Only the new tokens are timed.
        for &depth in b.depths.iter().filter(|&&d| d > 0) {
            let mut runs = Vec::new();
            for r in 0..reps {
                e.reset();
                let mut s = e.session();
                s.eval(&tokens(depth, vocab, 100 + r as u64))?;
                let d = s.eval(&tokens(pp, vocab, 10 + r as u64))?;
                runs.push(pp as f64 / d.as_secs_f64());
            }
            rows.push((format!("pp{pp}@d{depth}"), kv, median(runs.clone()), runs));
        }
        for &depth in std::iter::once(&0).chain(b.depths.iter().filter(|&&d| d > 0)) {
            let mut runs = Vec::new();
            for r in 0..reps {
                e.reset();
                let mut s = e.session();
                if depth > 0 {
                    s.eval(&tokens(depth, vocab, 100 + r as u64))?;
                }
                let mut total = Duration::ZERO;
                for t in tokens(tg, vocab, 200 + r as u64) {
                    total += s.eval(&[t])?;
                }
                runs.push(tg as f64 / total.as_secs_f64());
            }
            let name = if depth == 0 {
                format!("tg{tg}")
            } else {
                format!("tg{tg}@d{depth}")
            };
            rows.push((name, kv, median(runs.clone()), runs));
        }
        // Batched decode: B sequences with distinct prompts of `batch_depth` tokens decode together on the
        // scheduler; the aggregate rate counts every sequence's tokens over the slowest one's decode time.
        let depth = b.batch_depth.max(1);
        for &batch in &b.batches {
            let mut runs = Vec::new();
            for r in 0..reps {
                e.reset();
                let reqs = (0..batch)
                    .map(|i| {
                        let mut req = thorn_engine::engine::Request::greedy(
                            tokens(depth, vocab, 1000 + (r * batch + i) as u64),
                            tg,
                        );
                        req.ignore_eos = true;
                        (req, None)
                    })
                    .collect();
                // Every prompt in the first step, so that no decode step carries a prompt chunk.
                let cfg = thorn_engine::engine::scheduler::SchedulerConfig {
                    max_batch: batch,
                    step_tokens: depth.max(32) * batch,
                };
                let (outs, _) = e.generate_batch(reqs, cfg);
                let mut generated = 0usize;
                let mut slowest = Duration::ZERO;
                for (_, g) in outs {
                    let g = g?;
                    generated += g.stats.generated.saturating_sub(1);
                    slowest = slowest.max(g.stats.decode);
                }
                runs.push(generated as f64 / slowest.as_secs_f64().max(1e-9));
            }
            let name = if b.batch_depth == 32 {
                format!("tg{tg} x{batch}")
            } else {
                format!("tg{tg} x{batch}@d{depth}")
            };
            rows.push((name, kv, median(runs.clone()), runs));
        }
        if profiled.is_none() {
            profiled = Some(e);
        }
    }
    let Some(mut e) = profiled else {
        anyhow::bail!("no KV type to measure");
    };

    // Profiles of plain decode at depth 0 and at the deepest depth: where a token's time goes.
    let vocab = e.model().vocab();
    let mut decode_profile =
        |depth: usize| -> Result<(Duration, thorn_engine::model::layers::Profile)> {
            e.reset();
            e.set_profiling(true);
            let mut s = e.session();
            if depth > 0 {
                s.eval(&tokens(depth, vocab, 500))?;
            }
            // Only the decode steps count: the depth's prefill is taken off.
            let before = s.engine().profile().cloned().unwrap_or_default();
            let mut total = Duration::ZERO;
            for t in tokens(tg, vocab, 300) {
                total += s.eval(&[t])?;
            }
            let mut profile = s.engine().profile().cloned().unwrap_or_default();
            drop(s);
            e.set_profiling(false);
            for (a, b) in profile.seconds.iter_mut().zip(before.seconds) {
                *a -= b;
            }
            Ok((total, profile))
        };
    let (total, profile) = decode_profile(0)?;
    let deep = if max_depth > 0 {
        Some((max_depth, decode_profile(max_depth)?))
    } else {
        None
    };
    // A GPU's launches per decode step, how many of them ran inside graphs, and the share of steps
    // replayed whole from a step plan (their ops not run on the host).
    let launches = match e.device().graph_stats() {
        Some(b) => {
            let mut s = e.session();
            for t in tokens(8, vocab, 400) {
                s.eval(&[t])?;
            }
            drop(s);
            let a = e.device().graph_stats().unwrap_or(b);
            let graphs = (a.graph_kernels - b.graph_kernels) as f64 / 8.0;
            let single = (a.kernels - b.kernels) as f64 / 8.0;
            let planned = (a.steps - b.steps) as f64 / 8.0;
            Some((
                graphs + single,
                graphs / (graphs + single).max(1.0),
                planned,
            ))
        }
        None => None,
    };
    let kernels = if b.kernel_times {
        let mut at = vec![(0, kernel_times(&mut e, 0, tg)?)];
        if max_depth > 0 {
            at.push((max_depth, kernel_times(&mut e, max_depth, tg)?));
        }
        e.device().set_graphs(b.cuda_graphs);
        at
    } else {
        Vec::new()
    };
    let per_token_ms = total.as_secs_f64() * 1e3 / tg as f64;
    // The stages are timed on the host: a GPU's ops only queue there, so its profile would be the time
    // to queue, not to run; it has none.
    let profiled_stages = if launches.is_some() {
        &[][..]
    } else {
        &Stage::ALL[..]
    };
    let stages_of = |profile: &thorn_engine::model::layers::Profile| -> Vec<(String, f64)> {
        profiled_stages
            .iter()
            .map(|s| {
                (
                    format!("{s:?}"),
                    profile.seconds[*s as usize] * 1e3 / tg as f64,
                )
            })
            .collect()
    };
    let stages = stages_of(&profile);
    let deep = deep.map(|(depth, (total, profile))| {
        (
            depth,
            total.as_secs_f64() * 1e3 / tg as f64,
            stages_of(&profile),
        )
    });

    let weights = e.model().weight_bytes();
    if b.json {
        let items: Vec<serde_json::Value> = rows
            .iter()
            .map(|(name, kv, med, runs)| serde_json::json!({"test": name, "kv": kv, "tok_per_s": med, "runs": runs}))
            .collect();
        let out = serde_json::json!({
            "model": path.display().to_string(),
            "threads": e.device().threads(),
            "isa": e.device().name(),
            "page_size": b.page_size,
            "weight_bytes_per_token": weights,
            "results": items,
            "kernels_per_decode_step": launches.map(|l| l.0),
            "graph_share_of_kernels": launches.map(|l| l.1),
            "plan_share_of_steps": launches.map(|l| l.2),
            "decode_profile_ms_per_token": stages.iter().map(|(n, v)| (n.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
            "kernel_times": kernels.iter().map(|(depth, (us, rows))| serde_json::json!({
                "depth": depth,
                "us_per_step": us,
                "kernels": rows.iter().map(|r| serde_json::json!({
                    "name": r.name, "launches_per_step": r.launches, "us_per_step": r.us,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "decode_profile_at_depth": deep.as_ref().map(|(depth, ms, st)| serde_json::json!({
                "depth": depth,
                "ms_per_token": ms,
                "stages_ms_per_token": st.iter().map(|(n, v)| (n.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
            })),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("model   {}", path.display());
        println!(
            "threads {} ({}), weights read per decode step {:.1} MB, KV pages of {}",
            e.device().threads(),
            e.device().name(),
            weights as f64 / 1e6,
            b.page_size
        );
        println!("{:<14} {:>4} {:>10}   runs", "test", "kv", "tok/s");
        for (name, kv, med, runs) in &rows {
            let r: Vec<String> = runs.iter().map(|v| format!("{v:.1}")).collect();
            println!("{name:<14} {kv:>4} {med:>10.1}   {}", r.join(" "));
        }
        if let Some((per_step, share, planned)) = launches {
            println!(
                "kernels per decode step {per_step:.0}, {:.0}% of them in CUDA graphs, {:.0}% of the steps \
                 replayed from a step plan",
                100.0 * share,
                100.0 * planned
            );
        }
        for (depth, (us, rows)) in &kernels {
            let launches: f64 = rows.iter().map(|r| r.launches).sum();
            println!(
                "kernel times per decode step at depth {depth} (graphs off, events around each \
                 launch): {us:.1} us in {launches:.0} launches"
            );
            println!(
                "  {:<28} {:>9} {:>10} {:>10} {:>6}",
                "kernel", "launches", "us/step", "us/launch", "share"
            );
            for r in rows {
                println!(
                    "  {:<28} {:>9.1} {:>10.1} {:>10.2} {:>5.1}%",
                    r.name,
                    r.launches,
                    r.us,
                    r.us / r.launches.max(1e-9),
                    100.0 * r.us / us.max(1e-9)
                );
            }
        }
        println!("decode at depth 0: {per_token_ms:.3} ms/token (profiled run)");
        if !stages.is_empty() {
            println!("decode profile at depth 0:");
        }
        for (name, ms) in &stages {
            println!(
                "  {name:<12} {ms:>7.3} ms  {:>5.1}%",
                100.0 * ms / per_token_ms
            );
        }
        if let Some((depth, per_token_ms, stages)) = &deep {
            println!("decode at depth {depth}: {per_token_ms:.3} ms/token (profiled run)");
            if !stages.is_empty() {
                println!("decode profile at depth {depth}:");
            }
            for (name, ms) in stages {
                println!(
                    "  {name:<12} {ms:>7.3} ms  {:>5.1}%",
                    100.0 * ms / per_token_ms
                );
            }
        }
    }
    Ok(())
}
