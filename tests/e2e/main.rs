//! thorn's end-to-end tests: one binary, one module per concept. They run against the real default model
//! (pulled by `thorn model pull`) and the committed test data in tests/data.

mod approvals;
mod bfcl;
mod chat_template;
mod deadman;
mod engine;
mod hybrid;
mod mcp;
mod model_file;
mod plugins;
mod safety;
mod server;
mod spec;
mod terminal;
mod tokenizer;
mod tool_calls;
mod upstream;
