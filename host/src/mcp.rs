//! thorn as an MCP server: every admitted plugin function is an MCP tool.
//!
//! `thorn mcp` serves the Model Context Protocol over stdio (newline-delimited JSON-RPC, for desktop
//! agents that start their tools as child processes) and `thorn serve` over Streamable HTTP at `/mcp`
//! ([`crate::api::mcp`]: the same API keys, Host and Origin checks), with the `rmcp` SDK doing the protocol
//! (its supported revisions, 2025-11-25 and 2026-07-28 included). Each function of each plugin the
//! operator's policy admits is one tool:
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
//!
//! Over HTTP, the request's API key (put in the request's extensions by the API layer as an
//! [`McpIdentity`]) limits what is listed and what may be called, exactly as for host tools in a chat
//! request: a tool outside the key's allow-list is not listed, and calling it is a protocol error that
//! names the key. The caller in the audit log is the key's id and the client's address.
//!
//! A call the policy holds for approval is put to the client's user through **elicitation** when the
//! client supports it (the 2025 revisions' `elicitation/create`, sent while the call waits): accepting
//! with `approve: true` approves it, anything else denies it. The decision is taken under the client's
//! key like any other, so with keys it counts only where the policy lets a request's own key approve
//! (`approve_own`); otherwise the call waits for an approving key through the admin API. A client that
//! cancels the call withdraws it (denied), and a motion it cancels is stopped.
//!
//! The tool list follows the served plugin set ([`LiveSet`]): when the operator installs or approves a
//! plugin while thorn runs, every session is told with `notifications/tools/list_changed`, over the
//! session's stream for the 2025 revisions and over `subscriptions/listen` for 2026-07-28.

pub mod stdio;

use crate::auth::ApiKey;
use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ElicitRequestParams,
    ElicitationAction, ElicitationSchema, Implementation, InitializeResult, JsonObject,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, SubscriptionFilter,
    Tool, ToolAnnotations,
};
use rmcp::service::{NotificationContext, Peer, RequestContext, RoleServer, SubscriptionContext};
use serde_json::Value;
use std::sync::Arc;
use thorn_plugin::{Approvals, Approver, Caller, LiveSet, Pending, PluginError, PluginSet};

/// Who an HTTP request is: its API key (none when the server has no keys) and address. The API layer
/// puts it in the request's extensions; rmcp hands them to the handler.
#[derive(Debug, Clone, Default)]
pub struct McpIdentity {
    /// The key the request presented.
    pub key: Option<ApiKey>,
    /// The client's address.
    pub peer: Option<String>,
}

/// The MCP tools of the served plugin set, and how a call is made.
#[derive(Clone)]
pub struct McpTools {
    plugins: Arc<LiveSet>,
    caller: Caller,
}

impl std::fmt::Debug for McpTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpTools")
            .field("plugins", &self.plugins.current().plugins().len())
            .finish()
    }
}

/// The identity an HTTP request carried, if it came over HTTP.
fn identity(ext: &rmcp::model::Extensions) -> Option<&McpIdentity> {
    ext.get::<axum::http::request::Parts>()
        .and_then(|p| p.extensions.get::<McpIdentity>())
}

impl McpTools {
    /// Serves `plugins`' functions; calls are audited as `caller`'s (over HTTP, with the request's key
    /// id and address in place of `caller`'s).
    pub fn new(plugins: Arc<LiveSet>, caller: Caller) -> Self {
        McpTools { plugins, caller }
    }

    /// Every function `key` may use as an MCP tool, in the plugin set's order.
    pub fn tools(&self, key: Option<&ApiKey>) -> Vec<Tool> {
        let set = self.plugins.current();
        let mut out = Vec::new();
        for p in set.plugins() {
            for f in &p.manifest().functions {
                if key.is_some_and(|k| !k.may_use(p.name(), &f.name)) {
                    continue;
                }
                out.push(tool_of(f));
            }
        }
        out
    }

