//! What each upstream has done: requests, failures, latency, tokens, in flight (rendered by the API's
//! metrics), and its last health check.

use crate::histogram::Histogram;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

/// Per-upstream counters for `/metrics`.
#[derive(Debug)]
pub struct UpstreamStats {
    /// Rounds by outcome (`ok`, `cancelled`, or an [`UpstreamError::kind`]).
    outcomes: Mutex<BTreeMap<&'static str, u64>>,
    /// Until the response started.
    pub first_byte: Histogram,
    /// Whole rounds.
    pub latency: Histogram,
    /// Requests holding a lease now.
    pub in_flight: AtomicU64,
}

/// Bucket bounds of the upstream latency histograms, in seconds.
const LATENCY_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

impl UpstreamStats {
    pub(super) fn new() -> Self {
        UpstreamStats {
            outcomes: Mutex::default(),
            first_byte: Histogram::new(&LATENCY_BUCKETS),
            latency: Histogram::new(&LATENCY_BUCKETS),
            in_flight: AtomicU64::new(0),
        }
    }

    pub(super) fn count(&self, outcome: &'static str) {
        *self
            .outcomes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(outcome)
            .or_default() += 1;
    }

    /// Rounds by outcome.
    pub fn outcomes(&self) -> BTreeMap<&'static str, u64> {
        self.outcomes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The last health check's result.
#[derive(Debug, Clone, Default)]
pub struct Health {
    /// Whether it answered (`None`: not checked yet).
    pub up: Option<bool>,
    /// What went wrong, when it did not.
    pub error: Option<String>,
}
