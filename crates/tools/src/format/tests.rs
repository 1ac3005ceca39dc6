//! The tool-call formats: names and detection, and per format the grammar (compiled and run with
//! llguidance over a byte-level tokenizer), the parser, the streamed deltas (which must concatenate to the
//! parsed arguments) and past calls through the family's own chat template. `cargo test -p thorn-tools
//! tool_format` runs them.

use super::*;
use crate::chat::{ChatTemplate, FunctionCall, Message, RenderOptions, Role, ToolCall};
use serde_json::json;

/// The Qwen3-Coder chat template (Apache-2.0; see tests/templates/README.md).
const QWEN3_CODER: &str = include_str!("../../tests/templates/qwen3-coder.jinja");

fn weather_tools(format: ToolFormat) -> ToolSet {
    ToolSet::new(&[
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
                "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                          "required": ["lat", "lon"]}
            }, "required": ["city", "days"]}
        }}),
        json!({"type": "function", "function": {
            "name": "note",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        }}),
    ])
    .unwrap()
    .with_format(format)
    .unwrap()
}

/// Whether `text` is in the language of the Lark grammar `lark` (the whole of it, token by byte).
fn accepts(lark: &str, text: &str) -> bool {
    accepts_with(lark, text, &[])
}

/// [`accepts`] over a byte-level vocabulary that also has `controls` as control tokens (ids 256 on): the
/// grammar's control tokens resolve to them, and their texts in `text` are those tokens.
fn accepts_with(lark: &str, text: &str, controls: &[&str]) -> bool {
    use llguidance::api::TopLevelGrammar;
    use llguidance::{Matcher, ParserFactory};
    use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for c in controls {
        words.push([&[TokTrie::SPECIAL_TOKEN_MARKER], c.as_bytes()].concat());
    }
    words.push(b"\xFF<eos>".to_vec());
    let info = TokRxInfo::new(words.len() as u32, words.len() as u32 - 1);
    let env: TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
    let id_of = |t: &str| {
        controls
            .iter()
            .position(|c| *c == t)
            .map(|i| 256 + i as u32)
    };
    let lark = crate::grammar::resolve_controls(lark, &id_of);
    let factory = ParserFactory::new_simple(&env).expect("a factory");
    let parser = factory
        .create_parser(TopLevelGrammar::from_lark(lark.clone().into_owned()))
        .unwrap_or_else(|e| panic!("the grammar compiles: {e}\n{lark}"));
    let mut m = Matcher::new(Ok(parser));
    let mut tokens = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        match controls.iter().position(|c| rest.starts_with(c)) {
            Some(i) => {
                tokens.push(256 + i as u32);
                rest = &rest[controls[i].len()..];
            }
            None => {
                let n = rest.chars().next().map_or(1, char::len_utf8);
                tokens.extend(env.tokenize_bytes(&rest.as_bytes()[..n]));
                rest = &rest[n..];
            }
        }
    }
    match m.try_consume_tokens(&tokens) {
        Ok(n) if n == tokens.len() => m.is_accepting().unwrap_or(false),
        _ => false,
    }
}

/// Feeds `text` to a streamer in pieces of `size` bytes (at char boundaries) and returns each call's name
/// and its argument fragments joined, and how many calls ended.
fn stream(tools: &ToolSet, text: &str, size: usize) -> (Vec<(String, String)>, usize) {
    let mut s = tools.streamer();
    let (mut calls, mut ended): (Vec<(String, String)>, usize) = (Vec::new(), 0);
    let mut i = 0;
    while i < text.len() {
        let mut j = (i + size).min(text.len());
        while !text.is_char_boundary(j) {
            j += 1;
        }
        s.push(&text[i..j], &mut |d| match d {
            CallDelta::Begin { index, name } => {
                assert_eq!(index, calls.len(), "calls begin in order");
                calls.push((name, String::new()));
            }
            CallDelta::Arguments { index, text } => calls[index].1.push_str(&text),
            CallDelta::End { index } => {
                assert_eq!(index, ended);
                ended += 1;
            }
        });
        i = j;
    }
    (calls, ended)
}

#[test]
fn tool_format_names_round_trip_and_an_unknown_one_is_an_error() {
    for f in ToolFormat::ALL {
        assert_eq!(ToolFormat::from_name(f.name()).unwrap(), f);
        assert_eq!(f.to_string().parse::<ToolFormat>().unwrap(), f);
    }
    let e = ToolFormat::from_name("klingon").unwrap_err();
    assert!(
        e.to_string().contains("hermes") && e.to_string().contains("qwen3_xml"),
        "{e}"
    );
}

