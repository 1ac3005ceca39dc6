//! Qwen3.5/3.6 hybrid models (GGUF arch `qwen35`): Gated DeltaNet layers with one gated full-attention
//! layer every `full_attention_interval`, SwiGLU MLPs.
//!
//! This is the scalar f32 reference forward pass, one token at a time: the test oracle for the fast paths
//! to come (batched matmuls, chunked prefill, paged attention KV) and the state format the prefix cache
//! snapshots. Conventions are llama.cpp's GGUF ones (see `shared/design/notes/models-hybrid-formats.md`):
//!
//! * the `(1 + w)` RMSNorm weights (`attn_norm`, `post_attention_norm`, `output_norm`, `attn_q_norm`,
//!   `attn_k_norm`) are stored with the 1 folded in, so every norm is `x / rms(x) * w`; the gated norm of
//!   the DeltaNet output (`ssm_norm`) is `x / rms(x) * w * silu(z)`;
//! * `ssm_a` is `-exp(A_log)` and `ssm_dt.bias` is `dt_bias`;
//! * value heads are in tiled order: value head `n` reads key head `n % key_heads`.
//!
//! Per DeltaNet layer and token: `qkv = W x`, a causal depthwise convolution over the last `conv_kernel`
//! inputs (its window is state), SiLU, L2-normalised q and k (q scaled by `1/sqrt(dk)`), `β = σ(W_β x)`,
//! `g = a · softplus(W_α x + dt_bias)`, then per value head `S ← S·e^g; δ = (v − Sᵀk)·β; S ← S + k δᵀ;
//! o = Sᵀq`, the gated norm with `z = W_gate x`, and `ssm_out`. The attention layer splits each query head
//! into `[query | gate]`, normalises q and k per head, rotates the first `rope.dimension_count` dims
//! (NeoX halves), attends causally with grouped KV heads, and multiplies by `σ(gate)` before `attn_output`.

use super::ModelError;
use crate::gguf::Gguf;
use crate::quant::dequantize_ref;

/// Hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Config {
    /// Width of the residual stream.
    pub d_model: usize,
    /// MLP width.
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Layers.
    pub n_layers: usize,
    /// Which layers are Gated DeltaNet (the rest are full attention).
    pub recurrent: Vec<bool>,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Attention query heads.
    pub n_heads: usize,
    /// Attention KV heads.
    pub n_kv_heads: usize,
    /// Attention head width.
    pub head_dim: usize,
    /// Rotated dims per attention head.
    pub rope_dims: usize,
    /// RoPE base.
    pub rope_base: f32,
    /// DeltaNet key heads.
    pub key_heads: usize,
    /// DeltaNet value heads.
    pub value_heads: usize,
    /// DeltaNet key (and query) head width.
    pub key_dim: usize,
    /// DeltaNet value head width.
    pub value_dim: usize,
    /// Causal convolution taps.
    pub conv_kernel: usize,
}

impl Qwen35Config {
    /// Reads the hyperparameters of a `qwen35` GGUF.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let arch = g.architecture()?;
        if arch != "qwen35" {
            return Err(ModelError::Unsupported(format!(
                "architecture {arch:?} is not qwen35"
            )));
        }
        let u = |k: &str| g.arch_u32(k).map(|v| v as usize);
        let n_layers = u("block_count")?;
        let interval = u("full_attention_interval").unwrap_or(4).max(1);
        let recurrent = (0..n_layers).map(|i| (i + 1) % interval != 0).collect();
        let d_model = u("embedding_length")?;
        let value_heads = u("ssm.time_step_rank")?;
        let inner = u("ssm.inner_size")?;
        let vocab = g
            .tensor("token_embd.weight")?
            .dims
            .get(1)
            .copied()
            .unwrap_or(0);
        Ok(Qwen35Config {
            d_model,
            ffn: u("feed_forward_length")?,
            vocab: vocab as usize,
            n_layers,
            recurrent,
            eps: g.arch_f32("attention.layer_norm_rms_epsilon")?,
            n_heads: u("attention.head_count")?,
            n_kv_heads: u("attention.head_count_kv")?,
            head_dim: u("attention.key_length")?,
            rope_dims: u("rope.dimension_count")?,
            rope_base: g.arch_f32("rope.freq_base")?,
            key_heads: u("ssm.group_count")?,
            value_heads,
            key_dim: u("ssm.state_size")?,
            value_dim: inner / value_heads.max(1),
            conv_kernel: u("ssm.conv_kernel")?,
        })
    }

    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Floats of one DeltaNet layer's state: the recurrent matrix per value head and the convolution window.
    pub fn recurrent_state_floats(&self) -> usize {
        self.value_heads * self.key_dim * self.value_dim + self.conv_dim() * (self.conv_kernel - 1)
    }
}

