//! A sample of the BFCL questions through the constrained tool-call path (the full run is
//! `thorn bench grammar`): every emitted call must parse and validate against its schema.

use std::sync::Arc;
use thorn_bench::bfcl;
use thorn_engine::engine::{Engine, EngineConfig, FinishReason};
use thorn_engine::gguf::Gguf;
use thorn_guide::ToolGrammars;
use thorn_tests::{default_model, fixture, sampled};
use thorn_tools::chat::ChatTemplate;
use thorn_tools::{ResponseFormat, ToolChoice, ToolSet, complete_calls_prefix};

#[test]
fn sampled_bfcl_calls_parse_and_validate() {
    let g = Arc::new(Gguf::open(default_model()).unwrap());
    let mut e = Engine::from_gguf(
        g,
        &EngineConfig {
            threads: 2,
            context: 2048,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let template = ChatTemplate::new(e.gguf().get_str("tokenizer.chat_template").unwrap()).unwrap();
    let grammars = e.grammars().unwrap().clone();
    let (mut calls, mut generations) = (0, 0);
    for cat in [
        "simple_python",
        "multiple",
        "parallel",
        "parallel_multiple",
        "irrelevance",
    ] {
        let path = fixture(&format!("bfcl/BFCL_v4_{cat}.json"));
        let questions = bfcl::load(&path).unwrap();
        for q in questions.iter().take(2) {
            let tools = ToolSet::new(&q.tools).unwrap_or_else(|err| panic!("{}: {err}", q.id));
            let tok = e.tokenizer();
            let text = tools
                .render(&template, &q.messages, "", "<|im_end|>", &|s| tok.quote(s))
                .unwrap();
            let prompt = tok.encode_rendered(&text).unwrap();
            for (seed, choice) in [(0, ToolChoice::Required), (1, ToolChoice::Auto)] {
                let mut guide = grammars
                    .guide(&tools, &choice, true, &ResponseFormat::Text)
                    .unwrap_or_else(|err| panic!("{}: {err}", q.id))
                    .unwrap();
                let req = sampled(prompt.clone(), seed, 128);
                let out = e
                    .generate_guided(&req, Some(&mut guide), &mut |_| {})
                    .unwrap();
                generations += 1;
                let text = if out.finish == FinishReason::Length && !guide.is_done() {
                    complete_calls_prefix(&out.text)
                } else {
                    &out.text
                };
                let reply = tools
                    .reply(text)
                    .unwrap_or_else(|err| panic!("{} seed {seed}: {err} in {:?}", q.id, out.text));
                calls += reply.calls.len();
                if choice == ToolChoice::Required && out.finish == FinishReason::Stop {
                    assert!(!reply.calls.is_empty(), "{}: {:?}", q.id, out.text);
                }
            }
        }
    }
    eprintln!("{calls} calls in {generations} generations, all valid");
    assert!(calls >= 10, "only {calls} calls");
    assert_eq!(thorn_tools::validation_failures(), 0);
}
