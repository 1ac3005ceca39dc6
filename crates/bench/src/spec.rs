//! `thorn bench spec`: speculative decoding on tool calls and agent turns.
//!
//! Two workloads, each generated greedily five ways on the same engine, in rotating order per prompt:
//!
//! * **off**: no drafting (grammar fast-forward still commits forced tokens, as always);
//! * **chain3**: a linear chain of at most 3 drafted tokens (top-1 per depth), the reference's baseline;
//! * **tree**: the draft tree (top-k per depth, depth and node budgets from the options);
//! * **chain3-full**, **tree-full**: the same two at their whole budget whatever verification costs: a
//!   compute-bound CPU runs them slower, but their tokens per forward pass are what a backend with nearly
//!   free verification (a GPU) would get.
//!
//! Workloads: BFCL questions answered with `tool_choice: required` (tool-call generations), and the replay
//! set's assistant turns (the model writes each turn after the recorded history, `tool_choice: auto`).
//! Each mode keeps its own speculator (store of earlier outputs, calibration), so no mode drafts from
//! another mode's answer to the same prompt; the cost model is measured once and shared. Prompts are
//! prefilled by the first mode and served from the prefix cache for the others; only decoding is timed.
//! Outputs must agree across modes (greedy speculation is exact); disagreements are counted and reported.

use super::agentic::{Conversation, history, load};
use crate::bfcl;
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use thorn_engine::engine::{Engine, EngineConfig, Request};
use thorn_engine::spec::{SpecConfig, SpecStats, Speculator};
use thorn_guide::ToolGrammars;
use thorn_tools::chat::ChatTemplate;
use thorn_tools::{ResponseFormat, ToolChoice, ToolSet};

/// Options of a run: the flags `thorn bench spec` adds to the model, engine and speculation options it
/// shares with other commands (those reach [`run`] resolved, as a [`Setup`]).
#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    /// The BFCL data directory (default: the data set `thorn data pull bfcl` fetched).
    #[arg(long)]
    pub bfcl_dir: Option<PathBuf>,
    /// BFCL categories.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "simple_python,multiple,parallel,parallel_multiple,live_simple"
    )]
    pub categories: Vec<String>,
    /// Questions per category.
    #[arg(long, default_value_t = 6)]
    pub questions: usize,
    /// The recorded conversations (JSON Lines; default: the MLPerf Edge Agentic set built into thorn).
    #[arg(long)]
    pub trajectories: Option<PathBuf>,
    /// Conversations whose assistant turns are generated.
    #[arg(long, default_value_t = 4)]
    pub conversations: usize,
    /// Assistant turns per conversation.
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Most tokens per generation.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What a run takes from the rest of the command line, resolved: the model file, the BFCL folder, the
/// engine's threads and context (turns that do not fit the context are skipped) and the draft tree.
#[derive(Debug, Clone)]
pub struct Setup<'a> {
    /// The model file.
    pub model: &'a Path,
    /// The BFCL v4 files (`--bfcl-dir`, or the pulled data set).
    pub bfcl_dir: &'a Path,
    /// Context length in tokens.
    pub context: usize,
    /// CPU threads (0 = one per physical core).
    pub threads: usize,
    /// The draft tree measured beside no speculation and a 3-token chain.
    pub tree: SpecConfig,
}

#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    generations: usize,
    tokens: usize,
    passes: usize,
    decode_secs: f64,
    spec: SpecStats,
}

impl Tally {
    fn tps(&self) -> f64 {
        // The first token comes from the prefill's pass.
        (self.tokens - self.generations.min(self.tokens)) as f64 / self.decode_secs.max(1e-9)
    }

    fn per_pass(&self) -> f64 {
        self.tokens as f64 / self.passes.max(1) as f64
    }

    fn json(&self) -> Value {
        let s = &self.spec;
        json!({
            "generations": self.generations,
            "tokens": self.tokens,
            "forward_passes": self.passes,
            "tokens_per_forward": self.per_pass(),
            "decode_seconds": self.decode_secs,
            "decode_tok_s": self.tps(),
            "trees": s.trees,
            "tree_tokens": s.drafted,
            "accepted": s.accepted,
            "mean_tree_tokens": s.drafted as f64 / (s.trees as f64).max(1.0),
            "acceptance": s.acceptance(),
            "branched_trees": s.branched,
            "tree_sizes": SpecStats::SIZE_LABELS.iter().zip(s.sizes).map(|(l, n)| json!([l, n])).collect::<Vec<_>>(),
        })
    }
}

