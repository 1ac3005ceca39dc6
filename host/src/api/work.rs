//! A request's run: the agent's work spawned on a task of its own (so a dropped response cancels it),
//! its events forwarded to the handler, the first one awaited before a response starts (so a request
//! that cannot start still gets its status), and the finished request's numbers in the metrics.

use super::{ApiError, AppState};
use crate::agent::{AgentError, Event, Finish, Outcome, StreamedCalls, Turn};
use axum::response::sse::Event as SseEvent;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::sync::mpsc;

/// Sets the flag when dropped: a response that is dropped before it ends cancels its request.
pub(super) struct CancelOnDrop(pub(super) Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The error a streamed response ends with when its calls were not the ones returned (the grammar makes
/// that a bug, never a model's slip): clients must not take the deltas sent as the answer.
pub(super) fn stream_error(out: &Outcome) -> Option<ApiError> {
    match &out.streamed {
        StreamedCalls::Mismatch(why) => {
            Some(ApiError::Internal(format!("streamed tool calls: {why}")))
        }
        _ => None,
    }
}

/// Updates the metrics with a finished request. Time to first token runs from the request's arrival to its
/// first sampled token of any kind (text or a tool call), so replies that are tool calls count too.
pub(super) fn account(st: &AppState, out: &Outcome, t0: Instant) {
    st.metrics.tokens(&out.usage);
    if let Some(u) = &out.served.upstream {
        st.metrics.routed(u, out.served.spilled.unwrap_or("model"));
    }
    for h in &out.host_calls {
        st.metrics
            .plugin_call(&h.call.function.name, h.error_kind.unwrap_or("ok"));
    }
    if let Some(f) = out.first_token {
        st.metrics
            .ttft(f.saturating_duration_since(t0).as_secs_f64());
        if out.usage.completion_tokens > 1 {
            st.metrics
                .tpot(f.elapsed().as_secs_f64() / (out.usage.completion_tokens - 1) as f64);
        }
    }
}

/// A request's work (a chat turn or a completion): runs on a task of its own, sends its events, and
/// returns its outcome, which [`spawn`] sends last.
pub(super) type Work = Box<
    dyn FnOnce(
            Arc<AppState>,
            Arc<AtomicBool>,
            mpsc::UnboundedSender<Msg>,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Outcome, ApiError>> + Send>,
        > + Send,
>;

pub(super) enum Msg {
    Event(Event),
    Done(Box<Result<Outcome, ApiError>>),
}

/// Starts `work` on a task of its own: the first message is either `Started` or the error that kept it
/// from starting, the last its outcome. The request counts as running (for the shutdown) until then, and
/// its outcome goes into its access log line.
pub(super) fn spawn(
    st: &Arc<AppState>,
    work: Work,
) -> (mpsc::UnboundedReceiver<Msg>, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let running = st.shutdown.enter();
    let access = super::access::current();
    if let Some(a) = &access {
        a.work();
    }
    let fut = work(Arc::clone(st), Arc::clone(&cancel), tx.clone());
    // The work runs in the request's span.
    let span = tracing::Span::current();
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            let out = fut.await;
            if let Some(a) = access {
                a.outcome(&out);
            }
            drop(running);
            let _ = tx.send(Msg::Done(Box::new(out)));
        },
        span,
    ));
    (rx, cancel)
}

/// Counts a request its client abandoned (whoever was reading its events may be gone).
pub(super) fn note_cancel(st: &AppState, out: &Result<Outcome, AgentError>) {
    if out.as_ref().is_ok_and(|o| o.finish == Finish::Cancelled) {
        st.metrics.cancelled();
    }
}

pub(super) fn chat_work(turn: Turn) -> Work {
    Box::new(move |st, cancel, tx| {
        Box::pin(async move {
            let out = st
                .agent
                .run(turn, cancel, &mut |e| {
                    let _ = tx.send(Msg::Event(e));
                })
                .await;
            note_cancel(&st, &out);
            out.map_err(ApiError::from)
        })
    })
}

pub(super) fn completion_work(prompt: String, turn: Turn) -> Work {
    Box::new(move |st, cancel, tx| {
        Box::pin(async move {
            let out = st
                .agent
                .complete(prompt, &turn, cancel, &mut |e| {
                    let _ = tx.send(Msg::Event(e));
                })
                .await;
            note_cancel(&st, &out);
            out.map_err(ApiError::from)
        })
    })
}

/// What a request's work said first: it started (with the model serving it), or it already ended.
pub(super) enum Early {
    /// It started: its first events follow.
    Started(String),
    /// It ended before it started streaming.
    Done(Box<Outcome>),
}

impl Early {
    /// The outcome, if it already ended.
    pub(super) fn outcome(self) -> Option<Outcome> {
        match self {
            Early::Done(o) => Some(*o),
            Early::Started(_) => None,
        }
    }

