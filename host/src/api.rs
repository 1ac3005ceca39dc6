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

pub mod anthropic;
pub mod auth;
pub mod error;
pub mod listen;
pub mod mcp;
pub mod metrics;
pub mod wire;

use crate::agent::{Agent, Event, Finish, Outcome, Route, StreamedCalls, Turn};
use crate::upstream::Upstreams;
use auth::{ApiKey, Keys};
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, Uri, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
pub use error::ApiError;
use metrics::Metrics;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use thorn_engine::sample::SamplingParams;
use thorn_tools::chat::{FunctionCall, Message, Role, ToolCall};
use thorn_tools::{ResponseFormat, ToolChoice};
use tokio::sync::mpsc;

pub use listen::{HttpLimits, Peer, serve};

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
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            keys: Keys::default(),
            max_body: 8 << 20,
            metrics_auth: false,
            http: HttpLimits::default(),
            mcp: mcp::McpHttp::default(),
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
        }
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn new_id(prefix: &str) -> String {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}-{:016x}{:08x}", t ^ (n << 40), n as u32)
}

/// The router with every route (bodies are read by `read_body`, under its limits).
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .with_state(Arc::clone(&state))
        .merge(mcp::routes(&state))
}

/// Sets the flag when dropped: a response that is dropped before it ends cancels its request.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Who sent a request: the key it presented (when keys are configured) and its address.
#[derive(Debug, Clone, Default)]
struct Caller {
    key: Option<ApiKey>,
    peer: Option<std::net::SocketAddr>,
}

fn authorize(st: &AppState, headers: &HeaderMap) -> Result<Option<ApiKey>, ApiError> {
    if st.config.keys.is_empty() {
        return Ok(None);
    }
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match key.and_then(|k| st.config.keys.check(k)) {
        Some(k) => Ok(Some(k.clone())),
        None => Err(ApiError::Unauthorized),
    }
}

/// Reads a request body: at most `max_body` bytes, within `body_timeout`, holding its share of the
/// server-wide budget for bodies in flight while it is read (released when the returned permit drops).
/// A declared length is reserved before any byte is read, so an over-budget upload is refused at once.
async fn read_body(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Bytes, tokio::sync::OwnedSemaphorePermit), ApiError> {
    use tokio_stream::StreamExt;
    let limit = st.config.max_body;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::TooLarge { limit });
    }
    let take = |n: usize| {
        let n = u32::try_from(n).map_err(|_| ApiError::TooLarge { limit })?;
        Arc::clone(&st.bodies)
            .try_acquire_many_owned(n)
            .map_err(|_| ApiError::BodiesBusy)
    };
    let reserved = declared.map_or(0, |n| n as usize);
    let mut held = take(reserved)?;
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(reserved);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad(format!("reading the body: {e}"), None))?;
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::TooLarge { limit });
            }
            // A body without a declared length takes its budget as it arrives.
            let over = (buf.len() + chunk.len()).saturating_sub(reserved.max(buf.len()));
            if over > 0 {
                held.merge(take(over)?);
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    match tokio::time::timeout(st.config.http.body_timeout, read).await {
        Ok(r) => r.map(|b| (b, held)),
        Err(_) => Err(ApiError::BodyTimeout {
            secs: st.config.http.body_timeout.as_secs(),
        }),
    }
}

fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = if inner.is_syntax() || inner.is_eof() {
            format!("the body is not valid JSON: {inner}")
        } else if path == "." {
            format!("invalid request: {inner}")
        } else {
            format!("invalid value for `{path}`: {inner}")
        };
        ApiError::bad(msg, (path != ".").then_some(path.as_str()))
    })
}

fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    if let Some(m) = model.filter(|m| *m != st.agent.model().name) {
        let upstream = st.upstreams.resolve(m).ok().flatten();
        if let Some(t) = upstream {
            return Err(ApiError::bad(
                format!(
                    "{m:?} is served by upstream {}: this route serves the local model only (use /v1/chat/completions)",
                    t.upstream.name()
                ),
                Some("model"),
            ));
        }
    }
    check_model_name(&st.agent.model().name, model)
}

/// The name of the routed model alias (with `--local-first`).
pub const AUTO_MODEL: &str = "auto";

/// The engine a request's `model` (and `thorn_model_class`) names: the local model by its name; an
/// upstream's by `NAME/MODEL`, `NAME` or a bare id it lists; and with `--local-first`, `auto` (or no
/// model) is the local model spilling to that upstream, `thorn_model_class: "large"` its model.
fn route_for(
    st: &AppState,
    model: Option<&str>,
    class: Option<&str>,
    key: Option<&ApiKey>,
) -> Result<Route, ApiError> {
    let route = route_by_name(st, model, class)?;
    let Some(k) = key else {
        return Ok(route);
    };
    Ok(match route {
        Route::LocalFirst(t) if !k.may_use_upstream(t.upstream.name()) => Route::Local,
        Route::Upstream(t) if !k.may_use_upstream(t.upstream.name()) => {
            return Err(ApiError::Forbidden(format!(
                "the API key {:?} may not use the upstream {:?}",
                k.id(),
                t.upstream.name()
            )));
        }
        r => r,
    })
}

