//! Upstream engines: OpenAI-compatible servers elsewhere (vLLM, SGLang, llama-server, another thorn) as
//! the engine behind thorn's agent loop.
//!
//! thorn does not grow a distributed engine of its own; it puts its agent loop in front of existing ones.
//! A request for an upstream's model runs the same [`crate::agent`] loop as a local one, with each
//! generation round sent upstream instead of to the engine thread: the conversation and the tool
//! definitions go upstream (constrained decoding asked for through `tool_choice` and `response_format`,
//! which vLLM, SGLang and llama-server honour), the answer streams back ([`Upstream::round`]), and the
//! agent validates every tool call against its schema here, runs host tools in their sandbox here, and
//! sends the results back up for the next round. Nothing upstream ever reaches a plugin unchecked.
//!
//! Each [`Upstream`] bounds what it is given: requests in flight ([`Upstream::lease`], beyond it 503),
//! time to the response's start and silence between stream events (a hung upstream is a 504, not a hung
//! client), bytes per answer and per event ([`sse`]), calls per answer ([`round::MAX_CALLS`]); a
//! [`breaker::Breaker`] stops sending to one that keeps failing, and a health check
//! ([`Upstream::health_loop`]) re-lists its models and finds it again when it recovers. Every failure is
//! an [`UpstreamError`] that names the upstream; the API maps it to 502, 503 or 504 (or passes a client's
//! 4xx on as a 400) in OpenAI's error body.
//!
//! [`Upstreams`] is the set the server was started with: it resolves a request's `model` (`NAME/MODEL`,
//! a bare model id an upstream lists, or `NAME` for its first model) and names the `local-first`
//! upstream that takes the local model's overflow.

pub mod breaker;
mod error;
pub mod round;
mod set;
pub mod spec;
pub mod sse;
mod stats;

use breaker::{Admit, Breaker};
pub use error::{UpstreamError, Waited};
pub use round::{Delta, RoundOutput, RoundSpec, WireError};
use serde_json::Value;
pub use set::{Target, Upstreams};
pub use spec::{SpecError, UpstreamSpec};
pub use stats::{Health, UpstreamStats};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Whether `id` may name a model: 1 to 256 printable ASCII characters, no spaces.
pub fn valid_model_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 256 && id.bytes().all(|b| (0x21..0x7f).contains(&b))
}

/// Most models one upstream may list.
const MAX_MODELS: usize = 256;
/// Most bytes of an error body or a model list read from an upstream.
const MAX_SMALL_BODY: usize = 1 << 20;
/// Most bytes of one stream event.
const MAX_EVENT: usize = 4 << 20;
/// How often a request waiting on an upstream looks at its cancel flag.
const CANCEL_POLL: Duration = Duration::from_millis(100);

/// One upstream engine.
#[derive(Debug)]
pub struct Upstream {
    spec: UpstreamSpec,
    key: Option<String>,
    client: reqwest::Client,
    breaker: Breaker,
    permits: Arc<Semaphore>,
    models: RwLock<Vec<String>>,
    health: Mutex<Health>,
    stats: UpstreamStats,
}

/// A request's hold on one of an upstream's concurrency slots (for the whole turn, every round).
#[derive(Debug)]
pub struct Lease {
    upstream: Arc<Upstream>,
    _permit: OwnedSemaphorePermit,
}

