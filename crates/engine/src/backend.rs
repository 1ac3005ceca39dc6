//! Devices and their kernels, behind one API. Everything device-specific lives below this module; the
//! models above it call [`Device`] ops and hold [`Matrix`] weights, and never see a `cfg` or a backend type.
//!
//! * [`batch`]: a forward pass's input as the device reads it ([`Batch`]: tokens, page tables, positions,
//!   draft-tree parents); [`pages`]: the KV page storage ([`PagePool`], f32/f16/FP8 pages, refcounts);
//!   [`fp8`]: the KV cache's E4M3 helpers. The KV cache above (`kv`) owns the tables and the prefix tree.
//! * [`cpu`]: the backend that runs everywhere: a spin/park thread pool, AVX-512 VNNI and AVX2 kernels chosen
//!   at run time, and a scalar `*_ref` version of every kernel that the tests use as the oracle (the hot
//!   path never calls them).
//! * [`gpu`]: the GPU backend for Thor: the GPU device over a runtime (CUDA, or the kernel simulator in
//!   the tests), the kernels' launches, CUDA and NVRTC (its module docs say which type is what). It
//!   compiles in every build; [`Device::cuda`] returns a typed [`DeviceError`] when CUDA is compiled out
//!   or no GPU is present.
//! * This file is the [`Device`] enum and its dispatch (each op's CPU arm calls into `cpu`, e.g. its
//!   row loops in `cpu::rows`; its GPU arm into `gpu`); beside it `open.rs` ([`DeviceKind`],
//!   [`DeviceError`]), `matrix.rs` ([`Matrix`], [`Input`], [`Workspace`], and the ops that make matrices
//!   and multiply by them), `fused.rs` (ops fused where the device can) and `gdn_run.rs` ([`GdnRun`],
//!   [`GdnSteps`]), re-exported here.
//!
//! # The API
//!
//! A [`Device`] owns its worker threads (CPU) or context and streams (CUDA), and makes the weights in its own
//! layout ([`Device::matrix`], [`Device::matrix_f32`], [`Device::concat`]: on the CPU, groups of 16 rows
//! repacked block by block with their scales). A forward pass is a sequence of batch-wide ops:
//!
//! | op | what |
//! |---|---|
//! | [`Device::embed`] | exact dequantization of embedding rows |
//! | [`Device::rmsnorm_rows`] | RMSNorm of each row |
//! | [`Device::norm_logit_rows`] | the final norm of the rows whose logits a batch wants (the LM head's input) |
//! | [`Device::input`] + [`Device::matmul`] | `W·x` over quantized weights; the CPU quantizes the activations to 8 bits per 32 once per input, inside |
//! | [`Device::matmul_reference`] | the f64-accumulated check path over the stored GGUF rows |
//! | [`Device::rope_rows`] | rotary embedding of a batch's rows at their positions, llama.cpp's normal (adjacent pairs) or NeoX (halves, partial) |
//! | [`Device::write_kv_rows`] | the batch's keys and values into their KV page slots |
//! | [`Device::attention`] | paged attention over a [`Batch`], draft-tree rows included |
//! | [`Device::swiglu_rows`], [`Device::silu_mul`], [`Device::add`] | the MLP's activation and the residual |
//! | [`Device::sigmoid_gate`] | gated attention's output gate |
//! | [`Device::gdn_conv`], [`Device::gdn_normalize_qk`], [`Device::gdn_gates`] | Gated DeltaNet's causal convolution (its window is state), q/k norms and gates |
//! | [`Device::gdn_recurrence`], [`Device::gdn_chunked`] | the delta rule over a sequence's run, token by token (steps kept for verification) or in chunks |
//! | [`Device::gdn_gated_norm`] | the DeltaNet output's gated norm |
//!
//! Activations are [`Buf`]s in the device's memory (a `Vec` on the CPU, device memory on a GPU), grown by
//! [`Device::grow`] and handed to the ops as [`View`] / [`ViewMut`] ranges; the host reaches them only
//! through [`Buf::read_back`] and [`Buf::edit`] (see [`buf`]). A GPU queues its ops and returns, so a pass
//! ends with [`Device::finish`]. Per-forward device state (quantized activations, attention partials)
//! lives in a [`Workspace`] the caller keeps, so a pass allocates nothing once it has grown.
//!
//! State kept between passes (a hybrid model's recurrent states, which the prefix cache snapshots) is
//! [`Buf`]s too, moved to a GPU by [`Device::grow`] at their first pass and kept there; the host copies
//! them where they live ([`Buf::copy_from`], [`Buf::duplicate`]) without reading them back.

