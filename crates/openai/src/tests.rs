use super::*;
use serde_json::{Value, json};
use std::borrow::Cow;

fn to_string<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap()
}

#[test]
fn an_answer_is_written_in_openais_field_order_with_its_nulls() {
    let out = ChatCompletion {
        id: "chatcmpl-x".into(),
        object: "chat.completion".into(),
        created: 7,
        model: "m".into(),
        system_fingerprint: Some("fp".into()),
        choices: vec![ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant".into(),
                tool_calls: vec![ToolCall::function("call_1", "f", "{\"a\":1}")],
                ..AssistantMessage::default()
            },
            logprobs: None,
            finish_reason: Some("tool_calls".into()),
        }],
        usage: Some(Usage::new(0, 0, 0)),
    };
    assert_eq!(
        to_string(&out),
        concat!(
            r#"{"id":"chatcmpl-x","object":"chat.completion","created":7,"model":"m","#,
            r#""system_fingerprint":"fp","choices":[{"index":0,"message":{"role":"assistant","#,
            r#""content":null,"refusal":null,"tool_calls":[{"id":"call_1","type":"function","#,
            r#""function":{"name":"f","arguments":"{\"a\":1}"}}]},"logprobs":null,"#,
            r#""finish_reason":"tool_calls"}],"usage":{"prompt_tokens":0,"completion_tokens":0,"#,
            r#""total_tokens":0,"prompt_tokens_details":{"cached_tokens":0}}}"#
        )
    );
    // And it reads back as itself.
    let back: ChatCompletion<'static> = serde_json::from_str(&to_string(&out)).unwrap();
    assert_eq!(back, out);
}

#[test]
fn a_delta_carries_only_its_own_fields() {
    let d = Delta {
        tool_calls: Some(vec![ToolCallDelta::start(0, "call_1", "f")]),
        ..Delta::default()
    };
    assert_eq!(
        to_string(&d),
        r#"{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]}"#
    );
    let d = Delta::call(true, ToolCallDelta::arguments(2, "{\"a\":"));
    assert_eq!(
        to_string(&d),
        r#"{"thorn_host_tool_calls":[{"index":2,"function":{"arguments":"{\"a\":"}}]}"#
    );
    assert_eq!(to_string(&Delta::default()), "{}");
    // `reasoning` is read, never written.
    let d = Delta {
        reasoning: Some("r".into()),
        ..Delta::default()
    };
    assert_eq!(to_string(&d), "{}");
}

#[test]
fn chunks_from_other_servers_read_leniently() {
    // Nulls where OpenAI leaves fields out, an unknown field, reasoning under both names, arguments as an
    // object, a call without an index, no id or model at all.
    let c: ChatChunk<'static> = serde_json::from_value(json!({
        "choices": [{"delta": {"role": null, "content": null, "reasoning": "hm", "reasoning_content": "hm",
            "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}], "extra": 1},
            "logprobs": null, "finish_reason": null}],
        "usage": null, "timings": {"predicted_ms": 1.5}
    }))
    .unwrap();
    let d = &c.choices[0].delta;
    assert_eq!(d.reasoning(), Some("hm"));
    let call = &d.tool_calls.as_ref().unwrap()[0];
    assert_eq!(call.index, None);
    assert_eq!(call.function.arguments.as_deref(), Some("{\"x\":1}"));
    assert!(c.usage.is_none() && c.error.is_none());

    let c: ChatChunk<'static> =
        serde_json::from_value(json!({"choices": null, "usage": {"prompt_tokens": 3}})).unwrap();
    assert!(c.choices.is_empty());
    assert_eq!(
        c.usage.map(|u| (u.prompt_tokens, u.cached_tokens())),
        Some((3, None))
    );

    // An error event is kept as the server worded it.
    let c: ChatChunk<'static> =
        serde_json::from_value(json!({"error": {"message": "out of memory"}})).unwrap();
    assert_eq!(c.error, Some(json!({"message": "out of memory"})));

    // A known field of the wrong type is an error.
    let e = serde_json::from_value::<ChatChunk<'static>>(
        json!({"choices": [{"delta": {"content": 5}}]}),
    )
    .unwrap_err();
    assert!(e.to_string().contains("expected a string"), "{e}");
    let e = serde_json::from_value::<ToolCallDelta<'static>>(json!({"function": {"arguments": 5}}))
        .unwrap_err();
    assert!(e.to_string().contains("arguments as JSON text"), "{e}");
}

#[test]
fn a_client_request_writes_only_what_it_sets() {
    let tools = [json!({"type": "function", "function": {"name": "f"}})];
    let mut assistant = Message::text("assistant", "");
    assistant.content = None;
    assistant.tool_calls = Some(vec![ToolCall::function("c1", "f", "{}")]);
    let r = ChatRequest {
        model: Some("m".into()),
        messages: vec![Message::text("user", "hi"), assistant],
        stream: Some(true),
        stream_options: Some(StreamOptions {
            include_usage: true,
        }),
        tools: Some(Cow::Borrowed(&tools)),
        stop: Some(Stop::Many(vec!["END".into()])),
        ..ChatRequest::default()
    };
    assert_eq!(
        serde_json::to_value(&r).unwrap(),
        json!({"model": "m", "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
               "stream": true, "stream_options": {"include_usage": true}, "tools": tools, "stop": ["END"]})
    );
    let back: ChatRequest<'static> =
        serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
    assert_eq!(back, r);
}

#[test]
fn a_server_reads_what_clients_send() {
    let r: ChatRequest<'static> = serde_json::from_value(json!({
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "4"}],
        "stop": "x", "thorn_tool_use": {"routing": "lexical"}, "unknown": [1]
    }))
    .unwrap();
    assert!(matches!(&r.messages[0].content, Some(Content::Parts(p)) if p.len() == 2));
    let call = &r.messages[1].tool_calls.as_ref().unwrap()[0];
    assert_eq!(
        (call.kind.as_deref(), call.function.arguments.as_ref()),
        (None, "")
    );
    assert_eq!(r.stop.map(Stop::into_vec), Some(vec!["x".to_owned()]));
    assert_eq!(
        r.thorn_tool_use.and_then(|o| o.routing),
        Some(ToolRouting::Lexical)
    );
    // thorn's own extension refuses what it does not know.
    assert!(
        serde_json::from_value::<ChatRequest<'static>>(
            json!({"messages": [], "thorn_tool_use": {"route": "off"}})
        )
        .is_err()
    );
    let v: Value = serde_json::to_value(ModelList {
        object: "list".into(),
        data: vec![],
    })
    .unwrap();
    assert_eq!(v, json!({"object": "list", "data": []}));
}
