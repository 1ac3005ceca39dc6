//! The GPU device ([`GpuDevice`]): every [`Device`](crate::backend::Device) op run by the CUDA kernels
//! through [`super::launch`], on any [`GpuRuntime`], with its weights ([`GpuMatrix`]) and per-pass staging.

use super::launch::{self, Acts, DevPtr, KvStore, Launcher, Prep};
use super::mem::{DevVec, GpuBuf, fail};
use super::runtime::{GpuRuntime, GraphStats, KernelTimes, Queue};
use crate::backend::batch::Batch;
use crate::backend::buf::{Buf, Mem, View, ViewMut};
use crate::backend::gdn::Shape as GdnShape;
use crate::backend::pages::{PageDevice, PagePool};
use crate::backend::{DeviceError, Embedding, GdnRun, GdnSteps, Rope, cpu};
use std::sync::{Arc, Mutex};

mod fused;
mod logits;
mod pages;
mod staging;
mod step;
mod weights;

pub use weights::GpuMatrix;

use staging::Staging;

/// A matmul input's 8-bit copy (device scratch), kept in the caller's workspace because an
/// [`crate::backend::Input`] refers to it; reused across calls.
#[derive(Debug, Default)]
pub struct Quantized {
    q: DevVec,
    ds: DevVec,
    /// Every input prepared now, its floats written (the reference path reads them), none left to the
    /// products' prologue.
    pub(crate) eager: bool,
}

/// A GPU: its runtime, and the ops of the device API on it.
#[derive(Debug)]
pub struct GpuDevice {
    /// Its runtime, behind the queue its work goes through.
    q: Arc<Queue>,
    /// Per-op staging; ops run one at a time.
    staging: Box<Mutex<Staging>>,
    /// Whether Q4_1 matrices uploaded from now on are packed for aligned loads
    /// ([`Layout::Packed`]).
    packed: std::sync::atomic::AtomicBool,
}

impl Drop for GpuDevice {
    /// Runs the work still queued before its staging goes: a segment recorded but not yet launched reads
    /// the staging, and would otherwise run (when a buffer dropped after the device waits) on freed memory.
    fn drop(&mut self) {
        let _ = self.q.wait();
    }
}

impl GpuDevice {
    /// The device over `rt`, with CUDA graphs on.
    pub fn new(rt: Arc<dyn GpuRuntime>) -> Self {
        let q = Arc::new(Queue::new(rt));
        q.rec().on = true;
        q.rec().plans.verify = cfg!(test);
        GpuDevice {
            q,
            staging: Box::new(Mutex::new(Staging::default())),
            packed: true.into(),
        }
    }

    /// Launches each kernel so that it may start while the one before it finishes (programmatic dependent
    /// launch, sm_90 and later: each kernel waits for the previous one's results where it needs them), or
    /// not; returns whether launches now do (a GPU without it, or the simulator, says no).
    pub fn set_pdl(&self, on: bool) -> bool {
        if let Err(e) = self.q.flush() {
            fail("graph", e);
        }
        self.q.rt.set_pdl(on)
    }

