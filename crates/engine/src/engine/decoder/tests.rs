//! The decoder over a vocabulary with control tokens: a tool-call format's control token (Mistral's
//! `[TOOL_CALLS]`) is shown in the text only when the request asks, triggers the grammar as the token it
//! is, and the grammar that follows names it by id.

use crate::backend::Device;
use crate::engine::{Engine, EngineConfig, Request};
use crate::model::{Model, llama::Llama};
use crate::quant::GgmlType;
use crate::sample::guide::Guide;
use crate::spec::SpecConfig;
use crate::testutil::{LlamaShape, random_llama, tokenizer_with};
use std::sync::Arc;

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
