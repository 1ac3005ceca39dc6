//! Model architectures: one file per architecture, each a forward pass written against the backend API.
//!
//! * [`llama`]: the Llama family (SmolLM2, Llama 2/3, ...): GQA attention with normal RoPE, SwiGLU MLP.

pub mod llama;
pub mod qwen35;

use crate::gguf::GgufError;
use crate::quant::QuantError;
use thiserror::Error;

/// What can go wrong loading a model.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The file lacks a key or tensor, or has one of the wrong type.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A weight cannot be decoded.
    #[error(transparent)]
    Quant(#[from] QuantError),
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
