//! Schema-constrained tool calls on the default model.

use std::sync::Arc;
use thorn_engine::engine::{Engine, EngineConfig, Request};
use thorn_engine::gguf::Gguf;
use thorn_engine::sample::guide::Guide;
use thorn_guide::{GuideError, ToolGrammars};
use thorn_tests::{default_model, jsonl, sampled, token_ids};
use thorn_tools::{ResponseFormat, ToolChoice, ToolSet, parse_tool_calls};

fn engine() -> Engine {
    let g = Arc::new(Gguf::open(default_model()).unwrap());
    Engine::from_gguf(
        g,
        &EngineConfig {
            threads: 2,
            context: 1024,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn weather() -> ToolSet {
    ToolSet::new(&[serde_json::json!({"type": "function", "function": {"name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}})])
    .unwrap()
}

#[test]
fn greedy_constrained_call_on_the_fixture_tool_prompt_is_valid() {
    let mut e = engine();
    let p = jsonl("smollm2/reference_logits.jsonl")
        .into_iter()
        .find(|p| p["name"] == "tool_call_json")
        .unwrap();
    let prompt = token_ids(&p["prompt_ids"]);
    let tools = weather();
    let mut g = Guide::new(e.grammars().unwrap().tool_call(&tools).unwrap());
    let out = e
        .generate_guided(&Request::greedy(prompt, 96), Some(&mut g), &mut |_| {})
        .unwrap();
    eprintln!(
        "constrained greedy output: {:?} ({} tokens in {} decode forward passes after the prefill)",
        out.text,
        out.tokens.len(),
        out.stats.forward_passes
    );
    // Forced tokens (the tags, the keys, the tool name) ride along with the sampled ones.
    assert!(
        out.stats.forward_passes * 2 < out.tokens.len(),
        "fast-forward should skip most decode steps"
    );
    // Unconstrained, this model answers with prose and a made-up JSON shape (see the fixture's greedy_text).
    let (prose, calls) = parse_tool_calls(&out.text).unwrap();
    assert!(
        prose.is_empty(),
        "text outside the call: {prose:?} in {:?}",
        out.text
    );
    assert_eq!(calls.len(), 1, "{:?}", out.text);
    tools.check(&calls[0]).unwrap();
    assert_eq!(calls[0].name, "get_weather");
    assert_eq!(calls[0].arguments["city"], "Paris", "{:?}", out.text);
}

#[test]
fn sampled_constrained_calls_always_validate() {
    let mut e = engine();
    let tools = weather();
    let system = tools.system_prompt();
    let text = format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nIs it cold in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    );
    let prompt = e.tokenizer().encode(&text, true).unwrap();
    for seed in 0..4 {
        // Compiled once, forked per request.
        let mut g = Guide::new(e.grammars().unwrap().tool_call(&tools).unwrap());
        assert_eq!(e.grammars().unwrap().cached(), 1);
        let req = sampled(prompt.clone(), seed, 128);
        let out = e.generate_guided(&req, Some(&mut g), &mut |_| {}).unwrap();
        let (_, calls) = parse_tool_calls(&out.text)
            .unwrap_or_else(|err| panic!("seed {seed}: {err} in {:?}", out.text));
        assert_eq!(calls.len(), 1, "seed {seed}: {:?}", out.text);
        tools
            .check(&calls[0])
            .unwrap_or_else(|err| panic!("seed {seed}: {err}"));
    }
}

#[test]
fn a_schema_llguidance_cannot_compile_is_an_error() {
    let e = engine();
    let err = e
        .grammars()
        .unwrap()
        .lark("start: undefined_rule")
        .unwrap_err();
    assert!(
        err.to_string().contains("grammar does not compile"),
        "{err}"
    );
}

fn chat_prompt(e: &Engine, system: &str, user: &str) -> Vec<u32> {
    let text = format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    );
    e.tokenizer().encode(&text, true).unwrap()
}

fn two_tools() -> ToolSet {
    ToolSet::new(&[
        serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
        serde_json::json!({"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"]}}}),
    ])
    .unwrap()
}

#[test]
fn required_named_and_parallel_modes_shape_the_calls() {
    let mut e = engine();
    let tools = two_tools();
    let prompt = chat_prompt(
        &e,
        &tools.system_prompt(),
        "Weather in Oslo and the time in CET?",
    );
    let grammars = e.grammars().unwrap().clone();
    let named = ToolChoice::Function("get_time".into());
    for seed in 0..3 {
        let mut g = grammars
            .guide(&tools, &named, true, &ResponseFormat::Text)
            .unwrap()
            .unwrap();
        let out = e
            .generate_guided(
                &sampled(prompt.clone(), seed, 64),
                Some(&mut g),
                &mut |_| {},
            )
            .unwrap();
        let reply = tools.reply(&out.text).unwrap();
        assert_eq!(
            reply.calls.len(),
            1,
            "named: exactly one call, {:?}",
            out.text
        );
        assert_eq!(reply.calls[0].function.name, "get_time");
        assert!(reply.content.is_empty());
        assert!(reply.calls[0].id.starts_with("call_"));

        // Required + parallel: one or more calls to any tool, nothing else; biasing the end-of-turn token
        // away makes the model write a second call.
        let mut g = grammars
            .guide(&tools, &ToolChoice::Required, true, &ResponseFormat::Text)
            .unwrap()
            .unwrap();
        let mut req = sampled(prompt.clone(), seed, 80);
        let eos = e.tokenizer().eos().unwrap();
        req.sampling.logit_bias = vec![(eos, -100.0)];
        let out = e.generate_guided(&req, Some(&mut g), &mut |_| {}).unwrap();
        // With the end of turn banned it writes calls until max_tokens cuts one short; the complete ones count.
        let complete = thorn_tools::complete_calls_prefix(&out.text);
        let reply = tools
            .reply(complete)
            .unwrap_or_else(|err| panic!("{err}: {:?}", out.text));
        assert!(reply.calls.len() >= 2, "parallel calls: {:?}", out.text);
        assert!(reply.content.is_empty(), "{:?}", out.text);

        // Required without parallel calls: exactly one, and the grammar ends the turn.
        let mut g = grammars
            .guide(&tools, &ToolChoice::Required, false, &ResponseFormat::Text)
            .unwrap()
            .unwrap();
        let out = e.generate_guided(&req, Some(&mut g), &mut |_| {}).unwrap();
        assert_eq!(
            tools.reply(&out.text).unwrap().calls.len(),
            1,
            "{:?}",
            out.text
        );
    }
    assert_eq!(thorn_tools::validation_failures(), 0);
}

#[test]
fn auto_mode_leaves_prose_unconstrained_until_the_trigger() {
    let mut e = engine();
    let tools = two_tools();
    let grammars = e.grammars().unwrap().clone();
    // No call: free prose, identical to unconstrained greedy decoding (no mask is ever computed).
    let prompt = chat_prompt(
        &e,
        &tools.system_prompt(),
        "Write one sentence about the sea.",
    );
    let free = e
        .generate(&Request::greedy(prompt.clone(), 24), &mut |_| {})
        .unwrap();
    let mut g = grammars
        .guide(&tools, &ToolChoice::Auto, true, &ResponseFormat::Text)
        .unwrap()
        .unwrap();
    g.record_mask_times();
    let out = e
        .generate_guided(&Request::greedy(prompt, 24), Some(&mut g), &mut |_| {})
        .unwrap();
    if !out.text.contains("<tool_call>") {
        assert_eq!(out.tokens, free.tokens);
        assert!(g.mask_times().is_empty(), "no mask work over prose");
    }

    // A few-shot prompt makes the model write the trigger itself; from there the grammar takes over.
    let system = format!(
        "{}\nExample: for \"weather in Rome\" answer <tool_call>{{\"name\":\"get_weather\",\"arguments\":{{\"city\":\"Rome\"}}}}</tool_call>",
        tools.system_prompt()
    );
    let prompt = chat_prompt(&e, &system, "weather in Oslo");
    let mut streamed = String::new();
    let mut triggered = 0;
    for seed in 0..16 {
        if triggered >= 2 {
            break;
        }
        let mut g = grammars
            .guide(&tools, &ToolChoice::Auto, false, &ResponseFormat::Text)
            .unwrap()
            .unwrap();
        streamed.clear();
        // Warm, not hot: at temperature 1 the 135M model mostly rambles past the few-shot format.
        let mut req = sampled(prompt.clone(), seed, 96);
        req.sampling.temperature = 0.6;
        let out = e
            .generate_guided(&req, Some(&mut g), &mut |t| streamed.push_str(t))
            .unwrap();
        assert_eq!(streamed, out.text, "the stream carries the same text");
        let reply = tools
            .reply(&out.text)
            .unwrap_or_else(|err| panic!("{err}: {:?}", out.text));
        if g.is_active() {
            triggered += 1;
            assert_eq!(reply.calls.len(), 1, "{:?}", out.text);
            assert!(g.is_done(), "{:?}", out.text);
        } else {
            assert!(reply.calls.is_empty());
        }
    }
    assert!(triggered > 0, "the few-shot prompt never produced a call");
}

#[test]
fn a_trigger_inside_a_token_is_kept_or_respelled() {
    let mut e = engine();
    let p = jsonl("smollm2/reference_logits.jsonl")
        .into_iter()
        .find(|p| p["name"] == "capital")
        .unwrap();
    let prompt = token_ids(&p["prompt_ids"]);
    // Greedy: "The capital of France is Paris." The trigger "capit" ends inside the token " capital".
    let grammars = e.grammars().unwrap().clone();
    // The rest of that token ("al") fits the grammar: it is kept.
    let c = grammars
        .lark("start: \"capit\" \"al of \" /[A-Z][a-z]+/ \".\"")
        .unwrap();
    let mut g = Guide::triggered(c, "capit");
    let out = e
        .generate_guided(
            &Request::greedy(prompt.clone(), 32),
            Some(&mut g),
            &mut |_| {},
        )
        .unwrap();
    assert!(out.text.starts_with("The capital of "), "{:?}", out.text);
    assert!(out.text.ends_with('.') && g.is_done(), "{:?}", out.text);
    // It does not fit: the token is re-spelled up to the trigger's end and the grammar continues.
    let c = grammars.lark("start: \"capit\" \"ol!\"").unwrap();
    let mut g = Guide::triggered(c, "capit");
    let mut streamed = String::new();
    let out = e
        .generate_guided(&Request::greedy(prompt, 32), Some(&mut g), &mut |t| {
            streamed.push_str(t)
        })
        .unwrap();
    assert_eq!(out.text, "The capitol!");
    assert_eq!(streamed, out.text);
    let detok = e.tokenizer().decode(&out.tokens, false);
    assert_eq!(detok, out.text, "the tokens spell the text");
}

#[test]
fn response_formats_constrain_the_answer() {
    let mut e = engine();
    let grammars = e.grammars().unwrap().clone();
    let prompt = chat_prompt(&e, "You are helpful.", "Describe a cat as JSON.");
    let format = ResponseFormat::from_openai(&serde_json::json!({"type": "json_schema", "json_schema": {
        "name": "cat", "strict": true, "schema": {"type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 30}},
            "required": ["name", "age"]}}}))
    .unwrap();
    let (schema, _) = format.schema().unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    for seed in 0..3 {
        let mut g = grammars
            .guide(&ToolSet::default(), &ToolChoice::Auto, true, &format)
            .unwrap()
            .unwrap();
        let out = e
            .generate_guided(
                &sampled(prompt.clone(), seed, 64),
                Some(&mut g),
                &mut |_| {},
            )
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&out.text).unwrap();
        assert!(validator.is_valid(&v), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 2, "closed object: {v}");
    }
    let mut g = grammars
        .guide(
            &ToolSet::default(),
            &ToolChoice::None,
            true,
            &ResponseFormat::JsonObject,
        )
        .unwrap()
        .unwrap();
    let out = e
        .generate_guided(&sampled(prompt, 7, 48), Some(&mut g), &mut |_| {})
        .unwrap();
    if g.is_done() {
        let v: serde_json::Value = serde_json::from_str(&out.text).unwrap();
        assert!(v.is_object());
    } else {
        assert!(out.text.starts_with('{'), "{:?}", out.text);
    }
    // No tools and a text format: no guide at all.
    assert!(
        grammars
            .guide(
                &ToolSet::default(),
                &ToolChoice::Auto,
                true,
                &ResponseFormat::Text
            )
            .unwrap()
            .is_none()
    );
}

#[test]
fn schemas_the_grammar_cannot_enforce_are_rejected_naming_the_tool() {
    let e = engine();
    let tools = ToolSet::new(&[
        serde_json::json!({"type": "function", "function": {"name": "fine",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}),
        serde_json::json!({"type": "function", "function": {"name": "lookbehind",
            "parameters": {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=x)y"}}}}}),
    ])
    .unwrap();
    let err = e
        .grammars()
        .unwrap()
        .guide(&tools, &ToolChoice::Auto, true, &ResponseFormat::Text)
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, GuideError::Grammar(_)), "{msg}");
    assert!(msg.contains("\"lookbehind\""), "names the tool: {msg}");
    let err = e
        .grammars()
        .unwrap()
        .guide(
            &tools,
            &ToolChoice::Function("nope".into()),
            true,
            &ResponseFormat::Text,
        )
        .unwrap_err();
    assert!(err.to_string().contains("\"nope\""), "{err}");
}
