//! Where a GPU device's kernels run: the [`GpuRuntime`] trait (a CUDA GPU, or the kernel simulator in
//! the tests), its captured [`Graph`]s, and the [`Queue`] that records the launches between two host waits
//! and replays a repeated segment as one graph.

use super::launch::{DevPtr, Launch, Launcher, Params, Shape};
use super::mem::DevMem;
use super::plan::Plans;
use crate::backend::DeviceError;
use std::sync::{Arc, Mutex};

/// Where the GPU device's kernels run and its memory lives. Kernels, uploads and copies run in the order
/// they are queued.
pub trait GpuRuntime: Launcher + Send + Sync + std::fmt::Debug {
    /// The GPU, for reports.
    fn describe(&self) -> String;
    /// Its streaming multiprocessors (what attention's splits are sized for).
    fn multiprocessors(&self) -> usize;
    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<DevMem, DeviceError>;
    /// Queues a copy of `src` to device address `dst`; `src` may be reused when this returns.
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError>;
    /// Waits for the queued work, then copies `dst.len()` bytes from device address `src`.
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Queues a copy of `bytes` between device addresses.
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError>;
    /// Waits for the queued work.
    fn synchronize(&self) -> Result<(), DeviceError>;
    /// Captures `launches` as one graph (nothing runs now; [`Graph::launch`] queues them all at once).
    fn capture(&self, launches: &[Launch]) -> Result<Box<dyn Graph>, DeviceError>;
    /// The address at which the kernels read `host` where it is, on a GPU that shares the host's memory
    /// and page tables (an integrated GPU with pageable memory access: Jetson Thor); `None` elsewhere (a
    /// discrete GPU reads host memory over its bus: weights are uploaded).
    fn host_address(&self, host: &[u8]) -> Option<DevPtr> {
        let _ = host;
        None
    }
    /// Starts timing every kernel launched one by one (`on`), or stops: on a GPU an event pair around each
    /// launch (graph replays are not timed: turn graphs off first). A runtime that cannot time refuses.
    fn time_kernels(&self, on: bool) -> Result<(), DeviceError> {
        let _ = on;
        Err(DeviceError::Unsupported {
            device: "this GPU runtime",
            what: "timing kernels".into(),
        })
    }
    /// The kernels timed since the last call, per kernel name (waits for the queued work).
    fn kernel_times(&self) -> Result<KernelTimes, DeviceError> {
        Ok(KernelTimes::default())
    }
    /// Launches each kernel from now on so that it may start while the one before it finishes, waiting
    /// at its `GRID_WAIT()` (programmatic dependent launch, sm_90 and later), or not (`on` false). Returns
    /// whether launches now do: a runtime or GPU without it says no.
    fn set_pdl(&self, on: bool) -> bool {
        let _ = on;
        false
    }
}

/// Kernel times per kernel name (see [`GpuRuntime::time_kernels`]).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct KernelTimes {
    /// Per kernel name: launches and their total time, in seconds.
    pub kernels: std::collections::BTreeMap<&'static str, (usize, f64)>,
}

impl KernelTimes {
    /// Counts one launch of `kernel` that took `seconds`.
    pub fn add(&mut self, kernel: &'static str, seconds: f64) {
        let e = self.kernels.entry(kernel).or_default();
        e.0 += 1;
        e.1 += seconds;
    }

    /// All kernels' time, in seconds.
    pub fn total(&self) -> f64 {
        self.kernels.values().map(|k| k.1).sum()
    }
}

/// Launches captured once and queued as one ([`GpuRuntime::capture`]): a CUDA graph.
pub trait Graph: Send + std::fmt::Debug {
    /// Queues the graph's launches.
    fn launch(&self) -> Result<(), DeviceError>;
}

/// The most graphs a device keeps (a decode step's segments change rarely: its attention splits grow with
/// the context; prefill chunks repeat less). A hybrid model's step has a segment per host trip.
const MAX_GRAPHS: usize = 32;

/// The most segments launched kernel by kernel that are remembered, to be captured when one repeats.
const MAX_RECENT: usize = 32;

/// What a GPU device's launches did: graphs replayed and captured, and kernels launched one by one.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphStats {
    /// Segments (the launches between two host waits) replayed from a graph.
    pub replays: usize,
    /// Graphs captured (a segment that repeated one launched kernel by kernel).
    pub captures: usize,
    /// Segments launched kernel by kernel (not seen before).
    pub direct: usize,
    /// Kernels launched inside graphs.
    pub graph_kernels: usize,
    /// Kernels launched one by one.
    pub kernels: usize,
    /// Forward passes replayed whole from a step plan, their ops not run on the host (see
    /// [`plan`](super::plan)); counted in `replays` too.
    pub steps: usize,
}

