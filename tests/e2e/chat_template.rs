//! The model's own chat template, rendered with minijinja, against the fixture prompts (ChatML, rendered by
//! the reference pipeline) and their token ids.

use thorn::chat::{ChatTemplate, Message, RenderOptions, Role};
use thorn::gguf::Gguf;
use thorn::tokenizer::Tokenizer;
use thorn_tests::{default_model, golden, jsonl};

fn message(v: &serde_json::Value) -> Message {
    let role = match v["role"].as_str().unwrap() {
        "system" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        r => panic!("unknown role {r}"),
    };
    Message::new(role, v["content"].as_str().unwrap())
}

fn setup() -> (ChatTemplate, Tokenizer) {
    let g = Gguf::open(default_model()).unwrap();
    let t = ChatTemplate::new(g.get_str("tokenizer.chat_template").unwrap()).unwrap();
    (t, Tokenizer::from_gguf(&g).unwrap())
}

#[test]
fn renders_the_fixture_prompts_exactly() {
    let (template, tok) = setup();
    let prompts = jsonl("smollm2/reference_logits.jsonl");
    assert_eq!(prompts.len(), 8);
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    for p in &prompts {
        let name = p["name"].as_str().unwrap();
        let messages: Vec<Message> = p["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(message)
            .collect();
        let text = template.render(&messages, &opts).unwrap();
        assert_eq!(text, p["prompt_text"].as_str().unwrap(), "prompt {name}");
        let ids = tok.encode(&text, true).unwrap();
        let want: Vec<u32> = p["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want, "prompt ids of {name}");
        assert_eq!(ids.len() as u64, p["n_prompt"].as_u64().unwrap());
    }
}

#[test]
fn default_system_prompt_and_multi_turn_golden() {
    let (template, _) = setup();
    let convo = [
        Message::user("Hi"),
        Message::assistant("Hello! How can I help?"),
        Message::user("Tell me a joke about \"JSON\" & <tags>."),
    ];
    let with_gen = template
        .render(
            &convo,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
    let without = template.render(&convo, &RenderOptions::default()).unwrap();
    assert!(with_gen.starts_with(&without) && with_gen.ends_with("<|im_start|>assistant\n"));
    golden("chat/smollm2_multi_turn.txt", &with_gen);
}
