//! One round against an upstream, in OpenAI's chat form (the types are `thorn-openai`'s, the server's
//! own): the request body built from the agent's domain types, and the upstream's stream (or whole
//! answer) read back into deltas and one [`RoundOutput`].
//!
//! The upstream is read as data: its chunks are typed (a known field of the wrong type is an error that
//! names it), its tool calls are bounded in number and size, and nothing it sends is interpreted beyond
//! text, calls, finish, usage and log-probabilities.

use serde_json::Value;
use std::borrow::Cow;
use std::time::Instant;
use thorn_engine::sample::SamplingParams;
use thorn_openai as openai;
use thorn_tools::chat::{Message, Role};
use thorn_tools::{ResponseFormat, ToolChoice};

/// Most tool calls one upstream answer may hold.
pub const MAX_CALLS: usize = 128;

/// One round, in the agent's terms.
#[derive(Debug, Clone, Copy)]
pub struct RoundSpec<'a> {
    /// The upstream's own model id.
    pub model: &'a str,
    /// The conversation so far.
    pub messages: &'a [Message],
    /// Tool definitions (OpenAI `tools` entries; empty: none).
    pub tools: &'a [Value],
    /// `tool_choice`.
    pub tool_choice: &'a ToolChoice,
    /// `parallel_tool_calls`.
    pub parallel_tool_calls: bool,
    /// `response_format`.
    pub response_format: &'a ResponseFormat,
    /// Sampling.
    pub sampling: &'a SamplingParams,
    /// Most tokens (`None`: the upstream's own limit).
    pub max_tokens: Option<usize>,
    /// Stop strings.
    pub stop: &'a [String],
    /// Ask for log-probabilities.
    pub logprobs: bool,
    /// Chat-template variables (`enable_thinking`, ...), sent as `chat_template_kwargs` (vLLM and SGLang
    /// take them; others ignore the field) when there are any.
    pub template_kwargs: &'a serde_json::Map<String, Value>,
}

/// A message in the wire form (arguments as JSON text; an assistant message that only calls tools has
/// `null` content; a tool message keeps its name).
fn message(m: &Message) -> openai::Message<'_> {
    let only_calls = m.role == Role::Assistant && m.content.is_empty() && !m.tool_calls.is_empty();
    openai::Message {
        role: m.role.as_str().into(),
        content: (!only_calls).then(|| openai::Content::Text(m.content.as_str().into())),
        tool_calls: (!m.tool_calls.is_empty()).then(|| {
            m.tool_calls
                .iter()
                .map(|c| {
                    openai::ToolCall::function(
                        c.id.as_str(),
                        c.function.name.as_str(),
                        c.function.arguments.to_string(),
                    )
                })
                .collect()
        }),
        tool_call_id: m.tool_call_id.as_deref().map(Cow::Borrowed),
        name: m
            .name
            .as_deref()
            .filter(|_| m.role == Role::Tool)
            .map(Cow::Borrowed),
        reasoning_content: None,
    }
}

fn tool_choice(c: &ToolChoice) -> Value {
    match c {
        ToolChoice::None => "none".into(),
        ToolChoice::Auto => "auto".into(),
        ToolChoice::Required => "required".into(),
        ToolChoice::Function(n) => serde_json::json!({"type": "function", "function": {"name": n}}),
    }
}

