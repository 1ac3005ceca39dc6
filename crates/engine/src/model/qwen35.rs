//! Qwen3.5/3.6 hybrid models (GGUF arch `qwen35`, HF `qwen3_5_text`): Gated DeltaNet layers with one gated
//! full-attention layer every `full_attention_interval` (3 of 4 layers are recurrent), SwiGLU MLPs.
//!
//! * [`Qwen35`]: the engine's forward pass over a [`Batch`] of sequences, written against the device API
//!   ([`Device`]): batched matrix products, the attention layers' KV in the shared page pool (prefix cache
//!   included), the Gated DeltaNet ops ([`crate::backend::gdn`]: convolution window, gates, the delta rule
//!   token by token and in chunked form), and each sequence's DeltaNet state in its [`Recurrent`]
//!   (snapshotted by the prefix cache, see [`crate::kv::state`]).
//! * [`Qwen35Config`] (`config`): the hyperparameters, from GGUF keys or `config.json`, and the shapes they
//!   give; `mtp`: the MTP head of Qwen3.6 checkpoints (its drafts, [`Qwen35::mtp_draft`]).
//! * [`mod@reference`]: the scalar, one-token-at-a-time oracle.
//! * [`source`]: GGUF and Hugging Face (safetensors, incl. NVFP4) weights, both seen in GGUF conventions.
//!
//! Conventions are llama.cpp's GGUF ones (as its `convert_hf_to_gguf.py` writes them for `qwen35`):
//!
//! * the `(1 + w)` RMSNorm weights (`attn_norm`, `post_attention_norm`, `output_norm`, `attn_q_norm`,
//!   `attn_k_norm`) hold the 1 already, so every norm is `x / rms(x) * w`; the DeltaNet output norm
//!   (`ssm_norm`) is `x / rms(x) * w * silu(z)`;
//! * `ssm_a` is `-exp(A_log)` and `ssm_dt.bias` is `dt_bias`;
//! * value heads are tiled: value head `n` reads key head `n % key_heads`.
//!
//! Per DeltaNet layer and token: `qkv = W x`, a causal depthwise convolution over the last `conv_kernel`
//! inputs (its window is state), SiLU, L2-normalised q and k (q scaled by `1/sqrt(dk)`), `β = σ(W_β x)`,
//! `g = a · softplus(W_α x + dt_bias)`, then per value head `S ← S·e^g; δ = (v − Sᵀk)·β; S ← S + k δᵀ;
//! o = Sᵀq`, the gated norm with `z = W_gate x`, and `ssm_out`. The attention layer splits each query head
//! into `[query | gate]`, normalises q and k per head, rotates the first `rope.dimension_count` dims
//! (NeoX halves), attends causally with grouped KV heads, and multiplies by `σ(gate)` before `attn_output`.
//!
//! Not yet here: M-RoPE for images (text uses one position for every section, which is plain RoPE).

mod config;
mod mtp;
pub mod reference;
pub mod source;
#[cfg(test)]
mod tests;

use super::layers::{HeadScratch, Linear, LmHead, Mlp, MlpScratch, Run};
use super::{LogitRows, ModelError};
use crate::backend::{Buf, Device, GdnRun, GdnSteps, Matrix, Rope, ViewMut, Workspace};
use crate::gguf::Gguf;
use crate::kv::{Batch, Logits, PagePool, Recurrent};
use crate::quant::GgmlType;
pub use config::Qwen35Config;
use config::unsupported;
use mtp::Mtp;
pub use reference::{Qwen35State, Reference};
pub use source::{HfCheckpoint, Weights};
use std::sync::Arc;

#[derive(Debug)]
struct DeltaNet {
    qkv: Matrix,
    gate: Matrix,
    alpha: Matrix,
    beta: Matrix,
    a: Buf,
    dt_bias: Buf,
    conv: Buf,
    norm: Buf,
    out: Matrix,
    /// Offset of this layer's state in a sequence's [`Recurrent::state`].
    offset: usize,
}

#[derive(Debug)]
struct Attention {
    /// The query rows of `attn_q` (its rows alternate a head's query and its output gate).
    q: Matrix,
    /// The gate rows of `attn_q`.
    gate: Matrix,
    k: Matrix,
    v: Matrix,
    q_norm: Buf,
    k_norm: Buf,
    out: Matrix,
    /// This layer's index among the attention layers (its KV layer in the page pool).
    kv_layer: usize,
}