pub mod batch;
pub mod buf;
pub mod cpu;
pub mod fp8;
mod fused;
mod gdn_run;
pub mod gpu;
mod matrix;
mod open;
pub mod pages;

#[cfg(test)]
pub(crate) use gpu::sim;

use crate::quant::GgmlType;
use batch::Batch;
pub use buf::{Buf, Edit, View, ViewMut};
use cpu::Cpu;
pub use cpu::gdn;
pub use cpu::ops::rope_angles;
pub use cpu::simd::{MAX_GROUP, MAX_HEAD_DIM};
use pages::PagePool;

pub use gdn_run::{GdnRun, GdnSteps};
pub use matrix::{Input, Matrix, Workspace};
pub use open::{AttentionMath, DeviceError, DeviceKind, default_kernel_cache};

use gdn::Shape as GdnShape;

/// A pass's embedding rows, for [`Device::begin_step`]: rows `tokens` of an embedding table of type `ty`
/// (`d` values per row, `table` its bytes), dequantized exactly into `out` (`tokens.len() × d`).
#[derive(Debug)]
pub struct Embedding<'a> {
    /// The table's type.
    pub ty: GgmlType,
    /// The table's bytes.
    pub table: &'a [u8],
    /// Values per row.
    pub d: usize,
    /// The rows.
    pub tokens: &'a [u32],
    /// Where they go.
    pub out: ViewMut<'a>,
}

/// A compute device.
#[derive(Debug)]
pub enum Device {
    /// The CPU backend.
    Cpu(Cpu),
    /// A CUDA GPU (or, in the tests, the kernel simulator standing in for one).
    Cuda(gpu::GpuDevice),
}

/// Reductions over a row of logits where sampling runs, on the host: the best kernels this CPU has (the
/// sampler's argmax and log-sum-exp; the device hands it its logits rows).
#[derive(Debug, Clone, Copy)]
pub struct HostReduce {
    isa: cpu::Isa,
}

impl HostReduce {
    /// The kernels for this machine.
    pub fn detect() -> Self {
        HostReduce {
            isa: cpu::Isa::detect(),
        }
    }

    /// Index of the largest value (the first of equals); `None` for an empty row.
    pub fn argmax(&self, x: &[f32]) -> Option<usize> {
        cpu::simd::argmax(self.isa, x)
    }

    /// `ln(sum(exp(x)))`, computed stably.
    pub fn logsumexp(&self, x: &[f32]) -> f32 {
        cpu::simd::logsumexp(self.isa, x)
    }

    /// The largest value (`-inf` for an empty row).
    pub fn max(&self, x: &[f32]) -> f32 {
        cpu::simd::max(self.isa, x)
    }

    /// `x[i] = exp(x[i] - m)` in place, returning the sum (softmax's unnormalised weights; values far
    /// below `m`, minus infinity and NaN may weigh 0).
    pub fn exp_sub(&self, x: &mut [f32], m: f32) -> f32 {
        cpu::simd::exp_sub(self.isa, x, m)
    }
}

/// A rotary-embedding layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    /// llama.cpp's "normal" RoPE: adjacent pairs `(2i, 2i + 1)` of each head rotate.
    Normal,
    /// NeoX RoPE: pairs `(i, i + half)` of the first `2 · angles` dims rotate (partial when the table is
    /// shorter than half the head).
    Neox,
}

/// `v.len() >= n`, growing with zeros (buffers only grow, so a pass allocates nothing once warm).
pub fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

