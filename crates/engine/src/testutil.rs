//! Test data shared by the crate's unit tests.

use crate::kv::{KvCache, SeqKv};
use crate::quant::GgmlType;

/// Deterministic pseudo-random floats with occasional outliers (like real activations).
pub(crate) fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 97 == 5 { v * 40.0 } else { v }
        })
        .collect()
}

/// Rows of `ty` weights from random bytes (with sane scales) or, for F32, random floats.
pub(crate) fn quantize_rows(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    // Random bytes are valid blocks for these types once the f16 scales are sane.
    let row_bytes = ty.row_bytes(cols).unwrap();
    let mut bytes: Vec<u8> = data(rows * row_bytes, seed)
        .iter()
        .map(|v| (v.to_bits() >> 7) as u8)
        .collect();
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    let bs = ty.type_size();
    for blk in bytes.chunks_exact_mut(bs) {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q8_0 => blk[..2].copy_from_slice(&scale),
            GgmlType::Q4_1 | GgmlType::Q4_K => {
                blk[..2].copy_from_slice(&scale);
                blk[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_bits().to_le_bytes());
            }
            GgmlType::Q6_K => blk[208..210].copy_from_slice(&scale),
            _ => {}
        }
    }
    if ty == GgmlType::F32 {
        return data(rows * cols, seed)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
    }
    bytes
}

/// Deterministic pseudo-random numbers in `[-scale, scale)` (tests).
pub(crate) fn noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
        })
        .collect()
}

/// Writes `n` positions of layer 0 for a sequence into freshly reserved pages (row `pos` is
/// `data(seed + pos)`) and marks the first `done` as filled, as a forward pass about to run the rest sees it.
pub(crate) fn fill_seq(kv: &mut KvCache, n: usize, done: usize, seed: u64) -> SeqKv {
    let mut seq = kv.acquire(&[]);
    kv.reserve(&mut seq, n).unwrap();
    let (ps, w) = (
        kv.pool().page_size(),
        kv.pool().shape().n_kv_heads * kv.pool().shape().head_dim,
    );
    for pos in 0..n {
        let page = seq.pages()[pos / ps];
        let k = data(w, seed + pos as u64);
        let v = data(w, seed + 5000 + pos as u64);
        kv.pool_mut().write(page, pos % ps, 0, &k, &v);
    }
    seq.advance(done);
    seq
}

/// The shape of a Llama-architecture model, for skeleton files.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LlamaShape {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
}

/// SmolLM2-135M's shape: the default model.
pub(crate) const SMOLLM2_135M: LlamaShape = LlamaShape {
    layers: 30,
    d_model: 576,
    heads: 9,
    kv_heads: 3,
    ffn: 1536,
    vocab: 49152,
};

/// A Llama GGUF of `shape` whose matrices are `ty` blocks of zero bytes and whose norms are zeros, with the
/// embedding tied to the output (as SmolLM2's): what a runtime that never runs its kernels needs to load
/// and run the model (the launch budget, the host time per step). Its numbers mean nothing.
pub(crate) fn skeleton_llama(shape: LlamaShape, ty: GgmlType) -> crate::gguf::Gguf {
    llama_gguf(shape, ty, None)
}

/// A Llama GGUF of `shape` with seeded random `ty` weights and norms near one: a model whose logits
/// differ between tokens and positions, for tests that compare two ways of running it.
pub(crate) fn random_llama(shape: LlamaShape, ty: GgmlType, seed: u64) -> crate::gguf::Gguf {
    llama_gguf(shape, ty, Some(seed))
}

/// [`skeleton_llama`] (zeros, `seed` `None`) or [`random_llama`].
fn llama_gguf(shape: LlamaShape, ty: GgmlType, seed: Option<u64>) -> crate::gguf::Gguf {
    use crate::gguf::{GgufBuilder, Value};
    let LlamaShape {
        layers,
        d_model: d,
        heads,
        kv_heads,
        ffn,
        vocab,
    } = shape;
    let kvd = kv_heads * (d / heads);
    let next = std::cell::Cell::new(seed.unwrap_or(0));
    let seeded = || {
        next.set(next.get() + 1);
        seed.map(|_| next.get())
    };
    let matrix = |cols: usize, rows: usize| {
        let bytes = match seeded() {
            Some(s) => {
                let mut b = quantize_rows(ty, rows, cols, s);
                if ty == GgmlType::Q4_1 {
                    // Centred weights (min = -7.5 steps), so that no token's logit wins everywhere.
                    let m = half::f16::from_f32(-0.075).to_bits().to_le_bytes();
                    b.chunks_exact_mut(ty.type_size())
                        .for_each(|blk| blk[2..4].copy_from_slice(&m));
                }
                b
            }
            None => vec![0u8; ty.row_bytes(cols).expect("whole blocks per row") * rows],
        };
        (vec![cols as u64, rows as u64], bytes)
    };
    let u = |v: usize| Value::U32(v as u32);
    let mut b = GgufBuilder::new()
        .kv("general.architecture", Value::String("llama".into()))
        .kv("llama.block_count", u(layers))
        .kv("llama.embedding_length", u(d))
        .kv("llama.attention.head_count", u(heads))
        .kv("llama.attention.head_count_kv", u(kv_heads))
        .kv("llama.feed_forward_length", u(ffn))
        .kv("llama.vocab_size", u(vocab))
        .kv("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    let norm = |n: usize| {
        let v = match seeded() {
            Some(s) => data(n, s).iter().map(|x| 1.0 + x / 4.0).collect(),
            None => vec![0f32; n],
        };
        (vec![n as u64], bytemuck::cast_slice(&v).to_vec())
    };
    let add = |b: GgufBuilder, name: &str, (dims, data): (Vec<u64>, Vec<u8>), t| {
        b.tensor(name, &dims, t, data)
    };
    b = add(b, "token_embd.weight", matrix(d, vocab), ty);
    b = add(b, "output_norm.weight", norm(d), GgmlType::F32);
    for i in 0..layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        b = add(b, &n("attn_norm"), norm(d), GgmlType::F32);
        b = add(b, &n("attn_q"), matrix(d, d), ty);
        b = add(b, &n("attn_k"), matrix(d, kvd), ty);
        b = add(b, &n("attn_v"), matrix(d, kvd), ty);
        b = add(b, &n("attn_output"), matrix(d, d), ty);
        b = add(b, &n("ffn_norm"), norm(d), GgmlType::F32);
        b = add(b, &n("ffn_gate"), matrix(d, ffn), ty);
        b = add(b, &n("ffn_up"), matrix(d, ffn), ty);
        b = add(b, &n("ffn_down"), matrix(ffn, d), ty);
    }
    crate::gguf::Gguf::from_bytes(b.build()).expect("a well-formed skeleton")
}

/// The repository's tiny byte-level tokenizer (256 tokens, from tests/data/qwen35-tiny) in a GGUF of its
/// own, with `controls` appended as control tokens (ids 256 on; the last is the end-of-sequence token).
pub(crate) fn tokenizer_with(controls: &[&str]) -> std::sync::Arc<crate::gguf::Gguf> {
    use crate::gguf::{Array, Gguf, GgufBuilder, Value};
    let base = Gguf::open(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data/qwen35-tiny/model.gguf"),
    )
    .expect("the tiny test model");
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
    std::sync::Arc::new(Gguf::from_bytes(b.build()).expect("a well-formed tokenizer"))
}