    /// The model serving the request (as the response names it), and the outcome if it already ended.
    pub(super) fn split(self, st: &AppState) -> (String, Option<Outcome>) {
        match self {
            Early::Started(m) if m.is_empty() => (st.agent.model().name.clone(), None),
            Early::Started(m) => (m, None),
            Early::Done(o) => (o.served.model.clone(), Some(*o)),
        }
    }
}

/// The work's next message while the client reads the stream, `None` once it is gone (hyper drops the
/// response of a client that went away, and with it the stream's receiver): the forwarding task then
/// returns and drops the request's [`CancelOnDrop`]. So a client that leaves while nothing is written
/// (a call waiting for approval, a long motion) cancels its request at once, not at the next event.
/// When the shutdown cuts the request, its outcome is [`ApiError::ShuttingDown`]: the stream ends with
/// that error (and the work, its [`CancelOnDrop`] dropped, is cancelled).
pub(super) async fn next_msg<T>(
    st: &AppState,
    rx: &mut mpsc::UnboundedReceiver<Msg>,
    tx: &mpsc::Sender<T>,
) -> Option<Option<Msg>> {
    tokio::select! {
        m = rx.recv() => Some(m),
        () = tx.closed() => None,
        () = st.shutdown.cut_off() => Some(Some(cut())),
    }
}

/// What a request the shutdown cut ends with.
fn cut() -> Msg {
    Msg::Done(Box::new(Err(ApiError::ShuttingDown)))
}

/// The work's next message, or [`cut`] when the shutdown cuts it.
async fn recv(st: &AppState, rx: &mut mpsc::UnboundedReceiver<Msg>) -> Option<Msg> {
    tokio::select! {
        m = rx.recv() => m,
        () = st.shutdown.cut_off() => Some(cut()),
    }
}

/// Waits for the work to start, or the error that stopped it.
pub(super) async fn started(
    st: &AppState,
    rx: &mut mpsc::UnboundedReceiver<Msg>,
) -> Result<Early, ApiError> {
    match recv(st, rx).await {
        Some(Msg::Event(Event::Started { model, .. })) => Ok(Early::Started(model)),
        Some(Msg::Done(out)) => (*out).map(|o| Early::Done(Box::new(o))),
        Some(Msg::Event(_)) => Ok(Early::Started(String::new())),
        None => Err(ApiError::Internal(
            "the request ended without an answer".into(),
        )),
    }
}

/// Reads events to the end: the outcome.
pub(super) async fn collect(
    st: &AppState,
    rx: &mut mpsc::UnboundedReceiver<Msg>,
) -> Result<Outcome, ApiError> {
    while let Some(m) = recv(st, rx).await {
        match m {
            Msg::Event(_) => {}
            Msg::Done(out) => return *out,
        }
    }
    Err(ApiError::Internal(
        "the request ended without an answer".into(),
    ))
}

pub(super) fn sse_json(v: &impl serde::Serialize) -> Result<SseEvent, Infallible> {
    let text = serde_json::to_string(v).unwrap_or_else(|e| {
        // Our own types always serialize; say so on the stream rather than send nothing.
        let e = ApiError::Internal(format!("response serialization: {e}"));
        serde_json::to_string(&e.body()).unwrap_or_default()
    });
    Ok(SseEvent::default().data(text))
}

/// What a stream of typed events (Anthropic's content blocks, the Responses API's output items) makes of
/// the agent's events: the server-sent events each one produces, gathered until they are sent.
pub(super) trait Gather {
    /// Takes in one of the agent's events.
    fn event(&mut self, ev: Event);
    /// The events gathered since the last take, in order.
    fn take(&mut self) -> Vec<SseEvent>;
}

/// Sends what `g` has gathered; false once the client is gone.
pub(super) async fn send_gathered(
    g: &mut impl Gather,
    tx: &mpsc::Sender<Result<SseEvent, Infallible>>,
) -> bool {
    for ev in g.take() {
        if tx.send(Ok(ev)).await.is_err() {
            return false;
        }
    }
    true
}

/// Sends what `g` has gathered so far, then feeds it the turn's events as they arrive, sending what each
/// one gathers, until the turn's outcome (`early`, when it ended before the stream began). `None` once the
/// client is gone.
pub(super) async fn pump(
    st: &AppState,
    g: &mut impl Gather,
    rx: &mut mpsc::UnboundedReceiver<Msg>,
    early: Option<Outcome>,
    tx: &mpsc::Sender<Result<SseEvent, Infallible>>,
) -> Option<Result<Outcome, ApiError>> {
    if !send_gathered(g, tx).await {
        return None;
    }
    if let Some(o) = early {
        return Some(Ok(o));
    }
    loop {
        match next_msg(st, rx, tx).await? {
            Some(Msg::Event(ev)) => g.event(ev),
            Some(Msg::Done(o)) => return Some(*o),
            None => {
                return Some(Err(ApiError::Internal(
                    "the request ended without an answer".into(),
                )));
            }
        }
        if !send_gathered(g, tx).await {
            return None;
        }
    }
}
