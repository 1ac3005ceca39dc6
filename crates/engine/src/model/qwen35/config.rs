//! A `qwen35` model's hyperparameters ([`Qwen35Config`]), from GGUF keys or a Hugging Face `config.json`,
//! and the shapes derived from them (DeltaNet, KV, recurrent state).

use crate::backend::{MAX_GROUP, MAX_HEAD_DIM, gdn};
use crate::gguf::Gguf;
use crate::kv::KvShape;
use crate::model::ModelError;

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
    /// Training context.
    pub ctx_train: usize,
    /// Whether the model has an MTP head (one extra gated-attention block that predicts the token after
    /// next from the last hidden state and the next token: a drafter for speculative decoding).
    pub mtp: bool,
}

/// A model this loader does not run, and why.
pub(super) fn unsupported(msg: impl Into<String>) -> ModelError {
    ModelError::Unsupported(msg.into())
}

impl Qwen35Config {
    /// Reads the hyperparameters of a `qwen35` GGUF.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ModelError> {
        let arch = g.architecture()?;
        if arch != "qwen35" {
            return Err(unsupported(format!("architecture {arch:?} is not qwen35")));
        }
        let u = |k: &str| g.arch_u32(k).map(|v| v as usize);
        // `block_count` includes the MTP blocks, which come last (llama.cpp's nextn convention).
        let nextn = u("nextn_predict_layers").unwrap_or(0);
        let n_layers = u("block_count")?.saturating_sub(nextn);
        let interval = u("full_attention_interval").unwrap_or(4).max(1);
        let recurrent = (0..n_layers).map(|i| (i + 1) % interval != 0).collect();
        let value_heads = u("ssm.time_step_rank")?;
        let inner = u("ssm.inner_size")?;
        let vocab = g
            .tensor("token_embd.weight")?
            .dims
            .get(1)
            .copied()
            .unwrap_or(0);
        let c = Qwen35Config {
            d_model: u("embedding_length")?,
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
            ctx_train: u("context_length").unwrap_or(4096),
            mtp: nextn > 0,
        };
        c.validate()?;
        Ok(c)
    }

    /// Reads the hyperparameters of a Hugging Face `config.json` (`qwen3_5_text`, or the `text_config` of
    /// a multimodal one).
    pub fn from_hf(j: &serde_json::Value) -> Result<Self, ModelError> {
        let u = |k: &str| {
            j.get(k)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| unsupported(format!("config.json lacks {k}")))
        };
        let n_layers = u("num_hidden_layers")?;
        let recurrent: Vec<bool> = match j.get("layer_types").and_then(|v| v.as_array()) {
            Some(t) => t
                .iter()
                .map(|v| v.as_str() == Some("linear_attention"))
                .collect(),
            None => {
                let interval = u("full_attention_interval").unwrap_or(4).max(1);
                (0..n_layers).map(|i| (i + 1) % interval != 0).collect()
            }
        };
        if recurrent.len() != n_layers {
            return Err(unsupported(
                "config.json: layer_types does not match the layers",
            ));
        }
        let rope = j.get("rope_parameters").unwrap_or(j);
        let f = |v: &serde_json::Value, k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        let head_dim = u("head_dim")?;
        let partial = f(rope, "partial_rotary_factor")
            .or_else(|| f(j, "partial_rotary_factor"))
            .unwrap_or(1.0);
        let c = Qwen35Config {
            d_model: u("hidden_size")?,
            ffn: u("intermediate_size")?,
            vocab: u("vocab_size")?,
            n_layers,
            recurrent,
            eps: f(j, "rms_norm_eps").unwrap_or(1e-6) as f32,
            n_heads: u("num_attention_heads")?,
            n_kv_heads: u("num_key_value_heads")?,
            head_dim,
            rope_dims: (head_dim as f64 * partial).round() as usize,
            rope_base: f(rope, "rope_theta")
                .or_else(|| f(j, "rope_theta"))
                .unwrap_or(1e7) as f32,
            key_heads: u("linear_num_key_heads")?,
            value_heads: u("linear_num_value_heads")?,
            key_dim: u("linear_key_head_dim")?,
            value_dim: u("linear_value_head_dim")?,
            conv_kernel: u("linear_conv_kernel_dim")?,
            ctx_train: u("max_position_embeddings").unwrap_or(4096),
            mtp: u("mtp_num_hidden_layers").unwrap_or(0) > 0,
        };
        c.validate()?;
        Ok(c)
    }

    pub(super) fn validate(&self) -> Result<(), ModelError> {
        let ok = self.key_heads > 0
            && self.value_heads.is_multiple_of(self.key_heads)
            && self.n_kv_heads > 0
            && self.n_heads.is_multiple_of(self.n_kv_heads)
            && self.n_heads / self.n_kv_heads <= MAX_GROUP
            && self.head_dim <= MAX_HEAD_DIM
            && self.rope_dims <= self.head_dim
            && self.rope_dims.is_multiple_of(2)
            && (2..=gdn::MAX_KERNEL).contains(&self.conv_kernel)
            && self.value_dim <= gdn::MAX_HEAD
            && self.head_dim <= gdn::MAX_HEAD
            && self.recurrent.len() == self.n_layers
            && self.recurrent.iter().any(|&r| !r);
        if ok {
            Ok(())
        } else {
            Err(unsupported(format!(
                "qwen35 shape outside what thorn runs: {self:?}"
            )))
        }
    }

    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        self.gdn().conv_dim()
    }

    /// The DeltaNet layers' shape.
    pub fn gdn(&self) -> gdn::Shape {
        gdn::Shape {
            kh: self.key_heads,
            vh: self.value_heads,
            dk: self.key_dim,
            dv: self.value_dim,
            kernel: self.conv_kernel,
        }
    }

    /// Floats of one DeltaNet layer's state: the recurrent matrix per value head and the convolution window.
    pub fn recurrent_state_floats(&self) -> usize {
        self.gdn().floats()
    }

    /// Floats of a sequence's per-sequence state: every DeltaNet layer's, then (with an MTP head) the final
    /// hidden state of its last position, which the head reads next.
    pub fn state_floats(&self) -> usize {
        self.hidden_offset() + if self.mtp { self.d_model } else { 0 }
    }

    /// Where the last hidden state sits in the per-sequence state (after the DeltaNet layers').
    pub fn hidden_offset(&self) -> usize {
        self.recurrent.iter().filter(|&&r| r).count() * self.recurrent_state_floats()
    }

    /// What the KV cache holds for this model: the attention layers' KV and the recurrent state.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            n_layers: self.recurrent.iter().filter(|&&r| !r).count() + usize::from(self.mtp),
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            recurrent: self.state_floats(),
        }
    }
}
