//! `/v1/thorn/approvals`: the calls waiting for a person's approval, and their decisions.
//!
//! - `GET /v1/thorn/approvals` -> `{"object": "list", "data": [{"id", "plugin", "function", "arguments",
//!   "key_id", "conversation", "request", "created_at", "expires_at"}, ...]}`, oldest first;
//! - `GET /v1/thorn/approvals/ID` -> one of them (404 once it is decided or timed out);
//! - `POST /v1/thorn/approvals/ID` with `{"decision": "approve" | "deny", "reason": "..."}` decides it
//!   (`{"id", "decision", "by", "call": {...}}`); 404 when it no longer waits.
//!
//! Only keys with the `approve` right (a key file's `"approve": true`, or a key given with `--api-key`)
//! use these routes, and with no keys configured only loopback clients (403 otherwise). A request's own
//! key may not approve its calls unless the policy's `approve_own` says so (403), though it may deny
//! them. The decision is in the audit log with the decider's key id (`loopback` without keys).

use super::handler::{Caller, Checked};
use super::{ApiError, AppState};
use crate::auth::ApiKey;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use thorn_plugin::{Approver, DecideError};

/// `POST /v1/thorn/approvals/ID`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Decide {
    decision: Decision,
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Decision {
    Approve,
    Deny,
}

/// The longest reason kept, in bytes (it goes into the audit log and back to the model).
const MAX_REASON_BYTES: usize = 512;

const RIGHT: &str = "decide approvals (a key file gives that with \"approve\": true)";

fn approver(st: &AppState, caller: &Caller) -> Result<Approver, ApiError> {
    let (name, key_id) = caller.admin(st, ApiKey::may_approve, RIGHT)?;
    Ok(Approver { name, key_id })
}

/// `GET /v1/thorn/approvals`.
pub(super) async fn list(State(st): State<Arc<AppState>>, caller: Caller) -> Response {
    if let Err(e) = approver(&st, &caller) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": st.config.controls.approvals.list()})).into_response()
}

/// `GET /v1/thorn/approvals/ID`.
pub(super) async fn get_one(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = approver(&st, &caller) {
        return e.into_response();
    }
    match st.config.controls.approvals.get(&id) {
        Some(p) => Json(p).into_response(),
        None => ApiError::NotFound(DecideError::Unknown(id).to_string()).into_response(),
    }
}

/// `POST /v1/thorn/approvals/ID`.
pub(super) async fn decide(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Path(id): Path<String>,
    Checked(body): Checked<Decide>,
) -> Response {
    let by = match approver(&st, &caller) {
        Ok(by) => by,
        Err(e) => return e.into_response(),
    };
    let reason = body.reason.map(|r| {
        let mut end = r.len().min(MAX_REASON_BYTES);
        while !r.is_char_boundary(end) {
            end -= 1;
        }
        r[..end].to_owned()
    });
    let approve = body.decision == Decision::Approve;
    match st
        .config
        .controls
        .approvals
        .decide(&id, approve, &by, reason)
    {
        Ok(call) => Json(json!({
            "id": id,
            "decision": if approve { "approve" } else { "deny" },
            "by": by.name,
            "call": call,
        }))
        .into_response(),
        Err(e @ DecideError::Unknown(_)) => ApiError::NotFound(e.to_string()).into_response(),
        Err(e @ DecideError::OwnCall { .. }) => ApiError::Forbidden(e.to_string()).into_response(),
    }
}
