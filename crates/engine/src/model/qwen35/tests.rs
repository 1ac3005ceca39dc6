//! The `qwen35` goldens (`tests/data/qwen35-tiny`): the reference and the engine's forward pass, from
//! the GGUF and from the HF checkpoint.

use super::*;
use crate::kv::{KvCache, KvConfig, KvDtype, Recurrent, SeqKv};

/// A device to load weights for (the CPU's layout is the same whatever its thread count).
fn load_dev() -> Device {
    Device::cpu(1)
}

fn fixture(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/qwen35-tiny")
        .join(rel)
}

fn golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("golden.json")).unwrap()).unwrap()
}

/// A golden sequence's token ids.
fn ids_of(seq: &serde_json::Value) -> Vec<u32> {
    seq["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// A golden sequence's logits at every position, row-major (`golden.safetensors`).
fn golden_rows(seq: &serde_json::Value) -> Vec<f32> {
    golden_tensor(&format!("logits.{}", seq["name"].as_str().unwrap()))
}

fn golden_tensor(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixture("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Asserts `got` matches `want` within the fixture's tolerance (atol 1e-4, rtol 1e-4).
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - w).abs() <= 1e-4 + 1e-4 * w.abs(),
            "{what}: element {i} (position {}): {a} vs {w}",
            i / 256
        );
    }
}

fn gguf() -> Arc<Gguf> {
    Arc::new(Gguf::open(fixture("model.gguf")).unwrap())
}

#[test]
fn snapshot_size_of_a_27b_shaped_model() {
    // Qwen3.6-27B: 64 layers (48 DeltaNet), 16 key / 48 value heads of 128, conv kernel 4.
    let c = Qwen35Config {
        d_model: 5120,
        ffn: 17408,
        vocab: 248_320,
        n_layers: 64,
        recurrent: (0..64).map(|i| (i + 1) % 4 != 0).collect(),
        eps: 1e-6,
        n_heads: 24,
        n_kv_heads: 4,
        head_dim: 256,
        rope_dims: 64,
        rope_base: 1e7,
        key_heads: 16,
        value_heads: 48,
        key_dim: 128,
        value_dim: 128,
        conv_kernel: 4,
        ctx_train: 262_144,
        mtp: false,
    };
    assert!(c.validate().is_ok());
    assert_eq!(c.conv_dim(), 10240);
    let per_layer = c.recurrent_state_floats();
    assert_eq!(per_layer, 48 * 128 * 128 + 10240 * 3);
    let mib = (c.state_floats() * 4) as f64 / 1_048_576.0;
    // One fp32 snapshot of every DeltaNet layer: 149.6 MiB, the KV of ~2,390 bf16 positions
    // (16 attention layers x 2 x 4 KV heads x 256 x 2 bytes = 64 KiB per position).
    assert!((mib - 149.6).abs() < 0.1, "{mib} MiB");
    let kv = c.kv_shape();
    assert_eq!(kv.bytes_per_position(KvDtype::F16), 64 * 1024);
    assert_eq!(kv.n_layers, 16);
}

#[test]
fn hf_config_and_weights_equal_the_gguf_ones() {
    let g = gguf();
    let ck = HfCheckpoint::open(&fixture("")).unwrap();
    let c = Qwen35Config::from_gguf(&g).unwrap();
    // The GGUF does not record the training context the same way; everything else must agree.
    let mut hc = ck.qwen35_config().clone();
    hc.ctx_train = c.ctx_train;
    assert_eq!(hc, c);
    assert_eq!(c.recurrent, vec![true, true, true, false]);
    assert_eq!(c.rope_dims, 4);
    // Every tensor, converted from HF conventions, equals the converter's output.
    let mut worst = 0f32;
    for t in g.tensors() {
        let n = t.n_elements() as usize;
        let a = Weights::vector(&g, &t.name, n).unwrap();
        let (rows, cols) = t.rows_cols();
        let b = if t.dims.len() == 2 && !t.name.contains("conv1d") {
            ck.matrix_f32(&t.name, rows as usize, cols as usize)
                .unwrap()
        } else {
            let (r, c) = if t.name.contains("conv1d") {
                (t.dims[1] as usize, t.dims[0] as usize)
            } else {
                (n, 1)
            };
            ck.matrix_f32(&t.name, r, c).unwrap()
        };
        let diff = max_diff(&a, &b);
        worst = worst.max(diff);
        assert!(diff <= 1e-6, "{}: differs by {diff}", t.name);
    }
    eprintln!("largest HF/GGUF weight difference {worst:e}");
}

