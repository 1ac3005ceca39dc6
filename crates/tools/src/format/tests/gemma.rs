//! Gemma's `call:NAME{key:value}` calls in both dialects: detection from Gemma 4's template, the parser
//! and the value reader, the grammar built from the schema (sorted keys, required ones, quoted strings
//! with the quote as a control token or as text), the streamed deltas, and past calls through the
//! template.

use super::*;
use crate::format::gemma::{FUNCTION_GEMMA, GEMMA4};

/// Gemma 4's chat template (Apache-2.0; see tests/templates/README.md).
const GEMMA4_TEMPLATE: &str = include_str!("../../../tests/templates/gemma4.jinja");

/// Two calls with every kind of value, the strings holding the dialect's own punctuation.
const TWO: &str = "Let me check.<|tool_call>call:get_weather{city:<|\"|>São Paulo, {north}: \"x\" < y<|\"|>,days:3,\
metric:True,where:{lat:-23.5,lon:-46.6}}<tool_call|><|tool_call>call:note{text:<|\"|>a\nb<|\"|>}<tool_call|>";

#[test]
fn tool_format_gemma_is_detected_and_parses_calls_in_both_dialects() {
    assert_eq!(ToolFormat::detect(GEMMA4_TEMPLATE), ToolFormat::Gemma);
    let tools = weather_tools(ToolFormat::Gemma);
    let reply = tools.reply(TWO).unwrap();
    assert_eq!(reply.content, "Let me check.");
    assert_eq!(reply.calls.len(), 2);
    assert_eq!(
        reply.calls[0].function.arguments,
        json!({"city": "São Paulo, {north}: \"x\" < y", "days": 3, "metric": true,
               "where": {"lat": -23.5, "lon": -46.6}})
    );
    assert_eq!(reply.calls[1].function.arguments, json!({"text": "a\nb"}));
    // FunctionGemma's delimiters, `none` as null, an array.
    let fg = FUNCTION_GEMMA;
    let (_, calls) = fg
        .parse("<start_function_call>call:f{a:[1,<escape>x<escape>],b:none}<end_function_call>")
        .unwrap();
    assert_eq!(calls[0].arguments, json!({"a": [1, "x"], "b": null}));
    for bad in [
        "<|tool_call>get_weather{}<tool_call|>",
        "<|tool_call>call:note{text:<|\"|>open<tool_call|>",
        "<|tool_call>call:note{text:x y}<tool_call|>",
        "<|tool_call>call:note[1]<tool_call|>",
        "<|tool_call>call:note{}<tool_call|> and more",
    ] {
        assert!(
            matches!(GEMMA4.parse(bad), Err(ToolError::Malformed(_))),
            "{bad}"
        );
    }
    // Written as the template writes them (keys sorted), read back the same.
    let args = json!({"where": {"lon": 1.5, "lat": 2}, "city": "Oslo", "days": 2});
    let one = GEMMA4.write_call("get_weather", &args);
    assert_eq!(
        one,
        "<|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>,days:2,where:{lat:2,lon:1.5}}<tool_call|>"
    );
    assert_eq!(GEMMA4.parse(&one).unwrap().1[0].arguments, args);
    // Cut short: the complete call stays, a partial opening token goes.
    let second = TWO.rfind("<|tool_call>").unwrap();
    assert_eq!(tools.complete_prefix(&TWO[..TWO.len() - 3]), &TWO[..second]);
    assert_eq!(tools.complete_prefix("Hi <|tool_"), "Hi ");
}