impl Lease {
    /// The upstream.
    pub fn upstream(&self) -> &Arc<Upstream> {
        &self.upstream
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.upstream
            .stats
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Waits until `flag` is set.
async fn cancelled(flag: &AtomicBool) {
    while !flag.load(Ordering::Relaxed) {
        tokio::time::sleep(CANCEL_POLL).await;
    }
}

impl Upstream {
    /// An upstream for `spec`, its key read now.
    pub fn new(spec: UpstreamSpec) -> Result<Self, SpecError> {
        let key = spec.read_key()?;
        // The process's TLS for an https:// upstream (system roots plus --tls-ca).
        let client = thorn_plugin::tls::http_client()
            .connect_timeout(spec.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .pool_idle_timeout(Duration::from_secs(30))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| SpecError {
                spec: spec.name.clone(),
                why: format!("building its HTTP client: {e}"),
            })?;
        Ok(Upstream {
            breaker: Breaker::new(spec.failures, spec.cooldown),
            permits: Arc::new(Semaphore::new(spec.max_concurrent)),
            models: RwLock::new(spec.models.clone()),
            health: Mutex::default(),
            stats: UpstreamStats::new(),
            key,
            client,
            spec,
        })
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Its configuration.
    pub fn spec(&self) -> &UpstreamSpec {
        &self.spec
    }

    /// The models it serves (pinned, or as last listed).
    pub fn models(&self) -> Vec<String> {
        self.models
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether it lists `model`.
    pub fn has_model(&self, model: &str) -> bool {
        self.models
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|m| m == model)
    }

    /// The last health check's result.
    pub fn health(&self) -> Health {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Its circuit: `closed`, `open` or `half_open`.
    pub fn circuit(&self) -> &'static str {
        self.breaker.name()
    }

    /// Its counters.
    pub fn stats(&self) -> &UpstreamStats {
        &self.stats
    }

    /// Takes one of its concurrency slots for a turn: refused at once when all are taken or its circuit
    /// is open.
    pub fn lease(self: &Arc<Self>) -> Result<Lease, UpstreamError> {
        if let Some(wait) = self.breaker.refusing(Instant::now()) {
            self.stats.count("circuit_open");
            return Err(UpstreamError::CircuitOpen {
                name: self.spec.name.clone(),
                secs: wait.as_secs().max(1),
            });
        }
        let permit = Arc::clone(&self.permits).try_acquire_owned().map_err(|_| {
            self.stats.count("busy");
            UpstreamError::Busy {
                name: self.spec.name.clone(),
                limit: self.spec.max_concurrent,
            }
        })?;
        self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(Lease {
            upstream: Arc::clone(self),
            _permit: permit,
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self
            .client
            .request(method, format!("{}{path}", self.spec.base));
        match &self.key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    fn unreachable(&self, e: &reqwest::Error) -> UpstreamError {
        // reqwest's Display stops at its own layer; the cause (refused, reset) is below it.
        let mut why = e.to_string();
        let mut src = std::error::Error::source(e);
        while let Some(s) = src {
            why = format!("{why}: {s}");
            src = s.source();
        }
        UpstreamError::Unreachable {
            name: self.spec.name.clone(),
            why: round::clip(&why, 500),
        }
    }

    /// The next piece of a body (`None` at its end), waiting at most `idle`; `Gone` when `gone` (the
    /// client's cancel) fires first.
    async fn next_chunk(
        &self,
        resp: &mut reqwest::Response,
        idle: Duration,
        gone: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<Next, UpstreamError> {
        let chunk = tokio::select! {
            c = tokio::time::timeout(idle, resp.chunk()) => c.map_err(|_| UpstreamError::Timeout {
                name: self.spec.name.clone(),
                waited: Waited::Stream,
                after: idle,
            })?,
            () = gone => return Ok(Next::Gone),
        };
        match chunk {
            Ok(Some(b)) => Ok(Next::Bytes(b)),
            Ok(None) => Ok(Next::End),
            // A reset or a body cut short: it went away mid-answer.
            Err(_) => Err(UpstreamError::Closed {
                name: self.spec.name.clone(),
            }),
        }
    }

    /// A whole body of at most `limit` bytes, each piece within `idle`; `None` when `gone` fired.
    async fn read_body(
        &self,
        resp: &mut reqwest::Response,
        limit: usize,
        idle: Duration,
        mut gone: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<Option<Vec<u8>>, UpstreamError> {
        let mut body = Vec::new();
        loop {
            match self.next_chunk(resp, idle, gone.as_mut()).await? {
                Next::Bytes(b) if body.len() + b.len() > limit => {
                    return Err(self.too_long(limit));
                }
                Next::Bytes(b) => body.extend_from_slice(&b),
                Next::End => return Ok(Some(body)),
                Next::Gone => return Ok(None),
            }
        }
    }

    fn too_long(&self, limit: usize) -> UpstreamError {
        UpstreamError::Protocol {
            name: self.spec.name.clone(),
            why: format!("an answer longer than {limit} bytes"),
        }
    }

    /// A small body (an error body, a model list): at most [`MAX_SMALL_BODY`] bytes, all within `within`.
    async fn small_body(
        &self,
        mut resp: reqwest::Response,
        within: Duration,
    ) -> Result<Vec<u8>, UpstreamError> {
        let never = std::pin::pin!(std::future::pending::<()>());
        let read = self.read_body(&mut resp, MAX_SMALL_BODY, within, never);
        tokio::time::timeout(within, read)
            .await
            .map_err(|_| UpstreamError::Timeout {
                name: self.spec.name.clone(),
                waited: Waited::Stream,
                after: within,
            })?
            .map(Option::unwrap_or_default)
    }

    /// The error an upstream's non-success response stands for.
    async fn status_error(&self, resp: reqwest::Response) -> UpstreamError {
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok());
        let body = self
            .small_body(resp, self.spec.idle_timeout)
            .await
            .unwrap_or_default();
        let message = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| round::error_message(&v))
            .unwrap_or_else(|| round::clip(String::from_utf8_lossy(&body).trim(), 1000));
        UpstreamError::Status {
            name: self.spec.name.clone(),
            status,
            message: if message.is_empty() {
                "(no message)".into()
            } else {
                message
            },
            retry_after,
        }
    }

    /// Lists its models (`GET /models`): at most [`MAX_MODELS`] valid ids.
    pub async fn list_models(&self) -> Result<Vec<String>, UpstreamError> {
        let within = self.spec.timeout.min(Duration::from_secs(10));
        let resp =
            tokio::time::timeout(within, self.request(reqwest::Method::GET, "/models").send())
                .await
                .map_err(|_| UpstreamError::Timeout {
                    name: self.spec.name.clone(),
                    waited: Waited::Response,
                    after: within,
                })?
                .map_err(|e| self.unreachable(&e))?;
        if !resp.status().is_success() {
            return Err(self.status_error(resp).await);
        }
        let body = self.small_body(resp, within).await?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| UpstreamError::Protocol {
            name: self.spec.name.clone(),
            why: format!("GET /models is not JSON: {e}"),
        })?;
        let ids = v["data"]
            .as_array()
            .ok_or_else(|| UpstreamError::Protocol {
                name: self.spec.name.clone(),
                why: "GET /models has no \"data\" list".into(),
            })?
            .iter()
            .filter_map(|m| m["id"].as_str())
            .filter(|id| valid_model_id(id))
            .take(MAX_MODELS)
            .map(str::to_owned)
            .collect();
        Ok(ids)
    }

    /// One health check: lists the models (kept unless they are pinned) and tells the breaker.
    pub async fn check(&self) -> Result<(), UpstreamError> {
        let r = self.list_models().await;
        let mut h = self.health.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Ok(ids) => {
                self.breaker.success();
                if self.spec.models.is_empty() {
                    *self.models.write().unwrap_or_else(|p| p.into_inner()) = ids;
                }
                *h = Health {
                    up: Some(true),
                    error: None,
                };
                Ok(())
            }
            Err(e) => {
                if e.is_failure() {
                    self.breaker.failure(Instant::now());
                }
                *h = Health {
                    up: Some(false),
                    error: Some(e.to_string()),
                };
                Err(e)
            }
        }
    }

    /// Checks it every `health_interval` (none when that is zero), while its circuit lets a check go.
    pub async fn health_loop(self: Arc<Self>) {
        let every = self.spec.health_interval;
        if every.is_zero() {
            return;
        }
        loop {
            tokio::time::sleep(every).await;
            if self.breaker.probe_by_check(Instant::now())
                && let Err(e) = self.check().await
            {
                tracing::warn!(upstream = %self.spec.name, error = %e, "upstream health check failed");
            }
        }
    }

    /// Runs one generation round upstream, streaming: `on` sees text, reasoning and call deltas as they
    /// arrive. A set `cancel` flag ends it (the connection is dropped, which aborts the upstream's
    /// request) with [`RoundOutput::cancelled`].
    pub async fn round(
        &self,
        spec: &RoundSpec<'_>,
        cancel: &AtomicBool,
        on: &mut (dyn FnMut(Delta<'_>) + Send),
    ) -> Result<RoundOutput, UpstreamError> {
        let probe = match self.breaker.admit(Instant::now()) {
            Admit::Pass => false,
            Admit::Probe => true,
            Admit::Refused(wait) => {
                self.stats.count("circuit_open");
                return Err(UpstreamError::CircuitOpen {
                    name: self.spec.name.clone(),
                    secs: wait.as_secs().max(1),
                });
            }
        };
        let t0 = Instant::now();
        let r = self.round_inner(spec, cancel, on, t0).await;
        self.stats.latency.observe(t0.elapsed().as_secs_f64());
        match &r {
            Ok(o) if o.cancelled => {
                if probe {
                    self.breaker.release(Instant::now());
                }
                self.stats.count("cancelled");
            }
            Ok(_) => {
                self.breaker.success();
                self.stats.count("ok");
            }
            Err(e) => {
                if e.is_failure() {
                    self.breaker.failure(Instant::now());
                } else {
                    self.breaker.success();
                }
                self.stats.count(e.kind());
            }
        }
        r
    }

    async fn round_inner(
        &self,
        spec: &RoundSpec<'_>,
        cancel: &AtomicBool,
        on: &mut (dyn FnMut(Delta<'_>) + Send),
        t0: Instant,
    ) -> Result<RoundOutput, UpstreamError> {
        let name = || self.spec.name.clone();
        let abandoned = || RoundOutput {
            cancelled: true,
            ..RoundOutput::default()
        };
        let body = serde_json::to_vec(&round::request_body(spec)).map_err(|e| {
            UpstreamError::Protocol {
                name: name(),
                why: format!("serializing the request: {e}"),
            }
        })?;
        let send = self
            .request(reqwest::Method::POST, "/chat/completions")
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .body(body)
            .send();
        // The client's cancel, watched through the whole round.
        let mut gone = std::pin::pin!(cancelled(cancel));
        let mut resp = tokio::select! {
            r = tokio::time::timeout(self.spec.timeout, send) => r
                .map_err(|_| UpstreamError::Timeout { name: name(), waited: Waited::Response, after: self.spec.timeout })?
                .map_err(|e| self.unreachable(&e))?,
            () = gone.as_mut() => return Ok(abandoned()),
        };
        self.stats.first_byte.observe(t0.elapsed().as_secs_f64());
        if !resp.status().is_success() {
            return Err(self.status_error(resp).await);
        }
        on(Delta::Accepted);
        let streamed = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.starts_with("text/event-stream"));
        let mut out = RoundOutput::default();
        if !streamed {
            // A server that ignored `stream`: its whole answer, under the same bounds.
            let limit = self.spec.max_response;
            let idle = self.spec.idle_timeout;
            let Some(body) = self.read_body(&mut resp, limit, idle, gone).await? else {
                return Ok(abandoned());
            };
            let v: Value = serde_json::from_slice(&body).map_err(|e| UpstreamError::Protocol {
                name: name(),
                why: format!("the answer is neither an event stream nor JSON: {e}"),
            })?;
            out.whole(&v, &mut *on).map_err(|e| self.wire_error(e))?;
            return Ok(out);
        }
        let mut sse = sse::SseDecoder::new(MAX_EVENT.min(self.spec.max_response));
        let mut total = 0usize;
        while !out.done {
            let bytes = match self
                .next_chunk(&mut resp, self.spec.idle_timeout, gone.as_mut())
                .await?
            {
                Next::Bytes(b) => b,
                Next::End => break,
                Next::Gone => {
                    return Ok(RoundOutput {
                        cancelled: true,
                        ..out
                    });
                }
            };
            total += bytes.len();
            if total > self.spec.max_response {
                return Err(self.too_long(self.spec.max_response));
            }
            // Each event is taken as it completes; the first failure ends the round.
            let mut failed = None;
            sse.push(&bytes, &mut |data| {
                if failed.is_some() || out.done {
                    return;
                }
                if data.trim_ascii() == b"[DONE]" {
                    out.done = true;
                    return;
                }
                failed = round::parse_chunk(data)
                    .and_then(|c| out.chunk(&c, &mut *on))
                    .err()
                    .map(|e| self.wire_error(e));
            })
            .map_err(|t| UpstreamError::Protocol {
                name: name(),
                why: format!("a stream event longer than {} bytes", t.limit),
            })?;
            if let Some(e) = failed {
                return Err(e);
            }
        }
        if !out.done && out.finish.is_none() {
            return Err(UpstreamError::Closed { name: name() });
        }
        Ok(out)
    }

    fn wire_error(&self, e: WireError) -> UpstreamError {
        let name = self.spec.name.clone();
        match e {
            WireError::Reported(message) => UpstreamError::Reported { name, message },
            WireError::Invalid(why) => UpstreamError::Protocol { name, why },
        }
    }
}

/// What [`Upstream::next_chunk`] read.
enum Next {
    /// A piece of the body.
    Bytes(bytes::Bytes),
    /// The body's end.
    End,
    /// The client went away first.
    Gone,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstreams(specs: &[&str]) -> Upstreams {
        Upstreams::new(
            specs
                .iter()
                .map(|s| UpstreamSpec::parse(s).unwrap())
                .collect(),
            None,
        )
        .unwrap()
    }

    #[test]
    fn model_names_resolve_to_their_upstream() {
        let u = upstreams(&[
            "big=http://h:1,models=Qwen/Qwen3-8B|tiny",
            "other=http://h:2",
        ]);
        let t = u.resolve("big/Qwen/Qwen3-8B").unwrap().unwrap();
        assert_eq!(
            (t.upstream.name(), t.model.as_str()),
            ("big", "Qwen/Qwen3-8B")
        );
        assert_eq!(t.exposed(), "big/Qwen/Qwen3-8B");
        // NAME alone: its first model; a bare id it lists.
        assert_eq!(u.resolve("big").unwrap().unwrap().model, "Qwen/Qwen3-8B");
        assert_eq!(u.resolve("tiny").unwrap().unwrap().upstream.name(), "big");
        // A model big does not list is no model; one that lists none takes any.
        assert!(u.resolve("big/nope").unwrap().is_none());
        assert_eq!(u.resolve("other/x").unwrap().unwrap().model, "x");
        assert!(matches!(
            u.resolve("other"),
            Err(UpstreamError::NoModel { .. })
        ));
        assert!(u.resolve("unknown").unwrap().is_none());
    }

    #[test]
    fn the_local_first_upstream_must_exist_and_names_are_unique() {
        let spec = |s: &str| UpstreamSpec::parse(s).unwrap();
        assert!(Upstreams::new(vec![spec("a=http://h")], Some("b")).is_err());
        assert!(Upstreams::new(vec![spec("a=http://h"), spec("a=http://g")], None).is_err());
        let u = Upstreams::new(vec![spec("a=http://h,models=m")], Some("a")).unwrap();
        assert_eq!(u.large().unwrap().unwrap().model, "m");
    }

    #[test]
    fn leases_are_bounded_and_counted() {
        let u = Arc::new(
            Upstream::new(UpstreamSpec::parse("a=http://h,max_concurrent=2").unwrap()).unwrap(),
        );
        let a = u.lease().unwrap();
        let _b = u.lease().unwrap();
        assert_eq!(u.stats().in_flight.load(Ordering::Relaxed), 2);
        let e = u.lease().unwrap_err();
        assert!(matches!(e, UpstreamError::Busy { limit: 2, .. }), "{e}");
        assert!(!e.is_failure());
        drop(a);
        assert!(u.lease().is_ok());
        assert_eq!(u.stats().outcomes().get("busy"), Some(&1));
    }

    #[test]
    fn errors_name_the_upstream_and_only_its_faults_trip_the_circuit() {
        let status = |s: u16| UpstreamError::Status {
            name: "big".into(),
            status: s,
            message: "m".into(),
            retry_after: None,
        };
        assert!(!status(400).is_failure());
        assert!(status(401).is_failure());
        assert!(status(500).is_failure());
        assert_eq!(status(404).kind(), "status_4xx");
        let t = UpstreamError::Timeout {
            name: "big".into(),
            waited: Waited::Stream,
            after: Duration::from_millis(1500),
        };
        assert_eq!(
            t.to_string(),
            "upstream big sent nothing for 1.5 s in the middle of its answer"
        );
        assert_eq!(t.upstream(), "big");
    }

    /// A real socket that accepts and then says nothing: the round times out, and the breaker opens
    /// after the configured failures.
    #[tokio::test]
    async fn a_silent_upstream_times_out_and_opens_the_circuit() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = Arc::new(Mutex::new(Vec::new()));
        let keep = Arc::clone(&held);
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                keep.lock().unwrap().push(s);
            }
        });
        let spec = UpstreamSpec::parse(&format!(
            "slow=http://{addr},timeout=200ms,failures=2,cooldown=1h,models=m"
        ))
        .unwrap();
        let u = Arc::new(Upstream::new(spec).unwrap());
        let sampling = thorn_engine::sample::SamplingParams::default();
        let round = RoundSpec {
            model: "m",
            messages: &[],
            tools: &[],
            tool_choice: &thorn_tools::ToolChoice::Auto,
            parallel_tool_calls: true,
            response_format: &thorn_tools::ResponseFormat::Text,
            sampling: &sampling,
            max_tokens: Some(1),
            stop: &[],
            logprobs: false,
            template_kwargs: &serde_json::Map::new(),
        };
        let cancel = AtomicBool::new(false);
        for _ in 0..2 {
            let e = u.round(&round, &cancel, &mut |_| {}).await.unwrap_err();
            assert!(
                matches!(
                    e,
                    UpstreamError::Timeout {
                        waited: Waited::Response,
                        ..
                    }
                ),
                "{e}"
            );
        }
        assert_eq!(u.circuit(), "open");
        let e = u.round(&round, &cancel, &mut |_| {}).await.unwrap_err();
        assert!(matches!(e, UpstreamError::CircuitOpen { .. }), "{e}");
        assert!(matches!(u.lease(), Err(UpstreamError::CircuitOpen { .. })));
        assert_eq!(u.stats().outcomes().get("timeout"), Some(&2));
    }
}
