//! The Llama architecture (GGUF arch `llama`), as llama.cpp runs it.
//!
//! Per block: `h += Wo·attn(rope(Wq·n), rope(Wk·n), Wv·n)` with `n = rmsnorm(h)`, then
//! `h += Wdown·(silu(Wgate·n) * Wup·n)` with `n = rmsnorm(h)`; at the end `logits = Wout·rmsnorm(h)`, where
//! `Wout` falls back to the token embedding when the file has no `output.weight` (tied, as in SmolLM2).
//! RoPE is llama.cpp's "normal" type (adjacent pairs), applied to the GGUF weights as stored; attention uses
//! GQA (query head `h` reads KV head `h / (n_heads / n_kv_heads)`) and scale `1/sqrt(head_dim)`.
//!
//! Two precisions share the code: [`Precision::Quantized`] (the fast path: activations quantized to 8 bits
//! per block of 32 and integer dot products, as llama.cpp's CPU backend does) and [`Precision::Reference`]
//! (f32 activations against the dequantized weights with f64 accumulation; slow, used to check the math
//! against the float reference to ~1e-4).
//!
//! Q/K/V and gate/up are fused into one matrix each at load, so a layer is five parallel matmul dispatches.
//! The MLP and the final norm + LM head are the shared blocks of [`super::layers`].

use super::ModelError;
use super::layers::{HeadScratch, Linear, LmHead, Mlp, MlpScratch, Run, mark};
pub use super::layers::{Profile, Stage};
use crate::backend::gpu::{PlanId, StepKey};
use crate::backend::{Buf, Device, MAX_GROUP, MAX_HEAD_DIM, Rope, Workspace, rope_angles};
use crate::gguf::{Gguf, TensorInfo};
pub use crate::kv::Logits;
use crate::kv::{Batch, KvShape, PagePool};
use crate::quant::{GgmlType, dequantize_ref};
use std::sync::Arc;

/// Hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Blocks.
    pub n_layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// MLP hidden width.
    pub ffn: usize,
    /// Vocabulary size (rows of the output matrix).
    pub vocab: usize,
    /// RoPE base.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Context length the model was trained for.
    pub ctx_train: usize,
}

impl LlamaConfig {
    /// Reads the `llama.*` keys.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let arch = g.architecture()?;
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "architecture {arch:?} (this loader runs \"llama\")"
            )));
        }
        let u = |k: &str| g.arch_u32(k).map(|v| v as usize);
        let d_model = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = u("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = d_model.checked_div(n_heads).unwrap_or(0);
        let rot = u("rope.dimension_count").unwrap_or(head_dim);
        if n_heads == 0
            || n_kv_heads == 0
            || n_heads % n_kv_heads != 0
            || head_dim * n_heads != d_model
            || rot != head_dim
            || n_heads / n_kv_heads > MAX_GROUP
            || head_dim > MAX_HEAD_DIM
        {
            return Err(ModelError::Unsupported(format!(
                "head layout: {n_heads} heads, {n_kv_heads} KV heads, width {d_model}, rope dims {rot}"
            )));
        }
        let vocab = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        Ok(LlamaConfig {
            n_layers: u("block_count")?,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn: u("feed_forward_length")?,
            vocab,
            rope_base: g.arch_f32("rope.freq_base").unwrap_or(10000.0),
            eps: g.arch_f32("attention.layer_norm_rms_epsilon")?,
            ctx_train: u("context_length").unwrap_or(2048),
        })
    }

    /// Width of the K (and V) projection.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Which arithmetic the forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// 8-bit activations and integer dot products (fast).
    Quantized,
    /// f32 activations, dequantized weights, f64 accumulation (slow; a check of the math).
    Reference,
}

#[derive(Debug)]
struct Layer {
    attn_norm: Buf,
    qkv: Linear,
    wo: Linear,
    mlp: Mlp,
}

