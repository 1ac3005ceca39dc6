//! `/v1/thorn/estop`: the e-stop latch over HTTP. `GET` shows it (`{"latched", "since", "by"}`); `POST`
//! with `{"latched": true | false}` latches or releases it, for operator keys only (a key file's
//! `"operator": true`, or a key given with `--api-key`), and with no keys configured for loopback
//! clients only (403 otherwise). The latch's record names who changed it: the key's id, or `loopback`.

use super::handler::{Caller, Checked};
use super::{ApiError, AppState};
use crate::auth::ApiKey;
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

/// `GET /v1/thorn/estop`.
pub(super) async fn estop(State(st): State<Arc<AppState>>, _caller: Caller) -> Response {
    Json(st.config.controls.estop.state()).into_response()
}

/// `POST /v1/thorn/estop`.
pub(super) async fn set_estop(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Checked(body): Checked<SetEstop>,
) -> Response {
    let right = "operate the e-stop (a key file gives that with \"operator\": true)";
    let by = match caller.admin(&st, ApiKey::may_operate, right) {
        Ok((by, _)) => by,
        Err(e) => return e.into_response(),
    };
    match st.config.controls.estop.set(body.latched, &by) {
        Ok(state) => Json(state).into_response(),
        // Latching took effect even so (fail closed); releasing did not.
        Err(e) => ApiError::Internal(format!("{e}")).into_response(),
    }
}
