//! Rounds on an upstream engine: the conversation sent up, its answer streamed back, host calls
//! re-serialized as they stream and every call validated here before anything runs it.

use serde_json::Value;
use thorn_tools::chat::ToolCall;
use thorn_tools::{CallDelta, CallStreamer, OPEN, call_id};

use super::Usage;
use super::split::Counters;
use super::{Agent, AgentError, Event, Finish, RoundCtx, RoundResult, StreamedCalls, TokenLogprob};
use crate::upstream::{Delta, RoundSpec, Target};

impl Agent {
    /// One round upstream: the conversation and tools sent to `target`, its answer streamed back (text
    /// and reasoning as they come; a host call's deltas as they come, re-serialized as the local
    /// engine's are; a client call's once the round's calls are all known valid, since a stream cannot
    /// take a call back), then every call parsed and validated against its schema here. An invalid one
    /// is returned as rejected, for the model to be told.
    pub(super) async fn upstream_round(
        &self,
        target: &Target,
        r: &RoundCtx<'_>,
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) -> Result<RoundResult, AgentError> {
        let turn = r.turn;
        let kwargs = self.template_kwargs(turn);
        let spec = RoundSpec {
            model: &target.model,
            messages: r.messages,
            tools: r.all.definitions(),
            tool_choice: r.choice,
            parallel_tool_calls: turn.parallel_tool_calls,
            response_format: &turn.response_format,
            sampling: &turn.sampling,
            max_tokens: Some(self.output_tokens(turn)).filter(|&n| n != usize::MAX),
            stop: &turn.stop,
            logprobs: turn.logprobs,
            template_kwargs: &kwargs,
        };
        let mut calls: Vec<UpCall> = Vec::new();
        let first_round = r.first_round;
        let exposed = target.exposed();
        let o = {
            let calls = &mut calls;
            let counters = &mut *counters;
            let on_event = &mut *on_event;
            target
                .upstream
                .round(&spec, r.cancel, &mut |d| match d {
                    Delta::Accepted => {
                        if first_round {
                            on_event(Event::Started {
                                prompt_tokens: 0,
                                model: exposed.clone(),
                            });
                        }
                    }
                    Delta::Content(s) => on_event(Event::Content(s.to_owned())),
                    Delta::Reasoning(s) => on_event(Event::Reasoning(s.to_owned())),
                    Delta::Call {
                        index,
                        name,
                        arguments,
                    } => {
                        if calls.len() <= index {
                            calls.resize_with(index + 1, UpCall::default);
                        }
                        let c = &mut calls[index];
                        if let Some(n) = name {
                            c.name.push_str(n);
                        }
                        if let Some(a) = arguments {
                            c.feed(a, &turn.host_tools, counters, on_event);
                        }
                    }
                })
                .await?
        };
        let finish = if o.cancelled {
            Finish::Cancelled
        } else if o.finish.as_deref() == Some("length") {
            Finish::Length
        } else {
            Finish::Stop
        };
        let mut res = RoundResult {
            content: o.content,
            reasoning: o.reasoning,
            calls: Vec::new(),
            rejected: Vec::new(),
            finish,
            stop_string: None,
            usage: o.usage.map_or_else(Usage::default, |u| Usage {
                prompt_tokens: u.prompt,
                cached_tokens: u.cached,
                completion_tokens: u.completion,
            }),
            logprobs: o
                .logprobs
                .into_iter()
                .map(|l| TokenLogprob {
                    token: l.token,
                    bytes: l.bytes,
                    logprob: l.logprob,
                    top: l.top,
                })
                .collect(),
            first_token: o.first_token,
            streamed: StreamedCalls::Exact,
        };
        if o.cancelled {
            return Ok(res);
        }
        if !r.calls_possible {
            if !o.calls.is_empty() {
                tracing::warn!(upstream = %target.upstream.name(), calls = o.calls.len(), "calls from an upstream told not to call tools are dropped");
            }
            return Ok(res);
        }
        let truncated = finish == Finish::Length;
        // Buffered client deltas, in order, released when the round's calls all validated.
        let mut held: Vec<(ToolCall, Vec<String>)> = Vec::new();
        for (raw, mut up) in o.calls.into_iter().zip(
            calls
                .into_iter()
                .chain(std::iter::repeat_with(UpCall::default)),
        ) {
            up.close(&raw.name, &turn.host_tools, counters, on_event);
            let text = raw.arguments.trim();
            let parsed = if text.is_empty() {
                Ok(serde_json::json!({}))
            } else {
                serde_json::from_str::<Value>(text)
            };
            let call = |arguments: Value| ToolCall {
                id: up.id.clone().unwrap_or_else(call_id),
                kind: "function",
                function: thorn_tools::chat::FunctionCall {
                    name: raw.name.clone(),
                    arguments,
                },
            };
            match parsed {
                // Cut off by max_tokens: not a call (as locally); a host call's deltas went out.
                Err(_) if truncated => {
                    if up.host {
                        res.streamed = StreamedCalls::Truncated;
                    }
                }
                Err(e) => res.rejected.push((
                    call(serde_json::json!({})),
                    format!(
                        "the arguments are not valid JSON ({e}): {}",
                        crate::upstream::round::clip(text, 200)
                    ),
                )),
                Ok(arguments) => {
                    let check = r.all.check(&thorn_tools::ParsedCall {
                        name: raw.name.clone(),
                        arguments: arguments.clone(),
                    });
                    let c = call(arguments);
                    match check {
                        Err(e) => res.rejected.push((c, e.to_string())),
                        Ok(()) if up.host => res.calls.push(c),
                        Ok(()) => {
                            held.push((c.clone(), std::mem::take(&mut up.fragments)));
                            res.calls.push(c);
                        }
                    }
                }
            }
        }
        if res.rejected.is_empty() {
            for (c, fragments) in held {
                let index = counters.next(false);
                on_event(Event::CallStart {
                    host: false,
                    index,
                    id: c.id.clone(),
                    name: c.function.name.clone(),
                });
                // The fragments as they were streamed when they spell the arguments exactly, else whole.
                let whole = c.function.arguments.to_string();
                let fragments = if fragments.concat() == whole {
                    fragments
                } else {
                    vec![whole]
                };
                for text in fragments {
                    on_event(Event::CallArguments {
                        host: false,
                        index,
                        text,
                    });
                }
            }
        }
        Ok(res)
    }
}

