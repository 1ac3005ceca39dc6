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

use super::LogitRows;
use super::ModelError;
use super::layers::{HeadScratch, Linear, LmHead, Mlp, MlpScratch, Run, mark};
pub use super::layers::{Profile, Stage};
use crate::backend::gpu::{PlanId, StepKey};
use crate::backend::{
    Buf, Device, Embedding, MAX_GROUP, MAX_HEAD_DIM, Rope, Workspace, rope_angles,
};
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
        Ok(self.pass(dev, pool, batch, s)?.into_all())
    }

    /// [`Llama::forward`], its logits rows read back as far as the caller reads them (on a GPU, each
    /// row's greedy token and log-normaliser are reduced where the rows are: see [`LogitRows`]).
    pub fn pass<'s>(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        s: &'s mut Scratch,
    ) -> Result<LogitRows<'s>, ModelError> {
        let c = &self.cfg;
        let n = batch.len();
        if n == 0 {
            return Ok(s.head.rows(0, c.vocab));
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
        // Embeddings: exact dequantization of the stored rows, staged with the pass's other inputs.
        let embed = Embedding {
            ty: self.embd.ty,
            table: self.gguf.tensor_data(&self.embd),
            d,
            tokens,
            out: s.x.at_mut(..n * d),
        };
        if dev.begin_step(
            &mut s.key,
            pool,
            batch,
            Some((&s.rope, hd / 2)),
            Some(embed),
        )? {
            return Ok(s.head.rows(rows, c.vocab));
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
        Ok(s.head.rows(len / c.vocab, c.vocab))
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
mod tests;
