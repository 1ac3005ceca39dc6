//! External MCP servers as host tools: the ones the operator's policy names, and only the tools it
//! allows.
//!
//! An external server is a process thorn starts and speaks MCP to over its stdin and stdout, or a server
//! already running that thorn reaches over Streamable HTTP with a bearer token (`rmcp`'s client). It
//! runs **outside** the wasm sandbox (a started one with this process's rights), so it is used only when
//! the policy names it (`mcp_servers`); a started one gets an environment of only PATH, the variables
//! the policy sets and those it passes on by name. It is listed as unsandboxed wherever plugins are
//! listed. What
//! thorn does bound is everything that crosses to it and back:
//! - **Names.** Each allowed tool is the host tool `<server>_<tool>`. The policy's server names have no
//!   `_`, so a prefix is one server; a name that clashes with another tool (a plugin's, another
//!   server's) is refused when the set loads, and nothing shadows anything.
//! - **Schemas.** A tool's `inputSchema` is its parameters: it must be a valid JSON schema the tool set
//!   accepts and the decoding grammar can take ([`crate::PluginSet::load_checked`]; else that tool is
//!   refused, with why), it constrains decoding like a plugin's, and every call is validated against it
//!   before it is sent. Tools, descriptions (at most 2 KiB each) and schemas are read once, when the set
//!   loads: a server that changes them later is not followed.
//! - **Time.** Starting the server (again, after it went away) and listing its tools are bounded by the
//!   entry's `startup_timeout_ms`, each call by its `timeout_ms`; a call past it is abandoned (the
//!   request is cancelled on the server) and is a `timeout` error. A server that hangs costs its callers
//!   that long, never the whole host.
//! - **Size.** A result larger than `max_output_kib` is refused (`output`), and a line (HTTP: a body or
//!   an event) from the server past a bound a little above that is dropped by the transport unread, so a huge or endless reply
//!   cannot make thorn buffer it. A result is the tool's `structuredContent`, or its text blocks as
//!   `{"text": ...}`: data for the model, never control tokens.
//! - **Concurrency.** At most `max_concurrent` calls in flight; more wait within their time limit.
//! - **Failure.** A server that exits or speaks malformed JSON-RPC fails the calls it was serving with a
//!   typed error; the next call starts it again.
//! - **Audit.** Calls are recorded exactly as plugin calls are (intent before it is sent, outcome
//!   after), with the entry's digest as `plugin_sha256`.

use super::{
    Annotations, AuditLog, CallReport, Caller, FunctionDef, Manifest, PluginError, ServerSpec,
    ServerTransport, trail,
};
use rmcp::model::{CallToolRequestParams, Tool};
use rmcp::service::{RoleClient, RunningService, ServiceExt};
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use thorn_tools::ToolSet;
use tokio::io::AsyncBufReadExt;
use tokio::sync::{Mutex, Semaphore};

/// Longest tool description kept, in bytes (it goes into every prompt that shows the tool).
const MAX_DESCRIPTION: usize = 2048;

/// A running session with the server and the process behind it (killed when dropped).
struct Session {
    service: RunningService<RoleClient, ()>,
    child: Option<tokio::process::Child>,
}

/// One external MCP server, connected, with the tools of it that may be used.
pub struct McpServer {
    spec: ServerSpec,
    manifest: Manifest,
    tools: ToolSet,
    /// Host tool name -> the server's own name.
    remote: HashMap<String, String>,
    session: Mutex<Option<Session>>,
    slots: Semaphore,
    audit: Option<Arc<AuditLog>>,
    /// The process's e-stop latch: while it is latched no call goes out (a server outside the sandbox
    /// promises nothing about what its tools do).
    estop: Option<Arc<crate::Estop>>,
    approvals: Option<Arc<crate::Approvals>>,
    refused: Vec<String>,
    /// The runtime its session's tasks run on (kept alive while it is), for blocking calls.
    runtime: Option<(tokio::runtime::Handle, Arc<crate::sandbox::Shared>)>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.spec.name)
            .field("tools", &self.remote.len())
            .finish_non_exhaustive()
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let end = (0..=max)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    s[..end].to_owned()
}

