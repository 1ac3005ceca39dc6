//! Every way a request can fail, mapped once to an HTTP status and OpenAI's error body:
//! `{"error": {"message", "type", "param", "code"}}`.

use crate::agent::AgentError;
use crate::upstream::UpstreamError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use thiserror::Error;
use thorn_engine::engine::EngineError;
use thorn_engine::engine::service::SubmitError;

/// A failed request.
#[derive(Debug, Error)]
pub enum ApiError {
    /// Malformed JSON, a field of the wrong type, or a value out of range.
    #[error("{msg}")]
    BadRequest {
        /// What is wrong.
        msg: String,
        /// The offending field, if known.
        param: Option<String>,
    },
    /// The prompt does not fit the model's context.
    #[error("{0}")]
    ContextLength(String),
    /// Missing or wrong API key.
    #[error("invalid API key: send `Authorization: Bearer <key>`")]
    Unauthorized,
    /// The key is valid but may not do this (a host tool outside its allow-list, `/metrics`).
    #[error("{0}")]
    Forbidden(String),
    /// The request body did not arrive in time.
    #[error("the request body did not arrive within {secs} s")]
    BodyTimeout {
        /// The limit in seconds.
        secs: u64,
    },
    /// Too many request bodies are being read at once (the server's memory budget for them is spent).
    #[error("the server is reading too many request bodies at once; retry shortly")]
    BodiesBusy,
    /// No such model.
    #[error("the model {0:?} does not exist; see GET /v1/models")]
    ModelNotFound(String),
    /// No such route.
    #[error("no route {0}")]
    NotFound(String),
    /// The body is larger than allowed.
    #[error("the request body is larger than the limit of {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The queue is full.
    #[error("the server is busy ({0}); retry shortly")]
    Busy(String),
    /// The engine stopped.
    #[error("the engine is not running")]
    Unavailable,
    /// The server is stopping and its grace for running requests ran out.
    #[error("the server is shutting down: the request was cut when the shutdown grace ran out")]
    ShuttingDown,
    /// A bug or an engine failure.
    #[error("internal error: {0}")]
    Internal(String),
    /// The upstream engine serving the request failed or refused it (the message names it).
    #[error(transparent)]
    Upstream(UpstreamError),
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad(msg: impl Into<String>, param: Option<&str>) -> Self {
        ApiError::BadRequest {
            msg: msg.into(),
            param: param.map(str::to_owned),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } | ApiError::ContextLength(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::BodiesBusy => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable | ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Upstream(e) => upstream_status(e),
        }
    }

    /// OpenAI's error `type` and `code`.
    fn kind(&self) -> (&'static str, Option<&'static str>) {
        match self {
            ApiError::BadRequest { .. } => ("invalid_request_error", None),
            ApiError::ContextLength(_) => {
                ("invalid_request_error", Some("context_length_exceeded"))
            }
            ApiError::Unauthorized => ("invalid_request_error", Some("invalid_api_key")),
            ApiError::Forbidden(_) => ("permission_error", Some("permission_denied")),
            ApiError::BodyTimeout { .. } => ("invalid_request_error", Some("body_timeout")),
            ApiError::BodiesBusy => ("server_error", Some("overloaded")),
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            ApiError::NotFound(_) => ("invalid_request_error", Some("not_found")),
            ApiError::TooLarge { .. } => ("invalid_request_error", Some("request_too_large")),
            ApiError::Busy(_) => ("rate_limit_error", Some("queue_full")),
            ApiError::Unavailable => ("server_error", Some("unavailable")),
            ApiError::ShuttingDown => ("server_error", Some("shutting_down")),
            ApiError::Internal(_) => ("server_error", None),
            ApiError::Upstream(e) if upstream_status(e) == StatusCode::BAD_REQUEST => {
                ("invalid_request_error", Some("upstream_rejected"))
            }
            ApiError::Upstream(e) => ("upstream_error", Some(e.kind())),
        }
    }