#[test]
fn reference_logits_match_the_goldens_from_gguf_and_hf() {
    let g = gguf();
    let ck = HfCheckpoint::open(&fixture("")).unwrap();
    let models = [
        (
            "gguf",
            Reference::load(&g, Qwen35Config::from_gguf(&g).unwrap()).unwrap(),
        ),
        (
            "hf",
            Reference::load(&ck, ck.qwen35_config().clone()).unwrap(),
        ),
    ];
    let gold = golden();
    for (src, m) in &models {
        for s in gold["sequences"].as_array().unwrap() {
            let ids = ids_of(s);
            let mut st = m.new_state();
            let mut logits = vec![0f32; 256];
            let mut all = Vec::new();
            for &t in &ids {
                m.step(&mut st, t, &mut logits).unwrap();
                all.extend_from_slice(&logits);
            }
            assert_close(
                &all,
                &golden_rows(s),
                &format!("{src} reference {}", s["name"]),
            );
        }
    }
}

/// The engine's forward pass on a paged f32 cache.
struct Runner {
    model: Qwen35,
    dev: Device,
    kv: KvCache,
    batch: Batch,
    scratch: Scratch,
}

impl Runner {
    fn new(model: Qwen35) -> Self {
        Runner::on(model, Device::cpu(2))
    }

    /// A runner on `dev` (which must be the device the model was loaded for).
    fn on(model: Qwen35, dev: Device) -> Self {
        let shape = model.config().kv_shape();
        let kv = KvCache::on(
            &dev,
            shape,
            KvConfig {
                dtype: KvDtype::F32,
                page_size: 16,
                memory: 1 << 22,
                cache_output: true,
                state_memory: 1 << 20,
                snapshot_interval: 2048,
                turn_token: None,
            },
        )
        .unwrap();
        Runner {
            model,
            dev,
            kv,
            batch: Batch::default(),
            scratch: Scratch::default(),
        }
    }

    fn seq(&mut self) -> SeqKv {
        self.kv.acquire(&[])
    }

    /// Runs `tokens` after `seq` and returns the logits asked for.
    fn run(&mut self, seq: &mut SeqKv, tokens: &[u32], want: Logits) -> Vec<f32> {
        self.kv.reserve(seq, seq.len() + tokens.len()).unwrap();
        self.batch.clear();
        self.batch.push(seq, tokens, want);
        let out = self
            .model
            .forward(
                &self.dev,
                self.kv.pool_mut(),
                &self.batch,
                std::slice::from_mut(&mut seq.rec),
                &mut self.scratch,
            )
            .unwrap()
            .to_vec();
        seq.advance(tokens.len());
        out
    }
}

#[test]
fn forward_matches_the_goldens_from_gguf_and_hf_prefilled_and_chunked() {
    let gold = golden();
    for (src, chunked) in [("gguf", false), ("hf", false), ("gguf", true)] {
        let mut model = match src {
            "gguf" => Qwen35::from_gguf(&gguf(), &load_dev()).unwrap(),
            _ => Qwen35::from_hf(&fixture(""), &load_dev()).unwrap(),
        };
        model.set_chunked_prefill(chunked);
        let mut r = Runner::new(model);
        for s in gold["sequences"].as_array().unwrap() {
            let ids = ids_of(s);
            let mut seq = r.seq();
            let got = r.run(&mut seq, &ids, Logits::All);
            let what = format!("{src} (chunked {chunked}) sequence {}", s["name"]);
            assert_close(&got, &golden_rows(s), &what);
            eprintln!("{what}: max diff {:e}", max_diff(&got, &golden_rows(s)));
            r.kv.release(seq, None);
        }
    }
}

/// Prefills `ids[..40]`, then runs one batch of `ids[40..46]` as a verification pass (six kept steps)
/// beside the whole of `a` in a new sequence; returns the batch's logits and both states.
fn verify_beside_a_prefill(r: &mut Runner, a: &[u32], ids: &[u32]) -> (Vec<f32>, [Recurrent; 2]) {
    let mut s1 = r.seq();
    r.run(&mut s1, &ids[..40], Logits::None);
    let mut s2 = r.seq();
    r.kv.reserve(&mut s1, 46).unwrap();
    r.kv.reserve(&mut s2, a.len()).unwrap();
    r.batch.clear();
    r.batch.push(&s1, &ids[40..46], Logits::Tail(6));
    r.batch.push(&s2, a, Logits::All);
    let mut states = [std::mem::take(&mut s1.rec), std::mem::take(&mut s2.rec)];
    let logits = r
        .model
        .forward(
            &r.dev,
            r.kv.pool_mut(),
            &r.batch,
            &mut states,
            &mut r.scratch,
        )
        .unwrap()
        .to_vec();
    (logits, states)
}