    /// Runs tool `name` on `arguments` (`None`: no arguments) as a host call for `who` (`None`: this
    /// server's own caller): its result, or its failure as an error result; `Err` when there is no such
    /// tool or `who`'s key may not use it.
    pub async fn call(
        &self,
        name: &str,
        arguments: Option<JsonObject>,
        who: Option<&McpIdentity>,
    ) -> Result<CallToolResult, rmcp::ErrorData> {
        self.call_for(name, arguments, who, None, std::future::pending())
            .await
    }

    /// [`McpTools::call`] from a client session: a held call is put to `peer`'s user (when it supports
    /// elicitation), and `cancelled` resolving withdraws the call (see the module docs).
    async fn call_for(
        &self,
        name: &str,
        arguments: Option<JsonObject>,
        who: Option<&McpIdentity>,
        peer: Option<Peer<RoleServer>>,
        cancelled: impl std::future::Future<Output = ()>,
    ) -> Result<CallToolResult, rmcp::ErrorData> {
        let set: Arc<PluginSet> = self.plugins.current();
        let Some(plugin) = set.plugin_for(name) else {
            return Err(rmcp::ErrorData::invalid_params(
                format!("no tool is called {name:?}"),
                None,
            ));
        };
        let key = who.and_then(|w| w.key.as_ref());
        if let Some(k) = key.filter(|k| !k.may_use(plugin.name(), name)) {
            return Err(rmcp::ErrorData::invalid_params(
                format!("API key {:?} may not use the tool {name:?}", k.id()),
                None,
            ));
        }
        let mut caller = self.caller.clone();
        if let Some(w) = who {
            caller.key_id = key.map(|k| k.id().to_owned());
            caller.peer = w.peer.clone().or(caller.peer);
        }
        let args = Value::Object(arguments.unwrap_or_default());
        let request = thorn_tools::call_id().replacen("call_", "req_", 1);
        caller.request = Some(request.clone());
        let result = match set.approvals() {
            None => set.call_async(&caller, name, &args).await.0,
            Some(approvals) => {
                let elicit = peer.filter(|p| {
                    p.peer_info()
                        .is_some_and(|i| i.capabilities.elicitation.is_some())
                });
                let held = Held {
                    approvals,
                    request: &request,
                    caller: &caller,
                    motion: set.is_motion(name),
                };
                held.run(set.call_async(&caller, name, &args), elicit, cancelled)
                    .await
            }
        };
        Ok(match result {
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

/// A call that may be held for approval, run for an MCP client.
struct Held<'a> {
    approvals: &'a std::sync::Arc<Approvals>,
    request: &'a str,
    caller: &'a Caller,
    motion: bool,
}

impl Held<'_> {
    /// Runs `call`, asking `elicit`'s user to decide when it is held, until it ends; `cancelled`
    /// withdraws it (a held call ends denied, a motion is abandoned and stopped).
    async fn run(
        &self,
        call: impl std::future::Future<Output = (Result<Value, PluginError>, thorn_plugin::CallReport)>,
        elicit: Option<Peer<RoleServer>>,
        cancelled: impl std::future::Future<Output = ()>,
    ) -> Result<Value, PluginError> {
        let mut watch = self.approvals.watch(self.request);
        tokio::pin!(call);
        tokio::pin!(cancelled);
        let mut live = true;
        loop {
            tokio::select! {
                out = &mut call => return out.0,
                Some(p) = watch.next() => {
                    let Some(peer) = &elicit else { continue };
                    if !self.approvals.may_approve(&p.id, self.caller.key_id.as_deref()) {
                        continue;
                    }
                    tokio::select! {
                        out = &mut call => return out.0,
                        () = self.ask(peer, &p) => {}
                    }
                }
                () = &mut cancelled, if live => {
                    live = false;
                    let undecided = self.approvals.waiting_for(self.request);
                    self.approvals.withdraw(self.request);
                    if self.motion && !undecided {
                        return Err(PluginError::Deadman {
                            plugin: String::new(),
                            function: String::new(),
                            why: "the MCP client cancelled the call".into(),
                        });
                    }
                }
            }
        }
    }

    /// Asks `peer`'s user whether the held call `p` may run, and decides it by the answer (an
    /// elicitation that fails or is not answered decides nothing: the call waits on).
    async fn ask(&self, peer: &Peer<RoleServer>, p: &Pending) {
        let schema: ElicitationSchema = match serde_json::from_value(serde_json::json!({
            "type": "object",
            "properties": {"approve": {"type": "boolean", "title": "Approve",
                "description": "Let this call run"}},
            "required": ["approve"]
        })) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "the approval form does not parse");
                return;
            }
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let left = std::time::Duration::from_secs(p.expires_at.saturating_sub(now).max(1));
        let message = format!(
            "thorn holds a tool call for your approval: {}.{}({}). It is denied in {} s unless approved.",
            p.plugin,
            p.function,
            p.arguments,
            left.as_secs()
        );
        let params = ElicitRequestParams::FormElicitationParams {
            meta: None,
            message,
            requested_schema: schema,
        };
        let answer = match peer
            .create_elicitation_with_timeout(params, Some(left))
            .await
        {
            Ok(a) => a,
            Err(e) => {
                tracing::info!(approval = %p.id, error = %e, "no answer by elicitation; the call waits on");
                return;
            }
        };
        let approve = answer.action == ElicitationAction::Accept
            && answer
                .content
                .as_ref()
                .and_then(|c| c.get("approve"))
                .and_then(Value::as_bool)
                == Some(true);
        let by = Approver {
            name: self
                .caller
                .key_id
                .clone()
                .unwrap_or_else(|| "mcp-elicitation".into()),
            key_id: self.caller.key_id.clone(),
        };
        let reason = (!approve).then(|| "the MCP client's user declined it".to_owned());
        if let Err(e) = self.approvals.decide(&p.id, approve, &by, reason) {
            tracing::info!(approval = %p.id, error = %e, "the elicitation's answer was not taken");
        }
    }
}

