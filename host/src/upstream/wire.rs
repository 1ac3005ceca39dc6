//! OpenAI's chat wire form, the client side: one round's request body built from the agent's domain
//! types, and the upstream's stream (or whole answer) read back into deltas and one [`RoundOutput`].
//!
//! The upstream is read as data: its fields are checked for type, its tool calls are bounded in number
//! and size, and nothing it sends is interpreted beyond text, calls, finish, usage and log-probabilities.

use serde_json::{Map, Value, json};
use std::time::Instant;
use thorn_engine::sample::SamplingParams;
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
}

fn role(r: Role) -> &'static str {
    match r {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}

/// A message as OpenAI's wire form has it (arguments as JSON text).
fn message(m: &Message) -> Value {
    let mut o = Map::new();
    o.insert("role".into(), role(m.role).into());
    if m.role == Role::Assistant && m.content.is_empty() && !m.tool_calls.is_empty() {
        o.insert("content".into(), Value::Null);
    } else {
        o.insert("content".into(), m.content.clone().into());
    }
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(|c| {
                json!({"id": c.id, "type": "function",
                       "function": {"name": c.function.name, "arguments": c.function.arguments.to_string()}})
            })
            .collect();
        o.insert("tool_calls".into(), calls.into());
    }
    if let Some(id) = &m.tool_call_id {
        o.insert("tool_call_id".into(), id.clone().into());
    }
    if m.role == Role::Tool
        && let Some(n) = &m.name
    {
        o.insert("name".into(), n.clone().into());
    }
    Value::Object(o)
}

fn tool_choice(c: &ToolChoice) -> Value {
    match c {
        ToolChoice::None => "none".into(),
        ToolChoice::Auto => "auto".into(),
        ToolChoice::Required => "required".into(),
        ToolChoice::Function(n) => json!({"type": "function", "function": {"name": n}}),
    }
}

fn response_format(f: &ResponseFormat) -> Option<Value> {
    match f {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some(json!({"type": "json_object"})),
        ResponseFormat::JsonSchema {
            name,
            schema,
            strict,
        } => Some(json!({"type": "json_schema",
                          "json_schema": {"name": name, "schema": schema, "strict": strict}})),
    }
}

