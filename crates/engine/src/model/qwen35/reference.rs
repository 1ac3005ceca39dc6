//! The scalar f32 reference forward pass of `qwen35`, one token at a time with owned state: the test oracle
//! for the engine's batched forward ([`super::Qwen35`]) and for the loaders. It follows the goldens' math
//! literally (see the parent module for the conventions).

use super::Qwen35Config;
use super::source::Weights;
use crate::backend::gdn::{sigmoid, silu, softplus};
use crate::model::ModelError;

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
pub struct Reference {
    cfg: Qwen35Config,
    embd: Mat,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    output: Mat,
    mtp: Option<RefMtp>,
}

/// The MTP head, in the usual convention: its step for position `p` reads the final hidden state of `p`
/// and the token at `p + 1`, sits at position `p`, and attends to its own KV of positions `0..=p`.
#[derive(Debug, Clone)]
struct RefMtp {
    eh: Mat,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    head_norm: Vec<f32>,
    layer: Layer,
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
    /// The final (normed) hidden state of the last position.
    pub hidden: Vec<f32>,
    /// The MTP head's keys and values, one per position it has run at.
    pub mtp_kv: (Vec<f32>, Vec<f32>),
}

fn matrix(w: &dyn Weights, name: &str, rows: usize, cols: usize) -> Result<Mat, ModelError> {
    Ok(Mat {
        w: w.matrix_f32(name, rows, cols)?,
        rows,
        cols,
    })
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

impl Reference {
    /// Loads the weights of a model of shape `c`.
    pub fn load(g: &dyn Weights, c: Qwen35Config) -> Result<Self, ModelError> {
        let d = c.d_model;
        let mut layers = Vec::with_capacity(c.n_layers);
        let attention = |i: usize| -> Result<Attention, ModelError> {
            let n = |s: &str| format!("blk.{i}.{s}");
            let hd = c.head_dim;
            Ok(Attention {
                q: matrix(g, &n("attn_q.weight"), 2 * c.n_heads * hd, d)?,
                k: matrix(g, &n("attn_k.weight"), c.n_kv_heads * hd, d)?,
                v: matrix(g, &n("attn_v.weight"), c.n_kv_heads * hd, d)?,
                q_norm: g.vector(&n("attn_q_norm.weight"), hd)?,
                k_norm: g.vector(&n("attn_k_norm.weight"), hd)?,
                out: matrix(g, &n("attn_output.weight"), d, c.n_heads * hd)?,
            })
        };
        let layer = |i: usize, mixer: Mixer| -> Result<Layer, ModelError> {
            let n = |s: &str| format!("blk.{i}.{s}");
            Ok(Layer {
                norm: g.vector(&n("attn_norm.weight"), d)?,
                mixer,
                mlp: Mlp {
                    gate: matrix(g, &n("ffn_gate.weight"), c.ffn, d)?,
                    up: matrix(g, &n("ffn_up.weight"), c.ffn, d)?,
                    down: matrix(g, &n("ffn_down.weight"), d, c.ffn)?,
                    norm: g.vector(&n("post_attention_norm.weight"), d)?,
                },
            })
        };
        for (i, &rec) in c.recurrent.iter().enumerate() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let mixer = if rec {
                let vd = c.value_heads * c.value_dim;
                Mixer::DeltaNet(DeltaNet {
                    qkv: matrix(g, &n("attn_qkv.weight"), c.conv_dim(), d)?,
                    gate: matrix(g, &n("attn_gate.weight"), vd, d)?,
                    alpha: matrix(g, &n("ssm_alpha.weight"), c.value_heads, d)?,
                    beta: matrix(g, &n("ssm_beta.weight"), c.value_heads, d)?,
                    a: g.vector(&n("ssm_a"), c.value_heads)?,
                    dt_bias: g.vector(&n("ssm_dt.bias"), c.value_heads)?,
                    conv: g.vector(&n("ssm_conv1d.weight"), c.conv_dim() * c.conv_kernel)?,
                    norm: g.vector(&n("ssm_norm.weight"), c.value_dim)?,
                    out: matrix(g, &n("ssm_out.weight"), d, vd)?,
                })
            } else {
                Mixer::Attention(attention(i)?)
            };
            layers.push(layer(i, mixer)?);
        }
        let mtp = if c.mtp {
            let i = c.n_layers;
            let n = |s: &str| format!("blk.{i}.nextn.{s}");
            Some(RefMtp {
                eh: matrix(g, &n("eh_proj.weight"), d, 2 * d)?,
                enorm: g.vector(&n("enorm.weight"), d)?,
                hnorm: g.vector(&n("hnorm.weight"), d)?,
                head_norm: g.vector(&n("shared_head_norm.weight"), d)?,
                layer: layer(i, Mixer::Attention(attention(i)?))?,
            })
        } else {
            None
        };
        Ok(Reference {
            embd: matrix(g, "token_embd.weight", c.vocab, d)?,
            out_norm: g.vector("output_norm.weight", d)?,
            output: if g.tied_output() {
                matrix(g, "token_embd.weight", c.vocab, d)?
            } else {
                matrix(g, "output.weight", c.vocab, d)?
            },
            layers,
            mtp,
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
            hidden: vec![0.0; c.d_model],
            mtp_kv: (Vec::new(), Vec::new()),
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
        state.hidden.clone_from(&x);
        self.output.apply(&x, logits);
        Ok(())
    }

    /// The MTP head's step for the last position `p` of `state`: from its final hidden state and the token
    /// at `p + 1` (`next`), the logits for the token at `p + 2`. Must run once per position, in order.
    pub fn mtp_step(
        &self,
        state: &mut Qwen35State,
        next: u32,
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let d = c.d_model;
        let Some(m) = &self.mtp else {
            return Err(ModelError::Unsupported("the model has no MTP head".into()));
        };
        let p = state.len.checked_sub(1).ok_or_else(|| {
            ModelError::Unsupported("the MTP head needs a position before it".into())
        })?;
        let t = next as usize;
        let mut cat = vec![0f32; 2 * d];
        rmsnorm(
            &self.embd.w[t * d..(t + 1) * d],
            &m.enorm,
            c.eps,
            &mut cat[..d],
        );
        rmsnorm(&state.hidden, &m.hnorm, c.eps, &mut cat[d..]);
        let mut h = vec![0f32; d];
        m.eh.apply(&cat, &mut h);
        let mut x = vec![0f32; d];
        let mut mix = vec![0f32; d];
        rmsnorm(&h, &m.layer.norm, c.eps, &mut x);
        let Mixer::Attention(a) = &m.layer.mixer else {
            unreachable!("the MTP block is an attention block")
        };
        self.attention(a, &x, &mut state.mtp_kv, p, &mut mix);
        for (hv, mv) in h.iter_mut().zip(&mix) {
            *hv += mv;
        }
        rmsnorm(&h, &m.layer.mlp.norm, c.eps, &mut x);
        let mut g = vec![0f32; c.ffn];
        let mut u = vec![0f32; c.ffn];
        m.layer.mlp.gate.apply(&x, &mut g);
        m.layer.mlp.up.apply(&x, &mut u);
        for (gv, uv) in g.iter_mut().zip(&u) {
            *gv = silu(*gv) * uv;
        }
        m.layer.mlp.down.apply(&g, &mut mix);
        for (hv, mv) in h.iter_mut().zip(&mix) {
            *hv += mv;
        }
        rmsnorm(&h, &m.head_norm, c.eps, &mut x);
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
