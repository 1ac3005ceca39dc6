//! The request path, from the bytes of a `POST /v1/chat/completions` body to the prompt's tokens and the
//! grammar: any body gives a 4xx with an OpenAI error or a turn whose rendered prompt holds the template's
//! control tokens only, and whose tools, `tool_choice` and `response_format` compile (or are refused with a
//! 4xx) without a panic. Uses the default model's tokenizer and chat template (`thorn model pull`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use thorn::api::{chat_turn, parse_chat_request};
use thorn_tools::chat::ChatTemplate;
use thorn_engine::gguf::Gguf;
use thorn_engine::sample::grammar::GrammarFactory;
use thorn_engine::tokenizer::{Tokenizer, unquote};
use thorn_guide::ToolGrammars;
use thorn_tools::ToolSet;
use thorn_plugin::PluginSet;

struct Model {
    tok: Arc<Tokenizer>,
    template: ChatTemplate,
    grammars: GrammarFactory,
    plugins: Arc<PluginSet>,
}

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let cache = thorn::store::cache_dir(None);
        let path = thorn::store::default_model(&cache).expect("run `thorn model pull` first");
        let g = Gguf::open(&path).expect("the default model opens");
        let tok = Arc::new(Tokenizer::from_gguf(&g).expect("its tokenizer builds"));
        let template = ChatTemplate::new(g.get_str("tokenizer.chat_template").unwrap()).unwrap();
        let grammars = GrammarFactory::new(Arc::clone(&tok)).unwrap();
        Model { tok, template, grammars, plugins: Arc::new(PluginSet::default()) }
    })
}

fuzz_target!(|data: &[u8]| {
    let m = model();
    let req = match parse_chat_request(data) {
        Ok(r) => r,
        Err(e) => {
            assert!(e.status().is_client_error(), "{e}");
            return;
        }
    };
    let turn = match chat_turn("smollm2", Arc::clone(&m.plugins), req) {
        Ok(t) => t,
        Err(e) => {
            assert!(e.status().is_client_error(), "{e}");
            return;
        }
    };
    let Ok(tools) = ToolSet::new(&turn.tools) else { return };
    // The prompt: only the template's markup becomes control tokens, and the model reads the data's
    // characters exactly.
    let tok = &m.tok;
    if let Ok(text) = tools.render(&m.template, &turn.messages, "", "<|im_end|>", &|s| tok.quote(s)) {
        if text.len() < 1 << 16 {
            let ids = tok.encode_rendered(&text).expect("a rendered prompt tokenizes");
            let shown = tok.decode(&ids, true);
            assert_eq!(shown, unquote(&text), "the prompt round-trips");
            let controls = ids.iter().filter(|&&i| tok.is_control(i)).count();
            let clean: Vec<_> = turn
                .messages
                .iter()
                .map(|msg| {
                    let mut c = msg.clone();
                    c.content = "x".into();
                    c.tool_calls.iter_mut().for_each(|t| {
                        t.id = "x".into();
                        t.function.arguments = serde_json::json!({});
                    });
                    c.tool_call_id = c.tool_call_id.map(|_| "x".into());
                    c.name = c.name.map(|_| "x".into());
                    c.reasoning_content = c.reasoning_content.map(|_| "x".into());
                    c
                })
                .collect();
            if let Ok(t) = tools.render(&m.template, &clean, "", "<|im_end|>", &|s| tok.quote(s)) {
                let want = tok.encode_rendered(&t).unwrap().iter().filter(|&&i| tok.is_control(i)).count();
                assert_eq!(controls, want, "data added control tokens");
            }
        }
    }
    // The grammar: compiles or is refused, never panics.
    let _ = m
        .grammars
        .guide(&tools, &turn.tool_choice, turn.parallel_tool_calls, &turn.response_format);
});
