//! OpenAI's chat and completions wire format: one set of types for every side of it.
//!
//! thorn speaks OpenAI's format three times: its server reads requests and writes answers and stream
//! chunks, its upstream client writes requests and reads another server's chunks, and its benchmark
//! client does the same against any OpenAI-compatible endpoint. All three use these types, so a field
//! added here reaches each of them, and the compiler finds every place that builds one.
//!
//! - Writing borrows: strings are [`Cow`](std::borrow::Cow)s, so the server serializes a chunk straight
//!   from the text it generated and the upstream client a round's request straight from the conversation.
//!   Fields serialize in OpenAI's order; optional fields the server always sends are `Some`.
//! - Reading owns (`T<'static>`) and is lenient where servers differ and strict where they do not: an
//!   unknown field is ignored (as OpenAI does), `null` reads as absent, a tool call's `arguments` may be
//!   JSON text or the object itself, `reasoning` is read beside `reasoning_content`; a known field of the
//!   wrong type is an error that names it (with `serde_path_to_error`).
//! - Domain conversions (the agent's messages and outcomes, sampling) live with the code that owns those
//!   types; this crate knows only the wire.
//!
//! thorn's extensions are fields of the same types, named `thorn_*` (or documented as thorn's): clients
//! that do not know them ignore them.

mod lenient;
mod request;
mod response;

pub use request::{
    ChatRequest, CompletionRequest, Content, Function, Message, Part, Prompt, Stop, StreamOptions,
    ToolAnswers, ToolCall, ToolRouting, ToolUseOpts,
};
pub use response::{
    ApprovalPending, AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatLogprobs,
    ChunkChoice, Delta, ErrorDetail, ErrorResponse, FunctionDelta, HostCall, LegacyLogprobs,
    ModelList, ModelObject, PromptDetails, TextChoice, TextCompletion, TokenLogprob, ToolCallDelta,
    TopLogprob, Usage,
};

#[cfg(test)]
mod tests;