/// A matrix of `rows` outputs over `cols` inputs, row-major f32.
#[derive(Debug, Clone)]
struct Mat {
    w: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Mat {
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        for (r, o) in out.iter_mut().enumerate().take(self.rows) {
            let row = &self.w[r * self.cols..(r + 1) * self.cols];
            *o = row.iter().zip(x).map(|(a, b)| a * b).sum();
        }
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate: Mat,
    up: Mat,
    down: Mat,
    norm: Vec<f32>,
}

#[derive(Debug, Clone)]
struct DeltaNet {
    qkv: Mat,
    gate: Mat,
    alpha: Mat,
    beta: Mat,
    a: Vec<f32>,
    dt_bias: Vec<f32>,
    conv: Vec<f32>,
    norm: Vec<f32>,
    out: Mat,
}

#[derive(Debug, Clone)]
struct Attention {
    q: Mat,
    k: Mat,
    v: Mat,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    out: Mat,
}

#[derive(Debug, Clone)]
enum Mixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

#[derive(Debug, Clone)]
struct Layer {
    norm: Vec<f32>,
    mixer: Mixer,
    mlp: Mlp,
}

/// A loaded `qwen35` model (f32 weights).
#[derive(Debug, Clone)]
pub struct Qwen35 {
    cfg: Qwen35Config,
    embd: Mat,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    output: Mat,
}

/// One sequence's state: per DeltaNet layer its recurrent matrices and convolution window, per attention
/// layer its keys and values so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35State {
    /// Per layer: DeltaNet `[value head][key dim][value dim]` then the window `[channel][kernel - 1]`
    /// (oldest first); empty for attention layers.
    pub recurrent: Vec<Vec<f32>>,
    /// Per layer: keys and values of every position so far (`[pos][kv head][dim]`); empty for DeltaNet.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// Positions consumed.
    pub len: usize,
}

fn vector(g: &Gguf, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
    let t = g.tensor(name)?;
    if t.n_elements() != n as u64 {
        return Err(ModelError::Shape {
            name: name.into(),
            got: t.dims.clone(),
            want: vec![n as u64],
        });
    }
    let mut v = vec![0f32; n];
    dequantize_ref(t.ty, g.tensor_data(t), &mut v)?;
    Ok(v)
}

