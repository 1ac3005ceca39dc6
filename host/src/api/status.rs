//! The operator's routes: `GET /health` (open, for probes) and `GET /metrics` (Prometheus text; behind a
//! key allowed to read it when `metrics_auth` is on).
use super::handler::authorize;
use super::{ApiError, AppState, metrics, wire};
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// `GET /health`: the model, the queue, the plugins and each upstream's last health check.
pub(super) async fn health(State(st): State<Arc<AppState>>) -> Response {
    let e = st.agent.engine();
    let upstreams = st
        .upstreams
        .iter()
        .map(|u| {
            let h = u.health();
            wire::UpstreamHealth {
                name: u.name().to_owned(),
                up: h.up,
                error: h.error,
                circuit: u.circuit(),
                in_flight: u.stats().in_flight.load(Ordering::Relaxed),
                models: u.models(),
            }
        })
        .collect();
    Json(wire::Health {
        status: "ok",
        model: &st.agent.model().name,
        queue_depth: e.waiting(),
        busy: e.busy(),
        plugins: st.agent.plugins().plugins().len(),
        mcp_servers: st.agent.plugins().servers().len(),
        upstreams,
        estop: st.config.controls.estop.state(),
        approvals_pending: st.config.controls.approvals.list().len(),
    })
    .into_response()
}

/// `GET /metrics`.
pub(super) async fn metrics_text(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if st.config.metrics_auth {
        match authorize(&st, &headers) {
            Err(e) => return e.into_response(),
            Ok(Some(k)) if !k.may_read_metrics() => {
                return ApiError::Forbidden(format!(
                    "the API key {:?} may not read /metrics",
                    k.id()
                ))
                .into_response();
            }
            Ok(_) => {}
        }
    }
    let e = st.agent.engine();
    let mut text = st.metrics.render(&metrics::EngineGauges::of(e));
    metrics::render_upstreams(&st.upstreams, &mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}
