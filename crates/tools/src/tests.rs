use super::*;
use serde_json::json;

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}})
}

#[test]
fn parses_prose_and_calls() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\
                <tool_call>{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Rome\\\"}\"}";
    let (prose, calls) = parse_tool_calls(text).unwrap();
    assert_eq!(prose, "Let me check.");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
    assert_eq!(
        calls[1].arguments,
        json!({"city": "Rome"}),
        "string-encoded arguments and an unclosed last block"
    );
    assert_eq!(
        parse_tool_calls("no calls here").unwrap(),
        ("no calls here".into(), vec![])
    );
}

#[test]
fn rejects_malformed_calls() {
    for bad in [
        "<tool_call>{\"name\": 3}</tool_call>",
        "<tool_call>[1]</tool_call>",
        "<tool_call>{\"name\": \"x\", \"arguments\": [1]}</tool_call>",
        "<tool_call>{oops</tool_call>",
    ] {
        assert!(
            matches!(parse_tool_calls(bad), Err(ToolError::Malformed(_))),
            "{bad}"
        );
    }
}

#[test]
fn validates_against_the_schema() {
    let set = ToolSet::new(&[weather()]).unwrap();
    let ok = ParsedCall {
        name: "get_weather".into(),
        arguments: json!({"city": "Paris", "unit": "celsius"}),
    };
    assert_eq!(set.check(&ok), Ok(()));
    let missing = ParsedCall {
        name: "get_weather".into(),
        arguments: json!({"unit": "kelvin"}),
    };
    let err = set.check(&missing).unwrap_err().to_string();
    assert!(err.contains("city") && err.contains("kelvin"), "{err}");
    let unknown = ParsedCall {
        name: "launch".into(),
        arguments: json!({}),
    };
    assert_eq!(
        set.check(&unknown),
        Err(ToolError::UnknownTool("launch".into()))
    );
}

#[test]
fn bad_definitions_name_the_tool() {
    let bad_schema = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}});
    assert!(
        matches!(ToolSet::new(&[bad_schema]), Err(ToolError::Schema { tool, .. }) if tool == "f")
    );
    assert!(matches!(
        ToolSet::new(&[weather(), weather()]),
        Err(ToolError::Duplicate(_))
    ));
    assert!(matches!(
        ToolSet::new(&[json!({"type": "function"})]),
        Err(ToolError::Definition { index: 0, .. })
    ));
    assert!(matches!(
        ToolSet::new(&[json!({"type": "retrieval", "function": {"name": "x"}})]),
        Err(ToolError::Definition { .. })
    ));
    let bad_name = json!({"type": "function", "function": {"name": "rm -rf"}});
    assert!(ToolSet::new(&[bad_name]).is_err());
}

#[test]
fn system_prompt_lists_the_tools_compactly() {
    let set = ToolSet::new(&[weather()]).unwrap();
    let p = set.system_prompt();
    assert!(
        p.contains("<tools>\n[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\""),
        "{p}"
    );
    assert!(p.contains("<tool_call></tool_call>"));
}