/// The request body: always streamed, with usage in the last chunk. Sampling fields an OpenAI server may
/// not know (`top_k`, `min_p`, `repetition_penalty`: vLLM, SGLang and llama-server take them) are sent
/// only when the request set them away from their neutral value.
pub fn request_body(r: &RoundSpec<'_>) -> Value {
    let s = r.sampling;
    let mut o = Map::new();
    o.insert("model".into(), r.model.into());
    o.insert(
        "messages".into(),
        r.messages.iter().map(message).collect::<Vec<_>>().into(),
    );
    o.insert("stream".into(), true.into());
    o.insert("stream_options".into(), json!({"include_usage": true}));
    if !r.tools.is_empty() {
        o.insert("tools".into(), r.tools.to_vec().into());
        o.insert("tool_choice".into(), tool_choice(r.tool_choice));
        o.insert("parallel_tool_calls".into(), r.parallel_tool_calls.into());
    }
    if let Some(f) = response_format(r.response_format) {
        o.insert("response_format".into(), f);
    }
    o.insert("temperature".into(), s.temperature.into());
    if s.top_p < 1.0 {
        o.insert("top_p".into(), s.top_p.into());
    }
    if let Some(seed) = s.seed {
        o.insert("seed".into(), seed.into());
    }
    if s.presence_penalty != 0.0 {
        o.insert("presence_penalty".into(), s.presence_penalty.into());
    }
    if s.frequency_penalty != 0.0 {
        o.insert("frequency_penalty".into(), s.frequency_penalty.into());
    }
    if s.top_k > 0 {
        o.insert("top_k".into(), s.top_k.into());
    }
    if s.min_p > 0.0 {
        o.insert("min_p".into(), s.min_p.into());
    }
    if s.repetition_penalty != 1.0 {
        o.insert("repetition_penalty".into(), s.repetition_penalty.into());
    }
    if let Some(n) = r.max_tokens {
        o.insert("max_tokens".into(), n.into());
    }
    if !r.stop.is_empty() {
        o.insert("stop".into(), r.stop.to_vec().into());
    }
    if r.logprobs {
        o.insert("logprobs".into(), true.into());
        if s.top_logprobs > 0 {
            o.insert("top_logprobs".into(), s.top_logprobs.into());
        }
    }
    Value::Object(o)
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

fn counts(u: &Value) -> Option<Counts> {
    let n = |v: &Value| v.as_u64().map(|n| n as usize);
    Some(Counts {
        prompt: n(&u["prompt_tokens"])?,
        completion: n(&u["completion_tokens"]).unwrap_or(0),
        cached: n(&u["prompt_tokens_details"]["cached_tokens"]).unwrap_or(0),
    })
}

fn logprob_entry(v: &Value) -> Option<(String, Vec<u8>, f32)> {
    let token = v["token"].as_str()?.to_owned();
    let bytes = match v["bytes"].as_array() {
        Some(b) => b
            .iter()
            .map(|x| x.as_u64().and_then(|x| u8::try_from(x).ok()))
            .collect::<Option<Vec<u8>>>()?,
        None => token.as_bytes().to_vec(),
    };
    Some((token, bytes, v["logprob"].as_f64()? as f32))
}

fn logprobs(v: &Value, out: &mut Vec<Logprob>) {
    for t in v["content"].as_array().into_iter().flatten() {
        if let Some((token, bytes, logprob)) = logprob_entry(t) {
            let top = t["top_logprobs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(logprob_entry)
                .collect();
            out.push(Logprob {
                token,
                bytes,
                logprob,
                top,
            });
        }
    }
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
    pub fn chunk(&mut self, v: &Value, on: &mut dyn FnMut(Delta<'_>)) -> Result<(), WireError> {
        if let Some(m) = error_message(v).filter(|_| v.get("error").is_some()) {
            return Err(WireError::Reported(m));
        }
        if let Some(u) = v.get("usage").and_then(counts) {
            self.usage = Some(u);
        }
        let Some(choice) = v["choices"].as_array().and_then(|c| c.first()) else {
            return Ok(());
        };
        let d = &choice["delta"];
        self.take(d, on)?;
        if !choice["logprobs"].is_null() {
            logprobs(&choice["logprobs"], &mut self.logprobs);
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            self.finish = Some(f.to_owned());
        }
        Ok(())
    }

    /// Takes a whole answer (`chat.completion`, from an upstream that did not stream).
    pub fn whole(&mut self, v: &Value, on: &mut dyn FnMut(Delta<'_>)) -> Result<(), WireError> {
        if v.get("error").is_some() {
            return Err(WireError::Reported(
                error_message(v).unwrap_or_else(|| "an error without a message".into()),
            ));
        }
        let choice = v["choices"]
            .as_array()
            .and_then(|c| c.first())
            .ok_or_else(|| WireError::Invalid("an answer without choices".into()))?;
        // A whole message's calls carry no `index`: their order gives it.
        let mut m = choice["message"].clone();
        if let Some(calls) = m["tool_calls"].as_array_mut() {
            for (i, c) in calls.iter_mut().enumerate() {
                c["index"] = i.into();
            }
        }
        self.take(&m, on)?;
        if !choice["logprobs"].is_null() {
            logprobs(&choice["logprobs"], &mut self.logprobs);
        }
        self.finish = choice["finish_reason"]
            .as_str()
            .map(str::to_owned)
            .or(Some("stop".into()));
        self.usage = v.get("usage").and_then(counts);
        self.done = true;
        Ok(())
    }

    /// A delta (or whole message): text, reasoning, calls.
    fn take(&mut self, d: &Value, on: &mut dyn FnMut(Delta<'_>)) -> Result<(), WireError> {
        let first = |at: &mut Option<Instant>| {
            at.get_or_insert_with(Instant::now);
        };
        // vLLM and llama-server say `reasoning_content`, newer vLLM `reasoning` (a server sending both
        // sends the same text twice: the first is taken).
        if let Some(r) = ["reasoning_content", "reasoning"]
            .iter()
            .find_map(|k| d[*k].as_str())
            .filter(|r| !r.is_empty())
        {
            first(&mut self.first_token);
            self.reasoning.push_str(r);
            on(Delta::Reasoning(r));
        }
        if let Some(c) = d["content"].as_str().filter(|c| !c.is_empty()) {
            first(&mut self.first_token);
            self.content.push_str(c);
            on(Delta::Content(c));
        }
        for (pos, c) in d["tool_calls"].as_array().into_iter().flatten().enumerate() {
            let wire = c["index"].as_u64().unwrap_or(pos as u64);
            let at = self.call_at(wire)?;
            let f = &c["function"];
            let name = f["name"].as_str().filter(|n| !n.is_empty());
            // Arguments are JSON text; a server that sends the object itself is read as its text.
            let args_owned;
            let arguments = match &f["arguments"] {
                Value::String(s) if !s.is_empty() => Some(s.as_str()),
                v @ Value::Object(_) => {
                    args_owned = v.to_string();
                    Some(args_owned.as_str())
                }
                _ => None,
            };
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
    use thorn_tools::chat::{FunctionCall, ToolCall};

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
        let body = request_body(&RoundSpec {
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
        });
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
                "stop": ["END"]
            })
        );
        // No tools: no tool fields (some servers refuse a tool_choice without tools).
        let body = request_body(&RoundSpec {
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
        });
        assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
        assert!(body.get("max_tokens").is_none() && body.get("response_format").is_none());
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
            out.chunk(c, &mut |d| seen.push(format!("{d:?}"))).unwrap();
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
            out.chunk(&c, &mut |_| {}).unwrap();
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
                &json!({"error": {"message": "CUDA out of memory", "type": "InternalServerError"}}),
                &mut |_| {},
            )
            .unwrap_err();
        assert_eq!(e, WireError::Reported("CUDA out of memory".into()));
        let many: Vec<Value> = (0..=MAX_CALLS)
            .map(|i| json!({"index": i, "function": {"name": "f", "arguments": "{}"}}))
            .collect();
        let e = out
            .chunk(
                &json!({"choices": [{"delta": {"tool_calls": many}}]}),
                &mut |_| {},
            )
            .unwrap_err();
        assert!(matches!(e, WireError::Invalid(m) if m.contains("more than")));
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