fn route_by_name(
    st: &AppState,
    model: Option<&str>,
    class: Option<&str>,
) -> Result<Route, ApiError> {
    let local = &st.agent.model().name;
    let model = model.filter(|m| !m.is_empty());
    let open = model.is_none_or(|m| m == AUTO_MODEL && st.upstreams.local_first().is_some());
    match class {
        None => {}
        Some("small" | "local") if open => return Ok(Route::Local),
        Some("large") if open => {
            return match st.upstreams.large() {
                Ok(Some(t)) => Ok(Route::Upstream(t)),
                Ok(None) => Err(ApiError::bad(
                    "`thorn_model_class: \"large\"` needs a --local-first upstream, and this server has none",
                    Some("thorn_model_class"),
                )),
                Err(e) => Err(ApiError::Upstream(e)),
            };
        }
        Some("small" | "local" | "large") => {
            return Err(ApiError::bad(
                "`thorn_model_class` applies when `model` is left open (absent or \"auto\")",
                Some("thorn_model_class"),
            ));
        }
        Some(other) => {
            return Err(ApiError::bad(
                format!("`thorn_model_class` is \"small\" or \"large\", not {other:?}"),
                Some("thorn_model_class"),
            ));
        }
    }
    if open {
        // An upstream that has listed no model yet cannot take overflow: the request stays local.
        return Ok(match st.upstreams.large() {
            Ok(Some(t)) => Route::LocalFirst(t),
            _ => Route::Local,
        });
    }
    let m = model.expect("not open");
    if m == local {
        return Ok(Route::Local);
    }
    match st.upstreams.resolve(m) {
        Ok(Some(t)) => Ok(Route::Upstream(t)),
        Ok(None) => Err(ApiError::ModelNotFound(m.to_owned())),
        Err(e) => Err(ApiError::Upstream(e)),
    }
}

fn check_model_name(served: &str, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None | Some("") => Ok(()),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError::ModelNotFound(m.to_owned())),
    }
}

/// Records the status of every response; an error is rendered as OpenAI's body.
fn finish(st: &AppState, endpoint: &str, r: Result<Response, ApiError>) -> Response {
    finish_as(st, endpoint, r, ApiError::body)
}

/// [`finish`] with the error body `render` makes (Anthropic's, for its routes).
fn finish_as(
    st: &AppState,
    endpoint: &str,
    r: Result<Response, ApiError>,
    render: fn(&ApiError) -> serde_json::Value,
) -> Response {
    let r = match r {
        Ok(r) => r,
        Err(ApiError::TooLarge { .. }) => {
            let e = ApiError::TooLarge {
                limit: st.config.max_body,
            };
            e.respond(render(&e))
        }
        Err(e) => e.respond(render(&e)),
    };
    st.metrics.request(endpoint, r.status().as_u16());
    r
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let e = st.agent.engine();
    let upstreams = st
        .upstreams
        .iter()
        .map(|u| {
            let h = u.health();
            wire::UpstreamHealth {
                name: u.name().to_owned(),
                up: h.up,
                error: h.error,
                circuit: u.circuit(),
                in_flight: u.stats().in_flight.load(Ordering::Relaxed),
                models: u.models(),
            }
        })
        .collect();
    Json(wire::Health {
        status: "ok",
        model: &st.agent.model().name,
        queue_depth: e.waiting(),
        busy: e.busy(),
        plugins: st.agent.plugins().plugins().len(),
        mcp_servers: st.agent.plugins().servers().len(),
        upstreams,
    })
    .into_response()
}