#[test]
fn tool_choice_and_response_format_parse_openai_values() {
    assert_eq!(
        ToolChoice::from_openai(&json!("none")).unwrap(),
        ToolChoice::None
    );
    assert_eq!(
        ToolChoice::from_openai(&Value::Null).unwrap(),
        ToolChoice::Auto
    );
    assert_eq!(
        ToolChoice::from_openai(&json!("required")).unwrap(),
        ToolChoice::Required
    );
    assert_eq!(
        ToolChoice::from_openai(&json!({"type": "function", "function": {"name": "get_weather"}}))
            .unwrap(),
        ToolChoice::Function("get_weather".into())
    );
    for bad in [json!("sometimes"), json!(3), json!({"type": "function"})] {
        let err = ToolChoice::from_openai(&bad).unwrap_err();
        assert!(err.to_string().starts_with("tool_choice:"), "{err}");
    }
    let set = ToolSet::new(&[weather()]).unwrap();
    assert!(
        ToolChoice::Function("get_weather".into())
            .check(&set)
            .is_ok()
    );
    assert!(ToolChoice::Function("nope".into()).check(&set).is_err());
    assert!(ToolChoice::Required.check(&ToolSet::default()).is_err());

    assert_eq!(
        ResponseFormat::from_openai(&json!({"type": "json_object"})).unwrap(),
        ResponseFormat::JsonObject
    );
    let f = ResponseFormat::from_openai(&json!({"type": "json_schema",
        "json_schema": {"name": "n", "strict": true, "schema": {"type": "object"}}}))
    .unwrap();
    assert_eq!(f.schema(), Some((json!({"type": "object"}), true)));
    for bad in [
        json!({"type": "xml"}),
        json!({}),
        json!({"type": "json_schema"}),
        json!({"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
    ] {
        assert!(ResponseFormat::from_openai(&bad).is_err(), "{bad}");
    }
}

#[test]
fn reply_validates_and_numbers_the_calls() {
    let set = ToolSet::new(&[weather()]).unwrap();
    let r = set
        .reply("ok <tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}</tool_call>")
        .unwrap();
    assert_eq!(r.content, "ok");
    assert_eq!(r.calls.len(), 1);
    assert_eq!(r.calls[0].function.arguments, json!({"city": "Oslo"}));
    let before = validation_failures();
    let err = set
        .reply(
            "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"unit\":\"kelvin\"}}</tool_call>",
        )
        .unwrap_err();
    assert!(matches!(err, ToolError::Invalid { .. }), "{err}");
    assert_eq!(validation_failures(), before + 1, "counted as a bug");
    let ids: std::collections::HashSet<String> = (0..100)
        .map(|_| {
            set.reply(
                "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"x\"}}</tool_call>",
            )
            .unwrap()
            .calls[0]
                .id
                .clone()
        })
        .collect();
    assert_eq!(ids.len(), 100, "ids are unique");
}

#[test]
fn messages_for_a_template_without_tools_carry_the_protocol() {
    use crate::chat::{FunctionCall, Message, Role, ToolCall};
    let set = ToolSet::new(&[weather()]).unwrap();
    let mut call = Message::assistant("Checking.");
    call.tool_calls.push(ToolCall {
        id: "call_1".into(),
        kind: "function",
        function: FunctionCall {
            name: "get_weather".into(),
            arguments: json!({"city": "Oslo"}),
        },
    });
    let mut result = Message::new(Role::Tool, "{\"temp\":3}");
    result.tool_call_id = Some("call_1".into());
    let msgs = [Message::user("weather in Oslo?"), call, result];
    let out = set.messages_for(false, &msgs);
    assert_eq!(out.len(), 4);
    assert_eq!(out[0].role, Role::System);
    assert!(out[0].content.contains("<tools>"));
    assert_eq!(
        out[2].content,
        "Checking.<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}</tool_call>"
    );
    assert!(out[2].tool_calls.is_empty());
    assert_eq!(
        out[3].content,
        "<tool_response>\n{\"temp\":3}\n</tool_response>"
    );
    let with_sys = set.messages_for(false, &[Message::system("Be brief."), Message::user("hi")]);
    assert!(with_sys[0].content.starts_with("Be brief.\n\n"));
    assert_eq!(set.messages_for(true, &msgs), msgs.to_vec());
}

#[test]
fn a_closing_tag_inside_a_string_does_not_end_the_call() {
    let text = "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"a}}</tool_call> b\"}}</tool_call>";
    let (prose, calls) = parse_tool_calls(text).unwrap();
    assert_eq!(prose, "");
    assert_eq!(calls[0].arguments["city"], "a}}</tool_call> b");
    assert!(matches!(
        parse_tool_calls("<tool_call>{\"name\":\"x\"} junk</tool_call>"),
        Err(ToolError::Malformed(_))
    ));
}

