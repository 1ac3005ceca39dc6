//! The GPU device: every [`Device`](super::Device) op run by the CUDA kernels through [`super::launch`], on
//! any [`GpuRuntime`] (a CUDA GPU, or the kernel simulator in the tests).
//!
//! Its memory is device memory: weights (uploaded once; on a GPU that reads host memory in place, such as
//! Jetson Thor's unified memory, read where the model file's mapping has them), the model's [`super::Buf`]s ([`GpuBuf`]), and the
//! device's own staging (batch metadata, RoPE rows, attention partials, quantized activations:
//! [`DevVec`]s). An op queues its kernels on the runtime's one stream and returns; nothing waits until the
//! host needs a result ([`super::Buf::read_back`], [`super::Buf::edit`], [`GpuDevice::finish`] at the end
//! of a pass). Host data an op needs (batch metadata, RoPE rows, embedding rows) is uploaded in stream
//! order, so a queued kernel still sees what it was given, and staging that already holds the same bytes
//! is not uploaded again: a decode step uploads its batch metadata once for all its layers.
//!
//! With CUDA graphs on (the default), the launches between two host waits are recorded and a repeated
//! segment is replayed as one captured graph ([`Queue`]).
//!
//! The KV page pool is memory the GPU and the host both address ([`SharedMem`]: CUDA managed memory, which
//! stays in device memory while the GPU uses it), so that the prefix cache's page copies run on the host
//! between passes as they do on the CPU. A hybrid model's recurrent states are host memory too (the prefix
//! cache snapshots them); a pass works on a copy in a [`super::Buf`], uploaded at its start and read back
//! at its end, so its Gated DeltaNet layers run as kernels between the others. On the host still:
//! embedding rows (a few rows of exact dequantization from the mapped file, then uploaded) and the f64
//! reference matmul.

use super::batch::Batch;
use super::buf::{Buf, Mem, View, ViewMut};
use super::gdn::Shape as GdnShape;
use super::launch::{
    self, Acts, BatchMeta, DevBatch, DevPtr, KvStore, Launch, Launcher, Params, Shape, Weights,
};
use super::pages::PagePool;
use super::{DeviceError, GdnRun, GdnSteps, Rope};
use crate::quant::{GgmlType, dequantize_ref};
use std::sync::{Arc, Mutex};

/// Where the GPU device's kernels run and its memory lives. Kernels, uploads and copies run in the order
/// they are queued.
pub trait GpuRuntime: Launcher + Send + Sync + std::fmt::Debug {
    /// The GPU, for reports.
    fn describe(&self) -> String;
    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<DevMem, DeviceError>;
    /// `bytes` of zeroed device memory that the host addresses too, at the same address (CUDA managed
    /// memory), for the host to reach only while no queued work uses it.
    fn alloc_shared(&self, bytes: usize) -> Result<DevMem, DeviceError>;
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
/// copies to device memory end the segment first, and staging ([`DevVec`]) that an op of the segment
/// was handed is not given new contents until it has ended.
#[derive(Debug)]
pub struct Queue {
    rt: Arc<dyn GpuRuntime>,
    rec: Mutex<Recorder>,
}

#[derive(Debug, Default)]
struct Recorder {
    on: bool,
    segment: Vec<Launch>,
    /// Recent segments launched kernel by kernel, oldest first.
    recent: Vec<Vec<Launch>>,
    /// The current segment's number.
    id: u64,
    /// Captured graphs and the segments they replay, most recently used last.
    graphs: Vec<(Vec<Launch>, Box<dyn Graph>)>,
    stats: GraphStats,
}

impl Queue {
    fn new(rt: Arc<dyn GpuRuntime>) -> Self {
        Queue {
            rt,
            rec: Mutex::new(Recorder::default()),
        }
    }

    fn rec(&self) -> std::sync::MutexGuard<'_, Recorder> {
        self.rec
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Ends the current segment: its kernels are queued on the stream (see [`Queue`]).
    fn flush_locked(&self, r: &mut Recorder) -> Result<(), DeviceError> {
        if r.segment.is_empty() {
            return Ok(());
        }
        r.id += 1;
        let n = r.segment.len();
        if let Some(i) = r.graphs.iter().position(|(k, _)| *k == r.segment) {
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
    fn flush(&self) -> Result<(), DeviceError> {
        self.flush_locked(&mut self.rec())
    }

    /// Waits for all the work (the current segment's too).
    fn wait(&self) -> Result<(), DeviceError> {
        self.flush()?;
        self.rt.synchronize()
    }

    /// Queues a copy of host bytes into device memory, after the work before it.
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.flush()?;
        self.rt.upload(dst, src)
    }

    /// Copies device memory to the host once the work before it is done.
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.flush()?;
        self.rt.download(src, dst)
    }

