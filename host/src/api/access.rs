//! The access log: one line per request (one JSON object with `--log-format json`), written when the
//! request is over: its response sent (or its client gone) and its work ended.
//!
//! The layer gives each request an id (the client's `x-request-id` when it is a plain token, else a new
//! one, returned in the response's `x-request-id`), and a record the request's parts fill as they learn
//! things: the key's id (the [`Caller`](super::handler::Caller) extractor), the error (the dialect layer),
//! the model, the tokens, the time to first token and the tool calls (the request's work, when its
//! outcome is known). The line goes to the `thorn::access` target at INFO (`/health` and `/metrics`, which
//! are polled, at DEBUG): `THORN_LOG=warn,thorn::access=off` silences it.
//!
//! Every field is data from the request or the server: the JSON format escapes it, and the text format
//! quotes what a client chose (path, key id, model).

use super::{ApiError, AppState};
use crate::agent::Outcome;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;
use tracing::Instrument;

tokio::task_local! {
    static ACCESS: Arc<Access>;
}

/// The header that carries a request's id both ways.
const REQUEST_ID: &str = "x-request-id";

/// One request's record.
#[derive(Debug)]
pub(super) struct Access {
    id: String,
    method: Method,
    path: String,
    peer: Option<std::net::SocketAddr>,
    t0: Instant,
    st: Arc<AppState>,
    fields: Mutex<Fields>,
}

/// What the request's parts fill in.
#[derive(Debug, Default)]
struct Fields {
    status: u16,
    key: Option<String>,
    error: Option<&'static str>,
    model: Option<String>,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    ttft_ms: Option<f64>,
    rounds: usize,
    tool_calls: usize,
    host_calls: usize,
    finish: Option<&'static str>,
    /// The response's body was sent to its end (false: the client went away first).
    complete: bool,
    /// The request ran work (a turn or a completion).
    work: bool,
}

/// The record of the request being handled, if any (the handler's task; a request's work captures it
/// when it is spawned).
pub(super) fn current() -> Option<Arc<Access>> {
    ACCESS.try_with(Arc::clone).ok()
}

/// Fills in the current request's record.
fn note(f: impl FnOnce(&mut Fields)) {
    if let Some(a) = current() {
        a.with(f);
    }
}

/// The key a request presented.
pub(super) fn note_key(id: &str) {
    note(|f| f.key = Some(id.to_owned()));
}

/// The error a request failed with (its OpenAI `code`, else its `type`).
pub(super) fn note_error(e: &ApiError) {
    let code = e.log_code();
    note(|f| f.error = Some(code));
}

impl Access {
    fn with(&self, f: impl FnOnce(&mut Fields)) {
        f(&mut self.fields.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// The request's work begins.
    pub(super) fn work(&self) {
        self.with(|f| f.work = true);
    }

    /// The request's outcome (or the error that ended its work).
    pub(super) fn outcome(&self, out: &Result<Outcome, ApiError>) {
        let t0 = self.t0;
        self.with(|f| match out {
            Ok(o) => {
                f.model = Some(o.served.model.clone());
                f.prompt_tokens = o.usage.prompt_tokens;
                f.cached_tokens = o.usage.cached_tokens;
                f.completion_tokens = o.usage.completion_tokens;
                f.ttft_ms = o
                    .first_token
                    .map(|t| t.saturating_duration_since(t0).as_secs_f64() * 1e3);
                f.rounds = o.rounds;
                f.tool_calls = o.tool_calls.len();
                f.host_calls = o.host_calls.len();
                f.finish = Some(o.finish.as_str());
            }
            Err(e) => f.error = Some(e.log_code()),
        });
    }

    /// Writes the line.
    fn emit(&mut self) {
        let f = self.fields.get_mut().unwrap_or_else(|e| e.into_inner());
        let duration_ms = self.t0.elapsed().as_secs_f64() * 1e3;
        // Work the shutdown cut ended cancelled (or not at all); its client got `shutting_down`.
        let error = match (f.error, f.finish) {
            (None, None | Some("cancelled")) if f.work && self.st.shutdown.is_cut() => {
                Some("shutting_down")
            }
            (e, _) => e,
        };
        let polled = matches!(self.path.as_str(), "/health" | "/metrics");
        macro_rules! line {
            ($level:expr) => {
                tracing::event!(
                    target: "thorn::access",
                    $level,
                    id = %self.id,
                    method = %self.method,
                    route = %self.path,
                    status = f.status,
                    duration_ms = (duration_ms * 10.0).round() / 10.0,
                    peer = self.peer.map(tracing::field::display),
                    key = f.key.as_deref(),
                    model = f.model.as_deref(),
                    prompt_tokens = f.prompt_tokens,
                    cached_tokens = f.cached_tokens,
                    completion_tokens = f.completion_tokens,
                    ttft_ms = f.ttft_ms.map(|t| (t * 10.0).round() / 10.0),
                    rounds = f.rounds,
                    tool_calls = f.tool_calls,
                    host_calls = f.host_calls,
                    finish = f.finish,
                    error = error,
                    complete = f.complete,
                    "request"
                )
            };
        }
        if polled {
            line!(tracing::Level::DEBUG);
        } else {
            line!(tracing::Level::INFO);
        }
    }
}

/// A request id the client chose, when it is a plain token of at most 64 characters.
fn client_id(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    let plain = !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    plain.then(|| s.to_owned())
}

/// The layer around every route (the outermost one): the record, the id header, the line.
pub(super) async fn layer(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(REQUEST_ID)
        .and_then(client_id)
        .unwrap_or_else(|| super::handler::new_id("req"));
    let path: String = req.uri().path().chars().take(256).collect();
    let access = Arc::new(Access {
        id,
        method: req.method().clone(),
        path,
        peer: req.extensions().get::<super::Peer>().map(|p| p.0),
        t0: Instant::now(),
        st,
        fields: Mutex::new(Fields::default()),
    });
    // The request's span: its rounds and tool calls are its children (in the log and in OTLP traces).
    let span = tracing::info_span!(
        "request",
        id = %access.id,
        method = %access.method,
        route = %access.path,
    );
    let mut r = ACCESS
        .scope(Arc::clone(&access), next.run(req).instrument(span))
        .await;
    access.with(|f| f.status = r.status().as_u16());
    if let Ok(v) = HeaderValue::from_str(&access.id) {
        r.headers_mut().insert(REQUEST_ID, v);
    }
    r.map(|inner| {
        Body::new(Logged {
            inner,
            access: Arc::clone(&access),
        })
    })
}

/// The line is written when the last holder of the record lets it go: the response's body (sent to its
/// end, or abandoned) and the request's work.
impl Drop for Access {
    fn drop(&mut self) {
        self.emit();
    }
}

/// A response body that holds its request's record, and marks it complete when it was sent to its end.
struct Logged {
    inner: Body,
    access: Arc<Access>,
}

impl http_body::Body for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        // hyper stops polling a body of known length after its last byte, without asking for the end.
        let ended = match &r {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            this.access.with(|f| f.complete = true);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_request_id_is_taken_only_when_plain() {
        let ok = HeaderValue::from_static("abc-123_x.y:z");
        assert_eq!(client_id(&ok).as_deref(), Some("abc-123_x.y:z"));
        for bad in ["", "has space", "quote\"", "a\u{7f}"] {
            if let Ok(v) = HeaderValue::from_str(bad) {
                assert_eq!(client_id(&v), None, "{bad:?}");
            }
        }
        let long = HeaderValue::from_str(&"a".repeat(65)).unwrap();
        assert_eq!(client_id(&long), None);
    }
}
