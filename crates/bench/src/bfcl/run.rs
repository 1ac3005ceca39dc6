//! `thorn bench bfcl --endpoint URL`: BFCL v4 single-turn accuracy of any OpenAI-compatible endpoint, scored
//! with the AST checker ([`crate::bfcl::check()`]). Requests are sent as MLPerf Edge Agentic sends them:
//! `tool_choice: auto`, temperature 0, seed 42, at most 1024 new tokens. `--mlperf` takes MLPerf's
//! deterministic sample (the first 62% of each non-live file, 10% of the others, small files whole: 995
//! questions); otherwise `--limit` questions per category.

use crate::bfcl::{self, Category};
use crate::client::{Endpoint, EndpointArgs};
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thorn_openai::{ChatRequest, Message};

/// Options of a run.
#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    #[command(flatten)]
    pub endpoint: EndpointArgs,
    /// Folder with the BFCL v4 files (default: the data set `thorn data pull bfcl` fetched).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Categories (default: the twelve MLPerf scores).
    #[arg(long, value_delimiter = ',')]
    pub categories: Vec<String>,
    /// Questions per category (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// MLPerf's deterministic sample (995 questions).
    #[arg(long)]
    pub mlperf: bool,
}

/// The categories MLPerf scores, in its groups.
pub const MLPERF: [(&str, &str); 12] = [
    ("simple_python", "non_live"),
    ("simple_java", "non_live"),
    ("simple_javascript", "non_live"),
    ("multiple", "non_live"),
    ("parallel", "non_live"),
    ("parallel_multiple", "non_live"),
    ("live_simple", "live"),
    ("live_multiple", "live"),
    ("live_parallel", "live"),
    ("live_parallel_multiple", "live"),
    ("irrelevance", "hallucination"),
    ("live_irrelevance", "hallucination"),
];

fn group_of(cat: &str) -> &'static str {
    MLPERF
        .iter()
        .find(|(c, _)| *c == cat)
        .map_or("other", |(_, g)| g)
}

/// How many questions MLPerf takes from a file of `total`.
pub fn mlperf_count(cat: &str, total: usize) -> usize {
    if total <= 25 {
        return total;
    }
    let pct = if group_of(cat) == "non_live" { 62 } else { 10 };
    (total * pct / 100).max(1)
}

/// One category's result.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CategoryScore {
    pub category: String,
    pub group: String,
    pub questions: usize,
    pub correct: usize,
    pub errors: usize,
    pub accuracy: f64,
    pub seconds: f64,
}