impl McpServer {
    /// Starts the server `spec` describes, lists its tools and keeps those the policy allows (each
    /// refusal of one tool is kept in [`McpServer::refused`]; the server still serves the others). A
    /// server that cannot be started or listed in time is an error.
    pub async fn connect(spec: ServerSpec) -> Result<Self, PluginError> {
        let session = start(&spec).await?;
        let listed = tokio::time::timeout(spec.startup, session.service.peer().list_all_tools())
            .await
            .map_err(|_| {
                server_error(
                    &spec,
                    format!("listing its tools took over {:?}", spec.startup),
                )
            })?
            .map_err(|e| server_error(&spec, format!("listing its tools failed: {e}")))?;
        let mut functions = Vec::new();
        let mut remote = HashMap::new();
        let mut refused = Vec::new();
        let mut defs = Vec::new();
        if let Some(allowed) = &spec.tools {
            for a in allowed {
                if !listed.iter().any(|t| t.name == *a) {
                    refused.push(format!(
                        "{a:?} is allowed by the policy but the server does not list it"
                    ));
                }
            }
        }
        for t in &listed {
            if spec
                .tools
                .as_ref()
                .is_some_and(|a| !a.iter().any(|n| *n == t.name))
            {
                continue;
            }
            match function_of(&spec.name, t) {
                Ok((f, def)) => {
                    if remote.contains_key(&f.name) {
                        refused.push(format!("{:?} is listed twice", t.name));
                        continue;
                    }
                    remote.insert(f.name.clone(), t.name.to_string());
                    functions.push(f);
                    defs.push(def);
                }
                Err(why) => refused.push(format!("{:?}: {why}", t.name)),
            }
        }
        let tools = ToolSet::new(&defs).map_err(|e| server_error(&spec, e.to_string()))?;
        let manifest = Manifest {
            name: spec.name.clone(),
            version: session
                .service
                .peer_info()
                .and_then(|i| i.server_info.as_ref().map(|s| s.version.clone()))
                .unwrap_or_default(),
            description: format!("external MCP server {} (not sandboxed)", spec.name),
            functions,
            capabilities: Value::Null,
        };
        Ok(McpServer {
            slots: Semaphore::new(spec.max_concurrent),
            spec,
            manifest,
            tools,
            remote,
            session: Mutex::new(Some(session)),
            audit: None,
            estop: None,
            approvals: None,
            refused,
            runtime: None,
        })
    }

    /// Starts the server on `host`'s runtime (see [`McpServer::connect`]), from synchronous code.
    pub fn connect_on(host: &super::PluginHost, spec: ServerSpec) -> Result<Self, PluginError> {
        let (server, runtime) = host.block_on(Self::connect(spec));
        server.map(|mut s| {
            s.runtime = Some((host.handle.clone(), runtime));
            s
        })
    }

