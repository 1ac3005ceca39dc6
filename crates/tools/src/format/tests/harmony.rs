//! OpenAI's harmony messages (gpt-oss): detection from gpt-oss's template, the grammar over a vocabulary
//! with harmony's control tokens, the parser, the channel lexer (reasoning, answer text, call deltas that
//! join to the parse), and past calls through the template.

use super::*;
use crate::format::harmony::{self as fmt, HarmonyStreamer, Part};

/// gpt-oss's chat template (Apache-2.0; see tests/templates/README.md).
const GPT_OSS: &str = include_str!("../../../tests/templates/gpt-oss.jinja");

/// The output of a turn that reasons and calls, with the recipient in the role header (as the template
/// writes past calls).
const CALL: &str = "<|channel|>analysis<|message|>Need Oslo's weather; call the tool.<|end|>\
<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\", \"days\": 2}";

/// Feeds `text` to a channel lexer in pieces of `size` bytes and gathers what it makes.
fn lex(text: &str, size: usize) -> (String, String, Vec<(String, String)>) {
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    let mut s = HarmonyStreamer::new();
    let mut on = |p: Part| match p {
        Part::Reasoning(r) => reasoning.push_str(&r),
        Part::Content(c) => content.push_str(&c),
        Part::Call(CallDelta::Begin { index, name }) => {
            assert_eq!(index, calls.len());
            calls.push((name, String::new()));
        }
        Part::Call(CallDelta::Arguments { index, text }) => calls[index].1.push_str(&text),
        Part::Call(CallDelta::End { .. }) => {}
    };
    let mut i = 0;
    while i < text.len() {
        let mut j = (i + size).min(text.len());
        while !text.is_char_boundary(j) {
            j += 1;
        }
        s.push(&text[i..j], &mut on);
        i = j;
    }
    s.finish(&mut on);
    (reasoning, content, calls)
}

#[test]
fn tool_format_harmony_is_detected_and_parses_calls_and_answers_by_channel() {
    assert_eq!(ToolFormat::detect(GPT_OSS), ToolFormat::Harmony);
    let tools = weather_tools(ToolFormat::Harmony);
    let reply = tools.reply(CALL).unwrap();
    assert_eq!(reply.content, "", "reasoning is not the answer");
    assert_eq!(reply.calls.len(), 1);
    assert_eq!(reply.calls[0].function.name, "get_weather");
    assert_eq!(
        reply.calls[0].function.arguments,
        json!({"city": "Oslo", "days": 2})
    );
    // The recipient in the channel header, and the end token present, read the same.
    let other = "<|channel|>commentary to=functions.note <|constrain|>json<|message|>{\"text\":\"hi\"}<|call|>";
    let (_, calls) = tools.format().parse(&tools, other).unwrap();
    assert_eq!(
        (calls[0].name.as_str(), &calls[0].arguments),
        ("note", &json!({"text": "hi"}))
    );
    // An answer: the final channel's text, without the reasoning; plain text is an answer too.
    let answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.";
    assert_eq!(tools.reply(answer).unwrap().content, "It is 4.");
    assert_eq!(tools.reply("Just text.").unwrap().content, "Just text.");
    // Arguments that are not a JSON object are an error of the format.
    for bad in [
        "<|channel|>commentary to=functions.note <|constrain|>json<|message|>{\"text\":",
        "<|channel|>commentary to=functions.note<|message|>[1]",
    ] {
        assert!(
            matches!(
                tools.format().parse(&tools, bad),
                Err(ToolError::Malformed(_))
            ),
            "{bad}"
        );
    }
    // Cut short inside the arguments: only what came before the call is complete.
    let cut = &CALL[..CALL.len() - 4];
    assert_eq!(
        tools.complete_prefix(cut),
        &CALL[..CALL.find("<|start|>").unwrap()]
    );
    assert_eq!(tools.complete_prefix(CALL), CALL);
}

