//! The crate-wide error: one variant per stage of the data path. Each stage has its own typed error; the HTTP
//! layer (later) maps this enum, once, to OpenAI-style error bodies.

use thiserror::Error;

/// Any error thorn's library can return.
#[derive(Debug, Error)]
pub enum Error {
    /// Reading a model file.
    #[error(transparent)]
    Gguf(#[from] thorn_engine::gguf::GgufError),
    /// Decoding quantized data.
    #[error(transparent)]
    Quant(#[from] thorn_engine::quant::QuantError),
    /// Building or running the tokenizer.
    #[error(transparent)]
    Tokenizer(#[from] thorn_engine::tokenizer::TokenizerError),
    /// Rendering a chat template.
    #[error(transparent)]
    Template(#[from] thorn_tools::chat::TemplateError),
    /// Fetching or finding a model.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// Loading or running a model.
    #[error(transparent)]
    Model(#[from] thorn_engine::model::ModelError),
    /// Serving a generation request.
    #[error(transparent)]
    Engine(#[from] thorn_engine::engine::EngineError),
    /// A tool definition or call.
    #[error(transparent)]
    Tool(#[from] thorn_tools::ToolError),
    /// A device that cannot be used.
    #[error(transparent)]
    Device(#[from] thorn_engine::backend::DeviceError),
}