    /// [`McpServer::call_async`], blocking: on the runtime its session runs on (so a restart's session
    /// outlives the call), else on a runtime of its own, never on the caller's.
    pub fn call_blocking(
        &self,
        caller: &Caller,
        function: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        let call = self.call_async(caller, function, args);
        match &self.runtime {
            Some((handle, _)) => crate::sandbox::block_on(handle, call),
            None => std::thread::scope(|scope| {
                scope
                    .spawn(|| {
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .map_or_else(
                                |e| (Err(self.error(e.to_string())), CallReport::default()),
                                |rt| rt.block_on(call),
                            )
                    })
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p))
            }),
        }
    }

    /// Keeps only the host tools named in `names` (the others clashed with tools loaded before).
    pub fn keep_only(mut self, names: &[String]) -> Self {
        if names.len() == self.remote.len() {
            return self;
        }
        self.remote.retain(|k, _| names.contains(k));
        self.manifest.functions.retain(|f| names.contains(&f.name));
        let defs: Vec<Value> = self
            .tools
            .definitions()
            .iter()
            .filter(|d| {
                d["function"]["name"]
                    .as_str()
                    .is_some_and(|n| names.iter().any(|k| k == n))
            })
            .cloned()
            .collect();
        if let Ok(t) = ToolSet::new(&defs) {
            self.tools = t;
        }
        self
    }

    /// Records every call in `log` from now on.
    pub fn with_audit(mut self, log: Arc<AuditLog>) -> Self {
        self.audit = Some(log);
        self
    }

    /// Whether it records its calls in `log` (the same handle).
    pub fn audit_is(&self, log: Option<&Arc<AuditLog>>) -> bool {
        match (&self.audit, log) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }

    /// Ends the session; a started server is killed (it runs outside the sandbox, and a tool stuck in
    /// it would otherwise outlive thorn). A later call starts it again.
    pub async fn shutdown(&self) {
        if let Some(mut s) = self.session.lock().await.take()
            && let Some(child) = s.child.as_mut()
        {
            let _ = child.start_kill();
        }
    }

    /// Its name in the policy.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Its tools, as a manifest (names prefixed, schemas as the server gave them).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Its tools as a tool set.
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// How it is started and bounded.
    pub fn spec(&self) -> &ServerSpec {
        &self.spec
    }

    /// The tools of it that were refused, and why.
    pub fn refused(&self) -> &[String] {
        &self.refused
    }

    /// Calls host tool `function` with `args` for `caller`: validation, the intent record, a slot, the
    /// call under the time limit, the outcome record (the same trail as a plugin call).
    pub async fn call_async(
        &self,
        caller: &Caller,
        function: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        let callee = trail::Callee {
            name: &self.spec.name,
            sha256: &self.spec.sha256,
            audit_arguments: self.spec.audit_arguments,
        };
        let admit = || self.admit_call(function, args);
        let rule = &self.spec.approval;
        let no_estop = crate::Estop::in_memory();
        let gate = match (
            &self.approvals,
            self.manifest.functions.iter().find(|f| f.name == function),
        ) {
            (Some(approvals), Some(f)) if rule.applies_to(f) => Some(trail::Gate {
                approvals,
                rule,
                estop: self.estop.as_deref().unwrap_or(&no_estop),
            }),
            _ => None,
        };
        let run = |remote: String| async move {
            let remote = remote.as_str();
            let out = self.send(remote, args).await;
            let bytes = out.as_ref().map_or(0, |v| v.to_string().len());
            (out, bytes, CallReport::default())
        };
        trail::audited(
            self.audit.as_deref(),
            callee,
            caller,
            function,
            args,
            admit,
            gate,
            run,
        )
        .await
    }

    /// Holds the calls the policy's approval rule names in `approvals` until a person decides.
    pub fn with_approvals(mut self, approvals: Arc<crate::Approvals>) -> Self {
        self.approvals = Some(approvals);
        self
    }

    /// Refuses every call while `estop` is latched.
    pub fn with_estop(mut self, estop: Arc<crate::Estop>) -> Self {
        self.estop = Some(estop);
        self
    }

    /// The server's name for `function`, once the e-stop lets it out and the arguments satisfy its schema.
    fn admit_call(&self, function: &str, args: &Value) -> Result<String, PluginError> {
        if self.estop.as_ref().is_some_and(|e| e.latched()) {
            return Err(PluginError::Estopped {
                plugin: self.spec.name.clone(),
                function: function.to_owned(),
            });
        }
        let remote = self
            .remote
            .get(function)
            .ok_or_else(|| PluginError::UnknownFunction {
                plugin: self.spec.name.clone(),
                function: function.to_owned(),
            })?;
        self.tools.check(&thorn_tools::ParsedCall {
            name: function.to_owned(),
            arguments: args.clone(),
        })?;
        Ok(remote.clone())
    }

    /// Sends one call and reads its result: a slot within the call's time limit, the server (started
    /// again within its start-up limit if it went away), then the call within the time limit.
    async fn send(&self, remote: &str, args: &Value) -> Result<Value, PluginError> {
        let limit = self.spec.timeout;
        let _slot = match tokio::time::timeout(limit, self.slots.acquire()).await {
            Ok(Ok(permit)) => permit,
            _ => {
                return Err(PluginError::Busy {
                    plugin: self.spec.name.clone(),
                    after: limit,
                    limit: self.spec.max_concurrent,
                });
            }
        };
        let peer = self.peer().await?;
        let mut params = CallToolRequestParams::new(remote.to_owned());
        params.arguments = args.as_object().cloned();
        match tokio::time::timeout(limit, peer.call_tool(params)).await {
            Ok(r) => self.result_of(r.map_err(|e| self.error(format!("the call failed: {e}")))?),
            Err(_) => Err(PluginError::Timeout {
                plugin: self.spec.name.clone(),
                after: limit,
            }),
        }
    }

    /// A live peer: the current session's, or a new session's when the server went away.
    async fn peer(&self) -> Result<rmcp::service::Peer<RoleClient>, PluginError> {
        let mut s = self.session.lock().await;
        if let Some(live) = s.as_ref()
            && !live.service.peer().is_transport_closed()
        {
            return Ok(live.service.peer().clone());
        }
        *s = None;
        let fresh = start(&self.spec).await?;
        let peer = fresh.service.peer().clone();
        *s = Some(fresh);
        Ok(peer)
    }

    /// A tool result as the value the model reads, within the size limit.
    fn result_of(&self, r: rmcp::model::CallToolResult) -> Result<Value, PluginError> {
        let text = || {
            r.content
                .iter()
                .filter_map(|c| c.as_text().map(|t| t.text.as_str()))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let max = self.spec.max_output;
        if r.is_error == Some(true) {
            return Err(PluginError::Tool(clip(&text(), max)));
        }
        let value = match &r.structured_content {
            Some(v) => v.clone(),
            None => serde_json::json!({ "text": text() }),
        };
        let size = value.to_string().len();
        if size > max {
            return Err(PluginError::Output {
                plugin: self.spec.name.clone(),
                msg: format!("{size} bytes, more than the limit of {max}"),
            });
        }
        Ok(value)
    }

    fn error(&self, msg: String) -> PluginError {
        server_error(&self.spec, msg)
    }
}