#[test]
fn prefill_then_decode_matches_and_the_state_is_the_goldens() {
    let gold = golden();
    let c = &gold["sequences"][2];
    let ids = ids_of(c);
    let mut r = Runner::new(Qwen35::from_gguf(&gguf(), &load_dev()).unwrap());
    let mut seq = r.seq();
    r.run(&mut seq, &ids[..70], Logits::None);
    let cfg = r.model.config().clone();
    let per = cfg.recurrent_state_floats();
    let mats = cfg.gdn().matrix_floats();
    for layer in 0..3 {
        let st = &seq.rec.state.to_vec()[layer * per..(layer + 1) * per];
        let want_s = golden_tensor(&format!("state.layer{layer}.recurrent_gguf_head_order"));
        let want_w = golden_tensor(&format!(
            "state.layer{layer}.conv_window_gguf_channel_order"
        ));
        assert!(max_diff(&st[..mats], &want_s) < 1e-5, "layer {layer} state");
        assert!(
            max_diff(&st[mats..], &want_w) < 1e-5,
            "layer {layer} window"
        );
    }
    // The attention layer's cache: K after norm and RoPE, V as projected ([kv head, position, dim]).
    let (kc, vc) = (
        golden_tensor("state.layer3.k_cache"),
        golden_tensor("state.layer3.v_cache"),
    );
    let pool = r.kv.pool();
    for p in 0..70 {
        let page = seq.pages()[p / 16];
        for h in 0..2 {
            let k = pool.keys(page, 0, h).row(p % 16, 16);
            let v = pool.values(page, 0, h).row(p % 16, 16);
            let o = (h * 70 + p) * 16;
            assert!(max_diff(&k, &kc[o..o + 16]) < 1e-5, "k at {p}");
            assert!(max_diff(&v, &vc[o..o + 16]) < 1e-5, "v at {p}");
        }
    }
    let want = golden_tensor("continuation.C.logits");
    for (i, &t) in ids[70..].iter().enumerate() {
        let got = r.run(&mut seq, &[t], Logits::Last);
        assert_close(
            &got,
            &want[i * 256..(i + 1) * 256],
            &format!("position {}", 70 + i),
        );
    }
}

#[test]
fn batching_and_splitting_do_not_change_a_bit() {
    let gold = golden();
    let a = ids_of(&gold["sequences"][1]);
    let b = ids_of(&gold["sequences"][2]);
    let mut r = Runner::new(Qwen35::from_gguf(&gguf(), &load_dev()).unwrap());
    // Alone, in one pass.
    let mut sa = r.seq();
    let alone_a = r.run(&mut sa, &a, Logits::All);
    let mut sb = r.seq();
    let alone_b = r.run(&mut sb, &b, Logits::All);
    // Split into pieces.
    let mut sb2 = r.seq();
    let mut split_b = r.run(&mut sb2, &b[..33], Logits::All);
    split_b.extend(r.run(&mut sb2, &b[33..34], Logits::All));
    split_b.extend(r.run(&mut sb2, &b[34..], Logits::All));
    assert_eq!(alone_b, split_b);
    assert_eq!(sb.rec.state.to_vec(), sb2.rec.state.to_vec());
    // Together in one batch.
    let (mut ta, mut tb) = (r.seq(), r.seq());
    r.kv.reserve(&mut ta, a.len()).unwrap();
    r.kv.reserve(&mut tb, b.len()).unwrap();
    r.batch.clear();
    r.batch.push(&ta, &a, Logits::All);
    r.batch.push(&tb, &b, Logits::All);
    let mut states = [std::mem::take(&mut ta.rec), std::mem::take(&mut tb.rec)];
    let both = r
        .model
        .forward(
            &r.dev,
            r.kv.pool_mut(),
            &r.batch,
            &mut states,
            &mut r.scratch,
        )
        .unwrap()
        .to_vec();
    assert_eq!(&both[..a.len() * 256], &alone_a[..]);
    assert_eq!(&both[a.len() * 256..], &alone_b[..]);
    assert_eq!(states[1].state.to_vec(), sb.rec.state.to_vec());
}