    /// Whether Q4_1 matrices uploaded from now on are packed for the kernels' aligned loads (the
    /// default), or kept as the GGUF file lays them out (weights read in place always are).
    pub fn set_packed_weights(&self, on: bool) {
        self.packed.store(on, std::sync::atomic::Ordering::Relaxed);
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

    /// Times every kernel launched from now on (`on`; graphs go off, so each kernel is launched, and timed,
    /// on its own), or stops (graphs stay as they are).
    pub fn time_kernels(&self, on: bool) -> Result<(), DeviceError> {
        if on {
            self.set_graphs(false);
        }
        self.q.flush()?;
        self.q.rt.time_kernels(on)
    }

    /// The kernels timed since the last call (waits for the queued work).
    pub fn kernel_times(&self) -> Result<KernelTimes, DeviceError> {
        self.q.flush()?;
        self.q.rt.kernel_times()
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
        let mem = self.q.alloc(4 * len)?;
        match &b.mem {
            Mem::Host(v) => self.q.upload(mem.ptr(), bytemuck::cast_slice(v))?,
            Mem::Gpu(g) => self.q.copy(mem.ptr(), g.ptr(), 4 * g.len())?,
        }
        b.mem = Mem::Gpu(Box::new(GpuBuf {
            mem,
            len,
            host: Vec::new(),
            q: Arc::clone(&self.q),
        }));
        Ok(())
    }

    /// The most attention splits a token's positions are cut into on this GPU for `pool`'s model.
    fn split_cap(&self, pool: &PagePool) -> usize {
        launch::split_cap(self.q.rt.multiprocessors(), pool.shape().n_kv_heads)
    }

    /// Where a KV page pool's stores live on this device, and what runs its copies.
    pub(crate) fn pages(&self) -> Arc<dyn PageDevice> {
        Arc::new(pages::GpuPages::new(Arc::clone(&self.q)))
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

    /// Prepares `n` rows of `cols` floats of `x` for the matrix products: nothing to do where each product
    /// can quantize them in its prologue (see [`Acts::deferrable`]), else quantized here, once for all
    /// (`None`: `cols` is not whole blocks, and float matrices read `x` itself).
    pub fn input(&self, x: View<'_>, n: usize, cols: usize, s: &mut Quantized) -> Option<Acts> {
        if !cols.is_multiple_of(32) {
            return None;
        }
        if let Some(a) = Self::deferred(x.ptr(), n, cols, Prep::Floats, s) {
            return Some(a);
        }
        let a = self.acts(x.ptr(), n, cols, s);
        self.run("quantize", |l| launch::quantize_q8_1(l, &a));
        Some(a)
    }

    /// The input of `n` rows of `cols` left to the products' prologue as `prep` says (`None`: it must be
    /// prepared now).
    fn deferred(x: DevPtr, n: usize, cols: usize, prep: Prep, s: &Quantized) -> Option<Acts> {
        (!s.eager && Acts::deferrable(n, cols)).then_some(Acts {
            x,
            q: DevPtr(0),
            ds: DevPtr(0),
            tokens: n,
            cols,
            prep,
        })
    }

    /// The input of `n` rows of `cols` floats at `x` with room in `s` for their quantized copy.
    fn acts(&self, x: DevPtr, n: usize, cols: usize, s: &mut Quantized) -> Acts {
        let rt = &*self.q;
        let q =
            s.q.scratch(rt, Acts::q_bytes(n, cols))
                .unwrap_or_else(|e| fail("quantize", e));
        let ds =
            s.ds.scratch(rt, Acts::ds_bytes(n, cols))
                .unwrap_or_else(|e| fail("quantize", e));
        Acts {
            x,
            q,
            ds,
            tokens: n,
            cols,
            prep: Prep::Quantized,
        }
    }

    /// `out[t * w.rows + r] = W[r] · x[t]` for the `n` rows of `x` (`q`: their prepared input), or with
    /// `add` the products added to what `out` holds (a residual, in the same launch).
    pub fn matmul(
        &self,
        w: &GpuMatrix,
        x: View<'_>,
        n: usize,
        q: Option<Acts>,
        out: ViewMut<'_>,
        add: bool,
    ) {
        let a = q.unwrap_or(Acts {
            x: x.ptr(),
            q: DevPtr(0),
            ds: DevPtr(0),
            tokens: n,
            cols: w.w.cols,
            prep: Prep::Quantized,
        });
        // Block weights have whole blocks of 32 per row, so `input` quantized their activations.
        debug_assert!(q.is_some() || !w.w.kernel().is_ok_and(|(_, quantized)| quantized));
        assert!(out.len() >= n * w.w.rows, "matmul output too small");
        let (o, stride) = (out.ptr(), w.w.rows);
        self.run("matmul", |l| {
            let mut row = 0;
            for p in &w.parts {
                launch::matvec(l, p, &a, o.offset(4 * row), stride, add)?;
                row += p.rows;
            }
            Ok(())
        });
    }

    /// The embedding rows `e` asks for, dequantized on the host and uploaded where they go.
    pub fn embed_rows(&self, e: &Embedding<'_>) -> Result<(), DeviceError> {
        let s = &mut *self.staging();
        Self::dequantize_rows(e, &mut s.rows)?;
        self.upload(&e.out, &s.rows);
        Ok(())
    }

    /// The embedding rows `e` asks for, dequantized exactly (a few rows: on the host) into `rows`.
    fn dequantize_rows(e: &Embedding<'_>, rows: &mut Vec<f32>) -> Result<(), DeviceError> {
        let rb =
            e.ty.row_bytes(e.d)
                .ok_or_else(|| DeviceError::Unsupported {
                    device: "embed",
                    what: format!("rows of {} values of type {}", e.d, e.ty),
                })?;
        assert!(e.out.len() >= e.tokens.len() * e.d, "embedding rows");
        rows.resize(e.tokens.len() * e.d, 0.0);
        for (r, &t) in rows.chunks_exact_mut(e.d).zip(e.tokens) {
            cpu::rows::embed_row(e.ty, e.table, rb, t, r)?;
        }
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

    /// RoPE of `rows` strided rows at their positions (see [`crate::backend::Device::rope_rows`]).
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
        let (pp, tp) = s
            .rope_rows(&self.q, &positions[..rows], table, n_angles)
            .unwrap_or_else(|e| fail("rope", e));
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
    /// [`crate::backend::Device::write_kv_rows`]).
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
            .batch(&self.q, batch, pool.page_size(), self.split_cap(pool))
            .unwrap_or_else(|e| fail("KV write", e));
        let store = Self::store_mut(pool);
        let (k, v) = (k.ptr(), v.ptr());
        self.run("KV write", |l| {
            launch::write_kv(l, &store, &b, layer, k, v, stride)
        });
    }

    /// Attention of the batch's queries over `layer` (see [`crate::backend::Device::attention`]).
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
            .batch(rt, batch, pool.page_size(), self.split_cap(pool))
            .unwrap_or_else(|e| fail("attention", e));
        let group = n_heads / shape.n_kv_heads.max(1);
        let floats = b.partial_floats(shape.n_kv_heads, group, shape.head_dim);
        let pp = s
            .partials
            .scratch(rt, 4 * floats)
            .unwrap_or_else(|e| fail("attention", e));
        let counters = s
            .counters(rt, launch::attention_counters(n, shape.n_kv_heads))
            .unwrap_or_else(|e| fail("attention", e));
        let store = Self::store(pool);
        let (qp, op) = (q.ptr(), out.ptr());
        self.run("attention", |l| {
            launch::attention(
                l,
                &store,
                &b,
                layer,
                qp,
                q_stride,
                n_heads,
                op,
                pp,
                Some(counters),
            )
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

    /// Gated DeltaNet's convolution of a run (see [`crate::backend::Device::gdn_conv`]).
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

    /// L2 norms of the q and k heads of `n` tokens (see [`crate::backend::Device::gdn_normalize_qk`]).
    pub fn gdn_normalize_qk(&self, shape: &GdnShape, y: ViewMut<'_>, n: usize) {
        assert!(y.len() >= n * shape.conv_dim(), "DeltaNet q/k norm sizes");
        let yp = y.ptr();
        self.run("DeltaNet q/k norm", |l| {
            launch::gdn_normalize_qk(l, shape, yp, n)
        });
    }

    /// The DeltaNet gates, in place (see [`crate::backend::Device::gdn_gates`]).
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

    /// The delta rule token by token over every head (see [`crate::backend::Device::gdn_recurrence`]).
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

    /// The delta rule in chunks over every head (see [`crate::backend::Device::gdn_chunked`]).
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

    /// The DeltaNet output's gated norm over every row of `o` (see [`crate::backend::Device::gdn_gated_norm`]).
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