/// The modes compared: no drafting, a 3-token chain and the tree, both sized by the measured cost of
/// verification, then the same two at their full budget whatever it costs (what a backend with nearly free
/// verification, a GPU, would run: their tokens per forward are the figures that carry over).
const MODES: [&str; N] = ["off", "chain3", "tree", "chain3-full", "tree-full"];
const N: usize = 5;

struct Case {
    prompt: Vec<u32>,
    tools: Rc<ToolSet>,
    choice: ToolChoice,
}

fn bfcl_cases(e: &Engine, t: &ChatTemplate, o: &Opts, setup: &Setup<'_>) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for cat in &o.categories {
        let path = setup.bfcl_dir.join(format!("BFCL_v4_{cat}.json"));
        let qs = bfcl::load(&path).with_context(|| format!("loading {}", path.display()))?;
        for q in qs.iter().take(o.questions) {
            let Ok(tools) = ToolSet::new(&q.tools) else {
                continue;
            };
            let tok = e.tokenizer();
            let text = tools.render(t, &q.messages, "", "<|im_end|>", &|s| tok.quote(s))?;
            let prompt = tok.encode_rendered(&text)?;
            if prompt.len() + o.max_tokens < setup.context {
                out.push(Case {
                    prompt,
                    tools: Rc::new(tools),
                    choice: ToolChoice::Required,
                });
            }
        }
    }
    Ok(out)
}

fn trajectory_cases(
    e: &Engine,
    t: &ChatTemplate,
    o: &Opts,
    setup: &Setup<'_>,
) -> Result<Vec<Case>> {
    let convs: Vec<Conversation> = load(o.trajectories.as_deref())?;
    let mut out = Vec::new();
    for c in convs.iter().take(o.conversations) {
        let tools = Rc::new(ToolSet::new(&c.tools)?);
        let mut kept = 0;
        for (ri, row) in c.rows.iter().enumerate() {
            if row["role"] != "assistant" || ri == 0 || kept >= o.turns {
                continue;
            }
            let msgs = history(c, ri - 1).1;
            let tok = e.tokenizer();
            let text = tools.render(t, &msgs, "", "<|im_end|>", &|s| tok.quote(s))?;
            let prompt = tok.encode_rendered(&text)?;
            if prompt.len() + o.max_tokens >= setup.context {
                break;
            }
            out.push(Case {
                prompt,
                tools: Rc::clone(&tools),
                choice: ToolChoice::Auto,
            });
            kept += 1;
        }
    }
    Ok(out)
}

