//! Mistral's `[TOOL_CALLS]` array: detection from Nemo's template, the grammar over a vocabulary where
//! `[TOOL_CALLS]` is a control token (and where it is text), the parser, the streamed deltas, and past
//! calls with their ids through the template.

use super::*;
use crate::format::mistral as fmt;

/// Mistral-Nemo-Instruct-2407's chat template (Apache-2.0; see tests/templates/README.md).
const NEMO: &str = include_str!("../../../tests/templates/mistral-nemo.jinja");

#[test]
fn tool_format_mistral_is_detected_and_parses_arrays_of_calls() {
    assert_eq!(ToolFormat::detect(NEMO), ToolFormat::Mistral);
    let tools = weather_tools(ToolFormat::Mistral);
    // Two calls in one array, the ids the model learned from past calls, Small 3's space.
    let text = "Checking. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}, \"id\": \"a1b2c3d4e\"}, \
                {\"name\": \"note\", \"arguments\": \"{\\\"text\\\": \\\"x,]y\\\"}\"}]";
    let reply = tools.reply(text).unwrap();
    assert_eq!(reply.content, "Checking.");
    assert_eq!(reply.calls.len(), 2);
    assert_eq!(
        reply.calls[0].function.arguments,
        json!({"city": "Oslo", "days": 2})
    );
    assert_eq!(
        reply.calls[1].function.arguments,
        json!({"text": "x,]y"}),
        "arguments given as a JSON string"
    );
    // Two sections, and a bare object after the token, read the same.
    let (_, calls) = tools
        .format()
        .parse(
            &tools,
            "[TOOL_CALLS][{\"name\":\"note\",\"arguments\":{\"text\":\"a\"}}][TOOL_CALLS]{\"name\":\"note\",\"arguments\":{\"text\":\"b\"}}",
        )
        .unwrap();
    assert_eq!(calls.len(), 2);
    // Broken forms are errors of the format, never panics.
    for bad in [
        "[TOOL_CALLS] nothing",
        "[TOOL_CALLS][{\"name\": 3}]",
        "[TOOL_CALLS][{\"name\": \"note\", \"arguments\": [1]}]",
        "[TOOL_CALLS][{\"name\": \"note\"} {\"name\": \"note\"}]",
        "[TOOL_CALLS][{\"name\": \"note\"}] trailing",
        "[TOOL_CALLS][{\"name\": \"no",
    ] {
        assert!(
            matches!(
                tools.format().parse(&tools, bad),
                Err(ToolError::Malformed(_))
            ),
            "{bad}"
        );
    }
}

#[test]
fn tool_format_mistral_grammar_spells_the_control_token_as_the_token() {
    let tools = weather_tools(ToolFormat::Mistral);
    let one = tools
        .format()
        .write_call(&tools, "note", &json!({"text": "hi"}));
    assert_eq!(
        one,
        "[TOOL_CALLS][{\"name\":\"note\",\"arguments\":{\"text\":\"hi\"}}]"
    );
    let two = "[TOOL_CALLS][{\"name\":\"note\",\"arguments\":{\"text\":\"hi\"}}, \
               {\"name\":\"get_weather\",\"arguments\":{\"city\":\"Rome\",\"days\":1}}]";
    let parallel = tools.format().calls_grammar(&tools, None, true, None);
    let single = tools.format().calls_grammar(&tools, None, false, None);
    let ctl = &[fmt::OPEN];
    // With the control token in the vocabulary, the grammar takes the token and not its spelling.
    assert!(accepts_with(&parallel, &one, ctl) && accepts_with(&parallel, two, ctl));
    assert!(accepts_with(&single, &one, ctl) && !accepts_with(&single, two, ctl));
    assert!(
        accepts_with(&single, &one.replace("][", "] ["), ctl),
        "Small 3's space"
    );
    let spelled = "[TOOL_CALL".to_owned() + &one["[TOOL_CALL".len()..];
    assert!(!accepts_with(&parallel, &format!("x{spelled}"), ctl));
    // A model without the token writes it as text.
    assert!(accepts(&parallel, &one) && accepts(&parallel, two));
    // Each call is its tool's schema.
    assert!(!accepts_with(
        &parallel,
        &one.replace("hi\"}", "hi\",\"x\":1}"),
        ctl
    ));
    assert!(!accepts_with(
        &parallel,
        &two.replace("\"days\":1", "\"days\":9"),
        ctl
    ));
    // With an answer schema, a JSON answer is the alternative; a named tool allows only that tool.
    let answer =
        tools
            .format()
            .calls_grammar(&tools, None, false, Some(&json!({"type": "integer"})));
    assert!(accepts_with(&answer, "42", ctl) && accepts_with(&answer, &one, ctl));
    let only = tools
        .format()
        .calls_grammar(&tools, Some("get_weather"), false, None);
    assert!(!accepts_with(&only, &one, ctl));
}

