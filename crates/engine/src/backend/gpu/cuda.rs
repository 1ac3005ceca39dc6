//! The CUDA backend (built with the `cuda` feature), on cudarc with dynamic loading: the driver
//! (`libcuda`) and NVRTC (`libnvrtc`) are found at run time, so the binary builds and starts on machines
//! without CUDA.
//!
//! cudarc panics when a library it needs is missing, so [`Cuda::new`] probes both libraries first and
//! reports which one is missing ([`DeviceError::MissingLibrary`]); a driver without a usable GPU is
//! [`DeviceError::NoGpu`]. Every call into cudarc runs under `catch_unwind`, so a missing symbol in an old
//! driver is an error too, never a panic.
//!
//! [`Gpu`] is the kernel runtime: one context and one stream, device memory ([`DevBuf`]), and a
//! [`Launcher`] that compiles each catalog module with NVRTC on first use (through the on-disk
//! [`KernelCache`]) and launches its kernels with `cuLaunchKernel` (`cuLaunchKernelEx` with programmatic
//! dependent launch, where asked and the GPU has it). The launches themselves, and every
//! kernel's test, are in [`super::launch`], the same code the CPU simulator runs.
//!
//! [`open`] hands out a [`GpuDevice`] over it (see [`super`]): every buffer the kernels address is
//! device memory (the KV page pool's too), so the GPU needs no access to pageable host memory.

use super::Graph;
use super::launch::{DevPtr, Launch, Launcher, Params, Shape};
use super::nvrtc::KernelCache;
use super::{DevMem, GpuDevice, GpuRuntime};
use crate::backend::DeviceError;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaStream, HostSlice, PinnedHostSlice,
    result, sys,
};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use thorn_kernels::Module;

/// The driver's probes (a namespace: nothing to construct).
#[derive(Debug)]
pub struct Cuda;

/// What a probe found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// The GPU's name.
    pub name: String,
    /// Its compute capability (`(9, 0)` for sm_90).
    pub capability: (i32, i32),
}

#[expect(unsafe_code, reason = "cudarc's library probe is an unsafe fn")]
fn driver_present() -> bool {
    // SAFETY: tries to dlopen the driver library under each soname cudarc would use (no symbol is called).
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Cuda {
    /// Finds GPU `ordinal`: the libraries, the driver, the device.
    pub fn probe(ordinal: usize) -> Result<Probe, DeviceError> {
        if !driver_present() {
            return Err(DeviceError::MissingLibrary {
                library: "libcuda (the NVIDIA driver)",
                hint: "install the NVIDIA driver, or run with --device cpu",
            });
        }
        // The kernels are compiled at run time: no NVRTC, no kernels.
        super::nvrtc::version()?;
        let found = catch_unwind(AssertUnwindSafe(|| {
            let ctx = cudarc::driver::CudaContext::new(ordinal)
                .map_err(|e| format!("GPU {ordinal}: {e}"))?;
            let name = ctx.name().map_err(|e| e.to_string())?;
            let capability = ctx.compute_capability().map_err(|e| e.to_string())?;
            Ok::<_, String>(Probe { name, capability })
        }));
        match found {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => Err(DeviceError::NoGpu(e)),
            Err(_) => Err(DeviceError::NoGpu(
                "the CUDA driver failed while opening the device (is it older than CUDA 12.8?)"
                    .into(),
            )),
        }
    }
}

/// Whether a CUDA driver is present.
pub fn is_available() -> bool {
    driver_present()
}

/// Opens GPU `ordinal` as a device, its kernels compiled into `kernel_cache` (`None`: every time; the
/// engine passes its configuration's, by default `kernels/` under thorn's cache directory).
pub fn open(
    ordinal: usize,
    kernel_cache: Option<&std::path::Path>,
) -> Result<GpuDevice, DeviceError> {
    let gpu = Gpu::open(ordinal, kernel_cache.map(std::path::Path::to_path_buf))?;
    Ok(GpuDevice::new(Arc::new(gpu)))
}

fn driver(what: &str) -> impl Fn(result::DriverError) -> DeviceError + '_ {
    move |e| DeviceError::NoGpu(format!("{what}: {e}"))
}

