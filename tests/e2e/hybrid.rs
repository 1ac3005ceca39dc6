//! A hybrid Gated-DeltaNet model (tests/data/qwen35-tiny) in the engine: generation against the
//! scalar reference, multi-turn prefix reuse through recurrent-state snapshots (cache on and off give the
//! same tokens), branch-point snapshots, eviction under a small state budget, the batch scheduler, and
//! speculative decoding with rollback of the recurrent state.

use std::sync::Arc;
use thorn_engine::engine::scheduler::SchedulerConfig;
use thorn_engine::engine::{Engine, EngineConfig, Generation, Request};
use thorn_engine::gguf::Gguf;
use thorn_engine::kv::KvDtype;
use thorn_engine::model::qwen35::{Qwen35Config, Reference};
use thorn_engine::spec::draft::{DraftContext, Drafter, Proposals, SUFFIX_CLASSES};
use thorn_engine::spec::{SpecConfig, Speculator};
use thorn_tests::{argmax, fixture};
use thorn_tools::{ResponseFormat, ToolChoice, ToolFormat, ToolSet};

fn model_path() -> std::path::PathBuf {
    fixture("qwen35-tiny/model.gguf")
}

fn engine(spec: SpecConfig, state_memory: usize) -> Engine {
    let g = Arc::new(Gguf::open(model_path()).unwrap());
    Engine::from_gguf(
        g,
        &EngineConfig {
            threads: 2,
            context: 2048,
            kv_dtype: KvDtype::F32,
            page_size: 16,
            speculation: spec,
            state_memory,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn generate(e: &mut Engine, prompt: &[u32], n: usize) -> Generation {
    let mut req = Request::greedy(prompt.to_vec(), n);
    req.ignore_eos = true;
    e.generate(&req, &mut |_| {}).unwrap()
}

/// Greedy continuation by the scalar reference.
fn reference_greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    let g = Gguf::open(model_path()).unwrap();
    let m = Reference::load(&g, Qwen35Config::from_gguf(&g).unwrap()).unwrap();
    let mut st = m.new_state();
    let mut logits = vec![0f32; 256];
    for &t in prompt {
        m.step(&mut st, t, &mut logits).unwrap();
    }
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        m.step(&mut st, t, &mut logits).unwrap();
    }
    out
}

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

#[test]
fn the_engine_generates_what_the_reference_does() {
    let prompt = bytes("Hello, Qwen3.5 tiny! Tell me about recurrent state.");
    let want = reference_greedy(&prompt, 40);
    let mut e = engine(SpecConfig::off(), 0);
    assert!(e.model().is_hybrid());
    let got = generate(&mut e, &prompt, 40);
    assert_eq!(got.tokens, want);
}

const SYSTEM: &str = "You are the controller of a six-joint robot arm. Answer with one tool call per turn. \
Tools: move_joint(joint: integer 0-5, degrees: number -180..180) rotates one joint relative to its current \
position; set_gripper(open: boolean, force: number 0..40) opens or closes the gripper with a force limit in \
newtons; home() returns every joint to zero; read_sensors() returns joint angles, motor currents and the \
gripper state as JSON; wait(ms: integer 0..10000) pauses. Never exceed the joint limits, never move while \
the gripper is closed on an object heavier than 2 kg, and report any sensor fault instead of moving. \
Keep answers short: the operator reads them on a small screen.";

/// A conversation of `turns` turns: each prompt is the previous prompt, the reply and a new user message.
/// Returns every turn's (prompt tokens, cached tokens, reply).
fn converse(e: &mut Engine, turns: usize, cache: bool) -> Vec<(usize, usize, Vec<u32>)> {
    // An agent's context: a system prompt with its tool catalogue, then short turns.
    let mut prompt = bytes(&format!(
        "<system>{SYSTEM}</system>\n<user>Home the arm.</user>\n"
    ));
    let mut out = Vec::new();
    for turn in 0..turns {
        if !cache {
            e.reset();
        }
        let g = generate(e, &prompt, 24);
        out.push((
            g.stats.prompt_tokens,
            g.stats.cached_tokens,
            g.tokens.clone(),
        ));
        prompt.extend(&g.tokens);
        prompt.extend(bytes(&format!(
            "\n<user>Move joint {turn} by {}.</user>\n",
            turn * 7
        )));
    }
    out
}

#[test]
fn multi_turn_replay_is_identical_with_the_cache_on_and_off() {
    let mut on = engine(SpecConfig::off(), 0);
    let mut off = engine(SpecConfig::off(), 0);
    let a = converse(&mut on, 12, true);
    let b = converse(&mut off, 12, false);
    for (turn, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.2, y.2, "turn {turn}: replies differ with the cache on");
        assert_eq!(y.1, 0, "turn {turn}: nothing is cached with the cache off");
    }
    let prompt: usize = a.iter().map(|t| t.0).sum();
    let cached: usize = a.iter().map(|t| t.1).sum();
    let served = cached as f64 / prompt as f64;
    eprintln!(
        "cache on: {cached} of {prompt} prompt tokens served ({:.1}%); snapshots {:?}",
        100.0 * served,
        on.kv_stats().snapshots
    );
    assert!(served >= 0.90, "only {:.1}% served", 100.0 * served);
    // Each later turn resumes exactly where the previous one ended: its snapshot after the last token that
    // went through the model (the reply's final token was sampled, not yet run).
    for w in a.windows(2) {
        assert_eq!(w[1].1, w[0].0 + w[0].2.len() - 1);
    }
}

