//! Step plans: a whole forward pass replayed as one graph without running the model's ops on the host.
//!
//! A decode step repeats the same launches step after step: what changes (the token's embedding row, the
//! batch metadata, the RoPE rows) is data in device staging at fixed addresses, which the host stages
//! before the pass. So once a pass has been recorded twice under the same [`StepKey`] (captured as a graph
//! the second time), the next pass with that key stages its inputs and launches the graph: none of the
//! model's ops run on the host, nothing is recorded or compared.
//!
//! The key is everything the pass's launches are decided by besides the batch's data: the model and its
//! scratch (which buffers), the batch's shape (tokens, sequences, attention splits, the rows that want
//! logits), the KV pool; and the device's allocation count, so that any buffer moved since the recording
//! retires it. A pass whose launches are split by a host trip (an upload or a download between its ops)
//! has no plan. With verification on (the tests' default), a pass that could be replayed is recorded
//! anyway and its launches checked against the plan's, so a key that misses something fails a test
//! instead of replaying a stale graph.

use super::launch::Launch;
use super::mem::DevMem;
use super::runtime::{Graph, Queue};
use crate::backend::DeviceError;

/// The most plans a device keeps (a decode step's, per batch shape and attention split count).
const MAX_PLANS: usize = 16;

/// What decides a forward pass's launches besides the data in device staging (see the module docs),
/// built by the model and completed by the device; reused across passes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepKey(Vec<u64>);

impl StepKey {
    /// Starts a new key.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Adds a value the pass's launches depend on.
    pub fn push(&mut self, v: u64) {
        self.0.push(v);
    }

    /// Whether it holds nothing (no plan: the pass is run op by op).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A number no other [`PlanId`] holds: names a model or a scratch in a [`StepKey`], where an address would
/// not do (a value moved or swapped takes its buffers with it, and another may land at its address).
#[derive(Debug, PartialEq, Eq)]
pub struct PlanId(u64);

impl Default for PlanId {
    fn default() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        PlanId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl PlanId {
    /// Its number.
    pub fn get(&self) -> u64 {
        self.0
    }
}

/// A recorded pass: its key, the allocation count it was recorded at, its launches, and its graph once
/// it was recorded twice the same.
#[derive(Debug)]
struct Plan {
    key: StepKey,
    generation: u64,
    launches: Vec<Launch>,
    graph: Option<Box<dyn Graph>>,
}

/// A device's plans, and the pass being recorded.
#[derive(Debug, Default)]
pub(super) struct Plans {
    /// Most recently used last.
    list: Vec<Plan>,
    /// The key of the pass being recorded, and whether a host trip split it (no plan then).
    recording: Option<(StepKey, bool)>,
    /// Device allocations so far: a plan recorded at another count may address memory that moved.
    pub(super) generation: u64,
    /// Whether a pass that has a graph is recorded anyway and checked against it (a new device's: in the
    /// tests).
    pub(super) verify: bool,
}

impl Plans {
    /// Marks the pass being recorded as split by a host trip (the queue ends a segment inside it).
    pub(super) fn split(&mut self) {
        if let Some((_, split)) = &mut self.recording {
            *split = true;
        }
    }
}

impl Queue {
    /// Starts a forward pass under `key`: launches its plan's graph and returns `true` when one was
    /// recorded at this allocation count (the host then runs none of the pass's ops); else starts
    /// recording the pass, until [`Queue::end_step`], and returns `false`.
    pub(super) fn begin_step(&self, key: &StepKey) -> Result<bool, DeviceError> {
        let mut r = self.rec();
        self.flush_locked(&mut r)?;
        if !r.on || key.is_empty() {
            r.plans.recording = None;
            return Ok(false);
        }
        let generation = r.plans.generation;
        let p = &mut r.plans;
        p.list
            .retain(|pl| pl.generation == generation || pl.key != *key);
        if !p.verify
            && let Some(i) = p.list.iter().position(|pl| pl.key == *key)
            && p.list[i].graph.is_some()
        {
            let pl = p.list.remove(i);
            let n = pl.launches.len();
            let launched = pl.graph.as_ref().map_or(Ok(()), |g| g.launch());
            p.list.push(pl);
            launched?;
            r.stats.steps += 1;
            r.stats.replays += 1;
            r.stats.graph_kernels += n;
            r.id += 1;
            return Ok(true);
        }
        match &mut p.recording {
            Some((k, split)) => {
                k.clone_from(key);
                *split = false;
            }
            None => p.recording = Some((key.clone(), false)),
        }
        Ok(false)
    }