#[test]
fn tool_format_harmony_lexer_splits_channels_in_any_pieces() {
    let tools = weather_tools(ToolFormat::Harmony);
    let (_, parsed) = tools.format().parse(&tools, CALL).unwrap();
    for size in [1, 2, 5, 13, CALL.len()] {
        let (reasoning, content, calls) = lex(CALL, size);
        assert_eq!(
            reasoning, "Need Oslo's weather; call the tool.",
            "piece size {size}"
        );
        assert_eq!(content, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(
            (calls[0].0.as_str(), calls[0].1.clone()),
            (parsed[0].name.as_str(), parsed[0].arguments.to_string()),
            "the deltas join to the parsed arguments"
        );
    }
    let answer = "<|channel|>analysis<|message|>a < b<|end|><|start|>assistant<|channel|>final<|message|>Yes: 1 <| 2.";
    for size in [1, 3, answer.len()] {
        let (reasoning, content, calls) = lex(answer, size);
        assert_eq!(
            (reasoning.as_str(), content.as_str()),
            ("a < b", "Yes: 1 <| 2.")
        );
        assert!(calls.is_empty());
    }
    // A model that writes no harmony syntax: all of it is answer text, as it streams.
    assert_eq!(lex("Hello there", 2).1, "Hello there");
}

#[test]
fn tool_format_harmony_grammar_takes_reasoning_then_one_call() {
    let tools = weather_tools(ToolFormat::Harmony);
    let ctl = &fmt::CONTROLS;
    let required = tools.format().calls_grammar(&tools, None, true, None);
    let call = tools
        .format()
        .write_call(&tools, "note", &json!({"text": "hi"}));
    assert_eq!(
        call,
        "<|start|>assistant to=functions.note<|channel|>commentary json<|message|>{\"text\":\"hi\"}<|call|>"
    );
    let first = call.trim_start_matches("<|start|>assistant");
    let think = "<|channel|>analysis<|message|>Write a note.<|end|><|start|>assistant";
    // Straight to the call, after reasoning, and with the recipient in the channel header.
    assert!(accepts_with(&required, first, ctl), "{required}");
    assert!(accepts_with(&required, &format!("{think}{first}"), ctl));
    assert!(accepts_with(
        &required,
        "<|channel|>commentary to=functions.note <|constrain|>json<|message|>{\"text\":\"hi\"}<|call|>",
        ctl
    ));
    // From the trigger on (tool choice auto).
    assert!(accepts_with(
        &required,
        &first[first.find(fmt::TRIGGER).unwrap()..],
        ctl
    ));
    // One call a message; each its tool's schema; the control tokens as tokens, not their spelling.
    assert!(!accepts_with(&required, &format!("{first}{call}"), ctl));
    assert!(!accepts_with(&required, &first.replace("\"hi\"", "3"), ctl));
    assert!(!accepts_with(&required, &format!("x{first}"), ctl));
    // A model without the tokens writes them as text, reasoning and all.
    assert!(accepts(&required, first));
    assert!(accepts(&required, &format!("{think}{first}")));
    // With an answer schema, a final message holding that JSON is the alternative.
    let answer =
        tools
            .format()
            .calls_grammar(&tools, None, false, Some(&json!({"type": "integer"})));
    assert!(accepts_with(&answer, "<|channel|>final<|message|>42", ctl));
    assert!(accepts_with(
        &answer,
        &format!("{think}<|channel|>final<|message|>42"),
        ctl
    ));
    assert!(accepts_with(&answer, first, ctl));
    let only = tools
        .format()
        .calls_grammar(&tools, Some("get_weather"), false, None);
    assert!(!accepts_with(&only, first, ctl));
}

#[test]
fn tool_format_harmony_history_renders_through_gpt_oss_template_and_parses_back() {
    // gpt-oss's template writes every tool's description.
    let tools = ToolSet::new(&[json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}
        }, "required": ["city"]}
    }})])
    .unwrap()
    .with_format(ToolFormat::Harmony)
    .unwrap();
    let template = ChatTemplate::new(GPT_OSS).unwrap();
    assert!(template.knows_tools());
    let mut call = Message::assistant("");
    call.tool_calls.push(ToolCall {
        id: "call_1".into(),
        kind: "function",
        function: FunctionCall {
            name: "get_weather".into(),
            arguments: json!({"city": "Oslo", "days": 2}),
        },
    });
    // The reasoning before a call goes back as the analysis message the template writes for it.
    call.reasoning_content = Some("Need Oslo's weather.".into());
    let mut result = Message::new(Role::Tool, "{\"temp\": 3}");
    result.tool_call_id = Some("call_1".into());
    let prompt = tools
        .render(
            &template,
            &[Message::user("Weather in Oslo?"), call, result],
            "",
            "",
            &|_| None,
        )
        .unwrap();
    assert!(prompt.contains("namespace functions {"), "{prompt}");
    assert!(prompt.contains("type get_weather = (_: {"));
    assert!(prompt.ends_with("<|start|>assistant"));
    assert!(prompt.contains(
        "<|start|>assistant<|channel|>analysis<|message|>Need Oslo's weather.<|end|><|start|>assistant to=functions.get_weather"
    ));
    // The past call as the template wrote it reads back as the call.
    let at = prompt.find("<|start|>assistant to=").unwrap();
    let past = &prompt[at + "<|start|>assistant".len()..];
    let past = &past[..past.find("<|call|>").unwrap()];
    let (_, calls) = tools.format().parse(&tools, past).unwrap();
    assert_eq!(calls[0].arguments, json!({"city": "Oslo", "days": 2}));
    assert!(
        prompt.contains(
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        )
    );
}
