//! # thorn-guide
//!
//! Tool grammars compiled for decoding: the seam between the tool layer and the engine. `thorn-tools` says
//! what a request's output must look like as data (a Lark grammar and when it applies, see
//! `thorn_tools::grammar::guide_spec`); the engine compiles grammars and runs guides without knowing tools.
//! [`ToolGrammars`] compiles the one with the other's grammar factory and, when a tool set's grammar does
//! not compile, searches the tools for the one to blame.

mod compile;

pub use compile::{GuideError, ToolGrammarError, ToolGrammars, shown_controls};