/// A loaded Llama model. Weights are repacked into memory; the GGUF stays mapped for the embedding rows and
/// the reference path.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    gguf: Arc<Gguf>,
    embd: TensorInfo,
    layers: Vec<Layer>,
    head: LmHead,
    precision: Precision,
    /// Names it in step-plan keys.
    plan: PlanId,
}

/// Per-forward buffers, reused across calls (nothing is allocated per token once they have grown).
#[derive(Debug, Default)]
pub struct Scratch {
    x: Buf,
    xb: Buf,
    qkv: Buf,
    att: Buf,
    proj: Buf,
    mlp: MlpScratch,
    head: HeadScratch,
    ws: Workspace,
    /// RoPE `(cos, sin)` for positions `0..rope.len() / (head_dim / 2)`, grown on demand.
    rope: Vec<(f32, f32)>,
    /// The pass's step-plan key (see [`Device::begin_step`]), and what names these buffers in it.
    key: StepKey,
    plan: PlanId,
    /// Time per stage, when enabled.
    pub profile: Option<Profile>,
}

impl Llama {
    /// Loads a Llama model from a parsed GGUF, its weights in `dev`'s layout.
    pub fn load(gguf: Arc<Gguf>, dev: &Device) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf(&gguf)?;
        let g = &*gguf;
        let tensor = |name: &str, want: &[usize]| -> Result<TensorInfo, ModelError> {
            let t = g.tensor(name)?.clone();
            let want: Vec<u64> = want.iter().map(|&v| v as u64).collect();
            if t.dims != want {
                return Err(ModelError::Shape {
                    name: name.into(),
                    got: t.dims,
                    want,
                });
            }
            Ok(t)
        };
        let vector = |name: &str, n: usize| -> Result<Buf, ModelError> {
            let t = tensor(name, &[n])?;
            let mut v = vec![0f32; n];
            dequantize_ref(t.ty, g.tensor_data(&t), &mut v)?;
            Ok(dev.buf(v)?)
        };
        let weight = |parts: Vec<TensorInfo>| -> Result<Linear, ModelError> {
            Linear::from_gguf(dev, &gguf, parts)?
                .ok_or_else(|| ModelError::Unsupported("fused weights of mixed types".into()))
        };
        let (d, kvd, ffn) = (cfg.d_model, cfg.kv_dim(), cfg.ffn);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(&n("attn_norm"), d)?,
                qkv: weight(vec![
                    tensor(&n("attn_q"), &[d, d])?,
                    tensor(&n("attn_k"), &[d, kvd])?,
                    tensor(&n("attn_v"), &[d, kvd])?,
                ])?,
                wo: weight(vec![tensor(&n("attn_output"), &[d, d])?])?,
                mlp: Mlp::from_gguf(
                    dev,
                    &gguf,
                    vector(&n("ffn_norm"), d)?,
                    tensor(&n("ffn_gate"), &[d, ffn])?,
                    tensor(&n("ffn_up"), &[d, ffn])?,
                    tensor(&n("ffn_down"), &[ffn, d])?,
                )?,
            });
        }
        let embd = tensor("token_embd.weight", &[d, cfg.vocab])?;
        if !embd.ty.has_reference_kernel() {
            return Err(ModelError::Unsupported(format!(
                "token embedding of type {}",
                embd.ty
            )));
        }
        let output = match g.tensor("output.weight") {
            Ok(_) => tensor("output.weight", &[d, cfg.vocab])?,
            Err(_) => embd.clone(),
        };
        Ok(Llama {
            head: LmHead::new(vector("output_norm.weight", d)?, weight(vec![output])?),
            embd,
            layers,
            cfg,
            gguf,
            precision: Precision::Quantized,
            plan: PlanId::default(),
        })
    }

    /// Hyperparameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Switches the arithmetic (see [`Precision`]).
    pub fn set_precision(&mut self, p: Precision) {
        self.precision = p;
    }

    /// Current arithmetic.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The shape of this model's KV cache.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            recurrent: 0,
        }
    }

    /// Bytes of weights a decode step reads (repacked matrices + norms).
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.wo.bytes() + l.mlp.bytes())
            .sum();
        l + self.head.bytes() + 4 * self.cfg.d_model * (2 * self.cfg.n_layers + 1)
    }

    /// Runs the tokens of `batch` (several sequences, each at its own positions and pages) and writes their
    /// KV into `pool`. Returns the requested logits (`vocab` floats per row, sequences in batch order, see
    /// [`Batch::logit_rows`]), valid until the next call with the same scratch.
    pub fn forward<'s>(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        s: &'s mut Scratch,
    ) -> Result<&'s mut [f32], ModelError> {
        let c = &self.cfg;
        let n = batch.len();
        if n == 0 {
            return Ok(&mut []);
        }
        if pool.shape() != self.kv_shape() {
            return Err(ModelError::Unsupported(
                "the KV pool was made for another model".into(),
            ));
        }
        let tokens = &batch.tokens[..];
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(ModelError::Unsupported(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab
            )));
        }
        let longest = batch
            .seqs
            .iter()
            .map(|sp| sp.start + sp.len)
            .max()
            .unwrap_or(0);
        let (d, kvd, hd) = (c.d_model, c.kv_dim(), c.head_dim);
        let qkv_w = d + 2 * kvd;
        dev.grow(&mut s.x, n * d)?;
        dev.grow(&mut s.xb, n * d)?;
        dev.grow(&mut s.qkv, n * qkv_w)?;
        dev.grow(&mut s.att, n * d)?;
        dev.grow(&mut s.proj, n * d)?;

        while s.rope.len() < longest * (hd / 2) {
            let pos = s.rope.len() / (hd / 2);
            rope_angles(hd, pos, c.rope_base, &mut s.rope);
        }
        if let Some(p) = s.profile.as_mut() {
            p.start();
        }

        // Embeddings: exact dequantization of the stored rows.
        dev.embed(
            self.embd.ty,
            self.gguf.tensor_data(&self.embd),
            d,
            tokens,
            s.x.at_mut(..n * d),
        )?;

        // The pass's plan key: this model, this scratch (its buffers), the rows that want logits. The
        // reference path reads host weights: it is not planned. (A GPU's profile times only the host's
        // queueing, so a replayed pass has no stages to time.)
        s.key.clear();
        let mut rows = 0;
        if self.precision == Precision::Quantized {
            for v in [self.plan.get(), s.plan.get(), self.layers.len() as u64] {
                s.key.push(v);
            }
            batch.for_each_logit_run(|r| {
                rows += r.len();
                s.key.push(r.start as u64);
                s.key.push(r.end as u64);
            });
        }
        if dev.begin_step(&mut s.key, pool, batch, Some((&s.rope, hd / 2)))? {
            return Ok(s.head.logits.read_back(rows * c.vocab));
        }

        let run = Run {
            dev,
            reference: (self.precision == Precision::Reference).then_some(&*self.gguf),
            eps: c.eps,
        };
        // The reference path reads each input's floats, so nothing is left to a product's prologue.
        s.ws.eager(run.reference.is_some());
        for (li, l) in self.layers.iter().enumerate() {
            let input = dev.norm_input(&s.x, &l.attn_norm, c.eps, n, d, &mut s.xb, &mut s.ws);
            mark(&mut s.profile, Stage::Other);
            l.qkv.apply_to(&run, &input, &mut s.qkv)?;
            mark(&mut s.profile, Stage::Qkv);
            // Q and K heads are adjacent in the fused row: one rotation covers both, and the K and V
            // parts go to the pages in the same op. Attention reads Q from the fused rows in place.
            dev.rope_write_kv(
                Rope::Normal,
                pool,
                batch,
                li,
                s.qkv.at_mut(..n * qkv_w),
                qkv_w,
                c.n_heads,
                &s.rope,
                hd / 2,
            );
            mark(&mut s.profile, Stage::Other);
            dev.attention(
                pool,
                li,
                batch,
                s.qkv.at(..n * qkv_w),
                qkv_w,
                c.n_heads,
                c.n_kv_heads,
                hd,
                s.att.at_mut(..n * d),
                &mut s.ws,
            );
            mark(&mut s.profile, Stage::Attention);
            let input = dev.input(s.att.at(..n * d), n, d, &mut s.ws);
            l.wo.apply_add(&run, &input, &mut s.x, &mut s.proj)?;
            mark(&mut s.profile, Stage::AttnOut);
            l.mlp
                .forward(&run, &mut s.x, n, &mut s.mlp, &mut s.ws, &mut s.profile)?;
        }

        // The rows whose logits were asked for, in batch order.
        let len = self
            .head
            .forward(&run, &s.x, batch, &mut s.head, &mut s.ws, &mut s.profile)?;
        dev.end_step();
        Ok(s.head.logits.read_back(len))
    }
}