/// The virtual architecture NVRTC compiles for on a GPU of compute capability `(major, minor)`.
fn arch(capability: (i32, i32)) -> &'static str {
    match capability {
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (10, 1) => "compute_101",
        (11, 0) => "compute_110",
        (12, 0) => "compute_120",
        (8, 9) => "compute_89",
        (8, 7) => "compute_87",
        (8, 6) => "compute_86",
        (8, 0) => "compute_80",
        (major, minor) => Box::leak(format!("compute_{major}{minor}").into_boxed_str()),
    }
}

/// A loaded module and its kernels, each with its parameter count.
struct Loaded {
    _module: Arc<CudaModule>,
    functions: HashMap<&'static str, (CudaFunction, usize)>,
}

/// Page-locked buffers uploads go through, used in turn ([`Gpu::upload`]).
#[derive(Default)]
struct Bounce {
    slots: Vec<PinnedHostSlice<u8>>,
    next: usize,
}

/// Uploads of at most this many bytes go through a page-locked buffer.
const BOUNCE_BYTES: usize = 1 << 20;

/// Page-locked buffers in turn: a step's few uploads never wait for one another's copies.
const BOUNCE_SLOTS: usize = 4;

/// One GPU's kernel runtime: its context, one stream, the modules loaded so far.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: &'static str,
    name: String,
    /// Whether the kernels read host memory where it is: an integrated GPU that walks the host's page
    /// tables (Jetson Thor's unified memory), where the model file's mapped weights need no copy.
    reads_host: bool,
    /// Its streaming multiprocessors.
    multiprocessors: usize,
    modules: Mutex<HashMap<&'static str, Loaded>>,
    cache: Mutex<KernelCache>,
    /// While kernels are timed: each launch's kernel and the events recorded around it.
    timing: Mutex<Option<Vec<Timed>>>,
    /// Whether the GPU can launch a kernel while the one before it finishes (sm_90 and later: each
    /// kernel waits at its `GRID_WAIT()`), and whether launches ask it to.
    pdl_capable: bool,
    pdl: std::sync::atomic::AtomicBool,
    /// Page-locked bounce buffers for uploads (see [`Gpu::upload`]), allocated on first use.
    bounce: Mutex<Bounce>,
}

/// One timed launch: its kernel and the events recorded before and after it on the stream.
struct Timed {
    kernel: &'static str,
    start: sys::CUevent,
    end: sys::CUevent,
}

#[expect(unsafe_code, reason = "CUDA event handles held across threads")]
// SAFETY: event handles are driver objects of the context, usable from any thread that binds it (every
// use here binds it first); they are only touched under the `timing` mutex.
unsafe impl Send for Timed {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish_non_exhaustive()
    }
}

/// Device memory from [`Gpu::alloc`], freed when dropped (once the stream's queued work, which may still
/// use it, is done).
#[derive(Debug)]
pub struct DevBuf {
    ptr: DevPtr,
    bytes: usize,
    stream: Arc<CudaStream>,
}

impl DevBuf {
    /// Its address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// Its size.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    #[expect(unsafe_code, reason = "frees device memory")]
    fn drop(&mut self) {
        // Every use of the memory is queued on this stream: once it is idle, none is left.
        let _ = self.stream.synchronize();
        // SAFETY: the pointer came from malloc_sync and is freed once, after its last use (above).
        let _ = unsafe { result::free_sync(self.ptr.0) };
    }
}