#[test]
fn a_cut_short_generation_keeps_its_complete_calls() {
    let one = "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>";
    assert_eq!(complete_calls_prefix(one), one);
    let cut =
        format!("{one}<tool_call>{{\"name\":\"b\",\"arguments\":{{\"x\":\"}}</tool_call> more");
    assert_eq!(complete_calls_prefix(&cut), one);
    assert_eq!(complete_calls_prefix("prose only"), "prose only");
    assert_eq!(complete_calls_prefix(&format!("{one}<tool_")), one);
    // A tag inside a string of an unfinished call is not a block boundary.
    let cut = format!(
        "{one}<tool_call>{{\"name\":\"b\",\"arguments\":{{\"x\":\"y</tool_call><tool_call></tool_call>z"
    );
    assert_eq!(complete_calls_prefix(&cut), one);
    assert_eq!(
        complete_calls_prefix(&format!(
            "{one}<tool_call>{{\"name\":\"a\",\"arguments\":{{}}}}"
        )),
        one
    );
}

#[test]
fn multi_byte_text_after_a_call_is_an_error_not_a_panic() {
    let tail = format!("a{}", "é".repeat(30));
    let text = format!("<tool_call>{{\"name\":\"w\",\"arguments\":{{}}}}x{tail}</tool_call>");
    for cut in 0..text.len() {
        if text.is_char_boundary(cut) {
            let _ = parse_tool_calls(&text[..cut]);
        }
    }
    let text = format!("<tool_call>{{\"name\":\"w\",\"arguments\":{{}}}}{tail}</tool_call>");
    assert!(matches!(
        parse_tool_calls(&text),
        Err(ToolError::Malformed(_))
    ));
}

#[test]
fn oversized_consts_enums_and_patterns_are_refused_with_the_limit() {
    let tool = |params: Value| json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
    let long = "x".repeat(20_000);
    for (params, what) in [
        (
            json!({"type": "object", "properties": {"a": {"const": long}}}),
            "const",
        ),
        (
            json!({"type": "object", "properties": {"a": {"enum": (0..2000).collect::<Vec<_>>()}}}),
            "enum",
        ),
        (
            json!({"type": "object", "properties": {"a": {"type": "string", "pattern": long}}}),
            "pattern",
        ),
    ] {
        let err = ToolSet::new(tool(params).as_array().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains(what) && err.contains("\"f\""), "{err}");
    }
    let fmt =
        json!({"type": "json_schema", "json_schema": {"name": "big", "schema": {"const": long}}});
    let err = ResponseFormat::from_openai(&fmt).unwrap_err().to_string();
    assert!(err.contains("4096"), "{err}");
    // Within the limits all is well.
    assert!(
        ToolSet::new(
            tool(json!({"type": "object", "properties": {"a": {"const": "ok"}}}))
                .as_array()
                .unwrap()
        )
        .is_ok()
    );
}

#[test]
fn a_narrowed_tool_validates_under_its_new_schema_and_keeps_its_prompt() {
    let def = json!({"type": "function", "function": {"name": "recall", "parameters": {"type": "object",
        "properties": {"key": {"type": "string"}}, "required": ["key"]}}});
    let mut set = ToolSet::new(std::slice::from_ref(&def)).unwrap();
    let call = |key: &str| ParsedCall {
        name: "recall".into(),
        arguments: json!({ "key": key }),
    };
    assert!(set.check(&call("anything")).is_ok());
    let narrow = json!({"type": "object", "properties": {"key": {"type": "string",
        "enum": ["locker"]}}, "required": ["key"]});
    set.narrow("recall", narrow.clone()).unwrap();
    assert!(set.check(&call("locker")).is_ok());
    assert!(set.check(&call("dentist")).is_err());
    assert_eq!(
        set.definitions(),
        &[def],
        "the prompt shows the tool as defined"
    );
    assert_eq!(set.get("recall").unwrap().parameters, narrow);
    assert!(matches!(
        set.narrow("nope", json!({"type": "object"})),
        Err(ToolError::UnknownTool(_))
    ));
    // A schema that does not compile leaves the tool as it was.
    assert!(set.narrow("recall", json!({"type": 7})).is_err());
    assert!(set.check(&call("dentist")).is_err());
}
