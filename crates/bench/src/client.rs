//! A minimal OpenAI client for the endpoint benchmarks: one chat request, streamed, with the time of the
//! first token and the final usage. It speaks to any OpenAI-compatible server (thorn, llama.cpp's
//! `llama-server`, vLLM), so the same code measures every endpoint.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The endpoint a benchmark measures and where its report goes (the options every endpoint benchmark
/// shares).
#[derive(clap::Args, Debug, Clone)]
pub struct EndpointArgs {
    /// The endpoint's base URL.
    #[arg(
        long = "endpoint",
        value_name = "ENDPOINT",
        default_value = "http://127.0.0.1:8080"
    )]
    pub url: String,
    /// API key (Bearer).
    #[arg(long, env = "THORN_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// Model name to request (default: the first the endpoint lists).
    #[arg(long = "model", value_name = "MODEL_NAME")]
    pub model: Option<String>,
    /// Most new tokens per request.
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: usize,
    /// Write the JSON report here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the markdown summary here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// An endpoint: base URL (`http://127.0.0.1:8080`) and optional API key.
#[derive(Debug, Clone)]
pub struct Endpoint {
    base: String,
    key: Option<String>,
    agent: ureq::Agent,
}

/// One streamed answer.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// Answer text.
    pub content: String,
    /// Tool calls: name and arguments (parsed; `None` when not JSON).
    pub calls: Vec<(String, Option<Value>)>,
    /// `finish_reason`.
    pub finish: String,
    /// Time to the first generated content or tool-call delta.
    pub ttft: Option<Duration>,
    /// Whole request time.
    pub total: Duration,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, where the server reports it.
    pub cached_tokens: Option<u64>,
}

impl Endpoint {
    /// A client for `base` (with or without a trailing `/v1`).
    pub fn new(base: &str, key: Option<String>, timeout: Duration) -> Self {
        let base = base
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_owned();
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Endpoint { base, key, agent }
    }

    /// The first model the endpoint lists.
    pub fn model(&self) -> Result<String> {
        let mut r = self
            .agent
            .get(format!("{}/v1/models", self.base))
            .call()
            .with_context(|| format!("GET {}/v1/models", self.base))?;
        let v: Value = r.body_mut().read_json()?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .context("the endpoint lists no model")
    }

    /// POSTs `body` to the chat completions route (with the key, if any).
    fn post_chat(&self, body: &Value) -> Result<ureq::http::Response<ureq::Body>> {
        let mut req = self
            .agent
            .post(format!("{}/v1/chat/completions", self.base))
            .header("Content-Type", "application/json");
        if let Some(k) = &self.key {
            req = req.header("Authorization", &format!("Bearer {k}"));
        }
        req.send(body.to_string().as_bytes())
            .with_context(|| format!("POST {}/v1/chat/completions", self.base))
    }

    /// Sends a chat request unstreamed and returns the completion (or the error body, for any status).
    pub fn chat_json(&self, body: &Value) -> Result<Value> {
        let text = self.post_chat(body)?.body_mut().read_to_string()?;
        serde_json::from_str(&text).with_context(|| format!("a response that is not JSON: {text}"))
    }

    /// Sends a chat request (`body` without `stream`) and reads the streamed answer.
    pub fn chat(&self, body: &Value) -> Result<Reply> {
        let mut body = body.clone();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let t0 = Instant::now();
        let mut resp = self.post_chat(&body)?;
        let status = resp.status().as_u16();
        if status != 200 {
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            bail!("HTTP {status}: {text}");
        }
        let reader = BufReader::new(resp.body_mut().as_reader());
        let mut out = Reply::default();
        // Tool calls arrive as deltas keyed by index: name once, arguments in pieces.
        let mut calls: Vec<(String, String)> = Vec::new();
        for line in reader.lines() {
            let line = line?;
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(data)
                .with_context(|| format!("a stream event that is not JSON: {data}"))?;
            if v.get("error").is_some() {
                bail!("the stream reported an error: {}", v["error"]);
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                out.prompt_tokens = u["prompt_tokens"].as_u64();
                out.completion_tokens = u["completion_tokens"].as_u64();
                out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
            }
            let Some(choice) = v["choices"].get(0) else {
                continue;
            };
            let delta = &choice["delta"];
            let mut got = false;
            if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                out.content.push_str(t);
                got = true;
            }
            if let Some(tc) = delta["tool_calls"].as_array() {
                for c in tc {
                    let i = c["index"].as_u64().unwrap_or(calls.len() as u64) as usize;
                    while calls.len() <= i {
                        calls.push((String::new(), String::new()));
                    }
                    if let Some(n) = c["function"]["name"].as_str() {
                        calls[i].0.push_str(n);
                    }
                    if let Some(a) = c["function"]["arguments"].as_str() {
                        calls[i].1.push_str(a);
                    }
                }
                got = true;
            }
            // A host call being generated (thorn runs it) is output too.
            if delta["thorn_host_tool_calls"].is_array() {
                got = true;
            }
            // Reasoning deltas count as output too (servers that think first).
            if delta["reasoning_content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            {
                got = true;
            }
            if got && out.ttft.is_none() {
                out.ttft = Some(t0.elapsed());
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                out.finish = f.to_owned();
            }
        }
        out.total = t0.elapsed();
        out.calls = calls
            .into_iter()
            .map(|(n, a)| {
                let args = if a.trim().is_empty() {
                    Some(json!({}))
                } else {
                    serde_json::from_str(&a).ok()
                };
                (n, args)
            })
            .collect();
        Ok(out)
    }
}
