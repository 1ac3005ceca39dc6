//! `thorn bench agentic --endpoint URL`: the MLPerf Edge Agentic replay against any OpenAI-compatible
//! endpoint. The recorded SWE-agent conversations (`crates/bench/data/trajectories/`, compiled into the binary) are
//! replayed turn by turn and teacher-forced: each request carries the recorded history (never the model's
//! own reply) plus the next user or tool row, one conversation at a time, temperature 0, seed 42, the
//! recorded tools.
//!
//! `--max-context N` drops the turns whose prompt plus `--max-tokens` would not fit the model (counted with
//! thorn's tokenizer and the model's chat template; prompts only grow, so a conversation stops at its first
//! dropped turn) and reports what was kept. Per turn the bench records TTFT (first streamed delta), TPOT,
//! prompt, cached and completion tokens; the summary has the wall time, output tok/s and percentiles.

use super::client::{Endpoint, EndpointArgs};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thorn_engine::gguf::Gguf;
use thorn_engine::tokenizer::Tokenizer;
use thorn_openai as openai;
use thorn_tools::ToolSet;
use thorn_tools::chat::{ChatTemplate, FunctionCall, Message, Role, ToolCall};

/// Options of a run.
#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    #[command(flatten)]
    pub endpoint: EndpointArgs,
    /// The recorded conversations (JSON Lines; default: the MLPerf Edge Agentic set built into thorn).
    #[arg(long)]
    pub trajectories: Option<PathBuf>,
    /// Drop turns whose prompt plus --max-tokens exceeds this many tokens (0 = send everything).
    #[arg(long, default_value_t = 0)]
    pub max_context: usize,
    /// Only the first K conversations (0 = all).
    #[arg(long, default_value_t = 0)]
    pub conversations: usize,
    /// At most T turns per conversation (0 = all).
    #[arg(long, default_value_t = 0)]
    pub turns: usize,
    /// Conversations replayed at the same time (each one still turn by turn).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// GGUF whose tokenizer and chat template count prompt tokens for --max-context (default: the
    /// default model).
    #[arg(long)]
    pub tokenizer_model: Option<PathBuf>,
}

/// One recorded conversation: the system prompt, the tools, and its rows in order.
pub(crate) struct Conversation {
    pub(crate) id: String,
    pub(crate) tools: Vec<Value>,
    pub(crate) system: String,
    pub(crate) rows: Vec<Value>,
}

/// The MLPerf Edge Agentic trajectories (`crates/bench/data/trajectories`, with their license and provenance).
pub(crate) const TRAJECTORIES: &str =
    include_str!("../data/trajectories/agentic_coding_2.5h.jsonl");

/// The recorded conversations of `path`, or of the built-in set when `None`.
pub(crate) fn load(path: Option<&Path>) -> Result<Vec<Conversation>> {
    match path {
        None => parse(
            TRAJECTORIES,
            Path::new("agentic_coding_2.5h.jsonl (built in)"),
        ),
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            parse(&text, p)
        }
    }
}

fn parse(text: &str, path: &Path) -> Result<Vec<Conversation>> {
    let mut out: Vec<Conversation> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let id = row["conversation_id"].as_str().unwrap_or("").to_owned();
        if out.last().is_none_or(|c| c.id != id) {
            if row["role"] != "user" {
                bail!(
                    "{}:{}: a conversation must start with its user row",
                    path.display(),
                    i + 1
                );
            }
            out.push(Conversation {
                id,
                tools: row["tools"].as_array().cloned().unwrap_or_default(),
                system: row["system"].as_str().unwrap_or("").to_owned(),
                rows: Vec::new(),
            });
        }
        if let Some(c) = out.last_mut() {
            c.rows.push(row);
        }
    }
    Ok(out)
}

