//! Blocks both architectures share, written once against the device API.
//!
//! * [`Linear`]: a weight matrix in the device's layout; for Llama's reference precision also the GGUF
//!   parts it was built from (the f64 check path reads those).
//! * [`Mlp`]: the SwiGLU feed-forward block, `x += down(silu(gate(norm(x))) * up(norm(x)))`. Gate and up
//!   are one matrix when their types allow (one pass over the input, one launch), two otherwise; the
//!   products are the same either way (each output row is its own dot product).
//! * [`LmHead`]: the final norm of the rows whose logits a batch wants, then the LM head over them.
//! * [`Profile`]: time per [`Stage`] of a forward pass; the blocks mark their stages as they go (free
//!   when profiling is off).
//!
//! A model file holds these blocks and describes the rest of its architecture (attention variants, the
//! recurrent mixer); none of them knows the device.

use super::ModelError;
use crate::backend::{Buf, Device, Input, Matrix, View, Workspace};
use crate::gguf::{Gguf, TensorInfo};
use crate::kv::Batch;
use std::sync::Arc;

/// Stages of a forward pass, for profiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Embedding lookup, norms, RoPE, residual adds, activation quantization (caller thread).
    Other,
    /// Fused Q/K/V projection.
    Qkv,
    /// Attention over the KV cache.
    Attention,
    /// Attention output projection.
    AttnOut,
    /// Fused gate/up projection.
    GateUp,
    /// SiLU * up.
    Activation,
    /// Down projection.
    Down,
    /// Final norm and LM head.
    Output,
}

impl Stage {
    /// Every stage, in pass order.
    pub const ALL: [Stage; 8] = [
        Stage::Other,
        Stage::Qkv,
        Stage::Attention,
        Stage::AttnOut,
        Stage::GateUp,
        Stage::Activation,
        Stage::Down,
        Stage::Output,
    ];
}

/// Accumulated time per [`Stage`].
#[derive(Debug, Clone, Default)]
pub struct Profile {
    /// Seconds per stage, indexed like [`Stage::ALL`].
    pub seconds: [f64; 8],
    last: Option<std::time::Instant>,
}

impl Profile {
    /// Starts the clock of a forward pass.
    pub(crate) fn start(&mut self) {
        self.last = Some(std::time::Instant::now());
    }

    fn mark(&mut self, stage: Stage) {
        let now = std::time::Instant::now();
        if let Some(last) = self.last {
            self.seconds[stage as usize] += (now - last).as_secs_f64();
        }
        self.last = Some(now);
    }
}

/// Records the time since the previous mark under `stage` (free when profiling is off).
pub(crate) fn mark(p: &mut Option<Profile>, stage: Stage) {
    if let Some(p) = p {
        p.mark(stage);
    }
}

/// How the shared blocks run in this forward pass.
#[derive(Debug, Clone, Copy)]
pub struct Run<'a> {
    /// The device.
    pub dev: &'a Device,
    /// `Some`: the f64 reference path, reading weights from this file's tensors; `None`: the device's own
    /// (quantized) arithmetic.
    pub reference: Option<&'a Gguf>,
    /// RMS-norm epsilon.
    pub eps: f32,
}

/// A weight matrix: in the device's layout, and (for the reference path) the GGUF tensors it was built
/// from, stacked by rows.
#[derive(Debug)]
pub struct Linear {
    q: Matrix,
    parts: Vec<TensorInfo>,
}

impl Linear {
    /// A matrix with no reference form (the reference path then uses the device's arithmetic).
    pub fn new(q: Matrix) -> Self {
        Linear {
            q,
            parts: Vec::new(),
        }
    }

