//! `POST /v1/chat/completions`: a chat request run through the agent, answered whole or streamed as
//! OpenAI's chunks (text, reasoning, tool-call deltas, thorn's host-call events, usage).

use super::handler::{Caller, Checked, new_id, unix_now};
use super::request::{Shape, turn_of};
use super::work::{
    CancelOnDrop, Early, Msg, account, chat_work, collect, next_msg, spawn, sse_json, started,
    stream_error,
};
use super::{ApiError, AppState, wire};
use crate::agent::{Event, Outcome, StreamedCalls};
use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// `POST /v1/chat/completions`.
pub(super) async fn chat(
    State(st): State<Arc<AppState>>,
    caller: Caller,
    Checked(req): Checked<wire::ChatRequest<'static>>,
) -> Result<Response, ApiError> {
    let (turn, shape) = turn_of(&st, req, &caller)?;
    let t0 = Instant::now();
    let (mut rx, cancel) = spawn(&st, chat_work(turn));
    let guard = CancelOnDrop(cancel);
    let early = started(&st, &mut rx).await?;
    let id = new_id("chatcmpl");
    if shape.stream {
        Ok(stream_chat(
            Arc::clone(&st),
            rx,
            guard,
            id,
            shape,
            t0,
            early,
        ))
    } else {
        let out = match early.outcome() {
            Some(o) => o,
            None => collect(&st, &mut rx).await?,
        };
        account(&st, &out, t0);
        drop(guard);
        Ok(Json(chat_json(&id, &out, &shape)).into_response())
    }
}

pub(super) fn chat_json<'a>(
    id: &'a str,
    out: &'a Outcome,
    shape: &Shape,
) -> wire::ChatCompletion<'a> {
    let only_calls = out.content.is_empty() && !out.tool_calls.is_empty();
    wire::ChatCompletion {
        id: id.into(),
        object: "chat.completion".into(),
        created: unix_now(),
        model: out.served.model.as_str().into(),
        system_fingerprint: Some(wire::FINGERPRINT.into()),
        choices: vec![wire::ChatChoice {
            index: 0,
            message: wire::AssistantMessage {
                role: "assistant".into(),
                content: (!only_calls).then_some(out.content.as_str().into()),
                refusal: None,
                tool_calls: out.tool_calls.iter().map(wire::tool_call).collect(),
                thorn_host_tool_calls: out.host_calls.iter().map(wire::host_call).collect(),
                reasoning_content: (!out.reasoning.is_empty())
                    .then_some(out.reasoning.as_str().into()),
                reasoning: None,
                thorn_routed_tools: out.routed.as_deref().map(Into::into),
            },
            logprobs: shape.logprobs.then(|| wire::chat_logprobs(&out.logprobs)),
            finish_reason: Some(out.finish.as_str().into()),
        }],
        usage: Some(wire::usage(out.usage)),
    }
}