/// The chat messages of a conversation up to and including row `upto`, in OpenAI form and as thorn
/// messages (for counting tokens).
pub(crate) fn history(c: &Conversation, upto: usize) -> (Vec<openai::Message<'_>>, Vec<Message>) {
    let mut wire = vec![openai::Message::text("system", c.system.as_str())];
    let mut msgs = vec![Message::system(c.system.as_str())];
    for row in &c.rows[..=upto] {
        match row["role"].as_str() {
            Some("user") => {
                let t = row["content"].as_str().unwrap_or("");
                wire.push(openai::Message::text("user", t));
                msgs.push(Message::user(t));
            }
            Some("assistant") => {
                let calls = row["tool_calls"].as_array().cloned().unwrap_or_default();
                let mut m = openai::Message::text("assistant", "");
                m.tool_calls = Some(
                    row["tool_calls"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|c| {
                            let f = &c["function"];
                            openai::ToolCall::function(
                                c["id"].as_str().unwrap_or(""),
                                f["name"].as_str().unwrap_or(""),
                                match &f["arguments"] {
                                    Value::String(a) => a.clone(),
                                    other => other.to_string(),
                                },
                            )
                        })
                        .collect(),
                );
                m.reasoning_content = row["reasoning_content"].as_str().map(Into::into);
                wire.push(m);
                let mut a = Message::assistant("");
                a.tool_calls = calls
                    .iter()
                    .map(|c| ToolCall {
                        id: c["id"].as_str().unwrap_or("").to_owned(),
                        kind: "function",
                        function: FunctionCall {
                            name: c["function"]["name"].as_str().unwrap_or("").to_owned(),
                            arguments: c["function"]["arguments"]
                                .as_str()
                                .and_then(|a| serde_json::from_str(a).ok())
                                .unwrap_or(Value::Null),
                        },
                    })
                    .collect();
                msgs.push(a);
            }
            Some("tool") => {
                for r in row["tool_results"].as_array().into_iter().flatten() {
                    let content = r["content"].as_str().unwrap_or("");
                    let mut w = openai::Message::text("tool", content);
                    w.tool_call_id = r["tool_call_id"].as_str().map(Into::into);
                    wire.push(w);
                    let mut m = Message::new(Role::Tool, content);
                    m.tool_call_id = r["tool_call_id"].as_str().map(str::to_owned);
                    msgs.push(m);
                }
            }
            _ => {}
        }
    }
    (wire, msgs)
}

struct Counter {
    tok: Tokenizer,
    template: ChatTemplate,
    bos: String,
    eos: String,
}

impl Counter {
    fn new(model: &Path) -> Result<Self> {
        let g = Gguf::open(model).with_context(|| format!("opening {}", model.display()))?;
        let tok = Tokenizer::from_gguf(&g)?;
        let template = ChatTemplate::new(g.get_str("tokenizer.chat_template")?)?;
        let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_owned();
        let (bos, eos) = (text_of(tok.bos()), text_of(tok.eos()));
        Ok(Counter {
            tok,
            template,
            bos,
            eos,
        })
    }