#[derive(Debug)]
enum Mixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

#[derive(Debug)]
struct Layer {
    norm: Buf,
    mixer: Mixer,
    mlp: Mlp,
}

/// A loaded `qwen35` model for the engine.
#[derive(Debug)]
pub struct Qwen35 {
    cfg: Qwen35Config,
    embd: Vec<f32>,
    layers: Vec<Layer>,
    head: LmHead,
    mtp: Option<Mtp>,
    chunked_prefill: bool,
}

/// Per-forward buffers, reused across calls.
#[derive(Debug, Default)]
pub struct Scratch {
    x: Buf,
    xb: Buf,
    qkv: Buf,
    z: Buf,
    alpha: Buf,
    beta: Buf,
    /// The DeltaNet convolution's output.
    y: Buf,
    o: Buf,
    mix: Buf,
    /// The queries before their norm.
    qraw: Buf,
    /// The attention's output gates.
    gate: Buf,
    q: Buf,
    k: Buf,
    /// The normed keys.
    kn: Buf,
    v: Buf,
    att: Buf,
    mlp: MlpScratch,
    head: HeadScratch,
    hn: Buf,
    /// The MTP head's raw inputs per token: `[embedding | hidden state before it]`.
    raw: Buf,
    cat: Buf,
    ws: Workspace,
    /// `(cos, sin)` per position and rotated pair, grown on demand.
    rope: Vec<(f32, f32)>,
}

