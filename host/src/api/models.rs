//! Which model serves a request: the local model, an upstream's (`NAME/MODEL`), or `auto` with
//! `--local-first`; the API key's upstream allow-list; and the model list (`GET /v1/models`).
use super::handler::Caller;
use super::{ApiError, AppState, wire};
use crate::agent::Route;
use crate::auth::ApiKey;
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

pub(super) fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    if let Some(m) = model.filter(|m| *m != st.agent.model().name) {
        let upstream = st.upstreams.resolve(m).ok().flatten();
        if let Some(t) = upstream {
            return Err(ApiError::bad(
                format!(
                    "{m:?} is served by upstream {}: this route serves the local model only (use /v1/chat/completions)",
                    t.upstream.name()
                ),
                Some("model"),
            ));
        }
    }
    check_model_name(&st.agent.model().name, model)
}

/// The name of the routed model alias (with `--local-first`).
pub const AUTO_MODEL: &str = "auto";

/// The engine a request's `model` (and `thorn_model_class`) names: the local model by its name; an
/// upstream's by `NAME/MODEL`, `NAME` or a bare id it lists; and with `--local-first`, `auto` (or no
/// model) is the local model spilling to that upstream, `thorn_model_class: "large"` its model.
pub(super) fn route_for(
    st: &AppState,
    model: Option<&str>,
    class: Option<&str>,
    key: Option<&ApiKey>,
) -> Result<Route, ApiError> {
    let route = route_by_name(st, model, class)?;
    let Some(k) = key else {
        return Ok(route);
    };
    Ok(match route {
        Route::LocalFirst(t) if !k.may_use_upstream(t.upstream.name()) => Route::Local,
        Route::Upstream(t) if !k.may_use_upstream(t.upstream.name()) => {
            return Err(ApiError::Forbidden(format!(
                "the API key {:?} may not use the upstream {:?}",
                k.id(),
                t.upstream.name()
            )));
        }
        r => r,
    })
}

pub(super) fn route_by_name(
    st: &AppState,
    model: Option<&str>,
    class: Option<&str>,
) -> Result<Route, ApiError> {
    let local = &st.agent.model().name;
    let model = model.filter(|m| !m.is_empty());
    let open = model.is_none_or(|m| m == AUTO_MODEL && st.upstreams.local_first().is_some());
    match class {
        None => {}
        Some("small" | "local") if open => return Ok(Route::Local),
        Some("large") if open => {
            return match st.upstreams.large() {
                Ok(Some(t)) => Ok(Route::Upstream(t)),
                Ok(None) => Err(ApiError::bad(
                    "`thorn_model_class: \"large\"` needs a --local-first upstream, and this server has none",
                    Some("thorn_model_class"),
                )),
                Err(e) => Err(ApiError::Upstream(e)),
            };
        }
        Some("small" | "local" | "large") => {
            return Err(ApiError::bad(
                "`thorn_model_class` applies when `model` is left open (absent or \"auto\")",
                Some("thorn_model_class"),
            ));
        }
        Some(other) => {
            return Err(ApiError::bad(
                format!("`thorn_model_class` is \"small\" or \"large\", not {other:?}"),
                Some("thorn_model_class"),
            ));
        }
    }
    if open {
        // An upstream that has listed no model yet cannot take overflow: the request stays local.
        return Ok(match st.upstreams.large() {
            Ok(Some(t)) => Route::LocalFirst(t),
            _ => Route::Local,
        });
    }
    let m = model.expect("not open");
    if m == local {
        return Ok(Route::Local);
    }
    match st.upstreams.resolve(m) {
        Ok(Some(t)) => Ok(Route::Upstream(t)),
        Ok(None) => Err(ApiError::ModelNotFound(m.to_owned())),
        Err(e) => Err(ApiError::Upstream(e)),
    }
}

pub(super) fn check_model_name(served: &str, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None | Some("") => Ok(()),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError::ModelNotFound(m.to_owned())),
    }
}

/// Every model a request may name: the local one, `auto` with `--local-first`, each upstream's as
/// `NAME/MODEL`.
pub(super) fn model_objects(st: &AppState) -> Vec<wire::ModelObject> {
    let object = |id: String, owned_by: &str, context_length| wire::ModelObject {
        id,
        object: "model".into(),
        created: st.started,
        owned_by: owned_by.to_owned(),
        context_length,
    };
    let mut all = vec![object(
        st.agent.model().name.clone(),
        "thorn",
        Some(st.agent.model().context),
    )];
    if st.upstreams.local_first().is_some() {
        all.push(object(AUTO_MODEL.to_owned(), "thorn", None));
    }
    for u in st.upstreams.iter() {
        for m in u.models() {
            all.push(object(format!("{}/{m}", u.name()), u.name(), None));
        }
    }
    all
}

/// `GET /v1/models`.
pub(super) async fn models(State(st): State<Arc<AppState>>, _: Caller) -> Response {
    Json(wire::ModelList {
        object: "list".into(),
        data: model_objects(&st),
    })
    .into_response()
}

/// `GET /v1/models/{id}`.
pub(super) async fn model(
    State(st): State<Arc<AppState>>,
    _: Caller,
    Path(id): Path<String>,
) -> Result<Json<wire::ModelObject>, ApiError> {
    model_objects(&st)
        .into_iter()
        .find(|m| m.id == id)
        .map(Json)
        .ok_or(ApiError::ModelNotFound(id))
}
