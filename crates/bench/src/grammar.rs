//! `thorn bench grammar`: constrained tool calls over the BFCL questions.
//!
//! Two parts:
//!
//! 1. **Validity** (every question of the chosen categories, several seeds, temperature 1.0 by default):
//!    each answer is generated under the tool-call grammar and parsed and validated with `jsonschema`; the
//!    bench reports how many calls parsed and validated (the goal is all of them), the compile time per tool
//!    set, the mask time per token (p50/p99) and the share of tokens the grammar forced.
//! 2. **Speed** (the first few questions of each category, greedy): the same answer decoded three ways:
//!    constrained with fast-forward, constrained without it (a mask and a sampling step for every token), and
//!    free (the same tokens replayed one decode step each with sampling and no mask). Grammar overhead is
//!    constrained-without-FF against free; the FF gain is free against constrained-with-FF.

use crate::bfcl::{self, Question};
use anyhow::{Context, Result};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thorn_engine::engine::{Engine, EngineConfig, FinishReason, Request};
use thorn_engine::sample::{Sampler, SamplingParams};
use thorn_guide::ToolGrammars;
use thorn_tools::chat::ChatTemplate;
use thorn_tools::{ResponseFormat, ToolChoice, ToolFormat, ToolSet};

/// Options of a run.
#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    /// Folder with the BFCL v4 files (default: the data set `thorn data pull bfcl` fetched).
    #[arg(long)]
    pub bfcl_dir: Option<PathBuf>,
    /// BFCL categories (file names without `BFCL_v4_` and `.json`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "simple_python,multiple,parallel,parallel_multiple,irrelevance"
    )]
    pub categories: Vec<String>,
    /// Questions per category (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Seeds per question.
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// Sampling temperature of the validity run.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// tool_choice: auto, required or a function name.
    #[arg(long, default_value = "required", value_parser = tool_choice)]
    pub tool_choice: ToolChoice,
    /// The tool-call format the calls are decoded in (`hermes`, `qwen3_xml`, `llama3_json`, `mistral`, `mistral_args`, `harmony`, `gemma`, `functiongemma`): its prompt,
    /// grammar and parser.
    #[arg(long, default_value = "hermes")]
    pub tool_format: ToolFormat,
    /// Questions per category in the speed comparison (greedy; 0 = none).
    #[arg(long, default_value_t = 10)]
    pub speed_questions: usize,
    /// Sample every token of the validity run (no fast-forward of forced tokens).
    #[arg(long)]
    pub no_fast_forward: bool,
    /// Compute the full mask before every sampled token (no sample-first check).
    #[arg(long)]
    pub no_lazy_mask: bool,
    /// CPU threads (0 = one per physical core).
    #[arg(long, env = "THORN_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `--tool-choice` as spelled on the command line (`ToolChoice::from_name`).