    fn tokens(&self, tools: &ToolSet, msgs: &[Message]) -> Result<Vec<u32>> {
        let tok = &self.tok;
        let text = tools.render(&self.template, msgs, &self.bos, &self.eos, &|s| {
            tok.quote(s)
        })?;
        Ok(tok.encode_rendered(&text)?)
    }
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// Replays the conversations against the endpoint; `tokenizer_model` (`--tokenizer-model`, or the default
/// model) counts prompt tokens for `--max-context`.
pub fn run(o: &Opts, tokenizer_model: &Path) -> Result<()> {
    let ep = Endpoint::new(
        &o.endpoint.url,
        o.endpoint.api_key.clone(),
        Duration::from_secs(600),
    );
    let model = match &o.endpoint.model {
        Some(m) => m.clone(),
        None => ep.model().context("asking the endpoint for its model")?,
    };
    let convs = load(o.trajectories.as_deref())?;
    let convs: Vec<&Conversation> = convs
        .iter()
        .take(if o.conversations == 0 {
            usize::MAX
        } else {
            o.conversations
        })
        .collect();
    let counter = if o.max_context > 0 {
        Some(Counter::new(tokenizer_model)?)
    } else {
        None
    };
    // Plan the requests: every user/tool row, cut at the first that does not fit.
    let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (conversation, row, local prompt tokens)
    let (mut recorded, mut dropped, mut skipped) = (0usize, 0usize, 0usize);
    // The prompt tokens a perfect prefix cache could serve: each turn's longest common prefix with the
    // conversation's previous turn or any earlier conversation's first turn (the last token is always
    // computed). Teacher forcing sends the recorded replies, so a turn's new rows are always prefilled.
    let mut reusable = 0usize;
    let mut firsts: Vec<Vec<u32>> = Vec::new();
    for (ci, c) in convs.iter().enumerate() {
        let tools = ToolSet::new(&c.tools)?;
        let mut kept = 0;
        let mut prev: Option<Vec<u32>> = None;
        for (ri, row) in c.rows.iter().enumerate() {
            if row["role"] == "assistant" {
                continue;
            }
            recorded += 1;
            if o.turns > 0 && kept >= o.turns {
                skipped += 1;
                continue;
            }
            let toks = match &counter {
                Some(k) => k.tokens(&tools, &history(c, ri).1)?,
                None => Vec::new(),
            };
            let n = toks.len();
            if o.max_context > 0 && n + o.endpoint.max_tokens > o.max_context {
                dropped += 1;
                continue;
            }
            let lcp = |a: &[u32]| a.iter().zip(&toks).take_while(|(x, y)| x == y).count();
            let best = prev
                .iter()
                .chain(&firsts)
                .map(|p| lcp(p))
                .max()
                .unwrap_or(0);
            reusable += best.min(n.saturating_sub(1));
            if prev.is_none() {
                firsts.push(toks.clone());
            }
            prev = Some(toks);
            plan.push((ci, ri, n));
            kept += 1;
        }
    }
    let bar = indicatif::ProgressBar::new(plan.len() as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} turns {msg} [{elapsed_precise}, eta {eta}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Each conversation is replayed turn by turn; `concurrency` of them run at the same time.
    let mut by_conv: Vec<Vec<(usize, usize)>> = vec![Vec::new(); convs.len()];
    for &(ci, ri, local) in &plan {
        by_conv[ci].push((ri, local));
    }
    let queue = std::sync::Mutex::new((0..convs.len()).collect::<std::collections::VecDeque<_>>());
    let results = std::sync::Mutex::new((Vec::with_capacity(plan.len()), Vec::new()));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..o.concurrency.max(1) {
            s.spawn(|| {
                while let Some(ci) = queue.lock().ok().and_then(|mut q| q.pop_front()) {
                    let c = convs[ci];
                    for &(ri, local) in &by_conv[ci] {
                        bar.set_message(c.id.clone());
                        let (messages, _) = history(c, ri);
                        let body = openai::ChatRequest {
                            model: Some(model.as_str().into()),
                            messages,
                            tools: Some(c.tools.as_slice().into()),
                            tool_choice: Some("auto".into()),
                            temperature: Some(0.0),
                            seed: Some(42),
                            max_tokens: Some(o.endpoint.max_tokens_u32()),
                            ..openai::ChatRequest::default()
                        };
                        let sent = t0.elapsed().as_secs_f64();
                        let r = ep.chat(body);
                        let Ok(mut res) = results.lock() else {
                            return;
                        };
                        match r {
                            Ok(r) => {
                                let completion = r.completion_tokens.unwrap_or(0);
                                let ttft = r.ttft.unwrap_or(r.total).as_secs_f64();
                                let tpot = if completion > 1 {
                                    Some((r.total.as_secs_f64() - ttft) / (completion - 1) as f64)
                                } else {
                                    None
                                };
                                res.0.push(json!({"conversation": c.id, "row": ri, "sent_s": sent,
                                    "prompt_tokens": r.prompt_tokens.unwrap_or(local as u64), "local_prompt_tokens": local,
                                    "cached_tokens": r.cached_tokens, "completion_tokens": completion,
                                    "ttft_s": ttft, "tpot_s": tpot, "total_s": r.total.as_secs_f64(),
                                    "finish": r.finish, "calls": r.calls.len()}));
                            }
                            Err(e) => res.1.push(
                                json!({"conversation": c.id, "row": ri, "error": format!("{e:#}")}),
                            ),
                        }
                        bar.inc(1);
                    }
                }
            });
        }
    });
    let (turns, failed) = results.into_inner().unwrap_or_default();
    bar.finish_and_clear();
    let wall = t0.elapsed().as_secs_f64();
    let f = |k: &str| -> Vec<f64> { turns.iter().filter_map(|t| t[k].as_f64()).collect() };
    let sum = |k: &str| -> u64 { turns.iter().filter_map(|t| t[k].as_u64()).sum() };
    let (ttft, tpot) = (f("ttft_s"), f("tpot_s"));
    let out_tokens = sum("completion_tokens");
    let prompt_tokens = sum("prompt_tokens");
    let cached_reported = turns.iter().any(|t| t["cached_tokens"].is_u64());
    let cached = sum("cached_tokens");
    let report = json!({
        "endpoint": o.endpoint.url, "model": model, "conversations": convs.len(), "concurrency": o.concurrency.max(1),
        "recorded_turns": recorded, "turns": turns.len(), "dropped_turns": dropped,
        "skipped_turns": skipped,
        "failed_turns": failed.len(), "max_context": o.max_context, "max_tokens": o.endpoint.max_tokens,
        "wall_s": wall, "output_tokens": out_tokens, "output_tok_per_s": out_tokens as f64 / wall,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": if cached_reported { json!(cached) } else { Value::Null },
        "cached_share": if cached_reported { json!(cached as f64 / prompt_tokens.max(1) as f64) } else { Value::Null },
        "reusable_share": if counter.is_some() { json!(reusable as f64 / plan.iter().map(|p| p.2).sum::<usize>().max(1) as f64) } else { Value::Null },
        "ttft_s": {"p50": pct(&ttft, 0.5), "p90": pct(&ttft, 0.9), "p99": pct(&ttft, 0.99)},
        "tpot_s": {"p50": pct(&tpot, 0.5), "p90": pct(&tpot, 0.9), "p99": pct(&tpot, 0.99)},
        "per_turn": turns, "failures": failed,
    });
    let md = markdown(&report);
    println!("{md}");
    if let Some(p) = &o.endpoint.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &o.endpoint.markdown {
        std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
    }
    if !failed.is_empty() {
        bail!("{} turn(s) failed; the run is not valid", failed.len());
    }
    Ok(())
}