fn response_format(f: &ResponseFormat) -> Option<Value> {
    match f {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some(serde_json::json!({"type": "json_object"})),
        ResponseFormat::JsonSchema {
            name,
            schema,
            strict,
        } => Some(serde_json::json!({"type": "json_schema",
                          "json_schema": {"name": name, "schema": schema, "strict": strict}})),
    }
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The request body: always streamed, with usage in the last chunk. Sampling fields an OpenAI server may
/// not know (`top_k`, `min_p`, `repetition_penalty`: vLLM, SGLang and llama-server take them) are sent
/// only when the request set them away from their neutral value.
pub fn request_body<'a>(r: &RoundSpec<'a>) -> openai::ChatRequest<'a> {
    let s = r.sampling;
    let tools = !r.tools.is_empty();
    openai::ChatRequest {
        model: Some(r.model.into()),
        messages: r.messages.iter().map(message).collect(),
        stream: Some(true),
        stream_options: Some(openai::StreamOptions {
            include_usage: true,
        }),
        tools: tools.then_some(Cow::Borrowed(r.tools)),
        tool_choice: tools.then(|| tool_choice(r.tool_choice)),
        parallel_tool_calls: tools.then_some(r.parallel_tool_calls),
        response_format: response_format(r.response_format),
        temperature: Some(s.temperature),
        top_p: (s.top_p < 1.0).then_some(s.top_p),
        // The client's own seed (the API keeps its bits in a u64).
        seed: s.seed.map(|x| x as i64),
        presence_penalty: (s.presence_penalty != 0.0).then_some(s.presence_penalty),
        frequency_penalty: (s.frequency_penalty != 0.0).then_some(s.frequency_penalty),
        top_k: (s.top_k > 0).then(|| count(s.top_k)),
        min_p: (s.min_p > 0.0).then_some(s.min_p),
        repetition_penalty: (s.repetition_penalty != 1.0).then_some(s.repetition_penalty),
        max_tokens: r.max_tokens.map(count),
        stop: (!r.stop.is_empty()).then(|| openai::Stop::Many(r.stop.to_vec())),
        logprobs: r.logprobs.then_some(true),
        top_logprobs: (r.logprobs && s.top_logprobs > 0).then(|| count(s.top_logprobs)),
        chat_template_kwargs: (!r.template_kwargs.is_empty()).then(|| r.template_kwargs.clone()),
        ..openai::ChatRequest::default()
    }
}

/// What arrives, as it arrives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Delta<'a> {
    /// The upstream accepted the request: its answer starts.
    Accepted,
    /// Answer text.
    Content(&'a str),
    /// Reasoning text.
    Reasoning(&'a str),
    /// Part of call `index` (its place in this answer): its name (or more of it), more arguments text.
    Call {
        /// Its place among the answer's calls.
        index: usize,
        /// Name text, when this delta has some.
        name: Option<&'a str>,
        /// Arguments text, when this delta has some.
        arguments: Option<&'a str>,
    },
}

/// A call as the upstream sent it: arguments as the JSON text it wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawCall {
    /// The upstream's `index` for it.
    pub wire_index: u64,
    /// The tool's name.
    pub name: String,
    /// Its arguments' text.
    pub arguments: String,
}

/// Token counts of one round, as the upstream reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Prompt tokens.
    pub prompt: usize,
    /// Of those, from the upstream's cache.
    pub cached: usize,
    /// Generated tokens.
    pub completion: usize,
}

/// One generated token's log-probability, as the upstream reported it.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprob {
    /// Its text.
    pub token: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// Alternatives: text, bytes, log-probability.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// One round's answer.
#[derive(Debug, Clone, Default)]
pub struct RoundOutput {
    /// Answer text.
    pub content: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Tool calls, in the order they began.
    pub calls: Vec<RawCall>,
    /// `finish_reason` (`None`: the stream ended without one).
    pub finish: Option<String>,
    /// Token counts (when the upstream sent them).
    pub usage: Option<Counts>,
    /// Log-probabilities (when asked for).
    pub logprobs: Vec<Logprob>,
    /// When the first text or call arrived.
    pub first_token: Option<Instant>,
    /// The stream ended with `[DONE]`.
    pub done: bool,
    /// The client went away: the round was abandoned.
    pub cancelled: bool,
}

impl From<openai::Usage> for Counts {
    fn from(u: openai::Usage) -> Self {
        Counts {
            prompt: u.prompt_tokens,
            cached: u.cached_tokens().unwrap_or(0),
            completion: u.completion_tokens,
        }
    }
}

fn logprobs(lp: &openai::ChatLogprobs<'_>, out: &mut Vec<Logprob>) {
    // A server that sends no bytes means the text's.
    let bytes = |b: &Option<Cow<'_, [u8]>>, t: &str| {
        b.as_deref()
            .map_or_else(|| t.as_bytes().to_vec(), <[u8]>::to_vec)
    };
    out.extend(lp.content.iter().map(|t| {
        Logprob {
            token: t.token.to_string(),
            bytes: bytes(&t.bytes, &t.token),
            logprob: t.logprob,
            top: t
                .top_logprobs
                .iter()
                .map(|a| (a.token.to_string(), bytes(&a.bytes, &a.token), a.logprob))
                .collect(),
        }
    }));
}