fn tool_choice(name: &str) -> Result<ToolChoice, std::convert::Infallible> {
    Ok(ToolChoice::from_name(name))
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

struct Prompter {
    template: ChatTemplate,
    bos: String,
    eos: String,
}

impl Prompter {
    fn new(e: &Engine) -> Result<Self> {
        let src = e
            .gguf()
            .get_str("tokenizer.chat_template")
            .context("the model has no chat template")?;
        let tok = e.tokenizer();
        let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_owned();
        Ok(Prompter {
            template: ChatTemplate::new(src)?,
            bos: text_of(tok.bos()),
            eos: text_of(tok.eos()),
        })
    }

    fn tokens(&self, e: &Engine, q: &Question, tools: &ToolSet) -> Result<Vec<u32>> {
        let tok = e.tokenizer();
        let text = tools.render(&self.template, &q.messages, &self.bos, &self.eos, &|s| {
            tok.quote(s)
        })?;
        Ok(tok.encode_rendered(&text)?)
    }
}

#[derive(Default)]
struct Tally {
    questions: usize,
    generations: usize,
    calls: usize,
    valid: usize,
    invalid: Vec<String>,
    truncated: usize,
    no_call: usize,
    rejected_tool_sets: Vec<String>,
    tokens: usize,
    forced: usize,
    compile_ms: Vec<f64>,
    mask_us: Vec<f64>,
    lazy_hits: usize,
}

/// Runs the benchmark with the model file `model` on the BFCL v4 files in `bfcl_dir` (`--bfcl-dir`, or the
/// pulled data set).
pub fn run(o: &Opts, model: &Path, bfcl_dir: &Path) -> Result<()> {
    let cfg = EngineConfig {
        threads: o.threads,
        context: 4096,
        ..EngineConfig::default()
    };
    let mut e =
        Engine::load(model, &cfg).with_context(|| format!("loading {}", model.display()))?;
    let prompter = Prompter::new(&e)?;
    let grammars = e.grammars()?.clone();
    let mut per_cat = Vec::new();
    let mut all = Tally::default();
    let mut speed_set: Vec<(Vec<u32>, ToolSet)> = Vec::new();
    for cat in &o.categories {
        let path = bfcl_dir.join(format!("BFCL_v4_{cat}.json"));
        let mut qs = bfcl::load(&path)?;
        if o.limit > 0 {
            qs.truncate(o.limit);
        }
        let mut t = Tally::default();
        eprintln!("{cat}: {} questions x {} seeds", qs.len(), o.seeds);
        let started = Instant::now();
        for (qi, q) in qs.iter().enumerate() {
            t.questions += 1;
            if qi > 0 && qi % 50 == 0 {
                eprintln!(
                    "  {qi}/{} questions, {} calls, {} invalid, {:.0} s",
                    qs.len(),
                    t.calls,
                    t.invalid.len(),
                    started.elapsed().as_secs_f64()
                );
            }
            let tools = match ToolSet::new(&q.tools).and_then(|t| t.with_format(o.tool_format)) {
                Ok(t) => t,
                Err(err) => {
                    t.rejected_tool_sets.push(format!("{}: {err}", q.id));
                    continue;
                }
            };
            let c0 = Instant::now();
            let guide = grammars.guide(&tools, &o.tool_choice, true, &ResponseFormat::Text);
            t.compile_ms.push(c0.elapsed().as_secs_f64() * 1e3);
            let guide = match guide {
                Ok(Some(g)) => g,
                Ok(None) => continue,
                Err(err) => {
                    t.rejected_tool_sets.push(format!("{}: {err}", q.id));
                    continue;
                }
            };
            drop(guide);
            let prompt = prompter.tokens(&e, q, &tools)?;
            if prompt.len() + o.max_tokens >= e.context() {
                t.rejected_tool_sets.push(format!(
                    "{}: prompt of {} tokens is too long",
                    q.id,
                    prompt.len()
                ));
                continue;
            }
            if qi < o.speed_questions {
                speed_set.push((
                    prompt.clone(),
                    ToolSet::new(&q.tools)?.with_format(o.tool_format)?,
                ));
            }
            for seed in 0..o.seeds {
                let mut g = grammars
                    .guide(&tools, &o.tool_choice, true, &ResponseFormat::Text)?
                    .context("no guide")?;
                g.record_mask_times();
                g.set_fast_forward(!o.no_fast_forward);
                g.set_lazy_mask(!o.no_lazy_mask);
                let req = Request {
                    sampling: SamplingParams {
                        temperature: o.temperature,
                        seed: Some(seed),
                        ..SamplingParams::default()
                    },
                    shown_controls: thorn_guide::shown_controls(e.tokenizer(), o.tool_format),
                    ..Request::greedy(prompt.clone(), o.max_tokens)
                };
                let out = e.generate_guided(&req, Some(&mut g), &mut |_| {})?;
                t.generations += 1;
                t.tokens += out.tokens.len();
                t.forced += g.forced_tokens();
                t.mask_us
                    .extend(g.mask_times().iter().map(|d| d.as_secs_f64() * 1e6));
                t.lazy_hits += g.lazy_hits();
                // A call cut short by max_tokens is not an emitted call; the complete ones before it are.
                let text = if out.finish == FinishReason::Length && !g.is_done() {
                    t.truncated += 1;
                    tools.complete_prefix(&out.text)
                } else {
                    &out.text
                };
                t.calls += o.tool_format.calls_begun(&tools, text);
                match tools.reply(text) {
                    Ok(r) => {
                        t.valid += r.calls.len();
                        if r.calls.is_empty() && out.finish == FinishReason::Stop {
                            t.no_call += 1;
                        }
                    }
                    Err(err) => t
                        .invalid
                        .push(format!("{} seed {seed}: {err} in {:?}", q.id, out.text)),
                }
            }
        }
        merge(&mut all, &t);
        per_cat.push((cat.clone(), t));
    }

    // Speed: constrained with and without fast-forward, each against a free replay of its own tokens. (The
    // two constrained answers can differ: fast-forward commits the grammar's canonical spelling of forced
    // text, while without it the model may spell the same bytes with other tokens.)
    let (mut t_ff, mut t_noff) = (Duration::ZERO, Duration::ZERO);
    let (mut t_free_ff, mut t_free_noff) = (Duration::ZERO, Duration::ZERO);
    let (mut n_ff, mut n_noff, mut n_passes) = (0usize, 0usize, 0usize);
    for (i, (prompt, tools)) in speed_set.iter().enumerate() {
        let req = Request::greedy(prompt.clone(), o.max_tokens);
        let mut answers: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for &v in &order {
            let mut g = grammars
                .guide(tools, &o.tool_choice, true, &ResponseFormat::Text)?
                .context("no guide")?;
            g.set_fast_forward(v == 0);
            let out = e.generate_guided(&req, Some(&mut g), &mut |_| {})?;
            if v == 0 {
                t_ff += out.stats.decode;
                n_ff += out.tokens.len();
                n_passes += out.stats.forward_passes;
            } else {
                t_noff += out.stats.decode;
                n_noff += out.tokens.len();
            }
            answers[v] = out.tokens;
        }
        for &v in &order {
            let d = replay(&mut e, prompt, &answers[v])?;
            if v == 0 {
                t_free_ff += d;
            } else {
                t_free_noff += d;
            }
        }
    }
    let tps = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);

    let summary = |t: &Tally| {
        let mut c = t.compile_ms.clone();
        c.sort_by(f64::total_cmp);
        let mut m = t.mask_us.clone();
        m.sort_by(f64::total_cmp);
        json!({
            "questions": t.questions,
            "generations": t.generations,
            "calls": t.calls,
            "calls_valid": t.valid,
            "calls_invalid": t.invalid.len(),
            "truncated_by_max_tokens": t.truncated,
            "answers_without_call": t.no_call,
            "rejected_tool_sets": t.rejected_tool_sets,
            "tokens": t.tokens,
            "forced_tokens": t.forced,
            "forced_share": t.forced as f64 / t.tokens.max(1) as f64,
            "compile_ms_p50": pct(&c, 0.5),
            "compile_ms_p99": pct(&c, 0.99),
            "compile_ms_max": c.last().copied().unwrap_or(0.0),
            "mask_us_p50": pct(&m, 0.5),
            "mask_us_p99": pct(&m, 0.99),
            "mask_us_mean": m.iter().sum::<f64>() / m.len().max(1) as f64,
            "masks": m.len(),
            "sampled_tokens_accepted_without_mask": t.lazy_hits,
        })
    };
    let report = json!({
        "model": model.display().to_string(),
        "threads": e.device().threads(),
        "tool_choice": format!("{:?}", o.tool_choice),
        "tool_format": o.tool_format.name(),
        "temperature": o.temperature,
        "seeds": o.seeds,
        "max_tokens": o.max_tokens,
        "categories": per_cat.iter().map(|(c, t)| (c.clone(), summary(t))).collect::<serde_json::Map<_, _>>(),
        "total": summary(&all),
        "invalid_examples": all.invalid.iter().take(10).collect::<Vec<_>>(),
        "speed": {
            "answers": speed_set.len(),
            "tokens_ff": n_ff,
            "tokens_no_ff": n_noff,
            "forward_passes_with_ff": n_passes,
            "constrained_no_ff_tok_per_s": tps(n_noff, t_noff),
            "free_same_tokens_as_no_ff_tok_per_s": tps(n_noff, t_free_noff),
            "grammar_overhead_pct": 100.0 * (t_noff.as_secs_f64() / t_free_noff.as_secs_f64().max(1e-9) - 1.0),
            "constrained_ff_tok_per_s": tps(n_ff, t_ff),
            "free_same_tokens_as_ff_tok_per_s": tps(n_ff, t_free_ff),
            "ff_speedup_vs_free": t_free_ff.as_secs_f64() / t_ff.as_secs_f64().max(1e-9),
        },
        "validation_failures_logged": thorn_tools::validation_failures(),
    });
    if o.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{:<18} {:>5} {:>6} {:>6} {:>6} {:>5} {:>6} {:>7} {:>9} {:>9} {:>8} {:>8}",
        "category",
        "qs",
        "gens",
        "calls",
        "valid",
        "trunc",
        "nocall",
        "forced",
        "compile50",
        "compile99",
        "mask50",
        "mask99"
    );
    for (name, t) in per_cat
        .iter()
        .map(|(c, t)| (c.as_str(), t))
        .chain([("total", &all)])
    {
        let s = summary(t);
        println!(
            "{:<18} {:>5} {:>6} {:>6} {:>6} {:>5} {:>6} {:>6.1}% {:>7.2}ms {:>7.2}ms {:>6.1}us {:>6.1}us",
            name,
            t.questions,
            t.generations,
            t.calls,
            t.valid,
            t.truncated,
            t.no_call,
            100.0 * s["forced_share"].as_f64().unwrap_or(0.0),
            s["compile_ms_p50"].as_f64().unwrap_or(0.0),
            s["compile_ms_p99"].as_f64().unwrap_or(0.0),
            s["mask_us_p50"].as_f64().unwrap_or(0.0),
            s["mask_us_p99"].as_f64().unwrap_or(0.0),
        );
    }
    for r in all.rejected_tool_sets.iter().take(10) {
        println!("rejected: {r}");
    }
    for r in all.invalid.iter().take(10) {
        println!("INVALID: {r}");
    }
    let sp = &report["speed"];
    let f = |k: &str| sp[k].as_f64().unwrap_or(0.0);
    println!("speed over {} greedy answers:", speed_set.len());
    println!(
        "  constrained, no fast-forward {:>7.1} tok/s; free decode of the same {} tokens {:>7.1} tok/s: grammar overhead {:+.1}%",
        f("constrained_no_ff_tok_per_s"),
        n_noff,
        f("free_same_tokens_as_no_ff_tok_per_s"),
        f("grammar_overhead_pct")
    );
    println!(
        "  constrained, fast-forward    {:>7.1} tok/s; free decode of the same {} tokens {:>7.1} tok/s: {:.2}x ({} decode passes)",
        f("constrained_ff_tok_per_s"),
        n_ff,
        f("free_same_tokens_as_ff_tok_per_s"),
        f("ff_speedup_vs_free"),
        n_passes
    );
    Ok(())
}