fn server_error(spec: &ServerSpec, msg: String) -> PluginError {
    PluginError::Server {
        server: spec.name.clone(),
        msg,
    }
}

/// Reaches the server (starting its process, for stdio) and runs the MCP handshake, within the entry's
/// time limit.
async fn start(spec: &ServerSpec) -> Result<Session, PluginError> {
    // A line (or response body, or SSE event) past this is dropped unread: a result over `max_output`
    // is refused anyway, and JSON escaping plus `content` repeating `structuredContent` can triple a
    // result's size on the wire.
    let max_line = spec.max_output.saturating_mul(4).saturating_add(64 << 10);
    let (service, child) = match &spec.transport {
        ServerTransport::Stdio {
            program,
            args,
            cwd,
            env,
        } => {
            let mut cmd = tokio::process::Command::new(program);
            cmd.args(args)
                .env_clear()
                .envs(env.iter().map(|(k, v)| (k, v)))
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true);
            if let Some(dir) = cwd {
                cmd.current_dir(dir);
            }
            let mut child = cmd.spawn().map_err(|e| {
                server_error(spec, format!("cannot start {}: {e}", program.display()))
            })?;
            let (Some(stdout), Some(stdin), Some(stderr)) =
                (child.stdout.take(), child.stdin.take(), child.stderr.take())
            else {
                return Err(server_error(spec, "its stdio could not be piped".into()));
            };
            // Its stderr goes to the log, a bounded line at a time.
            let name = spec.name.clone();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::info!(server = %name, "{}", clip(&line, 1024));
                }
            });
            let transport =
                AsyncRwTransport::new_client(stdout, stdin).with_max_line_length(max_line);
            (handshake(spec, ().serve(transport)).await?, Some(child))
        }
        ServerTransport::Http { url, bearer } => {
            let mut cfg = StreamableHttpClientTransportConfig::with_uri(url.as_str());
            cfg.max_json_response_size = max_line;
            cfg.max_sse_event_size = max_line;
            if let Some(token) = bearer {
                cfg = cfg.auth_header(token.clone());
            }
            // The process's TLS (system roots plus --tls-ca) for an https:// server.
            let client = crate::tls::http_client()
                .build()
                .map_err(|e| server_error(spec, format!("building its HTTP client: {e}")))?;
            let transport = StreamableHttpClientTransport::with_client(client, cfg);
            (handshake(spec, ().serve(transport)).await?, None)
        }
    };
    Ok(Session { service, child })
}

/// The handshake `serving` does, within the entry's time limit.
async fn handshake<E: std::fmt::Display>(
    spec: &ServerSpec,
    serving: impl std::future::Future<Output = Result<RunningService<RoleClient, ()>, E>>,
) -> Result<RunningService<RoleClient, ()>, PluginError> {
    tokio::time::timeout(spec.startup, serving)
        .await
        .map_err(|_| server_error(spec, format!("it did not start within {:?}", spec.startup)))?
        .map_err(|e| server_error(spec, format!("the MCP handshake failed: {e}")))
}

/// An MCP tool as a host function of server `server`, and its tool-set definition.
fn function_of(server: &str, t: &Tool) -> Result<(FunctionDef, Value), String> {
    let name = format!("{server}_{}", t.name);
    if name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "its host name {name:?} is not 1 to 64 of A-Z a-z 0-9 _ -"
        ));
    }
    let parameters = Value::Object((*t.input_schema).clone());
    let description = clip(t.description.as_deref().unwrap_or(""), MAX_DESCRIPTION);
    let annotations = t
        .annotations
        .as_ref()
        .map_or_else(Annotations::default, |a| Annotations {
            read_only: a.read_only_hint,
            destructive: a.destructive_hint,
            idempotent: a.idempotent_hint,
            open_world: a.open_world_hint,
        });
    let f = FunctionDef {
        name,
        description,
        parameters,
        returns: t
            .output_schema
            .as_ref()
            .map(|s| Value::Object((**s).clone())),
        examples: Vec::new(),
        answer: None,
        from_request: Vec::new(),
        // A server outside the sandbox cannot promise to stop anything.
        stop: false,
        deadman: None,
        annotations,
    };
    let def = crate::manifest::tool_definition(&f);
    // Each tool on its own first, so one bad schema refuses one tool, not the server.
    ToolSet::new(std::slice::from_ref(&def)).map_err(|e| format!("unusable schema: {e}"))?;
    Ok((f, def))
}