#[test]
fn tool_format_counts_the_calls_a_text_begins_in_every_format() {
    for f in ToolFormat::ALL {
        let tools = weather_tools(f);
        let one = f.write_call(&tools, "note", &json!({"text": "a"}));
        let two = format!("Sure. {one}{one}");
        assert_eq!(f.calls_begun(&tools, "Sure."), 0, "{f}");
        assert_eq!(f.calls_begun(&tools, &one), 1, "{f}");
        assert_eq!(f.calls_begun(&tools, &two), 2, "{f}: {two}");
        // Cut inside the second call's arguments: still begun.
        let cut = &two[..two.rfind("a").unwrap()];
        assert_eq!(f.calls_begun(&tools, cut), 2, "{f}: {cut}");
    }
}

#[test]
fn tool_format_is_detected_from_the_chat_template() {
    assert_eq!(ToolFormat::detect(QWEN3_CODER), ToolFormat::QwenXml);
    // A template that writes Hermes calls, and one that knows no tools.
    let hermes = "{% for m in messages %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endfor %}";
    assert_eq!(ToolFormat::detect(hermes), ToolFormat::Hermes);
    assert_eq!(
        ToolFormat::detect("{{ messages[0].content }}"),
        ToolFormat::Hermes
    );
}

#[test]
fn tool_format_qwen_xml_parses_each_parameter_by_its_type() {
    let tools = weather_tools(ToolFormat::QwenXml);
    let text = "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\nnorth side\n</parameter>\n\
                <parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n\
                <parameter=where>\n{\"lat\": -23.5, \"lon\": -46.6}\n</parameter>\n</function>\n</tool_call>";
    let reply = tools.reply(text).unwrap();
    assert_eq!(reply.content, "Let me look.");
    assert_eq!(reply.calls.len(), 1);
    assert_eq!(reply.calls[0].function.name, "get_weather");
    let args = &reply.calls[0].function.arguments;
    assert_eq!(
        args.to_string(),
        r#"{"city":"São Paulo\nnorth side","days":3,"metric":true,"where":{"lat":-23.5,"lon":-46.6}}"#,
        "written order, each value as its type says"
    );
    // A string parameter is its raw text: quotes and a number-like value stay text.
    let (_, calls) = tools
        .format()
        .parse(
            &tools,
            "<tool_call>\n<function=note>\n<parameter=text>\n\"42\"\n</parameter>\n</function>",
        )
        .unwrap();
    assert_eq!(
        calls[0].arguments,
        json!({"text": "\"42\""}),
        "an unclosed last call is read"
    );
    // Broken calls are typed errors, never a panic.
    for bad in [
        "<tool_call>\n{\"name\": \"note\"}</tool_call>",
        "<tool_call>\n<function=note>\n<parameter=text>\nno end",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=note\n",
    ] {
        assert!(
            matches!(
                tools.format().parse(&tools, bad),
                Err(ToolError::Malformed(_))
            ),
            "{bad:?}"
        );
    }
    // A parsed call that breaks its schema is caught by validation.
    let missing = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>";
    assert!(matches!(
        tools.reply(missing),
        Err(ToolError::Invalid { .. })
    ));
}

#[test]
fn tool_format_qwen_xml_writes_calls_it_parses_back() {
    let tools = weather_tools(ToolFormat::QwenXml);
    let args =
        json!({"city": "Line one\nline </b> two", "days": 2, "where": {"lat": 1.5, "lon": 2.0}});
    let text = tools.format().write_call(&tools, "get_weather", &args);
    assert!(
        text.starts_with("<tool_call>\n<function=get_weather>\n<parameter=city>\nLine one\n"),
        "{text}"
    );
    let (prose, calls) = tools.format().parse(&tools, &text).unwrap();
    assert!(prose.is_empty());
    assert_eq!(calls[0].arguments, args);
    assert_eq!(
        tools.complete_prefix(&format!("{text}\n{text}")),
        format!("{text}\n{text}")
    );
    let cut = &text[..text.len() - 20];
    assert_eq!(
        tools.complete_prefix(&format!("ok {text}\n{cut}")),
        format!("ok {text}\n")
    );
}