/// How a GPU device's work reaches its runtime. Without graphs each launch goes straight to the stream.
/// With graphs the launches are recorded into a segment, which ends when the host next needs the
/// stream (a copy, a wait): a segment equal to one a graph was captured from replays that graph; one
/// equal to a recent segment that was launched kernel by kernel is captured (so a decode step's
/// segments are captured at its second step and replayed from the third); any other is launched kernel
/// by kernel and remembered. Replaying is launching the same kernels with the same arguments, so the
/// results are the same bits either way.
///
/// A segment's kernels run after it ends, so the host must not change what they read before then: the
/// copies to device memory end the segment first, and staging ([`DevVec`](super::DevVec)) that an op of
/// the segment was handed is not given new contents until it has ended.
#[derive(Debug)]
pub struct Queue {
    pub(super) rt: Arc<dyn GpuRuntime>,
    pub(super) rec: Mutex<Recorder>,
}

#[derive(Debug, Default)]
pub(super) struct Recorder {
    pub(super) on: bool,
    pub(super) segment: Vec<Launch>,
    /// Recent segments launched kernel by kernel, oldest first.
    pub(super) recent: Vec<Vec<Launch>>,
    /// The current segment's number.
    pub(super) id: u64,
    /// Captured graphs and the segments they replay, most recently used last.
    pub(super) graphs: Vec<(Vec<Launch>, Box<dyn Graph>)>,
    pub(super) stats: GraphStats,
    /// Step plans, and the pass being recorded as one.
    pub(super) plans: Plans,
}

impl Queue {
    pub(super) fn new(rt: Arc<dyn GpuRuntime>) -> Self {
        Queue {
            rt,
            rec: Mutex::new(Recorder::default()),
        }
    }

    pub(super) fn rec(&self) -> std::sync::MutexGuard<'_, Recorder> {
        self.rec
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ends the current segment: its kernels are queued on the stream (see [`Queue`]).
    pub(super) fn flush_locked(&self, r: &mut Recorder) -> Result<(), DeviceError> {
        if r.segment.is_empty() {
            return Ok(());
        }
        r.plans.split();
        r.id += 1;
        let n = r.segment.len();
        if let Some(i) = r.graphs.iter().rposition(|(k, _)| *k == r.segment) {
            let g = r.graphs.remove(i);
            let launched = g.1.launch();
            r.graphs.push(g);
            r.segment.clear();
            launched?;
            r.stats.replays += 1;
            r.stats.graph_kernels += n;
            return Ok(());
        }
        if let Some(i) = r.recent.iter().position(|k| *k == r.segment) {
            match self.rt.capture(&r.segment) {
                Ok(g) => {
                    let launched = g.launch();
                    if r.graphs.len() == MAX_GRAPHS {
                        r.graphs.remove(0);
                    }
                    let key = r.recent.remove(i);
                    r.graphs.push((key, g));
                    r.segment.clear();
                    launched?;
                    r.stats.captures += 1;
                    r.stats.graph_kernels += n;
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!("CUDA graphs are off: capturing one failed ({e})");
                    r.on = false;
                    r.recent.clear();
                }
            }
        }
        let launched = r.segment.iter().try_for_each(|l| l.run(&*self.rt));
        if r.on {
            if r.recent.len() == MAX_RECENT {
                r.recent.remove(0);
            }
            let seg = std::mem::take(&mut r.segment);
            r.recent.push(seg);
        }
        r.segment.clear();
        launched?;
        r.stats.direct += 1;
        r.stats.kernels += n;
        Ok(())
    }

    /// Ends the current segment.
    pub(super) fn flush(&self) -> Result<(), DeviceError> {
        self.flush_locked(&mut self.rec())
    }

    /// Waits for all the work (the current segment's too).
    pub(super) fn wait(&self) -> Result<(), DeviceError> {
        self.flush()?;
        self.rt.synchronize()
    }

    /// Queues a copy of host bytes into device memory, after the work before it.
    pub(super) fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.flush()?;
        self.rt.upload(dst, src)
    }

    /// Copies device memory to the host once the work before it is done.
    pub(super) fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.flush()?;
        self.rt.download(src, dst)
    }

    /// Queues a copy between device addresses, after the work before it.
    pub(super) fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.flush()?;
        self.rt.copy(dst, src, bytes)
    }
}

impl Launcher for Queue {
    fn launch_params(
        &self,
        module: &'static thorn_kernels::Module,
        kernel: &'static str,
        shape: Shape,
        params: &Params,
    ) -> Result<(), DeviceError> {
        let mut r = self.rec();
        if r.on {
            r.segment.push(Launch {
                module,
                kernel,
                shape,
                params: *params,
            });
            return Ok(());
        }
        r.stats.kernels += 1;
        drop(r);
        self.rt.launch_params(module, kernel, shape, params)
    }
}
