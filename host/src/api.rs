//! The OpenAI-compatible HTTP API (axum).
//!
//! Routes: `POST /v1/chat/completions` (streamed or not; tools, tool_choice, parallel_tool_calls,
//! response_format, sampling, stop, max tokens, logprobs), `POST /v1/completions`, Anthropic's
//! `POST /v1/messages` and `/v1/messages/count_tokens` ([`anthropic`]), `GET /v1/models`,
//! `GET /health` and `GET /metrics` (Prometheus). Wire types ([`wire`]) are converted to the agent's domain
//! types here, and every failure is one [`ApiError`] rendered as OpenAI's error body with the right status.
//!
//! Requests are handed to the [`Agent`]; the engine behind it serves one at a time from a bounded queue, so
//! an overloaded server answers 429 with `Retry-After`. A streamed response starts only once the request is
//! known to be servable (it fits the context, its grammar compiled), so those errors still get a proper
//! status. A client that goes away cancels its request: the response future or stream is dropped, which
//! sets the request's cancel flag, and the engine stops at its next step.
//!
//! Streamed tool calls arrive as they are generated, in OpenAI's form: a call's first `tool_calls` delta
//! carries its `index`, `id`, `type` and `function.name` with `arguments: ""`, later deltas argument
//! fragments that concatenate to exactly the non-streamed call's `arguments` (the agent re-serializes
//! them as they are lexed, [`thorn_tools::CallStreamer`]); the last chunk says `finish_reason:
//! "tool_calls"`. Tool-call markup never reaches `content`. The reply is still validated when it ends: if
//! it ever disagreed with what was streamed (the grammar makes that a bug), the stream ends with an error
//! event instead of a finish; a call cut off by `max_tokens` ends the stream with `finish_reason:
//! "length"`.
//!
//! Host tools: a request asks for one by naming it in the `thorn:` namespace,
//! `{"type": "function", "function": {"name": "thorn:calculator"}}` (a plugin: all its functions) or
//! `"thorn:evaluate"` (one function). It runs in the host, with the plugin's own schema and grants; the
//! streamed response shows each host call as it is generated (`thorn_host_tool_calls` deltas, in
//! `tool_calls`' form, indexed among the request's host calls), then as it runs and returns
//! (`thorn_host_tool_call` / `thorn_host_tool_result`), and the final message lists them as
//! `thorn_host_tool_calls`. Any other tool is a client tool,
//! whatever its name: a client tool is never reinterpreted as a host plugin (one with the same name as a
//! requested host tool is a 400). With API keys, a key may be limited to some host tools ([`auth`]).
//!
//! `/mcp` serves the same host tools to MCP clients over Streamable HTTP, under the same keys ([`mcp`]).
//!
//! Connections, headers and bodies are bounded by [`listen`]; `/health` is open (for probes), `/metrics`
//! needs a key allowed to read it when `metrics_auth` is on.

mod access;
pub mod anthropic;
mod approvals;
mod chat;
mod completions;
pub mod error;
mod estop;
mod handler;
pub mod listen;
pub mod mcp;
pub mod metrics;
mod models;
mod request;
pub mod responses;
pub mod shutdown;
mod status;
pub mod wire;
mod work;

use crate::agent::Agent;
use crate::auth::Keys;
use crate::upstream::Upstreams;
use axum::Router;
use axum::middleware::from_fn_with_state;
use axum::routing::{get, post};
use handler::{Dialect, respond, unix_now};
use metrics::Metrics;
use std::sync::Arc;

pub use error::ApiError;
pub use listen::{HttpLimits, Peer, serve};
pub use models::AUTO_MODEL;
pub use request::{HOST_TOOL_PREFIX, chat_turn, parse_chat_request};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Accepted API keys (empty: no authentication).
    pub keys: Keys,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// Whether `/metrics` needs a key allowed to read it (only when keys are configured).
    pub metrics_auth: bool,
    /// Connection and transfer limits.
    pub http: HttpLimits,
    /// `/mcp` ([`mcp`]).
    pub mcp: mcp::McpHttp,
    /// The e-stop latch (`/v1/thorn/estop`, `/health`) and the approvals queue (`/v1/thorn/approvals`)
    /// of the plugins this server runs.
    pub controls: thorn_plugin::Controls,
    /// How long running requests may go on once a shutdown begins ([`shutdown`]).
    pub shutdown_grace: std::time::Duration,
    /// The certificate served over TLS (`None`: plain HTTP).
    pub tls: Option<Arc<thorn_plugin::tls::ServerCert>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            keys: Keys::default(),
            max_body: 8 << 20,
            metrics_auth: false,
            http: HttpLimits::default(),
            mcp: mcp::McpHttp::default(),
            controls: thorn_plugin::Controls::default(),
            shutdown_grace: std::time::Duration::from_secs(10),
            tls: None,
        }
    }
}

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    agent: Agent,
    metrics: Metrics,
    config: ServerConfig,
    started: u64,
    /// Bytes of request bodies being read, all requests together ([`HttpLimits::max_inflight_body`]).
    bodies: Arc<tokio::sync::Semaphore>,
    /// Upstream engines.
    upstreams: Upstreams,
    /// Responses kept for `previous_response_id`.
    responses: responses::ResponseStore,
    /// The server's stop: running requests, and whether they were cut.
    shutdown: shutdown::Shutdown,
}

impl AppState {
    /// State over `agent`.
    pub fn new(agent: Agent, config: ServerConfig) -> Self {
        let budget = config
            .http
            .max_inflight_body
            .clamp(config.max_body.max(1), tokio::sync::Semaphore::MAX_PERMITS);
        AppState {
            agent,
            metrics: Metrics::default(),
            config,
            started: unix_now(),
            bodies: Arc::new(tokio::sync::Semaphore::new(budget)),
            upstreams: Upstreams::default(),
            responses: responses::ResponseStore::default(),
            shutdown: shutdown::Shutdown::default(),
        }
    }

    /// The server's stop.
    pub fn shutdown(&self) -> &shutdown::Shutdown {
        &self.shutdown
    }

    /// Serves these upstream engines' models too.
    pub fn with_upstreams(mut self, upstreams: Upstreams) -> Self {
        self.upstreams = upstreams;
        self
    }

    /// The upstream engines.
    pub fn upstreams(&self) -> &Upstreams {
        &self.upstreams
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// The router with every route. Each API's routes sit under [`handler::respond`], which gives them their
/// dialect (how keys are read, how errors are rendered) and counts their responses; bodies are read by the
/// `Checked` extractor, under the server's limits.
pub fn router(state: Arc<AppState>) -> Router {
    let openai = Router::new()
        .route("/v1/chat/completions", post(chat::chat))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models::models))
        .route("/v1/models/{id}", get(models::model))
        .route("/health", get(status::health))
        .route("/v1/thorn/estop", get(estop::estop).post(estop::set_estop))
        .route("/v1/thorn/approvals", get(approvals::list))
        .route(
            "/v1/thorn/approvals/{id}",
            get(approvals::get_one).post(approvals::decide),
        )
        .route("/metrics", get(status::metrics_text))
        .fallback(handler::not_found)
        .layer(from_fn_with_state(
            (Arc::clone(&state), Dialect::OpenAi),
            respond,
        ));
    let anthropic = Router::new()
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .layer(from_fn_with_state(
            (Arc::clone(&state), Dialect::Anthropic),
            respond,
        ));
    openai
        .merge(anthropic)
        .with_state(Arc::clone(&state))
        .merge(mcp::routes(&state))
        .layer(from_fn_with_state(Arc::clone(&state), access::layer))
}