#[test]
fn tool_format_qwen_xml_grammar_takes_well_formed_calls_only() {
    let tools = weather_tools(ToolFormat::QwenXml);
    let lark = tools.format().calls_grammar(&tools, None, true, None);
    let ok = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\nrive gauche\n</parameter>\n\
              <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    assert!(accepts(&lark, ok), "{lark}");
    let two = format!(
        "{ok}\n<tool_call>\n<function=note>\n<parameter=text>\nhi\n</parameter>\n</function>\n</tool_call>"
    );
    assert!(accepts(&lark, &two), "parallel calls");
    assert!(
        !accepts(
            &tools.format().calls_grammar(&tools, None, false, None),
            &two
        ),
        "one call only"
    );
    let with_object = ok.replace(
        "</parameter>\n</function>",
        "</parameter>\n<parameter=where>\n{\"lat\":1,\"lon\":2}\n</parameter>\n</function>",
    );
    assert!(accepts(&lark, &with_object), "an optional object parameter");
    for bad in [
        // A required parameter left out, a value out of its schema, a parameter the tool does not have,
        // parameters out of the schema's order, an unknown function, a JSON call.
        ok.replace("<parameter=days>\n3\n</parameter>\n", ""),
        ok.replace("\n3\n", "\n9\n"),
        ok.replace("<parameter=days>", "<parameter=weeks>"),
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>".to_owned(),
        ok.replace("get_weather", "get_wether"),
        "<tool_call>{\"name\":\"note\",\"arguments\":{\"text\":\"hi\"}}</tool_call>".to_owned(),
    ] {
        assert!(!accepts(&lark, &bad), "{bad:?}");
    }
    // A named tool only, and a JSON answer as the alternative.
    let only = tools
        .format()
        .calls_grammar(&tools, Some("note"), false, None);
    assert!(!accepts(&only, ok));
    let answer =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let either = tools
        .format()
        .calls_grammar(&tools, None, false, Some(&answer));
    assert!(accepts(&either, "{\"a\":1}") && accepts(&either, ok));
}

#[test]
fn tool_format_qwen_xml_streams_deltas_that_join_to_the_parsed_arguments() {
    let tools = weather_tools(ToolFormat::QwenXml);
    let text = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão \"Paulo\"\n\tzone\n\n</parameter>\n\
                <parameter=days>\n 3 \n</parameter>\n<parameter=where>\n{\"lat\": 1e2, \"lon\": -0.5}\n</parameter>\n\
                </function>\n</tool_call>\n<tool_call>\n<function=note>\n<parameter=text>\n</parameter>\n</function>\n</tool_call>";
    let (_, parsed) = tools.format().parse(&tools, text).unwrap();
    for size in [1, 2, 3, 7, 16, text.len()] {
        let (calls, ended) = stream(&tools, text, size);
        assert_eq!(ended, 2, "pieces of {size}");
        assert_eq!(calls.len(), parsed.len());
        for (c, p) in calls.iter().zip(&parsed) {
            assert_eq!(c.0, p.name);
            assert_eq!(c.1, p.arguments.to_string(), "pieces of {size}");
        }
    }
    // A string value streams as it is written, before its parameter ends (its last newline held back).
    let mut s = tools.streamer();
    let mut got = String::new();
    s.push(
        "<tool_call>\n<function=note>\n<parameter=text>\nhello\nwor",
        &mut |d| {
            if let CallDelta::Arguments { text, .. } = d {
                got.push_str(&text);
            }
        },
    );
    assert_eq!(got, "{\"text\":\"hello\\nwor");
    // Nothing before a call, nothing from text that is not one.
    let (calls, _) = stream(&tools, "plain <tool text, <tool_call> no function here", 4);
    assert!(calls.is_empty());
}