impl Qwen35 {
    /// Loads the weights of a model of shape `cfg` from `w`, its matrices in `dev`'s layout.
    pub fn load(w: &dyn Weights, cfg: Qwen35Config, dev: &Device) -> Result<Self, ModelError> {
        let c = &cfg;
        let d = c.d_model;
        let g = c.gdn();
        let mut layers = Vec::with_capacity(c.n_layers);
        let (mut offset, mut kv_layer) = (0, 0);
        for (i, &rec) in c.recurrent.iter().enumerate() {
            let mixer = if rec {
                let n = |s: &str| format!("blk.{i}.{s}");
                let vd = g.vh * g.dv;
                let m = DeltaNet {
                    qkv: w.matrix(dev, &n("attn_qkv.weight"), g.conv_dim(), d)?,
                    gate: w.matrix(dev, &n("attn_gate.weight"), vd, d)?,
                    alpha: w.matrix(dev, &n("ssm_alpha.weight"), g.vh, d)?,
                    beta: w.matrix(dev, &n("ssm_beta.weight"), g.vh, d)?,
                    a: dev.buf(w.vector(&n("ssm_a"), g.vh)?)?,
                    dt_bias: dev.buf(w.vector(&n("ssm_dt.bias"), g.vh)?)?,
                    conv: dev.buf(w.vector(&n("ssm_conv1d.weight"), g.conv_dim() * g.kernel)?)?,
                    norm: dev.buf(w.vector(&n("ssm_norm.weight"), g.dv)?)?,
                    out: w.matrix(dev, &n("ssm_out.weight"), d, vd)?,
                    offset,
                };
                offset += g.floats();
                Mixer::DeltaNet(m)
            } else {
                kv_layer += 1;
                Mixer::Attention(load_attention(w, dev, c, i, kv_layer - 1)?)
            };
            layers.push(load_layer(w, dev, c, i, mixer)?);
        }
        let mtp = if c.mtp {
            let i = c.n_layers;
            let n = |s: &str| format!("blk.{i}.nextn.{s}");
            let attn = Mixer::Attention(load_attention(w, dev, c, i, kv_layer)?);
            Some(Mtp {
                eh: w.matrix(dev, &n("eh_proj.weight"), d, 2 * d)?,
                enorm: dev.buf(w.vector(&n("enorm.weight"), d)?)?,
                hnorm: dev.buf(w.vector(&n("hnorm.weight"), d)?)?,
                head_norm: dev.buf(w.vector(&n("shared_head_norm.weight"), d)?)?,
                layer: load_layer(w, dev, c, i, attn)?,
            })
        } else {
            None
        };
        let output_name = if w.tied_output() {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        Ok(Qwen35 {
            embd: w.matrix_f32("token_embd.weight", c.vocab, d)?,
            head: LmHead::new(
                dev.buf(w.vector("output_norm.weight", d)?)?,
                Linear::new(w.matrix(dev, output_name, c.vocab, d)?),
            ),
            layers,
            mtp,
            chunked_prefill: false,
            cfg,
        })
    }

    /// Loads a `qwen35` GGUF for `dev` (a GPU that reads host memory in place keeps `g`'s mapping for
    /// its weights).
    pub fn from_gguf(g: &Arc<Gguf>, dev: &Device) -> Result<Self, ModelError> {
        Self::load(g, Qwen35Config::from_gguf(g)?, dev)
    }

    /// Loads a Hugging Face checkpoint directory for `dev`.
    pub fn from_hf(dir: &std::path::Path, dev: &Device) -> Result<Self, ModelError> {
        let ck = HfCheckpoint::open(dir)?;
        let cfg = ck.qwen35_config().clone();
        Self::load(&ck, cfg, dev)
    }

    /// The hyperparameters.
    pub fn config(&self) -> &Qwen35Config {
        &self.cfg
    }

    /// Bytes of weights a forward pass reads.
    pub fn weight_bytes(&self) -> usize {
        let mats = self.layers.iter().map(|l| {
            let mix = match &l.mixer {
                Mixer::DeltaNet(m) => {
                    m.qkv.bytes()
                        + m.gate.bytes()
                        + m.alpha.bytes()
                        + m.beta.bytes()
                        + m.out.bytes()
                }
                Mixer::Attention(a) => {
                    a.q.bytes() + a.gate.bytes() + a.k.bytes() + a.v.bytes() + a.out.bytes()
                }
            };
            mix + l.mlp.bytes()
        });
        mats.sum::<usize>() + self.head.bytes()
    }

    /// Prefill runs of more than one token with the chunked DeltaNet form instead of token by token (see
    /// [`gdn`](crate::backend::gdn): the token-by-token form is cheaper on CPU and batch-invariant, so it is the default).
    pub fn set_chunked_prefill(&mut self, on: bool) {
        self.chunked_prefill = on;
    }

    /// Runs the tokens of `batch` (several sequences, each at its own positions and pages, `states[i]` the
    /// recurrent state of sequence `i`): writes the attention KV into `pool` and advances the states. A
    /// sequence whose logits are [`Logits::Tail`]`(k)` (speculative verification, a chain) keeps its state
    /// after each of those `k` tokens in [`Recurrent::steps`]. Returns the requested logits as
    /// [`crate::model::llama::Llama::forward`] does.
    pub fn forward<'s>(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        states: &mut [Recurrent],
        s: &'s mut Scratch,
    ) -> Result<&'s mut [f32], ModelError> {
        Ok(self.pass(dev, pool, batch, states, s)?.into_all())
    }

    /// [`Qwen35::forward`], its logits rows read back as far as the caller reads them (see
    /// [`LogitRows`]).
    pub fn pass<'s>(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        states: &mut [Recurrent],
        s: &'s mut Scratch,
    ) -> Result<LogitRows<'s>, ModelError> {
        let c = &self.cfg;
        let n = batch.len();
        if n == 0 {
            return Ok(s.head.rows(0, c.vocab));
        }
        if pool.shape() != c.kv_shape() {
            return Err(unsupported("the KV pool was made for another model"));
        }
        if states.len() != batch.seqs.len() {
            return Err(unsupported("one recurrent state per sequence is needed"));
        }
        let floats = c.state_floats();
        for (st, span) in states.iter_mut().zip(&batch.seqs) {
            if st.state.len() != floats || st.len != span.start {
                return Err(unsupported(format!(
                    "recurrent state for position {} does not match the sequence at {}",
                    st.len, span.start
                )));
            }
            st.len = Recurrent::INVALID;
        }
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(unsupported(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab
            )));
        }
        // Steps kept for speculative verification.
        for (i, span) in batch.seqs.iter().enumerate() {
            let st = &mut states[i];
            match batch.logits[i] {
                Logits::Tail(k) => {
                    let k = k.min(span.len);
                    st.steps_len = k;
                    st.steps_from = span.start + span.len - k + 1;
                }
                _ => st.steps_len = 0,
            }
        }
        let d = c.d_model;
        let g = c.gdn();
        let (cd, vd) = (g.conv_dim(), g.vh * g.dv);
        let (nh, hd) = (c.n_heads, c.head_dim);
        dev.grow(&mut s.x, n * d)?;
        dev.grow(&mut s.xb, n * d)?;
        dev.grow(&mut s.y, n * cd)?;
        dev.grow(&mut s.o, n * vd)?;
        dev.grow(&mut s.q, n * nh * hd)?;
        dev.grow(&mut s.att, n * nh * hd)?;
        self.grow_rope(batch, s);
        self.embed(dev, &batch.tokens, &mut s.x)?;
        let mut rec = States::stage(dev, states, floats)?;
        self.layers_pass(dev, pool, batch, &mut rec, s)?;
        // The rows whose logits were asked for, in batch order.
        let run = Run {
            dev,
            reference: None,
            eps: c.eps,
        };
        let len = self
            .head
            .forward(&run, &s.x, batch, &mut s.head, &mut s.ws, &mut None)?;
        if let Some(mtp) = &self.mtp {
            self.mtp_fill(mtp, dev, pool, batch, states, s)?;
        }
        for (st, span) in states.iter_mut().zip(&batch.seqs) {
            st.len = span.start + span.len;
        }
        Ok(s.head.rows(len / c.vocab, c.vocab))
    }

    /// Every layer over the batch in `s.x`, the recurrent states in `rec`.
    fn layers_pass(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        rec: &mut States<'_>,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (n, d) = (batch.len(), c.d_model);
        let g = c.gdn();
        let vd = g.vh * g.dv;
        for l in &self.layers {
            dev.rmsnorm_rows(&s.x, &l.norm, c.eps, n, d, &mut s.xb);
            match &l.mixer {
                Mixer::DeltaNet(m) => {
                    let x = dev.input(&s.xb, n, d, &mut s.ws);
                    dev.matmul(&m.qkv, &x, &mut s.qkv);
                    dev.matmul(&m.gate, &x, &mut s.z);
                    dev.matmul(&m.alpha, &x, &mut s.alpha);
                    dev.matmul(&m.beta, &x, &mut s.beta);
                    dev.gdn_gates(
                        &m.a,
                        &m.dt_bias,
                        s.alpha.at_mut(..n * g.vh),
                        s.beta.at_mut(..n * g.vh),
                    );
                    for (i, span) in batch.seqs.iter().enumerate() {
                        let rows = span.first..span.first + span.len;
                        self.deltanet_run(m, dev, rec, i, rows, s);
                    }
                    dev.gdn_gated_norm(&g, s.o.at_mut(..n * vd), s.z.at(..n * vd), &m.norm, c.eps);
                    let o = dev.input(&s.o, n, vd, &mut s.ws);
                    dev.matmul(&m.out, &o, &mut s.mix);
                }
                Mixer::Attention(a) => self.attention(a, dev, pool, batch, n, s)?,
            }
            dev.add(s.x.at_mut(..n * d), s.mix.at(..n * d));
            self.mlp(l, dev, n, s)?;
        }
        Ok(())
    }

    /// The embedding rows of `tokens` into `x` (the table is f32 on the host).
    fn embed(&self, dev: &Device, tokens: &[u32], x: &mut Buf) -> Result<(), ModelError> {
        let d = self.cfg.d_model;
        let table = bytemuck::cast_slice(&self.embd);
        Ok(dev.embed(
            GgmlType::F32,
            table,
            d,
            tokens,
            x.at_mut(..tokens.len() * d),
        )?)
    }

    /// Extends the RoPE table to the batch's last position.
    fn grow_rope(&self, batch: &Batch, s: &mut Scratch) {
        let c = &self.cfg;
        let half = c.rope_dims / 2;
        let longest = batch
            .seqs
            .iter()
            .map(|sp| sp.start + sp.len)
            .max()
            .unwrap_or(0);
        while half > 0 && s.rope.len() < longest * half {
            let pos = s.rope.len() / half;
            for i in 0..half {
                let f = f64::from(c.rope_base).powf(-2.0 * i as f64 / c.rope_dims as f64);
                let th = pos as f64 * f;
                s.rope.push((th.cos() as f32, th.sin() as f32));
            }
        }
    }

    /// The gated attention of `n` tokens: projections of `s.xb`, q/k norms, partial RoPE, the KV written
    /// into `pool`, attention over the pages, the output gate and projection into `s.mix`.
    fn attention(
        &self,
        a: &Attention,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        n: usize,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (nh, hd) = (c.n_heads, c.head_dim);
        self.project_kv(a, dev, pool, batch, n, s, true)?;
        dev.attention(
            pool,
            a.kv_layer,
            batch,
            s.q.at(..n * nh * hd),
            nh * hd,
            nh,
            c.n_kv_heads,
            hd,
            s.att.at_mut(..n * nh * hd),
            &mut s.ws,
        );
        dev.sigmoid_gate(s.att.at_mut(..n * nh * hd), s.gate.at(..n * nh * hd));
        let att = dev.input(&s.att, n, nh * hd, &mut s.ws);
        dev.matmul(&a.out, &att, &mut s.mix);
        Ok(())
    }

    /// Projects `s.xb` to K and V (and the normed, rotated queries with
    /// their gates when `queries`) and writes K and V into `pool` at each token's slot.
    #[expect(clippy::too_many_arguments, reason = "the pass's pieces, spelled out")]
    fn project_kv(
        &self,
        a: &Attention,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        n: usize,
        s: &mut Scratch,
        queries: bool,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (nh, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let half = c.rope_dims / 2;
        let x = dev.input(&s.xb, n, c.d_model, &mut s.ws);
        if queries {
            dev.matmul(&a.q, &x, &mut s.qraw);
            dev.matmul(&a.gate, &x, &mut s.gate);
        }
        dev.matmul(&a.k, &x, &mut s.k);
        dev.matmul(&a.v, &x, &mut s.v);
        if queries {
            let w = nh * hd;
            let (q, qn) = (s.qraw.at(..n * w), s.q.at_mut(..n * w));
            dev.rmsnorm_rows(q, &a.q_norm, c.eps, n * nh, hd, qn);
            let q = s.q.at_mut(..n * w);
            dev.rope_rows(Rope::Neox, q, n, w, w, hd, &batch.pos, &s.rope, half);
        }
        let w = nkv * hd;
        dev.grow(&mut s.kn, n * w)?;
        dev.rmsnorm_rows(
            s.k.at(..n * w),
            &a.k_norm,
            c.eps,
            n * nkv,
            hd,
            s.kn.at_mut(..n * w),
        );
        let k = s.kn.at_mut(..n * w);
        dev.rope_rows(Rope::Neox, k, n, w, w, hd, &batch.pos, &s.rope, half);
        dev.write_kv_rows(
            pool,
            batch,
            a.kv_layer,
            s.kn.at(..n * w),
            s.v.at(..n * w),
            w,
        );
        Ok(())
    }

    /// The shared SwiGLU block ([`Mlp`]) over `n` tokens of `s.x`, added into `s.x`.
    fn mlp(&self, l: &Layer, dev: &Device, n: usize, s: &mut Scratch) -> Result<(), ModelError> {
        let run = Run {
            dev,
            reference: None,
            eps: self.cfg.eps,
        };
        l.mlp
            .forward(&run, &mut s.x, n, &mut s.mlp, &mut s.ws, &mut None)
    }

    /// Sequence `i`'s run of tokens (`rows` of the batch) through a DeltaNet layer: convolution and the
    /// recurrence over the layer's projections in `s` (the gates already applied), the convolution's output
    /// in `s.y`, the per-head outputs into `s.o`.
    fn deltanet_run(
        &self,
        m: &DeltaNet,
        dev: &Device,
        rec: &mut States<'_>,
        i: usize,
        rows: std::ops::Range<usize>,
        s: &mut Scratch,
    ) {
        let g = self.cfg.gdn();
        let (cd, vd, vh) = (g.conv_dim(), g.vh * g.dv, g.vh);
        let len = rows.len();
        let (t0, t1) = (rows.start, rows.end);
        let (mut state, mut steps) = rec.seq(i);
        let mats = m.offset..m.offset + g.matrix_floats();
        let window = mats.end..m.offset + g.floats();
        dev.gdn_conv(
            &g,
            &m.conv,
            state.slice(window.clone()),
            s.qkv.at(t0 * cd..t1 * cd),
            len,
            s.y.at_mut(t0 * cd..t1 * cd),
            steps.as_mut().map(|st| st.at(window.start)),
        );
        dev.gdn_normalize_qk(&g, s.y.at_mut(t0 * cd..t1 * cd), len);
        let run = GdnRun {
            y: s.y.at(t0 * cd..t1 * cd),
            g: s.alpha.at(t0 * vh..t1 * vh),
            beta: s.beta.at(t0 * vh..t1 * vh),
            n: len,
        };
        let out = s.o.at_mut(t0 * vd..t1 * vd);
        if self.chunked_prefill && steps.is_none() && len > 1 {
            dev.gdn_chunked(&g, run, state.slice(mats), out);
        } else {
            let steps = steps.as_mut().map(|st| st.at(mats.start));
            dev.gdn_recurrence(&g, run, state.slice(mats), out, steps);
        }
    }
}

