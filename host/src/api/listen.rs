//! The accept loop: HTTP/1.1 connections with limits on what a client can hold.
//!
//! `axum::serve` has no timers, so a client could open connections and never finish its headers
//! (slowloris), trickle a body forever, or open connections until the process runs out of descriptors and
//! `/health` stops answering. Here every resource a connection holds is bounded where it is spent:
//!
//! - **connections**: at most `max_connections` are served at once; further ones wait in the kernel's
//!   backlog until a slot frees (accepting them would spend a descriptor each);
//! - **headers**: a connection that has not sent a whole request head within `header_timeout` (from the
//!   moment it connects or its previous response ended) is closed, so idle and slowloris connections free
//!   their slot;
//! - **bodies**: a body must arrive whole within `body_timeout`, and all bodies being read at once hold at
//!   most `max_inflight_body` bytes together (see `api::read_body`), so stalled uploads cannot pile up
//!   memory; beyond it requests get 503;
//! - **responses**: a response must start within `request_timeout` (when set), else 504 and the request
//!   is cancelled (a streamed response starts as soon as its request is admitted).
//!
//! - **TLS** (with `--tls-cert`): the handshake is bounded by `header_timeout` too, and the certificate is
//!   asked for on every handshake (a SIGHUP reload serves the next connection).
//!
//! Each request carries its peer address ([`Peer`]) for the audit log. On SIGINT or SIGTERM the loop stops
//! as [`shutdown`](super::shutdown) describes.

use super::AppState;
use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tower::ServiceExt;

/// Limits on connections and request transfer (`thorn serve` flags).
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Most connections served at once.
    pub max_connections: usize,
    /// Time a connection has to send a request's headers.
    pub header_timeout: Duration,
    /// Time a request has to send its whole body.
    pub body_timeout: Duration,
    /// Bytes of request bodies being read at once, all connections together.
    pub max_inflight_body: usize,
    /// Time until a response starts (`None`: no limit).
    pub request_timeout: Option<Duration>,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_inflight_body: 256 << 20,
            request_timeout: None,
        }
    }
}

/// The client's address, as a request extension.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub SocketAddr);

/// Serves `router` on `listener` with `limits` until `signal` resolves, then stops as
/// [`shutdown`](super::shutdown) says: no new connections, idle ones closed, running requests given
/// `grace` to finish before `stop` cuts them (a second `signal` cuts at once).
pub async fn serve_with<S, F>(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: &HttpLimits,
    tls: Option<&Arc<thorn_plugin::tls::ServerCert>>,
    stop: &super::shutdown::Shutdown,
    grace: Duration,
    signal: S,
) -> std::io::Result<()>
where
    S: Fn() -> F,
    F: std::future::Future<Output = ()>,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // The configuration asks for the certificate on every handshake: a reload serves the next connection.
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(c.server_config()));
    let first = signal();
    tokio::pin!(first);
    loop {
        let slot = tokio::select! {
            s = Arc::clone(&slots).acquire_owned() => s.expect("the semaphore is never closed"),
            () = &mut first => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: wait a little, go on.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut first => break,
        };
        let _ = stream.set_nodelay(true);
        let app = router.clone();
        let deadline = limits.request_timeout;
        let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(Peer(peer));
            let app = app.clone();
            async move {
                let call = app.oneshot(req.map(Body::new));
                let r = match deadline {
                    Some(d) => match tokio::time::timeout(d, call).await {
                        Ok(r) => r,
                        Err(_) => Ok(timed_out()),
                    },
                    None => call.await,
                };
                r.map_err(|e| match e {})
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_buf_size(64 << 10);
        let watcher = graceful.watcher();
        let (acceptor, handshake) = (acceptor.clone(), limits.header_timeout);
        tokio::spawn(async move {
            let served = match acceptor {
                None => {
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    watcher.watch(conn).await
                }
                // The handshake is bounded as the headers are: a client that stalls it frees its slot.
                Some(acceptor) => {
                    match tokio::time::timeout(handshake, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let conn = builder.serve_connection(TokioIo::new(tls), service);
                            watcher.watch(conn).await
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, %peer, "TLS handshake failed");
                            Ok(())
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            Ok(())
                        }
                    }
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    let running = stop.running();
    tracing::info!(
        target: "thorn::status",
        "shutting down: no new connections; {running} request(s) running get {} s to finish",
        grace.as_secs_f64()
    );
    let drained = graceful.shutdown();
    tokio::pin!(drained);
    let cut_now = tokio::select! {
        () = &mut drained => false,
        () = tokio::time::sleep(grace) => true,
        () = signal() => true,
    };
    if cut_now {
        let cut = stop.running();
        stop.cut();
        tracing::warn!(
            target: "thorn::status",
            "shutting down: cut {cut} request(s) still running (each gets a shutting_down error)"
        );
        // Long enough for the cut streams to write their last events, and for the cut work to end
        // (a call it abandons is audited as cancelled).
        let settled = async {
            drained.await;
            while stop.running() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), settled).await;
    }
    tracing::info!(target: "thorn::status", "stopped");
    Ok(())
}

fn timed_out() -> Response<Body> {
    let body = serde_json::json!({"error": {"message": "the response did not start within the server's request timeout",
        "type": "server_error", "param": null, "code": "timeout"}});
    Response::builder()
        .status(StatusCode::GATEWAY_TIMEOUT)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("a static response is valid")
}

/// Serves `state`'s router with its limits until SIGINT or SIGTERM, then stops with its grace.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>) -> std::io::Result<()> {
    let limits = state.config.http.clone();
    let grace = state.config.shutdown_grace;
    serve_with(
        listener,
        super::router(Arc::clone(&state)),
        &limits,
        state.config.tls.as_ref(),
        &state.shutdown,
        grace,
        super::shutdown::signalled,
    )
    .await
}