async fn metrics_text(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if st.config.metrics_auth {
        match authorize(&st, &headers) {
            Err(e) => return e.into_response(),
            Ok(Some(k)) if !k.may_read_metrics() => {
                return ApiError::Forbidden(format!(
                    "the API key {:?} may not read /metrics",
                    k.id()
                ))
                .into_response();
            }
            Ok(_) => {}
        }
    }
    let e = st.agent.engine();
    let mut text = st.metrics.render(&metrics::EngineGauges::of(e));
    metrics::render_upstreams(&st.upstreams, &mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Every model a request may name: the local one, `auto` with `--local-first`, each upstream's as
/// `NAME/MODEL`.
fn model_objects(st: &AppState) -> Vec<wire::ModelObject> {
    let object = |id: String, owned_by: &str, context_length| wire::ModelObject {
        id,
        object: "model",
        created: st.started,
        owned_by: owned_by.to_owned(),
        context_length,
    };
    let mut all = vec![object(
        st.agent.model().name.clone(),
        "thorn",
        Some(st.agent.model().context),
    )];
    if st.upstreams.local_first().is_some() {
        all.push(object(AUTO_MODEL.to_owned(), "thorn", None));
    }
    for u in st.upstreams.iter() {
        for m in u.models() {
            all.push(object(format!("{}/{m}", u.name()), u.name(), None));
        }
    }
    all
}

async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let r = authorize(&st, &headers).map(|_| {
        Json(wire::ModelList {
            object: "list",
            data: model_objects(&st),
        })
        .into_response()
    });
    finish(&st, "/v1/models", r)
}

async fn model(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = authorize(&st, &headers).and_then(|_| {
        model_objects(&st)
            .into_iter()
            .find(|m| m.id == id)
            .map(|m| Json(m).into_response())
            .ok_or(ApiError::ModelNotFound(id))
    });
    finish(&st, "/v1/models", r)
}

async fn not_found(State(st): State<Arc<AppState>>, uri: Uri) -> Response {
    finish(&st, "other", Err(ApiError::NotFound(uri.path().to_owned())))
}

fn role_of(s: &str, i: usize) -> Result<Role, ApiError> {
    Ok(match s {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        other => {
            return Err(ApiError::bad(
                format!("unknown role {other:?}"),
                Some(&format!("messages[{i}].role")),
            ));
        }
    })
}

fn messages_of(wire: Vec<wire::WireMessage>) -> Result<Vec<Message>, ApiError> {
    if wire.is_empty() {
        return Err(ApiError::bad(
            "`messages` must not be empty",
            Some("messages"),
        ));
    }
    let mut out = Vec::with_capacity(wire.len());
    for (i, m) in wire.into_iter().enumerate() {
        let role = role_of(&m.role, i)?;
        let content = match m.content {
            None => String::new(),
            Some(wire::Content::Text(t)) => t,
            Some(wire::Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad(
                            format!(
                                "content parts of type {:?} are not supported (text only)",
                                p.kind
                            ),
                            Some(&format!("messages[{i}].content")),
                        ));
                    }
                    t.push_str(p.text.as_deref().unwrap_or(""));
                }
                t
            }
        };
        let mut msg = Message::new(role, content);
        for (j, c) in m.tool_calls.unwrap_or_default().into_iter().enumerate() {
            let args = if c.function.arguments.trim().is_empty() {
                json!({})
            } else {
                serde_json::from_str(&c.function.arguments).map_err(|e| {
                    ApiError::bad(
                        format!("tool call arguments are not JSON: {e}"),
                        Some(&format!("messages[{i}].tool_calls[{j}].function.arguments")),
                    )
                })?
            };
            msg.tool_calls.push(ToolCall {
                id: c.id,
                kind: "function",
                function: FunctionCall {
                    name: c.function.name,
                    arguments: args,
                },
            });
        }
        msg.tool_call_id = m.tool_call_id;
        msg.name = m.name;
        msg.reasoning_content = m.reasoning_content.filter(|_| role == Role::Assistant);
        out.push(msg);
    }
    Ok(out)
}

/// The namespace that asks for a host tool.
pub const HOST_TOOL_PREFIX: &str = "thorn:";

/// Splits the request's tools into definitions for the model and the names the host runs. Host tools are
/// the `thorn:`-named ones only (a plugin name first, else a function name); `key` limits which.
fn tools_of(
    plugins: &thorn_plugin::PluginSet,
    tools: Vec<Value>,
    key: Option<&ApiKey>,
) -> Result<(Vec<Value>, Vec<String>), ApiError> {
    let mut client = Vec::new();
    let mut defs = Vec::new();
    let mut host: Vec<String> = Vec::new();
    for (i, t) in tools.into_iter().enumerate() {
        let param = format!("tools[{i}]");
        let name = t["function"]["name"].as_str().unwrap_or("").to_owned();
        if t["type"] != "function" || name.is_empty() {
            return Err(ApiError::bad(
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                Some(&param),
            ));
        }
        let Some(wanted) = name.strip_prefix(HOST_TOOL_PREFIX) else {
            client.push(name);
            defs.push(t);
            continue;
        };
        let functions: Vec<(&str, &str)> = if let Some(p) = plugins.provider_named(wanted) {
            p.manifest()
                .functions
                .iter()
                .map(|f| (p.name(), f.name.as_str()))
                .collect()
        } else if let Some(p) = plugins.provider_for(wanted) {
            vec![(p.name(), wanted)]
        } else {
            return Err(ApiError::bad(
                format!("{name:?}: no installed plugin or plugin function is called {wanted:?}"),
                Some(&param),
            ));
        };
        for (plugin, function) in functions {
            if let Some(k) = key.filter(|k| !k.may_use(plugin, function)) {
                return Err(ApiError::Forbidden(format!(
                    "the API key {:?} may not use the host tool {function:?} (plugin {plugin:?})",
                    k.id()
                )));
            }
            if host.iter().any(|h| h == function) {
                continue;
            }
            let def = plugins
                .tools()
                .definitions()
                .iter()
                .find(|d| d["function"]["name"] == function)
                .ok_or_else(|| ApiError::Internal(format!("no definition for {function:?}")))?;
            host.push(function.to_owned());
            defs.push(def.clone());
        }
    }
    if let Some(c) = client.iter().find(|c| host.contains(c)) {
        return Err(ApiError::bad(
            format!("the client tool {c:?} has the name of a requested host tool; rename one"),
            Some("tools"),
        ));
    }
    Ok((defs, host))
}

