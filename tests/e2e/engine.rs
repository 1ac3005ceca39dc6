//! The forward pass against the float64 reference and against llama.cpp (tests/data/smollm2).
//!
//! Two precisions are checked:
//! * `Reference` (f32 activations, dequantized weights, f32 KV): the exact math. Logits must match the float
//!   reference to 1e-3 and greedy continuations must be identical (the fixture README's expectations).
//! * `Quantized` (the fast path: 8-bit activations per block of 32, f16 KV), like llama.cpp's CPU backend.
//!   Its error against the float reference is the quantization's, ~0.1-0.3 in logprob; the checks are the
//!   top-1 token where the reference's margin exceeds that error, the log-softmax distance to llama.cpp's own
//!   Q4_1 run, and greedy continuations up to the first step where the reference's top-2 margin is a near-tie.

use std::sync::Arc;
use thorn_engine::backend::AttentionMath;
use thorn_engine::engine::scheduler::SchedulerConfig;
use thorn_engine::engine::{Engine, EngineConfig, Request};
use thorn_engine::gguf::Gguf;
use thorn_engine::kv::KvDtype;
use thorn_engine::model::llama::Precision;
use thorn_guide::ToolGrammars;
use thorn_tests::{argmax, default_model, fixture, fixture_prompts, jsonl, token_ids as ids};

fn engine(precision: Precision) -> Engine {
    let g = Arc::new(Gguf::open(default_model()).unwrap());
    let kv_dtype = if precision == Precision::Reference {
        KvDtype::F32
    } else {
        KvDtype::F16
    };
    Engine::from_gguf(
        g,
        &EngineConfig {
            threads: 2,
            context: 1024,
            kv_dtype,
            precision,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn tensor(file: &str, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixture(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let lse = max
        + x.iter()
            .map(|&v| f64::from(v - max).exp())
            .sum::<f64>()
            .ln() as f32;
    x.iter().map(|&v| v - lse).collect()
}

#[test]
fn reference_precision_matches_the_float_reference() {
    let mut e = engine(Precision::Reference);
    let prompts = jsonl("smollm2/reference_logits.jsonl");
    // The three shortest prompts: the reference path is scalar f64 math over 135M weights per token.
    for p in prompts
        .iter()
        .filter(|p| ["capital", "poem", "python_code"].contains(&p["name"].as_str().unwrap()))
    {
        let name = p["name"].as_str().unwrap();
        e.reset();
        let mut s = e.session();
        s.prefill(&ids(&p["prompt_ids"])).unwrap();
        let want = tensor(
            "smollm2/reference_last_logits.safetensors",
            &format!("last_logits.{name}"),
        );
        let got = s.logits();
        let max_diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max_diff < 1e-3, "{name}: max |logit diff| {max_diff}");
        for pair in p["top20"].as_array().unwrap() {
            let (id, l) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap() as f32,
            );
            assert!(
                (got[id] - l).abs() < 1e-3,
                "{name} top-20 id {id}: {} vs {l}",
                got[id]
            );
        }
    }
    // One full greedy continuation, token for token.
    let p = &prompts[0];
    let want = ids(&p["greedy_ids"]);
    e.reset();
    let out = e
        .generate(
            &Request::greedy(ids(&p["prompt_ids"]), want.len()),
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(out.tokens, want, "greedy continuation of {}", p["name"]);
}

#[test]
fn quantized_precision_tracks_the_reference_and_llama_cpp() {
    let mut e = engine(Precision::Quantized);
    let prompts = jsonl("smollm2/reference_logits.jsonl");
    let llama_top20: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2/llamacpp_q4_1_top20_logprobs.json")).unwrap(),
    )
    .unwrap();
    let mut report = Vec::new();
    for p in &prompts {
        let name = p["name"].as_str().unwrap();
        e.reset();
        let mut s = e.session();
        s.prefill(&ids(&p["prompt_ids"])).unwrap();
        let ours = log_softmax(s.logits());
        drop(s);
        let reference = log_softmax(&tensor(
            "smollm2/reference_last_logits.safetensors",
            &format!("last_logits.{name}"),
        ));
        // llama.cpp's log-softmax at the reference's top-20 ids: `[id, logprob]`.
        let llama: Vec<(usize, f32)> = llama_top20["logprobs"][name]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                (
                    x[0].as_u64().unwrap() as usize,
                    x[1].as_f64().unwrap() as f32,
                )
            })
            .collect();
        // Top-20 of the reference: within the quantization error of both the reference and llama.cpp (the
        // fixture README expects 0.1-0.3 for an 8-bit-activation engine; the bound leaves room for the
        // different float summation orders of the AVX-512 and AVX2 kernels).
        let top: Vec<usize> = p["top20"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x[0].as_u64().unwrap() as usize)
            .collect();
        let d_ref = top
            .iter()
            .map(|&i| (ours[i] - reference[i]).abs())
            .fold(0f32, f32::max);
        assert_eq!(
            llama.iter().map(|&(i, _)| i).collect::<Vec<_>>(),
            top,
            "{name}: the llama.cpp entries are at the reference's top-20 ids"
        );
        let d_llama = llama
            .iter()
            .map(|&(i, l)| (ours[i] - l).abs())
            .fold(0f32, f32::max);
        report.push(format!(
            "{name}: top-20 |Δlogprob| vs reference {d_ref:.3}, vs llama.cpp {d_llama:.3}"
        ));
        assert!(
            d_ref < 0.4,
            "{name}: top-20 logprob diff vs reference {d_ref}"
        );
        assert!(
            d_llama < 0.4,
            "{name}: top-20 logprob diff vs llama.cpp {d_llama}"
        );
        assert_eq!(
            argmax(&ours),
            top[0] as u32,
            "{name}: top-1 (reference margin is large at the last prompt position)"
        );
    }
    eprintln!("{}", report.join("\n"));
}

