//! The circuit breaker in front of an upstream: after `failures` consecutive failures (it could not be
//! reached, timed out, answered 5xx or broke the protocol) the circuit opens and requests are refused at
//! once (503 with `Retry-After`) for `cooldown`; then one request is let through as a probe, and its
//! outcome closes the circuit or opens it again. Health checks count like requests, so a recovered
//! upstream is found by the next check after the cooldown even when no client is asking. A request
//! refused for the client's fault (a 4xx) counts as a success: the upstream answered.
//!
//! Time is passed in, so the tests drive it without sleeping.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Serving; consecutive failures so far.
    Closed(u32),
    /// Refusing until then.
    Open(Instant),
    /// One probe is out.
    HalfOpen,
}

/// What the breaker says to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Go ahead.
    Pass,
    /// Go ahead as the probe: report its outcome, or [`Breaker::release`] it.
    Probe,
    /// Refused; try again after this.
    Refused(Duration),
}

/// A circuit breaker.
#[derive(Debug)]
pub struct Breaker {
    failures: u32,
    cooldown: Duration,
    state: Mutex<State>,
}

impl Breaker {
    /// Opens after `failures` consecutive failures, for `cooldown`.
    pub fn new(failures: u32, cooldown: Duration) -> Self {
        Breaker {
            failures: failures.max(1),
            cooldown,
            state: Mutex::new(State::Closed(0)),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request may go now.
    pub fn admit(&self, now: Instant) -> Admit {
        let mut s = self.state();
        match *s {
            State::Closed(_) => Admit::Pass,
            State::Open(until) if now >= until => {
                *s = State::HalfOpen;
                Admit::Probe
            }
            State::Open(until) => Admit::Refused(until - now),
            // The probe's outcome decides; until then, wait about as long as a request takes.
            State::HalfOpen => Admit::Refused(Duration::from_secs(1)),
        }
    }

    /// Whether requests are being refused now, and for how long (without taking the probe).
    pub fn refusing(&self, now: Instant) -> Option<Duration> {
        match *self.state() {
            State::Closed(_) => None,
            State::Open(until) => (now < until).then(|| until - now),
            State::HalfOpen => Some(Duration::from_secs(1)),
        }
    }

    /// A request (or health check) succeeded.
    pub fn success(&self) {
        let mut s = self.state();
        if !matches!(*s, State::Open(_)) {
            *s = State::Closed(0);
        }
    }

    /// A request (or health check) failed.
    pub fn failure(&self, now: Instant) {
        let mut s = self.state();
        *s = match *s {
            State::Closed(n) if n + 1 < self.failures => State::Closed(n + 1),
            State::Open(until) => State::Open(until),
            _ => State::Open(now + self.cooldown),
        };
    }

    /// A probe ended without telling (it was cancelled): the next request probes again.
    pub fn release(&self, now: Instant) {
        let mut s = self.state();
        if *s == State::HalfOpen {
            *s = State::Open(now);
        }
    }

    /// A health check's view: an open circuit whose cooldown is over lets the check probe.
    pub fn probe_by_check(&self, now: Instant) -> bool {
        let mut s = self.state();
        match *s {
            State::Open(until) if now >= until => {
                *s = State::HalfOpen;
                true
            }
            State::Open(_) => false,
            _ => true,
        }
    }

    /// `closed`, `open` or `half_open`.
    pub fn name(&self) -> &'static str {
        match *self.state() {
            State::Closed(_) => "closed",
            State::Open(_) => "open",
            State::HalfOpen => "half_open",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_circuit_opens_after_consecutive_failures_and_probes_after_the_cooldown() {
        let b = Breaker::new(3, Duration::from_secs(30));
        let t = Instant::now();
        b.failure(t);
        b.failure(t);
        // A success in between resets the count.
        b.success();
        b.failure(t);
        b.failure(t);
        assert_eq!(b.admit(t), Admit::Pass);
        b.failure(t);
        assert_eq!(b.name(), "open");
        assert_eq!(
            b.refusing(t + Duration::from_secs(10)),
            Some(Duration::from_secs(20))
        );
        assert_eq!(b.refusing(t + Duration::from_secs(30)), None);
        assert_eq!(
            b.admit(t + Duration::from_secs(10)),
            Admit::Refused(Duration::from_secs(20))
        );
        // A success reported while open (a request admitted before) does not close it.
        b.success();
        assert_eq!(b.name(), "open");
        // After the cooldown one probe goes; the others wait for it.
        let later = t + Duration::from_secs(30);
        assert_eq!(b.admit(later), Admit::Probe);
        assert!(matches!(b.admit(later), Admit::Refused(_)));
        // The probe failed: open again, for a whole cooldown.
        b.failure(later);
        assert_eq!(
            b.admit(later + Duration::from_secs(1)),
            Admit::Refused(Duration::from_secs(29))
        );
        // The next probe succeeds: closed.
        let again = later + Duration::from_secs(30);
        assert_eq!(b.admit(again), Admit::Probe);
        b.success();
        assert_eq!(b.admit(again), Admit::Pass);
        assert_eq!(b.name(), "closed");
    }

    #[test]
    fn a_cancelled_probe_lets_the_next_request_probe() {
        let b = Breaker::new(1, Duration::from_secs(5));
        let t = Instant::now();
        b.failure(t);
        let later = t + Duration::from_secs(5);
        assert_eq!(b.admit(later), Admit::Probe);
        b.release(later);
        assert_eq!(b.admit(later), Admit::Probe);
    }

    #[test]
    fn health_checks_probe_only_after_the_cooldown() {
        let b = Breaker::new(1, Duration::from_secs(5));
        let t = Instant::now();
        assert!(b.probe_by_check(t));
        b.failure(t);
        assert!(!b.probe_by_check(t + Duration::from_secs(1)));
        assert!(b.probe_by_check(t + Duration::from_secs(5)));
        assert_eq!(b.name(), "half_open");
        b.success();
        assert_eq!(b.name(), "closed");
    }
}
