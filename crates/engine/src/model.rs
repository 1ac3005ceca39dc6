//! Model architectures: one file per architecture, each a forward pass written against the backend API.
//!
//! * [`llama`]: the Llama family (SmolLM2, Llama 2/3, ...): GQA attention with normal RoPE, SwiGLU MLP.
//! * [`qwen35`]: Qwen3.5/3.6 hybrids: Gated DeltaNet layers with recurrent state, gated attention.
//!
//! [`Model`] is what the engine holds: one of them, behind the calls a forward pass needs.

pub mod layers;
pub mod llama;
pub mod logits;
pub mod qwen35;

pub use logits::{BestLogit, Candidates, LogitRows};

use crate::backend::{Device, DeviceError};
use crate::gguf::{Gguf, GgufError};
use crate::kv::{Batch, KvShape, PagePool, Recurrent};
use crate::quant::QuantError;
use std::sync::Arc;
use thiserror::Error;

/// A loaded model of any supported architecture.
#[derive(Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "an engine holds exactly one model; its size is irrelevant"
)]
pub enum Model {
    /// A Llama-family transformer.
    Llama(llama::Llama),
    /// A Qwen3.5/3.6 hybrid.
    Qwen35(qwen35::Qwen35),
}

/// Per-forward buffers of whichever model runs.
#[derive(Debug, Default)]
pub struct Scratch {
    /// The Llama forward's (and the per-stage profile).
    pub llama: llama::Scratch,
    /// The hybrid forward's.
    pub qwen35: qwen35::Scratch,
}

impl Model {
    /// Loads the model of a GGUF by its architecture, its weights in `dev`'s layout.
    pub fn from_gguf(gguf: Arc<Gguf>, dev: &Device) -> Result<Self, ModelError> {
        match gguf.architecture()? {
            "qwen35" => Ok(Model::Qwen35(qwen35::Qwen35::from_gguf(&gguf, dev)?)),
            _ => Ok(Model::Llama(llama::Llama::load(gguf, dev)?)),
        }
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        match self {
            Model::Llama(m) => m.config().vocab,
            Model::Qwen35(m) => m.config().vocab,
        }
    }

    /// Training context.
    pub fn ctx_train(&self) -> usize {
        match self {
            Model::Llama(m) => m.config().ctx_train,
            Model::Qwen35(m) => m.config().ctx_train,
        }
    }

    /// What the KV cache holds per position and per sequence.
    pub fn kv_shape(&self) -> KvShape {
        match self {
            Model::Llama(m) => m.kv_shape(),
            Model::Qwen35(m) => m.config().kv_shape(),
        }
    }

    /// Whether sequences carry recurrent state (speculation then verifies chains, not trees).
    pub fn is_hybrid(&self) -> bool {
        matches!(self, Model::Qwen35(_))
    }

    /// Bytes of weights one forward pass reads.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Model::Llama(m) => m.weight_bytes(),
            Model::Qwen35(m) => m.weight_bytes(),
        }
    }

    /// Sets the arithmetic of the forward pass (the hybrid has one: f32 or the stored quantized weights).
    pub fn set_precision(&mut self, p: llama::Precision) {
        if let Model::Llama(m) = self {
            m.set_precision(p);
        }
    }

    /// Whether the model has a multi-token-prediction head (it drafts the token after the next).
    pub fn has_mtp(&self) -> bool {
        matches!(self, Model::Qwen35(m) if m.has_mtp())
    }

    /// The MTP head's logits for the token after `batch`'s one token per sequence (`vocab` per sequence;
    /// none for a model without a head). See [`qwen35::Qwen35::mtp_draft`].
    pub fn mtp_draft<'s>(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &mut Batch,
        states: &[Recurrent],
        s: &'s mut Scratch,
    ) -> Result<&'s mut [f32], ModelError> {
        let r = match self {
            Model::Llama(_) => Ok(&mut [][..]),
            Model::Qwen35(m) => m.mtp_draft(dev, pool, batch, states, &mut s.qwen35),
        };
        // The host reads the KV pages next: nothing may still be queued.
        dev.finish();
        r
    }

    /// Runs `batch`; `states` holds one recurrent state per sequence for hybrids (ignored otherwise).
    /// Returns the logits rows the batch wants, read back as far as the caller reads them.
    pub fn forward<'s>(
        &self,
        dev: &Device,
        pool: &mut PagePool,
        batch: &Batch,
        states: &mut [Recurrent],
        s: &'s mut Scratch,
    ) -> Result<LogitRows<'s>, ModelError> {
        let r = match self {
            Model::Llama(m) => m.pass(dev, pool, batch, &mut s.llama),
            Model::Qwen35(m) => m.pass(dev, pool, batch, states, &mut s.qwen35),
        };
        // The host reads the KV pages next: nothing may still be queued.
        dev.finish();
        r
    }
}

/// What can go wrong loading a model.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The file lacks a key or tensor, or has one of the wrong type.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A weight cannot be decoded.
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// The device cannot hold a weight or run an op.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// An architecture or feature thorn does not run.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// Tensor shapes that contradict the hyperparameters.
    #[error("tensor {name}: shape {got:?}, expected {want:?}")]
    Shape {
        /// Tensor.
        name: String,
        /// Found.
        got: Vec<u64>,
        /// Expected.
        want: Vec<u64>,
    },
}