/// Logit margin under which the reference's top-2 is a near-tie for an 8-bit-activation engine: the
/// fixture records 0.14-0.34 logit error for such an engine, and two such errors can add up.
const NEAR_TIE: f64 = 0.7;

#[test]
fn quantized_greedy_follows_the_reference_except_at_near_ties() {
    let mut e = engine(Precision::Quantized);
    let (mut agreed, mut report) = (0, Vec::new());
    for p in &jsonl("smollm2/reference_logits.jsonl") {
        let name = p["name"].as_str().unwrap();
        let want = ids(&p["greedy_ids"]);
        let margins: Vec<f64> = p["greedy_top1_margin"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_f64().unwrap())
            .collect();
        e.reset();
        let out = e
            .generate(
                &Request::greedy(ids(&p["prompt_ids"]), want.len()),
                &mut |_| {},
            )
            .unwrap();
        // The sequences may part only at a step where the reference itself nearly tied; after that they
        // continue from different histories and are not comparable.
        match out.tokens.iter().zip(&want).position(|(a, b)| a != b) {
            None => {
                assert_eq!(out.tokens.len(), want.len(), "{name}: stopped early");
                agreed += want.len();
                report.push(format!("{name}: all {} tokens equal", want.len()));
            }
            Some(k) => {
                assert!(
                    margins[k] < NEAR_TIE,
                    "{name}: split at step {k} where the reference margin is {} (not a near-tie)",
                    margins[k]
                );
                agreed += k;
                report.push(format!(
                    "{name}: equal for {k} tokens, split at a near-tie (margin {:.3})",
                    margins[k]
                ));
            }
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        agreed >= 100,
        "only {agreed} of 256 tokens agreed before near-ties"
    );
}

#[test]
fn multi_turn_reuses_the_cached_prefix() {
    let mut e = engine(Precision::Quantized);
    let p = &jsonl("smollm2/reference_logits.jsonl")[0];
    let prompt = ids(&p["prompt_ids"]);
    let first = e
        .generate(&Request::greedy(prompt.clone(), 8), &mut |_| {})
        .unwrap();
    assert_eq!(first.stats.cached_tokens, 0);
    let mut longer = prompt.clone();
    longer.extend_from_slice(&first.tokens);
    longer.extend(
        e.tokenizer()
            .encode(
                "<|im_end|>\n<|im_start|>user\nAnd Germany?<|im_end|>\n<|im_start|>assistant\n",
                true,
            )
            .unwrap(),
    );
    let second = e
        .generate(&Request::greedy(longer.clone(), 8), &mut |_| {})
        .unwrap();
    // Everything but the last generated token (never fed back) is reused.
    assert_eq!(
        second.stats.cached_tokens,
        prompt.len() + first.tokens.len() - 1
    );
    // And the result equals a cold run.
    let mut cold = engine(Precision::Quantized);
    let fresh = cold
        .generate(&Request::greedy(longer, 8), &mut |_| {})
        .unwrap();
    assert_eq!(second.tokens, fresh.tokens);
}

fn quantized(cfg: EngineConfig) -> Engine {
    let g = Arc::new(Gguf::open(default_model()).unwrap());
    Engine::from_gguf(
        g,
        &EngineConfig {
            threads: 2,
            precision: Precision::Quantized,
            ..cfg
        },
    )
    .unwrap()
}

#[test]
fn prefix_reuse_gives_bitwise_identical_logits() {
    for attention in attention_maths() {
        prefix_reuse_case(attention);
    }
}

/// f32 attention products, and bf16 ones where this CPU has them (the bit-for-bit tests run both).
fn attention_maths() -> Vec<AttentionMath> {
    if AttentionMath::Bf16.runs_here() {
        vec![AttentionMath::F32, AttentionMath::Bf16]
    } else {
        eprintln!("bf16 attention skipped: this CPU has no AVX-512 BF16");
        vec![AttentionMath::F32]
    }
}

fn prefix_reuse_case(attention: AttentionMath) {
    let mut e = quantized(EngineConfig {
        context: 1024,
        attention,
        ..EngineConfig::default()
    });
    for prompt in fixture_prompts() {
        e.reset();
        let cold = {
            let mut s = e.session();
            assert_eq!(s.prefill(&prompt).unwrap(), 0);
            s.logits().to_vec()
        };
        // Leave a prefix in the cache (ending inside a page), then prefill the whole prompt on top of it.
        for cut in [prompt.len() / 2, prompt.len() - 1] {
            e.reset();
            let mut s = e.session();
            s.prefill(&prompt[..cut]).unwrap();
            let hit = s.prefill(&prompt).unwrap();
            assert_eq!(hit, cut, "the cached prefix is reused");
            assert_eq!(s.logits(), &cold[..], "logits after reusing {cut} tokens");
        }
    }
}

#[test]
fn batched_generation_matches_one_at_a_time() {
    for attention in attention_maths() {
        batched_case(attention);
    }
}

fn batched_case(attention: AttentionMath) {
    let mut e = quantized(EngineConfig {
        context: 1024,
        attention,
        ..EngineConfig::default()
    });
    let mut prompts = fixture_prompts();
    // Requests that share a prefix with one another too.
    let shared: Vec<u32> = prompts[0].iter().chain(&prompts[1]).copied().collect();
    prompts.push(shared);
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            e.reset();
            e.generate(&Request::greedy(p.clone(), 24), &mut |_| {})
                .unwrap()
                .tokens
        })
        .collect();
    for (max_batch, step_tokens) in [(8, 256), (3, 16)] {
        e.reset();
        let reqs = prompts
            .iter()
            .map(|p| (Request::greedy(p.clone(), 24), None))
            .collect();
        let (outs, stats) = e.generate_batch(
            reqs,
            SchedulerConfig {
                max_batch,
                step_tokens,
            },
        );
        for (i, ((text, r), want)) in outs.into_iter().zip(&alone).enumerate() {
            let g = r.unwrap();
            assert_eq!(&g.tokens, want, "request {i} (batch {max_batch})");
            assert_eq!(text, g.text);
        }
        assert!(
            stats.batched_sequences > stats.steps,
            "sequences shared steps: {stats:?}"
        );
    }
}

