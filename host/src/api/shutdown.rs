//! Stopping the server without losing what clients are owed.
//!
//! On SIGINT or SIGTERM the accept loop stops taking connections, idle keep-alive connections close, and
//! the requests that run go on for the grace (`--shutdown-grace`). When it runs out the server *cuts*
//! what still runs: each request is cancelled, a stream ends with an error event (`shutting_down`) and its
//! end marker (`[DONE]` where the API has one), a request that had not answered yet gets a 503. A second
//! signal during the grace cuts at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::watch;

/// The server's stop: how many requests run, and whether they have been cut.
#[derive(Debug)]
pub struct Shutdown {
    cut: watch::Sender<bool>,
    running: Arc<AtomicUsize>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            cut: watch::Sender::new(false),
            running: Arc::new(AtomicUsize::new(0)),
        }
    }
}

/// One running request, counted until it is dropped.
#[derive(Debug)]
pub(super) struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shutdown {
    /// Requests running now (a request runs from its admission to its outcome).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Counts a request as running until the guard is dropped.
    pub(super) fn enter(&self) -> Running {
        self.running.fetch_add(1, Ordering::Relaxed);
        Running(Arc::clone(&self.running))
    }

    /// Ends every request still running (see the module's docs).
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Whether the requests have been cut.
    pub fn is_cut(&self) -> bool {
        *self.cut.borrow()
    }

    /// Resolves once the requests are cut.
    pub(super) async fn cut_off(&self) {
        let mut rx = self.cut.subscribe();
        // The sender lives in the server's state, which outlives every request that waits here.
        let _ = rx.wait_for(|cut| *cut).await;
    }
}

/// Resolves at SIGINT (ctrl-c) or SIGTERM.
pub async fn signalled() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn requests_are_counted_and_a_cut_wakes_every_waiter() {
        let s = Arc::new(Shutdown::default());
        let (a, b) = (s.enter(), s.enter());
        assert_eq!(s.running(), 2);
        drop(a);
        assert_eq!(s.running(), 1);
        let waiter = {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.cut_off().await })
        };
        assert!(!s.is_cut());
        s.cut();
        waiter.await.unwrap();
        assert!(s.is_cut());
        // A request that comes to wait after the cut does not wait.
        s.cut_off().await;
        drop(b);
        assert_eq!(s.running(), 0);
    }
}