    /// The error's name in the access log: its OpenAI `code`, else its `type`.
    pub(super) fn log_code(&self) -> &'static str {
        let (kind, code) = self.kind();
        code.unwrap_or(kind)
    }

    /// Seconds to wait before retrying, for the statuses that ask for it.
    fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::Busy(_) | ApiError::BodiesBusy | ApiError::ShuttingDown => Some(1),
            ApiError::Upstream(UpstreamError::CircuitOpen { secs, .. }) => Some(*secs),
            ApiError::Upstream(UpstreamError::Busy { .. }) => Some(1),
            ApiError::Upstream(UpstreamError::NoModel { .. }) => Some(10),
            ApiError::Upstream(UpstreamError::Status {
                status: 429 | 503,
                retry_after,
                ..
            }) => Some(retry_after.unwrap_or(1)),
            _ => None,
        }
    }

    /// OpenAI's error body.
    pub fn body(&self) -> super::wire::ErrorResponse<'static> {
        let (kind, code) = self.kind();
        let param = match self {
            ApiError::BadRequest { param, .. } => param.clone(),
            ApiError::ContextLength(_) => Some("messages".into()),
            _ => None,
        };
        super::wire::ErrorResponse {
            error: super::wire::ErrorDetail {
                message: self.to_string().into(),
                kind: kind.into(),
                param: param.map(Into::into),
                code: code.map(Into::into),
            },
        }
    }
}