/// The audit log's conversation id: `conversation_id` (checked: 1 to 128 of `A-Z a-z 0-9 . _ : -`), else
/// `user-` and a digest of OpenAI's free-form `user` field (so any `user` value is accepted and none is
/// written to the log verbatim).
fn conversation_of(id: Option<String>, user: Option<String>) -> Result<Option<String>, ApiError> {
    use sha2::Digest;
    if let Some(id) = id {
        thorn_plugin::validate_conversation_id(&id)
            .map_err(|e| ApiError::bad(e.to_string(), Some("conversation_id")))?;
        return Ok(Some(id));
    }
    Ok(user.map(|u| {
        let d = sha2::Sha256::digest(u.as_bytes());
        let hex: String = d[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("user-{hex}")
    }))
}

fn in_range(v: Option<f32>, lo: f32, hi: f32, name: &str) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::bad(
            format!("`{name}` must be between {lo} and {hi}, got {x}"),
            Some(name),
        )),
        _ => Ok(()),
    }
}

struct Shape {
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

fn sampling(
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<i64>,
    presence: Option<f32>,
    frequency: Option<f32>,
) -> Result<SamplingParams, ApiError> {
    in_range(temperature, 0.0, 2.0, "temperature")?;
    in_range(top_p, 0.0, 1.0, "top_p")?;
    in_range(presence, -2.0, 2.0, "presence_penalty")?;
    in_range(frequency, -2.0, 2.0, "frequency_penalty")?;
    Ok(SamplingParams {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        seed: seed.map(|s| s as u64),
        presence_penalty: presence.unwrap_or(0.0),
        frequency_penalty: frequency.unwrap_or(0.0),
        ..SamplingParams::default()
    })
}

fn stops(stop: Option<wire::Stop>) -> Result<Vec<String>, ApiError> {
    let v = stop.map(wire::Stop::into_vec).unwrap_or_default();
    use thorn_engine::engine::{MAX_STOP_BYTES, MAX_STOPS};
    if v.len() > MAX_STOPS || v.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            format!(
                "`stop` takes up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_BYTES} bytes"
            ),
            Some("stop"),
        ));
    }
    Ok(v)
}