impl Gpu {
    /// Opens GPU `ordinal` with its kernels compiled into `cache_dir` (`None`: compiled every time).
    pub fn open(
        ordinal: usize,
        cache_dir: Option<std::path::PathBuf>,
    ) -> Result<Self, DeviceError> {
        let probe = Cuda::probe(ordinal)?;
        let opened = catch_unwind(AssertUnwindSafe(|| {
            let ctx = CudaContext::new(ordinal).map_err(driver("opening the GPU"))?;
            #[expect(unsafe_code, reason = "one stream: no cross-stream events needed")]
            // SAFETY: every buffer and kernel of this runtime uses its one stream, so no slice is shared
            // across streams (the condition for turning event tracking off).
            unsafe {
                ctx.disable_event_tracking();
            }
            // A stream of its own: the legacy default stream cannot be captured into a graph.
            let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
            use cudarc::driver::sys::CUdevice_attribute as A;
            let attr = |a| {
                ctx.attribute(a)
                    .map_err(driver("reading the GPU's attributes"))
            };
            let reads_host = attr(A::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0
                && attr(A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS)? != 0;
            let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
            Ok::<_, DeviceError>((ctx, stream, reads_host, sms))
        }));
        let (ctx, stream, reads_host, multiprocessors) = opened.map_err(|_| {
            DeviceError::NoGpu("the CUDA driver failed while opening the device".into())
        })??;
        Ok(Gpu {
            ctx,
            stream,
            arch: arch(probe.capability),
            name: probe.name,
            reads_host,
            multiprocessors,
            modules: Mutex::new(HashMap::new()),
            cache: Mutex::new(KernelCache::new(cache_dir)),
            timing: Mutex::new(None),
            pdl_capable: probe.capability.0 >= 9,
            pdl: false.into(),
            bounce: Mutex::default(),
        })
    }

    /// The GPU's name and the architecture its kernels are compiled for.
    pub fn describe(&self) -> String {
        let memory = if self.reads_host {
            ", weights read in place"
        } else {
            ""
        };
        format!("{} ({}{memory})", self.name, self.arch)
    }

    /// Kernel modules compiled and read from the PTX cache so far.
    pub fn cache_stats(&self) -> (usize, usize) {
        self.cache.lock().map(|c| c.stats()).unwrap_or((0, 0))
    }

    /// `bytes` of zeroed device memory.
    #[expect(unsafe_code, reason = "raw device allocation")]
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        let n = bytes.max(1);
        // SAFETY: a fresh allocation of n bytes, zeroed before anything reads it.
        let ptr = unsafe { result::malloc_sync(n) }.map_err(driver("allocating device memory"))?;
        let buf = DevBuf {
            ptr: DevPtr(ptr),
            bytes,
            stream: Arc::clone(&self.stream),
        };
        // SAFETY: the range is the allocation just made.
        unsafe { result::memset_d8_sync(ptr, 0, n) }.map_err(driver("zeroing device memory"))?;
        Ok(buf)
    }

