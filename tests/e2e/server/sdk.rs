//! The real clients against the server: the openai SDK (a streamed tool call; the Responses API), the
//! OpenAI Agents SDK (over chat completions and over Responses, its default),
//! LangChain's bind_tools, and the anthropic SDK over the Messages API.

use super::*;

#[test]
fn the_openai_sdk_accumulates_a_streamed_tool_call() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let base = format!("http://{}", server().addr);
    let r = thorn_tests::run_client(&python, "openai_stream_tool_call.py", &[&base]);
    let deltas: Vec<&str> = r["argument_deltas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert!(deltas.len() >= 2, "{r}");
    let (done, fin, plain) = (&r["done"][0], &r["final_calls"], &r["plain_calls"]);
    assert_eq!(r["done"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(done["name"], "get_weather", "{r}");
    // What the SDK accumulated is the concatenation of the deltas, parses, and equals the non-streamed
    // call (same greedy decode; only the id differs).
    assert_eq!(done["arguments"], deltas.concat(), "{r}");
    assert_eq!(fin.as_array().unwrap().len(), 1, "{r}");
    assert_eq!(fin[0]["arguments"], done["arguments"], "{r}");
    assert_eq!(fin[0]["name"], plain[0]["name"], "{r}");
    assert_eq!(fin[0]["arguments"], plain[0]["arguments"], "{r}");
    assert_ne!(fin[0]["id"], plain[0]["id"], "{r}");
    let args: Value = serde_json::from_str(fin[0]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        args["city"].is_string() && ["c", "f"].contains(&args["unit"].as_str().unwrap()),
        "{r}"
    );
    assert_eq!(r["final_finish_reason"], "tool_calls", "{r}");
    assert_eq!(r["plain_finish_reason"], "tool_calls", "{r}");
    assert_eq!(r["streamed_content"], "", "{r}");
    assert!(r["chunks_with_calls"].as_u64().unwrap() >= 3, "{r}");
}

#[test]
fn the_openai_agents_sdk_runs_an_agent_with_a_function_tool() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let base = format!("http://{}", server().addr);
    let r = thorn_tests::run_client(&python, "openai_agents_tool.py", &[&base]);
    for mode in ["plain", "stream"] {
        let run = &r[mode];
        // The tool ran once, on the city the model asked about, and the run ended with an answer.
        let calls = run["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{mode}: {r}");
        assert!(!calls[0].as_str().unwrap().is_empty(), "{mode}: {r}");
        assert!(!run["final"].as_str().unwrap().is_empty(), "{mode}: {r}");
    }
    assert_eq!(r["plain"]["calls"], r["stream"]["calls"], "{r}");
    let kinds: Vec<&str> = r["plain"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "tool_call_item",
            "tool_call_output_item",
            "message_output_item"
        ],
        "{r}"
    );
    let events = r["stream"]["events"].as_array().unwrap();
    for e in [
        "item:tool_call_item",
        "item:tool_call_output_item",
        "raw_response_event",
    ] {
        assert!(events.contains(&json!(e)), "{e}: {r}");
    }
}

#[test]
fn langchain_bind_tools_parses_the_call_invoked_and_streamed() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let base = format!("http://{}", server().addr);
    let r = thorn_tests::run_client(&python, "langchain_bind_tools.py", &[&base]);
    let (inv, st) = (&r["invoked"], &r["streamed"]);
    assert_eq!(inv.as_array().unwrap().len(), 1, "{r}");
    assert_eq!(inv[0]["name"], "get_weather", "{r}");
    assert!(inv[0]["args"]["city"].is_string(), "{r}");
    // LangChain merged the streamed chunks into the same call (only the id differs).
    assert_eq!(st.as_array().unwrap().len(), 1, "{r}");
    assert_eq!(st[0]["name"], inv[0]["name"], "{r}");
    assert_eq!(st[0]["args"], inv[0]["args"], "{r}");
    assert!(r["chunks_with_call_parts"].as_u64().unwrap() >= 3, "{r}");
    assert_eq!(r["invalid"], json!([]), "{r}");
}

