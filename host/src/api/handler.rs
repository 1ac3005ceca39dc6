//! What every handler shares, as axum extractors and one layer: the [`Caller`] (its API key, checked, and
//! its address), a [`Checked`] JSON body (read under the server's size, time and memory limits, then
//! parsed with the path of any bad field), and [`respond`], which renders every error in its route's
//! [`Dialect`] (OpenAI's or Anthropic's error body) and counts every response's status in the metrics.
//! A handler returns `Result<Response, ApiError>` and never repeats this prologue.

use super::{ApiError, AppState, Peer};
use crate::auth::ApiKey;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, MatchedPath, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Uri, header};
use axum::middleware::Next;
use axum::response::Response;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn new_id(prefix: &str) -> String {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}-{:016x}{:08x}", t ^ (n << 40), n as u32)
}

/// Which API a route speaks: how a key may be presented and how errors are rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dialect {
    /// OpenAI's: `Authorization: Bearer`, `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic's: `x-api-key` (or `Authorization: Bearer`), `{"type": "error", "error": {...}}`.
    Anthropic,
}

/// The layer around every API route of a dialect: tells the extractors the route's [`Dialect`], renders
/// an error response in it (an [`ApiError`] renders OpenAI's body and leaves itself in the response's
/// extensions), and counts the response's status under its endpoint in the metrics. (Every body limit
/// an error names is `max_body`: the `Checked` extractor is the one reader of API bodies.)
pub(super) async fn respond(
    State((st, dialect)): State<(Arc<AppState>, Dialect)>,
    mut req: Request,
    next: Next,
) -> Response {
    let endpoint = endpoint(req.extensions().get::<MatchedPath>());
    req.extensions_mut().insert(dialect);
    let mut r = next.run(req).await;
    if let Some(Failed(e)) = r.extensions().get::<Failed>() {
        super::access::note_error(e);
    }
    // An error already carries OpenAI's body; Anthropic's routes render it again in theirs.
    if let Some(Failed(e)) = r.extensions_mut().remove::<Failed>()
        && dialect == Dialect::Anthropic
    {
        r = e.respond(super::anthropic::error_body(&e));
    }
    if let Some(endpoint) = endpoint {
        st.metrics.request(endpoint, r.status().as_u16());
    }
    r
}

/// The metrics label of a route (`None`: not counted: probes and the metrics scrape itself).
fn endpoint(path: Option<&MatchedPath>) -> Option<&'static str> {
    Some(match path.map(MatchedPath::as_str) {
        Some("/v1/chat/completions") => "/v1/chat/completions",
        Some("/v1/completions") => "/v1/completions",
        Some("/v1/messages") => "/v1/messages",
        Some("/v1/messages/count_tokens") => "/v1/messages/count_tokens",
        Some("/v1/models" | "/v1/models/{id}") => "/v1/models",
        Some("/health" | "/metrics") => return None,
        _ => "other",
    })
}

/// A failed request's error, left in its response for [`respond`] to render in the route's dialect.
#[derive(Debug, Clone)]
pub(super) struct Failed(pub(super) Arc<ApiError>);

/// Any other path.
pub(super) async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(uri.path().to_owned())
}

/// Who sent a request: the key it presented (when keys are configured) and its address. Extracting it
/// checks the key: a missing or wrong one is a 401 before the body is read.
#[derive(Debug, Clone, Default)]
pub(super) struct Caller {
    pub(super) key: Option<ApiKey>,
    pub(super) peer: Option<std::net::SocketAddr>,
}

impl Caller {
    /// The caller's name for an admin route that needs the key right `may` (`what` says what it is, for
    /// the 403): the key's id, or with no keys configured `loopback` for a loopback client. Returns the
    /// name and the key id.
    pub(super) fn admin(
        &self,
        st: &AppState,
        may: fn(&ApiKey) -> bool,
        what: &str,
    ) -> Result<(String, Option<String>), ApiError> {
        match &self.key {
            Some(k) if may(k) => Ok((k.id().to_owned(), Some(k.id().to_owned()))),
            Some(k) => Err(ApiError::Forbidden(format!(
                "key {:?} may not {what}",
                k.id()
            ))),
            None if st.config.keys.is_empty() && self.peer.is_none_or(|p| p.ip().is_loopback()) => {
                Ok(("loopback".into(), None))
            }
            None => Err(ApiError::Forbidden(format!(
                "with no API keys configured, only a loopback client may {what}"
            ))),
        }
    }
}

impl FromRequestParts<Arc<AppState>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        st: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let dialect = parts
            .extensions
            .get::<Dialect>()
            .copied()
            .unwrap_or(Dialect::OpenAi);
        let key = match dialect {
            Dialect::OpenAi => authorize(st, &parts.headers)?,
            Dialect::Anthropic => authorize_anthropic(st, &parts.headers)?,
        };
        if let Some(k) = &key {
            super::access::note_key(k.id());
        }
        Ok(Caller {
            key,
            peer: parts.extensions.get::<Peer>().map(|Peer(p)| *p),
        })
    }
}

/// The key from `Authorization: Bearer` (`None` when the server has no keys).
pub(super) fn authorize(st: &AppState, headers: &HeaderMap) -> Result<Option<ApiKey>, ApiError> {
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

/// The key from `x-api-key`, else `Authorization: Bearer`.
fn authorize_anthropic(st: &AppState, headers: &HeaderMap) -> Result<Option<ApiKey>, ApiError> {
    if st.config.keys.is_empty() {
        return Ok(None);
    }
    match headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        Some(k) => match st.config.keys.check(k.trim()) {
            Some(k) => Ok(Some(k.clone())),
            None => Err(ApiError::Unauthorized),
        },
        None => authorize(st, headers),
    }
}

/// A JSON body read under [`read_body`]'s limits and parsed as `T` (a bad field is a 400 naming its
/// path); the body's share of the server's budget is released once it is parsed.
#[derive(Debug)]
pub(super) struct Checked<T>(pub(super) T);

impl<T: DeserializeOwned> FromRequest<Arc<AppState>> for Checked<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, st: &Arc<AppState>) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        let (bytes, _permit) = read_body(st, &parts.headers, body).await?;
        parse_body(&bytes).map(Checked)
    }
}

/// Reads a request body: at most `max_body` bytes, within `body_timeout`, holding its share of the
/// server-wide budget for bodies in flight while it is read (released when the returned permit drops).
/// A declared length is reserved before any byte is read, so an over-budget upload is refused at once.
pub(super) async fn read_body(
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

pub(super) fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
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