    /// Binds the context to this thread and waits for the stream's queued work (before a host copy).
    fn settle(&self) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        self.synchronize()
    }

    /// Queues a copy of `src` to device address `dst` (after the stream's queued work); `src` may be reused
    /// when this returns. Up to [`BOUNCE_BYTES`] go through the next of [`BOUNCE_SLOTS`] page-locked
    /// buffers (a step's inputs: one copy into it, then a copy the GPU makes on its own, without the
    /// driver staging pageable memory), reused once the copy from it is done; larger ones go from
    /// pageable memory.
    #[expect(unsafe_code, reason = "raw device copies")]
    pub fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        if src.len() <= BOUNCE_BYTES
            && let Ok(mut b) = self.bounce.lock()
        {
            if b.slots.is_empty() {
                for _ in 0..BOUNCE_SLOTS {
                    // SAFETY: fresh page-locked memory; every byte a copy reads is written first below.
                    let slot = unsafe { self.ctx.alloc_pinned::<u8>(BOUNCE_BYTES) }
                        .map_err(driver("allocating page-locked memory"))?;
                    b.slots.push(slot);
                }
            }
            let i = b.next;
            b.next = (i + 1) % BOUNCE_SLOTS;
            let slot = &mut b.slots[i];
            // Waits for the copy queued from this buffer last time.
            let p = slot
                .as_mut_ptr()
                .map_err(driver("waiting for a copy to the GPU"))?;
            // SAFETY: `p` is the slot's BOUNCE_BYTES of page-locked memory, no copy reads it now (waited
            // above), and `src` is a distinct host buffer of at most that many bytes.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
            // SAFETY: the slice is used on this stream only (the slot's event is recorded after the copy
            // when `_done` drops).
            let (pinned, _done) = unsafe { slot.stream_synced_slice(&self.stream) };
            // SAFETY: `dst` addresses at least `src.len()` bytes of one allocation of this context,
            // written in stream order after the work queued before; `pinned` stays untouched until the
            // copy is done (the next write to the slot waits for its event).
            let copied = unsafe {
                result::memcpy_htod_async(dst.0, &pinned[..src.len()], self.stream.cu_stream())
            };
            return copied.map_err(driver("copying to the GPU"));
        }
        // SAFETY: the caller's `dst` addresses at least `src.len()` bytes of one allocation (DevBuf
        // ranges) of this context. The copy is queued on the one stream, after the work queued before it;
        // from pageable memory, as `src` is, the driver stages the bytes before the call returns, so `src`
        // may be reused or freed once it has.
        unsafe { result::memcpy_htod_async(dst.0, src, self.stream.cu_stream()) }
            .map_err(driver("copying to the GPU"))
    }

    #[expect(unsafe_code, reason = "raw device copies")]
    pub fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.settle()?;
        // SAFETY: `src` addresses at least `dst.len()` bytes of one allocation of this context; the queued
        // work is done (settle), and the copy is synchronous.
        unsafe { result::memcpy_dtoh_sync(dst, src.0) }.map_err(driver("copying from the GPU"))
    }

    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream
            .synchronize()
            .map_err(driver("waiting for the GPU"))
    }

    /// The function `kernel` of `module` and its parameter count, compiling and loading the module on
    /// first use.
    fn function(
        &self,
        module: &Module,
        kernel: &'static str,
    ) -> Result<(CudaFunction, usize), DeviceError> {
        let mut modules = self
            .modules
            .lock()
            .map_err(|_| DeviceError::NoGpu("a kernel launch panicked earlier".into()))?;
        if !modules.contains_key(module.name) {
            let ptx = self
                .cache
                .lock()
                .map_err(|_| DeviceError::NoGpu("a kernel compile panicked earlier".into()))?
                .ptx(module, self.arch)?;
            let arity: Vec<Option<usize>> = module
                .kernels
                .iter()
                .map(|k| super::nvrtc::ptx_arity(&ptx, k))
                .collect();
            let m = self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(driver("loading a kernel module"))?;
            let mut functions = HashMap::new();
            for (&k, n) in module.kernels.iter().zip(arity) {
                let f = m.load_function(k).map_err(driver("finding a kernel"))?;
                functions.insert(k, (f, n.unwrap_or(0)));
            }
            modules.insert(
                module.name,
                Loaded {
                    _module: m,
                    functions,
                },
            );
        }
        modules[module.name]
            .functions
            .get(kernel)
            .cloned()
            .ok_or_else(|| DeviceError::Unsupported {
                device: "the CUDA backend",
                what: format!("kernel {kernel}: not in module {}", module.name),
            })
    }
}

impl GpuRuntime for Gpu {
    fn describe(&self) -> String {
        Gpu::describe(self)
    }

    fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    fn host_address(&self, host: &[u8]) -> Option<DevPtr> {
        // With pageable memory access the GPU translates host virtual addresses itself.
        self.reads_host.then_some(DevPtr(host.as_ptr() as u64))
    }

    fn alloc(&self, bytes: usize) -> Result<DevMem, DeviceError> {
        let buf = Gpu::alloc(self, bytes)?;
        Ok(DevMem::new(buf.ptr(), bytes, Box::new(buf)))
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        Gpu::upload(self, dst, src)
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        Gpu::download(self, src, dst)
    }

