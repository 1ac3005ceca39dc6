//! The kernel simulator as a GPU runtime (tests only): kernels run on the CPU through `thorn-kernel-sim`,
//! device memory is host memory and a device pointer a host address. The launch tests and the GPU device's
//! tests (a whole forward pass on [`super::GpuDevice`]) run on it.

use super::Graph;
use super::launch::{DevPtr, Launch, Launcher, Params, Shape};
use super::{DevMem, GpuRuntime};
use crate::backend::DeviceError;
use thorn_kernels::Module;

/// The simulator as a launcher: device memory is host memory, a device pointer a host address.
#[derive(Debug)]
pub(crate) struct Sim;

impl Launcher for Sim {
    fn launch_params(
        &self,
        module: &'static Module,
        kernel: &'static str,
        shape: Shape,
        params: &Params,
    ) -> Result<(), DeviceError> {
        let mut params = *params;
        let n = params.len();
        let mut ptrs = params.pointers();
        #[expect(unsafe_code, reason = "runs a kernel on host buffers")]
        // SAFETY: the pointers address `params`' slots, alive for the call, one per argument as the op in
        // `launch` built them for this kernel (the simulator checks their count); the pointer arguments are
        // host memory that outlives the call, sized by that op's checks: the launch tests' fenced `Mem`
        // buffers, or the GPU device's host slices and DevMem allocations.
        let r = unsafe {
            thorn_kernel_sim::launch(
                module.name,
                kernel,
                shape.grid.into(),
                shape.block.into(),
                shape.shared as usize,
                &mut ptrs[..n],
            )
        };
        r.map_err(|e| DeviceError::Unsupported {
            device: "the kernel simulator",
            what: e.to_string(),
        })
    }
}

/// The multiprocessors the simulator reports.
const SIM_MULTIPROCESSORS: usize = 4;

impl GpuRuntime for Sim {
    fn describe(&self) -> String {
        "the kernel simulator".into()
    }

    /// Few, so that the tests' contexts are cut into several splits of several tiles.
    fn multiprocessors(&self) -> usize {
        SIM_MULTIPROCESSORS
    }

    fn alloc(&self, bytes: usize) -> Result<DevMem, DeviceError> {
        let words = vec![0u64; bytes.div_ceil(8).max(1)];
        let ptr = DevPtr(words.as_ptr() as u64);
        Ok(DevMem::new(ptr, bytes, Box::new(words)))
    }

    #[expect(unsafe_code, reason = "a copy to a simulated device address")]
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        // SAFETY: `dst` is an address inside a live DevMem allocation (a host Vec) with at least
        // `src.len()` bytes from there, as the GPU device's callers pass it (weights, staging, buffer
        // ranges); `src` is a distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0 as *mut u8, src.len()) };
        Ok(())
    }

    #[expect(unsafe_code, reason = "a copy from a simulated device address")]
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: `src` is an address inside a live DevMem allocation (a host Vec) with `dst.len()` bytes
        // from there, as the GPU device's buffers pass it; `dst` is a distinct host buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    #[expect(unsafe_code, reason = "a copy between simulated device addresses")]
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        // SAFETY: both are addresses inside live DevMem allocations with `bytes` available, distinct
        // allocations (the GPU device's concat copies each part into a new one, and a growing buffer its
        // contents into its new memory).
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        // Simulated launches finish before they return.
        Ok(())
    }

    fn capture(&self, launches: &[Launch]) -> Result<Box<dyn Graph>, DeviceError> {
        Ok(Box::new(SimGraph {
            launches: launches.to_vec(),
            counts: None,
            run: true,
        }))
    }
}

/// A simulated graph: its launches, replayed in order (on the counting runtime, counted there; on the
/// null runtime, not run).
#[derive(Debug)]
struct SimGraph {
    launches: Vec<Launch>,
    counts: Option<std::sync::Arc<std::sync::Mutex<Counts>>>,
    run: bool,
}

/// Adds to `counts`.
fn count(counts: &std::sync::Mutex<Counts>, f: impl FnOnce(&mut Counts)) {
    f(&mut counts.lock().unwrap());
}

impl Graph for SimGraph {
    fn launch(&self) -> Result<(), DeviceError> {
        if let Some(c) = &self.counts {
            count(c, |c| c.graphs += 1);
        }
        if !self.run {
            return Ok(());
        }
        self.launches.iter().try_for_each(|l| l.run(&Sim))
    }
}

/// What a [`Counting`] runtime was asked to do.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Kernel launches.
    pub launches: usize,
    /// Host-to-device copies.
    pub uploads: usize,
    /// Bytes they copied.
    pub upload_bytes: usize,
    /// Device-to-host copies (each waits for the queued work).
    pub downloads: usize,
    /// Bytes they copied.
    pub download_bytes: usize,
    /// Waits for the queued work.
    pub waits: usize,
    /// Graphs captured.
    pub captures: usize,
    /// Graph launches.
    pub graphs: usize,
}