#[test]
fn verification_keeps_every_step_and_rolls_back_exactly() {
    let gold = golden();
    let ids = ids_of(&gold["sequences"][2]);
    let mut r = Runner::new(Qwen35::from_gguf(&gguf(), &load_dev()).unwrap());
    // One token at a time: the state after each position.
    let mut s1 = r.seq();
    r.run(&mut s1, &ids[..40], Logits::None);
    let mut after = vec![s1.rec.state.to_vec()];
    for &t in &ids[40..46] {
        r.run(&mut s1, &[t], Logits::Last);
        after.push(s1.rec.state.to_vec());
    }
    // A verification pass of 1 pending + 5 drafted tokens keeps the state after each of the last 6.
    let mut s2 = r.seq();
    r.run(&mut s2, &ids[..40], Logits::None);
    let logits = r.run(&mut s2, &ids[40..46], Logits::Tail(6));
    assert_eq!(logits.len(), 6 * 256);
    assert_eq!((s2.rec.steps_from, s2.rec.steps_len), (41, 6));
    assert_eq!(s2.rec.state.to_vec(), after[6]);
    // Accept 2 drafted tokens: the state is the one after position 43, bit for bit.
    r.kv.keep_path(&mut s2, 41, &[0, 1]);
    assert_eq!(s2.len(), 43);
    assert_eq!(s2.rec.len, 43);
    assert_eq!(s2.rec.state.to_vec(), after[3]);
    // And decoding carries on exactly.
    let a = r.run(&mut s2, &ids[43..44], Logits::Last);
    let mut s3 = r.seq();
    let b = r.run(&mut s3, &ids[..44], Logits::Last);
    assert_eq!(a, b);
}

