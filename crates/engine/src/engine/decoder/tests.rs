//! The decoder over a vocabulary with control tokens: a tool-call format's control token (Mistral's
//! `[TOOL_CALLS]`) is shown in the text only when the request asks, triggers the grammar as the token it
//! is, and the grammar that follows names it by id.

use crate::backend::Device;
use crate::engine::{Engine, EngineConfig, Request};
use crate::gguf::{Array, Gguf, GgufBuilder, Value};
use crate::model::{Model, llama::Llama};
use crate::quant::GgmlType;
use crate::sample::guide::Guide;
use crate::spec::SpecConfig;
use crate::testutil::{LlamaShape, random_llama};
use std::sync::Arc;

/// The repository's tiny byte-level tokenizer (256 tokens) with `controls` appended as control tokens.
fn tokenizer_with(controls: &[&str]) -> Arc<Gguf> {
    let base = Gguf::open(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data/qwen35-tiny/model.gguf"),
    )
    .unwrap();
    let mut tokens = base
        .get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .to_vec();
    let mut kinds = base
        .get_i32_array("tokenizer.ggml.token_type")
        .unwrap()
        .to_vec();
    for c in controls {
        tokens.push((*c).to_owned());
        kinds.push(3); // control
    }
    let merges = base
        .get_str_array("tokenizer.ggml.merges")
        .unwrap()
        .to_vec();
    let eos = tokens.len() as u32 - 1;
    let b = GgufBuilder::new()
        .kv("general.architecture", Value::String("llama".into()))
        .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
        .kv("tokenizer.ggml.pre", Value::String("qwen2".into()))
        .kv("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
        .kv("tokenizer.ggml.token_type", Value::Array(Array::I32(kinds)))
        .kv("tokenizer.ggml.merges", Value::Array(Array::String(merges)))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(eos));
    Arc::new(Gguf::from_bytes(b.build()).unwrap())
}

/// A random 2-layer Llama over [`tokenizer_with`]`(["[TOOL_CALLS]", "</s>"])`: `[TOOL_CALLS]` is token
/// 256, the end of generation 257.
fn engine(speculation: SpecConfig) -> Engine {
    let shape = LlamaShape {
        layers: 2,
        d_model: 64,
        heads: 2,
        kv_heads: 1,
        ffn: 128,
        vocab: 288,
    };
    let dev = Device::cpu(1);
    let g = Arc::new(random_llama(shape, GgmlType::Q4_1, 11));
    let m = Model::Llama(Llama::load(g, &dev).unwrap());
    let cfg = EngineConfig {
        threads: 1,
        context: 256,
        page_size: 16,
        speculation,
        ..EngineConfig::default()
    };
    Engine::with_model(tokenizer_with(&["[TOOL_CALLS]", "</s>"]), m, dev, &cfg).unwrap()
}

const TOOL_CALLS: u32 = 256;

/// Writes prose, then (pushed there by a bias) Mistral's control token, whose grammar then forces a call.
fn run(e: &mut Engine, shown: bool) -> crate::engine::Generation {
    let constraint = e
        .grammars()
        .unwrap()
        .lark(&format!(
            "start: <[{TOOL_CALLS}]> \"[\" \"{{\\\"name\\\":\\\"go\\\",\\\"arguments\\\":{{\\\"n\\\":\" /[1-9]/ \"}}}}\" \"]\"\n"
        ))
        .unwrap();
    let mut guide = Guide::triggered(constraint, "[TOOL_CALLS]");
    let mut req = Request::greedy(b"Call go.".iter().map(|&b| u32::from(b)).collect(), 40);
    // The bias makes the control token the first choice; the grammar takes over from there.
    req.sampling.logit_bias = vec![(TOOL_CALLS, 30.0)];
    if shown {
        req.shown_controls = vec![TOOL_CALLS];
    }
    e.generate_guided(&req, Some(&mut guide), &mut |_| {})
        .unwrap()
}

#[test]
fn a_control_token_trigger_is_shown_and_hands_the_call_to_its_grammar() {
    for spec in [SpecConfig::off(), SpecConfig::default()] {
        let mut e = engine(spec);
        let out = run(&mut e, true);
        assert_eq!(out.tokens[0], TOOL_CALLS, "the bias wins the first token");
        assert!(
            out.text
                .starts_with("[TOOL_CALLS][{\"name\":\"go\",\"arguments\":{\"n\":"),
            "the control token is in the text, the grammar's call after it: {:?}",
            out.text
        );
        assert!(out.text.ends_with("}}]"), "{:?}", out.text);
        assert_eq!(
            out.tokens.iter().filter(|&&t| t == TOOL_CALLS).count(),
            1,
            "the grammar never lets the token in again"
        );
    }
}

#[test]
fn a_control_token_the_request_does_not_show_stays_out_of_the_text() {
    let mut e = engine(SpecConfig::off());
    let out = run(&mut e, false);
    assert_eq!(out.tokens[0], TOOL_CALLS);
    assert!(
        !out.text.contains("[TOOL_CALLS]"),
        "hidden, and never a trigger: {:?}",
        out.text
    );
}