/// The simulator, counting what the GPU device asks of it: the tests of what an op queues and when it
/// waits.
#[derive(Debug, Default)]
pub(crate) struct Counting {
    /// Shared with the graphs it captures, which count their launches there.
    counts: std::sync::Arc<std::sync::Mutex<Counts>>,
    /// Whether captures fail (a driver without graphs).
    refuse: std::sync::atomic::AtomicBool,
    /// Whether it stands for a GPU that reads host memory in place (unified memory).
    unified: bool,
    /// Whether kernels are only counted, never run (the null runtime).
    null: bool,
    /// Launches per kernel name since the last [`Counting::take_kernels`].
    kernels: std::sync::Mutex<std::collections::BTreeMap<&'static str, usize>>,
    /// Kernel times, while timing is on: the host's clock around each simulated kernel.
    times: std::sync::Mutex<Option<super::KernelTimes>>,
}

impl Counting {
    /// A counting runtime, shared with the device that runs on it.
    pub fn new() -> std::sync::Arc<Counting> {
        std::sync::Arc::default()
    }

    /// A counting runtime standing for a GPU that reads host memory where it is (Jetson Thor): the
    /// simulator's device addresses are host addresses, so it reads host bytes in place as such a GPU does.
    pub fn unified() -> std::sync::Arc<Counting> {
        std::sync::Arc::new(Counting {
            unified: true,
            ..Counting::default()
        })
    }

    /// The null runtime: it counts what the device asks as [`Counting::new`] does but runs no kernel, so
    /// a whole model's pass costs only the device's host work (the launch budget and the host time per
    /// step are measured on it). Memory is host memory as in the simulator; what kernels would compute is
    /// not there.
    pub fn null() -> std::sync::Arc<Counting> {
        std::sync::Arc::new(Counting {
            null: true,
            ..Counting::default()
        })
    }

    /// Launches per kernel name since the last call (launched one by one; a graph's are not in it).
    pub fn take_kernels(&self) -> std::collections::BTreeMap<&'static str, usize> {
        std::mem::take(&mut *self.kernels.lock().unwrap())
    }

    /// Makes every capture fail from now on.
    pub fn refuse_graphs(&self) {
        self.refuse
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The counts since the last call (and starts again from zero).
    pub fn take(&self) -> Counts {
        std::mem::take(&mut *self.counts.lock().unwrap())
    }

    fn count(&self, f: impl FnOnce(&mut Counts)) {
        count(&self.counts, f);
    }
}

impl Launcher for Counting {
    fn launch_params(
        &self,
        module: &'static Module,
        kernel: &'static str,
        shape: Shape,
        params: &Params,
    ) -> Result<(), DeviceError> {
        self.count(|c| c.launches += 1);
        *self.kernels.lock().unwrap().entry(kernel).or_default() += 1;
        if self.null {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        Sim.launch_params(module, kernel, shape, params)?;
        if let Some(t) = &mut *self.times.lock().unwrap() {
            t.add(kernel, t0.elapsed().as_secs_f64());
        }
        Ok(())
    }
}

impl GpuRuntime for Counting {
    fn describe(&self) -> String {
        "the kernel simulator (counting)".into()
    }

    fn multiprocessors(&self) -> usize {
        SIM_MULTIPROCESSORS
    }

    fn time_kernels(&self, on: bool) -> Result<(), DeviceError> {
        let mut t = self.times.lock().unwrap();
        match (on, t.is_some()) {
            (true, false) => *t = Some(super::KernelTimes::default()),
            (false, _) => *t = None,
            (true, true) => {}
        }
        Ok(())
    }

    fn kernel_times(&self) -> Result<super::KernelTimes, DeviceError> {
        Ok(self
            .times
            .lock()
            .unwrap()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default())
    }

    fn alloc(&self, bytes: usize) -> Result<DevMem, DeviceError> {
        Sim.alloc(bytes)
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.count(|c| {
            c.uploads += 1;
            c.upload_bytes += src.len();
        });
        Sim.upload(dst, src)
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.count(|c| {
            c.downloads += 1;
            c.download_bytes += dst.len();
        });
        Sim.download(src, dst)
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        Sim.copy(dst, src, bytes)
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.count(|c| c.waits += 1);
        Ok(())
    }

    fn capture(&self, launches: &[Launch]) -> Result<Box<dyn Graph>, DeviceError> {
        if self.refuse.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(DeviceError::Unsupported {
                device: "the kernel simulator",
                what: "graphs (refused by the test)".into(),
            });
        }
        self.count(|c| c.captures += 1);
        Ok(Box::new(SimGraph {
            launches: launches.to_vec(),
            counts: Some(std::sync::Arc::clone(&self.counts)),
            run: !self.null,
        }))
    }

    fn host_address(&self, host: &[u8]) -> Option<DevPtr> {
        self.unified.then_some(DevPtr(host.as_ptr() as u64))
    }
}

/// The GPU devices a test runs on: the simulator always, and GPU 0 when this build has CUDA and the
/// machine a GPU the device can use (else a line says why it is skipped), with programmatic dependent
/// launch too where the GPU has it.
pub(crate) fn gpu_devices() -> Vec<crate::backend::Device> {
    let mut v = vec![crate::backend::Device::gpu(std::sync::Arc::new(Sim))];
    let cache = crate::backend::default_kernel_cache();
    match crate::backend::Device::cuda(0, cache.as_deref()) {
        Ok(d) => v.push(d),
        Err(e) => eprintln!("skip: the GPU run ({e})"),
    }
    // And with programmatic dependent launch, where the GPU has it: the same results.
    if let Ok(d) = crate::backend::Device::cuda(0, cache.as_deref())
        && d.set_pdl(true)
    {
        v.push(d);
    }
    v
}