/// The text of an error the upstream put in a body or an event (`{"error": {"message"}}`,
/// `{"error": "text"}`, `{"message"}`, `{"detail"}`), at most 1000 bytes of it.
pub fn error_message(v: &Value) -> Option<String> {
    let m = match &v["error"] {
        Value::String(s) => s.clone(),
        Value::Object(e) => e.get("message").and_then(Value::as_str)?.to_owned(),
        _ => v["message"]
            .as_str()
            .or_else(|| v["detail"].as_str())?
            .to_owned(),
    };
    Some(clip(&m, 1000))
}

/// An error an event or a whole answer reported under `error`.
fn reported(e: &Value) -> WireError {
    let wrapped = serde_json::json!({ "error": e });
    WireError::Reported(
        error_message(&wrapped)
            .unwrap_or_else(|| clip(&format!("an error without a message: {e}"), 1000)),
    )
}

/// Why an upstream's answer could not be taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// The upstream reported an error (in an event or as the whole answer): its message.
    Reported(String),
    /// The answer breaks a rule of the form or one of thorn's bounds.
    Invalid(String),
}

/// At most `n` bytes of `s`, cut at a character boundary.
pub fn clip(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_owned();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// One streamed event's data read as a chunk: not JSON, or not a chunk (a known field of the wrong type,
/// named by its path), is [`WireError::Invalid`].
pub fn parse_chunk(data: &[u8]) -> Result<openai::ChatChunk<'static>, WireError> {
    let de = &mut serde_json::Deserializer::from_slice(data);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        WireError::Invalid(if inner.is_data() {
            format!("a stream event is not a chat.completion.chunk: {path}: {inner}")
        } else {
            format!("a stream event is not JSON: {inner}")
        })
    })
}

/// A call piece: its `index` (else its place in the list), name text, arguments text.
type CallPiece<'p> = (u64, Option<&'p str>, Option<&'p str>);

impl RoundOutput {
    fn call_at(&mut self, wire_index: u64) -> Result<usize, WireError> {
        if let Some(i) = self.calls.iter().position(|c| c.wire_index == wire_index) {
            return Ok(i);
        }
        if self.calls.len() == MAX_CALLS {
            return Err(WireError::Invalid(format!(
                "more than {MAX_CALLS} tool calls in one answer"
            )));
        }
        self.calls.push(RawCall {
            wire_index,
            ..RawCall::default()
        });
        Ok(self.calls.len() - 1)
    }

