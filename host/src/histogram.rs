//! A Prometheus histogram over atomics: fixed bucket bounds in seconds, no lock on the hot path.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Cumulative buckets, a sum and a count.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    total: AtomicU64,
}

impl Histogram {
    /// Empty, with these bucket bounds.
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    /// Counts one observation.
    pub fn observe(&self, seconds: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if seconds <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_micros
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    /// The histogram with its `HELP` and `TYPE` lines.
    pub fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.rows(name, "", out);
    }

    /// Its sample lines, with `labels` (`key="value",` pairs, each followed by a comma) on each.
    pub fn rows(&self, name: &str, labels: &str, out: &mut String) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let total = self.total.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {total}");
        let plain = labels.trim_end_matches(',');
        let braces = if plain.is_empty() {
            String::new()
        } else {
            format!("{{{plain}}}")
        };
        let _ = writeln!(
            out,
            "{name}_sum{braces} {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{braces} {total}");
    }
}