#[test]
fn a_tiny_kv_budget_preempts_but_completes_every_request() {
    let prompts = fixture_prompts();
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let per_position = 2 * 30 * 3 * 64 * 2; // SmolLM2: layers * KV heads * head_dim, K and V, f16
    let positions = (longest + 40).next_multiple_of(32) + 32;
    let mut small = quantized(EngineConfig {
        context: 1024,
        kv_memory: positions * per_position,
        page_size: 32,
        ..EngineConfig::default()
    });
    // The same page size on both sides: attention's summation order follows the pages.
    let mut big = quantized(EngineConfig {
        context: 1024,
        page_size: 32,
        ..EngineConfig::default()
    });
    let reqs = || {
        prompts
            .iter()
            .map(|p| (Request::greedy(p.clone(), 32), None))
            .collect::<Vec<_>>()
    };
    let (want, _) = big.generate_batch(reqs(), SchedulerConfig::default());
    let (got, stats) = small.generate_batch(reqs(), SchedulerConfig::default());
    assert!(
        stats.preemptions > 0,
        "the budget forced preemption: {stats:?}"
    );
    for (i, ((_, g), (_, w))) in got.into_iter().zip(want).enumerate() {
        assert_eq!(g.unwrap().tokens, w.unwrap().tokens, "request {i}");
    }
    let kv = small.kv_stats();
    assert!(kv.pages_total * kv.page_size <= positions);
    eprintln!("tiny budget: {stats:?}, {kv:?}");
}

