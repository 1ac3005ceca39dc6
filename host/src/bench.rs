//! `thorn bench engine`: the llama-bench measurements (pp, tg, tg at depth) on thorn's own engine.
//! `thorn bench grammar`: constrained tool calls over BFCL ([`grammar`]).
//! `thorn bench bfcl` and `thorn bench agentic`: BFCL accuracy and the MLPerf Edge Agentic replay against any
//! OpenAI-compatible endpoint ([`bfcl`], [`agentic`]), so thorn and its peers are measured by the same code.

pub mod agentic;
pub mod bfcl;
pub mod chart;
mod client;
pub mod grammar;

use anyhow::{Context, Result};
use std::path::Path;
use std::time::Duration;
use thorn::engine::{Engine, EngineConfig};
use thorn::model::llama::Stage;

/// Deterministic token ids spread over the vocabulary (llama-bench also feeds arbitrary tokens).
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = thorn::sample::Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn engine(
    path: &Path,
    pp: usize,
    tg: usize,
    depths: &[usize],
    reps: usize,
    threads: usize,
    json: bool,
) -> Result<()> {
    let max_depth = depths.iter().copied().max().unwrap_or(0);
    let context = (pp.max(max_depth + tg) + 16).next_multiple_of(256);
    let cfg = EngineConfig {
        threads,
        context,
        ..EngineConfig::default()
    };
    let mut e = Engine::load(path, &cfg).with_context(|| format!("loading {}", path.display()))?;
    let vocab = e.model().config().vocab;
    let reps = reps.max(1);

    // Warm-up: one short prefill and a few decode steps (page in weights, spin up the pool).
    e.reset();
    e.eval(&tokens(64, vocab, 1))?;
    for t in tokens(8, vocab, 2) {
        e.eval(&[t])?;
    }

    let mut pp_runs = Vec::new();
    for r in 0..reps {
        e.reset();
        let d = e.eval(&tokens(pp, vocab, 10 + r as u64))?;
        pp_runs.push(pp as f64 / d.as_secs_f64());
    }
    let mut rows = vec![(format!("pp{pp}"), median(pp_runs.clone()), pp_runs)];
    for &depth in std::iter::once(&0).chain(depths) {
        let mut runs = Vec::new();
        for r in 0..reps {
            e.reset();
            if depth > 0 {
                e.eval(&tokens(depth, vocab, 100 + r as u64))?;
            }
            let mut total = Duration::ZERO;
            for t in tokens(tg, vocab, 200 + r as u64) {
                total += e.eval(&[t])?;
            }
            runs.push(tg as f64 / total.as_secs_f64());
        }
        let name = if depth == 0 {
            format!("tg{tg}")
        } else {
            format!("tg{tg}@d{depth}")
        };
        rows.push((name, median(runs.clone()), runs));
    }

    // A profile of plain decode at depth 0: where a token's time goes.
    e.reset();
    e.set_profiling(true);
    let mut total = Duration::ZERO;
    for t in tokens(tg, vocab, 300) {
        total += e.eval(&[t])?;
    }
    let profile = e.profile().cloned().unwrap_or_default();
    e.set_profiling(false);
    let per_token_ms = total.as_secs_f64() * 1e3 / tg as f64;
    let stages: Vec<(String, f64)> = Stage::ALL
        .iter()
        .map(|s| {
            (
                format!("{s:?}"),
                profile.seconds[*s as usize] * 1e3 / tg as f64,
            )
        })
        .collect();

    let weights = e.model().weight_bytes();
    if json {
        let items: Vec<serde_json::Value> = rows
            .iter()
            .map(|(name, med, runs)| serde_json::json!({"test": name, "tok_per_s": med, "runs": runs}))
            .collect();
        let out = serde_json::json!({
            "model": path.display().to_string(),
            "threads": e.cpu().threads(),
            "isa": format!("{:?}", e.cpu().isa()),
            "weight_bytes_per_token": weights,
            "results": items,
            "decode_profile_ms_per_token": stages.iter().map(|(n, v)| (n.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("model   {}", path.display());
        println!(
            "threads {} ({:?}), weights read per decode step {:.1} MB",
            e.cpu().threads(),
            e.cpu().isa(),
            weights as f64 / 1e6
        );
        println!("{:<14} {:>10}   runs", "test", "tok/s");
        for (name, med, runs) in &rows {
            let r: Vec<String> = runs.iter().map(|v| format!("{v:.1}")).collect();
            println!("{name:<14} {med:>10.1}   {}", r.join(" "));
        }
        println!("decode profile at depth 0 ({per_token_ms:.2} ms/token, profiled run):");
        for (name, ms) in &stages {
            println!(
                "  {name:<12} {ms:>7.3} ms  {:>5.1}%",
                100.0 * ms / per_token_ms
            );
        }
    }
    Ok(())
}