    /// The GGUF tensors `parts`, stacked by rows into one matrix in `dev`'s layout; `None` when their
    /// types cannot share one matrix.
    pub fn from_gguf(
        dev: &Device,
        g: &Arc<Gguf>,
        parts: Vec<TensorInfo>,
    ) -> Result<Option<Self>, ModelError> {
        // The file's mapping outlives weights a GPU reads in place.
        let owner: Arc<dyn Send + Sync> = Arc::<Gguf>::clone(g);
        let mats = parts
            .iter()
            .map(|t| {
                let (rows, cols) = t.rows_cols();
                let data = g.tensor_data(t);
                dev.mapped_matrix(t.ty, rows as usize, cols as usize, data, &owner)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(dev.concat(mats).map(|q| Linear { q, parts }))
    }

    /// The matrix in the device's layout.
    pub fn matrix(&self) -> &Matrix {
        &self.q
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.q.rows()
    }

    /// Bytes of the device's copy.
    pub fn bytes(&self) -> usize {
        self.q.bytes()
    }

    /// `out[t * rows + r] = W[r] · x[t]` for the `n` rows of `x`.
    pub fn apply<'v>(
        &self,
        run: &Run<'_>,
        x: impl Into<View<'v>>,
        n: usize,
        ws: &mut Workspace,
        out: &mut Buf,
    ) -> Result<(), ModelError> {
        let x = x.into();
        if let Some(r) = self.reference(run, || x, n, out) {
            return r;
        }
        let input = run.dev.input(x, n, self.q.cols(), ws);
        run.dev.matmul(&self.q, &input, out);
        Ok(())
    }

    /// [`Linear::apply`] to an input already prepared (by [`Device::norm_input`], say).
    pub fn apply_to(&self, run: &Run<'_>, x: &Input<'_>, out: &mut Buf) -> Result<(), ModelError> {
        if let Some(r) = self.reference(run, || x.floats(), x.rows(), out) {
            return r;
        }
        run.dev.matmul(&self.q, x, out);
        Ok(())
    }

    /// `out[t * rows + r] += W[r] · x[t]` (a residual); `tmp` holds the products where the device adds
    /// them separately.
    pub fn apply_add(
        &self,
        run: &Run<'_>,
        x: &Input<'_>,
        out: &mut Buf,
        tmp: &mut Buf,
    ) -> Result<(), ModelError> {
        let n = x.rows() * self.q.rows();
        if let Some(r) = self.reference(run, || x.floats(), x.rows(), tmp) {
            r?;
            run.dev.add(out.at_mut(..n), tmp.at(..n));
            return Ok(());
        }
        run.dev.matmul_add(&self.q, x, out, tmp);
        Ok(())
    }

    /// The reference path's product (`None`: the fast path runs). The input's floats are asked for only
    /// here (a GPU may not have written a prepared input's otherwise).
    fn reference<'v>(
        &self,
        run: &Run<'_>,
        x: impl FnOnce() -> View<'v>,
        n: usize,
        out: &mut Buf,
    ) -> Option<Result<(), ModelError>> {
        let g = run.reference.filter(|_| !self.parts.is_empty())?;
        let x = x();
        let (rows, cols) = (self.q.rows(), self.q.cols());
        let mut product = || -> Result<(), ModelError> {
            run.dev.grow(out, n * rows)?;
            let mut row0 = 0;
            for part in &self.parts {
                let prows = part.rows_cols().0 as usize;
                run.dev.matmul_reference(
                    part.ty,
                    g.tensor_data(part),
                    prows,
                    x,
                    n,
                    cols,
                    &mut *out,
                    rows,
                    row0,
                )?;
                row0 += prows;
            }
            Ok(())
        };
        Some(product())
    }
}

/// Gate and up projections of an [`Mlp`].
#[derive(Debug)]
enum GateUp {
    /// One matrix, `[gate; up]` rows.
    Fused(Linear),
    /// Two (their types differ).
    Split(Linear, Linear),
}

/// The SwiGLU feed-forward block with its pre-norm.
#[derive(Debug)]
pub struct Mlp {
    norm: Buf,
    gate_up: GateUp,
    down: Linear,
    ffn: usize,
}

/// An [`Mlp`]'s buffers (grown once, reused).
#[derive(Debug, Default)]
pub struct MlpScratch {
    xb: Buf,
    gu: Buf,
    up: Buf,
    h: Buf,
    out: Buf,
}

impl Mlp {
    /// The block with gate and up fused into one matrix (`[gate; up]`: `2 ffn x d`; `down`: `d x ffn`).
    pub fn fused(norm: Buf, gate_up: Linear, down: Linear) -> Self {
        Mlp {
            norm,
            ffn: gate_up.rows() / 2,
            gate_up: GateUp::Fused(gate_up),
            down,
        }
    }

    /// The block with gate and up as two matrices (`ffn x d` each), for types that cannot share one.
    pub fn split(norm: Buf, gate: Linear, up: Linear, down: Linear) -> Self {
        Mlp {
            norm,
            ffn: gate.rows(),
            gate_up: GateUp::Split(gate, up),
            down,
        }
    }

