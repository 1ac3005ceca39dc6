//! Speculative decoding is exact: tree verification gives the logits of plain decoding bit for bit, greedy
//! output is token-for-token the same with and without speculation (fixture prompts, BFCL tool calls in
//! every tool-call format, trajectory turns, batched), and sampling keeps its distribution.

use std::rc::Rc;
use std::sync::Arc;
use thorn_bench::bfcl;
use thorn_engine::backend::{AttentionMath, Device};
use thorn_engine::engine::scheduler::SchedulerConfig;
use thorn_engine::engine::{Decoder, Engine, EngineConfig, GuideSlot, Request};
use thorn_engine::gguf::Gguf;
use thorn_engine::kv::{Batch, KvCache, KvConfig, KvDtype, Logits, NO_PARENT};
use thorn_engine::model::LogitRows;
use thorn_engine::model::llama::{Llama, Scratch};
use thorn_engine::sample::SamplingParams;
use thorn_engine::spec::{FixedCost, PassShape, SpecConfig, SpecStats, Speculator};
use thorn_guide::ToolGrammars;
use thorn_tests::{default_model, fixture, fixture_prompts, trajectories};
use thorn_tools::chat::{ChatTemplate, Message};
use thorn_tools::{ResponseFormat, ToolChoice, ToolFormat, ToolSet};