/// Reads a body (under [`read_body`]'s limits) and parses it as `T`; the body's budget is released at once.
async fn read_json<T: DeserializeOwned>(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, ApiError> {
    let (bytes, _permit) = read_body(st, headers, body).await?;
    parse_body(&bytes)
}

/// The error a streamed response ends with when its calls were not the ones returned (the grammar makes
/// that a bug, never a model's slip): clients must not take the deltas sent as the answer.
fn stream_error(out: &Outcome) -> Option<ApiError> {
    match &out.streamed {
        StreamedCalls::Mismatch(why) => {
            Some(ApiError::Internal(format!("streamed tool calls: {why}")))
        }
        _ => None,
    }
}

/// Parses a chat request body as the server does (for tools and fuzzing: the same errors, the same paths).
pub fn parse_chat_request(body: &[u8]) -> Result<wire::ChatRequest, ApiError> {
    parse_body(body)
}

/// The agent's turn for a chat request, checked as the server checks it, for a server of `model` with
/// `plugins` installed and no API keys.
pub fn chat_turn(
    model: &str,
    plugins: Arc<thorn_plugin::PluginSet>,
    r: wire::ChatRequest,
) -> Result<Turn, ApiError> {
    check_model_name(model, r.model.as_deref())?;
    turn_from(plugins, r, &Caller::default(), Route::Local).map(|(t, _)| t)
}

fn turn_of(
    st: &AppState,
    r: wire::ChatRequest,
    caller: &Caller,
) -> Result<(Turn, Shape), ApiError> {
    let opts = r.thorn_tool_use;
    let route = route_for(
        st,
        r.model.as_deref(),
        r.thorn_model_class.as_deref(),
        caller.key.as_ref(),
    )?;
    let (mut turn, shape) = turn_from(st.agent.plugins(), r, caller, route)?;
    turn.tool_use = opts.map(|o| o.over(st.agent.tool_use()));
    Ok((turn, shape))
}

fn turn_from(
    plugins: Arc<thorn_plugin::PluginSet>,
    r: wire::ChatRequest,
    caller: &Caller,
    route: Route,
) -> Result<(Turn, Shape), ApiError> {
    if r.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only n = 1 is supported", Some("n")));
    }
    let top_logprobs = r.top_logprobs.unwrap_or(0);
    if top_logprobs > 20 {
        return Err(ApiError::bad(
            "`top_logprobs` must be at most 20",
            Some("top_logprobs"),
        ));
    }
    let logprobs = r.logprobs.unwrap_or(false);
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::bad(
            "`top_logprobs` needs `logprobs: true`",
            Some("top_logprobs"),
        ));
    }
    in_range(r.min_p, 0.0, 1.0, "min_p")?;
    let mut sampling = sampling(
        r.temperature,
        r.top_p,
        r.seed,
        r.presence_penalty,
        r.frequency_penalty,
    )?;
    sampling.top_k = r.top_k.unwrap_or(0) as usize;
    sampling.min_p = r.min_p.unwrap_or(0.0);
    sampling.repetition_penalty = r.repetition_penalty.unwrap_or(1.0);
    sampling.top_logprobs = top_logprobs as usize;
    let (tools, host_tools) = tools_of(&plugins, r.tools.unwrap_or_default(), caller.key.as_ref())?;
    let tool_choice = match &r.tool_choice {
        None => ToolChoice::Auto,
        Some(v) => ToolChoice::from_openai(v)
            .map_err(|e| ApiError::bad(e.to_string(), Some("tool_choice")))?,
    };
    let response_format = match &r.response_format {
        None => ResponseFormat::Text,
        Some(v) => ResponseFormat::from_openai(v)
            .map_err(|e| ApiError::bad(e.to_string(), Some("response_format")))?,
    };
    let max_tokens = r.max_completion_tokens.or(r.max_tokens);
    if max_tokens == Some(0) {
        return Err(ApiError::bad(
            "`max_tokens` must be at least 1",
            Some("max_tokens"),
        ));
    }
    let shape = Shape {
        stream: r.stream.unwrap_or(false),
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
        logprobs,
    };
    let turn = Turn {
        messages: messages_of(r.messages)?,
        tools,
        host_tools,
        tool_choice,
        parallel_tool_calls: r.parallel_tool_calls.unwrap_or(true),
        response_format,
        sampling,
        max_tokens: max_tokens.map_or(usize::MAX, |n| n as usize),
        stop: stops(r.stop)?,
        max_tool_rounds: r.max_tool_rounds.map(|n| n as usize),
        conversation: conversation_of(r.conversation_id, r.user)?,
        key_id: caller.key.as_ref().map(|k| k.id().to_owned()),
        peer: caller.peer.map(|p| p.to_string()),
        logprobs,
        speculation: r.speculation.unwrap_or(true),
        plugins,
        // Set by `turn_of`, over the server's default.
        tool_use: None,
        route,
    };
    Ok((turn, shape))
}

/// Updates the metrics with a finished request. Time to first token runs from the request's arrival to its
/// first sampled token of any kind (text or a tool call), so replies that are tool calls count too.
fn account(st: &AppState, out: &Outcome, t0: Instant) {
    st.metrics.tokens(&out.usage);
    if let Some(u) = &out.served.upstream {
        st.metrics.routed(u, out.served.spilled.unwrap_or("model"));
    }
    for h in &out.host_calls {
        st.metrics
            .plugin_call(&h.call.function.name, h.error_kind.unwrap_or("ok"));
    }
    if let Some(f) = out.first_token {
        st.metrics
            .ttft(f.saturating_duration_since(t0).as_secs_f64());
        if out.usage.completion_tokens > 1 {
            st.metrics
                .tpot(f.elapsed().as_secs_f64() / (out.usage.completion_tokens - 1) as f64);
        }
    }
}