/// The markdown summary of a report.
pub fn markdown(r: &Value) -> String {
    let ms = |v: &Value| v.as_f64().map_or("-".into(), |s| format!("{:.1}", s * 1e3));
    format!(
        "Agentic replay on {} ({}): {} conversations ({} at a time), {} of {} turns sent ({} dropped for context, {} beyond --turns, {} failed)\n\n\
         | wall (s) | output tokens | output tok/s | prompt tokens | cached share (reusable) | TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) |\n\
         |---:|---:|---:|---:|---:|---|---|\n\
         | {:.1} | {} | {:.2} | {} | {} ({}) | {} / {} / {} | {} / {} / {} |\n",
        r["endpoint"].as_str().unwrap_or(""),
        r["model"].as_str().unwrap_or(""),
        r["conversations"],
        r["concurrency"],
        r["turns"],
        r["recorded_turns"],
        r["dropped_turns"],
        r["skipped_turns"],
        r["failed_turns"],
        r["wall_s"].as_f64().unwrap_or(0.0),
        r["output_tokens"],
        r["output_tok_per_s"].as_f64().unwrap_or(0.0),
        r["prompt_tokens"],
        r["cached_share"]
            .as_f64()
            .map_or("not reported".into(), |s| format!("{:.1}%", s * 100.0)),
        r["reusable_share"]
            .as_f64()
            .map_or("-".into(), |s| format!("{:.1}%", s * 100.0)),
        ms(&r["ttft_s"]["p50"]),
        ms(&r["ttft_s"]["p90"]),
        ms(&r["ttft_s"]["p99"]),
        ms(&r["tpot_s"]["p50"]),
        ms(&r["tpot_s"]["p90"]),
        ms(&r["tpot_s"]["p99"]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_trajectories_are_the_pinned_file() {
        use sha2::{Digest, Sha256};
        let hex: String = Sha256::digest(TRAJECTORIES.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "b7da8c4ffbe1cabd79c4d8169e5201541e006364b4bfc016d01d893e20ee6f70"
        );
        let convs = load(None).unwrap();
        assert_eq!(convs.len(), 20);
        let assistant_turns: usize = convs
            .iter()
            .map(|c| c.rows.iter().filter(|r| r["role"] == "assistant").count())
            .sum();
        assert_eq!(assistant_turns, 1007);
        assert!(
            convs
                .iter()
                .all(|c| c.tools.len() == 1 && !c.system.is_empty())
        );
    }
}