fn engine(spec: SpecConfig) -> Engine {
    let g = Arc::new(Gguf::open(default_model()).unwrap());
    Engine::from_gguf(
        g,
        &EngineConfig {
            threads: 2,
            context: 2048,
            speculation: spec,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// Trees on every step that has a proposal, whatever they cost: the most verification work.
fn eager() -> SpecConfig {
    SpecConfig {
        adaptive: false,
        ..SpecConfig::default()
    }
}

#[test]
fn tree_verification_gives_the_logits_of_plain_decoding() {
    let g = Arc::new(Gguf::open(default_model()).unwrap());
    let cpu = Device::cpu(2);
    let model = Llama::load(g, &cpu).unwrap();
    let vocab = model.config().vocab;
    let prompt = &fixture_prompts()[0];
    // A tree straddling page boundaries: two chains and side branches at several depths.
    //   0 -> 1 -> 2 -> 3 -> 4      (stored in place)
    //   0 -> 5 -> 6 ;  1 -> 7 ; root -> 8 -> 9
    let tokens: Vec<u32> = vec![330, 2114, 314, 260, 1345, 28, 3029, 30, 1380, 281];
    let parents: Vec<u32> = vec![NO_PARENT, 0, 1, 2, 3, 0, 5, 1, NO_PARENT, 8];
    let path = |mut i: usize| {
        let mut p = vec![tokens[i]];
        while parents[i] != NO_PARENT {
            i = parents[i] as usize;
            p.push(tokens[i]);
        }
        p.reverse();
        p
    };
    // f32 and (where the CPU has them) bf16 attention products: a tree's tile and a chain's decode steps
    // give the same bits either way. Not fp8 pages yet: a page's E4M3 scale follows the rows written into
    // it, a tree's rejected branches included, so the chain's page holds other bits (issue 54's FP8 work).
    let mut cases = vec![
        (AttentionMath::F32, KvDtype::F32),
        (AttentionMath::F32, KvDtype::F16),
    ];
    if AttentionMath::Bf16.runs_here() {
        cases.push((AttentionMath::Bf16, KvDtype::F16));
    } else {
        eprintln!("bf16 attention skipped: this CPU has no AVX-512 BF16");
    }
    for (math, dtype) in cases {
        cpu.set_attention(math);
        for page_size in [16, 64] {
            let cfg = KvConfig {
                dtype,
                page_size,
                memory: 64 << 20,
                cache_output: false,
                ..KvConfig::default()
            };
            let mut kv = KvCache::new(model.kv_shape(), cfg);
            let mut scratch = Scratch::default();
            let mut batch = Batch::default();
            // The prompt, its last token held back to run with the tree (as a decode step would).
            let (head, last) = prompt.split_at(prompt.len() - 1);
            let mut run = |kv: &mut KvCache,
                           seq: &mut thorn_engine::kv::SeqKv,
                           t: &[u32],
                           p: Option<&[u32]>,
                           want| {
                kv.reserve(seq, seq.len() + t.len()).unwrap();
                batch.clear();
                match p {
                    Some(p) => batch.push_tree(seq, t, p, want),
                    None => batch.push(seq, t, want),
                }
                let out = model
                    .forward(&cpu, kv.pool_mut(), &batch, &mut scratch)
                    .unwrap()
                    .to_vec();
                seq.advance(t.len());
                out
            };
            let mut seq = kv.acquire(&[]);
            run(&mut kv, &mut seq, head, None, Logits::None);
            let mut all = last.to_vec();
            all.extend(&tokens);
            let mut ps = vec![NO_PARENT];
            ps.extend(
                parents
                    .iter()
                    .map(|&p| if p == NO_PARENT { 0 } else { p + 1 }),
            );
            let tree = run(
                &mut kv,
                &mut seq,
                &all,
                Some(&ps),
                Logits::Tail(tokens.len()),
            );
            kv.release(seq, None);
            for i in 0..tokens.len() {
                let mut s = kv.acquire(&[]);
                run(&mut kv, &mut s, head, None, Logits::None);
                let mut chain = last.to_vec();
                chain.extend(path(i));
                let plain = run(&mut kv, &mut s, &chain, None, Logits::Last);
                kv.release(s, None);
                assert!(
                    plain == tree[i * vocab..(i + 1) * vocab],
                    "node {i} ({math:?} products, {dtype:?}, pages of {page_size}): tree logits differ from \
                     the chain's"
                );
            }
        }
    }
}

#[test]
fn accepted_paths_keep_exact_kv() {
    // After a verified tree, the kept KV must be what plain decoding would have written: continuing from
    // it gives the same logits as a sequence that never speculated.
    for adaptive in [false, true] {
        // Trees sized by a fixed cost model: the same shapes however busy the machine is.
        let mut spec = engine(SpecConfig {
            adaptive,
            fixed_cost: Some(FixedCost::MEMORY_BOUND),
            ..SpecConfig::default()
        });
        let mut plain = engine(SpecConfig::off());
        for p in fixture_prompts() {
            let mut repeated = p.clone();
            repeated.extend_from_slice(&p[p.len() / 2..]);
            let req = Request::greedy(repeated.clone(), 40);
            let a = spec.generate(&req, &mut |_| {}).unwrap();
            let b = plain.generate(&req, &mut |_| {}).unwrap();
            assert_eq!(a.tokens, b.tokens);
            assert_eq!(a.text, b.text);
            // The cached continuation (prompt + output) now serves a longer prompt identically.
            let mut next = repeated;
            next.extend(&a.tokens);
            next.push(13);
            let l1 = {
                let mut s = spec.session();
                assert!(s.prefill(&next).unwrap() > 0);
                s.logits().to_vec()
            };
            plain.reset();
            let mut s = plain.session();
            s.prefill(&next).unwrap();
            assert!(l1 == s.logits(), "logits after a speculated turn");
            drop(s);
        }
        let s = spec.spec_stats();
        assert!(s.trees > 0 && s.accepted > 0, "{s:?}");
    }
}

/// The first `per` BFCL questions of three categories with their tools in `format`, as prompts.
fn tool_prompts(e: &Engine, format: ToolFormat, per: usize) -> Vec<(Vec<u32>, Rc<ToolSet>)> {
    let template = ChatTemplate::new(e.gguf().get_str("tokenizer.chat_template").unwrap()).unwrap();
    let mut out = Vec::new();
    for cat in ["simple_python", "multiple", "parallel"] {
        let path = fixture(&format!("bfcl/BFCL_v4_{cat}.json"));
        for q in bfcl::load(&path).unwrap().iter().take(per) {
            let tools = ToolSet::new(&q.tools).unwrap().with_format(format).unwrap();
            let tok = e.tokenizer();
            let text = tools
                .render(&template, &q.messages, "", "<|im_end|>", &|s| tok.quote(s))
                .unwrap();
            out.push((tok.encode_rendered(&text).unwrap(), Rc::new(tools)));
        }
    }
    out
}

/// Agent turns from the replay set: the system prompt, the task, and the first tool result.
fn trajectory_prompts(e: &Engine) -> Vec<(Vec<u32>, Rc<ToolSet>)> {
    let template = ChatTemplate::new(e.gguf().get_str("tokenizer.chat_template").unwrap()).unwrap();
    let rows = trajectories();
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for r in &rows {
        let id = r["conversation_id"].as_str().unwrap().to_owned();
        if r["role"] != "user" || !seen.insert(id.clone()) || out.len() == 2 {
            continue;
        }
        let tools = ToolSet::new(r["tools"].as_array().unwrap()).unwrap();
        let result = rows
            .iter()
            .find(|x| x["conversation_id"] == id.as_str() && x["role"] == "tool")
            .and_then(|x| x["tool_results"][0]["content"].as_str())
            .unwrap_or("");
        let task: String = r["content"].as_str().unwrap().chars().take(2000).collect();
        let msgs = vec![
            Message::system(r["system"].as_str().unwrap_or("")),
            Message::user(format!(
                "{task}\n\nTool output:\n{}",
                &result[..result.len().min(1500)]
            )),
        ];
        let tok = e.tokenizer();
        let text = tools
            .render(&template, &msgs, "", "<|im_end|>", &|s| tok.quote(s))
            .unwrap();
        let mut toks = tok.encode_rendered(&text).unwrap();
        if toks.len() > 1900 {
            toks.drain(..toks.len() - 1900);
        }
        out.push((toks, Rc::new(tools)));
    }
    out
}

/// A prompt and, for tool turns, its tools and tool_choice.
type Case = (Vec<u32>, Option<(Rc<ToolSet>, ToolChoice)>);

fn same_greedy(spec_cfg: SpecConfig, attention: AttentionMath) -> SpecStats {
    let mut spec = engine(spec_cfg);
    let mut plain = engine(SpecConfig::off());
    spec.device().set_attention(attention);
    plain.device().set_attention(attention);
    let grammars = plain.grammars().unwrap().clone();
    let mut cases: Vec<Case> = fixture_prompts().into_iter().map(|p| (p, None)).collect();
    for (p, t) in tool_prompts(&plain, ToolFormat::Hermes, 3) {
        cases.push((p.clone(), Some((Rc::clone(&t), ToolChoice::Required))));
        cases.push((p, Some((t, ToolChoice::Auto))));
    }
    // Qwen3's XML format: its grammar-forced runs (tags, parameter names) drafted and verified too.
    for (p, t) in tool_prompts(&plain, ToolFormat::QwenXml, 1) {
        cases.push((p.clone(), Some((Rc::clone(&t), ToolChoice::Required))));
        cases.push((p, Some((t, ToolChoice::Auto))));
    }
    // The other families' formats, forced: their grammars' runs (control tokens as text here, Gemma's
    // schema-built values, harmony's headers) drafted and verified.
    for format in ToolFormat::ALL
        .into_iter()
        .filter(|f| ![ToolFormat::Hermes, ToolFormat::QwenXml].contains(f))
    {
        for (p, t) in tool_prompts(&plain, format, 1).into_iter().take(2) {
            cases.push((p, Some((t, ToolChoice::Required))));
        }
    }
    for (p, t) in trajectory_prompts(&plain) {
        cases.push((p, Some((t, ToolChoice::Auto))));
    }
    for (i, (prompt, tools)) in cases.iter().enumerate() {
        let req = Request::greedy(prompt.clone(), 48);
        let guide = || {
            tools
                .as_ref()
                .and_then(|(t, c)| grammars.guide(t, c, true, &ResponseFormat::Text).unwrap())
        };
        let (mut g1, mut g2) = (guide(), guide());
        let a = spec
            .generate_guided(&req, g1.as_mut(), &mut |_| {})
            .unwrap();
        let b = plain
            .generate_guided(&req, g2.as_mut(), &mut |_| {})
            .unwrap();
        assert_eq!(
            a.tokens, b.tokens,
            "case {i}: speculation changed the output"
        );
        assert_eq!(a.text, b.text);
        assert_eq!(a.finish, b.finish);
        assert!(a.stats.forward_passes <= b.stats.forward_passes);
    }
    // Batched: the scheduler speculates for every decoding sequence in a shared pass.
    let reqs = |cases: &[Case]| {
        cases
            .iter()
            .take(8)
            .map(|(p, _)| (Request::greedy(p.clone(), 32), None))
            .collect::<Vec<_>>()
    };
    let (a, _) = spec.generate_batch(reqs(&cases), SchedulerConfig::default());
    let (b, _) = plain.generate_batch(reqs(&cases), SchedulerConfig::default());
    for (i, ((ta, ra), (tb, rb))) in a.into_iter().zip(b).enumerate() {
        assert_eq!(
            ra.unwrap().tokens,
            rb.unwrap().tokens,
            "batched request {i}"
        );
        assert_eq!(ta, tb);
    }
    spec.spec_stats()
}

#[test]
fn greedy_output_is_the_same_with_speculation() {
    let mut maths = vec![AttentionMath::F32];
    if AttentionMath::Bf16.runs_here() {
        maths.push(AttentionMath::Bf16);
    } else {
        eprintln!("bf16 attention skipped: this CPU has no AVX-512 BF16");
    }
    for math in maths {
        let s = same_greedy(eager(), math);
        eprintln!("eager trees, {math:?} attention products: {s:?}");
        assert!(s.trees > 20 && s.accepted > 0, "trees were verified: {s:?}");
        assert!(s.accepted < s.drafted, "some branches were rejected: {s:?}");
    }
}

#[test]
fn seeded_sampling_is_the_same_with_speculation() {
    // Verification samples at each node exactly as plain decoding does, from the same random stream.
    let mut spec = engine(eager());
    let mut plain = engine(SpecConfig::off());
    for (i, p) in fixture_prompts().into_iter().enumerate() {
        let mut prompt = p.clone();
        prompt.extend_from_slice(&p);
        let req = Request {
            sampling: SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                seed: Some(i as u64),
                ..SamplingParams::default()
            },
            ..Request::greedy(prompt, 40)
        };
        let a = spec.generate(&req, &mut |_| {}).unwrap();
        let b = plain.generate(&req, &mut |_| {}).unwrap();
        assert_eq!(a.tokens, b.tokens, "prompt {i}");
    }
    assert!(spec.spec_stats().accepted > 0);
}

/// A tiny synthetic "model": a fixed second-order Markov chain over six tokens.
struct Markov {
    toks: [u32; 6],
    table: Vec<[f32; 6]>,
}

impl Markov {
    fn new(toks: [u32; 6]) -> Self {
        let mut x = 0x9E37_79B9_u64;
        let table = (0..36)
            .map(|_| {
                std::array::from_fn(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 1000) as f32 / 400.0
                })
            })
            .collect();
        Markov { toks, table }
    }

    fn index(&self, t: u32) -> usize {
        self.toks.iter().position(|&x| x == t).unwrap_or(0)
    }

    fn logits(&self, history: &[u32], out: &mut [f32]) {
        out.fill(f32::NEG_INFINITY);
        let n = history.len();
        let row = self.index(history[n - 2]) * 6 + self.index(history[n - 1]);
        for (k, &t) in self.toks.iter().enumerate() {
            out[t as usize] = self.table[row][k];
        }
    }

    fn probs(&self, a: u32, b: u32) -> [f64; 6] {
        let r = &self.table[self.index(a) * 6 + self.index(b)];
        let m = r.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let e: Vec<f64> = r.iter().map(|&x| f64::from(x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        std::array::from_fn(|k| e[k] / s)
    }
}

/// Samples `len` tokens after `prompt` from the Markov model, with or without speculation.
fn sample_markov(
    m: &Markov,
    tok: &thorn_engine::tokenizer::Tokenizer,
    sp: &mut Speculator,
    prompt: &[u32],
    seed: u64,
    len: usize,
    speculate: bool,
) -> Vec<u32> {
    let vocab = tok.vocab_size();
    let req = Request {
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        ignore_eos: true,
        speculate,
        ..Request::greedy(prompt.to_vec(), len)
    };
    let mut dec = Decoder::new(req, GuideSlot::None, vocab, 4096);
    let mut rows = vec![0f32; vocab];
    m.logits(dec.history(), &mut rows);
    dec.advance(&mut LogitRows::host(&mut rows, vocab), 0, tok, &mut |_| {})
        .unwrap();
    while !dec.is_done() {
        let shape = PassShape {
            base: dec.pending().len(),
            decisions: 1.0,
            room: 64,
        };
        dec.draft(sp, tok, shape).unwrap();
        let tree = dec.tree().to_vec();
        let parents = dec.tree_parents().to_vec();
        dec.ran_pending();
        if tree.is_empty() {
            m.logits(dec.history(), &mut rows[..vocab]);
            let mut row = LogitRows::host(&mut rows[..vocab], vocab);
            dec.advance(&mut row, 0, tok, &mut |_| {}).unwrap();
            continue;
        }
        rows.resize((tree.len() + 1) * vocab, 0.0);
        let mut h = dec.history().to_vec();
        m.logits(&h, &mut rows[..vocab]);
        for i in 0..tree.len() {
            let mut p = vec![tree[i]];
            let mut at = parents[i];
            while at != NO_PARENT {
                p.push(tree[at as usize]);
                at = parents[at as usize];
            }
            p.reverse();
            let base = h.len();
            h.extend(&p);
            m.logits(&h, &mut rows[(i + 1) * vocab..(i + 2) * vocab]);
            h.truncate(base);
        }
        let mut all = LogitRows::host(&mut rows, vocab);
        dec.advance_tree(&mut all, 0, tok, &mut |_| {}, sp).unwrap();
    }
    dec.finish(&mut |_| {}).tokens
}

#[test]
fn speculative_sampling_keeps_the_distribution() {
    let e = engine(SpecConfig::off());
    let tok = e.tokenizer();
    // Six word tokens; the prompt repeats them so the suffix drafter always has something to offer.
    let toks: [u32; 6] = std::array::from_fn(|i| {
        tok.encode(
            [" red", " green", " blue", " cat", " dog", " sun"][i],
            false,
        )
        .unwrap()[0]
    });
    let m = Markov::new(toks);
    let mut prompt = Vec::new();
    for i in 0..60 {
        prompt.push(toks[(i * 7 + i / 5) % 6]);
    }
    let mut sp = Speculator::new(eager());
    const N: usize = 6000;
    let mut counts = vec![0usize; 216];
    for seed in 0..N as u64 {
        let out = sample_markov(&m, tok, &mut sp, &prompt, 1000 + seed, 4, true);
        let k = out[1..4].iter().fold(0, |k, &t| k * 6 + m.index(t));
        counts[k] += 1;
    }
    assert!(
        sp.stats.accepted > 1000,
        "speculation was exercised: {:?}",
        sp.stats
    );
    // The exact law of tokens 2..4 given the prompt and token 1 is a product of chain steps; token 1's
    // distribution is mixed in by conditioning on it below.
    let n = prompt.len();
    let p1 = m.probs(prompt[n - 2], prompt[n - 1]);
    let mut expect = vec![0f64; 216];
    for (a, &pa) in p1.iter().enumerate() {
        let pb = m.probs(prompt[n - 1], toks[a]);
        for (b, &pbv) in pb.iter().enumerate() {
            let pc = m.probs(toks[a], toks[b]);
            for (c, &pcv) in pc.iter().enumerate() {
                let pd = m.probs(toks[b], toks[c]);
                for (d, &pdv) in pd.iter().enumerate() {
                    expect[b * 36 + c * 6 + d] += pa * pbv * pcv * pdv;
                }
            }
        }
    }
    // Pearson's chi-square over cells with enough mass, against the 0.1% critical value
    // (Wilson-Hilferty approximation).
    let (mut chi, mut df) = (0.0, -1.0f64);
    for (o, p) in counts.iter().zip(&expect) {
        let e = p * N as f64;
        if e >= 5.0 {
            chi += (*o as f64 - e).powi(2) / e;
            df += 1.0;
        }
    }
    let z = 3.09;
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    eprintln!(
        "chi-square {chi:.1} on {df} degrees of freedom (0.1% critical value {crit:.1}); {:?}",
        sp.stats
    );
    assert!(df > 50.0, "enough cells: {df}");
    assert!(
        chi < crit,
        "speculative samples do not follow the model: chi-square {chi:.1} > {crit:.1}"
    );
    // And seed for seed, the same tokens as without speculation.
    let mut plain = Speculator::new(SpecConfig::off());
    for seed in 0..50 {
        assert_eq!(
            sample_markov(&m, tok, &mut sp, &prompt, seed, 6, true),
            sample_markov(&m, tok, &mut plain, &prompt, seed, 6, false)
        );
    }
}