impl Device {
    /// The CPU with `threads` threads (0 = one per physical core) and the best ISA of this machine.
    pub fn cpu(threads: usize) -> Self {
        Device::Cpu(Cpu::new(threads))
    }

    /// GPU `ordinal`, its kernels compiled into `kernel_cache` (`None`: every time), or why there is none.
    pub fn cuda(
        ordinal: usize,
        kernel_cache: Option<&std::path::Path>,
    ) -> Result<Self, DeviceError> {
        gpu::cuda::open(ordinal, kernel_cache).map(Device::Cuda)
    }

    /// A GPU device over `rt` (a CUDA GPU's runtime; in the tests, the kernel simulator).
    pub fn gpu(rt: std::sync::Arc<dyn gpu::GpuRuntime>) -> Self {
        Device::Cuda(gpu::GpuDevice::new(rt))
    }

    /// The device's name for reports (`cpu/avx512vnni`, `cpu/neon-i8mm`, ...).
    pub fn name(&self) -> String {
        match self {
            Device::Cpu(c) => format!("cpu/{}", c.isa().name()),
            Device::Cuda(g) => g.name(),
        }
    }

    /// Host threads the device's kernels run on.
    pub fn threads(&self) -> usize {
        match self {
            Device::Cpu(c) => c.threads(),
            Device::Cuda(_) => 1,
        }
    }

    /// `b` with room for at least `n` floats in this device's memory (the buffers of a pass only grow,
    /// so a warm pass allocates nothing).
    pub fn grow(&self, b: &mut Buf, n: usize) -> Result<(), DeviceError> {
        match (self, &mut b.mem) {
            (Device::Cpu(_), buf::Mem::Host(v)) => {
                grow(v, n);
                Ok(())
            }
            (Device::Cpu(_), buf::Mem::Gpu(_)) => Err(DeviceError::Unsupported {
                device: "the CPU",
                what: "a GPU buffer".into(),
            }),
            (Device::Cuda(g), _) => g.grow(b, n),
        }
    }

    /// Where a KV page pool's stores live when not in host memory (a GPU's device memory), and what runs
    /// the pool's copies there; `None` on the CPU, whose pages are host memory.
    pub(crate) fn pages(&self) -> Option<std::sync::Arc<dyn pages::PageDevice>> {
        match self {
            Device::Cpu(_) => None,
            Device::Cuda(g) => Some(g.pages()),
        }
    }

    /// `v` as a buffer of this device (norm weights, and other constants the ops read).
    pub fn buf(&self, v: Vec<f32>) -> Result<Buf, DeviceError> {
        match self {
            Device::Cpu(_) => Ok(Buf::from(v)),
            Device::Cuda(g) => g.buf(v),
        }
    }

    /// Turns CUDA graphs on or off (a GPU's launches between two host waits replayed as one graph once
    /// they repeat; see `gpu::Queue`). The CPU has none.
    pub fn set_graphs(&self, on: bool) {
        if let Device::Cuda(g) = self {
            g.set_graphs(on);
        }
    }

    /// What a GPU's launches did so far (graphs replayed and captured, kernels launched one by one).
    pub fn graph_stats(&self) -> Option<gpu::GraphStats> {
        match self {
            Device::Cpu(_) => None,
            Device::Cuda(g) => Some(g.graph_stats()),
        }
    }

    /// Times every GPU kernel launched from now on (`on`: graphs off, an event pair around each launch), or
    /// stops; [`Device::kernel_times`] reads the times. The CPU has no kernels to time.
    pub fn time_kernels(&self, on: bool) -> Result<(), DeviceError> {
        match self {
            Device::Cpu(_) => Err(DeviceError::Unsupported {
                device: "the CPU",
                what: "kernel times (they are a GPU's)".into(),
            }),
            Device::Cuda(g) => g.time_kernels(on),
        }
    }

    /// The GPU kernels timed since the last call, per kernel name (waits for the queued ops).
    pub fn kernel_times(&self) -> Result<gpu::KernelTimes, DeviceError> {
        match self {
            Device::Cpu(_) => Ok(gpu::KernelTimes::default()),
            Device::Cuda(g) => g.kernel_times(),
        }
    }