/// A pass's recurrent states where its DeltaNet ops reach them: each sequence's own [`Recurrent`] buffers,
/// moved into the device's memory at the sequence's first pass (on a GPU) and kept there, so a pass
/// neither uploads nor reads back states.
struct States<'a> {
    host: &'a mut [Recurrent],
    floats: usize,
}

impl<'a> States<'a> {
    /// The states of `seqs` (one per sequence of the pass, `floats` each, their kept steps sized) in
    /// `dev`'s memory.
    fn stage(dev: &Device, seqs: &'a mut [Recurrent], floats: usize) -> Result<Self, ModelError> {
        for st in seqs.iter_mut() {
            dev.grow(&mut st.state, floats)?;
            dev.grow(&mut st.steps, (st.steps_len * floats).max(1))?;
        }
        Ok(States { host: seqs, floats })
    }

    /// Sequence `i`'s state, and its kept steps if the pass keeps any.
    fn seq(&mut self, i: usize) -> (ViewMut<'_>, Option<GdnSteps<'_>>) {
        let f = self.floats;
        let st = &mut self.host[i];
        let count = st.steps_len;
        let steps = (count > 0).then(|| GdnSteps {
            buf: st.steps.at_mut(..count * f),
            stride: f,
            offset: 0,
            count,
        });
        (st.state.at_mut(..f), steps)
    }
}

