//! The GPU device: every [`Device`](super::Device) op run by the CUDA kernels through [`super::launch`], on
//! any [`GpuRuntime`] (a CUDA GPU, or the kernel simulator in the tests).
//!
//! This first form keeps the device API's host slices: activations, the KV page pool and the norm weights
//! stay in host memory and the kernels address them there, which a GPU can do when it reads pageable host
//! memory (Jetson Thor's coherent unified memory; HMM or ATS elsewhere): [`super::cuda::open`] refuses a
//! GPU that cannot. Weight matrices are uploaded to device memory once. Each op waits for its kernels
//! before it returns, because the caller may read what they wrote. On the host still: embedding rows (a few
//! rows of exact dequantization from the mapped file), single-token KV writes, the in-place SiLU product,
//! the Gated DeltaNet ops (their kernels are in `launch`, not yet behind this API) and the f64 reference
//! matmul.
//! The device-resident form (activations and KV pages in device memory, no per-op wait, CUDA graphs)
//! builds on the same launches.

use super::batch::Batch;
use super::launch::{self, Acts, BatchMeta, DevBatch, DevPtr, KvStore, Launcher, Weights};
use super::pages::PagePool;
use super::{DeviceError, Rope};
use crate::quant::{GgmlType, dequantize_ref};
use std::sync::{Arc, Mutex};

/// Where the GPU device's kernels run and its memory lives.
pub trait GpuRuntime: Launcher + Send + Sync + std::fmt::Debug {
    /// The GPU, for reports.
    fn describe(&self) -> String;
    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<DevMem, DeviceError>;
    /// Copies `src` to device address `dst`.
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError>;
    /// Copies `bytes` between device addresses.
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError>;
    /// Waits for every queued kernel.
    fn synchronize(&self) -> Result<(), DeviceError>;
}

/// Device memory from a [`GpuRuntime`], released when dropped.
pub struct DevMem {
    ptr: DevPtr,
    bytes: usize,
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
            _owner: owner,
        }
    }

    /// Its address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
}

/// A weight matrix in device memory.
#[derive(Debug)]
pub struct GpuMatrix {
    w: Weights,
    mem: DevMem,
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
        self.mem.bytes
    }
}

/// A matmul input's 8-bit copy (host memory the kernels address), kept in the caller's workspace because
/// an [`super::Input`] borrows it; reused across calls.
#[derive(Debug, Default)]
pub struct Quantized {
    q: Vec<i8>,
    ds: Vec<f32>,
}

/// The device's own per-op staging (RoPE tables and positions, batch metadata, attention partials),
/// reused across calls.
#[derive(Debug, Default)]
struct Staging {
    partials: Vec<f32>,
    meta: BatchMeta,
    table: Vec<f32>,
    pos: Vec<i32>,
}

/// The address of a host slice, as the kernels take it (the device reads host memory here).
fn at<T>(s: &[T]) -> DevPtr {
    DevPtr(s.as_ptr() as u64)
}

/// The address of a host slice the kernels write.
fn at_mut<T>(s: &mut [T]) -> DevPtr {
    DevPtr(s.as_mut_ptr() as u64)
}

/// The batch metadata's buffers, as [`DevBatch`].
fn dev_batch(m: &BatchMeta, batch: &Batch) -> DevBatch {
    DevBatch {
        table: at(&m.table),
        meta: at(&m.meta),
        seen: at(&m.seen),
        dst: at(&m.dst),
        seqs: at(&m.seqs),
        tokens: batch.len(),
        n_seqs: batch.seqs.len(),
        splits: m.splits,
        attend_from: m.attend_from,
    }
}

/// A GPU: its runtime, and the ops of the device API on it.
#[derive(Debug)]
pub struct GpuDevice {
    rt: Arc<dyn GpuRuntime>,
    /// Per-op staging; ops run one at a time.
    staging: Box<Mutex<Staging>>,
}

impl GpuDevice {
    /// The device over `rt`.
    pub fn new(rt: Arc<dyn GpuRuntime>) -> Self {
        GpuDevice {
            rt,
            staging: Box::new(Mutex::new(Staging::default())),
        }
    }

