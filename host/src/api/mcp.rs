//! `/mcp`: thorn's sandboxed tools over MCP's Streamable HTTP transport, on the same port and under the
//! same API keys as the OpenAI routes.
//!
//! The protocol is `rmcp`'s [`StreamableHttpService`] serving [`McpTools`]; this module puts thorn's
//! rules in front of it:
//! - **Keys.** With keys configured, every `/mcp` request needs `Authorization: Bearer <key>` (401
//!   otherwise, before rmcp sees it). The key travels to the handler as an [`McpIdentity`] in the
//!   request's extensions, so a key's tool allow-list limits what `tools/list` shows and what
//!   `tools/call` runs, and the audit log names the key and the client's address.
//! - **DNS rebinding.** The `Host` header must name an allowed host (loopback by default:
//!   `--mcp-allowed-host` adds the names a remote client uses) and a request that carries an `Origin`
//!   header (a browser's) is refused unless that origin is allowed (`--mcp-allowed-origin`; none by
//!   default). Both answer 403.
//! - **Bounds.** A POST's body is read here as the chat routes read theirs (`--max-body`, the body
//!   timeout, the budget shared by all bodies in flight) before rmcp parses it; at most `max_sessions`
//!   sessions (the 2025 revisions keep one per client) live at once, at most `max_sessions_per_key` of
//!   them for one API key and `max_sessions_per_peer` for one client address (so one client cannot lock
//!   the others out); a new one past a bound is a 429 with `Retry-After`, and an idle session is dropped
//!   after five minutes.

use super::listen::Peer;
use super::{ApiError, AppState};
use crate::auth::ApiKey;
use crate::mcp::{McpIdentity, McpTools};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use std::collections::HashMap;
use std::sync::Arc;
use thorn_plugin::Caller;

/// How `/mcp` is served.
#[derive(Debug, Clone)]
pub struct McpHttp {
    /// Whether `/mcp` is served at all.
    pub enabled: bool,
    /// Hosts (`name` or `name:port`) a request's `Host` header may name (empty: loopback only).
    pub allowed_hosts: Vec<String>,
    /// Browser origins (`scheme://host:port`, `:*` for any port) allowed to call; none: a request with
    /// an `Origin` header is refused.
    pub allowed_origins: Vec<String>,
    /// Most live sessions.
    pub max_sessions: usize,
    /// Most live sessions of one API key.
    pub max_sessions_per_key: usize,
    /// Most live sessions of one client address.
    pub max_sessions_per_peer: usize,
}

impl Default for McpHttp {
    fn default() -> Self {
        McpHttp {
            enabled: true,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            max_sessions: 256,
            max_sessions_per_key: 32,
            max_sessions_per_peer: 16,
        }
    }
}

/// The hosts allowed when none are configured.
const LOOPBACK: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// What the guard in front of rmcp needs.
#[derive(Clone)]
struct Guard {
    state: Arc<AppState>,
    sessions: Arc<LocalSessionManager>,
    /// Who opened each session (its key and address), and a lock that makes opening one (the bound
    /// checked, the session made, its owner noted) one step.
    owners: Arc<tokio::sync::Mutex<HashMap<String, Owner>>>,
}

/// Who opened a session.
#[derive(Debug, Clone, PartialEq)]
struct Owner {
    key: Option<String>,
    peer: Option<std::net::IpAddr>,
}

/// The `/mcp` route over `state` (nothing when it is disabled).
pub(super) fn routes(state: &Arc<AppState>) -> Router {
    let cfg = &state.config.mcp;
    if !cfg.enabled {
        return Router::new();
    }
    let mut http = StreamableHttpServerConfig::default()
        .with_max_request_body_bytes(state.config.max_body)
        .enforce_origin_validation()
        .with_allowed_origins(cfg.allowed_origins.iter().cloned());
    http = if cfg.allowed_hosts.is_empty() {
        http.with_allowed_hosts(LOOPBACK)
    } else {
        http.with_allowed_hosts(cfg.allowed_hosts.iter().cloned())
    };
    let sessions = Arc::new(LocalSessionManager::default());
    let live = Arc::clone(state.agent.live_plugins());
    let caller = Caller {
        conversation: Some("mcp".into()),
        key_id: None,
        peer: None,
        request: None,
    };
    let service = StreamableHttpService::new(
        move || Ok(McpTools::new(Arc::clone(&live), caller.clone())),
        Arc::clone(&sessions),
        http,
    );
    let guard = Guard {
        state: Arc::clone(state),
        sessions,
        owners: Arc::default(),
    };
    Router::new()
        .route_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(guard, admit))
}