    /// The block from GGUF tensors (`blk.N.ffn_{gate,up,down}`), gate and up fused when their types allow.
    pub fn from_gguf(
        dev: &Device,
        g: &Arc<Gguf>,
        norm: Buf,
        gate: TensorInfo,
        up: TensorInfo,
        down: TensorInfo,
    ) -> Result<Self, ModelError> {
        let one = |t: TensorInfo| -> Result<Linear, ModelError> {
            Linear::from_gguf(dev, g, vec![t])?
                .ok_or_else(|| ModelError::Unsupported("a weight no device layout holds".into()))
        };
        Ok(
            match Linear::from_gguf(dev, g, vec![gate.clone(), up.clone()])? {
                Some(gu) => Mlp::fused(norm, gu, one(down)?),
                None => Mlp::split(norm, one(gate)?, one(up)?, one(down)?),
            },
        )
    }

    /// Bytes of its matrices.
    pub fn bytes(&self) -> usize {
        let gu = match &self.gate_up {
            GateUp::Fused(f) => f.bytes(),
            GateUp::Split(g, u) => g.bytes() + u.bytes(),
        };
        gu + self.down.bytes()
    }

    /// `x += down(silu(gate(norm(x))) * up(norm(x)))` for the `n` rows of width `d` of `x`.
    pub fn forward(
        &self,
        run: &Run<'_>,
        x: &mut Buf,
        n: usize,
        s: &mut MlpScratch,
        ws: &mut Workspace,
        prof: &mut Option<Profile>,
    ) -> Result<(), ModelError> {
        let (d, f) = (self.norm.len(), self.ffn);
        run.dev.grow(&mut s.xb, n * d)?;
        run.dev.grow(&mut s.h, n * f)?;
        let input = run
            .dev
            .norm_input(&*x, &self.norm, run.eps, n, d, &mut s.xb, ws);
        mark(prof, Stage::Other);
        let h = match &self.gate_up {
            GateUp::Fused(gu) => {
                gu.apply_to(run, &input, &mut s.gu)?;
                mark(prof, Stage::GateUp);
                run.dev.swiglu_input(&s.gu, n, f, &mut s.h, ws)
            }
            GateUp::Split(g, u) => {
                g.apply_to(run, &input, &mut s.gu)?;
                u.apply_to(run, &input, &mut s.up)?;
                mark(prof, Stage::GateUp);
                run.dev
                    .silu_mul(s.gu.at(..n * f), s.up.at(..n * f), s.h.at_mut(..n * f));
                run.dev.input(s.h.at(..n * f), n, f, ws)
            }
        };
        mark(prof, Stage::Activation);
        self.down.apply_add(run, &h, x, &mut s.out)?;
        mark(prof, Stage::Down);
        Ok(())
    }
}

/// The final norm and the LM head.
#[derive(Debug)]
pub struct LmHead {
    norm: Buf,
    output: Linear,
}

/// An [`LmHead`]'s buffers.
#[derive(Debug, Default)]
pub struct HeadScratch {
    xb: Buf,
    /// The logits of the last pass.
    pub logits: Buf,
    /// Their rows' [`BestLogit`](super::BestLogit)s, where the device reduced them
    /// ([`Device::logit_best`]), then, where a sampler asked for them, their top-k candidates
    /// ([`Device::logit_top`]): one read-back for both.
    best: Buf,
    /// Rows of the last pass whose best the device computed into `best` (0: none).
    best_rows: usize,
    /// Whether it computed their candidates too.
    top: bool,
}

impl HeadScratch {
    /// The last pass's `rows` logits rows of `vocab`, with their best (and candidates) where the device
    /// computed them.
    pub fn rows(&mut self, rows: usize, vocab: usize) -> super::LogitRows<'_> {
        let reduced = self.best_rows == rows && rows > 0;
        let top = reduced && self.top;
        let best = reduced.then_some(&mut self.best);
        super::LogitRows::new(&mut self.logits, best, top, rows, vocab)
    }
}

impl LmHead {
    /// The head from the final norm's weights and the output matrix (`vocab x d`).
    pub fn new(norm: Buf, output: Linear) -> Self {
        LmHead { norm, output }
    }

    /// The final norm's weights.
    pub fn norm(&self) -> &Buf {
        &self.norm
    }

    /// The output matrix.
    pub fn output(&self) -> &Linear {
        &self.output
    }

    /// Bytes of its matrix.
    pub fn bytes(&self) -> usize {
        self.output.bytes()
    }