    /// Takes one streamed chunk (`chat.completion.chunk`); `on` sees what it adds.
    pub fn chunk(
        &mut self,
        c: &openai::ChatChunk<'_>,
        on: &mut dyn FnMut(Delta<'_>),
    ) -> Result<(), WireError> {
        if let Some(e) = &c.error {
            return Err(reported(e));
        }
        if let Some(u) = c.usage {
            self.usage = Some(u.into());
        }
        let Some(choice) = c.choices.first() else {
            return Ok(());
        };
        let d = &choice.delta;
        let calls = d.tool_calls.iter().flatten().enumerate().map(|(pos, t)| {
            (
                t.index.map_or(pos as u64, |i| i as u64),
                t.function.name.as_deref(),
                t.function.arguments.as_deref(),
            )
        });
        self.take(d.reasoning(), d.content.as_deref(), calls, on)?;
        if let Some(lp) = &choice.logprobs {
            logprobs(lp, &mut self.logprobs);
        }
        if let Some(f) = &choice.finish_reason {
            self.finish = Some(f.to_string());
        }
        Ok(())
    }

    /// Takes a whole answer's body (`chat.completion`, from an upstream that did not stream).
    pub fn whole(&mut self, body: &Value, on: &mut dyn FnMut(Delta<'_>)) -> Result<(), WireError> {
        if let Some(e) = body.get("error").filter(|e| !e.is_null()) {
            return Err(reported(e));
        }
        let a: openai::ChatCompletion<'_> =
            serde_path_to_error::deserialize(body).map_err(|e| {
                WireError::Invalid(format!("an answer that is not a chat.completion: {e}"))
            })?;
        let choice = a
            .choices
            .first()
            .ok_or_else(|| WireError::Invalid("an answer without choices".into()))?;
        let m = &choice.message;
        // A whole message's calls carry no `index`: their order gives it.
        let calls = m.tool_calls.iter().enumerate().map(|(pos, t)| {
            (
                pos as u64,
                Some(t.function.name.as_ref()),
                Some(t.function.arguments.as_ref()),
            )
        });
        self.take(m.reasoning(), m.content.as_deref(), calls, on)?;
        if let Some(lp) = &choice.logprobs {
            logprobs(lp, &mut self.logprobs);
        }
        self.finish = Some(choice.finish_reason.as_deref().unwrap_or("stop").to_owned());
        self.usage = a.usage.map(Counts::from);
        self.done = true;
        Ok(())
    }

    /// A delta (or whole message): reasoning, text, calls.
    fn take<'p>(
        &mut self,
        reasoning: Option<&str>,
        content: Option<&str>,
        calls: impl Iterator<Item = CallPiece<'p>>,
        on: &mut dyn FnMut(Delta<'_>),
    ) -> Result<(), WireError> {
        let first = |at: &mut Option<Instant>| {
            at.get_or_insert_with(Instant::now);
        };
        if let Some(r) = reasoning.filter(|r| !r.is_empty()) {
            first(&mut self.first_token);
            self.reasoning.push_str(r);
            on(Delta::Reasoning(r));
        }
        if let Some(c) = content.filter(|c| !c.is_empty()) {
            first(&mut self.first_token);
            self.content.push_str(c);
            on(Delta::Content(c));
        }
        for (wire, name, arguments) in calls {
            let at = self.call_at(wire)?;
            let name = name.filter(|n| !n.is_empty());
            let arguments = arguments.filter(|a| !a.is_empty());
            if name.is_none() && arguments.is_none() {
                continue;
            }
            first(&mut self.first_token);
            let call = &mut self.calls[at];
            // A name is complete once arguments began; a server that repeats the whole name in every
            // delta does not make it twice as long.
            let name = name.filter(|n| call.arguments.is_empty() && call.name != *n);
            if let Some(n) = name {
                call.name.push_str(n);
            }
            if let Some(a) = arguments {
                call.arguments.push_str(a);
            }
            on(Delta::Call {
                index: at,
                name,
                arguments,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use thorn_tools::chat::{FunctionCall, ToolCall};

    fn chunk(v: &Value) -> openai::ChatChunk<'static> {
        parse_chunk(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn a_round_becomes_an_openai_request() {
        let mut assistant = Message::assistant("");
        assistant.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            kind: "function",
            function: FunctionCall {
                name: "evaluate".into(),
                arguments: json!({"expression": "2+2"}),
            },
        }];
        let mut tool = Message::new(Role::Tool, "{\"value\":4}");
        tool.tool_call_id = Some("call_1".into());
        tool.name = Some("evaluate".into());
        let messages = [Message::system("s"), Message::user("u"), assistant, tool];
        let tools = [json!({"type": "function", "function": {"name": "evaluate"}})];
        let sampling = SamplingParams {
            temperature: 0.0,
            seed: Some(7),
            top_k: 5,
            ..SamplingParams::default()
        };
        let body = serde_json::to_value(request_body(&RoundSpec {
            model: "Qwen/Qwen3-8B",
            messages: &messages,
            tools: &tools,
            tool_choice: &ToolChoice::Function("evaluate".into()),
            parallel_tool_calls: false,
            response_format: &ResponseFormat::JsonObject,
            sampling: &sampling,
            max_tokens: Some(64),
            stop: &["END".into()],
            logprobs: false,
            template_kwargs: json!({"enable_thinking": false}).as_object().unwrap(),
        }))
        .unwrap();
        assert_eq!(
            body,
            json!({
                "model": "Qwen/Qwen3-8B",
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "evaluate", "arguments": "{\"expression\":\"2+2\"}"}}]},
                    {"role": "tool", "content": "{\"value\":4}", "tool_call_id": "call_1", "name": "evaluate"}
                ],
                "stream": true,
                "stream_options": {"include_usage": true},
                "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": "evaluate"}},
                "parallel_tool_calls": false,
                "response_format": {"type": "json_object"},
                "temperature": 0.0,
                "seed": 7,
                "top_k": 5,
                "max_tokens": 64,
                "stop": ["END"],
                "chat_template_kwargs": {"enable_thinking": false}
            })
        );
        // No tools: no tool fields (some servers refuse a tool_choice without tools).
        let body = serde_json::to_value(request_body(&RoundSpec {
            model: "m",
            messages: &messages[..2],
            tools: &[],
            tool_choice: &ToolChoice::Auto,
            parallel_tool_calls: true,
            response_format: &ResponseFormat::Text,
            sampling: &SamplingParams::default(),
            max_tokens: None,
            stop: &[],
            logprobs: true,
            template_kwargs: &serde_json::Map::new(),
        }))
        .unwrap();
        assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
        assert!(body.get("max_tokens").is_none() && body.get("response_format").is_none());
        assert!(body.get("chat_template_kwargs").is_none());
        assert_eq!(body["logprobs"], true);
    }

    #[test]
    fn streamed_chunks_add_up_to_the_answer() {
        let chunks = [
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
            json!({"choices": [{"delta": {"reasoning_content": "Hm."}}]}),
            json!({"choices": [{"delta": {"content": "Sure. "}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "x", "type": "function",
                "function": {"name": "evaluate", "arguments": ""}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"expression\": "}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"2+2\"}"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "y",
                "function": {"name": "neg", "arguments": "{}"}}]}}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 12,
                "prompt_tokens_details": {"cached_tokens": 16}}}),
        ];
        let mut out = RoundOutput::default();
        let mut seen = Vec::new();
        for c in &chunks {
            out.chunk(&chunk(c), &mut |d| seen.push(format!("{d:?}")))
                .unwrap();
        }
        assert_eq!(out.content, "Sure. ");
        assert_eq!(out.reasoning, "Hm.");
        assert_eq!(out.calls.len(), 2);
        assert_eq!(
            (out.calls[0].name.as_str(), out.calls[0].arguments.as_str()),
            ("evaluate", "{\"expression\": \"2+2\"}")
        );
        assert_eq!(out.calls[1].name, "neg");
        assert_eq!(out.finish.as_deref(), Some("tool_calls"));
        assert_eq!(
            out.usage,
            Some(Counts {
                prompt: 30,
                cached: 16,
                completion: 12
            })
        );
        // The empty first content and the empty first arguments are not deltas.
        assert_eq!(seen.len(), 6, "{seen:?}");
        assert!(out.first_token.is_some());

        // A name repeated in each delta, and reasoning under both keys, count once.
        let mut out = RoundOutput::default();
        for c in [
            json!({"choices": [{"delta": {"reasoning_content": "a", "reasoning": "a"}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "}"}}]}}]}),
        ] {
            out.chunk(&chunk(&c), &mut |_| {}).unwrap();
        }
        assert_eq!(out.reasoning, "a");
        assert_eq!(
            (out.calls[0].name.as_str(), out.calls[0].arguments.as_str()),
            ("f", "{}")
        );
    }

    #[test]
    fn an_upstream_error_event_and_too_many_calls_are_errors() {
        let mut out = RoundOutput::default();
        let e = out
            .chunk(
                &chunk(&json!({"error": {"message": "CUDA out of memory", "type": "InternalServerError"}})),
                &mut |_| {},
            )
            .unwrap_err();
        assert_eq!(e, WireError::Reported("CUDA out of memory".into()));
        let many: Vec<Value> = (0..=MAX_CALLS)
            .map(|i| json!({"index": i, "function": {"name": "f", "arguments": "{}"}}))
            .collect();
        let e = out
            .chunk(
                &chunk(&json!({"choices": [{"delta": {"tool_calls": many}}]})),
                &mut |_| {},
            )
            .unwrap_err();
        assert!(matches!(e, WireError::Invalid(m) if m.contains("more than")));
        // An event that is not JSON, or a known field of the wrong type (named by its path), is invalid.
        let e = parse_chunk(b"{\"choices\": [").unwrap_err();
        assert!(
            matches!(&e, WireError::Invalid(m) if m.contains("not JSON")),
            "{e:?}"
        );
        let e = parse_chunk(br#"{"choices": [{"delta": {"content": 5}}]}"#).unwrap_err();
        assert!(
            matches!(&e, WireError::Invalid(m) if m.contains("choices[0].delta.content")),
            "{e:?}"
        );
    }

    #[test]
    fn a_whole_answer_reads_like_its_stream() {
        let mut out = RoundOutput::default();
        out.whole(
            &json!({"choices": [{"message": {"role": "assistant", "content": null, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"y": 2}}}]},
                "finish_reason": "tool_calls"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 3}}),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(out.calls.len(), 2);
        assert_eq!(out.calls[1].arguments, "{\"y\":2}");
        assert!(out.done);
        assert_eq!(out.usage.map(|u| u.prompt), Some(5));
        assert_eq!(
            error_message(&json!({"detail": "Not Found"})).as_deref(),
            Some("Not Found")
        );
        assert_eq!(clip("héllo", 2), "h...");
    }
}