#[test]
fn the_anthropic_sdk_speaks_the_messages_api() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let base = format!("http://{}", server().addr);
    let r = thorn_tests::run_client(&python, "anthropic_messages.py", &[&base]);
    // Not streamed: a forced call is a tool_use block with object input.
    let plain = &r["plain"];
    assert_eq!(plain["stop_reason"], "tool_use", "{r}");
    let call = plain["blocks"].as_array().unwrap().last().unwrap();
    assert_eq!(call["type"], "tool_use", "{r}");
    assert_eq!(call["name"], "get_weather", "{r}");
    assert!(call["input"]["city"].is_string(), "{r}");
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{r}");
    let usage = &plain["usage"];
    assert!(
        usage["input_tokens"].as_u64().unwrap()
            + usage["cache_read_input_tokens"].as_u64().unwrap()
            > 20,
        "{r}"
    );
    assert!(usage["output_tokens"].as_u64().unwrap() > 0, "{r}");
    // Streamed: the SDK accumulated several input_json_delta fragments into the same call.
    let stream = &r["stream"];
    let fragments: Vec<&str> = stream["fragments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(fragments.len() >= 2, "{r}");
    let streamed = stream["blocks"].as_array().unwrap().last().unwrap();
    assert_eq!(streamed["input"], call["input"], "{r}");
    assert_eq!(streamed["name"], "get_weather", "{r}");
    let joined: Value = serde_json::from_str(&fragments.concat()).unwrap();
    assert_eq!(joined, call["input"], "{r}");
    assert_eq!(stream["stop_reason"], "tool_use", "{r}");
    assert!(
        stream["texts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| !t.as_str().unwrap().contains("tool_call")),
        "{r}"
    );
    // The result went back as a tool_result and the model answered.
    assert!(
        ["end_turn", "max_tokens"].contains(&r["follow"]["stop_reason"].as_str().unwrap()),
        "{r}"
    );
    assert_eq!(r["follow"]["types"][0], "text", "{r}");
    // Text streams and reassembles; count_tokens counts.
    assert!(!r["text"]["text"].as_str().unwrap().is_empty(), "{r}");
    assert_eq!(r["text"]["text"], r["text"]["final_text"], "{r}");
    assert!(
        ["end_turn", "max_tokens"].contains(&r["text"]["stop_reason"].as_str().unwrap()),
        "{r}"
    );
    assert!(r["count"].as_u64().unwrap() > 20, "{r}");
    assert_eq!(
        r["stopped"],
        json!({"stop_reason": "stop_sequence", "stop_sequence": " "}),
        "{r}"
    );
    // A host tool ran inside the request: the SDK read the stream to its end, and the final message lists
    // the host call with its result.
    assert_eq!(
        r["host"]["stop_reason"], r["host_plain"]["stop_reason"],
        "{r}"
    );
    let hosted = &r["host_plain"]["thorn_host_tool_calls"][0];
    assert_eq!(hosted["name"], "evaluate", "{r}");
    assert_eq!(hosted["result"]["value"], 51.0, "{r}");
    assert!(
        r["host"]["events"]
            .as_array()
            .unwrap()
            .contains(&json!("message_stop")),
        "{r}"
    );
    // Errors are the SDK's typed exceptions with Anthropic's bodies.
    assert_eq!(r["errors"]["model"], json!([404, "not_found_error"]), "{r}");
    assert_eq!(r["errors"]["image"][0], 400, "{r}");
    assert_eq!(r["errors"]["image"][1], "invalid_request_error", "{r}");
    assert!(
        r["errors"]["image"][2]
            .as_str()
            .unwrap()
            .contains("messages[0].content[0].type"),
        "{r}"
    );
}

#[test]
fn the_openai_sdk_speaks_the_responses_api() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let base = format!("http://{}", server().addr);
    let r = thorn_tests::run_client(&python, "openai_responses.py", &[&base]);
    // Plain text, with usage.
    let plain = &r["plain"];
    assert!(plain["id"].as_str().unwrap().starts_with("resp_"), "{r}");
    assert!(!plain["text"].as_str().unwrap().is_empty(), "{r}");
    assert!(plain["usage"]["input_tokens"].as_u64().unwrap() > 0, "{r}");
    assert!(
        plain["kinds"]
            .as_array()
            .unwrap()
            .contains(&json!("message")),
        "{r}"
    );
    // A required call: one function_call item whose arguments parse and match the schema.
    let calls = r["call"]["calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{r}");
    assert_eq!(calls[0]["name"], "get_weather", "{r}");
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{r}");
    assert!(
        calls[0]["call_id"].as_str().unwrap().starts_with("call_"),
        "{r}"
    );
    // Its result, as input items or after previous_response_id: an answer either way, the same one (the
    // stored conversation is the one the items spell out).
    for round in ["items_round", "previous_round"] {
        assert!(
            !r[round]["text"].as_str().unwrap().is_empty(),
            "{round}: {r}"
        );
    }
    assert_eq!(r["items_round"]["text"], r["previous_round"]["text"], "{r}");
    assert_eq!(r["previous_round"]["previous"], r["call"]["id"], "{r}");
    // Streamed: typed events from created to completed, argument deltas that join to the final call.
    let s = &r["stream"];
    assert_eq!(s["first"], "response.created", "{r}");
    assert_eq!(s["last"], "response.completed", "{r}");
    for kind in [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ] {
        assert!(
            s["kinds"].as_array().unwrap().contains(&json!(kind)),
            "{kind}: {r}"
        );
    }
    let joined: String = s["deltas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(s["final"][0]["arguments"], joined, "{r}");
    assert_eq!(s["final"][0]["arguments"], calls[0]["arguments"], "{r}");
    // A custom tool: a custom_tool_call item with freeform input (a string, whatever the model wrote),
    // answered through a custom_tool_call_output item; streamed, its input deltas join to the input.
    let custom = &r["custom"]["calls"];
    assert_eq!(custom[0]["name"], "apply_patch", "{r}");
    assert!(custom[0]["input"].is_string(), "{r}");
    assert!(r["custom"]["answer"].is_string(), "{r}");
    let cs = &r["custom_stream"];
    let joined: String = cs["deltas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(cs["done"], json!(joined), "{r}");
    assert_eq!(cs["final"][0], json!(joined), "{r}");
    assert_eq!(
        cs["final"][0], custom[0]["input"],
        "the same greedy call: {r}"
    );
    // A json_schema answer is that JSON.
    let answer: Value = serde_json::from_str(r["json"].as_str().unwrap()).unwrap();
    assert!(answer["city"].is_string(), "{r}");
    // A host tool ran in thorn and its result answered.
    assert!(r["host"]["text"].as_str().unwrap().contains("51"), "{r}");
    assert!(!r["host"]["extra"].as_array().unwrap().is_empty(), "{r}");
    // An unknown previous_response_id is a 400 naming the field.
    assert_eq!(r["unknown_previous"]["status"], 400, "{r}");
    assert_eq!(
        r["unknown_previous"]["param"], "previous_response_id",
        "{r}"
    );
}

#[test]
fn the_openai_agents_sdks_default_model_runs_a_function_tool_over_responses() {
    let Some(python) = thorn_tests::client_python() else {
        return;
    };
    let base = format!("http://{}", server().addr);
    let r = thorn_tests::run_client(&python, "openai_agents_responses.py", &[&base]);
    for mode in ["plain", "stream"] {
        let run = &r[mode];
        let calls = run["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{mode}: {r}");
        assert!(!calls[0].as_str().unwrap().is_empty(), "{mode}: {r}");
        assert!(!run["final"].as_str().unwrap().is_empty(), "{mode}: {r}");
    }
    assert_eq!(r["plain"]["calls"], r["stream"]["calls"], "{r}");
    let items = r["plain"]["items"].as_array().unwrap();
    assert!(items.contains(&json!("tool_call_item")), "{r}");
    assert!(items.contains(&json!("tool_call_output_item")), "{r}");
}