    /// Queues a copy between device addresses, after the work before it.
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
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

/// Device memory from a [`GpuRuntime`], released when dropped.
pub struct DevMem {
    ptr: DevPtr,
    bytes: usize,
    /// Host memory the device reads where it is (kept alive by the owner), not an allocation.
    in_place: bool,
    _owner: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for DevMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevMem")
            .field("ptr", &self.ptr)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl DevMem {
    /// Memory at `ptr` of `bytes`, kept alive (and released) by `owner`.
    pub fn new(ptr: DevPtr, bytes: usize, owner: Box<dyn Send + Sync>) -> Self {
        DevMem {
            ptr,
            bytes,
            in_place: false,
            _owner: owner,
        }
    }

    /// Its address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
}

/// A failure of the runtime inside an op: a bug or a lost device, reported as a panic with the driver's
/// words, which the engine turns into a failed request.
fn fail(what: &str, e: DeviceError) -> ! {
    panic!("GPU {what}: {e}")
}

/// A [`Buf`]'s device memory, and the host copy [`Buf::read_back`] and [`Buf::edit`] hand out.
#[derive(Debug)]
pub struct GpuBuf {
    mem: DevMem,
    len: usize,
    host: Vec<f32>,
    q: Arc<Queue>,
}

impl GpuBuf {
    /// Floats it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its address.
    pub fn ptr(&self) -> DevPtr {
        self.mem.ptr()
    }

    /// Its first `n` values, after the queued work (see [`Buf::read_back`]).
    pub(super) fn read_back(&mut self, n: usize) -> &mut [f32] {
        self.host.resize(self.len, 0.0);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.host[..n]);
        if let Err(e) = self.q.download(self.mem.ptr(), bytes) {
            fail("read-back", e);
        }
        &mut self.host[..n]
    }

    /// Its contents for the host to change, and where they go back (see [`Buf::edit`]).
    pub(super) fn edit(&mut self) -> (&mut [f32], WriteBack) {
        let back = WriteBack {
            q: Arc::clone(&self.q),
            ptr: self.mem.ptr(),
        };
        let n = self.len;
        (self.read_back(n), back)
    }
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        // A queued kernel may still use the memory.
        let _ = self.q.wait();
    }
}

/// Device memory the host addresses too ([`GpuRuntime::alloc_shared`]): the KV page pool's stores. The
/// host's views of it wait for the device's queued work first, and borrow it, so no op can be handed it
/// to write while one is held.
#[derive(Debug)]
pub struct SharedMem {
    mem: DevMem,
    q: Arc<Queue>,
}

impl SharedMem {
    /// Its device address.
    pub fn ptr(&self) -> DevPtr {
        self.mem.ptr()
    }

    /// Its bytes, once the queued work is done.
    pub(super) fn host(&self) -> &[u8] {
        if let Err(e) = self.q.wait() {
            fail("KV pages", e);
        }
        #[expect(
            unsafe_code,
            reason = "a host view of memory the device shares with it"
        )]
        // SAFETY: the allocation is host-addressable at its device address for `bytes` bytes
        // (alloc_shared's contract) and lives as long as `self`; no queued work uses it (waited above), and
        // none can be queued to write it while this view borrows `self` (writers borrow the pool mutably).
        unsafe {
            std::slice::from_raw_parts(self.mem.ptr().0 as *const u8, self.mem.bytes)
        }
    }

    /// Its bytes to change, once the queued work is done.
    pub(super) fn host_mut(&mut self) -> &mut [u8] {
        if let Err(e) = self.q.wait() {
            fail("KV pages", e);
        }
        #[expect(
            unsafe_code,
            reason = "a host view of memory the device shares with it"
        )]
        // SAFETY: as `host`; the view is exclusive because it borrows `self` mutably.
        unsafe {
            std::slice::from_raw_parts_mut(self.mem.ptr().0 as *mut u8, self.mem.bytes)
        }
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // A queued kernel may still use the memory.
        let _ = self.q.wait();
    }
}

/// Where an [`super::buf::Edit`] of a GPU buffer writes its changes back.
#[derive(Debug)]
pub struct WriteBack {
    q: Arc<Queue>,
    ptr: DevPtr,
}

impl WriteBack {
    /// Queues the upload of `host` (the whole buffer).
    pub(super) fn write(self, host: &[f32]) {
        if let Err(e) = self.q.upload(self.ptr, bytemuck::cast_slice(host)) {
            fail("write-back", e);
        }
    }
}

/// Device staging that only grows, and remembers what it was last given (so identical host data is not
/// uploaded again) and which segment of the [`Queue`] it was last handed to.
#[derive(Debug, Default)]
pub struct DevVec {
    mem: Option<DevMem>,
    last: Vec<u8>,
    used: Option<u64>,
}

impl DevVec {
    /// At least `bytes` of device memory; growing replaces it once the work that may use it is done.
    fn reserve(&mut self, q: &Queue, bytes: usize) -> Result<DevPtr, DeviceError> {
        match &self.mem {
            Some(m) if m.bytes >= bytes => Ok(m.ptr()),
            _ => {
                q.wait()?;
                let m = q.rt.alloc(bytes.next_power_of_two().max(256))?;
                let p = m.ptr();
                self.mem = Some(m);
                self.last.clear();
                Ok(p)
            }
        }
    }

    /// `data` in device memory, for an op of the current segment: uploaded unless the staging holds
    /// exactly it already (ending the segment first if one of its ops was handed the old contents).
    fn put(&mut self, q: &Queue, data: &[u8]) -> Result<DevPtr, DeviceError> {
        let mut r = q.rec();
        if let Some(m) = &self.mem
            && self.last == data
        {
            self.used = Some(r.id);
            return Ok(m.ptr());
        }
        if self.used == Some(r.id) {
            q.flush_locked(&mut r)?;
        }
        drop(r);
        let p = self.reserve(q, data.len())?;
        q.rt.upload(p, data)?;
        self.last.clear();
        self.last.extend_from_slice(data);
        self.used = Some(q.rec().id);
        Ok(p)
    }