/// Runs `work` (a chat turn or a completion) on a task of its own, forwarding its events; the first message
/// is either `Started` or the error that kept it from starting.
type Work = Box<
    dyn FnOnce(
            Arc<AppState>,
            Arc<AtomicBool>,
            mpsc::UnboundedSender<Msg>,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;

enum Msg {
    Event(Event),
    Done(Box<Result<Outcome, ApiError>>),
}

fn spawn(st: &Arc<AppState>, work: Work) -> (mpsc::UnboundedReceiver<Msg>, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    tokio::spawn(work(Arc::clone(st), Arc::clone(&cancel), tx));
    (rx, cancel)
}

/// Counts a request its client abandoned (whoever was reading its events may be gone).
fn note_cancel(st: &AppState, out: &Result<Outcome, crate::agent::AgentError>) {
    if out.as_ref().is_ok_and(|o| o.finish == Finish::Cancelled) {
        st.metrics.cancelled();
    }
}

fn chat_work(turn: Turn) -> Work {
    Box::new(move |st, cancel, tx| {
        Box::pin(async move {
            let t2 = tx.clone();
            let out = st
                .agent
                .run(turn, cancel, &mut |e| {
                    let _ = t2.send(Msg::Event(e));
                })
                .await;
            note_cancel(&st, &out);
            let _ = tx.send(Msg::Done(Box::new(out.map_err(ApiError::from))));
        })
    })
}

fn completion_work(prompt: String, turn: Turn) -> Work {
    Box::new(move |st, cancel, tx| {
        Box::pin(async move {
            let t2 = tx.clone();
            let out = st
                .agent
                .complete(prompt, &turn, cancel, &mut |e| {
                    let _ = t2.send(Msg::Event(e));
                })
                .await;
            note_cancel(&st, &out);
            let _ = tx.send(Msg::Done(Box::new(out.map_err(ApiError::from))));
        })
    })
}

/// What a request's work said first: it started (with the model serving it), or it already ended.
enum Early {
    /// It started: its first events follow.
    Started(String),
    /// It ended before it started streaming.
    Done(Box<Outcome>),
}

impl Early {
    /// The outcome, if it already ended.
    fn outcome(self) -> Option<Outcome> {
        match self {
            Early::Done(o) => Some(*o),
            Early::Started(_) => None,
        }
    }

    /// The model serving the request (as the response names it), and the outcome if it already ended.
    fn split(self, st: &AppState) -> (String, Option<Outcome>) {
        match self {
            Early::Started(m) if m.is_empty() => (st.agent.model().name.clone(), None),
            Early::Started(m) => (m, None),
            Early::Done(o) => (o.served.model.clone(), Some(*o)),
        }
    }
}

/// Waits for the work to start, or the error that stopped it.
async fn started(rx: &mut mpsc::UnboundedReceiver<Msg>) -> Result<Early, ApiError> {
    match rx.recv().await {
        Some(Msg::Event(Event::Started { model, .. })) => Ok(Early::Started(model)),
        Some(Msg::Done(out)) => (*out).map(|o| Early::Done(Box::new(o))),
        Some(Msg::Event(_)) => Ok(Early::Started(String::new())),
        None => Err(ApiError::Internal(
            "the request ended without an answer".into(),
        )),
    }
}

async fn chat(
    State(st): State<Arc<AppState>>,
    peer: Option<Extension<Peer>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        let caller = Caller {
            key: authorize(&st, &headers)?,
            peer: peer.map(|Extension(Peer(p))| p),
        };
        let req: wire::ChatRequest = read_json(&st, &headers, body).await?;
        let (turn, shape) = turn_of(&st, req, &caller)?;
        let t0 = Instant::now();
        let (mut rx, cancel) = spawn(&st, chat_work(turn));
        let guard = CancelOnDrop(cancel);
        let early = started(&mut rx).await?;
        let id = new_id("chatcmpl");
        if shape.stream {
            Ok(stream_chat(
                Arc::clone(&st),
                rx,
                guard,
                id,
                shape,
                t0,
                early,
            ))
        } else {
            let out = match early.outcome() {
                Some(o) => o,
                None => collect(&mut rx).await?,
            };
            account(&st, &out, t0);
            drop(guard);
            Ok(Json(chat_json(&id, &out, &shape)).into_response())
        }
    }
    .await;
    finish(&st, "/v1/chat/completions", r)
}

/// Reads events to the end: the outcome.
async fn collect(rx: &mut mpsc::UnboundedReceiver<Msg>) -> Result<Outcome, ApiError> {
    while let Some(m) = rx.recv().await {
        match m {
            Msg::Event(_) => {}
            Msg::Done(out) => return *out,
        }
    }
    Err(ApiError::Internal(
        "the request ended without an answer".into(),
    ))
}

fn chat_json<'a>(id: &'a str, out: &'a Outcome, shape: &Shape) -> wire::ChatCompletion<'a> {
    let only_calls = out.content.is_empty() && !out.tool_calls.is_empty();
    wire::ChatCompletion {
        id,
        object: "chat.completion",
        created: unix_now(),
        model: &out.served.model,
        system_fingerprint: wire::FINGERPRINT,
        choices: [wire::ChatChoice {
            index: 0,
            message: wire::AssistantMessage {
                role: "assistant",
                content: (!only_calls).then_some(out.content.as_str()),
                refusal: None,
                tool_calls: out.tool_calls.iter().map(wire::ToolCallOut::of).collect(),
                thorn_host_tool_calls: out.host_calls.iter().map(wire::HostCallOut::of).collect(),
                reasoning_content: (!out.reasoning.is_empty()).then_some(out.reasoning.as_str()),
                thorn_routed_tools: out.routed.as_deref(),
            },
            logprobs: shape
                .logprobs
                .then(|| wire::ChatLogprobs::of(&out.logprobs)),
            finish_reason: out.finish.as_str(),
        }],
        usage: wire::WireUsage::from(out.usage),
    }
}

