//! A response streamed as the Responses API's typed events: `response.created` and `response.in_progress`,
//! per output item `response.output_item.added`, its deltas and `.done` events, then `response.completed`
//! (or `response.incomplete`); thorn's host calls as `thorn.host_tool_call` / `thorn.host_tool_result`.
//! Every event carries its `type` and a `sequence_number`.

use super::*;
use crate::agent::{Event, StreamedCalls};
use crate::api::work::{Early, Gather, Msg, pump, send_gathered, stream_error};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use std::convert::Infallible;
use tokio::sync::mpsc;

/// The item being streamed.
#[derive(Debug, Clone, PartialEq)]
enum Open {
    None,
    Reasoning(String),
    Message(String),
    Call {
        call_id: String,
        name: String,
        args: String,
        /// A custom tool's call: how much of `args` has been sent as freeform input.
        custom: Option<usize>,
    },
}

/// A stream's output items: which is open, the events gathered, and how many client calls were streamed
/// as they were generated.
struct Items {
    ids: ItemIds,
    seq: u64,
    index: usize,
    open: Open,
    events: Vec<(String, Value)>,
    calls: usize,
    /// What the response echoes (which tools are custom or namespaced).
    echo: Echo,
}

impl Gather for Items {
    fn event(&mut self, ev: Event) {
        match ev {
            Event::Content(t) => self.text(&t),
            Event::Reasoning(t) => self.reasoning(&t),
            Event::CallStart {
                host: false,
                id,
                name,
                ..
            } => {
                self.calls += 1;
                self.call(&id, &name);
            }
            Event::CallArguments {
                host: false, text, ..
            } => self.arguments(&text),
            Event::HostCall(c) => {
                self.close();
                self.push(
                    "thorn.host_tool_call",
                    json!({"call": wire::host_call_started(&c)}),
                );
            }
            Event::HostResult(h) => self.push(
                "thorn.host_tool_result",
                json!({"call": wire::host_call(&h)}),
            ),
            Event::ApprovalPending { call_id, pending } => self.push(
                "thorn.approval_pending",
                json!({"approval": wire::approval_pending(&call_id, &pending)}),
            ),
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

impl Items {
    fn push(&mut self, kind: &str, mut v: Value) {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.events.push((kind.to_owned(), v));
    }

    fn close(&mut self) {
        let index = self.index;
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => return,
            Open::Reasoning(text) => {
                let id = self.ids.reasoning.clone();
                self.push(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                let item = reasoning_item(&self.ids, &text);
                self.push(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
            }
            Open::Message(text) => {
                let id = self.ids.message.clone();
                self.push(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                self.push(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                        "part": {"type": "output_text", "text": text, "annotations": []}}),
                );
                let item = message_item(&self.ids, &text, "completed");
                self.push(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
            }
            Open::Call {
                call_id,
                name,
                args,
                custom,
            } => {
                let id = call_item_id(&call_id);
                let item = call_item(&self.echo, &call_id, &name, &args, "completed");
                if custom.is_some() {
                    self.push(
                        "response.custom_tool_call_input.done",
                        json!({"item_id": id, "output_index": index, "input": item["input"]}),
                    );
                } else {
                    self.push(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": index, "arguments": args}),
                    );
                }
                self.push(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
            }
        }
        self.index += 1;
    }

    fn reasoning(&mut self, t: &str) {
        if !matches!(self.open, Open::Reasoning(_)) {
            self.close();
            let item = json!({"type": "reasoning", "id": self.ids.reasoning, "summary": [], "content": []});
            self.push(
                "response.output_item.added",
                json!({"output_index": self.index, "item": item}),
            );
            self.open = Open::Reasoning(String::new());
        }
        if let Open::Reasoning(s) = &mut self.open {
            s.push_str(t);
        }
        let id = self.ids.reasoning.clone();
        self.push(
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": self.index, "content_index": 0, "delta": t}),
        );
    }

    fn text(&mut self, t: &str) {
        if !matches!(self.open, Open::Message(_)) {
            self.close();
            let id = self.ids.message.clone();
            let item = json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant",
                "content": []});
            self.push(
                "response.output_item.added",
                json!({"output_index": self.index, "item": item}),
            );
            self.push(
                "response.content_part.added",
                json!({"item_id": id, "output_index": self.index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
            self.open = Open::Message(String::new());
        }
        if let Open::Message(s) = &mut self.open {
            s.push_str(t);
        }
        let id = self.ids.message.clone();
        self.push(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": self.index, "content_index": 0, "delta": t,
                "logprobs": []}),
        );
    }

    fn call(&mut self, call_id: &str, name: &str) {
        self.close();
        let custom = self.echo.custom.iter().any(|c| c == name);
        let item = call_item(&self.echo, call_id, name, "", "in_progress");
        self.push(
            "response.output_item.added",
            json!({"output_index": self.index, "item": item}),
        );
        self.open = Open::Call {
            call_id: call_id.to_owned(),
            name: name.to_owned(),
            args: String::new(),
            custom: custom.then_some(0),
        };
    }

    fn arguments(&mut self, delta: &str) {
        let Open::Call {
            call_id,
            args,
            custom,
            ..
        } = &mut self.open
        else {
            return;
        };
        args.push_str(delta);
        let id = call_item_id(call_id);
        if let Some(done) = custom {
            let more = input_delta(args, done);
            if !more.is_empty() {
                self.push(
                    "response.custom_tool_call_input.delta",
                    json!({"item_id": id, "output_index": self.index, "delta": more}),
                );
            }
            return;
        }
        self.push(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": self.index, "delta": delta}),
        );
    }
}

/// The freeform input a custom call's arguments (`{"input":"...`, streamed as compact JSON whose every
/// escape arrives whole) add past the `done` bytes of the string already sent; `done` moves on.
fn input_delta(args: &str, done: &mut usize) -> String {
    let Some(rest) = args.strip_prefix("{\"input\":\"") else {
        return String::new();
    };
    // The end may hold the closing `"}` or an escape not yet whole: try the longest piece that decodes.
    for cut in 0..=6.min(rest.len()) {
        let end = rest.len() - cut;
        if end < *done || !rest.is_char_boundary(end) {
            continue;
        }
        if let Ok(s) = serde_json::from_str::<String>(&format!("\"{}\"", &rest[*done..end])) {
            *done = end;
            return s;
        }
    }
    String::new()
}

fn sse(name: String, v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().event(name).data(v.to_string()))
}

fn error_event(e: &ApiError, seq: u64) -> Value {
    json!({"type": "error", "code": null, "message": e.to_string(), "param": null, "sequence_number": seq})
}

#[expect(clippy::too_many_arguments, reason = "a stream's parts, spelled out")]
pub(super) fn stream_response(
    st: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    guard: CancelOnDrop,
    id: String,
    echo: Echo,
    t0: Instant,
    early: Early,
    keep: impl FnOnce(&Outcome) + Send + 'static,
) -> Response {
    let (model, early) = early.split(&st);
    let (tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let mut b = Items {
            ids: ItemIds::new(),
            seq: 0,
            index: 0,
            open: Open::None,
            events: Vec::new(),
            calls: 0,
            echo: echo.clone(),
        };
        let pending = response_json(&id, &model, &echo, &b.ids, None);
        b.push("response.created", json!({"response": pending}));
        b.push("response.in_progress", json!({"response": pending}));
        let Some(outcome) = pump(&st, &mut b, &mut rx, early, &tx).await else {
            return;
        };
        let out = match outcome {
            Ok(out) => {
                account(&st, &out, t0);
                if let Some(e) = stream_error(&out) {
                    let _ = tx.send(sse("error".into(), &error_event(&e, b.seq))).await;
                    return;
                }
                out
            }
            Err(e) => {
                let _ = tx.send(sse("error".into(), &error_event(&e, b.seq))).await;
                return;
            }
        };
        // Calls not streamed as they were generated (none, unless this is a bug) go out whole.
        for c in out.tool_calls.iter().skip(b.calls) {
            b.call(&c.id, &c.function.name);
            b.arguments(&c.function.arguments.to_string());
        }
        b.close();
        keep(&out);
        let mut full = response_json(&id, &out.served.model, &echo, &b.ids, Some(&out));
        // A call cut off by max_output_tokens was streamed in part: the response is incomplete.
        if matches!(out.streamed, StreamedCalls::Truncated) {
            full["status"] = json!("incomplete");
            full["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        let kind = if full["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        b.push(kind, json!({"response": full}));
        let _ = send_gathered(&mut b, &tx).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_custom_calls_input_streams_as_its_decoded_text() {
        // The compact JSON of `{"input": "a\"b\\c é\n"}` in the fragments a call streamer makes,
        // cut inside an escape too: the deltas join to the decoded input, nothing sent twice.
        let whole = serde_json::to_string(&json!({"input": "a\"b\\c é\n"})).unwrap();
        for size in 1..whole.len() {
            let (mut args, mut done, mut joined) = (String::new(), 0, String::new());
            let mut at = 0;
            while at < whole.len() {
                let mut end = (at + size).min(whole.len());
                while !whole.is_char_boundary(end) {
                    end += 1;
                }
                args.push_str(&whole[at..end]);
                joined.push_str(&input_delta(&args, &mut done));
                at = end;
            }
            assert_eq!(joined, "a\"b\\c é\n", "pieces of {size}");
        }
    }
}