/// Checks the key and the session bound, reads a POST's body under the server's body limits (size,
/// time, the budget shared by all bodies in flight), then hands the request to rmcp with its
/// [`McpIdentity`].
async fn admit(State(g): State<Guard>, req: Request<Body>, next: Next) -> Response {
    let key: Option<ApiKey> = match super::handler::authorize(&g.state, req.headers()) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let (mut parts, body) = req.into_parts();
    let peer_addr = parts.extensions.get::<Peer>().map(|Peer(p)| *p);
    let owner = Owner {
        key: key.as_ref().map(|k| k.id().to_owned()),
        peer: peer_addr.map(|p| p.ip()),
    };
    let mut held = None;
    // A POST without a session opens one: its body read, it holds the owners' lock until the session
    // exists (so the bounds hold under concurrent opens).
    let mut opening = None;
    let body = if parts.method == axum::http::Method::POST {
        let new = !parts.headers.contains_key("mcp-session-id");
        if new {
            let live = g.sessions.sessions.read().await.len();
            if live >= g.state.config.mcp.max_sessions {
                return ApiError::Busy(format!("{live} MCP sessions are open")).into_response();
            }
        }
        let body = match super::handler::read_body(&g.state, &parts.headers, body).await {
            Ok((bytes, permit)) => {
                held = Some(permit);
                Body::from(bytes)
            }
            Err(e) => return e.into_response(),
        };
        if new {
            let owners = Arc::clone(&g.owners).lock_owned().await;
            match admit_session(&g, owners, &owner).await {
                Ok(o) => opening = Some(o),
                Err(e) => return e.into_response(),
            }
        }
        body
    } else {
        body
    };
    parts.extensions.insert(McpIdentity {
        key,
        peer: peer_addr.map(|p| p.to_string()),
    });
    let response = next.run(Request::from_parts(parts, body)).await;
    if let (Some(mut owners), Some(id)) = (
        opening,
        response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok()),
    ) {
        owners.insert(id.to_owned(), owner);
    }
    drop(held);
    response
}

/// Checks the session bounds for a new session of `owner` (pruning the owners of sessions that ended),
/// keeping the lock for the caller to note the new session's owner.
async fn admit_session(
    g: &Guard,
    mut owners: tokio::sync::OwnedMutexGuard<HashMap<String, Owner>>,
    owner: &Owner,
) -> Result<tokio::sync::OwnedMutexGuard<HashMap<String, Owner>>, ApiError> {
    let cfg = &g.state.config.mcp;
    let live = g.sessions.sessions.read().await;
    if live.len() >= cfg.max_sessions {
        return Err(ApiError::Busy(format!(
            "{} MCP sessions are open",
            live.len()
        )));
    }
    owners.retain(|id, _| live.contains_key(id.as_str()));
    drop(live);
    if let Some(k) = &owner.key {
        let n = owners
            .values()
            .filter(|o| o.key.as_ref() == Some(k))
            .count();
        if n >= cfg.max_sessions_per_key {
            return Err(ApiError::Busy(format!(
                "this API key has {n} MCP sessions open (at most {})",
                cfg.max_sessions_per_key
            )));
        }
    }
    if let Some(p) = owner.peer {
        let n = owners.values().filter(|o| o.peer == Some(p)).count();
        if n >= cfg.max_sessions_per_peer {
            return Err(ApiError::Busy(format!(
                "this address has {n} MCP sessions open (at most {})",
                cfg.max_sessions_per_peer
            )));
        }
    }
    Ok(owners)
}