/// An upstream call as it streams: its name, and once its arguments start, a [`CallStreamer`] that
/// re-serializes them (so the fragments spell exactly the validated call's `arguments`).
#[derive(Debug, Default)]
pub(super) struct UpCall {
    name: String,
    /// Set when it began (its id).
    id: Option<String>,
    host: bool,
    /// Its index among the request's calls of its kind (host calls: assigned when they begin).
    index: usize,
    streamer: CallStreamer,
    /// A client call's argument fragments, held until the round validates.
    fragments: Vec<String>,
}

impl UpCall {
    /// Begins the call (its name is complete once arguments arrive) and streams it.
    fn begin(
        &mut self,
        name: &str,
        host_tools: &[String],
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) {
        if self.id.is_some() {
            return;
        }
        if self.name.is_empty() {
            self.name = name.to_owned();
        }
        let id = call_id();
        self.host = host_tools.contains(&self.name);
        if self.host {
            self.index = counters.next(true);
            on_event(Event::CallStart {
                host: true,
                index: self.index,
                id: id.clone(),
                name: self.name.clone(),
            });
        }
        self.id = Some(id);
        let head = format!(
            "{OPEN}{{\"name\":{},\"arguments\":",
            serde_json::Value::String(self.name.clone())
        );
        self.push(&head, on_event);
    }

    fn push(&mut self, text: &str, on_event: &mut (dyn FnMut(Event) + Send)) {
        let (host, index) = (self.host, self.index);
        let fragments = &mut self.fragments;
        self.streamer.push(text, &mut |d| {
            if let CallDelta::Arguments { text, .. } = d {
                if host {
                    on_event(Event::CallArguments { host, index, text });
                } else {
                    fragments.push(text);
                }
            }
        });
    }

    /// More arguments text.
    fn feed(
        &mut self,
        text: &str,
        host_tools: &[String],
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) {
        let name = self.name.clone();
        self.begin(&name, host_tools, counters, on_event);
        self.push(text, on_event);
    }

    /// The call ended: a call that never sent arguments begins now; the re-serializer is flushed.
    fn close(
        &mut self,
        name: &str,
        host_tools: &[String],
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) {
        self.begin(name, host_tools, counters, on_event);
        self.push("}", on_event);
    }
}