    #[expect(unsafe_code, reason = "a raw device-to-device copy")]
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        // SAFETY: both ranges are `bytes` long inside distinct DevMem allocations of this context (the GPU
        // device's concat copies whole matrices into an allocation of their total size, a growing buffer
        // its contents into its new memory); the copy is queued on the one stream, in order.
        unsafe { result::memcpy_dtod_async(dst.0, src.0, bytes, self.stream.cu_stream()) }
            .map_err(driver("copying on the GPU"))
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        Gpu::synchronize(self)
    }

    fn time_kernels(&self, on: bool) -> Result<(), DeviceError> {
        let mut t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        if on {
            t.get_or_insert_with(Vec::new);
            return Ok(());
        }
        if let Some(pending) = t.take() {
            Gpu::synchronize(self)?;
            self.destroy_events(pending);
        }
        Ok(())
    }

    #[expect(unsafe_code, reason = "reads CUDA events")]
    fn kernel_times(&self) -> Result<super::KernelTimes, DeviceError> {
        let mut t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        let Some(pending) = t.as_mut().map(std::mem::take) else {
            return Ok(super::KernelTimes::default());
        };
        Gpu::synchronize(self)?;
        let mut times = super::KernelTimes::default();
        let mut read = Ok(());
        for e in &pending {
            // SAFETY: both events were created by this context and recorded on its one stream, around
            // one launch; the stream is idle (above), so both have completed; neither is destroyed yet.
            match unsafe { result::event::elapsed(e.start, e.end) } {
                Ok(ms) => times.add(e.kernel, f64::from(ms) / 1e3),
                Err(err) => read = Err(driver("reading a kernel's time")(err)),
            }
        }
        self.destroy_events(pending);
        read.map(|()| times)
    }

    fn set_pdl(&self, on: bool) -> bool {
        let on = on && self.pdl_capable;
        self.pdl.store(on, std::sync::atomic::Ordering::Relaxed);
        on
    }

    fn capture(&self, launches: &[Launch]) -> Result<Box<dyn Graph>, DeviceError> {
        match self.capture_once(launches) {
            Err(e) if self.pdl.load(std::sync::atomic::Ordering::Relaxed) => {
                // A driver whose graphs cannot hold programmatic launches: graphs matter more.
                tracing::warn!(
                    "programmatic dependent launch is off: capturing a graph with it failed ({e})"
                );
                self.pdl.store(false, std::sync::atomic::Ordering::Relaxed);
                self.capture_once(launches)
            }
            r => r,
        }
    }
}

impl Gpu {
    fn capture_once(&self, launches: &[Launch]) -> Result<Box<dyn Graph>, DeviceError> {
        // Every module is loaded first, so that the capture holds launches only.
        for l in launches {
            self.function(l.module, l.kernel)?;
        }
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver("starting a graph capture"))?;
        let launched = launches.iter().try_for_each(|l| l.run(self));
        // The capture ends whatever happened, so that the stream runs work again.
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("capturing a graph"));
        launched?;
        match graph? {
            Some(g) => Ok(Box::new(Captured(g))),
            None => Err(DeviceError::NoGpu("a graph capture came back empty".into())),
        }
    }
}

/// A captured CUDA graph.
struct Captured(CudaGraph);

#[expect(
    unsafe_code,
    reason = "cudarc's graph is not Send; its use is serialised"
)]
// SAFETY: a graph's handles may be used from any thread as long as no two threads use them at once; the
// GPU device keeps its graphs under one lock and launches them only there.
unsafe impl Send for Captured {}

impl std::fmt::Debug for Captured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Captured")
    }
}

impl Graph for Captured {
    fn launch(&self) -> Result<(), DeviceError> {
        self.0.launch().map_err(driver("launching a graph"))
    }
}

impl Gpu {
    /// An event recorded on the stream now (for a timed launch).
    #[expect(unsafe_code, reason = "records a CUDA event")]
    fn record_event(&self) -> Result<sys::CUevent, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(driver("creating an event"))?;
        // SAFETY: a live event of this context, recorded on its live stream.
        unsafe { result::event::record(e, self.stream.cu_stream()) }
            .map_err(driver("recording an event"))?;
        Ok(e)
    }

    /// Frees the events of timed launches (their work done).
    #[expect(unsafe_code, reason = "destroys CUDA events")]
    fn destroy_events(&self, timed: Vec<Timed>) {
        let _ = self.ctx.bind_to_thread();
        for e in timed {
            // SAFETY: each event was created by this context, is destroyed once (the Vec is consumed) and
            // no queued work records it any more (the stream was synchronized by the caller).
            unsafe {
                let _ = result::event::destroy(e.start);
                let _ = result::event::destroy(e.end);
            }
        }
    }
}