#[test]
fn a_branch_point_gets_a_snapshot_for_the_next_branch() {
    let mut e = engine(SpecConfig::off(), 0);
    let shared =
        bytes("<system>Shared instructions for every request, long enough to matter.</system>\n");
    let ask = |q: &str| {
        let mut p = shared.clone();
        p.extend(bytes(q));
        p
    };
    let first = generate(&mut e, &ask("<user>What is 2+2?</user>"), 8);
    assert_eq!(first.stats.cached_tokens, 0);
    // The second request shares the system prompt: its KV is cached, but no state snapshot sits at the
    // branch, so it recomputes from the start and leaves one there.
    let second = generate(&mut e, &ask("<user>Name a colour.</user>"), 8);
    assert_eq!(second.stats.cached_tokens, 0);
    let third_prompt = ask("<user>Name an animal.</user>");
    let third = generate(&mut e, &third_prompt, 8);
    assert_eq!(third.stats.cached_tokens, shared.len() + "<user>".len());
    // The third left a snapshot where it branched off the second.
    let fourth_prompt = ask("<user>Name a fruit.</user>");
    let fourth = generate(&mut e, &fourth_prompt, 8);
    assert_eq!(
        fourth.stats.cached_tokens,
        shared.len() + "<user>Name a".len()
    );
    // And the results are what a cold engine computes.
    for (p, g) in [(&third_prompt, &third), (&fourth_prompt, &fourth)] {
        let mut cold = engine(SpecConfig::off(), 0);
        assert_eq!(generate(&mut cold, p, 8).tokens, g.tokens);
    }
}

#[test]
fn a_small_state_budget_evicts_snapshots_without_changing_outputs() {
    // Room for two snapshots of the tiny model (3 layers x 1408 floats).
    let snapshot = 3 * 1408 * 4;
    let mut small = engine(SpecConfig::off(), 2 * snapshot);
    let mut cold = engine(SpecConfig::off(), 0);
    let a = converse(&mut small, 6, true);
    let b = converse(&mut cold, 6, false);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.2, y.2);
    }
    let s = small.kv_stats().snapshots;
    assert!(s.evicted > 0 && s.held <= 2, "{s:?}");
    assert!(s.bytes <= 2 * snapshot);
}

#[test]
fn the_scheduler_batches_hybrid_sequences_exactly() {
    let mut e = engine(SpecConfig::off(), 0);
    let prompts: Vec<Vec<u32>> = [
        "<user>First request, short.</user>",
        "<user>Second request is somewhat longer than the first one.</user>",
        "<user>Third.</user>",
    ]
    .iter()
    .map(|s| bytes(s))
    .collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            e.reset();
            generate(&mut e, p, 20).tokens
        })
        .collect();
    e.reset();
    let subs = prompts
        .iter()
        .map(|p| {
            let mut r = Request::greedy(p.clone(), 20);
            r.ignore_eos = true;
            (r, None)
        })
        .collect();
    // Small steps, so prompts prefill in several chunks next to running decodes.
    let (results, stats) = e.generate_batch(
        subs,
        SchedulerConfig {
            max_batch: 3,
            step_tokens: 16,
        },
    );
    assert!(stats.batched_sequences > stats.steps, "{stats:?}");
    for (i, (_, r)) in results.into_iter().enumerate() {
        assert_eq!(r.unwrap().tokens, alone[i], "request {i}");
    }
}

/// A drafter that knows the greedy continuation and proposes its next two tokens followed by two wrong
/// ones, so every verification accepts a prefix and rejects the rest.
#[derive(Debug)]
struct HalfRight {
    truth: Vec<u32>,
}

