//! Schema-constrained tool calls on the default model.

use std::sync::Arc;
use thorn::engine::{Engine, EngineConfig, Request};
use thorn::gguf::Gguf;
use thorn::sample::SamplingParams;
use thorn::tools::{ToolSet, parse_tool_calls};
use thorn_tests::{default_model, jsonl, token_ids};

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
    let mut c = e.grammars().unwrap().tool_call(&tools).unwrap();
    let out = e
        .generate_constrained(&Request::greedy(prompt, 96), Some(&mut c), &mut |_| {})
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
        let mut c = e.grammars().unwrap().tool_call(&tools).unwrap();
        assert_eq!(e.grammars().unwrap().cached(), 1);
        let req = Request {
            sampling: SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            },
            ..Request::greedy(prompt.clone(), 128)
        };
        let out = e
            .generate_constrained(&req, Some(&mut c), &mut |_| {})
            .unwrap();
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