impl Launcher for Gpu {
    #[expect(unsafe_code, reason = "cuLaunchKernel with raw parameters")]
    fn launch_params(
        &self,
        module: &'static Module,
        kernel: &'static str,
        shape: Shape,
        params: &Params,
    ) -> Result<(), DeviceError> {
        let (f, arity) = self.function(module, kernel)?;
        if params.len() != arity {
            return Err(DeviceError::Unsupported {
                device: "the CUDA backend",
                what: format!(
                    "kernel {kernel} takes {arity} parameters, not {}",
                    params.len()
                ),
            });
        }
        let mut params = *params;
        let n = params.len();
        let mut ptrs = params.pointers();
        let [gx, gy, gz] = shape.grid;
        let [bx, by, bz] = shape.block;
        let mut timing = self.timing.lock().unwrap_or_else(|e| e.into_inner());
        let start = match timing.as_ref() {
            Some(_) => Some(self.record_event()?),
            None => None,
        };
        // Timed kernels run one after another: their events would time overlapping kernels otherwise.
        let pdl = self.pdl.load(std::sync::atomic::Ordering::Relaxed) && start.is_none();
        let launched = if pdl {
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            };
            let config = sys::CUlaunchConfig {
                gridDimX: gx,
                gridDimY: gy,
                gridDimZ: gz,
                blockDimX: bx,
                blockDimY: by,
                blockDimZ: bz,
                sharedMemBytes: shape.shared,
                hStream: self.stream.cu_stream(),
                attrs: &raw mut attr,
                numAttrs: 1,
            };
            // SAFETY: as below for the parameters; `config` and the attribute it points to live across
            // the call, which copies them. Every kernel of the catalog waits at its GRID_WAIT() before it
            // touches memory the kernels before it use, which is what the attribute asks of it.
            unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    f.cu_function(),
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        } else {
            // SAFETY: one pointer per kernel parameter, each to a slot holding that parameter's C type,
            // built by the op in `launch` that checked the sizes; `params` outlives the call, which copies
            // them.
            unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    (gx, gy, gz),
                    (bx, by, bz),
                    shape.shared,
                    self.stream.cu_stream(),
                    &mut ptrs[..n],
                )
            }
        };
        launched.map_err(|e| DeviceError::NoGpu(format!("launching {kernel}: {e}")))?;
        if let (Some(start), Some(timed)) = (start, timing.as_mut()) {
            let end = self.record_event()?;
            timed.push(Timed { kernel, start, end });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_opening_one_is_a_typed_error() {
        match open(0, None) {
            Ok(dev) => println!("found {}", dev.name()),
            Err(DeviceError::MissingLibrary { library, .. }) => {
                assert!(library.starts_with("libcuda") != is_available());
            }
            Err(DeviceError::NoGpu(why)) => assert!(is_available(), "{why}"),
            Err(DeviceError::Unsupported { what, .. }) => {
                assert!(what.contains("compute_"), "{what}");
                println!("found {what}");
            }
            other => panic!("unexpected: {other:?}"),
        }
    }

    /// The kernel cache is the directory the device is opened with (`--cache-dir` reaches it through
    /// the engine's configuration): a GPU's first op compiles its module into it. Without a GPU, opening
    /// one is the typed error of the test above.
    #[test]
    fn a_gpu_compiles_its_kernels_into_the_cache_it_is_opened_with() {
        let dir = tempfile::tempdir().unwrap();
        let kernels = dir.path().join("kernels");
        let dev = match open(0, Some(&kernels)) {
            Ok(dev) => crate::backend::Device::Cuda(dev),
            Err(e) => return println!("skipped: {e}"),
        };
        let mut x = dev.buf(vec![1.0; 64]).unwrap();
        let y = dev.buf(vec![2.0; 64]).unwrap();
        dev.add(&mut x, &y);
        assert_eq!(x.read_back(64), &[3.0; 64][..]);
        let entries = std::fs::read_dir(&kernels).unwrap();
        let ptx = entries.filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().ends_with(".ptx")
        });
        assert!(ptx.count() > 0, "no PTX in {}", kernels.display());
    }
}