#[test]
fn tool_format_gemma_grammar_follows_the_schema_in_sorted_keys() {
    let tools = weather_tools(ToolFormat::Gemma);
    let ctl = &[GEMMA4.open, GEMMA4.close, GEMMA4.quote];
    let g = tools.format().calls_grammar(&tools, None, true, None);
    let one = GEMMA4.write_call("get_weather", &json!({"city": "Rome", "days": 2}));
    let full = GEMMA4.write_call(
        "get_weather",
        &json!({"city": "Rome <b>", "days": 7, "metric": false, "where": {"lat": 1.5, "lon": -2}}),
    );
    let note = GEMMA4.write_call("note", &json!({"text": "hi"}));
    for ok in [&one, &full, &note, &format!("{one}{note}")] {
        assert!(accepts_with(&g, ok, ctl), "{ok}\n{g}");
        assert!(accepts(&g, ok), "the quote spelled as text: {ok}");
    }
    for bad in [
        GEMMA4.write_call("get_weather", &json!({"city": "Rome"})), // a required key missing
        GEMMA4.write_call("get_weather", &json!({"city": "Rome", "days": 2, "x": 1})), // not a listed key
        GEMMA4.write_call("get_weather", &json!({"city": "Rome", "days": 2.5})), // not an integer
        one.replace(
            "city:<|\"|>Rome<|\"|>,days:2",
            "days:2,city:<|\"|>Rome<|\"|>",
        ), // not sorted
        GEMMA4.write_call("get_weather", &json!({"city": 3, "days": 2})),
    ] {
        assert!(!accepts_with(&g, &bad, ctl), "{bad}");
    }
    assert!(!accepts_with(
        &tools.format().calls_grammar(&tools, None, false, None),
        &format!("{one}{note}"),
        ctl
    ));
    // FunctionGemma's dialect over its own tokens.
    let fg = weather_tools(ToolFormat::FunctionGemma);
    let g = fg.format().calls_grammar(&fg, None, false, None);
    let call = FUNCTION_GEMMA.write_call("note", &json!({"text": "a<escape"}));
    let fctl = &[
        FUNCTION_GEMMA.open,
        FUNCTION_GEMMA.close,
        FUNCTION_GEMMA.quote,
    ];
    assert!(accepts_with(&g, &call, fctl) && accepts(&g, &call), "{g}");
}

#[test]
fn tool_format_gemma_streams_deltas_that_join_to_the_parse() {
    let tools = weather_tools(ToolFormat::Gemma);
    let (_, parsed) = tools.format().parse(&tools, TWO).unwrap();
    let calls_text = &TWO[TWO.find("<|tool_call>").unwrap()..];
    for size in [1, 2, 3, 7, calls_text.len()] {
        let (calls, ended) = stream(&tools, calls_text, size);
        assert_eq!((calls.len(), ended), (2, 2), "piece size {size}");
        for (c, p) in calls.iter().zip(&parsed) {
            assert_eq!(
                (c.0.as_str(), c.1.clone()),
                (p.name.as_str(), p.arguments.to_string())
            );
        }
    }
}

#[test]
fn tool_format_gemma_history_renders_through_gemma4s_template() {
    let tools = weather_tools(ToolFormat::Gemma);
    let template = ChatTemplate::new(GEMMA4_TEMPLATE).unwrap();
    assert!(template.knows_tools());
    let mut call = Message::assistant("");
    call.tool_calls.push(ToolCall {
        id: "call_1".into(),
        kind: "function",
        function: FunctionCall {
            name: "get_weather".into(),
            arguments: json!({"days": 2, "city": "Oslo"}),
        },
    });
    let prompt = tools
        .render(
            &template,
            &[Message::user("Oslo?"), call],
            "<bos>",
            "",
            &|_| None,
        )
        .unwrap();
    assert!(
        prompt.contains("<|tool>declaration:get_weather{"),
        "{prompt}"
    );
    let at = prompt.find("<|tool_call>").unwrap();
    let past = &prompt[at..prompt.find("<tool_call|>").unwrap() + "<tool_call|>".len()];
    assert_eq!(
        past,
        GEMMA4.write_call("get_weather", &json!({"city": "Oslo", "days": 2})),
        "the template writes calls as the format does"
    );
    let (_, calls) = tools.format().parse(&tools, past).unwrap();
    assert_eq!(calls[0].arguments, json!({"city": "Oslo", "days": 2}));
}
