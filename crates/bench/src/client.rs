//! A minimal OpenAI client for the endpoint benchmarks: one chat request, streamed, with the time of the
//! first token and the final usage. It speaks to any OpenAI-compatible server (thorn, llama.cpp's
//! `llama-server`, vLLM), so the same code measures every endpoint; the wire types are `thorn-openai`'s,
//! the ones thorn's server answers with.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use thorn_openai::{
    ChatChunk, ChatCompletion, ChatRequest, ErrorResponse, ModelList, StreamOptions,
};

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

impl EndpointArgs {
    /// `--max-tokens` as the wire's `max_tokens`.
    pub fn max_tokens_u32(&self) -> u32 {
        u32::try_from(self.max_tokens).unwrap_or(u32::MAX)
    }
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
        let list: ModelList = r.body_mut().read_json()?;
        list.data
            .into_iter()
            .next()
            .map(|m| m.id)
            .context("the endpoint lists no model")
    }

    /// POSTs `body` to the chat completions route (with the key, if any).
    fn post_chat(&self, body: &ChatRequest<'_>) -> Result<ureq::http::Response<ureq::Body>> {
        let mut req = self
            .agent
            .post(format!("{}/v1/chat/completions", self.base))
            .header("Content-Type", "application/json");
        if let Some(k) = &self.key {
            req = req.header("Authorization", &format!("Bearer {k}"));
        }
        req.send(serde_json::to_vec(body)?.as_slice())
            .with_context(|| format!("POST {}/v1/chat/completions", self.base))
    }

    /// Sends a chat request unstreamed and returns the completion; an error status is an error with the
    /// server's message.
    pub fn chat_json(&self, body: &ChatRequest<'_>) -> Result<ChatCompletion<'static>> {
        let mut resp = self.post_chat(body)?;
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string()?;
        if status != 200 {
            let why = serde_json::from_str::<ErrorResponse<'_>>(&text)
                .map_or(text.clone(), |e| e.error.message.into_owned());
            bail!("HTTP {status}: {why}");
        }
        serde_json::from_str(&text)
            .with_context(|| format!("a response that is not a chat.completion: {text}"))
    }

    /// Sends a chat request streamed (with usage in the last chunk) and reads the answer.
    pub fn chat(&self, mut body: ChatRequest<'_>) -> Result<Reply> {
        body.stream = Some(true);
        body.stream_options = Some(StreamOptions {
            include_usage: true,
        });
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
            let c: ChatChunk<'_> = serde_json::from_str(data)
                .with_context(|| format!("a stream event that is not a chunk: {data}"))?;
            if let Some(e) = &c.error {
                bail!("the stream reported an error: {e}");
            }
            if let Some(u) = c.usage {
                out.prompt_tokens = Some(u.prompt_tokens as u64);
                out.completion_tokens = Some(u.completion_tokens as u64);
                out.cached_tokens = u.cached_tokens().map(|n| n as u64);
            }
            let Some(choice) = c.choices.first() else {
                continue;
            };
            let delta = &choice.delta;
            let mut got = false;
            if let Some(t) = delta.content.as_deref().filter(|t| !t.is_empty()) {
                out.content.push_str(t);
                got = true;
            }
            for tc in delta.tool_calls.iter().flatten() {
                let i = tc.index.unwrap_or(calls.len());
                anyhow::ensure!(i < 1024, "a tool call index of {i}");
                if calls.len() <= i {
                    calls.resize_with(i + 1, Default::default);
                }
                if let Some(n) = &tc.function.name {
                    calls[i].0.push_str(n);
                }
                if let Some(a) = &tc.function.arguments {
                    calls[i].1.push_str(a);
                }
                got = true;
            }
            // A host call being generated (thorn runs it), and reasoning (servers that think first),
            // are output too.
            if delta.thorn_host_tool_calls.is_some() || delta.reasoning().is_some() {
                got = true;
            }
            if got && out.ttft.is_none() {
                out.ttft = Some(t0.elapsed());
            }
            if let Some(f) = &choice.finish_reason {
                out.finish = f.to_string();
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