#[test]
fn tool_format_qwen_xml_history_renders_through_the_template_and_parses_back() {
    let tools = weather_tools(ToolFormat::QwenXml);
    let template = ChatTemplate::new(QWEN3_CODER).unwrap();
    assert!(template.knows_tools());
    let args = json!({"city": "Oslo", "days": 2});
    let mut call = Message::assistant("");
    call.tool_calls.push(ToolCall {
        id: "call_1".into(),
        kind: "function",
        function: FunctionCall {
            name: "get_weather".into(),
            arguments: args.clone(),
        },
    });
    let mut result = Message::new(Role::Tool, "{\"temp\": 3}");
    result.tool_call_id = Some("call_1".into());
    let msgs = vec![Message::user("Weather in Oslo?"), call, result];
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: Some(tools.definitions()),
        bos_token: "",
        eos_token: "",
        quote: None,
        kwargs: None,
    };
    let prompt = template
        .render(&tools.messages_for(true, &msgs), &opts)
        .unwrap();
    assert!(
        prompt.contains("<function>\n<name>get_weather</name>"),
        "the tools, listed"
    );
    // The past call as the template wrote it is a call this format reads, the same arguments.
    let start = prompt
        .find("<tool_call>\n<function=get_weather>")
        .expect("the past call");
    let past = &prompt[start..];
    let past = &past[..past.find("<|im_end|>").expect("the turn's end")];
    let (_, calls) = tools.format().parse(&tools, past).unwrap();
    assert_eq!(calls[0].arguments, args);
    // What thorn writes for a template without tools is the same text.
    assert!(prompt.contains(&tools.format().write_call(&tools, "get_weather", &args)));
    assert!(prompt.ends_with("<|im_start|>assistant\n"));
}

#[test]
fn tool_format_qwen_xml_rejects_parameter_names_it_cannot_write() {
    let t = ToolSet::new(&[
        json!({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "string"}}}}}),
    ])
    .unwrap();
    assert!(matches!(
        t.with_format(ToolFormat::QwenXml),
        Err(ToolError::Schema { .. })
    ));
}

/// A Llama-3.1-style template written for these tests (it renders past calls as that family's templates
/// do: the bare object with `"parameters"`, results as `ipython` turns), not Meta's own text.
const LLAMA3_LIKE: &str = "{% for m in messages %}<|start_header_id|>{% if m.role == 'tool' %}ipython\
{% else %}{{ m.role }}{% endif %}<|end_header_id|>\n\n{% if m.tool_calls %}{% for c in m.tool_calls %}\
{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}\
{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}{# <|python_tag|> #}\
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";

#[test]
fn tool_format_llama3_json_parses_writes_and_streams_bare_calls() {
    let tools = weather_tools(ToolFormat::Llama3Json);
    assert_eq!(ToolFormat::detect(LLAMA3_LIKE), ToolFormat::Llama3Json);
    let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"days\": 2}}; \
                {\"name\": \"note\", \"parameters\": {\"text\": \"a;b\"}}";
    let reply = tools.reply(text).unwrap();
    assert_eq!(reply.content, "");
    assert_eq!(reply.calls.len(), 2);
    assert_eq!(
        reply.calls[0].function.arguments,
        json!({"city": "Oslo", "days": 2})
    );
    assert_eq!(reply.calls[1].function.arguments, json!({"text": "a;b"}));
    // Prose before the call stays prose; text after a call that is not another is an error.
    let (prose, calls) = tools
        .format()
        .parse(
            &tools,
            "Sure. {\"name\": \"note\", \"parameters\": {\"text\": \"x\"}}",
        )
        .unwrap();
    assert_eq!((prose.as_str(), calls.len()), ("Sure.", 1));
    assert!(matches!(
        tools
            .format()
            .parse(&tools, "{\"name\": \"note\", \"parameters\": {}} and more"),
        Err(ToolError::Malformed(_))
    ));
    // Written calls read back; a cut-short answer keeps its complete calls.
    let one = tools
        .format()
        .write_call(&tools, "note", &json!({"text": "hi"}));
    assert_eq!(one, "{\"name\":\"note\",\"parameters\":{\"text\":\"hi\"}}");
    let cut = format!("{one}; {}", &one[..one.len() - 5]);
    assert_eq!(tools.complete_prefix(&cut), one);
    // The grammar: compact calls, several with parallel, each the tool's schema.
    let lark = tools.format().calls_grammar(&tools, None, true, None);
    let two = format!(
        "{one}; {}",
        tools
            .format()
            .write_call(&tools, "get_weather", &json!({"city": "Rome", "days": 1}))
    );
    assert!(accepts(&lark, &one) && accepts(&lark, &two), "{lark}");
    assert!(
        !accepts(&lark, "{\"name\":\"note\",\"arguments\":{\"text\":\"hi\"}}"),
        "the Hermes key"
    );
    assert!(
        !accepts(&lark, &one.replace("hi\"", "hi\",\"x\":1")),
        "an extra argument"
    );
    assert!(!accepts(
        &tools.format().calls_grammar(&tools, None, false, None),
        &two
    ));
    // Streamed from the trigger on: the deltas join to the parsed arguments.
    let (_, parsed) = tools.format().parse(&tools, &two).unwrap();
    for size in [1, 3, 8, two.len()] {
        let (calls, ended) = stream(&tools, &two, size);
        assert_eq!(ended, 2);
        for (c, p) in calls.iter().zip(&parsed) {
            assert_eq!(
                (c.0.as_str(), c.1.clone()),
                (p.name.as_str(), p.arguments.to_string())
            );
        }
    }
    // Past calls through the family's template read back as calls.
    let template = ChatTemplate::new(LLAMA3_LIKE).unwrap();
    let mut call = Message::assistant("");
    call.tool_calls.push(ToolCall {
        id: "call_1".into(),
        kind: "function",
        function: FunctionCall {
            name: "note".into(),
            arguments: json!({"text": "hi"}),
        },
    });
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let prompt = template
        .render(&[Message::user("note hi"), call], &opts)
        .unwrap();
    let past = &prompt[prompt.find("{\"name\"").unwrap()..];
    let past = &past[..past.find("<|eot_id|>").unwrap()];
    assert_eq!(
        tools.format().parse(&tools, past).unwrap().1[0].arguments,
        json!({"text": "hi"})
    );
}