    /// Ends the pass [`Queue::begin_step`] started recording: its launches are queued (from the plan's
    /// graph when they equal the plan's; the plan is captured as a graph when they repeat it) and kept as
    /// the key's plan.
    ///
    /// # Panics
    /// With verification on, when a key whose plan has a graph recorded other launches: the key misses
    /// something the launches depend on, and replaying would have run stale launches.
    pub(super) fn end_step(&self) -> Result<(), DeviceError> {
        let mut r = self.rec();
        let Some((key, split)) = r.plans.recording.take() else {
            return self.flush_locked(&mut r);
        };
        if split || r.segment.is_empty() || !r.on {
            return self.flush_locked(&mut r);
        }
        let generation = r.plans.generation;
        let n = r.segment.len();
        let found = r.plans.list.iter().position(|pl| pl.key == key);
        let mut plan = match found {
            Some(i) => r.plans.list.remove(i),
            None => {
                if r.plans.list.len() == MAX_PLANS {
                    r.plans.list.remove(0);
                }
                Plan {
                    key,
                    generation,
                    launches: Vec::new(),
                    graph: None,
                }
            }
        };
        if plan.generation == generation && plan.launches == r.segment {
            if plan.graph.is_none() {
                match self.rt.capture(&r.segment) {
                    Ok(g) => {
                        plan.graph = Some(g);
                        r.stats.captures += 1;
                    }
                    Err(e) => {
                        tracing::warn!("CUDA graphs are off: capturing one failed ({e})");
                        r.on = false;
                    }
                }
            }
        } else {
            if let Some(i) = first_difference(&plan.launches, &r.segment)
                && plan.graph.is_some()
                && plan.generation == generation
            {
                let what = r.segment.get(i).or(plan.launches.get(i));
                panic!(
                    "a step plan's key misses what its launches depend on: launch {i} ({}) differs from \
                     its recording",
                    what.map_or("none", |l| l.kernel)
                );
            }
            plan.launches.clone_from(&r.segment);
            plan.generation = generation;
            plan.graph = None;
        }
        let launched = match &plan.graph {
            Some(g) => {
                r.stats.replays += 1;
                r.stats.graph_kernels += n;
                g.launch()
            }
            None => {
                r.stats.direct += 1;
                r.stats.kernels += n;
                r.segment.iter().try_for_each(|l| l.run(&*self.rt))
            }
        };
        r.plans.list.push(plan);
        r.segment.clear();
        r.id += 1;
        launched
    }

    /// Device memory of `bytes` (see [`GpuRuntime::alloc`](super::GpuRuntime::alloc)): every plan
    /// recorded before it retires.
    pub(super) fn alloc(&self, bytes: usize) -> Result<DevMem, DeviceError> {
        self.rec().plans.generation += 1;
        self.rt.alloc(bytes)
    }
}

/// The first index where two launch lists differ (in a launch or in length).
fn first_difference(a: &[Launch], b: &[Launch]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::launch::{Arg, Launcher, Params, Shape};
    use crate::backend::gpu::runtime::GpuRuntime;
    use crate::backend::gpu::sim::Counting;
    use std::sync::Arc;

    /// One `add_f32` launch of `n` elements (the null runtime runs none).
    fn add(q: &Queue, n: i32) {
        let shape = Shape {
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared: 0,
        };
        let params = Params::new(&[Arg::I32(n)]);
        q.launch_params(&thorn_kernels::ELEMENTWISE, "add_f32", shape, &params)
            .unwrap();
    }

    fn key(v: &[u64]) -> StepKey {
        let mut k = StepKey::default();
        v.iter().for_each(|&x| k.push(x));
        k
    }

    /// A pass recorded once runs kernel by kernel, twice is captured, and from then on is replayed whole
    /// without its ops; another key, an allocation, or a host trip inside the pass each record again.
    #[test]
    fn a_pass_is_replayed_from_its_plan_once_recorded_twice() {
        let rt = Counting::null();
        let q = Queue::new(Arc::clone(&rt) as Arc<dyn GpuRuntime>);
        q.rec().on = true;
        q.rec().plans.verify = false;
        let pass = |k: &StepKey, n: i32| {
            if !q.begin_step(k).unwrap() {
                add(&q, n);
                add(&q, n + 1);
                q.end_step().unwrap();
                false
            } else {
                true
            }
        };
        let a = key(&[1, 2]);
        assert_eq!(
            [pass(&a, 8), pass(&a, 8), pass(&a, 8)],
            [false, false, true]
        );
        let st = q.rec().stats;
        assert_eq!((st.direct, st.captures, st.replays, st.steps), (1, 1, 2, 1));
        assert_eq!(
            rt.take().launches,
            2,
            "only the first pass launched one by one"
        );
        // Another key records anew; the first still replays.
        assert!(!pass(&key(&[1, 3]), 8));
        assert!(pass(&a, 8));
        // An allocation retires every plan recorded before it.
        let m = q.alloc(64).unwrap();
        assert!(
            !pass(&a, 8),
            "replayed a plan recorded before an allocation"
        );
        // A pass split by a host trip (an upload between its launches) has no plan.
        let split = key(&[9]);
        for _ in 0..3 {
            assert!(!q.begin_step(&split).unwrap());
            add(&q, 1);
            q.upload(m.ptr(), &[0; 4]).unwrap();
            add(&q, 2);
            q.end_step().unwrap();
        }
        // An empty key, or graphs off, has none either.
        for _ in 0..3 {
            assert!(!pass(&StepKey::default(), 8));
        }
        q.rec().on = false;
        assert!(!pass(&a, 8) && !pass(&a, 8));
    }

    /// With verification on, a pass whose key has a graph is recorded anyway and checked: launches that
    /// differ from the plan's (a key missing what they depend on) fail loudly instead of replaying.
    #[test]
    #[should_panic(expected = "a step plan's key misses what its launches depend on")]
    fn a_key_that_misses_what_the_launches_depend_on_is_caught() {
        let rt = Counting::null();
        let q = Queue::new(Arc::clone(&rt) as Arc<dyn GpuRuntime>);
        q.rec().on = true;
        q.rec().plans.verify = true;
        let k = key(&[7]);
        for n in [8, 8, 9] {
            assert!(
                !q.begin_step(&k).unwrap(),
                "verification records every pass"
            );
            add(&q, n);
            q.end_step().unwrap();
        }
    }
}
