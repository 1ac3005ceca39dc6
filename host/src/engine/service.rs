//! The engine on a thread of its own, behind a bounded queue.
//!
//! The engine is a synchronous loop that owns the model, the KV cache and the grammar factory. Callers hand
//! it jobs (closures run with `&mut Engine`) through a bounded channel and get results back through
//! channels of their own, so nothing async ever touches it. Jobs run one at a time in arrival order, which is
//! fair between clients; a full queue is refused at once ([`SubmitError::Full`]), so an overloaded server
//! answers 429 instead of piling up work. Batching several sequences per step is the scheduler's job and
//! replaces the single-job loop when it lands.

use super::Engine;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use thiserror::Error;

/// Work for the engine thread.
pub type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// Why a job was not accepted.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue is full.
    #[error("the engine's queue is full ({capacity} requests waiting)")]
    Full {
        /// Jobs that may wait.
        capacity: usize,
    },
    /// The engine thread is gone.
    #[error("the engine has stopped")]
    Stopped,
}

/// A handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct EngineService {
    tx: SyncSender<Job>,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    capacity: usize,
}

impl std::fmt::Debug for EngineService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineService")
            .field("waiting", &self.waiting())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl EngineService {
    /// Moves `engine` onto a new thread that runs jobs; at most `capacity` may wait.
    pub fn start(mut engine: Engine, capacity: usize) -> std::io::Result<Self> {
        let capacity = capacity.max(1);
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(capacity);
        let waiting = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let (w, r) = (Arc::clone(&waiting), Arc::clone(&running));
        std::thread::Builder::new()
            .name("thorn-engine".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    w.fetch_sub(1, Ordering::SeqCst);
                    r.store(1, Ordering::SeqCst);
                    // A panicking job must not take the engine down with it; its caller sees its channel
                    // close and reports an internal error.
                    let res =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut engine)));
                    if res.is_err() {
                        tracing::error!("an engine job panicked; the engine resets its cache");
                        engine.reset();
                    }
                    r.store(0, Ordering::SeqCst);
                }
            })?;
        Ok(EngineService {
            tx,
            waiting,
            running,
            capacity,
        })
    }

    /// Queues `job`, or refuses it at once if the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::Full {
                        capacity: self.capacity,
                    },
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Jobs waiting (not counting the one running).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Whether a job is running now.
    pub fn busy(&self) -> bool {
        self.running.load(Ordering::SeqCst) > 0
    }

    /// How many jobs may wait.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}
