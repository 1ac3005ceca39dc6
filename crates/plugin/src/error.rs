//! The one error type of the sandbox: every way loading or calling a plugin (or an external MCP server) can
//! fail, with a short stable name per kind for the audit log and metrics.

use crate::{AuditError, CallerError, PolicyError};
use std::time::Duration;
use thiserror::Error;
use thorn_tools::ToolError;

/// What can go wrong loading or calling a plugin.
#[derive(Debug, Error)]
pub enum PluginError {
    /// Reading or compiling the component.
    #[error("plugin {path}: {msg}")]
    Load {
        /// The component file.
        path: String,
        /// What failed.
        msg: String,
    },
    /// `describe()` returned something that is not a valid manifest.
    #[error("plugin {path}: invalid manifest: {msg}")]
    Manifest {
        /// The component file.
        path: String,
        /// What is wrong.
        msg: String,
    },
    /// The plugin has no such function.
    #[error("plugin {plugin:?} has no function {function:?}")]
    UnknownFunction {
        /// The plugin.
        plugin: String,
        /// The function asked for.
        function: String,
    },
    /// Arguments that violate the function's schema (the plugin did not run).
    #[error(transparent)]
    Arguments(#[from] ToolError),
    /// The call ran past its time limit and was stopped.
    #[error("plugin {plugin:?} timed out after {after:?} and was stopped")]
    Timeout {
        /// The plugin.
        plugin: String,
        /// The limit.
        after: Duration,
    },
    /// The guest tried to grow its memory past the cap.
    #[error("plugin {plugin:?}: memory limit exceeded ({limit} bytes)")]
    MemoryLimit {
        /// The plugin.
        plugin: String,
        /// The cap.
        limit: usize,
    },
    /// The call used all its fuel.
    #[error("plugin {plugin:?} ran out of fuel ({fuel} units)")]
    Fuel {
        /// The plugin.
        plugin: String,
        /// The budget.
        fuel: u64,
    },
    /// The guest trapped (panic, stack overflow, ...).
    #[error("plugin {plugin:?} crashed: {trap}{}", stderr_suffix(.stderr))]
    Trap {
        /// The plugin.
        plugin: String,
        /// The trap, in words.
        trap: String,
        /// The tail of what the guest wrote to stderr (a panic message, say).
        stderr: String,
    },
    /// The result was larger than allowed or not valid JSON text.
    #[error("plugin {plugin:?} returned an unusable result: {msg}")]
    Output {
        /// The plugin.
        plugin: String,
        /// What is wrong.
        msg: String,
    },
    /// The tool ran and reported an error (for the model to read).
    #[error("{0}")]
    Tool(String),
    /// The operator's policy refuses the plugin.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// No slot freed up within the call's time limit.
    #[error(
        "plugin {plugin:?} is busy: no free slot within {after:?} ({limit} concurrent calls allowed)"
    )]
    Busy {
        /// The plugin.
        plugin: String,
        /// How long the call waited.
        after: Duration,
        /// Its concurrency limit.
        limit: usize,
    },
    /// The call could not be recorded: it did not run (intent), or its result is withheld (outcome).
    #[error(transparent)]
    Audit(#[from] AuditError),
    /// The caller's conversation id, key id or peer address is malformed (an API maps it to 400).
    #[error(transparent)]
    Caller(#[from] CallerError),
    /// The e-stop is latched and the function is neither a stop nor read-only (see [`crate::Estop`]).
    #[error(
        "the e-stop is latched: {plugin:?}'s {function:?} was not run (only stop and read-only functions run until it is released)"
    )]
    Estopped {
        /// The plugin (or MCP server).
        plugin: String,
        /// The function.
        function: String,
    },
    /// The call needed a person's approval and did not get it (denied, timed out, or its request went
    /// away; see [`crate::approval`]).
    #[error("{plugin:?}'s {function:?} was not run: denied by {by}{}", .reason.as_deref().map_or(String::new(), |r| format!(": {r}")))]
    Denied {
        /// The plugin (or MCP server).
        plugin: String,
        /// The function.
        function: String,
        /// Who denied it (an API key id, `timeout`, `cancelled`, ...).
        by: String,
        /// Why, if said.
        reason: Option<String>,
    },
    /// A motion ran longer than its deadman allows, or was abandoned; the host stopped it (see
    /// [`crate::deadman`]).
    #[error("{plugin:?}'s {function:?} was stopped by its deadman: {why}")]
    Deadman {
        /// The plugin.
        plugin: String,
        /// The function.
        function: String,
        /// Why, in words.
        why: String,
    },
    /// A rate limit or budget of the policy refused the call (see [`crate::rate`]).
    #[error("plugin {plugin:?}: rate limited: {msg}")]
    RateLimited {
        /// The plugin.
        plugin: String,
        /// The function.
        function: String,
        /// Which limit, in words.
        msg: String,
    },
    /// An external MCP server could not be started, or failed a call (exited, malformed JSON-RPC).
    #[error("MCP server {server:?}: {msg}")]
    Server {
        /// The server's name in the policy.
        server: String,
        /// What went wrong.
        msg: String,
    },
    /// The guest tried to hold more resources (open files, sockets, streams) than allowed at once.
    #[error("plugin {plugin:?}: resource limit exceeded ({limit} open handles)")]
    ResourceLimit {
        /// The plugin.
        plugin: String,
        /// The cap.
        limit: usize,
    },
}

impl PluginError {
    /// A short stable name for the kind of error (audit log, metrics).
    pub fn kind(&self) -> &'static str {
        match self {
            PluginError::Load { .. } => "load",
            PluginError::Manifest { .. } => "manifest",
            PluginError::UnknownFunction { .. } => "unknown_function",
            PluginError::Arguments(_) => "arguments",
            PluginError::Timeout { .. } => "timeout",
            PluginError::MemoryLimit { .. } => "memory_limit",
            PluginError::Fuel { .. } => "fuel",
            PluginError::Trap { .. } => "trap",
            PluginError::Output { .. } => "output",
            PluginError::Tool(_) => "tool",
            PluginError::Policy(_) => "policy",
            PluginError::Busy { .. } => "busy",
            PluginError::Audit(_) => "audit",
            PluginError::Caller(_) => "caller",
            PluginError::ResourceLimit { .. } => "resource_limit",
            PluginError::Server { .. } => "mcp_server",
            PluginError::Estopped { .. } => "estopped",
            PluginError::RateLimited { .. } => "rate_limited",
            PluginError::Denied { .. } => "denied",
            PluginError::Deadman { .. } => "deadman",
        }
    }
}

fn stderr_suffix(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!(" (stderr: {s})")
    }
}