fn sse_json(v: &impl serde::Serialize) -> Result<SseEvent, Infallible> {
    let text = serde_json::to_string(v).unwrap_or_else(|e| {
        // Our own types always serialize; say so on the stream rather than send nothing.
        ApiError::Internal(format!("response serialization: {e}"))
            .body()
            .to_string()
    });
    Ok(SseEvent::default().data(text))
}

fn stream_chat(
    st: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    guard: CancelOnDrop,
    id: String,
    shape: Shape,
    t0: Instant,
    early: Early,
) -> Response {
    let (model, early) = early.split(&st);
    let created = unix_now();
    // One chunk, serialized at once (its fields borrow what the event carried).
    let chunk = move |delta: wire::Delta<'_>,
                      finish: Option<&'static str>,
                      logprobs: Option<wire::ChatLogprobs<'_>>,
                      usage: Option<wire::WireUsage>| {
        let choices = match usage {
            // The usage chunk has no choice.
            Some(_) => Vec::new(),
            None => vec![wire::ChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason: finish,
            }],
        };
        sse_json(&wire::ChatChunk {
            id: &id,
            object: "chat.completion.chunk",
            created,
            model: &model,
            system_fingerprint: wire::FINGERPRINT,
            choices,
            usage,
        })
    };
    let (tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let send = |ev: Result<SseEvent, Infallible>| {
            let tx = tx.clone();
            async move { tx.send(ev).await.is_ok() }
        };
        let first = wire::Delta {
            role: Some("assistant"),
            content: Some(""),
            ..wire::Delta::default()
        };
        if !send(chunk(first, None, None, None)).await {
            return;
        }
        // Client calls whose deltas went out as they were generated.
        let mut client_calls = 0usize;
        let outcome = match early {
            Some(o) => Ok(o),
            None => loop {
                match rx.recv().await {
                    Some(Msg::Event(Event::Content(t))) => {
                        let d = wire::Delta {
                            content: Some(&t),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::Reasoning(t))) => {
                        let d = wire::Delta {
                            reasoning_content: Some(&t),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::CallStart {
                        host,
                        index,
                        id,
                        name,
                    })) => {
                        if !host {
                            client_calls += 1;
                        }
                        let d =
                            wire::Delta::call(host, wire::ToolCallDelta::start(index, &id, &name));
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::CallArguments { host, index, text })) => {
                        let d =
                            wire::Delta::call(host, wire::ToolCallDelta::arguments(index, &text));
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::HostCall(c))) => {
                        let d = wire::Delta {
                            thorn_host_tool_call: Some(wire::HostCallOut::started(&c)),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::HostResult(h))) => {
                        let d = wire::Delta {
                            thorn_host_tool_result: Some(wire::HostCallOut::of(&h)),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::Started { .. })) => {}
                    Some(Msg::Done(o)) => break *o,
                    None => {
                        break Err(ApiError::Internal(
                            "the request ended without an answer".into(),
                        ));
                    }
                }
            },
        };
        match outcome {
            Ok(out) if stream_error(&out).is_some() => {
                account(&st, &out, t0);
                let e = stream_error(&out).expect("checked");
                let _ = tx.send(sse_json(&e.body())).await;
            }
            Ok(out) => {
                account(&st, &out, t0);
                // Calls not streamed (none are, unless this is a bug) go out whole, as one delta each.
                let args: Vec<String> = out
                    .tool_calls
                    .iter()
                    .map(|c| c.function.arguments.to_string())
                    .collect();
                for (i, (c, a)) in out
                    .tool_calls
                    .iter()
                    .zip(&args)
                    .enumerate()
                    .skip(client_calls)
                {
                    let mut whole = wire::ToolCallDelta::start(i, &c.id, &c.function.name);
                    whole.function.arguments = a;
                    let d = wire::Delta::call(false, whole);
                    if !send(chunk(d, None, None, None)).await {
                        return;
                    }
                }
                // A call cut off by max_tokens was streamed in part: the response ends at its length.
                let finish = match out.streamed {
                    StreamedCalls::Truncated => "length",
                    _ => out.finish.as_str(),
                };
                let logprobs = shape
                    .logprobs
                    .then(|| wire::ChatLogprobs::of(&out.logprobs));
                let last = chunk(wire::Delta::default(), Some(finish), logprobs, None);
                if !send(last).await {
                    return;
                }
                if shape.include_usage {
                    let u = chunk(
                        wire::Delta::default(),
                        None,
                        None,
                        Some(wire::WireUsage::from(out.usage)),
                    );
                    if !send(u).await {
                        return;
                    }
                }
            }
            Err(e) => {
                // Headers are gone; the error travels as an event, as OpenAI does.
                let _ = tx.send(sse_json(&e.body())).await;
            }
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        authorize(&st, &headers)?;
        let req: wire::CompletionRequest = read_json(&st, &headers, body).await?;
        check_model(&st, req.model.as_deref())?;
        if req.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("only n = 1 is supported", Some("n")));
        }
        if req.echo == Some(true) {
            return Err(ApiError::bad("`echo` is not supported", Some("echo")));
        }
        let prompt = match req.prompt {
            wire::Prompt::One(p) => p,
            wire::Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
            wire::Prompt::Many(_) => {
                return Err(ApiError::bad(
                    "only one prompt is supported",
                    Some("prompt"),
                ));
            }
        };
        let top = req.logprobs.unwrap_or(0);
        if top > 5 {
            return Err(ApiError::bad(
                "`logprobs` must be at most 5",
                Some("logprobs"),
            ));
        }
        let mut s = sampling(
            req.temperature,
            req.top_p,
            req.seed,
            req.presence_penalty,
            req.frequency_penalty,
        )?;
        s.top_logprobs = top as usize;
        let turn = Turn {
            messages: Vec::new(),
            tools: Vec::new(),
            host_tools: Vec::new(),
            tool_choice: ToolChoice::None,
            parallel_tool_calls: false,
            response_format: ResponseFormat::Text,
            sampling: s,
            max_tokens: req.max_tokens.unwrap_or(16).max(1) as usize,
            stop: stops(req.stop)?,
            max_tool_rounds: Some(0),
            conversation: None,
            key_id: None,
            peer: None,
            logprobs: req.logprobs.is_some(),
            speculation: req.speculation.unwrap_or(true),
            tool_use: None,
            plugins: st.agent.plugins(),
            route: Route::Local,
        };
        let shape = Shape {
            stream: req.stream.unwrap_or(false),
            include_usage: req.stream_options.is_some_and(|o| o.include_usage),
            logprobs: req.logprobs.is_some(),
        };
        let t0 = Instant::now();
        let (mut rx, cancel) = spawn(&st, completion_work(prompt, turn));
        let guard = CancelOnDrop(cancel);
        let (model, early) = started(&mut rx).await?.split(&st);
        let id = new_id("cmpl");
        let created = unix_now();
        if !shape.stream {
            let out = match early {
                Some(o) => o,
                None => collect(&mut rx).await?,
            };
            account(&st, &out, t0);
            drop(guard);
            return Ok(Json(wire::TextCompletion::new(
                &id,
                created,
                &model,
                &out.content,
                Some(out.finish.as_str()),
                shape
                    .logprobs
                    .then(|| wire::LegacyLogprobs::of(&out.logprobs)),
                Some(wire::WireUsage::from(out.usage)),
            ))
            .into_response());
        }
        let body = move |text: &str,
                         finish: Option<&'static str>,
                         logprobs: Option<wire::LegacyLogprobs>,
                         usage: Option<wire::WireUsage>| {
            sse_json(&wire::TextCompletion::new(
                &id, created, &model, text, finish, logprobs, usage,
            ))
        };
        let (tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
        let st2 = Arc::clone(&st);
        tokio::spawn(async move {
            let _guard = guard;
            let outcome = match early {
                Some(o) => Ok(o),
                None => loop {
                    match rx.recv().await {
                        Some(Msg::Event(Event::Content(t))) => {
                            if tx.send(body(&t, None, None, None)).await.is_err() {
                                return;
                            }
                        }
                        Some(Msg::Event(_)) => {}
                        Some(Msg::Done(o)) => break *o,
                        None => {
                            break Err(ApiError::Internal("the request ended early".into()));
                        }
                    }
                },
            };
            match outcome {
                Ok(out) => {
                    account(&st2, &out, t0);
                    let usage = shape
                        .include_usage
                        .then(|| wire::WireUsage::from(out.usage));
                    let last = body("", Some(out.finish.as_str()), None, usage);
                    if tx.send(last).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(sse_json(&e.body())).await;
                }
            }
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        });
        Ok(
            Sse::new(tokio_stream::wrappers::ReceiverStream::new(out_rx))
                .keep_alive(KeepAlive::default())
                .into_response(),
        )
    }
    .await;
    finish(&st, "/v1/completions", r)
}