impl Drafter for HalfRight {
    fn propose(&mut self, ctx: &DraftContext<'_>, out: &mut Proposals) {
        let h = ctx.history.len();
        if h >= self.truth.len() || ctx.history != &self.truth[..h] {
            return;
        }
        let mut path: Vec<u32> = self.truth[h..].iter().take(2).copied().collect();
        let last = *path.last().unwrap_or(&0);
        path.extend([(last + 1) % 256, (last + 2) % 256]);
        out.add(&path, 100.0, SUFFIX_CLASSES as u8 - 1);
    }
}

#[test]
fn a_hybrid_model_is_forced_through_every_formats_tool_calls() {
    use thorn_guide::ToolGrammars;
    use thorn_tools::CallDelta;
    use thorn_tools::format::harmony::{HarmonyStreamer, Part};
    // Every family's own format, on the tiny hybrid (a byte vocabulary: the formats' control tokens are
    // written as text): every value constrained (a random model would never end a free value), the calls
    // must come out whole, parse and validate, the same with and without speculation, and a second call
    // where the format allows parallel calls.
    let def = serde_json::json!({"type": "function", "function": {
        "name": "move_joint",
        "parameters": {"type": "object", "properties": {
            "joint": {"type": "integer", "enum": [1, 2, 3]},
            "degrees": {"type": "integer", "enum": [-10, 0, 10]},
            "relative": {"type": "boolean"}
        }, "required": ["joint", "degrees", "relative"]}
    }});
    let prompt = bytes("<user>Move joint 1 by 10 degrees.</user>\n");
    let eager = SpecConfig {
        adaptive: false,
        ..SpecConfig::default()
    };
    for format in ToolFormat::ALL {
        let tools = ToolSet::new(std::slice::from_ref(&def))
            .unwrap()
            .with_format(format)
            .unwrap();
        let mut outs = Vec::new();
        for cfg in [SpecConfig::off(), eager.clone()] {
            let mut e = engine(cfg, 0);
            let mut guide = e
                .grammars()
                .unwrap()
                .guide(&tools, &ToolChoice::Required, false, &ResponseFormat::Text)
                .unwrap();
            let out = e
                .generate_guided(
                    &Request::greedy(prompt.clone(), 200),
                    guide.as_mut(),
                    &mut |_| {},
                )
                .unwrap();
            let reply = tools
                .reply(&out.text)
                .unwrap_or_else(|err| panic!("{format}: {err}: {:?}", out.text));
            assert_eq!(reply.calls.len(), 1, "{format}: {:?}", out.text);
            assert_eq!(reply.calls[0].function.name, "move_joint");
            // The streamed deltas join to the validated arguments.
            let mut args = String::new();
            let mut on = |d| {
                if let CallDelta::Arguments { text, .. } = d {
                    args.push_str(&text)
                }
            };
            if format.has_channels() {
                let mut s = HarmonyStreamer::new();
                s.push(&out.text, &mut |p| {
                    if let Part::Call(d) = p {
                        on(d)
                    }
                });
            } else {
                let from = out.text.find(format.trigger()).unwrap_or(0);
                tools.streamer().push(&out.text[from..], &mut on);
            }
            assert_eq!(
                args,
                reply.calls[0].function.arguments.to_string(),
                "{format}"
            );
            outs.push(out.tokens);
        }
        assert_eq!(outs[0], outs[1], "{format}: speculation changed the call");
        if format == ToolFormat::QwenXml {
            let text = String::from_utf8(outs[0].iter().map(|&t| t as u8).collect()).unwrap();
            assert!(text.starts_with("<tool_call>\n<function=move_joint>\n<parameter=joint>\n"));
        }
    }
}

#[test]
fn speculation_on_a_hybrid_rolls_back_rejected_tokens() {
    let prompt = bytes("<user>Move joint 1 by 10 degrees, then report the sensors.</user>\n");
    let mut plain = engine(SpecConfig::off(), 0);
    let want = generate(&mut plain, &prompt, 48);
    let mut truth = prompt.clone();
    truth.extend(&want.tokens);
    // Full-budget chains (no cost sizing), with the half-right drafter beside the suffix drafter.
    let cfg = SpecConfig {
        adaptive: false,
        ..SpecConfig::default()
    };
    let mut spec = engine(cfg.clone(), 0);
    let mut sp = Speculator::new(cfg);
    sp.add_drafter(Box::new(HalfRight {
        truth: truth.clone(),
    }));
    spec.swap_speculator(&mut sp);
    // The hybrid verifies chains: the tree's top-k is cut to 1.
    assert_eq!(spec.spec_config().top_k, 1);
    let got = generate(&mut spec, &prompt, 48);
    assert_eq!(got.tokens, want.tokens);
    let st = spec.spec_stats();
    eprintln!("{st:?}");
    assert!(st.drafted > 0, "nothing was drafted: {st:?}");
    assert!(
        st.accepted > 0 && st.accepted < st.drafted,
        "drafts must be partly accepted and partly rejected: {st:?}"
    );
    assert!(got.stats.forward_passes < want.stats.forward_passes);
    // The batch scheduler verifies the same way.
    let mut r = Request::greedy(prompt.clone(), 48);
    r.ignore_eos = true;
    spec.reset();
    let (res, _) = spec.generate_batch(vec![(r, None)], SchedulerConfig::default());
    assert_eq!(res[0].1.as_ref().unwrap().tokens, want.tokens);
}

