//! A Messages response streamed as Anthropic's events: `message_start`, `ping`, per block
//! `content_block_start` / `content_block_delta` / `content_block_stop`, then `message_delta` and
//! `message_stop`; thorn's host calls as `thorn_host_tool_call` / `thorn_host_tool_result` events.

use super::*;

pub(super) fn sse(name: &'static str, v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().event(name).data(v.to_string()))
}

/// The open content block of a stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Open {
    None,
    Thinking,
    Text,
    ToolUse,
}

/// A stream's content blocks: which is open, the events that open, extend and close them, and how many
/// client calls were streamed as they were generated.
#[derive(Debug)]
pub(super) struct Blocks {
    index: usize,
    open: Open,
    events: Vec<(&'static str, Value)>,
    calls: usize,
}

impl Gather for Blocks {
    fn event(&mut self, ev: Event) {
        match ev {
            Event::Content(t) => self.text(t),
            Event::Reasoning(t) => self.thinking(t),
            Event::CallStart {
                host: false,
                id,
                name,
                ..
            } => {
                self.calls += 1;
                self.tool_use(&id, &name);
            }
            Event::CallArguments {
                host: false, text, ..
            } => self.input(text),
            Event::HostCall(c) => {
                self.close();
                self.events.push((
                    "thorn_host_tool_call",
                    json!({"type": "thorn_host_tool_call", "call": wire::host_call_started(&c)}),
                ));
            }
            Event::HostResult(h) => self.events.push((
                "thorn_host_tool_result",
                json!({"type": "thorn_host_tool_result", "call": wire::host_call(&h)}),
            )),
            Event::ApprovalPending { call_id, pending } => self.events.push((
                "thorn_approval_pending",
                json!({"type": "thorn_approval_pending", "approval": wire::approval_pending(&call_id, &pending)}),
            )),
            _ => {}
        }
    }

    fn take(&mut self) -> Vec<SseEvent> {
        self.events
            .drain(..)
            .map(|(name, v)| SseEvent::default().event(name).data(v.to_string()))
            .collect()
    }
}

impl Blocks {
    fn close(&mut self) {
        if self.open != Open::None {
            self.events.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.index += 1;
            self.open = Open::None;
        }
    }

    fn start(&mut self, kind: Open, block: Value) {
        self.close();
        self.events.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        ));
        self.open = kind;
    }

    fn delta(&mut self, delta: Value) {
        self.events.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        ));
    }

    fn text(&mut self, t: String) {
        if self.open != Open::Text {
            self.start(Open::Text, json!({"type": "text", "text": ""}));
        }
        self.delta(json!({"type": "text_delta", "text": t}));
    }

    fn thinking(&mut self, t: String) {
        if self.open != Open::Thinking {
            self.start(
                Open::Thinking,
                json!({"type": "thinking", "thinking": "", "signature": ""}),
            );
        }
        self.delta(json!({"type": "thinking_delta", "thinking": t}));
    }

    fn tool_use(&mut self, id: &str, name: &str) {
        self.start(
            Open::ToolUse,
            json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
        );
    }

    fn input(&mut self, partial: String) {
        if self.open == Open::ToolUse {
            self.delta(json!({"type": "input_json_delta", "partial_json": partial}));
        }
    }
}

pub(super) fn stream_messages(
    st: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    guard: CancelOnDrop,
    id: String,
    t0: Instant,
    early: Early,
) -> Response {
    let (model, early) = early.split(&st);
    let (tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let mut b = Blocks {
            index: 0,
            open: Open::None,
            events: vec![
                (
                    "message_start",
                    json!({"type": "message_start", "message": {"id": id, "type": "message",
                        "role": "assistant", "model": model, "content": [], "stop_reason": null,
                        "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}}),
                ),
                ("ping", json!({"type": "ping"})),
            ],
            calls: 0,
        };
        // Client calls are streamed as tool_use blocks as they are generated.
        let Some(outcome) = pump(&st, &mut b, &mut rx, early, &tx).await else {
            return;
        };
        let out = match outcome {
            Ok(out) => {
                account(&st, &out, t0);
                if let Some(e) = stream_error(&out) {
                    let _ = tx.send(sse("error", &error_body(&e))).await;
                    return;
                }
                out
            }
            Err(e) => {
                let _ = tx.send(sse("error", &error_body(&e))).await;
                return;
            }
        };
        // Calls not streamed as they were generated (none, unless this is a bug) go out whole.
        for c in out.tool_calls.iter().skip(b.calls) {
            b.tool_use(&c.id, &c.function.name);
            b.input(c.function.arguments.to_string());
        }
        b.close();
        // A call cut off by max_tokens was streamed in part: the message ends at its length.
        let (reason, seq) = match out.streamed {
            StreamedCalls::Truncated => ("max_tokens", None),
            _ => stop_of(&out),
        };
        b.events.push((
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": usage_of(&out)}),
        ));
        b.events
            .push(("message_stop", json!({"type": "message_stop"})));
        let _ = send_gathered(&mut b, &tx).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