/// The GGUF type a model's layer weights mostly use (for reports).
pub fn dominant_type(g: &Gguf) -> Option<GgmlType> {
    let mut counts: Vec<(GgmlType, usize)> = Vec::new();
    for t in g.tensors().iter().filter(|t| t.dims.len() == 2) {
        match counts.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some(c) => c.1 += 1,
            None => counts.push((t.ty, 1)),
        }
    }
    counts.into_iter().max_by_key(|&(_, c)| c).map(|(t, _)| t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvCache, KvConfig, KvDtype, Logits};

    /// The default model where `thorn model pull` puts it, if it is there.
    fn default_model() -> Option<std::path::PathBuf> {
        let p = crate::cache_dir()?.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        p.exists().then_some(p)
    }

    /// Logits of a prefill and two decode steps of `tokens` on `dev`, through the first `layers` layers.
    fn run(dev: &Device, g: &Arc<Gguf>, tokens: &[u32], layers: usize) -> Vec<Vec<f32>> {
        let mut model = Llama::load(Arc::clone(g), dev).unwrap();
        model.layers.truncate(layers);
        let dtype = KvDtype::F16;
        let mut kv = KvCache::on(
            dev,
            model.kv_shape(),
            KvConfig {
                dtype,
                page_size: 16,
                memory: 1 << 24,
                cache_output: false,
                ..KvConfig::default()
            },
        )
        .unwrap();
        let (mut s, mut batch, mut seq) = (Scratch::default(), Batch::default(), kv.acquire(&[]));
        let mut out = Vec::new();
        for chunk in [
            &tokens[..tokens.len() - 2],
            &tokens[tokens.len() - 2..][..1],
            &tokens[tokens.len() - 1..],
        ] {
            let want = seq.len() + chunk.len();
            kv.reserve(&mut seq, want).unwrap();
            batch.clear();
            batch.push(&seq, chunk, Logits::Last);
            out.push(
                model
                    .forward(dev, kv.pool_mut(), &batch, &mut s)
                    .unwrap()
                    .to_vec(),
            );
            seq.advance(chunk.len());
        }
        kv.release(seq, None);
        out
    }

    /// The most kernel launches one SmolLM2 decode step may take on the GPU device. It only goes down: each
    /// fusion that lands lowers it to what the step then takes. Today 6 a layer (QKV with the norm in its
    /// prologue, RoPE and KV write, attention with its merge, the output projection with the residual
    /// add, gate|up with the norm, down with SwiGLU and the add) and the LM head with its norm.
    const DECODE_LAUNCH_BUDGET: usize = 181;

    /// One forward pass of `tokens` for `seq`, its KV reserved first.
    fn step(
        model: &Llama,
        dev: &Device,
        kv: &mut KvCache,
        seq: &mut crate::kv::SeqKv,
        s: &mut Scratch,
        tokens: &[u32],
    ) {
        let want = seq.len() + tokens.len();
        kv.reserve(seq, want).unwrap();
        let mut batch = Batch::default();
        batch.push(seq, tokens, Logits::Last);
        model.forward(dev, kv.pool_mut(), &batch, s).unwrap();
        seq.advance(tokens.len());
    }

    /// What one SmolLM2 decode step asks of the GPU device, counted on the null runtime (a model of
    /// SmolLM2's shape whose kernels are counted, never run): the launches, against
    /// [`DECODE_LAUNCH_BUDGET`], and per kernel; the copies and waits; and the host's time per step with
    /// graphs off and on (printed, not asserted: the device's own work per step, without a GPU).
    ///
    /// `cargo test -p thorn-engine --lib decode_launch_budget -- --nocapture` prints
    /// `launches per decode step: N`.
    #[test]
    fn decode_launch_budget() {
        use crate::backend::sim::Counting;
        use crate::testutil::{SMOLLM2_135M, skeleton_llama};
        let g = Arc::new(skeleton_llama(SMOLLM2_135M, crate::quant::GgmlType::Q4_1));
        let rt = Counting::null();
        let dev = Device::gpu(Arc::clone(&rt) as _);
        dev.set_graphs(false);
        let model = Llama::load(Arc::clone(&g), &dev).unwrap();
        let mut kv = KvCache::on(
            &dev,
            model.kv_shape(),
            KvConfig {
                dtype: KvDtype::F16,
                page_size: 16,
                memory: 1 << 26,
                cache_output: false,
                ..KvConfig::default()
            },
        )
        .unwrap();
        let (mut s, mut seq) = (Scratch::default(), kv.acquire(&[]));
        // A prefill and two decode steps grow every buffer; the fourth pass is counted.
        step(
            &model,
            &dev,
            &mut kv,
            &mut seq,
            &mut s,
            &[1, 2, 3, 4, 5, 6, 7, 8],
        );
        for t in [9, 10] {
            step(&model, &dev, &mut kv, &mut seq, &mut s, &[t]);
        }
        rt.take();
        rt.take_kernels();
        step(&model, &dev, &mut kv, &mut seq, &mut s, &[11]);
        let c = rt.take();
        println!("launches per decode step: {}", c.launches);
        for (kernel, n) in rt.take_kernels() {
            println!("  {kernel}: {n}");
        }
        println!(
            "uploads {} ({} bytes), downloads {}, waits {}",
            c.uploads, c.upload_bytes, c.downloads, c.waits
        );
        // The host's time per decode step: the device's own work, kernels not run.
        let mut time = |label: &str| {
            let mut us: Vec<f64> = (0..64)
                .map(|i| {
                    let t0 = std::time::Instant::now();
                    step(&model, &dev, &mut kv, &mut seq, &mut s, &[12 + i]);
                    t0.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            us.sort_by(f64::total_cmp);
            println!(
                "host time per decode step, {label}: median {:.1} us",
                us[32]
            );
        };
        time("graphs off");
        dev.set_graphs(true);
        // Timed as served: a step seen before is replayed from its plan, not recorded to be checked.
        dev.verify_steps(false);
        time("graphs on");
        let st = dev.graph_stats().unwrap();
        println!(
            "steps replayed from a plan: {} of {} graph replays",
            st.steps, st.replays
        );
        kv.release(seq, None);
        assert!(
            c.launches <= DECODE_LAUNCH_BUDGET,
            "{} launches per decode step, over the budget of {DECODE_LAUNCH_BUDGET}",
            c.launches
        );
    }

    /// Decode steps replayed whole from their step plans (none of the model's ops run on the host) give
    /// the bits of the same steps run op by op, through what a plan must notice between two steps: a new
    /// page every 16 positions, the attention's splits doubling at 64, a second sequence joining the batch
    /// (another shape) and leaving, the staging growing for it; and most steps are replayed.
    #[test]
    fn decode_steps_replayed_from_their_plans_match_steps_run_op_by_op() {
        use crate::testutil::{LlamaShape, random_llama};
        let shape = LlamaShape {
            layers: 2,
            d_model: 128,
            heads: 4,
            kv_heads: 2,
            ffn: 256,
            vocab: 512,
        };
        let g = Arc::new(random_llama(shape, crate::quant::GgmlType::Q4_1, 3));
        let passes = |dev: &Device| {
            let model = Llama::load(Arc::clone(&g), dev).unwrap();
            let mut kv = KvCache::on(
                dev,
                model.kv_shape(),
                KvConfig {
                    dtype: KvDtype::F16,
                    page_size: 16,
                    memory: 1 << 22,
                    cache_output: false,
                    ..KvConfig::default()
                },
            )
            .unwrap();
            let mut s = Scratch::default();
            let (mut a, mut b) = (kv.acquire(&[]), kv.acquire(&[]));
            let mut out = Vec::new();
            let mut pass = |kv: &mut KvCache, seqs: &mut [(&mut crate::kv::SeqKv, u32)]| {
                let mut batch = Batch::default();
                for (seq, t) in seqs.iter_mut() {
                    let want = seq.len() + 1;
                    kv.reserve(seq, want).unwrap();
                    batch.push(seq, &[*t], Logits::Last);
                }
                out.push(
                    model
                        .forward(dev, kv.pool_mut(), &batch, &mut s)
                        .unwrap()
                        .to_vec(),
                );
                seqs.iter_mut().for_each(|(seq, _)| seq.advance(1));
            };
            for i in 0..72 {
                pass(&mut kv, &mut [(&mut a, 1 + i % 500)]);
            }
            for i in 0..6 {
                pass(&mut kv, &mut [(&mut a, 7 + i), (&mut b, 300 + i)]);
            }
            for i in 0..6 {
                pass(&mut kv, &mut [(&mut a, 40 + i)]);
            }
            kv.release(a, None);
            kv.release(b, None);
            out
        };
        let off = Device::gpu(Arc::new(crate::backend::sim::Sim));
        off.set_graphs(false);
        let want = passes(&off);
        let on = Device::gpu(Arc::new(crate::backend::sim::Sim));
        on.verify_steps(false);
        let got = passes(&on);
        assert_ne!(want[0], want[1], "the model's logits depend on the token");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "pass {i}: a replayed step's logits differ");
        }
        // Checked: every pass that could be replayed is recorded and its launches compared with the plan's.
        let checked = Device::gpu(Arc::new(crate::backend::sim::Sim));
        assert!(passes(&checked) == want, "checked passes differ");
        assert_eq!(checked.graph_stats().unwrap().steps, 0);
        let st = on.graph_stats().unwrap();
        // Per shape (one sequence below 64 positions, above, two sequences, one again after the staging
        // grew) at most three passes are recorded: one that grows staging (its wait splits it), then two
        // (the second captured). The rest are replayed.
        assert!(st.steps >= 84 - 3 * 4, "{st:?}");
    }

    /// SmolLM2 (the default model, Q4_1) through the GPU device, its kernels run by the simulator, against
    /// the CPU device, for a 4-token prefill and two decode steps over f16 pages.
    ///
    /// The two differ only in the order of float sums (the RMS norms give the same bits, so the 8-bit
    /// activations start out the same), but a sum that lands on the other side of a rounding boundary flips
    /// an 8-bit activation, and SmolLM2's outlier features amplify each flip (as between any two kernels of
    /// this quantized math). Which sums flip depends on the CPU's kernels too (AVX-512 and AVX2 sum in
    /// other orders): through two layers a flip or two was measured, 5e-4 of the largest logit on an
    /// AVX-512 Xeon, 2.4e-3 on an AVX2 EPYC. So the two-layer logits must agree to 1e-2 of the largest (a
    /// wrong kernel is off by the logits' own size), and through all 30 the greedy tokens agree and the
    /// log-probabilities of the CPU's top 20 stay within 0.4 (the bound the end-to-end tests hold an
    /// 8-bit-activation engine to against the f64 reference and llama.cpp).
    #[test]
    fn the_default_model_on_the_gpu_device_matches_the_cpu() {
        let Some(path) = default_model() else {
            println!("skipped: the default model is not pulled (`thorn model pull`)");
            return;
        };
        let g = Arc::new(Gguf::open(&path).unwrap());
        let tokens = [1u32, 504, 3458, 282, 4237, 314];
        let cpu2 = run(&Device::cpu(2), &g, &tokens, 2);
        let cpu30 = run(&Device::cpu(2), &g, &tokens, 30);
        for dev in crate::backend::sim::gpu_devices() {
            check_against_cpu(&dev, &g, &tokens, &cpu2, &cpu30);
        }
    }

    /// On a GPU that reads host memory in place (unified memory, as on Jetson Thor; here the counting
    /// simulator standing for one), SmolLM2's matrices stay in the file's mapping: loading uploads only
    /// the norm weights, the fused QKV and gate/up matrices keep their parts where the file has them, and
    /// the logits are the bits of the device that uploads its weights (the kernels read the same bytes).
    #[test]
    fn a_unified_memory_gpu_reads_the_weights_in_place() {
        let Some(path) = default_model() else {
            println!("skipped: the default model is not pulled (`thorn model pull`)");
            return;
        };
        let g = Arc::new(Gguf::open(&path).unwrap());
        let rt = crate::backend::sim::Counting::unified();
        let dev = Device::gpu(Arc::clone(&rt) as _);
        let model = Llama::load(Arc::clone(&g), &dev).unwrap();
        let loaded = rt.take();
        let l = &model.layers[0];
        assert!(l.qkv.matrix().in_place() && l.wo.matrix().in_place());
        assert!(model.head.output().matrix().in_place());
        let weights = model.weight_bytes();
        println!(
            "in place: {weights} bytes of weights, {} bytes uploaded while loading",
            loaded.upload_bytes
        );
        assert!(loaded.upload_bytes * 100 < weights, "{loaded:?}");
        drop(model);
        let tokens = [1u32, 504, 3458, 282, 4237, 314];
        let uploaded = Device::gpu(Arc::new(crate::backend::sim::Sim));
        assert_eq!(run(&dev, &g, &tokens, 2), run(&uploaded, &g, &tokens, 2));
    }

    fn check_against_cpu(
        dev: &Device,
        g: &Arc<Gguf>,
        tokens: &[u32],
        cpu2: &[Vec<f32>],
        cpu30: &[Vec<f32>],
    ) {
        let name = dev.name();
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                .0
        };
        let log_softmax = |v: &[f32]| {
            let m = v.iter().fold(f32::MIN, |a, &x| a.max(x));
            let lse = m + v.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
            v.iter().map(|&x| x - lse).collect::<Vec<f32>>()
        };
        for (step, (c, q)) in cpu2.iter().zip(&run(dev, g, tokens, 2)).enumerate() {
            let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = c.iter().zip(q).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            println!(
                "{name}, 2 layers, step {step}: max |logit difference| {diff:e} (largest {scale})"
            );
            assert!(
                diff <= 1e-2 * scale,
                "{name}, 2 layers, step {step}: {diff} of {scale}"
            );
        }
        for (step, (c, q)) in cpu30.iter().zip(&run(dev, g, tokens, 30)).enumerate() {
            assert_eq!(argmax(c), argmax(q), "{name}, step {step}: greedy token");
            let (lc, lq) = (log_softmax(c), log_softmax(q));
            let mut top: Vec<usize> = (0..c.len()).collect();
            top.sort_by(|&a, &b| c[b].total_cmp(&c[a]));
            let d = top[..20]
                .iter()
                .map(|&i| (lc[i] - lq[i]).abs())
                .fold(0f32, f32::max);
            println!("{name}, 30 layers, step {step}: top-20 |Δlogprob| {d:.3}");
            assert!(
                d < 0.4,
                "{name}, 30 layers, step {step}: top-20 logprob difference {d}"
            );
        }
    }
}