    /// The logits of the rows of `x` that `batch` wants into `s.logits`, in batch order (`vocab` per
    /// row). Returns how many floats that is (none when it wants none).
    pub fn forward(
        &self,
        run: &Run<'_>,
        x: &Buf,
        batch: &Batch,
        s: &mut HeadScratch,
        ws: &mut Workspace,
        prof: &mut Option<Profile>,
    ) -> Result<usize, ModelError> {
        let d = self.norm.len();
        run.dev.grow(&mut s.xb, batch.len() * d)?;
        // The rows that want logits: one run of them (a decode step's, a prefill's last) is normed and
        // prepared as the head's input in one op; several are gathered first.
        let (mut runs, mut first) = (0, 0..0);
        batch.for_each_logit_run(|r| {
            if runs == 0 {
                first = r;
            }
            runs += 1;
        });
        if runs == 0 {
            return Ok(0);
        }
        let m = if runs == 1 {
            let m = first.len();
            let input = run.dev.norm_input(
                x.at(first.start * d..first.end * d),
                &self.norm,
                run.eps,
                m,
                d,
                &mut s.xb,
                ws,
            );
            mark(prof, Stage::Other);
            self.output.apply_to(run, &input, &mut s.logits)?;
            m
        } else {
            let m = run
                .dev
                .norm_logit_rows(x, batch, &self.norm, run.eps, d, &mut s.xb);
            mark(prof, Stage::Other);
            self.output
                .apply(run, s.xb.at(..m * d), m, ws, &mut s.logits)?;
            m
        };
        // A GPU reduces each row to its greedy token and log-normaliser where the rows are, and to its
        // top-k candidates when a sampler reads them.
        let vocab = self.output.rows();
        let (best, top) = (m * Device::BEST_FLOATS, m * Device::TOP_FLOATS);
        let top = if batch.top_candidates { top } else { 0 };
        run.dev.grow(&mut s.best, best + top)?;
        s.best_rows =
            if run
                .dev
                .logit_best(s.logits.at(..m * vocab), m, vocab, s.best.at_mut(..best))
            {
                m
            } else {
                0
            };
        s.top = top > 0
            && run.dev.logit_top(
                s.logits.at(..m * vocab),
                m,
                vocab,
                s.best.at_mut(best..best + top),
            );
        mark(prof, Stage::Output);
        Ok(m * vocab)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::testutil::{data, quantize_rows};

    #[test]
    fn a_fused_mlp_computes_the_same_bits_as_a_split_one() {
        let dev = Device::cpu(2);
        let (d, f, n) = (64, 96, 3);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F32] {
            let (g, u, w) = (
                quantize_rows(ty, f, d, 1),
                quantize_rows(ty, f, d, 2),
                quantize_rows(ty, d, f, 3),
            );
            let m = |b: &[u8], rows, cols| dev.matrix(ty, rows, cols, b).unwrap();
            let norm = data(d, 4);
            let fused = Mlp::fused(
                Buf::from(norm.clone()),
                Linear::new(dev.concat(vec![m(&g, f, d), m(&u, f, d)]).unwrap()),
                Linear::new(m(&w, d, f)),
            );
            let split = Mlp::split(
                Buf::from(norm),
                Linear::new(m(&g, f, d)),
                Linear::new(m(&u, f, d)),
                Linear::new(m(&w, d, f)),
            );
            let run = Run {
                dev: &dev,
                reference: None,
                eps: 1e-5,
            };
            let x = data(n * d, 5);
            let mut ws = Workspace::default();
            let mut out = |mlp: &Mlp| {
                let mut x = Buf::from(x.clone());
                let mut s = MlpScratch::default();
                mlp.forward(&run, &mut x, n, &mut s, &mut ws, &mut None)
                    .unwrap();
                x.read_back(n * d).to_vec()
            };
            let (a, b) = (out(&fused), out(&split));
            assert_ne!(a, x, "{ty}: the block adds its output");
            assert_eq!(a, b, "{ty}: fused and split differ");
        }
    }