    /// Waits for the queued ops (a GPU queues them; the CPU runs each before it returns). A forward pass
    /// ends with it: the host reads the KV pages next.
    pub fn finish(&self) {
        if let Device::Cuda(g) = self {
            g.finish();
        }
    }

    /// Starts a forward pass of `batch` under `key` (the model's part: which model and scratch, the rows
    /// that want logits; see [`gpu::plan`]), after staging what its ops read (the batch's metadata, its
    /// RoPE rows `(table, angles per position)` when given) and writing its embedding rows (when given);
    /// a GPU stages all of those with one upload. On a GPU with graphs on, a pass seen before under the
    /// same key is replayed whole and this returns `true`: the model runs none of its ops and reads its
    /// results. Otherwise `false`: the model runs its ops, then calls [`Device::end_step`]. An empty key
    /// (a pass the model does not plan) and the CPU always run the ops.
    pub fn begin_step(
        &self,
        key: &mut gpu::StepKey,
        pool: &mut PagePool,
        batch: &Batch,
        rope: Option<(&[(f32, f32)], usize)>,
        embed: Option<Embedding<'_>>,
    ) -> Result<bool, DeviceError> {
        match self {
            Device::Cpu(_) => {
                if let Some(e) = embed {
                    self.embed(e.ty, e.table, e.d, e.tokens, e.out)?;
                }
                Ok(false)
            }
            Device::Cuda(g) => g.begin_step(key, pool, batch, rope, embed),
        }
    }

    /// Ends the pass [`Device::begin_step`] started, when the model ran its ops.
    pub fn end_step(&self) {
        if let Device::Cuda(g) = self {
            g.end_step();
        }
    }

    /// Whether a GPU device records a pass that could be replayed and checks it against its plan
    /// (on in the tests; see [`gpu::plan`]).
    #[cfg(test)]
    pub(crate) fn verify_steps(&self, on: bool) {
        if let Device::Cuda(g) = self {
            g.verify_steps(on);
        }
    }

    /// On a GPU of sm_90 or later, launches each kernel so that it may start while the one before it
    /// finishes (programmatic dependent launch), or not; returns whether launches now do (never on the
    /// CPU). Off by default until measured.
    pub fn set_pdl(&self, on: bool) -> bool {
        match self {
            Device::Cpu(_) => false,
            Device::Cuda(g) => g.set_pdl(on),
        }
    }

    /// The CPU's attention products: bf16 where `math` asks for them and the CPU has them (AVX-512 BF16),
    /// else f32; a GPU keeps its own kernels. Returns whether bf16 products are now on. Set it before the
    /// KV cache is filled.
    pub fn set_attention(&self, math: AttentionMath) -> bool {
        match self {
            Device::Cpu(c) => c.set_bf16_attention(math == AttentionMath::Bf16),
            Device::Cuda(_) => false,
        }
    }

    /// On a GPU, whether Q4_1 matrices loaded from now on are packed for the kernels' aligned loads (the
    /// default) or kept as the GGUF file lays them out (to compare the two); nothing on the CPU.
    pub fn set_packed_weights(&self, on: bool) {
        if let Device::Cuda(g) = self {
            g.set_packed_weights(on);
        }
    }

    /// Floats [`Device::logit_best`] writes per row.
    pub const BEST_FLOATS: usize = gpu::launch::ROW_BEST_FLOATS;