    /// Device scratch of `bytes` that an op of the current segment writes.
    fn scratch(&mut self, q: &Queue, bytes: usize) -> Result<DevPtr, DeviceError> {
        let p = self.reserve(q, bytes)?;
        self.last.clear();
        self.used = Some(q.rec().id);
        Ok(p)
    }
}

/// A weight matrix in device memory.
///
/// Its rows are one or more parts, each contiguous: one, for a matrix uploaded (or stacked by a copy); a
/// stacked matrix whose parts are read in place where the model file has them keeps them apart, and a
/// product runs one launch per part into its rows of the output.
#[derive(Debug)]
pub struct GpuMatrix {
    /// The whole matrix (its address is the first part's).
    w: Weights,
    parts: Vec<Weights>,
    /// The memory behind the parts (or the mapping that holds them).
    mems: Vec<DevMem>,
}

impl GpuMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.w.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.w.cols
    }

    /// Bytes a matrix-vector product reads.
    pub fn bytes(&self) -> usize {
        self.mems.iter().map(|m| m.bytes).sum()
    }

    /// Whether its weights are read in place in host memory (see [`GpuRuntime::host_address`]).
    pub fn in_place(&self) -> bool {
        self.mems.iter().any(|m| m.in_place)
    }
}

/// A matmul input's 8-bit copy (device scratch), kept in the caller's workspace because an
/// [`super::Input`] refers to it; reused across calls.
#[derive(Debug, Default)]
pub struct Quantized {
    q: DevVec,
    ds: DevVec,
}

/// The batch metadata in device memory, one staging per array.
#[derive(Debug, Default)]
struct MetaBufs {
    table: DevVec,
    meta: DevVec,
    seen: DevVec,
    dst: DevVec,
    seqs: DevVec,
}

/// The device's own staging (RoPE rows and positions, batch metadata, attention partials, embedding
/// rows), reused across calls.
#[derive(Debug, Default)]
struct Staging {
    meta: BatchMeta,
    dev_meta: MetaBufs,
    partials: DevVec,
    table: Vec<f32>,
    dev_table: DevVec,
    pos: Vec<i32>,
    dev_pos: DevVec,
    rows: Vec<f32>,
    /// The chunked DeltaNet's per-head scratch.
    gdn_work: DevVec,
}

impl Staging {
    /// `batch`'s metadata in device memory (uploaded only where it changed since the last op).
    fn batch(
        &mut self,
        rt: &Queue,
        batch: &Batch,
        page_size: usize,
    ) -> Result<DevBatch, DeviceError> {
        self.meta.build(batch, page_size)?;
        let (m, d) = (&self.meta, &mut self.dev_meta);
        Ok(DevBatch {
            table: d.table.put(rt, bytemuck::cast_slice(&m.table))?,
            meta: d.meta.put(rt, bytemuck::cast_slice(&m.meta))?,
            seen: d.seen.put(rt, bytemuck::cast_slice(&m.seen))?,
            dst: d.dst.put(rt, bytemuck::cast_slice(&m.dst))?,
            seqs: d.seqs.put(rt, bytemuck::cast_slice(&m.seqs))?,
            tokens: batch.len(),
            n_seqs: batch.seqs.len(),
            splits: m.splits,
            attend_from: m.attend_from,
        })
    }

    /// The RoPE rows and positions built in `table` and `pos`, in device memory.
    fn rope(&mut self, rt: &Queue) -> Result<(DevPtr, DevPtr), DeviceError> {
        Ok((
            self.dev_pos.put(rt, bytemuck::cast_slice(&self.pos))?,
            self.dev_table.put(rt, bytemuck::cast_slice(&self.table))?,
        ))
    }
}

/// A GPU: its runtime, and the ops of the device API on it.
#[derive(Debug)]
pub struct GpuDevice {
    /// Its runtime, behind the queue its work goes through.
    q: Arc<Queue>,
    /// Per-op staging; ops run one at a time.
    staging: Box<Mutex<Staging>>,
}

impl GpuDevice {
    /// The device over `rt`, with CUDA graphs on.
    pub fn new(rt: Arc<dyn GpuRuntime>) -> Self {
        let q = Arc::new(Queue::new(rt));
        q.rec().on = true;
        GpuDevice {
            q,
            staging: Box::new(Mutex::new(Staging::default())),
        }
    }

    /// Turns graphs on or off (see [`Queue`]); off, every kernel is launched as its op queues it.
    pub fn set_graphs(&self, on: bool) {
        if let Err(e) = self.q.flush() {
            fail("graph", e);
        }
        self.q.rec().on = on;
    }

