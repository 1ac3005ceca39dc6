//! The engine on a thread of its own, behind a bounded queue.
//!
//! The engine thread owns the model, the KV cache and the grammar factory, and runs the batch
//! [`Scheduler`]: callers hand it generations ([`EngineService::generate`]: a closure that prepares a
//! [`Submission`] on the engine thread, where the tokenizer and grammars live) and exclusive jobs
//! ([`EngineService::submit`]: closures run with `&mut Engine` between steps). Results come back through
//! the caller's own channels, so nothing async ever touches the engine. Admission is first come, first
//! served; once `capacity` requests are waiting (queued or not yet admitted to the batch) new ones are
//! refused at once ([`SubmitError::Full`]), so an overloaded server answers 429 instead of piling up work.

use super::Engine;
use super::scheduler::{Scheduler, SchedulerConfig, SchedulerStats, Submission};
use crate::kv::KvStats;
use crate::spec::SpecStats;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use thiserror::Error;

/// Exclusive work for the engine thread.
pub type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// Prepares a generation on the engine thread; `None` when it reported its own error.
pub type Prepare = Box<dyn FnOnce(&mut Engine) -> Option<Submission> + Send>;

enum Work {
    Job(Job),
    Generate(Prepare),
}

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

/// What the engine thread publishes about itself.
#[derive(Debug, Default)]
struct Shared {
    /// Work sent and not yet taken off the channel.
    queued: AtomicUsize,
    /// Generations taken but not yet admitted to the batch (the scheduler updates it as it admits).
    pending: Arc<AtomicUsize>,
    /// Sequences in the batch (or an exclusive job running).
    running: AtomicUsize,
    stats: Mutex<(SchedulerStats, KvStats, SpecStats)>,
}

/// A handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct EngineService {
    tx: Sender<Work>,
    shared: Arc<Shared>,
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

fn panicked<T>(r: std::thread::Result<T>, what: &str) -> Option<T> {
    r.map_err(|_| tracing::error!("{what} panicked")).ok()
}

impl EngineService {
    /// Moves `engine` onto a new thread that batches generations; at most `capacity` may wait.
    pub fn start(engine: Engine, capacity: usize) -> std::io::Result<Self> {
        Self::with_scheduler(engine, capacity, SchedulerConfig::default())
    }

    /// [`EngineService::start`] with scheduling limits.
    pub fn with_scheduler(
        mut engine: Engine,
        capacity: usize,
        cfg: SchedulerConfig,
    ) -> std::io::Result<Self> {
        use std::panic::{AssertUnwindSafe, catch_unwind};
        let capacity = capacity.max(1);
        let (tx, rx) = std::sync::mpsc::channel::<Work>();
        let shared = Arc::new(Shared::default());
        if let Ok(mut s) = shared.stats.lock() {
            s.1 = engine.kv_stats();
            s.2 = engine.spec_stats();
        }
        let sh = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("thorn-engine".into())
            .spawn(move || {
                let mut sched = Scheduler::new(cfg);
                sched.set_waiting_gauge(Arc::clone(&sh.pending));
                loop {
                    // Block only when there is nothing to step.
                    let first = if sched.is_idle() {
                        match rx.recv() {
                            Ok(w) => Some(w),
                            Err(_) => break,
                        }
                    } else {
                        None
                    };
                    for work in first
                        .into_iter()
                        .chain(std::iter::from_fn(|| rx.try_recv().ok()))
                    {
                        // Work is counted where it goes before it stops counting as queued, so
                        // `waiting` never dips below the truth while it moves (a refusal at capacity
                        // then never lets one more in).
                        match work {
                            Work::Job(job) => {
                                sh.running.fetch_add(1, Ordering::SeqCst);
                                sh.queued.fetch_sub(1, Ordering::SeqCst);
                                // A panicking job must not take the engine down with it; its caller sees
                                // its channel close and reports an internal error.
                                let r = catch_unwind(AssertUnwindSafe(|| job(&mut engine)));
                                if panicked(r, "an engine job").is_none() {
                                    engine.rebuild_kv();
                                }
                                sh.running.fetch_sub(1, Ordering::SeqCst);
                            }
                            Work::Generate(prep) => {
                                let r = catch_unwind(AssertUnwindSafe(|| prep(&mut engine)));
                                if let Some(Some(sub)) = panicked(r, "preparing a generation") {
                                    sched.submit(&engine, sub);
                                }
                                sh.pending.store(sched.waiting(), Ordering::SeqCst);
                                sh.queued.fetch_sub(1, Ordering::SeqCst);
                            }
                        }
                    }
                    if !sched.is_idle() {
                        let r = catch_unwind(AssertUnwindSafe(|| sched.step(&mut engine)));
                        if panicked(r, "an engine step").is_none() {
                            sched.fail_all(&mut engine, false, || {
                                super::EngineError::Internal("the engine step panicked".into())
                            });
                            engine.rebuild_kv();
                        }
                    }
                    sh.pending.store(sched.waiting(), Ordering::SeqCst);
                    sh.running.store(sched.running(), Ordering::SeqCst);
                    if let Ok(mut s) = sh.stats.lock() {
                        *s = (sched.stats(), engine.kv_stats(), engine.spec_stats());
                    }
                }
            })?;
        Ok(EngineService {
            tx,
            shared,
            capacity,
        })
    }

