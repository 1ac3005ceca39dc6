//! Host plugins inside a request: calls run in the sandbox, tools used out of the box, a hostile
//! plugin's failure back to the model, client tools never run as plugins, the host-call budget.

use super::*;

#[test]
fn host_plugins_run_inside_the_request() {
    // Naming the plugin offers all its functions; the host runs the call and the model answers.
    let r = chat(json!({"messages": user("What is 17 * 3?"),
        "tools": [{"type": "function", "function": {"name": "thorn:calculator"}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 200, "conversation_id": "t-calc"}));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls = host_calls(&v);
    assert!(!calls.is_empty(), "{v}");
    assert_eq!(calls[0]["name"], "evaluate");
    assert_eq!(calls[0]["result"]["value"], 51.0, "{}", calls[0]);
    assert_ne!(v["choices"][0]["finish_reason"], "tool_calls");

    // The file reader reads inside its grant (the model picks the path; either the file's text comes back
    // or the plugin's own error does, never anything from outside /data).
    let r = chat(json!({"messages": user("Read the file notes.txt"),
        "tools": [{"type": "function", "function": {"name": "thorn:read_file"}}],
        "tool_choice": {"type": "function", "function": {"name": "read_file"}},
        "temperature": 0, "max_tokens": 200}));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls = host_calls(&v);
    assert_eq!(calls[0]["name"], "read_file", "{v}");
    match calls[0]["result"]["content"].as_str() {
        Some(text) => assert_eq!(text, "The launch code is 4242.\n"),
        None => assert!(calls[0]["error_kind"] == "tool", "{}", calls[0]),
    }
    eprintln!("read_file call: {}", calls[0]);

    // Streamed: each call and result shows up as it happens.
    let r = chat(json!({"messages": user("Compute 2 + 2."),
        "tools": [{"type": "function", "function": {"name": "thorn:evaluate"}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 200, "stream": true}));
    let data = r.sse();
    assert!(
        data.iter().any(|d| d.contains("thorn_host_tool_call\"")),
        "{data:?}"
    );
    // The host call streamed as it was generated, in tool_calls' form, and reassembles to the call run.
    let events: Vec<Value> = data
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["thorn_host_tool_calls"].as_array())
        .flatten()
        .filter(|d| d["index"] == 0)
        .map(|d| d["function"]["arguments"].as_str().unwrap().to_owned())
        .collect();
    let run = events
        .iter()
        .find_map(|e| e["choices"][0]["delta"].get("thorn_host_tool_call"))
        .expect("the call about to run");
    assert_eq!(streamed, run["arguments"].as_str().unwrap(), "{data:?}");
    assert!(
        events
            .iter()
            .all(|e| e["choices"][0]["delta"].get("tool_calls").is_none()),
        "a host call is not the client's: {data:?}"
    );
    assert!(
        data.iter().any(|d| d.contains("thorn_host_tool_result")),
        "{data:?}"
    );
    assert_eq!(data.last().unwrap(), "[DONE]");
}

#[test]
fn host_tools_are_used_out_of_the_box() {
    // The default tool use: the router picks the function, the call is forced, the template answers.
    let tools = json!([{"type": "function", "function": {"name": "thorn:calculator"}},
        {"type": "function", "function": {"name": "thorn:files"}}]);
    let ask = |text: &str, extra: Value| {
        let mut body = json!({"messages": user(text), "tools": tools, "temperature": 0,
            "max_tokens": 200});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        chat(body)
    };
    let r = ask("What is 17 * 3? Use the calculator.", json!({}));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["thorn_routed_tools"], json!(["evaluate"]), "{v}");
    let calls = host_calls(&v);
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["result"]["value"], 51.0, "{v}");
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    // The answer is the calculator's template: the value exactly as computed.
    assert_eq!(
        msg["content"],
        format!("{} = 51", args["expression"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Streamed, the same answer arrives as content deltas after the call.
    let data = ask(
        "What is 17 * 3? Use the calculator.",
        json!({"stream": true}),
    )
    .sse();
    let content: String = data
        .iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(content, msg["content"].as_str().unwrap(), "{data:?}");

    // A request offering only some of the installed functions routes them as the full set does: the
    // router scores among every installed function.
    for (text, only) in [
        ("What is 17 * 3? Use the calculator.", "thorn:evaluate"),
        ("Read the file notes.txt please.", "thorn:files"),
    ] {
        let full = ask(text, json!({"max_tokens": 1})).json();
        let body = json!({"messages": user(text), "temperature": 0, "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": only}}]});
        let subset = chat(body).json();
        let routed = |v: &Value| v["choices"][0]["message"]["thorn_routed_tools"].clone();
        assert_eq!(routed(&subset), routed(&full), "{text}: {subset} vs {full}");
        assert_ne!(routed(&full), json!([]), "{full}");
    }

    // A message no tool is about gets no tools at all: an answer, never a call.
    let r = ask("What is the capital of France?", json!({}));
    let v = r.json();
    assert_eq!(
        v["choices"][0]["message"]["thorn_routed_tools"],
        json!([]),
        "{v}"
    );
    assert!(host_calls(&v).is_empty(), "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string());

    // A from_request value is decoded as one of the request's own word spans.
    let text = "Read the file notes.txt please.";
    let v = ask(text, json!({})).json();
    assert_eq!(
        v["choices"][0]["message"]["thorn_routed_tools"],
        json!(["read_file"]),
        "{v}"
    );
    let calls = host_calls(&v);
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    let path = args["path"].as_str().unwrap();
    assert!(
        thorn_tools::request_spans(text).iter().any(|s| s == path),
        "{path:?} is not a span of {text:?}"
    );

    // The request can turn it off, and a bad setting is the client's error.
    let v = ask(
        "What is 17 * 3?",
        json!({"thorn_tool_use": {"routing": "off"}}),
    )
    .json();
    assert!(
        v["choices"][0]["message"]
            .get("thorn_routed_tools")
            .is_none(),
        "{v}"
    );
    for bad in [json!({"routing": "sideways"}), json!({"bogus": true})] {
        let r = ask("What is 17 * 3?", json!({"thorn_tool_use": bad}));
        assert_eq!(r.status, 400, "{}", r.body);
    }
}

#[test]
fn a_hostile_plugins_failure_goes_back_to_the_model() {
    let r = chat(
        json!({"messages": user("Call spin with n = 3 and target \"x\"."),
        "tools": [{"type": "function", "function": {"name": "thorn:spin"}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 200}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls = host_calls(&v);
    assert!(!calls.is_empty(), "no complete call: {v}");
    assert_eq!(calls[0]["name"], "spin");
    assert_eq!(calls[0]["error_kind"], "timeout", "{}", calls[0]);
    assert!(v["choices"][0]["message"]["content"].is_string());
    let m = http(server().addr, "GET", "/metrics", &[], b"");
    assert!(
        m.body
            .contains("thorn_plugin_calls_total{tool=\"spin\",outcome=\"timeout\"}"),
        "{}",
        m.body
    );
}

#[test]
fn client_tools_are_never_run_as_host_plugins() {
    // A client tool that happens to share a plugin function's name is the client's: it comes back as a
    // tool call, and the plugin does not run.
    let evaluate = json!({"type": "function", "function": {"name": "evaluate",
        "parameters": {"type": "object", "properties": {"op": {"enum": ["add", "multiply"]}},
                       "required": ["op"]}}});
    let r = chat(
        json!({"messages": user("What is 17 * 3?"), "tools": [evaluate],
        "tool_choice": "required", "temperature": 0, "max_tokens": 200}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert!(host_calls(&v).is_empty(), "{v}");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "evaluate"
    );
    // Asking for the host tool and defining a client tool of the same name is ambiguous: 400.
    let r = chat(json!({"messages": user("hi"), "tools": [evaluate,
        {"type": "function", "function": {"name": "thorn:calculator"}}]}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "tools");
    // An unknown host tool is a 400 that names it.
    let r = chat(json!({"messages": user("hi"),
        "tools": [{"type": "function", "function": {"name": "thorn:nope"}}]}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("nope"), "{}", r.body);
}

#[test]
fn zero_tool_rounds_is_a_400_and_runs_no_host_call() {
    let s = start_tuned(1024, 8, 2, ServerConfig::default(), |a| a);
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": user("What is 17 * 3?"), "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "thorn:calculator"}}],
            "temperature": 0, "max_tokens": 64, "max_tool_rounds": 0}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "max_tool_rounds", "{}", r.body);
    let m = http(s.addr, "GET", "/metrics", &[], b"");
    assert!(
        !m.body.contains("tool=\"evaluate\""),
        "the plugin never ran: {}",
        m.body
    );
}

#[test]
fn host_calls_past_the_budget_are_not_run() {
    let s = start_tuned(1024, 8, 2, ServerConfig::default(), |a| {
        a.with_max_host_calls(0)
    });
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": user("What is 17 * 3?"), "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "thorn:calculator"}}],
            "temperature": 0, "max_tokens": 200, "max_tool_rounds": 1000}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let calls = host_calls(&v);
    assert!(!calls.is_empty(), "{v}");
    for c in &calls {
        assert_eq!(c["error_kind"], "call_budget", "{c}");
    }
    let m = http(s.addr, "GET", "/metrics", &[], b"");
    assert!(
        m.body
            .contains("thorn_plugin_calls_total{tool=\"evaluate\",outcome=\"call_budget\"}")
            && !m.body.contains("tool=\"evaluate\",outcome=\"ok\""),
        "the plugin never ran: {}",
        m.body
    );
}