    /// What the launches did so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.q.rec().stats
    }

    fn staging(&self) -> std::sync::MutexGuard<'_, Staging> {
        self.staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Its name for reports.
    pub fn name(&self) -> String {
        format!("cuda/{}", self.q.rt.describe())
    }

    /// Queues `f`'s launches (see [`fail`] for what a failure is).
    fn run(&self, what: &str, f: impl FnOnce(&dyn Launcher) -> Result<(), DeviceError>) {
        if let Err(e) = f(&*self.q) {
            fail(what, e);
        }
    }

    /// Waits for every queued op (the end of a forward pass: the host reads the KV pages and the logits
    /// next).
    pub fn finish(&self) {
        if let Err(e) = self.q.wait() {
            fail("pass", e);
        }
    }

    /// `b` with room for at least `n` floats in device memory (a host buffer moves there, its contents
    /// with it; a smaller one is replaced, its contents copied, once the queued work is done).
    pub fn grow(&self, b: &mut Buf, n: usize) -> Result<(), DeviceError> {
        if matches!(&b.mem, Mem::Gpu(g) if g.len() >= n) {
            return Ok(());
        }
        let len = n.max(b.len());
        let mem = self.q.rt.alloc(4 * len)?;
        match &b.mem {
            Mem::Host(v) => self.q.upload(mem.ptr(), bytemuck::cast_slice(v))?,
            Mem::Gpu(g) => self.q.copy(mem.ptr(), g.ptr(), 4 * g.len())?,
        }
        b.mem = Mem::Gpu(GpuBuf {
            mem,
            len,
            host: Vec::new(),
            q: Arc::clone(&self.q),
        });
        Ok(())
    }

    /// `bytes` of zeroed memory the device and the host both address (the KV page pool).
    pub fn shared(&self, bytes: usize) -> Result<SharedMem, DeviceError> {
        Ok(SharedMem {
            mem: self.q.rt.alloc_shared(bytes)?,
            q: Arc::clone(&self.q),
        })
    }

    /// `v` as a buffer in device memory.
    pub fn buf(&self, v: Vec<f32>) -> Result<Buf, DeviceError> {
        let mut b = Buf::from(v);
        self.grow(&mut b, 0)?;
        Ok(b)
    }

    /// `x`'s contents on the host (after the queued work), for the host-side ops.
    pub fn download(&self, x: View<'_>) -> Vec<f32> {
        let mut v = vec![0f32; x.len()];
        if let Err(e) = self.q.download(x.ptr(), bytemuck::cast_slice_mut(&mut v)) {
            fail("download", e);
        }
        v
    }

    /// Queues the upload of host values into `out`.
    pub fn upload(&self, out: &ViewMut<'_>, v: &[f32]) {
        assert!(v.len() <= out.len(), "an upload past its buffer");
        if let Err(e) = self.q.upload(out.ptr(), bytemuck::cast_slice(v)) {
            fail("upload", e);
        }
    }

    /// `rows × cols` weights of type `ty` (GGUF bytes), in device memory. Types without a kernel are
    /// dequantized on the host and uploaded as f32.
    pub fn matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<GpuMatrix, DeviceError> {
        let w = Weights {
            ptr: DevPtr(0),
            ty,
            rows,
            cols,
            scale: 1.0,
        };
        if w.check().is_err() {
            let rb = ty.row_bytes(cols).ok_or_else(|| DeviceError::Unsupported {
                device: "the GPU",
                what: format!("rows of {cols} weights of type {ty}"),
            })?;
            let mut f = vec![0f32; rows * cols];
            for (src, dst) in data.chunks_exact(rb).zip(f.chunks_exact_mut(cols)) {
                dequantize_ref(ty, src, dst)?;
            }
            return self.matrix_f32(rows, cols, &f);
        }
        self.upload_weights(w, data)
    }

    /// `rows × cols` f32 weights (row-major), in device memory.
    pub fn matrix_f32(
        &self,
        rows: usize,
        cols: usize,
        f: &[f32],
    ) -> Result<GpuMatrix, DeviceError> {
        let w = Weights {
            ptr: DevPtr(0),
            ty: GgmlType::F32,
            rows,
            cols,
            scale: 1.0,
        };
        self.upload_weights(w, bytemuck::cast_slice(f))
    }

    /// Weights from a mapping `owner` keeps alive (a model file's tensor): read where they are on a GPU
    /// that reads host memory in place ([`GpuRuntime::host_address`]: unified memory, as on Jetson Thor),
    /// else as [`GpuDevice::matrix`] does.
    pub fn mapped_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
        owner: &Arc<dyn Send + Sync>,
    ) -> Result<GpuMatrix, DeviceError> {
        let mut w = Weights {
            ptr: DevPtr(0),
            ty,
            rows,
            cols,
            scale: 1.0,
        };
        let Some(ptr) = self.q.rt.host_address(data).filter(|_| w.check().is_ok()) else {
            return self.matrix(ty, rows, cols, data);
        };
        if ty.row_bytes(cols).map(|rb| rb * rows) != Some(data.len()) {
            return Err(DeviceError::Unsupported {
                device: "the GPU",
                what: format!(
                    "{} bytes for {rows} rows of {cols} weights of type {ty}",
                    data.len()
                ),
            });
        }
        w.ptr = ptr;
        let mem = DevMem {
            ptr,
            bytes: data.len(),
            in_place: true,
            _owner: Box::new(Arc::clone(owner)),
        };
        Ok(GpuMatrix {
            w,
            parts: vec![w],
            mems: vec![mem],
        })
    }

    fn upload_weights(&self, mut w: Weights, data: &[u8]) -> Result<GpuMatrix, DeviceError> {
        w.check()?;
        let mem = self.q.rt.alloc(data.len())?;
        self.q.upload(mem.ptr(), data)?;
        w.ptr = mem.ptr();
        Ok(GpuMatrix {
            w,
            parts: vec![w],
            mems: vec![mem],
        })
    }

    /// Matrices of one type and width stacked along the output dimension (fused QKV, gate/up): copied
    /// into one allocation, or, for weights read in place, kept where they are as the parts of one matrix.
    pub fn concat(&self, parts: Vec<GpuMatrix>) -> Option<GpuMatrix> {
        let first = parts.first()?.w;
        if parts
            .iter()
            .any(|p| p.w.ty != first.ty || p.w.cols != first.cols || p.w.scale != first.scale)
        {
            return None;
        }
        let w = Weights {
            rows: parts.iter().map(|p| p.w.rows).sum(),
            ..first
        };
        if parts.iter().any(GpuMatrix::in_place) {
            let (mut ws, mut mems) = (Vec::new(), Vec::new());
            for p in parts {
                ws.extend(p.parts);
                mems.extend(p.mems);
            }
            return Some(GpuMatrix { w, parts: ws, mems });
        }
        let total: usize = parts.iter().map(GpuMatrix::bytes).sum();
        let mem = self.q.rt.alloc(total).ok()?;
        let mut at = 0;
        for p in &parts {
            for (part, m) in p.parts.iter().zip(&p.mems) {
                self.q.copy(mem.ptr().offset(at), part.ptr, m.bytes).ok()?;
                at += m.bytes;
            }
        }
        let w = Weights {
            ptr: mem.ptr(),
            ..w
        };
        Some(GpuMatrix {
            w,
            parts: vec![w],
            mems: vec![mem],
        })
    }

    /// Quantizes `n` rows of `cols` floats of `x` for the matrix products (when `cols` allows it; float
    /// matrices read `x` itself). Returns the quantized input's addresses.
    pub fn input(&self, x: View<'_>, n: usize, cols: usize, s: &mut Quantized) -> Option<Acts> {
        if !cols.is_multiple_of(32) {
            return None;
        }
        let rt = &*self.q;
        let q =
            s.q.scratch(rt, n * cols)
                .unwrap_or_else(|e| fail("quantize", e));
        let ds =
            s.ds.scratch(rt, 4 * 2 * n * cols / 32)
                .unwrap_or_else(|e| fail("quantize", e));
        let a = Acts {
            x: x.ptr(),
            q,
            ds,
            tokens: n,
            cols,
        };
        self.run("quantize", |l| launch::quantize_q8_1(l, &a));
        Some(a)
    }

    /// `out[t * w.rows + r] = W[r] · x[t]` for the `n` rows of `x` (`q`: their quantized copy).
    pub fn matmul(&self, w: &GpuMatrix, x: View<'_>, n: usize, q: Option<Acts>, out: ViewMut<'_>) {
        let a = q.unwrap_or(Acts {
            x: x.ptr(),
            q: DevPtr(0),
            ds: DevPtr(0),
            tokens: n,
            cols: w.w.cols,
        });
        // Block weights have whole blocks of 32 per row, so `input` quantized their activations.
        debug_assert!(q.is_some() || !w.w.kernel().is_ok_and(|(_, quantized)| quantized));
        assert!(out.len() >= n * w.w.rows, "matmul output too small");
        let (o, stride) = (out.ptr(), w.w.rows);
        self.run("matmul", |l| {
            let mut row = 0;
            for p in &w.parts {
                launch::matvec(l, p, &a, o.offset(4 * row), stride)?;
                row += p.rows;
            }
            Ok(())
        });
    }

    /// `n` embedding rows of `d` floats, dequantized on the host by `row` (row index, its floats) and
    /// uploaded into `out`.
    pub fn embed(
        &self,
        n: usize,
        d: usize,
        row: impl Fn(usize, &mut [f32]) -> Result<(), DeviceError>,
        out: ViewMut<'_>,
    ) -> Result<(), DeviceError> {
        let s = &mut *self.staging();
        s.rows.resize(n * d, 0.0);
        for (t, r) in s.rows.chunks_exact_mut(d).enumerate() {
            row(t, r)?;
        }
        self.upload(&out, &s.rows);
        Ok(())
    }

    /// RMS norm of `n` rows of `d`.
    pub fn rmsnorm_rows(
        &self,
        x: View<'_>,
        w: View<'_>,
        eps: f32,
        n: usize,
        d: usize,
        out: ViewMut<'_>,
    ) {
        assert!(
            x.len() >= n * d && out.len() >= n * d && w.len() >= d,
            "rmsnorm sizes"
        );
        let (xp, wp, op) = (x.ptr(), w.ptr(), out.ptr());
        self.run("rmsnorm", |l| launch::rmsnorm(l, xp, wp, op, n, d, eps));
    }

    /// RoPE of `rows` strided rows at their positions (see [`super::Device::rope_rows`]).
    #[expect(clippy::too_many_arguments, reason = "a strided batch of rows")]
    pub fn rope_rows(
        &self,
        kind: Rope,
        x: ViewMut<'_>,
        rows: usize,
        stride: usize,
        width: usize,
        head_dim: usize,
        positions: &[u32],
        table: &[(f32, f32)],
        n_angles: usize,
    ) {
        assert!(
            x.len() >= rows.saturating_sub(1) * stride + width,
            "rope rows"
        );
        let s = &mut *self.staging();
        // The rows' own angles, as a table the kernel reads at positions 0..rows.
        s.table.clear();
        s.pos.clear();
        for (t, &p) in positions[..rows].iter().enumerate() {
            let p = p as usize;
            s.table.extend(
                table[p * n_angles..(p + 1) * n_angles]
                    .iter()
                    .flat_map(|&(c, si)| [c, si]),
            );
            s.pos.push(t as i32);
        }
        let (pp, tp) = s.rope(&self.q).unwrap_or_else(|e| fail("rope", e));
        let xp = x.ptr();
        self.run("rope", |l| {
            launch::rope(
                l,
                kind,
                xp,
                pp,
                tp,
                rows,
                stride,
                width / head_dim,
                head_dim,
                n_angles,
            )
        });
    }

    /// The page pool as the kernels address it (host memory here), for kernels that only read it.
    fn store(pool: &PagePool) -> KvStore {
        Self::store_at(pool, pool.raw_parts())
    }

    /// The page pool as the kernels address it, for kernels that write it.
    fn store_mut(pool: &mut PagePool) -> KvStore {
        let parts = pool.raw_parts_mut();
        Self::store_at(pool, parts)
    }

    fn store_at(pool: &PagePool, (k, v, ks, vs): (u64, u64, u64, u64)) -> KvStore {
        KvStore {
            k: DevPtr(k),
            v: DevPtr(v),
            kscale: DevPtr(ks),
            vscale: DevPtr(vs),
            dtype: pool.dtype(),
            shape: pool.shape(),
            page_size: pool.page_size(),
        }
    }

    /// Every token's keys and values of `layer` into its page slot (see
    /// [`super::Device::write_kv_rows`]).
    pub fn write_kv_rows(
        &self,
        pool: &mut PagePool,
        batch: &Batch,
        layer: usize,
        k: View<'_>,
        v: View<'_>,
        stride: usize,
    ) {
        let w = pool.shape().n_kv_heads * pool.shape().head_dim;
        let n = batch.len();
        assert!(
            n == 0 || (k.len().min(v.len()) >= (n - 1) * stride + w),
            "KV rows"
        );
        let s = &mut *self.staging();
        let b = s
            .batch(&self.q, batch, pool.page_size())
            .unwrap_or_else(|e| fail("KV write", e));
        let store = Self::store_mut(pool);
        let (k, v) = (k.ptr(), v.ptr());
        self.run("KV write", |l| {
            launch::write_kv(l, &store, &b, layer, k, v, stride)
        });
    }

    /// Attention of the batch's queries over `layer` (see [`super::Device::attention`]).
    #[expect(
        clippy::too_many_arguments,
        reason = "attention needs its shape spelled out"
    )]
    pub fn attention(
        &self,
        pool: &PagePool,
        layer: usize,
        batch: &Batch,
        q: View<'_>,
        q_stride: usize,
        n_heads: usize,
        out: ViewMut<'_>,
    ) {
        let shape = pool.shape();
        let n = batch.len();
        assert!(
            n == 0 || q.len() >= (n - 1) * q_stride + n_heads * shape.head_dim,
            "attention queries"
        );
        assert!(
            out.len() >= n * n_heads * shape.head_dim,
            "attention output"
        );
        let s = &mut *self.staging();
        let rt = &*self.q;
        let b = s
            .batch(rt, batch, pool.page_size())
            .unwrap_or_else(|e| fail("attention", e));
        let group = n_heads / shape.n_kv_heads.max(1);
        let floats = b.partial_floats(shape.n_kv_heads, group, shape.head_dim);
        let pp = s
            .partials
            .scratch(rt, 4 * floats)
            .unwrap_or_else(|e| fail("attention", e));
        let store = Self::store(pool);
        let (qp, op) = (q.ptr(), out.ptr());
        self.run("attention", |l| {
            launch::attention(l, &store, &b, layer, qp, q_stride, n_heads, op, pp)
        });
    }

    /// `x += y`.
    pub fn add(&self, x: ViewMut<'_>, y: View<'_>) {
        assert!(y.len() >= x.len(), "add sizes");
        let (n, xp, yp) = (x.len(), x.ptr(), y.ptr());
        self.run("add", |l| launch::add(l, xp, yp, n));
    }

    /// `out = silu(gate) * up`.
    pub fn silu_mul(&self, gate: View<'_>, up: View<'_>, out: ViewMut<'_>) {
        assert!(
            gate.len() >= out.len() && up.len() >= out.len(),
            "silu_mul sizes"
        );
        let (n, g, u, o) = (out.len(), gate.ptr(), up.ptr(), out.ptr());
        self.run("silu_mul", |l| launch::silu_mul(l, g, u, o, n));
    }

    /// SwiGLU of `n` fused `[gate | up]` rows of `2 f` into `out`.
    pub fn swiglu_rows(&self, gu: View<'_>, n: usize, f: usize, out: ViewMut<'_>) {
        assert!(gu.len() >= n * 2 * f && out.len() >= n * f, "swiglu sizes");
        let (g, o) = (gu.ptr(), out.ptr());
        self.run("swiglu", |l| launch::swiglu_rows(l, g, o, n, f));
    }

    /// `x *= sigmoid(gate)`.
    pub fn sigmoid_gate(&self, x: ViewMut<'_>, gate: View<'_>) {
        assert!(gate.len() >= x.len(), "sigmoid gate sizes");
        let (n, xp, g) = (x.len(), x.ptr(), gate.ptr());
        self.run("sigmoid gate", |l| launch::sigmoid_gate(l, xp, g, n));
    }

    /// Gated DeltaNet's convolution of a run (see [`super::Device::gdn_conv`]).
    #[expect(
        clippy::too_many_arguments,
        reason = "the convolution's state and its outputs"
    )]
    pub fn gdn_conv(
        &self,
        shape: &GdnShape,
        taps: View<'_>,
        window: ViewMut<'_>,
        x: View<'_>,
        n: usize,
        y: ViewMut<'_>,
        steps: Option<GdnSteps<'_>>,
    ) {
        let (cd, w) = (shape.conv_dim(), shape.kernel.saturating_sub(1));
        assert!(
            taps.len() >= cd * shape.kernel
                && window.len() >= cd * w
                && x.len() >= n * cd
                && y.len() >= n * cd
                && steps.as_ref().is_none_or(|s| s.buf.len() >= s.span(cd * w)),
            "DeltaNet convolution sizes"
        );
        let (tp, wp, xp, yp) = (taps.ptr(), window.ptr(), x.ptr(), y.ptr());
        let steps = steps.map(|s| dev_steps(&s));
        self.run("DeltaNet convolution", |l| {
            launch::gdn_conv(l, shape, tp, wp, xp, n, yp, steps)
        });
    }

    /// L2 norms of the q and k heads of `n` tokens (see [`super::Device::gdn_normalize_qk`]).
    pub fn gdn_normalize_qk(&self, shape: &GdnShape, y: ViewMut<'_>, n: usize) {
        assert!(y.len() >= n * shape.conv_dim(), "DeltaNet q/k norm sizes");
        let yp = y.ptr();
        self.run("DeltaNet q/k norm", |l| {
            launch::gdn_normalize_qk(l, shape, yp, n)
        });
    }

    /// The DeltaNet gates, in place (see [`super::Device::gdn_gates`]).
    pub fn gdn_gates(&self, a: View<'_>, dt_bias: View<'_>, alpha: ViewMut<'_>, beta: ViewMut<'_>) {
        let vh = a.len();
        let n = alpha.len().checked_div(vh).unwrap_or(0);
        assert!(
            dt_bias.len() >= vh && alpha.len() == n * vh && beta.len() >= n * vh,
            "DeltaNet gate sizes"
        );
        let (ap, dp, alp, bp) = (a.ptr(), dt_bias.ptr(), alpha.ptr(), beta.ptr());
        self.run("DeltaNet gates", |l| {
            launch::gdn_gates(l, ap, dp, alp, bp, n, vh)
        });
    }

    fn check_run(shape: &GdnShape, run: &GdnRun<'_>, state: &ViewMut<'_>, out: &ViewMut<'_>) {
        let n = run.n;
        assert!(
            run.y.len() >= n * shape.conv_dim()
                && run.g.len() >= n * shape.vh
                && run.beta.len() >= n * shape.vh
                && state.len() >= shape.matrix_floats()
                && out.len() >= n * shape.vh * shape.dv,
            "DeltaNet recurrence sizes"
        );
    }

    /// The delta rule token by token over every head (see [`super::Device::gdn_recurrence`]).
    pub fn gdn_recurrence(
        &self,
        shape: &GdnShape,
        run: GdnRun<'_>,
        state: ViewMut<'_>,
        out: ViewMut<'_>,
        steps: Option<GdnSteps<'_>>,
    ) {
        Self::check_run(shape, &run, &state, &out);
        assert!(
            steps
                .as_ref()
                .is_none_or(|s| s.buf.len() >= s.span(shape.matrix_floats())),
            "DeltaNet steps sizes"
        );
        let (yp, gp, bp, sp, op) = (
            run.y.ptr(),
            run.g.ptr(),
            run.beta.ptr(),
            state.ptr(),
            out.ptr(),
        );
        let steps = steps.map(|s| dev_steps(&s));
        self.run("DeltaNet recurrence", |l| {
            launch::gdn_recurrence(l, shape, yp, gp, bp, sp, op, run.n, steps)
        });
    }

    /// The delta rule in chunks over every head (see [`super::Device::gdn_chunked`]).
    pub fn gdn_chunked(
        &self,
        shape: &GdnShape,
        run: GdnRun<'_>,
        state: ViewMut<'_>,
        out: ViewMut<'_>,
    ) {
        Self::check_run(shape, &run, &state, &out);
        let floats = launch::gdn_chunk_work(shape);
        let work = self
            .staging()
            .gdn_work
            .scratch(&self.q, 4 * floats)
            .unwrap_or_else(|e| fail("DeltaNet chunks", e));
        let (yp, gp, bp, sp, op) = (
            run.y.ptr(),
            run.g.ptr(),
            run.beta.ptr(),
            state.ptr(),
            out.ptr(),
        );
        self.run("DeltaNet chunks", |l| {
            launch::gdn_chunk(l, shape, yp, gp, bp, sp, op, work, run.n)
        });
    }

    /// The DeltaNet output's gated norm over every row of `o` (see [`super::Device::gdn_gated_norm`]).
    pub fn gdn_gated_norm(
        &self,
        shape: &GdnShape,
        o: ViewMut<'_>,
        z: View<'_>,
        w: View<'_>,
        eps: f32,
    ) {
        let dv = shape.dv;
        let rows = o.len().checked_div(dv).unwrap_or(0);
        assert!(
            o.len() == rows * dv && z.len() >= rows * dv && w.len() >= dv,
            "DeltaNet norm sizes"
        );
        let (op, zp, wp) = (o.ptr(), z.ptr(), w.ptr());
        self.run("DeltaNet norm", |l| {
            launch::gdn_gated_norm(l, op, zp, wp, rows, dv, eps)
        });
    }
}

