//! The Llama model's tests: its launch budget and host time per step on the GPU device, step plans, and the
//! default model on the GPU device against the CPU.

use super::*;
use crate::kv::{KvCache, KvConfig, KvDtype, Logits};

/// The default model where `thorn model pull` puts it, if it is there.
fn default_model() -> Option<std::path::PathBuf> {
    let p = crate::cache_dir()?.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

/// Logits of a prefill and two decode steps of `tokens` on `dev`, through the first `layers` layers.
fn run(dev: &Device, g: &Arc<Gguf>, tokens: &[u32], layers: usize) -> Vec<Vec<f32>> {
    let mut model = Llama::load(Arc::clone(g), dev).unwrap();
    model.layers.truncate(layers);
    let dtype = KvDtype::F16;
    let mut kv = KvCache::on(
        dev,
        model.kv_shape(),
        KvConfig {
            dtype,
            page_size: 16,
            memory: 1 << 24,
            cache_output: false,
            ..KvConfig::default()
        },
    )
    .unwrap();
    let (mut s, mut batch, mut seq) = (Scratch::default(), Batch::default(), kv.acquire(&[]));
    let mut out = Vec::new();
    for chunk in [
        &tokens[..tokens.len() - 2],
        &tokens[tokens.len() - 2..][..1],
        &tokens[tokens.len() - 1..],
    ] {
        let want = seq.len() + chunk.len();
        kv.reserve(&mut seq, want).unwrap();
        batch.clear();
        batch.push(&seq, chunk, Logits::Last);
        out.push(
            model
                .forward(dev, kv.pool_mut(), &batch, &mut s)
                .unwrap()
                .to_vec(),
        );
        seq.advance(chunk.len());
    }
    kv.release(seq, None);
    out
}

/// The most kernel launches one SmolLM2 decode step may take on the GPU device. It only goes down (each
/// fusion that lands lowers it to what the step then takes) unless a launch takes over host work. Today 6
/// a layer (QKV with the norm in its prologue, RoPE and KV write, attention with its merge, the output
/// projection with the residual add, gate|up with the norm, down with SwiGLU and the add), the LM head
/// with its norm, the logits' reduction to each row's greedy token and log-normaliser (which the step then
/// reads back: 12 bytes, not the 196 KB row), and the embedding rows' copy from the step's staged inputs
/// into the residual stream (which lets the inputs travel in one upload instead of four).
const DECODE_LAUNCH_BUDGET: usize = 183;

/// One forward pass of `tokens` for `seq`, its KV reserved first, its logits read as a greedy step reads them.
fn step(
    model: &Llama,
    dev: &Device,
    kv: &mut KvCache,
    seq: &mut crate::kv::SeqKv,
    s: &mut Scratch,
    tokens: &[u32],
) {
    let want = seq.len() + tokens.len();
    kv.reserve(seq, want).unwrap();
    let mut batch = Batch::default();
    batch.push(seq, tokens, Logits::Last);
    // As the engine reads a greedy step: the row's best where the device reduced it, else the row.
    let mut rows = model.pass(dev, kv.pool_mut(), &batch, s).unwrap();
    if rows.best(0).is_none() {
        rows.row(0);
    }
    seq.advance(tokens.len());
}

/// What one SmolLM2 decode step asks of the GPU device, counted on the null runtime (a model of
/// SmolLM2's shape whose kernels are counted, never run): the launches, against
/// [`DECODE_LAUNCH_BUDGET`], and per kernel; the copies and waits (one upload, one read-back, no wait);
/// and the host's time per step with graphs off and on (printed, not asserted: the device's own work per
/// step, without a GPU).
///
/// `cargo test -p thorn-engine --lib decode_launch_budget -- --nocapture` prints
/// `launches per decode step: N`.
#[test]
fn decode_launch_budget() {
    use crate::backend::sim::Counting;
    use crate::testutil::{SMOLLM2_135M, skeleton_llama};
    let g = Arc::new(skeleton_llama(SMOLLM2_135M, crate::quant::GgmlType::Q4_1));
    let rt = Counting::null();
    let dev = Device::gpu(Arc::clone(&rt) as _);
    dev.set_graphs(false);
    let model = Llama::load(Arc::clone(&g), &dev).unwrap();
    let mut kv = KvCache::on(
        &dev,
        model.kv_shape(),
        KvConfig {
            dtype: KvDtype::F16,
            page_size: 16,
            memory: 1 << 26,
            cache_output: false,
            ..KvConfig::default()
        },
    )
    .unwrap();
    let (mut s, mut seq) = (Scratch::default(), kv.acquire(&[]));
    // A prefill and two decode steps grow every buffer; the fourth pass is counted.
    step(
        &model,
        &dev,
        &mut kv,
        &mut seq,
        &mut s,
        &[1, 2, 3, 4, 5, 6, 7, 8],
    );
    for t in [9, 10] {
        step(&model, &dev, &mut kv, &mut seq, &mut s, &[t]);
    }
    rt.take();
    rt.take_kernels();
    step(&model, &dev, &mut kv, &mut seq, &mut s, &[11]);
    let c = rt.take();
    println!("launches per decode step: {}", c.launches);
    for (kernel, n) in rt.take_kernels() {
        println!("  {kernel}: {n}");
    }
    println!(
        "uploads {} ({} bytes), downloads {}, waits {}",
        c.uploads, c.upload_bytes, c.downloads, c.waits
    );
    // The step's inputs (its token's embedding row, the batch metadata, the RoPE rows) in one upload;
    // its greedy token and normaliser in one read-back.
    assert_eq!((c.uploads, c.downloads, c.waits), (1, 1, 0), "{c:?}");
    // The host's time per decode step: the device's own work, kernels not run.
    let mut time = |label: &str| {
        let mut us: Vec<f64> = (0..64)
            .map(|i| {
                let t0 = std::time::Instant::now();
                step(&model, &dev, &mut kv, &mut seq, &mut s, &[12 + i]);
                t0.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        us.sort_by(f64::total_cmp);
        println!(
            "host time per decode step, {label}: median {:.1} us",
            us[32]
        );
    };
    time("graphs off");
    dev.set_graphs(true);
    // Timed as served: a step seen before is replayed from its plan, not recorded to be checked.
    dev.verify_steps(false);
    time("graphs on");
    let st = dev.graph_stats().unwrap();
    println!(
        "steps replayed from a plan: {} of {} graph replays",
        st.steps, st.replays
    );
    kv.release(seq, None);
    assert!(
        c.launches <= DECODE_LAUNCH_BUDGET,
        "{} launches per decode step, over the budget of {DECODE_LAUNCH_BUDGET}",
        c.launches
    );
}

/// Decode steps replayed whole from their step plans (none of the model's ops run on the host) give
/// the bits of the same steps run op by op, through what a plan must notice between two steps: a new
/// page every 16 positions, a second sequence joining the batch (another shape) and leaving, the staging
/// growing for it; and what it must not: the context growing past a tile of attention (64 positions: a
/// second split, on the same grid). Most steps are replayed.
#[test]
fn decode_steps_replayed_from_their_plans_match_steps_run_op_by_op() {
    use crate::testutil::{LlamaShape, random_llama};
    let shape = LlamaShape {
        layers: 2,
        d_model: 128,
        heads: 4,
        kv_heads: 2,
        ffn: 256,
        vocab: 512,
    };
    let g = Arc::new(random_llama(shape, crate::quant::GgmlType::Q4_1, 3));
    let passes = |dev: &Device| {
        let model = Llama::load(Arc::clone(&g), dev).unwrap();
        let mut kv = KvCache::on(
            dev,
            model.kv_shape(),
            KvConfig {
                dtype: KvDtype::F16,
                page_size: 16,
                memory: 1 << 22,
                cache_output: false,
                ..KvConfig::default()
            },
        )
        .unwrap();
        let mut s = Scratch::default();
        let (mut a, mut b) = (kv.acquire(&[]), kv.acquire(&[]));
        let mut out = Vec::new();
        let mut pass = |kv: &mut KvCache, seqs: &mut [(&mut crate::kv::SeqKv, u32)]| {
            let mut batch = Batch::default();
            for (seq, t) in seqs.iter_mut() {
                let want = seq.len() + 1;
                kv.reserve(seq, want).unwrap();
                batch.push(seq, &[*t], Logits::Last);
            }
            out.push(
                model
                    .forward(dev, kv.pool_mut(), &batch, &mut s)
                    .unwrap()
                    .to_vec(),
            );
            seqs.iter_mut().for_each(|(seq, _)| seq.advance(1));
        };
        for i in 0..72 {
            pass(&mut kv, &mut [(&mut a, 1 + i % 500)]);
        }
        for i in 0..6 {
            pass(&mut kv, &mut [(&mut a, 7 + i), (&mut b, 300 + i)]);
        }
        for i in 0..6 {
            pass(&mut kv, &mut [(&mut a, 40 + i)]);
        }
        kv.release(a, None);
        kv.release(b, None);
        out
    };
    let off = Device::gpu(Arc::new(crate::backend::sim::Sim));
    off.set_graphs(false);
    let want = passes(&off);
    let on = Device::gpu(Arc::new(crate::backend::sim::Sim));
    on.verify_steps(false);
    let got = passes(&on);
    assert_ne!(want[0], want[1], "the model's logits depend on the token");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g == w, "pass {i}: a replayed step's logits differ");
    }
    // Checked: every pass that could be replayed is recorded and its launches compared with the plan's.
    let checked = Device::gpu(Arc::new(crate::backend::sim::Sim));
    assert!(passes(&checked) == want, "checked passes differ");
    assert_eq!(checked.graph_stats().unwrap().steps, 0);
    let st = on.graph_stats().unwrap();
    // Per shape (one sequence at any depth, two sequences, one again after the staging grew) at most
    // three passes are recorded: one that grows staging (its wait splits it), then two (the second
    // captured). The rest are replayed.
    assert!(st.steps >= 84 - 3 * 3, "{st:?}");
}

/// An engine on `dev` over a 2-layer random Llama (`seed`) with the repository's tiny test model's byte-level
/// tokenizer of 256 tokens: one thread, 512 positions of f16 pages of 16, the rest as `adjust` sets it.
fn tiny_engine(
    dev: Device,
    seed: u64,
    adjust: impl FnOnce(&mut crate::engine::EngineConfig),
) -> crate::engine::Engine {
    use crate::testutil::{LlamaShape, random_llama};
    let shape = LlamaShape {
        layers: 2,
        d_model: 128,
        heads: 4,
        kv_heads: 2,
        ffn: 256,
        vocab: 256,
    };
    let g = Arc::new(random_llama(shape, crate::quant::GgmlType::Q4_1, seed));
    let tokenizer = Arc::new(
        Gguf::open(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/data/qwen35-tiny/model.gguf"),
        )
        .unwrap(),
    );
    let m = crate::model::Model::Llama(Llama::load(g, &dev).unwrap());
    let mut cfg = crate::engine::EngineConfig {
        threads: 1,
        context: 512,
        kv_dtype: KvDtype::F16,
        page_size: 16,
        ..crate::engine::EngineConfig::default()
    };
    adjust(&mut cfg);
    crate::engine::Engine::with_model(tokenizer, m, dev, &cfg).unwrap()
}

/// Top-k sampling on a GPU draws from each row's candidates found on the device (`row_top`, read back with
/// the row's normaliser instead of the row): the same tokens and log-probabilities (to rounding) as the
/// same requests drawing from the whole rows (a zero logit bias sends them there), for the same seeds,
/// alone and batched.
#[test]
fn top_k_sampling_on_the_gpu_draws_from_the_devices_candidates() {
    use crate::engine::Request;
    use crate::spec::SpecConfig;
    let rt = crate::backend::sim::Counting::new();
    let d = Device::gpu(Arc::clone(&rt) as _);
    let mut e = tiny_engine(d, 5, |cfg| cfg.speculation = SpecConfig::off());
    let request = |text: &str, seed: u64, row: bool| {
        let mut r = Request::greedy(text.bytes().map(u32::from).collect(), 24);
        r.ignore_eos = true;
        r.sampling.temperature = 0.9;
        r.sampling.top_k = 20;
        r.sampling.top_p = 0.95;
        r.sampling.top_logprobs = 3;
        r.sampling.seed = Some(seed);
        if row {
            r.sampling.logit_bias = vec![(0, 0.0)];
        }
        r
    };
    let mut run = |row: bool| {
        rt.take_kernels();
        rt.take();
        let one = e.generate(&request("abcabc", 1, row), &mut |_| {}).unwrap();
        e.reset();
        let reqs = vec![
            (request("xyz", 2, row), None),
            (request("hello", 3, row), None),
        ];
        let (two, _) = e.generate_batch(reqs, Default::default());
        e.reset();
        let tops = rt.take_kernels().get("row_top").copied().unwrap_or(0);
        let read = rt.take().download_bytes;
        let mut out = vec![one];
        out.extend(two.into_iter().map(|(_, r)| r.unwrap()));
        (out, tops, read)
    };
    let (device, tops, few) = run(false);
    let (rows, none, all) = run(true);
    assert!(tops > 0 && none == 0, "row_top launches: {tops} and {none}");
    // 3 + 129 floats a row instead of 256 (SmolLM2's 49152: 0.3% of the row).
    assert!(few < all, "read back {few} bytes instead of {all}");
    assert!(device[0].tokens.iter().any(|&t| t != device[0].tokens[0]));
    for (a, b) in device.iter().zip(&rows) {
        assert_eq!(a.tokens, b.tokens, "the same draws");
        for (x, y) in a.sampled.iter().zip(&b.sampled) {
            assert!((x.logprob - y.logprob).abs() < 1e-4, "{x:?} vs {y:?}");
            let ids = |s: &crate::sample::Sampled| s.top.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!(ids(x), ids(y));
        }
    }
}

/// SmolLM2 (the default model, Q4_1) through the GPU device, its kernels run by the simulator, against
/// the CPU device, for a 4-token prefill and two decode steps over f16 pages.
///
/// The two differ only in the order of float sums (the RMS norms give the same bits, so the 8-bit
/// activations start out the same), but a sum that lands on the other side of a rounding boundary flips
/// an 8-bit activation, and SmolLM2's outlier features amplify each flip (as between any two kernels of
/// this quantized math). Which sums flip depends on the CPU's kernels too (AVX-512 and AVX2 sum in
/// other orders): through two layers a flip or two was measured, 5e-4 of the largest logit on an
/// AVX-512 Xeon, 2.4e-3 on an AVX2 EPYC. So the two-layer logits must agree to 1e-2 of the largest (a
/// wrong kernel is off by the logits' own size), and through all 30 the greedy tokens agree and the
/// log-probabilities of the CPU's top 20 stay within 0.4 (the bound the end-to-end tests hold an
/// 8-bit-activation engine to against the f64 reference and llama.cpp).
#[test]
fn the_default_model_on_the_gpu_device_matches_the_cpu() {
    let Some(path) = default_model() else {
        println!("skipped: the default model is not pulled (`thorn model pull`)");
        return;
    };
    let g = Arc::new(Gguf::open(&path).unwrap());
    let tokens = [1u32, 504, 3458, 282, 4237, 314];
    // Two layers: the GPU kernels quantize activations as this CPU's SIMD kernels do, so the logits agree
    // closely. Thirty layers: against the scalar kernels, the oracle, the same on every machine (the
    // SIMD paths' rounding compounds differently over 30 layers, AVX2's more than AVX-512's, and the
    // GPU's kernels answer to the reference, not to whichever SIMD path the test machine has).
    let scalar = Device::Cpu(crate::backend::cpu::Cpu::with_isa(
        2,
        crate::backend::cpu::simd::Isa::Scalar,
    ));
    let cpu2 = run(&Device::cpu(2), &g, &tokens, 2);
    let cpu30 = run(&scalar, &g, &tokens, 30);
    for dev in crate::backend::sim::gpu_devices() {
        check_against_cpu(&dev, &g, &tokens, &cpu2, &cpu30);
    }
}

/// On a GPU that reads host memory in place (unified memory, as on Jetson Thor; here the counting
/// simulator standing for one), SmolLM2's matrices stay in the file's mapping: loading uploads only
/// the norm weights, the fused QKV and gate/up matrices keep their parts where the file has them, and
/// the logits are the bits of a device that uploads its weights unpacked (the same kernels read the same bytes).
#[test]
fn a_unified_memory_gpu_reads_the_weights_in_place() {
    let Some(path) = default_model() else {
        println!("skipped: the default model is not pulled (`thorn model pull`)");
        return;
    };
    let g = Arc::new(Gguf::open(&path).unwrap());
    let rt = crate::backend::sim::Counting::unified();
    let dev = Device::gpu(Arc::clone(&rt) as _);
    let model = Llama::load(Arc::clone(&g), &dev).unwrap();
    let loaded = rt.take();
    let l = &model.layers[0];
    assert!(l.qkv.matrix().in_place() && l.wo.matrix().in_place());
    assert!(model.head.output().matrix().in_place());
    let weights = model.weight_bytes();
    println!(
        "in place: {weights} bytes of weights, {} bytes uploaded while loading",
        loaded.upload_bytes
    );
    assert!(loaded.upload_bytes * 100 < weights, "{loaded:?}");
    drop(model);
    let tokens = [1u32, 504, 3458, 282, 4237, 314];
    // Uploaded as the file lays them out (not packed), so the same kernels read the same bytes.
    let uploaded = Device::gpu(Arc::new(crate::backend::sim::Sim));
    uploaded.set_packed_weights(false);
    assert_eq!(run(&dev, &g, &tokens, 2), run(&uploaded, &g, &tokens, 2));
}

fn check_against_cpu(
    dev: &Device,
    g: &Arc<Gguf>,
    tokens: &[u32],
    cpu2: &[Vec<f32>],
    cpu30: &[Vec<f32>],
) {
    let name = dev.name();
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
            .0
    };
    let log_softmax = |v: &[f32]| {
        let m = v.iter().fold(f32::MIN, |a, &x| a.max(x));
        let lse = m + v.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
        v.iter().map(|&x| x - lse).collect::<Vec<f32>>()
    };
    for (step, (c, q)) in cpu2.iter().zip(&run(dev, g, tokens, 2)).enumerate() {
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = c.iter().zip(q).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!(
            "{name}, 2 layers, step {step}: max |logit difference| {diff:e} (largest {scale})"
        );
        assert!(
            diff <= 1e-2 * scale,
            "{name}, 2 layers, step {step}: {diff} of {scale}"
        );
    }
    for (step, (c, q)) in cpu30.iter().zip(&run(dev, g, tokens, 30)).enumerate() {
        assert_eq!(argmax(c), argmax(q), "{name}, step {step}: greedy token");
        let (lc, lq) = (log_softmax(c), log_softmax(q));
        let mut top: Vec<usize> = (0..c.len()).collect();
        top.sort_by(|&a, &b| c[b].total_cmp(&c[a]));
        let d = top[..20]
            .iter()
            .map(|&i| (lc[i] - lq[i]).abs())
            .fold(0f32, f32::max);
        println!("{name}, 30 layers, step {step}: top-20 |Δlogprob| {d:.3}");
        assert!(
            d < 0.4,
            "{name}, 30 layers, step {step}: top-20 logprob difference {d}"
        );
    }
}