    fn staging(&self) -> std::sync::MutexGuard<'_, Staging> {
        self.staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Its name for reports.
    pub fn name(&self) -> String {
        format!("cuda/{}", self.rt.describe())
    }

    /// Runs `f`'s launches and waits for them (the caller may read their results next); a failure is a
    /// bug or a lost device, reported as a panic with the driver's words, which the engine turns into a
    /// failed request.
    fn run(&self, what: &str, f: impl FnOnce(&dyn Launcher) -> Result<(), DeviceError>) {
        let r = f(&*self.rt).and_then(|()| self.rt.synchronize());
        if let Err(e) = r {
            panic!("GPU {what}: {e}");
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
        self.upload(w, data)
    }

    /// `rows × cols` f32 weights (row-major), in device memory.
    pub fn matrix_f32(
        &self,
        rows: usize,
        cols: usize,
        f: &[f32],
    ) -> Result<GpuMatrix, DeviceError> {
        let bytes: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
        let w = Weights {
            ptr: DevPtr(0),
            ty: GgmlType::F32,
            rows,
            cols,
            scale: 1.0,
        };
        self.upload(w, &bytes)
    }

    fn upload(&self, mut w: Weights, data: &[u8]) -> Result<GpuMatrix, DeviceError> {
        w.check()?;
        let mem = self.rt.alloc(data.len())?;
        self.rt.upload(mem.ptr(), data)?;
        w.ptr = mem.ptr();
        Ok(GpuMatrix { w, mem })
    }

    /// Matrices of one type and width stacked along the output dimension (fused QKV, gate/up).
    pub fn concat(&self, parts: &[GpuMatrix]) -> Option<GpuMatrix> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.w.ty != first.w.ty || p.w.cols != first.w.cols || p.w.scale != first.w.scale)
        {
            return None;
        }
        let total: usize = parts.iter().map(|p| p.mem.bytes).sum();
        let mem = self.rt.alloc(total).ok()?;
        let mut at = 0;
        for p in parts {
            self.rt
                .copy(mem.ptr().offset(at), p.mem.ptr(), p.mem.bytes)
                .ok()?;
            at += p.mem.bytes;
        }
        let w = Weights {
            ptr: mem.ptr(),
            rows: parts.iter().map(|p| p.w.rows).sum(),
            ..first.w
        };
        Some(GpuMatrix { w, mem })
    }

    /// Quantizes `n` rows of `cols` floats of `x` for the matrix products (when `cols` allows it; float
    /// matrices read `x` itself). Returns the quantized input's addresses.
    pub fn input(&self, x: &[f32], n: usize, cols: usize, s: &mut Quantized) -> Option<Acts> {
        if !cols.is_multiple_of(32) {
            return None;
        }
        s.q.resize(n * cols, 0);
        s.ds.resize(2 * n * cols / 32, 0.0);
        let a = Acts {
            x: at(x),
            q: at_mut(&mut s.q),
            ds: at_mut(&mut s.ds),
            tokens: n,
            cols,
        };
        self.run("quantize", |l| launch::quantize_q8_1(l, &a));
        Some(a)
    }

    /// `out[t * w.rows + r] = W[r] · x[t]` for the `n` rows of `x` (`q`: their quantized copy).
    pub fn matmul(&self, w: &GpuMatrix, x: &[f32], n: usize, q: Option<Acts>, out: &mut [f32]) {
        let a = q.unwrap_or(Acts {
            x: at(x),
            q: DevPtr(0),
            ds: DevPtr(0),
            tokens: n,
            cols: w.w.cols,
        });
        // Block weights have whole blocks of 32 per row, so `input` quantized their activations.
        debug_assert!(q.is_some() || !w.w.kernel().is_ok_and(|(_, quantized)| quantized));
        let o = at_mut(out);
        self.run("matmul", |l| launch::matvec(l, &w.w, &a, o));
    }

    /// RMS norm of `n` rows of `d`.
    pub fn rmsnorm_rows(
        &self,
        x: &[f32],
        w: &[f32],
        eps: f32,
        n: usize,
        d: usize,
        out: &mut [f32],
    ) {
        let (xp, wp, op) = (at(x), at(w), at_mut(out));
        self.run("rmsnorm", |l| launch::rmsnorm(l, xp, wp, op, n, d, eps));
    }

    /// RoPE of every head of `x` (one token) by `angles`.
    pub fn rope(&self, kind: Rope, x: &mut [f32], head_dim: usize, angles: &[(f32, f32)]) {
        let s = &mut *self.staging();
        let heads = x.len() / head_dim;
        s.table.clear();
        s.table.extend(angles.iter().flat_map(|&(c, si)| [c, si]));
        s.pos.clear();
        s.pos.push(0);
        let (xp, pp, tp, w) = (at_mut(x), at(&s.pos), at(&s.table), heads * head_dim);
        let n = angles.len();
        self.run("rope", |l| {
            launch::rope(l, kind, xp, pp, tp, 1, w, heads, head_dim, n)
        });
    }

    /// RoPE of `rows` strided rows at their positions (see [`super::Device::rope_rows`]).
    #[expect(clippy::too_many_arguments, reason = "a strided batch of rows")]
    pub fn rope_rows(
        &self,
        kind: Rope,
        x: &mut [f32],
        rows: usize,
        stride: usize,
        width: usize,
        head_dim: usize,
        positions: &[u32],
        table: &[(f32, f32)],
        n_angles: usize,
    ) {
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
        let (xp, pp, tp) = (at_mut(x), at(&s.pos), at(&s.table));
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
    #[expect(clippy::too_many_arguments, reason = "a strided batch of rows")]
    pub fn write_kv_rows(
        &self,
        pool: &mut PagePool,
        batch: &Batch,
        layer: usize,
        rows: &[f32],
        stride: usize,
        k_at: usize,
        v_at: usize,
    ) {
        let s = &mut *self.staging();
        if let Err(e) = s.meta.build(batch, pool.page_size()) {
            panic!("GPU KV write: {e}");
        }
        let b = dev_batch(&s.meta, batch);
        let store = Self::store_mut(pool);
        let (k, v) = (at(&rows[k_at..]), at(&rows[v_at..]));
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
        q: &[f32],
        q_stride: usize,
        n_heads: usize,
        out: &mut [f32],
    ) {
        let s = &mut *self.staging();
        if let Err(e) = s.meta.build(batch, pool.page_size()) {
            panic!("GPU attention: {e}");
        }
        let b = dev_batch(&s.meta, batch);
        let shape = pool.shape();
        let group = n_heads / shape.n_kv_heads.max(1);
        s.partials.resize(
            b.partial_floats(shape.n_kv_heads, group, shape.head_dim),
            0.0,
        );
        let store = Self::store(pool);
        let (qp, op, pp) = (at(q), at_mut(out), at_mut(&mut s.partials));
        self.run("attention", |l| {
            launch::attention(l, &store, &b, layer, qp, q_stride, n_heads, op, pp)
        });
    }

    /// `x += y`.
    pub fn add(&self, x: &mut [f32], y: &[f32]) {
        let (n, xp, yp) = (x.len(), at_mut(x), at(y));
        self.run("add", |l| launch::add(l, xp, yp, n));
    }

    /// `out = silu(gate) * up`.
    pub fn silu_mul(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        let (n, g, u, o) = (out.len(), at(gate), at(up), at_mut(out));
        self.run("silu_mul", |l| launch::silu_mul(l, g, u, o, n));
    }

    /// SwiGLU of `n` fused `[gate | up]` rows of `2 f` into `out`.
    pub fn swiglu_rows(&self, gu: &[f32], n: usize, f: usize, out: &mut [f32]) {
        let (g, o) = (at(gu), at_mut(out));
        self.run("swiglu", |l| launch::swiglu_rows(l, g, o, n, f));
    }

    /// `x *= sigmoid(gate)`.
    pub fn sigmoid_gate(&self, x: &mut [f32], gate: &[f32]) {
        let (n, xp, g) = (x.len(), at_mut(x), at(gate));
        self.run("sigmoid gate", |l| launch::sigmoid_gate(l, xp, g, n));
    }
}