fn load_attention(
    w: &dyn Weights,
    dev: &Device,
    c: &Qwen35Config,
    i: usize,
    kv_layer: usize,
) -> Result<Attention, ModelError> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let (d, hd, nh) = (c.d_model, c.head_dim, c.n_heads);
    // `attn_q`'s rows are `[query | gate]` per head: two matrices, so that both come out contiguous.
    let part = |gate: usize| -> Vec<usize> {
        (0..nh)
            .flat_map(|h| (h * 2 + gate) * hd..(h * 2 + gate + 1) * hd)
            .collect()
    };
    let q = n("attn_q.weight");
    Ok(Attention {
        q: w.matrix_rows(dev, &q, 2 * nh * hd, d, &part(0))?,
        gate: w.matrix_rows(dev, &q, 2 * nh * hd, d, &part(1))?,
        k: w.matrix(dev, &n("attn_k.weight"), c.n_kv_heads * hd, d)?,
        v: w.matrix(dev, &n("attn_v.weight"), c.n_kv_heads * hd, d)?,
        q_norm: dev.buf(w.vector(&n("attn_q_norm.weight"), hd)?)?,
        k_norm: dev.buf(w.vector(&n("attn_k_norm.weight"), hd)?)?,
        out: w.matrix(dev, &n("attn_output.weight"), d, c.n_heads * hd)?,
        kv_layer,
    })
}

