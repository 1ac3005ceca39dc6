//! # thorn-engine
//!
//! thorn's inference engine: everything between token ids and logits, and back to tokens. It knows nothing of
//! HTTP, chat templates, tools or plugins; those crates sit above it and the compiler keeps them there (this
//! crate depends on no async runtime, web framework, wasm runtime or JSON-schema validator).
//!
//! The modules, bottom of the data path first:
//!
//! * [`quant`]: the weight and KV number formats, each with a scalar reference kernel (the test oracle).
//! * [`gguf`]: a memory-mapped GGUF v2/v3 reader that treats its input as hostile.
//! * [`tokenizer`]: byte-level BPE built from the GGUF vocabulary, special-token parsing, data quoting and an
//!   incremental detokenizer for streaming.
//! * [`kv`]: the paged KV cache, the radix tree of cached prefixes and recurrent-state snapshots.
//! * [`backend`]: devices and their kernels (CPU: thread pool + runtime-dispatched SIMD; CUDA).
//! * [`model`]: one file per architecture, written against the backend.
//! * [`sample`]: sampling, and the llguidance grammar seam (`response_format` and tool-call grammars are
//!   built above, by `thorn-tools`, and handed in as a [`sample::guide::Guide`]).
//! * [`spec`]: speculative decoding: suffix and grammar drafts, draft trees sized by measured cost, exact
//!   verification.
//! * [`engine`]: the model with its KV cache, the continuous-batching [`engine::scheduler`], the per-request
//!   [`engine::Decoder`] and [`engine::service`], which puts it all on its own thread behind a bounded queue.
//!
//! `unsafe` is denied at the root and allowed only in `backend` (each block with a `// SAFETY:` note) and in
//! the one audited file mapping (`gguf::map_readonly`).
#![deny(unsafe_code)]

pub mod backend;
pub mod engine;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod quant;
pub mod sample;
pub mod spec;
pub mod tokenizer;

#[cfg(test)]
mod testutil;

pub use engine::{Engine, EngineConfig, EngineError, FinishReason, Generation, Request};

/// thorn's cache directory (models, data, compiled kernels): `$THORN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/thorn`, else `~/.cache/thorn` (empty variables count as unset); `None` without any.
/// The host's `--cache-dir` flag overrides it there.
pub fn cache_dir() -> Option<std::path::PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
    };
    env("THORN_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("thorn")))
        .or_else(|| env("HOME").map(|p| p.join(".cache").join("thorn")))
}