/// What storing the KV cache in f16 or FP8 (E4M3) costs in logits, against f32 KV. It is measured at the
/// reference precision (f32 activations, f64 sums), where a change in the attention kernel's summation
/// order moves logits by ~1e-5: the error is then the storage format's own, and a first token that moves
/// means the format moved it. At the quantized precision the same comparison is dominated by the 8-bit
/// activations, which amplify any last-bit difference (f16 KV alone moves the likely tokens' log-probabilities by up to
/// ~0.45 nats there, and first tokens sit within 0.23-0.29 nats of the runner-up on three of the prompts), so
/// that run is reported and held only to a bound that a wrong scale or a broken conversion would break.
#[test]
fn fp8_kv_cache_stays_close_to_f32_at_the_reference_precision() {
    kv_formats_stay_close_to_f32(Precision::Reference);
}

/// The same comparison at the quantized precision: the paged kernels' many-page walk over the long prompt,
/// in the SIMD kernels (`scripts/test-aarch64 e2e` runs this one; the reference precision's scalar f64 sums
/// are the same code on every CPU and cost seconds a token under emulation).
#[test]
fn fp8_kv_cache_stays_close_to_f32_at_the_quantized_precision() {
    kv_formats_stay_close_to_f32(Precision::Quantized);
}

fn kv_formats_stay_close_to_f32(precision: Precision) {
    let mk = |kv_dtype, attention, precision| {
        let g = Arc::new(Gguf::open(default_model()).unwrap());
        let cfg = EngineConfig {
            threads: 2,
            context: 1024,
            kv_dtype,
            attention,
            precision,
            ..EngineConfig::default()
        };
        Engine::from_gguf(g, &cfg).unwrap()
    };
    // The reference precision is slow: its run skips the one long prompt (613 tokens), so the paged
    // kernels' many-page walk is held at the quantized precision only (the others span up to 4 pages).
    let prompts: Vec<_> = fixture_prompts()
        .into_iter()
        .filter(|p| precision == Precision::Quantized || p.len() <= 256)
        .collect();
    let greedy = |e: &mut Engine, p: &[u32]| {
        e.reset();
        e.generate(&Request::greedy(p.to_vec(), GREEDY_TOKENS), &mut |_| {})
            .unwrap()
            .tokens
    };
    let mut f32e = mk(KvDtype::F32, AttentionMath::F32, precision);
    let want: Vec<(Vec<f32>, Vec<u32>)> = prompts
        .iter()
        .map(|p| {
            f32e.reset();
            let lp = {
                let mut s = f32e.session();
                s.prefill(p).unwrap();
                log_softmax(s.logits())
            };
            let g = if precision == Precision::Quantized {
                greedy(&mut f32e, p)
            } else {
                Vec::new()
            };
            (lp, g)
        })
        .collect();
    for (dtype, attention) in [
        (KvDtype::F16, AttentionMath::F32),
        (KvDtype::Fp8, AttentionMath::F32),
        (KvDtype::F16, AttentionMath::Bf16),
        (KvDtype::Fp8, AttentionMath::Bf16),
    ] {
        let bf16 = attention == AttentionMath::Bf16;
        if !attention.runs_here() {
            eprintln!(
                "{precision:?} precision, {} KV, bf16 attention: skipped, this CPU has no AVX-512 BF16",
                dtype.name()
            );
            continue;
        }
        let mut e = mk(dtype, attention, precision);
        let (mut worst, mut top1, mut same, mut total) = (0f32, 0, 0, 0);
        for (p, (a, g)) in prompts.iter().zip(&want) {
            e.reset();
            let b = {
                let mut s = e.session();
                s.prefill(p).unwrap();
                log_softmax(s.logits())
            };
            // Distance on the tokens that matter: the f32 run's top 10.
            let mut order: Vec<usize> = (0..a.len()).collect();
            order.sort_by(|&i, &j| a[j].total_cmp(&a[i]));
            for &i in &order[..10] {
                worst = worst.max((a[i] - b[i]).abs());
            }
            top1 += usize::from(argmax(a) == argmax(&b));
            if precision == Precision::Quantized {
                let mine = greedy(&mut e, p);
                same += g.iter().zip(&mine).take_while(|(x, y)| x == y).count();
                total += g.len();
            }
        }
        let n = prompts.len();
        let math = if bf16 { "bf16" } else { "f32" };
        eprintln!(
            "{precision:?} precision, {} KV, {math} attention: top-10 logprob error max {worst:.3}, top-1 \
             agreement {top1}/{n}, greedy tokens equal before the first split {same}/{total}",
            dtype.name()
        );
        if precision == Precision::Reference {
            // f16 keeps 11 significant bits (measured 0.003); E4M3 keeps 4 (~3% per element,
            // measured up to 0.63): no first token may change, and the likely tokens stay within a nat.
            // bf16 products keep 8 bits of the query, keys, values and weights (measured 0.046).
            let bound = match (dtype, bf16) {
                (KvDtype::F16, false) => 0.02,
                (KvDtype::F16, true) => BF16_BOUND,
                _ => 1.0,
            };
            assert_eq!(top1, n, "{} {math}: the first token changed", dtype.name());
            assert!(
                worst < bound,
                "{} {math}: logprob error {worst}",
                dtype.name()
            );
        } else {
            assert!(
                worst < 2.0,
                "{} {math}: quantized logprob error {worst}",
                dtype.name()
            );
            assert!(
                top1 + 2 >= n,
                "{} {math}: first tokens changed on {} of {n}",
                dtype.name(),
                n - top1
            );
        }
    }
}

