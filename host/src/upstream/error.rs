//! Why a request to an upstream failed: [`UpstreamError`], each variant naming the upstream (the API
//! maps it to 400, 429, 502, 503 or 504).

use std::time::Duration;
use thiserror::Error;

/// Which limit an upstream ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// For its response to start.
    Response,
    /// For the next stream event.
    Stream,
}

/// Why a request to an upstream failed. Every message names the upstream.
#[derive(Debug, Error)]
pub enum UpstreamError {
    /// No connection (refused, reset, no route, DNS).
    #[error("upstream {name} could not be reached: {why}")]
    Unreachable {
        /// The upstream.
        name: String,
        /// What the connection said.
        why: String,
    },
    /// It did not answer in time.
    #[error("upstream {name} {}", match .waited {
        Waited::Response => format!("did not start its response within {:.1} s", .after.as_secs_f64()),
        Waited::Stream => format!("sent nothing for {:.1} s in the middle of its answer", .after.as_secs_f64()),
    })]
    Timeout {
        /// The upstream.
        name: String,
        /// Which wait.
        waited: Waited,
        /// The limit.
        after: Duration,
    },
    /// It answered with an error status.
    #[error("upstream {name} answered {status}: {message}")]
    Status {
        /// The upstream.
        name: String,
        /// Its status.
        status: u16,
        /// Its error message (clipped).
        message: String,
        /// Its `Retry-After`, in seconds.
        retry_after: Option<u64>,
    },
    /// It reported an error inside its stream.
    #[error("upstream {name} failed while answering: {message}")]
    Reported {
        /// The upstream.
        name: String,
        /// Its message (clipped).
        message: String,
    },
    /// It sent something that is not an OpenAI answer.
    #[error("upstream {name} sent an answer thorn cannot read: {why}")]
    Protocol {
        /// The upstream.
        name: String,
        /// What was wrong.
        why: String,
    },
    /// The stream ended before the answer did (the upstream died or dropped the connection).
    #[error("upstream {name} closed its stream before the answer ended")]
    Closed {
        /// The upstream.
        name: String,
    },
    /// Its circuit is open: it failed repeatedly and is not sent requests for a while.
    #[error("upstream {name} is unavailable after repeated failures; retry in {secs} s")]
    CircuitOpen {
        /// The upstream.
        name: String,
        /// Until the next try.
        secs: u64,
    },
    /// Its concurrency limit is reached.
    #[error("upstream {name} is already serving its limit of {limit} requests; retry shortly")]
    Busy {
        /// The upstream.
        name: String,
        /// The limit.
        limit: usize,
    },
    /// It has listed no model yet, so `NAME` alone names none.
    #[error("upstream {name} has not listed its models yet; name one as {name}/MODEL")]
    NoModel {
        /// The upstream.
        name: String,
    },
}

impl UpstreamError {
    /// The upstream it names.
    pub fn upstream(&self) -> &str {
        match self {
            UpstreamError::Unreachable { name, .. }
            | UpstreamError::Timeout { name, .. }
            | UpstreamError::Status { name, .. }
            | UpstreamError::Reported { name, .. }
            | UpstreamError::Protocol { name, .. }
            | UpstreamError::Closed { name }
            | UpstreamError::CircuitOpen { name, .. }
            | UpstreamError::Busy { name, .. }
            | UpstreamError::NoModel { name } => name,
        }
    }

    /// A short name for metrics and error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Unreachable { .. } => "unreachable",
            UpstreamError::Timeout {
                waited: Waited::Response,
                ..
            } => "timeout",
            UpstreamError::Timeout { .. } => "stream_timeout",
            UpstreamError::Status { status, .. } if *status < 500 => "status_4xx",
            UpstreamError::Status { .. } => "status_5xx",
            UpstreamError::Reported { .. } => "reported",
            UpstreamError::Protocol { .. } => "protocol",
            UpstreamError::Closed { .. } => "closed",
            UpstreamError::CircuitOpen { .. } => "circuit_open",
            UpstreamError::Busy { .. } => "busy",
            UpstreamError::NoModel { .. } => "no_model",
        }
    }

    /// Whether the upstream is at fault (the breaker counts it): not for a request it refused as the
    /// client's fault, nor for thorn's own refusals.
    pub fn is_failure(&self) -> bool {
        match self {
            UpstreamError::Status { status, .. } => *status >= 500 || matches!(status, 401 | 403),
            UpstreamError::CircuitOpen { .. }
            | UpstreamError::Busy { .. }
            | UpstreamError::NoModel { .. } => false,
            _ => true,
        }
    }
}