#[test]
fn tool_format_hermes_is_the_json_protocol_through_the_same_interface() {
    let tools = weather_tools(ToolFormat::Hermes);
    let text = "<tool_call>{\"name\": \"note\", \"arguments\": {\"text\": \"a\\nb\"}}</tool_call>";
    let (_, calls) = tools.format().parse(&tools, text).unwrap();
    assert_eq!(calls[0].arguments, json!({"text": "a\nb"}));
    let lark = tools.format().calls_grammar(&tools, None, false, None);
    assert!(accepts(
        &lark,
        "<tool_call>{\"name\":\"note\",\"arguments\":{\"text\":\"a\"}}</tool_call>"
    ));
    assert!(!accepts(
        &lark,
        "<tool_call>\n<function=note>\n</function>\n</tool_call>"
    ));
    let (streamed, ended) = stream(&tools, text, 3);
    assert_eq!((streamed[0].1.as_str(), ended), ("{\"text\":\"a\\nb\"}", 1));
    assert_eq!(
        tools
            .format()
            .write_call(&tools, "note", &json!({"text": "x"})),
        "<tool_call>{\"name\":\"note\",\"arguments\":{\"text\":\"x\"}}</tool_call>"
    );
    assert!(
        tools
            .system_prompt()
            .contains("inside <tool_call></tool_call> tags")
    );
    assert!(
        weather_tools(ToolFormat::QwenXml)
            .system_prompt()
            .contains("<function=example_function_name>")
    );
}

mod gemma;
mod harmony;
mod mistral;

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any text values (newlines, quotes, backslashes, angle brackets, non-ASCII, control characters)
        /// and numbers, written in this format and streamed in any pieces, join to the parsed arguments.
        #[test]
        fn tool_format_qwen_xml_any_values_in_any_pieces_join_to_the_parse(
            city in "[ -~\\n\\t\u{e9}\u{1F600}\u{1}<>/]{0,24}",
            days in 1i64..8,
            text in "[ -~\\n\u{e9}]{0,16}",
            cuts in prop::collection::vec(0usize..300, 0..10),
        ) {
            prop_assume!(!city.contains("</parameter>") && !text.contains("</parameter>"));
            let tools = weather_tools(ToolFormat::QwenXml);
            let mut out = tools.format().write_call(&tools, "get_weather", &json!({"city": city, "days": days}));
            out.push('\n');
            out.push_str(&tools.format().write_call(&tools, "note", &json!({"text": text})));
            let (_, parsed) = tools.format().parse(&tools, &out).unwrap();
            prop_assert_eq!(&parsed[0].arguments, &json!({"city": city, "days": days}));
            let mut s = tools.streamer();
            let mut joined = vec![String::new(); 2];
            let mut at = 0;
            let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(out.len())).collect();
            bounds.push(out.len());
            bounds.sort_unstable();
            for b in bounds {
                let mut b = b.max(at);
                while !out.is_char_boundary(b) {
                    b += 1;
                }
                s.push(&out[at..b], &mut |d| {
                    if let CallDelta::Arguments { index, text } = d {
                        joined[index].push_str(&text);
                    }
                });
                at = b;
            }
            for (j, p) in joined.iter().zip(&parsed) {
                prop_assert_eq!(j, &p.arguments.to_string());
            }
        }
    }
}