fn run_cases(
    e: &mut Engine,
    cases: &[Case],
    specs: &mut [Speculator; N],
    max_tokens: usize,
    label: &str,
) -> Result<([Tally; N], usize)> {
    let grammars = e.grammars()?.clone();
    let mut t = [Tally::default(); N];
    let mut mismatches = 0;
    let bar = indicatif::ProgressBar::new(cases.len() as u64).with_message(label.to_owned());
    for (i, c) in cases.iter().enumerate() {
        let mut outs: [Option<Vec<u32>>; N] = Default::default();
        for k in 0..N {
            // Rotate the order so no mode always runs first (cold caches, a noisy neighbour).
            let m = (i + k) % N;
            let before = specs[m].stats;
            e.swap_speculator(&mut specs[m]);
            let mut guide = grammars.guide(&c.tools, &c.choice, true, &ResponseFormat::Text)?;
            let req = Request::greedy(c.prompt.clone(), max_tokens);
            let r = e.generate_guided(&req, guide.as_mut(), &mut |_| {});
            e.swap_speculator(&mut specs[m]);
            let g = r?;
            let after = specs[m].stats;
            let tl = &mut t[m];
            tl.generations += 1;
            tl.tokens += g.tokens.len();
            tl.passes += g.stats.forward_passes + 1;
            tl.decode_secs += g.stats.decode.as_secs_f64();
            tl.spec.trees += after.trees - before.trees;
            tl.spec.drafted += after.drafted - before.drafted;
            tl.spec.accepted += after.accepted - before.accepted;
            tl.spec.branched += after.branched - before.branched;
            for (s, (a, b)) in tl
                .spec
                .sizes
                .iter_mut()
                .zip(after.sizes.iter().zip(before.sizes))
            {
                *s += a - b;
            }
            outs[m] = Some(g.tokens);
        }
        if outs.iter().any(|o| *o != outs[0]) {
            mismatches += 1;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((t, mismatches))
}

/// Runs the benchmark.
pub fn run(o: &Opts, setup: &Setup<'_>) -> Result<()> {
    let mut e = Engine::load(
        setup.model,
        &EngineConfig {
            threads: setup.threads,
            context: setup.context,
            speculation: SpecConfig::off(),
            ..EngineConfig::default()
        },
    )
    .with_context(|| format!("loading {}", setup.model.display()))?;
    let template = ChatTemplate::new(
        e.gguf()
            .get_str("tokenizer.chat_template")
            .context("the model has no chat template")?,
    )?;
    eprintln!("measuring forward passes of 1-64 tokens for the cost model ...");
    e.set_speculation(SpecConfig::default());
    e.calibrate_speculation()?;
    let cost = e.speculator().cost.clone();
    let full = |c: SpecConfig| SpecConfig {
        adaptive: false,
        ..c
    };
    let configs = [
        SpecConfig::off(),
        SpecConfig::chain(3),
        setup.tree.clone(),
        full(SpecConfig::chain(3)),
        full(setup.tree.clone()),
    ];
    let mut specs: [Speculator; N] = configs.map(|c| {
        let mut s = Speculator::new(c);
        s.cost = cost.clone();
        s
    });
    let workloads = [
        ("bfcl tool calls", bfcl_cases(&e, &template, o, setup)?),
        (
            "trajectory turns",
            trajectory_cases(&e, &template, o, setup)?,
        ),
    ];
    let mut report = json!({
        "model": setup.model.display().to_string(),
        "threads": e.device().threads(),
        "isa": e.device().name(),
        "max_tokens": o.max_tokens,
        "tree": {"top_k": setup.tree.top_k, "max_depth": setup.tree.max_depth, "max_nodes": setup.tree.max_nodes,
                 "adaptive": setup.tree.adaptive},
        "cost_ms": (1..=64).filter(|&n| cost.measured(n)).map(|n| json!([n, cost.cost(n) * 1e3])).collect::<Vec<_>>(),
        "workloads": {},
    });
    let mut md = String::new();
    md.push_str(
        "| workload | mode | generations | tokens | tokens/forward | decode tok/s | vs off | vs chain3 | tree tokens/tree | branched trees | accepted |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (label, cases) in &workloads {
        let (t, mismatches) = run_cases(&mut e, cases, &mut specs, o.max_tokens, label)?;
        let mut w = json!({"cases": cases.len(), "mismatches": mismatches});
        for (m, name) in MODES.iter().enumerate() {
            w[name] = t[m].json();
            let s = &t[m].spec;
            md.push_str(&format!(
                "| {label} | {name} | {} | {} | {:.2} | {:.1} | {:.2}x | {:.2}x | {} | {} | {} |\n",
                t[m].generations,
                t[m].tokens,
                t[m].per_pass(),
                t[m].tps(),
                t[m].tps() / t[0].tps(),
                t[m].tps() / t[1].tps(),
                if s.trees > 0 {
                    format!("{:.1}", s.drafted as f64 / s.trees as f64)
                } else {
                    "-".into()
                },
                if s.trees > 0 {
                    format!("{} of {}", s.branched, s.trees)
                } else {
                    "-".into()
                },
                if s.drafted > 0 {
                    format!("{:.0}%", 100.0 * s.acceptance())
                } else {
                    "-".into()
                },
            ));
        }
        if mismatches > 0 {
            md.push_str(&format!(
                "\n**{mismatches} of {} {label} differ between modes** (a bug: greedy speculation is exact)\n\n",
                cases.len()
            ));
        }
        report["workloads"][label] = w;
    }
    println!("{md}");
    if let Some(p) = o.json.as_deref() {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