/// One plugin function as an MCP tool.
fn tool_of(f: &thorn_plugin::FunctionDef) -> Tool {
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
    tool
}

impl ServerHandler for McpTools {
    fn get_info(&self) -> ServerConfig {
        InitializeResult::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_tool_list_changed()
                .build(),
        )
        .with_server_info(Implementation::new("thorn", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "thorn's sandboxed WebAssembly tools. Each call is validated against the tool's \
             schema, runs under the operator's policy and is audited.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, rmcp::ErrorData> {
        let key = identity(&context.extensions).and_then(|w| w.key.as_ref());
        Ok(ListToolsResult::with_all_items(self.tools(key)))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, rmcp::ErrorData> {
        let who = identity(&context.extensions);
        let ct = context.ct.clone();
        self.call_for(
            &request.name,
            request.arguments,
            who,
            Some(context.peer.clone()),
            async move { ct.cancelled().await },
        )
        .await
        .map(Into::into)
    }

    /// The 2025 revisions: a session is told of each change on its own stream until it goes away.
    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        let mut changes = self.plugins.subscribe();
        changes.mark_unchanged();
        let peer = context.peer;
        tokio::spawn(async move {
            // Checked now and then too, so a session that went away without a change since does not
            // keep its watcher.
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(30));
            loop {
                tokio::select! {
                    changed = changes.changed() => {
                        if changed.is_err() || peer.notify_tool_list_changed().await.is_err() {
                            return;
                        }
                    }
                    _ = tick.tick() => {
                        if peer.is_transport_closed() {
                            return;
                        }
                    }
                }
            }
        });
    }

    /// 2026-07-28: `subscriptions/listen` for `tools_list_changed` is honoured.
    fn accepted_subscription_filter(
        &self,
        requested: &SubscriptionFilter,
    ) -> Option<SubscriptionFilter> {
        let mut accepted = SubscriptionFilter::new();
        accepted.tools_list_changed = requested.tools_list_changed;
        Some(accepted)
    }

    async fn listen(&self, context: SubscriptionContext) -> Result<(), rmcp::ErrorData> {
        let mut changes = self.plugins.subscribe();
        changes.mark_unchanged();
        loop {
            tokio::select! {
                () = context.cancelled() => return Ok(()),
                changed = changes.changed() => {
                    if changed.is_err() || context.sink().notify_tool_list_changed().await.is_err() {
                        return Ok(());
                    }
                }
            }
        }
    }
}