/// Greedy tokens each KV format's run generates for its agreement figure.
const GREEDY_TOKENS: usize = 32;
/// The reference-precision bound on f16 KV with bf16 attention products.
const BF16_BOUND: f32 = 0.15;

/// A grammar-forced run (a long `const`) goes through in step-sized pieces: it never makes one pass
/// longer than the step budget, so the requests batched with it keep decoding; its output is still exact.
#[test]
fn a_long_forced_run_respects_the_step_budget() {
    use thorn_tools::{ResponseFormat, ToolChoice, ToolSet};
    let mut e = quantized(EngineConfig {
        context: 2048,
        ..EngineConfig::default()
    });
    let text = "abc ".repeat(400);
    let format = ResponseFormat::JsonSchema {
        name: "c".into(),
        schema: serde_json::json!({ "const": text }),
        strict: false,
    };
    let prompts = fixture_prompts();
    let g = e
        .grammars()
        .unwrap()
        .guide(&ToolSet::default(), &ToolChoice::None, false, &format)
        .unwrap()
        .map(Box::new);
    // No draft trees, so every pass is only forced, prompt and decoded tokens.
    let plain = |p: &Vec<u32>, n| Request {
        speculate: false,
        ..Request::greedy(p.clone(), n)
    };
    let reqs = vec![
        (plain(&prompts[0], 1200), g),
        (plain(&prompts[1], 24), None),
    ];
    let step_tokens = 64;
    let (outs, stats) = e.generate_batch(
        reqs,
        SchedulerConfig {
            max_batch: 4,
            step_tokens,
        },
    );
    let long = outs[0].1.as_ref().unwrap();
    assert_eq!(long.text, serde_json::to_string(&text).unwrap());
    assert!(outs[1].1.is_ok());
    assert!(
        stats.max_step_tokens <= step_tokens as u64 + 1,
        "a pass of {} tokens with a budget of {step_tokens}: {stats:?}",
        stats.max_step_tokens
    );
}
