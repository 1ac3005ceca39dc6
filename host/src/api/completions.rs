//! `POST /v1/completions`: OpenAI's legacy text completions over a raw prompt, whole or streamed.

use super::handler::{Caller, Checked, new_id, unix_now};
use super::models::check_model;
use super::request::{Shape, sampling, stops};
use super::work::{
    CancelOnDrop, Msg, account, collect, completion_work, next_msg, spawn, sse_json, started,
};
use super::{ApiError, AppState, wire};
use crate::agent::{Event, Turn};
use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use thorn_tools::ToolChoice;
use tokio::sync::mpsc;

/// `POST /v1/completions`: a raw prompt continued by the local model (no template, no tools).
pub(super) async fn completions(
    State(st): State<Arc<AppState>>,
    _: Caller,
    Checked(req): Checked<wire::CompletionRequest>,
) -> Result<Response, ApiError> {
    check_model(&st, req.model.as_deref())?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only n = 1 is supported", Some("n")));
    }
    if req.echo == Some(true) {
        return Err(ApiError::bad("`echo` is not supported", Some("echo")));
    }
    let prompt = match req.prompt {
        wire::Prompt::One(p) => p,
        wire::Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
        wire::Prompt::Many(_) => {
            return Err(ApiError::bad(
                "only one prompt is supported",
                Some("prompt"),
            ));
        }
    };
    let top = req.logprobs.unwrap_or(0);
    if top > 5 {
        return Err(ApiError::bad(
            "`logprobs` must be at most 5",
            Some("logprobs"),
        ));
    }
    let mut s = sampling(
        req.temperature,
        req.top_p,
        req.seed,
        req.presence_penalty,
        req.frequency_penalty,
    )?;
    s.top_logprobs = top as usize;
    let turn = Turn {
        tool_choice: ToolChoice::None,
        parallel_tool_calls: false,
        sampling: s,
        max_tokens: req.max_tokens.unwrap_or(16).max(1) as usize,
        stop: stops(req.stop)?,
        max_tool_rounds: Some(0),
        logprobs: req.logprobs.is_some(),
        speculation: req.speculation.unwrap_or(true),
        ..Turn::new(Vec::new(), st.agent.plugins())
    };
    let shape = Shape {
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        logprobs: req.logprobs.is_some(),
    };
    let t0 = Instant::now();
    let (mut rx, cancel) = spawn(&st, completion_work(prompt, turn));
    let guard = CancelOnDrop(cancel);
    let (model, early) = started(&st, &mut rx).await?.split(&st);
    let id = new_id("cmpl");
    let created = unix_now();
    if !shape.stream {
        let out = match early {
            Some(o) => o,
            None => collect(&st, &mut rx).await?,
        };
        account(&st, &out, t0);
        drop(guard);
        return Ok(Json(wire::TextCompletion::new(
            &id,
            created,
            &model,
            &out.content,
            Some(out.finish.as_str()),
            shape.logprobs.then(|| wire::legacy_logprobs(&out.logprobs)),
            Some(wire::usage(out.usage)),
        ))
        .into_response());
    }
    let body = move |text: &str,
                     finish: Option<&'static str>,
                     logprobs: Option<wire::LegacyLogprobs>,
                     usage: Option<wire::Usage>| {
        sse_json(&wire::TextCompletion::new(
            &id, created, &model, text, finish, logprobs, usage,
        ))
    };
    let (tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    let st2 = Arc::clone(&st);
    tokio::spawn(async move {
        let _guard = guard;
        let outcome = match early {
            Some(o) => Ok(o),
            None => loop {
                let Some(msg) = next_msg(&st, &mut rx, &tx).await else {
                    return;
                };
                match msg {
                    Some(Msg::Event(Event::Content(t))) => {
                        if tx.send(body(&t, None, None, None)).await.is_err() {
                            return;
                        }
                    }
                    Some(Msg::Event(_)) => {}
                    Some(Msg::Done(o)) => break *o,
                    None => {
                        break Err(ApiError::Internal("the request ended early".into()));
                    }
                }
            },
        };
        match outcome {
            Ok(out) => {
                account(&st2, &out, t0);
                let usage = shape.include_usage.then(|| wire::usage(out.usage));
                let last = body("", Some(out.finish.as_str()), None, usage);
                if tx.send(last).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(sse_json(&e.body())).await;
            }
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    Ok(
        Sse::new(tokio_stream::wrappers::ReceiverStream::new(out_rx))
            .keep_alive(KeepAlive::default())
            .into_response(),
    )
}
