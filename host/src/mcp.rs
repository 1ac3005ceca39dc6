//! thorn as an MCP server: every admitted plugin function is an MCP tool.
//!
//! `thorn mcp` serves the Model Context Protocol over stdio (newline-delimited JSON-RPC, for desktop
//! agents that start their tools as child processes), with the `rmcp` SDK doing the protocol (its
//! supported revisions, 2025-11-25 and 2026-07-28 included). Each function of each plugin the operator's
//! policy admits is one tool:
//! - `inputSchema` is the function's `parameters`, `outputSchema` its `returns` (when it is an object
//!   schema), the description its own, and `annotations` the manifest's hints (`readOnlyHint`,
//!   `destructiveHint`, `idempotentHint`, `openWorldHint`: the robot arm's moves are destructive);
//! - a call runs exactly as a host tool call from the agent does: [`PluginSet::call_async`] validates
//!   the arguments against the schema (a violation never reaches the plugin), runs the plugin in its
//!   sandbox under its grant and limits, and writes the audit log's intent record before it acts, with
//!   the caller named `mcp` in the log;
//! - a plugin's own failure (its error, a trap, a timeout, bad arguments) is a tool result with
//!   `isError: true` and the message, which is what MCP clients show the model; an unknown tool is a
//!   protocol error.
//!
//! Results are the plugin's JSON: `structuredContent`, and the same JSON as one text block for clients
//! that read only text.

use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    InitializeResult, JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities,
    ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::Value;
use std::sync::Arc;
use thorn_plugin::{Caller, PluginSet};

/// The MCP tools of a plugin set, and how a call is made.
#[derive(Clone)]
pub struct McpTools {
    plugins: Arc<PluginSet>,
    caller: Caller,
}

impl std::fmt::Debug for McpTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpTools")
            .field("plugins", &self.plugins.plugins().len())
            .finish()
    }
}

impl McpTools {
    /// Serves `plugins`' functions; calls are audited as `caller`'s.
    pub fn new(plugins: Arc<PluginSet>, caller: Caller) -> Self {
        McpTools { plugins, caller }
    }

    /// Every function as an MCP tool, in the plugin set's order.
    pub fn tools(&self) -> Vec<Tool> {
        let mut out = Vec::new();
        for p in self.plugins.plugins() {
            for f in &p.manifest().functions {
                let object = |v: &Value| v.as_object().cloned().map(Arc::new);
                let input = object(&f.parameters).unwrap_or_default();
                let mut tool = Tool::new(f.name.clone(), f.description.clone(), input);
                tool.output_schema = f
                    .returns
                    .as_ref()
                    .filter(|r| r["type"] == "object")
                    .and_then(object);
                let a = &f.annotations;
                if !a.is_empty() {
                    let mut hints = ToolAnnotations::new();
                    if let Some(v) = a.read_only {
                        hints = hints.read_only(v);
                    }
                    if let Some(v) = a.destructive {
                        hints = hints.destructive(v);
                    }
                    if let Some(v) = a.idempotent {
                        hints = hints.idempotent(v);
                    }
                    if let Some(v) = a.open_world {
                        hints = hints.open_world(v);
                    }
                    tool.annotations = Some(hints);
                }
                out.push(tool);
            }
        }
        out
    }

    /// Runs tool `name` on `arguments` (`None`: no arguments) as a host call: `None` when no plugin has
    /// it, else its result, or its failure as an error result.
    pub async fn call(&self, name: &str, arguments: Option<JsonObject>) -> Option<CallToolResult> {
        self.plugins.plugin_for(name)?;
        let args = Value::Object(arguments.unwrap_or_default());
        let (result, _) = self.plugins.call_async(&self.caller, name, &args).await;
        Some(match result {
            Ok(v) => {
                let mut r = CallToolResult::success(vec![ContentBlock::text(v.to_string())]);
                // Structured content is an object in MCP; other JSON results are text only.
                if v.is_object() {
                    r.structured_content = Some(v);
                }
                r
            }
            Err(e) => CallToolResult::error(vec![ContentBlock::text(e.to_string())]),
        })
    }
}

impl ServerHandler for McpTools {
    fn get_info(&self) -> ServerConfig {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("thorn", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "thorn's sandboxed WebAssembly tools. Each call is validated against the tool's \
                 schema, runs under the operator's policy and is audited.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, rmcp::ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, rmcp::ErrorData> {
        match self.call(&request.name, request.arguments).await {
            Some(r) => Ok(r.into()),
            None => Err(rmcp::ErrorData::invalid_params(
                format!("no tool is called {:?}", request.name),
                None,
            )),
        }
    }
}