#[test]
fn tool_format_mistral_streams_deltas_that_join_to_the_parse_and_keeps_complete_calls() {
    let tools = weather_tools(ToolFormat::Mistral);
    let text = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"S\u{e3}o \\\"P\\\"\", \"days\": 3, \"where\": {\"lat\": -23.5, \"lon\": -46.6}}}, \
                {\"name\": \"note\", \"arguments\": {\"text\": \"[a], {b}\"}}]";
    let (_, parsed) = tools.format().parse(&tools, text).unwrap();
    assert_eq!(parsed.len(), 2);
    for size in [1, 2, 7, text.len()] {
        let (calls, ended) = stream(&tools, text, size);
        assert_eq!(ended, 2, "piece size {size}");
        for (c, p) in calls.iter().zip(&parsed) {
            assert_eq!(
                (c.0.as_str(), c.1.clone()),
                (p.name.as_str(), p.arguments.to_string())
            );
        }
    }
    // Cut short: the complete calls stay, the partial one and a partial token go.
    let first_end = text.find("}}}, ").unwrap() + 3;
    let cut = &text[..text.len() - 12];
    assert_eq!(tools.complete_prefix(cut), &text[..first_end]);
    assert_eq!(
        tools
            .format()
            .parse(&tools, &text[..first_end])
            .unwrap()
            .1
            .len(),
        1
    );
    assert_eq!(tools.complete_prefix("Hello [TOOL_CA"), "Hello ");
    assert_eq!(tools.complete_prefix(text), text);
}

#[test]
fn tool_format_mistral_history_renders_through_nemos_template_with_its_ids() {
    let tools = weather_tools(ToolFormat::Mistral);
    let template = ChatTemplate::new(NEMO).unwrap();
    assert!(template.knows_tools());
    let mut call = Message::assistant("");
    call.tool_calls.push(ToolCall {
        // A client's id, not Nemo's nine characters: given a nine-character form.
        id: "call_0f3a9c2e7b".into(),
        kind: "function",
        function: FunctionCall {
            name: "note".into(),
            arguments: json!({"text": "hi"}),
        },
    });
    let mut result = Message::new(Role::Tool, "{\"ok\": true}");
    result.tool_call_id = Some("call_0f3a9c2e7b".into());
    let messages = [Message::user("note hi"), call, result];
    let prompt = tools
        .render(&template, &messages, "<s>", "</s>", &|_| None)
        .unwrap();
    let id = fmt::template_id("call_0f3a9c2e7b");
    assert!(id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()));
    assert_eq!(fmt::template_id(&id), id, "a nine-character id stays");
    assert!(
        prompt.contains(&format!("\"id\": \"{id}\"}}]</s>")),
        "{prompt}"
    );
    assert!(prompt.contains(&format!("\"call_id\": \"{id}\"}}[/TOOL_RESULTS]")));
    assert!(prompt.contains("[AVAILABLE_TOOLS][{\"type\": \"function\""));
    // The past call the template wrote reads back as the call.
    let past = &prompt[prompt.find(fmt::OPEN).unwrap()..];
    let past = &past[..past.find("</s>").unwrap()];
    let (_, calls) = tools.format().parse(&tools, past).unwrap();
    assert_eq!(
        (calls[0].name.as_str(), &calls[0].arguments),
        ("note", &json!({"text": "hi"}))
    );
}

/// Mistral-Small-3.2-24B-Instruct-2506's chat template (Apache-2.0; see tests/templates/README.md).
const SMALL_32: &str = include_str!("../../../tests/templates/mistral-small-3.2.jinja");