#[test]
fn the_server_serves_a_hybrid_base_model_with_snapshots() {
    use serde_json::{Value, json};
    use thorn::agent::Agent;
    use thorn::api::{AppState, ServerConfig};
    use thorn_plugin::PluginSet;
    let agent = Agent::start(
        engine(SpecConfig::default(), 0),
        "qwen35-tiny".into(),
        Arc::new(PluginSet::default()),
        8,
        1,
    )
    .unwrap();
    let state = Arc::new(AppState::new(
        agent,
        ServerConfig {
            max_body: 1 << 20,
            ..ServerConfig::default()
        },
    ));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            thorn::api::serve(l, state).await.unwrap();
        });
    });
    let addr = rx.recv().unwrap();
    let post = |path: &str, body: Value| {
        let r = thorn_tests::http(
            addr,
            "POST",
            path,
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        );
        (r.status, serde_json::from_str::<Value>(&r.body).unwrap())
    };
    // A base model has no chat template: chat is refused clearly, raw completions work.
    let (status, body) = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chat template")
    );
    // A raw multi-turn conversation: every turn after the first resumes from a snapshot.
    let mut prompt = format!("<system>{SYSTEM}</system>\n<user>Home the arm.</user>\n");
    for turn in 0..4 {
        let (status, body) = post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(status, 200, "{body}");
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if turn > 0 {
            assert!(cached > SYSTEM.len() as u64, "turn {turn}: {cached} cached");
        }
        // The reply's bytes may not be valid UTF-8 on their own (a random model); keep them as text.
        prompt.push_str(body["choices"][0]["text"].as_str().unwrap());
        prompt.push_str(&format!("\n<user>Move joint {turn}.</user>\n"));
    }
    let r = thorn_tests::http(addr, "GET", "/metrics", &[], b"");
    let metric = |name: &str| -> f64 {
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
            .trim()
            .parse()
            .unwrap()
    };
    assert!(metric("thorn_kv_snapshots") >= 1.0);
    assert!(metric("thorn_kv_snapshots_restored_total") >= 3.0);
    assert!(metric("thorn_kv_snapshot_bytes") > 0.0);
}

#[test]
fn a_reasoning_budget_closes_the_think_block_the_same_with_speculation() {
    use thorn_engine::engine::think::ThinkBudget;
    // A prompt that opened the block; the random model never closes it by itself.
    let prompt = bytes("<user>Think, then move joint 1.</user>\n<think>\n");
    let close = bytes("\n</think>\n\n");
    let budget = ThinkBudget {
        tokens: 12,
        opened: true,
        open: "<think>".into(),
        close: "</think>".into(),
        close_tokens: close.clone(),
    };
    let eager = SpecConfig {
        adaptive: false,
        ..SpecConfig::default()
    };
    let run = |cfg: SpecConfig, b: Option<ThinkBudget>| {
        let mut e = engine(cfg, 0);
        let mut req = Request::greedy(prompt.clone(), 40);
        req.ignore_eos = true;
        req.think_budget = b;
        e.generate(&req, &mut |_| {}).unwrap()
    };
    let plain = run(SpecConfig::off(), Some(budget.clone()));
    // The closing tag right after the 12th token, then the model goes on.
    assert_eq!(
        &plain.tokens[12..12 + close.len()],
        &close[..],
        "{:?}",
        plain.text
    );
    assert_eq!(plain.tokens.len(), 40);
    assert!(!plain.text[..plain.text.find("</think>").unwrap()].contains("</think>"));
    // Speculation forces it at the same token: the same output.
    let spec = run(eager, Some(budget));
    assert_eq!(spec.tokens, plain.tokens);
    // Without a budget the same prefix, and no tag there.
    let free = run(SpecConfig::off(), None);
    assert_eq!(free.tokens[..12], plain.tokens[..12]);
    assert_ne!(&free.tokens[12..12 + close.len()], &close[..]);
}