    fn send(&self, work: Work) -> Result<(), SubmitError> {
        if self.waiting() >= self.capacity {
            return Err(SubmitError::Full {
                capacity: self.capacity,
            });
        }
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        self.tx.send(work).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped
        })
    }

    /// Queues an exclusive job (it runs between batch steps), or refuses it at once if the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.send(Work::Job(job))
    }

    /// Queues a generation: `prepare` runs on the engine thread and returns the [`Submission`] to batch
    /// (or `None` after reporting its own error).
    pub fn generate(&self, prepare: Prepare) -> Result<(), SubmitError> {
        self.send(Work::Generate(prepare))
    }

    /// Scheduler counters (steps, batched sequences, preemptions) and KV cache counters, as of the end of
    /// the engine's last step.
    pub fn stats(&self) -> (SchedulerStats, KvStats, SpecStats) {
        self.shared.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// Requests waiting: queued, or taken but not yet in the batch.
    pub fn waiting(&self) -> usize {
        self.shared.queued.load(Ordering::SeqCst) + self.shared.pending.load(Ordering::SeqCst)
    }

    /// Sequences generating now (or an exclusive job running).
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::SeqCst)
    }

    /// Whether anything is running now.
    pub fn busy(&self) -> bool {
        self.running() > 0
    }

    /// How many jobs may wait.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use std::sync::mpsc::channel;

    fn tiny() -> Engine {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data/qwen35-tiny/model.gguf");
        let cfg = EngineConfig {
            threads: 1,
            context: 256,
            ..EngineConfig::default()
        };
        Engine::load(&path, &cfg).unwrap()
    }

    #[test]
    fn work_being_prepared_still_fills_the_queue() {
        let svc = EngineService::start(tiny(), 1).unwrap();
        let (started_tx, started) = channel();
        let (release, release_rx) = channel::<()>();
        // A generation whose preparation (tokenizing, compiling a grammar) is slow: it is off the
        // channel but not yet in the scheduler.
        svc.generate(Box::new(move |_: &mut Engine| {
            started_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            None
        }))
        .unwrap();
        started.recv().unwrap();
        assert_eq!(svc.waiting(), 1, "the generation being prepared is counted");
        let refused = svc.submit(Box::new(|_: &mut Engine| {}));
        assert_eq!(refused, Err(SubmitError::Full { capacity: 1 }));
        release.send(()).unwrap();
        // Once it is gone (it reported its own result: nothing to batch), the queue takes work again.
        let (done_tx, done) = channel();
        let t = std::time::Instant::now();
        loop {
            let tx = done_tx.clone();
            match svc.submit(Box::new(move |_: &mut Engine| tx.send(()).unwrap())) {
                Ok(()) => break,
                Err(SubmitError::Full { .. }) => {
                    assert!(t.elapsed().as_secs() < 60, "the queue never drained");
                    std::thread::yield_now();
                }
                Err(e) => panic!("{e}"),
            }
        }
        done.recv().unwrap();
        assert_eq!(svc.waiting(), 0);
    }
}