/// Runs the benchmark on the BFCL v4 files in `data` (`--data`, or the pulled data set).
pub fn run(o: &Opts, data: &Path) -> Result<()> {
    let ep = Endpoint::new(
        &o.endpoint.url,
        o.endpoint.api_key.clone(),
        Duration::from_secs(600),
    );
    let model = match &o.endpoint.model {
        Some(m) => m.clone(),
        None => ep.model().context("asking the endpoint for its model")?,
    };
    let cats: Vec<String> = if o.categories.is_empty() {
        MLPERF.iter().map(|(c, _)| (*c).to_owned()).collect()
    } else {
        o.categories.clone()
    };
    let mut plan = Vec::new();
    for cat in &cats {
        let qs = bfcl::load(&data.join(format!("BFCL_v4_{cat}.json")))?;
        let answers = if matches!(
            Category::of(cat),
            Some((Category::Irrelevance | Category::Relevance, _))
        ) {
            Vec::new()
        } else {
            bfcl::load_answers(&data.join(format!("possible_answer/BFCL_v4_{cat}.json")))?
        };
        let n = if o.mlperf {
            mlperf_count(cat, qs.len())
        } else if o.limit > 0 {
            o.limit.min(qs.len())
        } else {
            qs.len()
        };
        plan.push((cat.clone(), qs, answers, n));
    }
    let total: usize = plan.iter().map(|p| p.3).sum();
    let bar = indicatif::ProgressBar::new(total as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} {msg} [{elapsed_precise}, eta {eta}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut scores = Vec::new();
    let mut failures = Vec::new();
    for (cat, qs, answers, n) in &plan {
        bar.set_message(cat.clone());
        let t0 = Instant::now();
        let mut s = CategoryScore {
            category: cat.clone(),
            group: group_of(cat).into(),
            questions: *n,
            ..CategoryScore::default()
        };
        for (i, q) in qs.iter().take(*n).enumerate() {
            let expected: &[Value] = answers.get(i).map_or(&[], |a| &a.ground_truth);
            if let Some(a) = answers.get(i) {
                anyhow::ensure!(
                    a.id == q.id,
                    "answer {} does not match question {}",
                    a.id,
                    q.id
                );
            }
            let body = ChatRequest {
                model: Some(model.as_str().into()),
                messages: q
                    .messages
                    .iter()
                    .map(|m| Message::text(m.role.as_str(), m.content.as_str()))
                    .collect(),
                tools: (!q.tools.is_empty()).then(|| q.tools.as_slice().into()),
                tool_choice: Some("auto".into()),
                temperature: Some(0.0),
                seed: Some(42),
                max_tokens: Some(o.endpoint.max_tokens_u32()),
                ..ChatRequest::default()
            };
            let verdict = match ep.chat(body) {
                Ok(r) => {
                    // Calls whose arguments are not JSON count as no call.
                    let calls: Vec<(String, Value)> = r
                        .calls
                        .into_iter()
                        .filter_map(|(n, a)| Some((n, a?)))
                        .collect();
                    bfcl::check(&q.id, &q.functions, expected, &calls)
                }
                Err(e) => {
                    s.errors += 1;
                    Err(format!("request failed: {e:#}"))
                }
            };
            match verdict {
                Ok(()) => s.correct += 1,
                Err(e) => failures.push(json!({"id": q.id, "why": e})),
            }
            bar.inc(1);
        }
        s.accuracy = s.correct as f64 / s.questions.max(1) as f64;
        s.seconds = t0.elapsed().as_secs_f64();
        scores.push(s);
    }
    bar.finish_and_clear();
    let all: usize = scores.iter().map(|s| s.questions).sum();
    let ok: usize = scores.iter().map(|s| s.correct).sum();
    let overall = ok as f64 / all.max(1) as f64;
    let groups: Vec<(String, f64)> = ["non_live", "live", "hallucination"]
        .iter()
        .filter_map(|g| {
            let (q, c) = scores
                .iter()
                .filter(|s| s.group == *g)
                .fold((0, 0), |(q, c), s| (q + s.questions, c + s.correct));
            (q > 0).then(|| ((*g).to_owned(), c as f64 / q as f64))
        })
        .collect();
    let normalized = groups.iter().map(|g| g.1).sum::<f64>() / groups.len().max(1) as f64;
    let report = json!({"endpoint": o.endpoint.url, "model": model, "questions": all, "correct": ok,
        "overall": overall, "normalized": normalized,
        "groups": groups.iter().map(|(g, a)| json!({"group": g, "accuracy": a})).collect::<Vec<_>>(),
        "categories": scores, "failures": failures});
    let md = markdown(&report);
    println!("{md}");
    if let Some(p) = &o.endpoint.json {
        write(p, &serde_json::to_string_pretty(&report)?)?;
    }
    if let Some(p) = &o.endpoint.markdown {
        write(p, &md)?;
    }
    Ok(())
}

fn write(p: &Path, text: &str) -> Result<()> {
    if let Some(d) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))
}

/// The markdown summary of a report.
pub fn markdown(r: &Value) -> String {
    let mut s = format!(
        "BFCL v4 on {} ({}): {} questions, overall {:.2}%, normalized {:.2}%\n\n| category | group | questions | correct | accuracy |\n|---|---|---:|---:|---:|\n",
        r["endpoint"].as_str().unwrap_or(""),
        r["model"].as_str().unwrap_or(""),
        r["questions"],
        r["overall"].as_f64().unwrap_or(0.0) * 100.0,
        r["normalized"].as_f64().unwrap_or(0.0) * 100.0,
    );
    for c in r["categories"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1}% |\n",
            c["category"].as_str().unwrap_or(""),
            c["group"].as_str().unwrap_or(""),
            c["questions"],
            c["correct"],
            c["accuracy"].as_f64().unwrap_or(0.0) * 100.0
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlperf_sample_is_995_questions() {
        let sizes = [
            ("simple_python", 400),
            ("simple_java", 100),
            ("simple_javascript", 50),
            ("multiple", 200),
            ("parallel", 200),
            ("parallel_multiple", 200),
            ("live_simple", 258),
            ("live_multiple", 1053),
            ("live_parallel", 16),
            ("live_parallel_multiple", 24),
            ("irrelevance", 240),
            ("live_irrelevance", 884),
        ];
        let n: usize = sizes.iter().map(|(c, t)| mlperf_count(c, *t)).sum();
        assert_eq!(n, 995);
    }
}
