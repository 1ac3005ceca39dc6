//! A persistent worker pool with a spin-then-park handoff.
//!
//! A decode step is ~150 parallel ops of a few microseconds each, so per-op costs matter: no thread is
//! spawned and nothing is allocated per op. The caller publishes a job (a borrowed closure) by bumping a
//! generation counter; workers spin briefly on it, run the closure with their index, and count themselves
//! done; the caller runs share 0 itself and waits for the count. Idle workers park after a short spin, so an
//! idle server does not burn cores.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::thread::JoinHandle;

/// The job type: called once per thread with the thread's index in `0..n_threads`.
type Job<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    /// Points at a `&Job` living on the caller's stack while a job runs.
    job: AtomicPtr<&'static Job<'static>>,
    generation: AtomicUsize,
    done: AtomicUsize,
    stop: AtomicBool,
    /// Set when a worker's job panicked; the caller re-raises.
    panicked: AtomicBool,
}

/// A fixed set of worker threads; `n_threads` includes the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

/// Spins before parking (~10-50 µs with `pause`): long enough to bridge the gap between two ops of one decode
/// step, short enough that an oversubscribed or idle machine does not lose a core to spinning.
const SPIN_ITERS: u32 = 4_000;

impl ThreadPool {
    /// A pool of `n_threads` (at least 1; the caller is thread 0).
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            generation: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let workers = (1..n_threads)
            .map(|idx| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("thorn-cpu-{idx}"))
                    .spawn(move || worker(&shared, idx))
                    .expect("spawning a CPU worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            n_threads,
        }
    }

    /// Threads in the pool, the caller included.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `job(i)` for every thread index `i` in parallel and returns when all are done.
    pub fn run(&self, job: &Job<'_>) {
        if self.n_threads == 1 {
            job(0);
            return;
        }
        let s = &*self.shared;
        s.done.store(0, Ordering::Relaxed);
        #[expect(unsafe_code, reason = "lifetime erasure of a borrowed job; see SAFETY")]
        // SAFETY: the erased reference is only dereferenced by workers between the generation bump below and
        // their `done` increment, and this function does not return (so `job` stays borrowed) until every
        // worker has incremented `done`. The pointer targets `job_ref`, a local that outlives that window.
        let job_ref: &'static Job<'static> =
            unsafe { std::mem::transmute::<&Job<'_>, &'static Job<'static>>(job) };
        let slot = &job_ref as *const &'static Job<'static> as *mut &'static Job<'static>;
        s.job.store(slot, Ordering::Release);
        s.generation.fetch_add(1, Ordering::AcqRel);
        for w in &self.workers {
            w.thread().unpark();
        }
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0)));
        let want = self.n_threads - 1;
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) != want {
            spins += 1;
            if spins < SPIN_ITERS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        s.job.store(std::ptr::null_mut(), Ordering::Release);
        if let Err(p) = res {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::AcqRel) {
            panic!("a CPU worker thread panicked while running a kernel");
        }
    }

    /// Splits `0..n` into one contiguous range per thread (multiples of `align`, except the last) and runs
    /// `f(range)` on each in parallel.
    pub fn for_ranges(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let t = self.n_threads;
        let align = align.max(1);
        let chunks = n.div_ceil(align);
        self.run(&|i| {
            let start = (chunks * i / t * align).min(n);
            let end = (chunks * (i + 1) / t * align).min(n);
            if start < end {
                f(start..end);
            }
        });
    }
}

fn worker(s: &Shared, idx: usize) {
    // The generation the pool was created with, not whatever it is by the time this thread starts: the
    // first job may already have been published.
    let mut seen = 0;
    loop {
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins < SPIN_ITERS {
                std::hint::spin_loop();
            } else {
                std::thread::park();
            }
        }
        let slot = s.job.load(Ordering::Acquire);
        if !slot.is_null() {
            #[expect(unsafe_code, reason = "reads the job published by ThreadPool::run")]
            // SAFETY: `run` stored a pointer to a live `&Job` before bumping the generation and keeps it alive
            // until this worker increments `done` below.
            let job: &Job<'static> = unsafe { *slot };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(idx))).is_err() {
                s.panicked.store(true, Ordering::Release);
            }
        }
        s.done.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_thread_runs_every_job() {
        for n in 1..=4 {
            let pool = ThreadPool::new(n);
            let total = AtomicU64::new(0);
            for round in 0..1000u64 {
                pool.run(&|i| {
                    total.fetch_add(round * 10 + i as u64, Ordering::Relaxed);
                });
            }
            let per_round: u64 = (0..n as u64).sum();
            let want: u64 = (0..1000u64).map(|r| r * 10 * n as u64 + per_round).sum();
            assert_eq!(total.load(Ordering::Relaxed), want);
        }
    }

    #[test]
    fn ranges_cover_exactly_once() {
        let pool = ThreadPool::new(3);
        for n in [0, 1, 5, 64, 100, 961] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.for_ranges(n, 4, &|r| {
                assert!(r.start % 4 == 0);
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn a_panicking_job_is_reported_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|i| assert!(i == 0, "boom"))
        }));
        assert!(r.is_err());
        let count = AtomicU64::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }
}