impl ApiError {
    /// The response: this error's status and headers (`Retry-After`, `WWW-Authenticate`) with `body`.
    pub fn respond(&self, body: impl serde::Serialize) -> Response {
        let mut r = (self.status(), axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after() {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self, ApiError::Unauthorized) {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl IntoResponse for ApiError {
    /// OpenAI's body; the error stays in the response's extensions, so the API's layer
    /// (`handler::respond`) renders it again in its route's dialect.
    fn into_response(self) -> Response {
        let mut r = self.respond(self.body());
        r.extensions_mut()
            .insert(super::handler::Failed(std::sync::Arc::new(self)));
        r
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::ContextLength { .. } | AgentError::PromptBytes { .. } => {
                ApiError::ContextLength(e.to_string())
            }
            AgentError::Busy(SubmitError::Full { .. }) => ApiError::Busy(e.to_string()),
            AgentError::Busy(SubmitError::Stopped) => ApiError::Unavailable,
            AgentError::Tools(t) => ApiError::bad(t.to_string(), Some("tools")),
            AgentError::Guide(g) => ApiError::bad(g.to_string(), Some("response_format")),
            AgentError::Template(t) => ApiError::bad(t.to_string(), Some("messages")),
            AgentError::NoTemplate => ApiError::bad(e.to_string(), Some("messages")),
            AgentError::Engine(EngineError::PromptTooLong { .. }) => {
                ApiError::ContextLength(e.to_string())
            }
            AgentError::Engine(EngineError::Stops) => ApiError::bad(e.to_string(), Some("stop")),
            AgentError::Engine(ref c) if c.is_client_error() => ApiError::bad(e.to_string(), None),
            AgentError::Engine(EngineError::Kv(k)) => ApiError::Busy(k.to_string()),
            // A client's schema that the grammar engine refused or gave up on while decoding.
            AgentError::Engine(EngineError::Grammar(g)) => {
                ApiError::bad(g.to_string(), Some("response_format"))
            }
            AgentError::Engine(e) => ApiError::Internal(e.to_string()),
            AgentError::Lost => ApiError::Internal(e.to_string()),
            AgentError::Upstream(u) => ApiError::Upstream(u),
        }
    }
}

/// An upstream failure's status: the upstream's own refusal of the client's request (400, 404, 413,
/// 422, ...) is the client's 400, its rate limit a 429; an upstream that cannot be reached, fails,
/// breaks the protocol or refuses thorn's key is a 502; one that is unavailable (its circuit is open,
/// its slots are taken, it says 503) a 503; one that does not answer in time a 504.
fn upstream_status(e: &UpstreamError) -> StatusCode {
    match e {
        UpstreamError::Status { status, .. } => match *status {
            429 => StatusCode::TOO_MANY_REQUESTS,
            401 | 403 | 407 => StatusCode::BAD_GATEWAY,
            400..=499 => StatusCode::BAD_REQUEST,
            503 => StatusCode::SERVICE_UNAVAILABLE,
            504 => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::BAD_GATEWAY,
        },
        UpstreamError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        UpstreamError::CircuitOpen { .. }
        | UpstreamError::Busy { .. }
        | UpstreamError::NoModel { .. } => StatusCode::SERVICE_UNAVAILABLE,
        UpstreamError::Unreachable { .. }
        | UpstreamError::Reported { .. }
        | UpstreamError::Protocol { .. }
        | UpstreamError::Closed { .. } => StatusCode::BAD_GATEWAY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_failures_are_gateway_errors_that_name_the_upstream() {
        let name = || "big".to_owned();
        let status = |s: u16| {
            ApiError::from(AgentError::Upstream(UpstreamError::Status {
                name: name(),
                status: s,
                message: "m".into(),
                retry_after: None,
            }))
        };
        assert_eq!(status(400).status(), StatusCode::BAD_REQUEST);
        assert_eq!(status(422).status(), StatusCode::BAD_REQUEST);
        assert_eq!(status(401).status(), StatusCode::BAD_GATEWAY);
        assert_eq!(status(500).status(), StatusCode::BAD_GATEWAY);
        assert_eq!(status(503).status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(429).status(), StatusCode::TOO_MANY_REQUESTS);
        let open = ApiError::Upstream(UpstreamError::CircuitOpen {
            name: name(),
            secs: 12,
        });
        assert_eq!(open.status(), StatusCode::SERVICE_UNAVAILABLE);
        let r = open.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "12");
        let t = ApiError::Upstream(UpstreamError::Timeout {
            name: name(),
            waited: crate::upstream::Waited::Response,
            after: std::time::Duration::from_secs(60),
        });
        assert_eq!(t.status(), StatusCode::GATEWAY_TIMEOUT);
        let body = t.body().error;
        assert_eq!(body.kind, "upstream_error");
        assert_eq!(body.code.as_deref(), Some("timeout"));
        assert!(body.message.contains("upstream big"));
        let closed = ApiError::Upstream(UpstreamError::Closed { name: name() });
        assert_eq!(closed.status(), StatusCode::BAD_GATEWAY);
    }

    fn status_of(e: EngineError) -> (StatusCode, Option<&'static str>) {
        let api = ApiError::from(AgentError::Engine(e));
        (api.status(), api.kind().1)
    }

    #[test]
    fn engine_errors_are_the_clients_fault_only_when_the_request_is() {
        let bad = StatusCode::BAD_REQUEST;
        assert_eq!(status_of(EngineError::EmptyPrompt), (bad, None));
        assert_eq!(
            status_of(EngineError::PromptTooLong {
                prompt: 9,
                context: 8
            }),
            (bad, Some("context_length_exceeded"))
        );
        assert_eq!(
            status_of(EngineError::TokenOutOfVocab {
                token: 70_000,
                vocab: 49_152
            })
            .0,
            bad
        );
        assert_eq!(status_of(EngineError::Stops).0, bad);
        // A failed forward pass, a lost thread or a broken file is ours, whatever request it met.
        let ours = StatusCode::INTERNAL_SERVER_ERROR;
        assert_eq!(
            status_of(EngineError::Forward(std::sync::Arc::new(
                thorn_engine::model::ModelError::Unsupported("nan".into())
            )))
            .0,
            ours
        );
        assert_eq!(status_of(EngineError::Internal("bug".into())).0, ours);
        assert_eq!(
            status_of(EngineError::VocabMismatch {
                tokenizer: 2,
                model: 1
            })
            .0,
            ours
        );
        assert_eq!(
            status_of(EngineError::Spawn(std::io::Error::other("no threads"))).0,
            ours
        );
        assert_eq!(
            ApiError::from(AgentError::NoTemplate).status(),
            StatusCode::BAD_REQUEST
        );
    }
}