/// The kernels' form of kept steps.
fn dev_steps(s: &GdnSteps<'_>) -> launch::DevSteps {
    launch::DevSteps {
        buf: s.buf.ptr(),
        stride: s.stride,
        offset: s.offset,
        count: s.count,
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sim::Counting;
    use crate::backend::{Device, Workspace};
    use crate::kv::{Batch, KvCache, KvConfig, KvDtype, KvShape, Logits};
    use crate::testutil::data;
    use std::sync::Arc;

    /// A pass's layers share its batch: the metadata the KV writes and attention read is uploaded by the
    /// first layer's op and only read by the others, and nothing waits. The next step (new positions,
    /// slots) uploads what changed.
    #[test]
    fn the_batch_metadata_is_uploaded_once_per_pass_and_nothing_waits() {
        let rt = Counting::new();
        let dev = Device::gpu(Arc::clone(&rt) as _);
        // Launched as queued, so that they are counted as they come.
        dev.set_graphs(false);
        let (layers, kv_heads, heads, hd) = (4, 2, 4, 64);
        let shape = KvShape {
            n_layers: layers,
            n_kv_heads: kv_heads,
            head_dim: hd,
            recurrent: 0,
        };
        let mut kv = KvCache::on(
            &dev,
            shape,
            KvConfig {
                dtype: KvDtype::F16,
                page_size: 16,
                memory: 1 << 22,
                cache_output: false,
                ..KvConfig::default()
            },
        )
        .unwrap();
        let mut seq = kv.acquire(&[]);
        let w = kv_heads * hd;
        let mut out = Default::default();
        let mut ws = Workspace::default();
        let mut batch = Batch::default();
        for (step, new) in [(0, 5), (1, 1), (2, 1)] {
            let want = seq.len() + new;
            kv.reserve(&mut seq, want).unwrap();
            batch.clear();
            batch.push(&seq, &vec![0; new], Logits::Last);
            let k = dev.buf(data(new * w, step)).unwrap();
            let q = dev.buf(data(new * heads * hd, 10 + step)).unwrap();
            dev.grow(&mut out, new * heads * hd).unwrap();
            rt.take();
            for layer in 0..layers {
                dev.write_kv_rows(kv.pool_mut(), &batch, layer, &k, &k, w);
                let pool = kv.pool();
                dev.attention(
                    pool,
                    layer,
                    &batch,
                    &q,
                    heads * hd,
                    heads,
                    kv_heads,
                    hd,
                    &mut out,
                    &mut ws,
                );
            }
            let c = rt.take();
            assert!(c.launches >= 2 * layers, "step {step}: {c:?}");
            // Five metadata arrays at most, uploaded by the first layer's op.
            assert!(c.uploads <= 5, "step {step}: {c:?}");
            assert_eq!(c.downloads, 0, "step {step}: {c:?}");
            // The first step sizes the staging (growing it waits for the queued work); after that
            // nothing waits.
            if step > 0 {
                assert_eq!(c.waits, 0, "step {step}: {c:?}");
            }
            dev.finish();
            assert!(
                out.read_back(new * heads * hd)
                    .iter()
                    .all(|v| v.is_finite())
            );
            seq.advance(new);
        }
        kv.release(seq, None);
    }

    /// Two ops of one recorded segment given different staging contents (RoPE rows of other positions):
    /// the second upload waits for the first op's segment to run, so graphs on compute what graphs off do;
    /// and host edits of a buffer reach the ops recorded after them.
    #[test]
    fn staging_a_recorded_op_was_handed_is_not_changed_under_it() {
        use crate::backend::{Rope, rope_angles};
        let (hd, heads, rows) = (16, 2, 3);
        let w = heads * hd;
        let mut table = Vec::new();
        for p in 0..8 {
            rope_angles(hd, p, 10000.0, &mut table);
        }
        let run = |graphs: bool| {
            let rt = Counting::new();
            let dev = Device::gpu(Arc::clone(&rt) as _);
            dev.set_graphs(graphs);
            let mut a = dev.buf(data(rows * w, 1)).unwrap();
            let mut b = dev.buf(data(rows * w, 2)).unwrap();
            dev.rope_rows(
                Rope::Normal,
                &mut a,
                rows,
                w,
                w,
                hd,
                &[0, 1, 2],
                &table,
                hd / 2,
            );
            dev.rope_rows(
                Rope::Normal,
                &mut b,
                rows,
                w,
                w,
                hd,
                &[5, 6, 7],
                &table,
                hd / 2,
            );
            {
                let mut e = a.edit();
                e[0] = 42.0;
            }
            dev.add(&mut b, &a);
            (
                a.read_back(rows * w).to_vec(),
                b.read_back(rows * w).to_vec(),
            )
        };
        let (want, got) = (run(false), run(true));
        assert_eq!(got, want);
        // And they are rotations at those positions (the CPU's).
        let cpu = Device::cpu(1);
        let (mut a, mut b) = (data(rows * w, 1), data(rows * w, 2));
        cpu.rope_rows(
            Rope::Normal,
            &mut a,
            rows,
            w,
            w,
            hd,
            &[0, 1, 2],
            &table,
            hd / 2,
        );
        cpu.rope_rows(
            Rope::Normal,
            &mut b,
            rows,
            w,
            w,
            hd,
            &[5, 6, 7],
            &table,
            hd / 2,
        );
        a[0] = 42.0;
        cpu.add(&mut b, &a);
        let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| (p - q).abs() <= 1e-5);
        assert!(close(&want.0, &a) && close(&want.1, &b));
    }
}