fn matrix(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Mat, ModelError> {
    let t = g.tensor(name)?;
    let (c, r) = (
        t.dims.first().copied().unwrap_or(0),
        t.dims.get(1).copied().unwrap_or(1),
    );
    if (c, r) != (cols as u64, rows as u64) {
        return Err(ModelError::Shape {
            name: name.into(),
            got: t.dims.clone(),
            want: vec![cols as u64, rows as u64],
        });
    }
    let mut w = vec![0f32; rows * cols];
    dequantize_ref(t.ty, g.tensor_data(t), &mut w)?;
    Ok(Mat { w, rows, cols })
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

impl Qwen35 {
    /// Loads a `qwen35` GGUF.
    pub fn load(g: &Gguf) -> Result<Self, ModelError> {
        let c = Qwen35Config::from_gguf(g)?;
        let d = c.d_model;
        let mut layers = Vec::with_capacity(c.n_layers);
        for (i, &rec) in c.recurrent.iter().enumerate() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let mixer = if rec {
                let vd = c.value_heads * c.value_dim;
                Mixer::DeltaNet(DeltaNet {
                    qkv: matrix(g, &n("attn_qkv.weight"), c.conv_dim(), d)?,
                    gate: matrix(g, &n("attn_gate.weight"), vd, d)?,
                    alpha: matrix(g, &n("ssm_alpha.weight"), c.value_heads, d)?,
                    beta: matrix(g, &n("ssm_beta.weight"), c.value_heads, d)?,
                    a: vector(g, &n("ssm_a"), c.value_heads)?,
                    dt_bias: vector(g, &n("ssm_dt.bias"), c.value_heads)?,
                    conv: vector(g, &n("ssm_conv1d.weight"), c.conv_dim() * c.conv_kernel)?,
                    norm: vector(g, &n("ssm_norm.weight"), c.value_dim)?,
                    out: matrix(g, &n("ssm_out.weight"), d, vd)?,
                })
            } else {
                let hd = c.head_dim;
                Mixer::Attention(Attention {
                    q: matrix(g, &n("attn_q.weight"), 2 * c.n_heads * hd, d)?,
                    k: matrix(g, &n("attn_k.weight"), c.n_kv_heads * hd, d)?,
                    v: matrix(g, &n("attn_v.weight"), c.n_kv_heads * hd, d)?,
                    q_norm: vector(g, &n("attn_q_norm.weight"), hd)?,
                    k_norm: vector(g, &n("attn_k_norm.weight"), hd)?,
                    out: matrix(g, &n("attn_output.weight"), d, c.n_heads * hd)?,
                })
            };
            layers.push(Layer {
                norm: vector(g, &n("attn_norm.weight"), d)?,
                mixer,
                mlp: Mlp {
                    gate: matrix(g, &n("ffn_gate.weight"), c.ffn, d)?,
                    up: matrix(g, &n("ffn_up.weight"), c.ffn, d)?,
                    down: matrix(g, &n("ffn_down.weight"), d, c.ffn)?,
                    norm: vector(g, &n("post_attention_norm.weight"), d)?,
                },
            });
        }
        Ok(Qwen35 {
            embd: matrix(g, "token_embd.weight", c.vocab, d)?,
            out_norm: vector(g, "output_norm.weight", d)?,
            output: matrix(g, "output.weight", c.vocab, d)?,
            layers,
            cfg: c,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &Qwen35Config {
        &self.cfg
    }

    /// A fresh state (no positions).
    pub fn new_state(&self) -> Qwen35State {
        let c = &self.cfg;
        Qwen35State {
            recurrent: c
                .recurrent
                .iter()
                .map(|&r| {
                    if r {
                        vec![0.0; c.recurrent_state_floats()]
                    } else {
                        Vec::new()
                    }
                })
                .collect(),
            kv: vec![(Vec::new(), Vec::new()); c.n_layers],
            len: 0,
        }
    }

    /// Consumes `token` at the next position of `state` and writes the logits into `logits` (`vocab`).
    pub fn step(
        &self,
        state: &mut Qwen35State,
        token: u32,
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let d = c.d_model;
        let t = token as usize;
        if t >= c.vocab {
            return Err(ModelError::Unsupported(format!(
                "token id {t} is outside the vocabulary ({})",
                c.vocab
            )));
        }
        let mut h = self.embd.w[t * d..(t + 1) * d].to_vec();
        let mut x = vec![0f32; d];
        let mut mix = vec![0f32; d];
        for (li, l) in self.layers.iter().enumerate() {
            rmsnorm(&h, &l.norm, c.eps, &mut x);
            match &l.mixer {
                Mixer::DeltaNet(m) => self.deltanet(m, &x, &mut state.recurrent[li], &mut mix),
                Mixer::Attention(a) => {
                    self.attention(a, &x, &mut state.kv[li], state.len, &mut mix)
                }
            }
            for (hv, m) in h.iter_mut().zip(&mix) {
                *hv += m;
            }
            rmsnorm(&h, &l.mlp.norm, c.eps, &mut x);
            let mut g = vec![0f32; c.ffn];
            let mut u = vec![0f32; c.ffn];
            l.mlp.gate.apply(&x, &mut g);
            l.mlp.up.apply(&x, &mut u);
            for (gv, uv) in g.iter_mut().zip(&u) {
                *gv = silu(*gv) * uv;
            }
            l.mlp.down.apply(&g, &mut mix);
            for (hv, m) in h.iter_mut().zip(&mix) {
                *hv += m;
            }
        }
        state.len += 1;
        rmsnorm(&h, &self.out_norm, c.eps, &mut x);
        self.output.apply(&x, logits);
        Ok(())
    }

    fn deltanet(&self, m: &DeltaNet, x: &[f32], st: &mut [f32], out: &mut [f32]) {
        let c = &self.cfg;
        let (kh, vh, dk, dv, kern) = (
            c.key_heads,
            c.value_heads,
            c.key_dim,
            c.value_dim,
            c.conv_kernel,
        );
        let cd = c.conv_dim();
        let (s, window) = st.split_at_mut(vh * dk * dv);
        let mut qkv = vec![0f32; cd];
        m.qkv.apply(x, &mut qkv);
        // Causal depthwise convolution over the window (oldest first) and this input, then SiLU.
        let w = kern - 1;
        let mut conv = vec![0f32; cd];
        for ch in 0..cd {
            let taps = &m.conv[ch * kern..(ch + 1) * kern];
            let win = &mut window[ch * w..(ch + 1) * w];
            let mut acc = taps[w] * qkv[ch];
            for j in 0..w {
                acc += taps[j] * win[j];
            }
            conv[ch] = silu(acc);
            win.rotate_left(1.min(w));
            if w > 0 {
                win[w - 1] = qkv[ch];
            }
        }
        let (q, rest) = conv.split_at_mut(kh * dk);
        let (k, v) = rest.split_at_mut(kh * dk);
        for head in q.chunks_mut(dk).chain(k.chunks_mut(dk)) {
            let inv = 1.0 / (head.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
            head.iter_mut().for_each(|v| *v *= inv);
        }
        let qs = 1.0 / (dk as f32).sqrt();
        q.iter_mut().for_each(|v| *v *= qs);
        let mut ab = vec![0f32; vh];
        let mut bb = vec![0f32; vh];
        m.alpha.apply(x, &mut ab);
        m.beta.apply(x, &mut bb);
        let mut z = vec![0f32; vh * dv];
        m.gate.apply(x, &mut z);
        let mut o = vec![0f32; vh * dv];
        let mut delta = vec![0f32; dv];
        for hv in 0..vh {
            let hk = hv % kh;
            let (qh, kk) = (&q[hk * dk..(hk + 1) * dk], &k[hk * dk..(hk + 1) * dk]);
            let vv = &v[hv * dv..(hv + 1) * dv];
            let beta = sigmoid(bb[hv]);
            let decay = (m.a[hv] * softplus(ab[hv] + m.dt_bias[hv])).exp();
            let sh = &mut s[hv * dk * dv..(hv + 1) * dk * dv];
            sh.iter_mut().for_each(|x| *x *= decay);
            for (j, dl) in delta.iter_mut().enumerate() {
                let sk: f32 = (0..dk).map(|i| sh[i * dv + j] * kk[i]).sum();
                *dl = (vv[j] - sk) * beta;
            }
            for i in 0..dk {
                for j in 0..dv {
                    sh[i * dv + j] += kk[i] * delta[j];
                }
            }
            let oh = &mut o[hv * dv..(hv + 1) * dv];
            for (j, ov) in oh.iter_mut().enumerate() {
                *ov = (0..dk).map(|i| sh[i * dv + j] * qh[i]).sum();
            }
            // Gated RMSNorm over the head.
            let mut normed = vec![0f32; dv];
            rmsnorm(oh, &m.norm, c.eps, &mut normed);
            for (j, ov) in oh.iter_mut().enumerate() {
                *ov = normed[j] * silu(z[hv * dv + j]);
            }
        }
        m.out.apply(&o, out);
    }

    fn attention(
        &self,
        a: &Attention,
        x: &[f32],
        kv: &mut (Vec<f32>, Vec<f32>),
        pos: usize,
        out: &mut [f32],
    ) {
        let c = &self.cfg;
        let (nh, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let mut qg = vec![0f32; 2 * nh * hd];
        a.q.apply(x, &mut qg);
        let mut k = vec![0f32; nkv * hd];
        let mut v = vec![0f32; nkv * hd];
        a.k.apply(x, &mut k);
        a.v.apply(x, &mut v);
        let mut q = vec![0f32; nh * hd];
        let mut gate = vec![0f32; nh * hd];
        for h in 0..nh {
            let src = &qg[h * 2 * hd..(h + 1) * 2 * hd];
            rmsnorm(&src[..hd], &a.q_norm, c.eps, &mut q[h * hd..(h + 1) * hd]);
            gate[h * hd..(h + 1) * hd].copy_from_slice(&src[hd..]);
        }
        let mut kn = vec![0f32; hd];
        for h in 0..nkv {
            rmsnorm(&k[h * hd..(h + 1) * hd], &a.k_norm, c.eps, &mut kn);
            k[h * hd..(h + 1) * hd].copy_from_slice(&kn);
        }
        // Partial RoPE, NeoX halves over the first `rope_dims` dims of each head.
        let half = c.rope_dims / 2;
        let rot = |head: &mut [f32]| {
            for i in 0..half {
                let f = c.rope_base.powf(-2.0 * i as f32 / c.rope_dims as f32);
                let (s, co) = (pos as f32 * f).sin_cos();
                let (a0, a1) = (head[i], head[i + half]);
                head[i] = a0 * co - a1 * s;
                head[i + half] = a1 * co + a0 * s;
            }
        };
        q.chunks_mut(hd).for_each(rot);
        k.chunks_mut(hd).for_each(rot);
        kv.0.extend_from_slice(&k);
        kv.1.extend_from_slice(&v);
        let n = pos + 1;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut att = vec![0f32; nh * hd];
        let mut scores = vec![0f32; n];
        for h in 0..nh {
            let g = h / (nh / nkv).max(1);
            let qh = &q[h * hd..(h + 1) * hd];
            for (p, sc) in scores.iter_mut().enumerate() {
                let kp = &kv.0[(p * nkv + g) * hd..(p * nkv + g + 1) * hd];
                *sc = qh.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale;
            }
            let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0.0;
            for sc in scores.iter_mut() {
                *sc = (*sc - m).exp();
                sum += *sc;
            }
            let oh = &mut att[h * hd..(h + 1) * hd];
            for (p, &w) in scores.iter().enumerate() {
                let vp = &kv.1[(p * nkv + g) * hd..(p * nkv + g + 1) * hd];
                for (o, &vv) in oh.iter_mut().zip(vp) {
                    *o += w / sum * vv;
                }
            }
            for (o, &gv) in oh.iter_mut().zip(&gate[h * hd..(h + 1) * hd]) {
                *o *= sigmoid(gv);
            }
        }
        a.out.apply(&att, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(rel: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/fixtures/qwen35-tiny")
            .join(rel)
    }

    fn golden() -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(fixture("golden.json")).unwrap()).unwrap()
    }

    /// A golden sequence's token ids.
    fn ids_of(seq: &serde_json::Value) -> Vec<u32> {
        seq["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    }

    #[test]
    fn snapshot_size_of_a_27b_shaped_model() {
        // Qwen3.6-27B: 64 layers (48 DeltaNet), 16 key / 48 value heads of 128, conv kernel 4.
        let c = Qwen35Config {
            d_model: 5120,
            ffn: 17408,
            vocab: 248_320,
            n_layers: 64,
            recurrent: (0..64).map(|i| (i + 1) % 4 != 0).collect(),
            eps: 1e-6,
            n_heads: 24,
            n_kv_heads: 4,
            head_dim: 256,
            rope_dims: 64,
            rope_base: 1e7,
            key_heads: 16,
            value_heads: 48,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
        };
        assert_eq!(c.conv_dim(), 10240);
        let per_layer = c.recurrent_state_floats();
        assert_eq!(per_layer, 48 * 128 * 128 + 10240 * 3);
        let layers = c.recurrent.iter().filter(|&&r| r).count();
        let mib = (layers * per_layer * 4) as f64 / 1_048_576.0;
        // One fp32 snapshot of every DeltaNet layer: 149.6 MiB, the KV of ~2,390 bf16 positions
        // (16 attention layers x 2 x 4 KV heads x 256 x 2 bytes = 64 KiB per position).
        assert!((mib - 149.6).abs() < 0.1, "{mib} MiB");
    }

    #[test]
    fn gguf_logits_match_the_goldens() {
        let g = Gguf::open(fixture("model.gguf")).unwrap();
        let m = Qwen35::load(&g).unwrap();
        assert_eq!(m.config().recurrent, vec![true, true, true, false]);
        let gold = golden();
        let mut worst = 0f32;
        for s in gold["sequences"].as_array().unwrap() {
            let ids = ids_of(s);
            let mut st = m.new_state();
            let mut logits = vec![0f32; m.config().vocab];
            for (p, &t) in ids.iter().enumerate() {
                m.step(&mut st, t, &mut logits).unwrap();
                let want = s["logits"][p].as_array().unwrap();
                for (a, w) in logits.iter().zip(want) {
                    let w = w.as_f64().unwrap() as f32;
                    let err = (a - w).abs();
                    worst = worst.max(err);
                    assert!(
                        err <= 1e-4 + 1e-4 * w.abs(),
                        "{} position {p}: {a} vs {w}",
                        s["name"]
                    );
                }
            }
        }
        eprintln!("largest logit difference {worst:e}");
    }

    fn golden_tensor(name: &str) -> Vec<f32> {
        let bytes = std::fs::read(fixture("golden.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn state_after_a_prefix_matches_and_restores() {
        let g = Gguf::open(fixture("model.gguf")).unwrap();
        let m = Qwen35::load(&g).unwrap();
        let gold = golden();
        let c = &gold["sequences"][2];
        assert_eq!(c["name"], "C");
        let ids = ids_of(c);
        let mut st = m.new_state();
        let mut logits = vec![0f32; m.config().vocab];
        for &t in &ids[..70] {
            m.step(&mut st, t, &mut logits).unwrap();
        }
        let cfg = m.config();
        let s_len = cfg.value_heads * cfg.key_dim * cfg.value_dim;
        for layer in 0..3 {
            let want_s = golden_tensor(&format!("state.layer{layer}.recurrent_gguf_head_order"));
            let want_w = golden_tensor(&format!(
                "state.layer{layer}.conv_window_gguf_channel_order"
            ));
            let (s, w) = st.recurrent[layer].split_at(s_len);
            let max = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
            };
            assert_eq!((s.len(), w.len()), (want_s.len(), want_w.len()));
            assert!(
                max(s, &want_s) < 1e-5,
                "layer {layer} recurrent state: {}",
                max(s, &want_s)
            );
            assert!(
                max(w, &want_w) < 1e-5,
                "layer {layer} conv window: {}",
                max(w, &want_w)
            );
        }
        // A snapshot of the state continues exactly like the run that made it.
        let snapshot = st.clone();
        let want = golden_tensor("continuation.C.logits");
        for (run, mut s) in [("original", st), ("restored", snapshot)] {
            for (i, &t) in ids[70..].iter().enumerate() {
                m.step(&mut s, t, &mut logits).unwrap();
                for (a, w) in logits.iter().zip(&want[i * 256..(i + 1) * 256]) {
                    assert!(
                        (a - w).abs() <= 1e-4 + 1e-4 * w.abs(),
                        "{run} position {}: {a} vs {w}",
                        70 + i
                    );
                }
            }
        }
    }
}