/// Greedy generation through the engine on the GPU device (the simulator): its scheduler's decode steps,
/// the suffix drafter's draft trees and two requests batched give the same tokens with step plans replayed
/// as with graphs off; and with every replay checked against a recording instead (the tests' default), so
/// a pass the engine makes whose key misses what its launches depend on fails here. Greedy picks read only
/// each row's best, reduced on the device: the same tokens as picks from the whole rows (asked for by
/// reporting an alternative), their log-probabilities to rounding.
#[test]
fn the_engine_on_the_gpu_device_generates_the_same_with_step_plans() {
    use crate::engine::{Engine, Request};
    use crate::spec::{FixedCost, SpecConfig};
    let engine = |graphs: bool, checked: bool| {
        let d = Device::gpu(Arc::new(crate::backend::sim::Sim));
        d.verify_steps(checked);
        tiny_engine(d, 11, |cfg| {
            cfg.cuda_graphs = graphs;
            // A fixed cost model: whether a draft is worth a pass must not depend on the machine's load.
            cfg.speculation = SpecConfig {
                fixed_cost: Some(FixedCost::MEMORY_BOUND),
                ..SpecConfig::default()
            };
        })
    };
    let request = |text: &str, rows: bool| {
        let mut r = Request::greedy(text.bytes().map(u32::from).collect(), 32);
        r.ignore_eos = true;
        r.sampling.top_logprobs = usize::from(rows);
        r
    };
    let generate = |e: &mut Engine, rows: bool| {
        let one = e
            .generate(&request("abcabcabc", rows), &mut |_| {})
            .unwrap();
        e.reset();
        let reqs = vec![
            (request("xyzxyz", rows), None),
            (request("hello hello", rows), None),
        ];
        let (two, _) = e.generate_batch(reqs, Default::default());
        let mut out = vec![one];
        out.extend(two.into_iter().map(|(_, r)| r.unwrap()));
        out
    };
    let run = |e: &mut Engine| -> Vec<Vec<u32>> {
        generate(e, false).into_iter().map(|g| g.tokens).collect()
    };
    let mut off = engine(false, false);
    let from_rows = generate(&mut off, true);
    let want: Vec<Vec<u32>> = from_rows.iter().map(|g| g.tokens.clone()).collect();
    off.reset();
    let from_best = generate(&mut off, false);
    for (b, r) in from_best.iter().zip(&from_rows) {
        assert_eq!(b.tokens, r.tokens, "picks from the rows' best");
        for (x, y) in b.sampled.iter().zip(&r.sampled) {
            assert!((x.logprob - y.logprob).abs() < 1e-4, "{x:?} vs {y:?}");
        }
    }
    assert!(want[0].iter().any(|&t| t != want[0][0]), "{want:?}");
    let mut replayed = engine(true, false);
    assert_eq!(run(&mut replayed), want, "replayed from step plans");
    let st = replayed.device().graph_stats().unwrap();
    assert!(st.steps > 0, "no pass was replayed from its plan: {st:?}");
    let mut checked = engine(true, true);
    assert_eq!(run(&mut checked), want, "checked against step plans");
    assert_eq!(checked.device().graph_stats().unwrap().steps, 0);
    assert!(
        replayed.spec_stats().trees > 0,
        "no draft tree was verified"
    );
}