#[test]
fn tool_format_mistral_args_parses_grammar_checks_and_streams_name_args_calls() {
    assert_eq!(ToolFormat::detect(SMALL_32), ToolFormat::MistralArgs);
    let tools = weather_tools(ToolFormat::MistralArgs);
    let text = "On it.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": \"Oslo [TOOL\", \"days\": 2}\
                [TOOL_CALLS]note[ARGS]{\"text\": \"x\"}";
    let reply = tools.reply(text).unwrap();
    assert_eq!(reply.content, "On it.");
    assert_eq!(reply.calls.len(), 2);
    assert_eq!(
        reply.calls[0].function.arguments,
        json!({"city": "Oslo [TOOL", "days": 2})
    );
    for bad in [
        "[TOOL_CALLS]note{\"text\": \"x\"}",
        "[TOOL_CALLS][ARGS]{}",
        "[TOOL_CALLS]note[ARGS][1]",
        "[TOOL_CALLS]note[ARGS]{\"text\": \"x\"} more",
    ] {
        assert!(
            matches!(
                tools.format().parse(&tools, bad),
                Err(ToolError::Malformed(_))
            ),
            "{bad}"
        );
    }
    // Cut short: the complete call stays.
    let second = text.rfind("[TOOL_CALLS]").unwrap();
    assert_eq!(
        tools.complete_prefix(&text[..text.len() - 3]),
        &text[..second]
    );
    // The grammar: control tokens by id, an optional id, each call its tool's schema.
    let ctl = &[fmt::OPEN, fmt::ARGS, fmt::CALL_ID];
    let parallel = tools.format().calls_grammar(&tools, None, true, None);
    let one = tools
        .format()
        .write_call(&tools, "note", &json!({"text": "hi"}));
    assert_eq!(one, "[TOOL_CALLS]note[ARGS]{\"text\":\"hi\"}");
    let two = format!(
        "{one}[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{{\"city\":\"Rome\",\"days\":1}}"
    );
    assert!(accepts_with(&parallel, &one, ctl) && accepts_with(&parallel, &two, ctl));
    assert!(!accepts_with(
        &tools.format().calls_grammar(&tools, None, false, None),
        &two,
        ctl
    ));
    assert!(!accepts_with(
        &parallel,
        &two.replace("a1b2c3d4e", "a1b2"),
        ctl
    ));
    assert!(!accepts_with(
        &parallel,
        &one.replace("hi\"", "hi\",\"x\":1"),
        ctl
    ));
    assert!(
        accepts(&parallel, &two),
        "spelled as text by a model without the tokens"
    );
    // Streamed: the deltas join to the parsed arguments in any pieces.
    let (_, parsed) = tools.format().parse(&tools, text).unwrap();
    for size in [1, 4, 11, text.len()] {
        let (calls, _) = stream(&tools, &text[text.find("[TOOL_CALLS]").unwrap()..], size);
        assert_eq!(calls.len(), 2, "piece size {size}");
        for (c, p) in calls.iter().zip(&parsed) {
            assert_eq!(
                (c.0.as_str(), c.1.clone()),
                (p.name.as_str(), p.arguments.to_string())
            );
        }
    }
}

#[test]
fn tool_format_mistral_args_history_renders_through_small_32s_template() {
    let tools = weather_tools(ToolFormat::MistralArgs);
    let template = ChatTemplate::new(SMALL_32).unwrap();
    let mut call = Message::assistant("");
    call.tool_calls.push(ToolCall {
        id: "toolu_01ABCDEFG".into(),
        kind: "function",
        function: FunctionCall {
            name: "note".into(),
            arguments: json!({"text": "hi"}),
        },
    });
    let mut result = Message::new(Role::Tool, "ok");
    result.tool_call_id = Some("toolu_01ABCDEFG".into());
    let prompt = tools
        .render(
            &template,
            &[Message::user("note hi"), call, result],
            "<s>",
            "</s>",
            &|_| None,
        )
        .unwrap();
    let id = fmt::template_id("toolu_01ABCDEFG");
    assert!(
        prompt.contains(&format!("[TOOL_CALLS]note[CALL_ID]{id}[ARGS]")),
        "{prompt}"
    );
    assert!(prompt.contains(&format!(
        "[TOOL_RESULTS]{id}[TOOL_CONTENT]ok[/TOOL_RESULTS]"
    )));
    let past = &prompt[prompt.find("[TOOL_CALLS]").unwrap()..];
    let past = &past[..past.find("</s>").unwrap()];
    let (_, calls) = tools.format().parse(&tools, past).unwrap();
    assert_eq!(calls[0].arguments, json!({"text": "hi"}));
}