    /// On the GPU device an MLP block only queues its kernels (quantize, gate/up, SwiGLU, down, add): once
    /// its buffers have grown, nothing waits and nothing comes back until the host reads the result, which
    /// is one copy. The result is the CPU's within a few 8-bit activation steps (the kernels sum in another
    /// order, which can move an activation across a rounding boundary).
    #[test]
    fn an_mlp_on_the_gpu_device_waits_only_when_the_host_reads() {
        use std::sync::Arc;
        let rt = crate::backend::sim::Counting::new();
        let gpu = Device::gpu(Arc::clone(&rt) as _);
        let cpu = Device::cpu(1);
        let (d, f, n) = (64, 96, 3);
        let ty = GgmlType::Q8_0;
        let (g, u, w) = (
            quantize_rows(ty, f, d, 1),
            quantize_rows(ty, f, d, 2),
            quantize_rows(ty, d, f, 3),
        );
        let block = |dev: &Device| {
            let m = |b: &[u8], rows, cols| dev.matrix(ty, rows, cols, b).unwrap();
            Mlp::fused(
                dev.buf(data(d, 4)).unwrap(),
                Linear::new(dev.concat(vec![m(&g, f, d), m(&u, f, d)]).unwrap()),
                Linear::new(m(&w, d, f)),
            )
        };
        let x0 = data(n * d, 5);
        gpu.set_graphs(false);
        let out = |dev: &Device, counted: bool| {
            let mlp = block(dev);
            let run = Run {
                dev,
                reference: None,
                eps: 1e-5,
            };
            let (mut ws, mut s) = (Workspace::default(), MlpScratch::default());
            let mut x = dev.buf(x0.clone()).unwrap();
            // The first pass grows the buffers; the second runs warm.
            mlp.forward(&run, &mut x, n, &mut s, &mut ws, &mut None)
                .unwrap();
            rt.take();
            mlp.forward(&run, &mut x, n, &mut s, &mut ws, &mut None)
                .unwrap();
            if counted {
                let c = rt.take();
                // gate|up (the norm and the quantization in its prologue), down (SwiGLU and the
                // quantization in its prologue, the residual added as it writes).
                assert_eq!(c.launches, 2, "{c:?}");
                assert_eq!((c.waits, c.downloads, c.uploads), (0, 0, 0), "{c:?}");
            }
            let v = x.read_back(n * d).to_vec();
            if counted {
                assert_eq!(rt.take().downloads, 1);
            }
            v
        };
        let (want, got) = (out(&cpu, false), out(&gpu, true));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = want
            .iter()
            .zip(&got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 0.05 * scale, "max diff {diff} of {scale}");
        assert_ne!(want, x0);
    }

    /// With graphs on, a GPU pass's launches are recorded and run when the host reads: the first warm
    /// pass launches them one by one, the second (the same launches) captures a graph, the third replays
    /// it; every pass computes the same bits as with graphs off.
    #[test]
    fn repeated_passes_replay_one_graph_with_the_same_results() {
        use std::sync::Arc;
        let rt = crate::backend::sim::Counting::new();
        let (d, f, n) = (64, 96, 2);
        let ty = GgmlType::Q4_0;
        let (g, u, w) = (
            quantize_rows(ty, f, d, 6),
            quantize_rows(ty, f, d, 7),
            quantize_rows(ty, d, f, 8),
        );
        let passes = |dev: &Device| {
            let m = |b: &[u8], rows, cols| dev.matrix(ty, rows, cols, b).unwrap();
            let mlp = Mlp::fused(
                dev.buf(data(d, 9)).unwrap(),
                Linear::new(dev.concat(vec![m(&g, f, d), m(&u, f, d)]).unwrap()),
                Linear::new(m(&w, d, f)),
            );
            let run = Run {
                dev,
                reference: None,
                eps: 1e-5,
            };
            let (mut ws, mut s) = (Workspace::default(), MlpScratch::default());
            let mut x = dev.buf(data(n * d, 10)).unwrap();
            (0..5)
                .map(|_| {
                    mlp.forward(&run, &mut x, n, &mut s, &mut ws, &mut None)
                        .unwrap();
                    x.read_back(n * d).to_vec()
                })
                .collect::<Vec<_>>()
        };
        let off = Device::gpu(Arc::clone(&rt) as _);
        off.set_graphs(false);
        let want = passes(&off);
        let on = Device::gpu(Arc::clone(&rt) as _);
        rt.take();
        let got = passes(&on);
        assert_eq!(got, want, "graphs change the results");
        let c = rt.take();
        let st = on.graph_stats().unwrap();
        // Pass 1 launches one by one, 2 captures, 3 to 5 replay.
        assert_eq!((st.captures, st.replays), (1, 3), "{st:?}");
        assert_eq!((c.captures, c.graphs), (1, 4), "{c:?}");
        // Two fused kernels a pass (see the test above), four passes in graphs.
        assert_eq!(st.graph_kernels, 4 * 2, "{st:?}");

        // A runtime whose captures fail: the segment runs kernel by kernel and graphs stay off.
        let refusing = crate::backend::sim::Counting::new();
        refusing.refuse_graphs();
        let dev = Device::gpu(Arc::clone(&refusing) as _);
        assert_eq!(passes(&dev), want, "a failed capture changes the results");
        let st = dev.graph_stats().unwrap();
        assert_eq!(
            (st.captures, st.replays, st.graph_kernels),
            (0, 0, 0),
            "{st:?}"
        );
        assert!(st.kernels > 0, "{st:?}");
    }
}