/// Decodes `answer` after `prompt` the free way: one decode step and one (unmasked) sampling step per token,
/// as unconstrained generation of that text would. Returns the decode time (the prefill is not counted).
fn replay(e: &mut Engine, prompt: &[u32], answer: &[u32]) -> Result<Duration> {
    let mut sampler = Sampler::new(SamplingParams::default(), e.model().vocab());
    let mut s = e.session();
    s.prefill(prompt)?;
    let mut history = prompt.to_vec();
    let mut logits = s.logits().to_vec();
    let t0 = Instant::now();
    for (k, &tok) in answer.iter().enumerate() {
        // The first token comes out of the prefill, as in generate.
        std::hint::black_box(sampler.sample(&mut logits, &history).token);
        history.push(tok);
        if k + 1 < answer.len() {
            let l = s.step(&[tok])?;
            logits.clear();
            logits.extend_from_slice(l);
        }
    }
    Ok(t0.elapsed())
}

fn merge(all: &mut Tally, t: &Tally) {
    all.questions += t.questions;
    all.generations += t.generations;
    all.calls += t.calls;
    all.valid += t.valid;
    all.invalid.extend(t.invalid.iter().cloned());
    all.truncated += t.truncated;
    all.no_call += t.no_call;
    all.rejected_tool_sets
        .extend(t.rejected_tool_sets.iter().cloned());
    all.tokens += t.tokens;
    all.forced += t.forced;
    all.compile_ms.extend_from_slice(&t.compile_ms);
    all.mask_us.extend_from_slice(&t.mask_us);
    all.lazy_hits += t.lazy_hits;
}