    /// On a GPU, each of `rows` rows of `vocab` logits reduced where it is to its greedy token (the lower
    /// index among equals, as a float; -1 when every value is NaN), that logit and the row's
    /// log-normaliser, [`Device::BEST_FLOATS`] floats per row into `out`, so that a greedy step reads back
    /// those instead of the rows; returns `true`. The CPU reads its rows where they are: it computes
    /// nothing and returns `false`.
    pub fn logit_best<'v>(
        &self,
        logits: impl Into<View<'v>>,
        rows: usize,
        vocab: usize,
        out: impl Into<ViewMut<'v>>,
    ) -> bool {
        match self {
            Device::Cpu(_) => false,
            Device::Cuda(g) => {
                g.row_best(logits.into(), rows, vocab, out.into());
                true
            }
        }
    }

    /// The most top-k sampling candidates [`Device::logit_top`] finds per row.
    pub const TOP_CANDIDATES: usize = gpu::launch::TOP_CANDIDATES;

    /// Floats [`Device::logit_top`] writes per row: the count, then (index, value) pairs.
    pub const TOP_FLOATS: usize = gpu::launch::TOP_FLOATS;

    /// On a GPU, each of `rows` rows of `vocab` logits reduced where it is to its
    /// [`Device::TOP_CANDIDATES`] largest finite values (the lower index first among equals; fewer when
    /// the row has fewer), [`Device::TOP_FLOATS`] floats per row into `out` (the count, then (index as a
    /// float, value) pairs in no order), so that a top-k sampling step reads back those instead of the
    /// rows; returns `true`. The CPU computes nothing and returns `false`.
    pub fn logit_top<'v>(
        &self,
        logits: impl Into<View<'v>>,
        rows: usize,
        vocab: usize,
        out: impl Into<ViewMut<'v>>,
    ) -> bool {
        match self {
            Device::Cpu(_) => false,
            Device::Cuda(g) => {
                g.row_top(logits.into(), rows, vocab, out.into());
                true
            }
        }
    }

    /// Rows `tokens` of an embedding table of type `ty` (`d` values per row, `table` its bytes), dequantized
    /// exactly into `out` (`tokens.len() × d`).
    pub fn embed<'v>(
        &self,
        ty: GgmlType,
        table: &[u8],
        d: usize,
        tokens: &[u32],
        out: impl Into<ViewMut<'v>>,
    ) -> Result<(), DeviceError> {
        let rb = ty.row_bytes(d).ok_or_else(|| DeviceError::Unsupported {
            device: "embed",
            what: format!("rows of {d} values of type {ty}"),
        })?;
        // A few rows of exact dequantization: on the host for every device (the table is host memory).
        let out = out.into();
        match self {
            Device::Cpu(_) => Ok(cpu::rows::embed(ty, table, rb, d, tokens, out.host())?),
            Device::Cuda(g) => g.embed_rows(&Embedding {
                ty,
                table,
                d,
                tokens,
                out,
            }),
        }
    }

    /// RMSNorm of `n` rows of `d` floats of `x` with weight `w` into `out`.
    pub fn rmsnorm_rows<'v>(
        &self,
        x: impl Into<View<'v>>,
        w: impl Into<View<'v>>,
        eps: f32,
        n: usize,
        d: usize,
        out: impl Into<ViewMut<'v>>,
    ) {
        let (x, w, out) = (x.into(), w.into(), out.into());
        match self {
            Device::Cpu(_) => cpu::rows::rmsnorm_rows(x.host(), w.host(), eps, n, d, out.host()),
            Device::Cuda(g) => g.rmsnorm_rows(x, w, eps, n, d, out),
        }
    }

    /// The rows of `x` (`d` floats per token of `batch`) whose logits the batch asks for, in batch order,
    /// RMS-normed with `w` into `out`: the LM head's input. Returns how many rows were written.
    pub fn norm_logit_rows<'v>(
        &self,
        x: impl Into<View<'v>>,
        batch: &Batch,
        w: impl Into<View<'v>>,
        eps: f32,
        d: usize,
        out: impl Into<ViewMut<'v>>,
    ) -> usize {
        let (x, w, mut out) = (x.into(), w.into(), out.into());
        // Runs of rows that follow each other in the batch (a decode step's, a prefill's) are one op.
        let mut m = 0;
        batch.for_each_logit_run(|r| {
            let rows = r.len();
            self.rmsnorm_rows(
                x.slice(r.start * d..r.end * d),
                w,
                eps,
                rows,
                d,
                out.slice(m * d..(m + rows) * d),
            );
            m += rows;
        });
        m
    }

    /// RoPE of `rows` rows `stride` floats apart, each over its first `width` floats (whole heads of
    /// `head_dim`; a fused QKV row's Q and K heads), row `t` at position `positions[t]` of `table` (`n_angles`
    /// `(cos, sin)` pairs per position, the layout `rope_angles` appends).
    #[expect(clippy::too_many_arguments, reason = "a strided batch of rows")]
    pub fn rope_rows<'v>(
        &self,
        kind: Rope,
        x: impl Into<ViewMut<'v>>,
        rows: usize,
        stride: usize,
        width: usize,
        head_dim: usize,
        positions: &[u32],
        table: &[(f32, f32)],
        n_angles: usize,
    ) {
        let (x, p) = (x.into(), &positions[..rows]);
        match self {
            Device::Cpu(_) => {
                let x = x.host();
                cpu::rows::rope_rows(kind, x, stride, width, head_dim, p, table, n_angles);
            }
            Device::Cuda(g) => {
                g.rope_rows(kind, x, rows, stride, width, head_dim, p, table, n_angles);
            }
        }
    }

    /// Every token's keys and values of `layer` into its KV page slot: token `t`'s keys are
    /// `k[t * stride..]` and its values `v[t * stride..]` (`n_kv_heads × head_dim` each; the K and V parts
    /// of fused QKV rows, or rows of their own).
    pub fn write_kv_rows<'v>(
        &self,
        pool: &mut PagePool,
        batch: &Batch,
        layer: usize,
        k: impl Into<View<'v>>,
        v: impl Into<View<'v>>,
        stride: usize,
    ) {
        let (k, v) = (k.into(), v.into());
        match self {
            Device::Cpu(_) => {
                cpu::rows::write_kv_rows(pool, batch, layer, k.host(), v.host(), stride);
            }
            Device::Cuda(g) => g.write_kv_rows(pool, batch, layer, k, v, stride),
        }
    }

    /// Causal attention for every token of `batch` in `layer`, reading the KV pages (which must already
    /// hold the batch's own tokens). Token `t`'s query heads (`n_heads × head_dim`) are at
    /// `q[t * q_stride..]` (a fused QKV row is read in place); `out` is `tokens × n_heads × head_dim`.
    #[expect(
        clippy::too_many_arguments,
        reason = "attention needs its shape spelled out"
    )]
    pub fn attention<'v>(
        &self,
        pool: &PagePool,
        layer: usize,
        batch: &Batch,
        q: impl Into<View<'v>>,
        q_stride: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        out: impl Into<ViewMut<'v>>,
        ws: &mut Workspace,
    ) {
        let (q, out) = (q.into(), out.into());
        match self {
            Device::Cpu(c) => c.attention(
                pool,
                layer,
                batch,
                q.host(),
                q_stride,
                n_heads,
                n_kv_heads,
                head_dim,
                out.host(),
                &mut ws.partials,
                &mut ws.tiles,
            ),
            Device::Cuda(g) => g.attention(pool, layer, batch, q, q_stride, n_heads, out),
        }
    }

    /// `x += y`.
    pub fn add<'v>(&self, x: impl Into<ViewMut<'v>>, y: impl Into<View<'v>>) {
        let (x, y) = (x.into(), y.into());
        match self {
            Device::Cpu(_) => cpu::simd::add(x.host(), y.host()),
            Device::Cuda(g) => g.add(x, y),
        }
    }

    /// `out = silu(gate) * up`, element-wise.
    pub fn silu_mul<'v>(
        &self,
        gate: impl Into<View<'v>>,
        up: impl Into<View<'v>>,
        out: impl Into<ViewMut<'v>>,
    ) {
        let (gate, up, out) = (gate.into(), up.into(), out.into());
        match self {
            Device::Cpu(_) => cpu::simd::silu_mul(gate.host(), up.host(), out.host()),
            Device::Cuda(g) => g.silu_mul(gate, up, out),
        }
    }

    /// `x *= sigmoid(gate)`, element-wise (gated attention's output gate).
    pub fn sigmoid_gate<'v>(&self, x: impl Into<ViewMut<'v>>, gate: impl Into<View<'v>>) {
        let (x, gate) = (x.into(), gate.into());
        match self {
            Device::Cpu(_) => cpu::rows::sigmoid_gate(x.host(), gate.host()),
            Device::Cuda(g) => g.sigmoid_gate(x, gate),
        }
    }

    /// Writes host values into `out` (a GPU queues the upload; `v` can be reused at once).
    pub fn write<'v>(&self, out: impl Into<ViewMut<'v>>, v: &[f32]) {
        let out = out.into();
        match self {
            Device::Cpu(_) => out.host()[..v.len()].copy_from_slice(v),
            Device::Cuda(g) => g.upload(&out, v),
        }
    }

    /// Gated DeltaNet: the causal convolution of `n` tokens' `[q | k | v]` (`x`) with `taps`, continuing
    /// from `window` (updated), into `y`; `steps` keeps the window after each of the run's last tokens
    /// (verification), at its offset.
    #[expect(
        clippy::too_many_arguments,
        reason = "the convolution's state and its outputs"
    )]
    pub fn gdn_conv<'v>(
        &self,
        shape: &GdnShape,
        taps: impl Into<View<'v>>,
        window: impl Into<ViewMut<'v>>,
        x: impl Into<View<'v>>,
        n: usize,
        y: impl Into<ViewMut<'v>>,
        steps: Option<GdnSteps<'_>>,
    ) {
        let (taps, window, x, y) = (taps.into(), window.into(), x.into(), y.into());
        match self {
            Device::Cpu(_) => {
                let mut steps = steps.map(GdnSteps::host);
                gdn::conv(
                    shape,
                    taps.host(),
                    window.host(),
                    x.host(),
                    n,
                    y.host(),
                    steps.as_mut(),
                );
            }
            Device::Cuda(g) => g.gdn_conv(shape, taps, window, x, n, y, steps),
        }
    }

    /// Gated DeltaNet: L2-normalises the q and k heads of `n` tokens of `y` (q also scaled).
    pub fn gdn_normalize_qk<'v>(&self, shape: &GdnShape, y: impl Into<ViewMut<'v>>, n: usize) {
        let y = y.into();
        match self {
            Device::Cpu(_) => gdn::normalize_qk(shape, y.host(), n),
            Device::Cuda(g) => g.gdn_normalize_qk(shape, y, n),
        }
    }

    /// Gated DeltaNet: the decay `alpha` and write strength `beta` gates (tokens × `a.len()` heads) from
    /// their projections, in place.
    pub fn gdn_gates<'v>(
        &self,
        a: impl Into<View<'v>>,
        dt_bias: impl Into<View<'v>>,
        alpha: impl Into<ViewMut<'v>>,
        beta: impl Into<ViewMut<'v>>,
    ) {
        let (a, dt_bias, alpha, beta) = (a.into(), dt_bias.into(), alpha.into(), beta.into());
        match self {
            Device::Cpu(_) => gdn::gates(a.host(), dt_bias.host(), alpha.host(), beta.host()),
            Device::Cuda(g) => g.gdn_gates(a, dt_bias, alpha, beta),
        }
    }

    /// Gated DeltaNet: every value head's delta-rule recurrence over a run, token by token (the form
    /// decode and verification use): `state` holds the heads' `[dk][dv]` matrices, `out` gets `n × vh × dv`;
    /// `steps` keeps the matrices after each of the run's last tokens, at its offset.
    pub fn gdn_recurrence<'v>(
        &self,
        shape: &GdnShape,
        run: GdnRun<'v>,
        state: impl Into<ViewMut<'v>>,
        out: impl Into<ViewMut<'v>>,
        steps: Option<GdnSteps<'_>>,
    ) {
        let (state, out) = (state.into(), out.into());
        match self {
            Device::Cpu(_) => {
                let steps = steps.map(GdnSteps::host);
                cpu::rows::gdn_recurrence(shape, &run.host(), state.host(), out.host(), steps);
            }
            Device::Cuda(g) => g.gdn_recurrence(shape, run, state, out, steps),
        }
    }

    /// Gated DeltaNet: the same recurrence in chunked (WY) form (prefill on matrix engines), every value
    /// head.
    pub fn gdn_chunked<'v>(
        &self,
        shape: &GdnShape,
        run: GdnRun<'v>,
        state: impl Into<ViewMut<'v>>,
        out: impl Into<ViewMut<'v>>,
    ) {
        let (state, out) = (state.into(), out.into());
        match self {
            Device::Cpu(_) => cpu::rows::gdn_chunked(shape, &run.host(), state.host(), out.host()),
            Device::Cuda(g) => g.gdn_chunked(shape, run, state, out),
        }
    }

    /// Gated DeltaNet: the output's gated RMSNorm per value head, `o = norm(o) * silu(z)`, over every row
    /// of `dv` in `o`.
    pub fn gdn_gated_norm<'v>(
        &self,
        shape: &GdnShape,
        o: impl Into<ViewMut<'v>>,
        z: impl Into<View<'v>>,
        w: impl Into<View<'v>>,
        eps: f32,
    ) {
        let (o, z, w) = (o.into(), z.into(), w.into());
        match self {
            Device::Cpu(_) => gdn::gated_norm(shape, o.host(), z.host(), w.host(), eps),
            Device::Cuda(g) => g.gdn_gated_norm(shape, o, z, w, eps),
        }
    }

    /// SwiGLU of `n` rows laid out `[gate (f) | up (f)]` (a fused gate/up projection) into `out` (`n × f`).
    pub fn swiglu_rows<'v>(
        &self,
        gu: impl Into<View<'v>>,
        n: usize,
        f: usize,
        out: impl Into<ViewMut<'v>>,
    ) {
        let (gu, out) = (gu.into(), out.into());
        match self {
            Device::Cuda(g) => g.swiglu_rows(gu, n, f, out),
            Device::Cpu(c) => c.swiglu_rows(gu.host(), n, f, out.host()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_cuda_is_a_gpu_or_a_typed_error() {
        assert_eq!("cpu".parse(), Ok(DeviceKind::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceKind::Cuda(0)));
        assert_eq!("CUDA:3".parse(), Ok(DeviceKind::Cuda(3)));
        assert!("tpu".parse::<DeviceKind>().is_err());
        assert!("cuda:x".parse::<DeviceKind>().is_err());
        assert_eq!("Auto".parse(), Ok(DeviceKind::Auto));
        let auto = DeviceKind::Auto.open(1, None).unwrap();
        match DeviceKind::Cuda(0).open(1, None) {
            // Compiled in on a machine with a GPU: that GPU, and `auto` takes it too.
            Ok(dev) => {
                assert!(dev.name().starts_with("cuda/"), "{}", dev.name());
                assert_eq!(auto.name(), dev.name());
            }
            // Compiled out, or compiled in on a machine without a GPU (or without the kernels yet): an
            // error that says which, never a panic, and `auto` falls back to the CPU.
            Err(
                DeviceError::CudaNotCompiled
                | DeviceError::MissingLibrary { .. }
                | DeviceError::NoGpu(_)
                | DeviceError::Unsupported { .. },
            ) => assert!(auto.name().starts_with("cpu/"), "{}", auto.name()),
            Err(other) => panic!("unexpected: {other:?}"),
        }
        assert!(
            DeviceKind::Cpu
                .open(1, None)
                .unwrap()
                .name()
                .starts_with("cpu/")
        );
    }

    /// Without a place from its caller (the host's `--cache-dir`), the engine caches a GPU's kernels where
    /// it always has: `kernels/` under thorn's cache directory.
    #[test]
    fn the_engine_caches_kernels_under_the_cache_dir_unless_told_where() {
        let want = crate::cache_dir().map(|d| d.join("kernels"));
        assert_eq!(default_kernel_cache(), want);
        assert_eq!(crate::EngineConfig::default().kernel_cache, want);
    }
}