fn load_layer(
    w: &dyn Weights,
    dev: &Device,
    c: &Qwen35Config,
    i: usize,
    mixer: Mixer,
) -> Result<Layer, ModelError> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let d = c.d_model;
    Ok(Layer {
        norm: dev.buf(w.vector(&n("attn_norm.weight"), d)?)?,
        mixer,
        mlp: load_mlp(w, dev, c, i)?,
    })
}

/// A layer's SwiGLU block: gate and up fused into one matrix where their stored types allow.
fn load_mlp(w: &dyn Weights, dev: &Device, c: &Qwen35Config, i: usize) -> Result<Mlp, ModelError> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let (d, f) = (c.d_model, c.ffn);
    let norm = dev.buf(w.vector(&n("post_attention_norm.weight"), d)?)?;
    let gate = || w.matrix(dev, &n("ffn_gate.weight"), f, d);
    let up = || w.matrix(dev, &n("ffn_up.weight"), f, d);
    let down = Linear::new(w.matrix(dev, &n("ffn_down.weight"), d, f)?);
    Ok(match dev.concat(vec![gate()?, up()?]) {
        Some(gu) => Mlp::fused(norm, Linear::new(gu), down),
        None => Mlp::split(norm, Linear::new(gate()?), Linear::new(up()?), down),
    })
}
