//! `/v1/thorn/estop`: the e-stop latch over HTTP. `GET` shows it (`{"latched", "since", "by"}`); `POST`
//! with `{"latched": true | false}` latches or releases it, for operator keys only (a key file's
//! `"operator": true`, or a key given with `--api-key`), and with no keys configured for loopback
//! clients only (403 otherwise). The latch's record names who changed it: the key's id, or `loopback`.

use super::handler::{Caller, Checked};
use super::{ApiError, AppState};
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use std::sync::Arc;

/// `POST /v1/thorn/estop`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SetEstop {
    latched: bool,
}

/// Who may operate the latch: an operator key, or with no keys a loopback client. Returns the name the
/// latch's record gives them.
fn operator(st: &AppState, caller: &Caller) -> Result<String, ApiError> {
    match &caller.key {
        Some(k) if k.may_operate() => Ok(k.id().to_owned()),
        Some(k) => Err(ApiError::Forbidden(format!(
            "key {:?} may not operate the e-stop (a key file gives that with \"operator\": true)",
            k.id()
        ))),
        None if st.config.keys.is_empty() && caller.peer.is_none_or(|p| p.ip().is_loopback()) => {
            Ok("loopback".into())
        }
        None => Err(ApiError::Forbidden(
            "with no API keys configured, only a loopback client may operate the e-stop".into(),
        )),
    }
}

/// `GET /v1/thorn/estop`.
pub(super) async fn estop(State(st): State<Arc<AppState>>, _caller: Caller) -> Response {
    Json(st.config.estop.state()).into_response()
}

/// `POST /v1/thorn/estop`.
pub(super) async fn set_estop(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Checked(body): Checked<SetEstop>,
) -> Response {
    let by = match operator(&st, &caller) {
        Ok(by) => by,
        Err(e) => return e.into_response(),
    };
    match st.config.estop.set(body.latched, &by) {
        Ok(state) => Json(state).into_response(),
        // Latching took effect even so (fail closed); releasing did not.
        Err(e) => ApiError::Internal(format!("{e}")).into_response(),
    }
}