#[test]
fn nvfp4_checkpoint_weights_are_dequantized() {
    use crate::quant::fp8::f32_to_fp8_e4m3;
    use crate::quant::nvfp4::f32_to_e2m1;
    // A 2 x 32 NVFP4 weight quantized the ModelOpt way, next to an F32 copy of its exact values.
    let w: Vec<f32> = (0..64)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.37)
        .collect();
    let amax = w.iter().fold(0f32, |a, &b| a.max(b.abs()));
    let global = amax / (6.0 * 448.0);
    let mut packed = vec![0u8; 32];
    let mut scales = vec![0u8; 4];
    let mut exact = vec![0f32; 64];
    for blk in 0..4 {
        let b = &w[blk * 16..(blk + 1) * 16];
        let bmax = b.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let sc = f32_to_fp8_e4m3(bmax / (6.0 * global));
        scales[blk] = sc;
        let s = crate::quant::fp8::fp8_e4m3_to_f32(sc) * global;
        for (j, &x) in b.iter().enumerate() {
            let i = blk * 16 + j;
            let code = f32_to_e2m1(x / s);
            packed[i / 2] |= if i % 2 == 0 { code } else { code << 4 };
            exact[i] = crate::quant::nvfp4::E2M1_VALUES[usize::from(code)] * s;
        }
    }
    let dir = std::env::temp_dir().join(format!("thorn-nvfp4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("config.json")).unwrap()).unwrap();
    cfg["hidden_size"] = 32.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    use safetensors::tensor::TensorView;
    let g2 = global.to_le_bytes();
    let emb = vec![0u8; 4 * 32];
    let tensors = vec![
        (
            "model.layers.0.mlp.up_proj.weight",
            TensorView::new(safetensors::Dtype::U8, vec![2, 16], &packed).unwrap(),
        ),
        (
            "model.layers.0.mlp.up_proj.weight_scale",
            TensorView::new(safetensors::Dtype::F8_E4M3, vec![2, 2], &scales).unwrap(),
        ),
        (
            "model.layers.0.mlp.up_proj.weight_scale_2",
            TensorView::new(safetensors::Dtype::F32, vec![], &g2).unwrap(),
        ),
        (
            "model.embed_tokens.weight",
            TensorView::new(safetensors::Dtype::F32, vec![1, 32], &emb).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    let ck = HfCheckpoint::open(&dir).unwrap();
    let got = ck.matrix_f32("blk.0.ffn_up.weight", 2, 32).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(got, exact);
    assert!(max_diff(&got, &w) < 0.35 * amax, "a sane quantization");
}

use crate::testutil::noise;

/// The qwen35-tiny checkpoint plus a random MTP head, written as an HF checkpoint in a fresh directory.
pub(crate) fn checkpoint_with_mtp(tag: &str) -> std::path::PathBuf {
    use safetensors::tensor::TensorView;
    let dir = std::env::temp_dir().join(format!("thorn-mtp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("config.json")).unwrap()).unwrap();
    cfg["mtp_num_hidden_layers"] = 1.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(fixture("model.safetensors")).unwrap();
    let base = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (d, ffn) = (64usize, 128usize);
    let shapes: Vec<(&str, Vec<usize>, f32)> = vec![
        (
            "mtp.fc.weight",
            vec![d, 2 * d],
            1.0 / (2.0 * d as f32).sqrt(),
        ),
        ("mtp.pre_fc_norm_embedding.weight", vec![d], 0.3),
        ("mtp.pre_fc_norm_hidden.weight", vec![d], 0.3),
        ("mtp.norm.weight", vec![d], 0.3),
        ("mtp.layers.0.input_layernorm.weight", vec![d], 0.3),
        ("mtp.layers.0.post_attention_layernorm.weight", vec![d], 0.3),
        (
            "mtp.layers.0.self_attn.q_proj.weight",
            vec![128, d],
            1.7 / 8.0,
        ),
        (
            "mtp.layers.0.self_attn.k_proj.weight",
            vec![32, d],
            1.7 / 8.0,
        ),
        (
            "mtp.layers.0.self_attn.v_proj.weight",
            vec![32, d],
            1.7 / 8.0,
        ),
        (
            "mtp.layers.0.self_attn.o_proj.weight",
            vec![d, d],
            1.7 / 8.0,
        ),
        ("mtp.layers.0.self_attn.q_norm.weight", vec![16], 0.3),
        ("mtp.layers.0.self_attn.k_norm.weight", vec![16], 0.3),
        ("mtp.layers.0.mlp.gate_proj.weight", vec![ffn, d], 1.7 / 8.0),
        ("mtp.layers.0.mlp.up_proj.weight", vec![ffn, d], 1.7 / 8.0),
        (
            "mtp.layers.0.mlp.down_proj.weight",
            vec![d, ffn],
            1.7 / 11.3,
        ),
    ];
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, (_, shape, scale))| {
            noise(100 + i as u64, shape.iter().product(), *scale)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let mut views: Vec<(String, TensorView<'_>)> = base
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                TensorView::new(t.dtype(), t.shape().to_vec(), t.data()).unwrap(),
            )
        })
        .collect();
    for ((name, shape, _), bytes) in shapes.iter().zip(&data) {
        views.push((
            name.to_string(),
            TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap(),
        ));
    }
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn the_mtp_head_matches_the_reference_convention() {
    let dir = checkpoint_with_mtp("ref");
    let ck = HfCheckpoint::open(&dir).unwrap();
    assert!(ck.qwen35_config().mtp);
    let reference = Reference::load(&ck, ck.qwen35_config().clone()).unwrap();
    let model = Qwen35::load(&ck, ck.qwen35_config().clone(), &load_dev()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(model.has_mtp());
    let ids = ids_of(&golden()["sequences"][1]);
    // The reference: for each position, the step, then the head with the next token.
    let mut st = reference.new_state();
    let mut logits = vec![0f32; 256];
    let mut want = Vec::new();
    for p in 0..ids.len() - 1 {
        reference.step(&mut st, ids[p], &mut logits).unwrap();
        reference
            .mtp_step(&mut st, ids[p + 1], &mut logits)
            .unwrap();
        want.push(logits.clone());
    }
    // The engine's pass one token at a time, its head drafting after each (as decode does), and a whole
    // prefill followed by one draft.
    let mut r = Runner::new(model);
    let mut seq = r.seq();
    let mut mtp_batch = Batch::default();
    // The head's logits for the token after `next`, which follows `seq`.
    let mut draft = |r: &mut Runner, seq: &mut SeqKv, next: u32| {
        r.kv.reserve(seq, seq.len() + 1).unwrap();
        mtp_batch.clear();
        mtp_batch.push(seq, &[next], Logits::Last);
        r.model
            .mtp_draft(
                &r.dev,
                r.kv.pool_mut(),
                &mut mtp_batch,
                std::slice::from_ref(&seq.rec),
                &mut r.scratch,
            )
            .unwrap()
            .to_vec()
    };
    for p in 0..ids.len() - 1 {
        r.run(&mut seq, &ids[p..p + 1], Logits::Last);
        let got = draft(&mut r, &mut seq, ids[p + 1]);
        assert_close(&got, &want[p], &format!("MTP logits at position {p}"));
    }
    let mut whole = r.seq();
    let n = ids.len() - 1;
    r.run(&mut whole, &ids[..n], Logits::Last);
    let got = draft(&mut r, &mut whole, ids[n]);
    assert_close(&got, &want[n - 1], "MTP logits after a whole prefill");
}

#[test]
fn the_engine_speculates_with_the_mtp_head_exactly() {
    let dir = checkpoint_with_mtp("engine");
    speculates_exactly_on(&dir, || Device::cpu(2));
    // On the GPU device too: its kernels, like the CPU's, give a token the same bits whatever it is
    // batched with, so verifying drafts changes nothing.
    speculates_exactly_on(&dir, || Device::gpu(Arc::new(crate::backend::sim::Sim)));
    std::fs::remove_dir_all(&dir).ok();
}

/// Greedy output with the MTP head drafting equals the output without, on the devices `dev` makes.
fn speculates_exactly_on(dir: &std::path::Path, dev: impl Fn() -> Device) {
    use crate::engine::{Engine, EngineConfig, Request};
    use crate::spec::SpecConfig;
    use crate::spec::draft::MODEL_CLASS;
    let engine = |cfg: &EngineConfig| {
        let d = dev();
        let m = crate::model::Model::Qwen35(Qwen35::from_hf(dir, &d).unwrap());
        Engine::with_model(gguf(), m, d, cfg).unwrap()
    };
    let cfg = |spec: SpecConfig| EngineConfig {
        threads: 2,
        context: 1024,
        kv_dtype: KvDtype::F32,
        page_size: 16,
        speculation: spec,
        ..EngineConfig::default()
    };
    let mut plain = engine(&cfg(SpecConfig::off()));
    // A fixed cost model: whether the head's drafts are worth a pass must not depend on the machine's load.
    let fixed = SpecConfig {
        fixed_cost: Some(crate::spec::FixedCost::MEMORY_BOUND),
        ..SpecConfig::default()
    };
    let mut spec = engine(&cfg(fixed));
    let prompt: Vec<u32> = "<user>Move joint 2 by 15 degrees.</user>\n"
        .bytes()
        .map(u32::from)
        .collect();
    let mut req = Request::greedy(prompt, 40);
    req.ignore_eos = true;
    let a = plain.generate(&req, &mut |_| {}).unwrap();
    let b = spec.generate(&req, &mut |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
    let (_, tried) = spec.speculator().calib.observed(MODEL_CLASS);
    assert!(tried > 0.0, "the MTP head drafted nothing");
    // Batched, too.
    spec.reset();
    let (res, _) = spec.generate_batch(vec![(req, None)], Default::default());
    assert_eq!(res[0].1.as_ref().unwrap().tokens, a.tokens);
}

#[test]
fn a_snapshot_restored_by_the_prefix_cache_continues_like_the_goldens() {
    let gold = golden();
    let ids = ids_of(&gold["sequences"][2]);
    let mut r = Runner::new(Qwen35::from_gguf(&gguf(), &load_dev()).unwrap());
    // Prefill 70 tokens and leave them in the cache: the KV in the tree, the state as a snapshot.
    let mut seq = r.seq();
    r.run(&mut seq, &ids[..70], Logits::None);
    r.kv.release(seq, Some(&ids[..70]));
    // A request for the whole sequence resumes at 70 from the snapshot (not from zero)...
    let mut seq = r.kv.acquire(&ids);
    assert_eq!((seq.len(), seq.rec.len, seq.hit()), (70, 70, 70));
    assert_eq!(r.kv.stats().snapshots.restored, 1);
    // ...and continues one token at a time exactly as the goldens do.
    let want = golden_tensor("continuation.C.logits");
    for (i, &t) in ids[70..].iter().enumerate() {
        let got = r.run(&mut seq, &[t], Logits::Last);
        assert_close(
            &got,
            &want[i * 256..(i + 1) * 256],
            &format!("position {}", 70 + i),
        );
    }
}

mod gpu;