pub(super) fn stream_chat(
    st: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    guard: CancelOnDrop,
    id: String,
    shape: Shape,
    t0: Instant,
    early: Early,
) -> Response {
    let (model, early) = early.split(&st);
    let created = unix_now();
    // One chunk, serialized at once (its fields borrow what the event carried).
    let chunk = move |delta: wire::Delta<'_>,
                      finish: Option<&'static str>,
                      logprobs: Option<wire::ChatLogprobs<'_>>,
                      usage: Option<wire::Usage>| {
        let choices = match usage {
            // The usage chunk has no choice.
            Some(_) => Vec::new(),
            None => vec![wire::ChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason: finish.map(Into::into),
            }],
        };
        sse_json(&wire::ChatChunk {
            id: id.as_str().into(),
            object: "chat.completion.chunk".into(),
            created,
            model: model.as_str().into(),
            system_fingerprint: Some(wire::FINGERPRINT.into()),
            choices,
            usage,
            error: None,
        })
    };
    let (tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let send = |ev: Result<SseEvent, Infallible>| {
            let tx = tx.clone();
            async move { tx.send(ev).await.is_ok() }
        };
        let first = wire::Delta {
            role: Some("assistant".into()),
            content: Some("".into()),
            ..wire::Delta::default()
        };
        if !send(chunk(first, None, None, None)).await {
            return;
        }
        // Client calls whose deltas went out as they were generated.
        let mut client_calls = 0usize;
        let outcome = match early {
            Some(o) => Ok(o),
            None => loop {
                let Some(msg) = next_msg(&st, &mut rx, &tx).await else {
                    return;
                };
                match msg {
                    Some(Msg::Event(Event::Content(t))) => {
                        let d = wire::Delta {
                            content: Some(t.as_str().into()),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::Reasoning(t))) => {
                        let d = wire::Delta {
                            reasoning_content: Some(t.as_str().into()),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::CallStart {
                        host,
                        index,
                        id,
                        name,
                    })) => {
                        if !host {
                            client_calls += 1;
                        }
                        let d =
                            wire::Delta::call(host, wire::ToolCallDelta::start(index, &id, &name));
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::CallArguments { host, index, text })) => {
                        let d =
                            wire::Delta::call(host, wire::ToolCallDelta::arguments(index, &text));
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::HostCall(c))) => {
                        let d = wire::Delta {
                            thorn_host_tool_call: Some(wire::host_call_started(&c)),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::HostResult(h))) => {
                        let d = wire::Delta {
                            thorn_host_tool_result: Some(wire::host_call(&h)),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::ApprovalPending { call_id, pending })) => {
                        let d = wire::Delta {
                            thorn_approval_pending: Some(wire::approval_pending(
                                &call_id, &pending,
                            )),
                            ..wire::Delta::default()
                        };
                        if !send(chunk(d, None, None, None)).await {
                            return;
                        }
                    }
                    Some(Msg::Event(Event::Started { .. })) => {}
                    Some(Msg::Done(o)) => break *o,
                    None => {
                        break Err(ApiError::Internal(
                            "the request ended without an answer".into(),
                        ));
                    }
                }
            },
        };
        match outcome {
            Ok(out) if stream_error(&out).is_some() => {
                account(&st, &out, t0);
                let e = stream_error(&out).expect("checked");
                let _ = tx.send(sse_json(&e.body())).await;
            }
            Ok(out) => {
                account(&st, &out, t0);
                // Calls not streamed (none are, unless this is a bug) go out whole, as one delta each.
                let args: Vec<String> = out
                    .tool_calls
                    .iter()
                    .map(|c| c.function.arguments.to_string())
                    .collect();
                for (i, (c, a)) in out
                    .tool_calls
                    .iter()
                    .zip(&args)
                    .enumerate()
                    .skip(client_calls)
                {
                    let mut whole = wire::ToolCallDelta::start(i, &c.id, &c.function.name);
                    whole.function.arguments = Some(a.as_str().into());
                    let d = wire::Delta::call(false, whole);
                    if !send(chunk(d, None, None, None)).await {
                        return;
                    }
                }
                // A call cut off by max_tokens was streamed in part: the response ends at its length.
                let finish = match out.streamed {
                    StreamedCalls::Truncated => "length",
                    _ => out.finish.as_str(),
                };
                let logprobs = shape.logprobs.then(|| wire::chat_logprobs(&out.logprobs));
                let last = chunk(wire::Delta::default(), Some(finish), logprobs, None);
                if !send(last).await {
                    return;
                }
                if shape.include_usage {
                    let u = chunk(
                        wire::Delta::default(),
                        None,
                        None,
                        Some(wire::usage(out.usage)),
                    );
                    if !send(u).await {
                        return;
                    }
                }
            }
            Err(e) => {
                // Headers are gone; the error travels as an event, as OpenAI does.
                let _ = tx.send(sse_json(&e.body())).await;
            }
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
