//! The reader on files built in code: round trips, and every kind of bad file we could think of.

use super::*;

fn sample() -> GgufBuilder {
    let q41 = vec![0x11u8; 20 * 2]; // two Q4_1 blocks
    let f32s: Vec<u8> = [1.0f32, -2.0, 3.5, 0.25]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    GgufBuilder::new()
        .kv("general.architecture", Value::String("llama".into()))
        .kv("llama.block_count", Value::U32(30))
        .kv("llama.rope.freq_base", Value::F32(100000.0))
        .kv("tokenizer.ggml.add_bos_token", Value::Bool(false))
        .kv(
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(vec!["a".into(), "Ġb".into(), "<|x|>".into()])),
        )
        .kv(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![1, 1, 3])),
        )
        .kv("misc.i64", Value::I64(-5))
        .kv("misc.f64", Value::F64(0.5))
        .kv("misc.u8", Value::U8(7))
        .kv(
            "misc.nested",
            Value::Array(Array::Array(vec![
                Array::U16(vec![1, 2]),
                Array::Bool(vec![true]),
            ])),
        )
        .tensor("blk.0.w", &[64], GgmlType::Q4_1, q41)
        .tensor("norm", &[2, 2], GgmlType::F32, f32s)
}

#[test]
fn round_trip_metadata_and_tensors() {
    let g = Gguf::from_bytes(sample().build()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.arch_u32("block_count").unwrap(), 30);
    assert_eq!(g.arch_f32("rope.freq_base").unwrap(), 100000.0);
    assert!(!g.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap()[1], "Ġb");
    assert_eq!(
        g.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        &[1, 1, 3]
    );
    assert_eq!(g.get_u64("misc.u8").unwrap(), 7);
    assert!(matches!(
        g.get_u64("misc.i64"),
        Err(GgufError::KeyType { .. })
    ));
    assert!(matches!(
        g.get_str("llama.block_count"),
        Err(GgufError::KeyType {
            found: "uint32",
            ..
        })
    ));
    assert!(matches!(g.get_u32("nope"), Err(GgufError::MissingKey(_))));
    assert_eq!(g.get("misc.f64").and_then(Value::as_f64), Some(0.5));
    let t = g.tensor("norm").unwrap();
    assert_eq!(
        (t.dims.clone(), t.ty, t.size, t.rows_cols()),
        (vec![2, 2], GgmlType::F32, 16, (2, 2))
    );
    assert_eq!(t.offset % 32, 0);
    assert_eq!(&g.tensor_data(t)[4..8], &(-2.0f32).to_le_bytes());
    assert_eq!(
        g.tensor_data(g.tensor("blk.0.w").unwrap()),
        &[0x11u8; 40][..]
    );
    assert!(matches!(
        g.tensor("missing"),
        Err(GgufError::MissingTensor(_))
    ));
    assert_eq!(g.tensor_bytes(), 56);
}

#[test]
fn open_reads_a_file_through_mmap() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, sample().build()).unwrap();
    let g = Gguf::open(&p).unwrap();
    assert_eq!(g.tensors().len(), 2);
    let e = Gguf::open(dir.path().join("absent.gguf")).unwrap_err();
    assert!(e.to_string().contains("absent.gguf"), "{e}");
    std::fs::write(&p, b"").unwrap();
    assert!(matches!(Gguf::open(&p), Err(GgufError::Truncated { .. })));
}

#[test]
fn every_truncation_is_an_error() {
    let full = sample().build();
    for len in 0..full.len() {
        // The last tensor's data ends the file, so every strict prefix is missing something.
        let r = Gguf::from_bytes(full[..len].to_vec());
        assert!(r.is_err(), "prefix of {len} bytes parsed");
    }
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend_from_slice(&3u32.to_le_bytes());
    v.extend_from_slice(&n_tensors.to_le_bytes());
    v.extend_from_slice(&n_kv.to_le_bytes());
    v
}

fn err(bytes: Vec<u8>) -> String {
    Gguf::from_bytes(bytes).unwrap_err().to_string()
}

#[test]
fn hostile_headers_are_rejected_without_allocating() {
    assert!(err(b"GGML\x03\0\0\0".to_vec()).contains("not a GGUF file"));
    let mut v1 = header(0, 0);
    v1[4] = 1;
    assert!(err(v1).contains("version 1"));
    let mut be = header(0, 0);
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(err(be).contains("unsupported GGUF version"));
    assert!(err(header(u64::MAX, 0)).contains("tensor count"));
    assert!(err(header(0, u64::MAX)).contains("metadata count"));
    assert!(err(header(1 << 40, 1)).contains("cannot fit"));

    // A key whose length claims far more than the file.
    let mut k = header(0, 1);
    k.extend_from_slice(&u64::MAX.to_le_bytes());
    k.extend_from_slice(&[0; 16]);
    assert!(err(k).contains("truncated"));

    // An array claiming 2^62 strings.
    let mut a = header(0, 1);
    a.extend_from_slice(&1u64.to_le_bytes());
    a.push(b'k');
    a.extend_from_slice(&9u32.to_le_bytes());
    a.extend_from_slice(&8u32.to_le_bytes());
    a.extend_from_slice(&(1u64 << 62).to_le_bytes());
    assert!(err(a).contains("cannot fit"));

    // Unknown value type.
    let mut u = header(0, 1);
    u.extend_from_slice(&1u64.to_le_bytes());
    u.push(b'k');
    u.extend_from_slice(&99u32.to_le_bytes());
    u.extend_from_slice(&[0; 16]);
    assert!(err(u).contains("unknown metadata value type 99"));
}

#[test]
fn bad_metadata_values_are_rejected() {
    let dup = GgufBuilder::new()
        .kv("a", Value::U8(1))
        .kv("a", Value::U8(2))
        .build();
    assert!(err(dup).contains("duplicate metadata key"));
    let align = GgufBuilder::new()
        .kv("general.alignment", Value::U32(3))
        .build();
    assert!(err(align).contains("power-of-two"));
    let align_ty = GgufBuilder::new()
        .kv("general.alignment", Value::String("32".into()))
        .build();
    assert!(err(align_ty).contains("general.alignment"));
    // The builder pads the file to the alignment; the value is the last thing before the padding.
    let mut bad_utf8 = GgufBuilder::new()
        .kv("k", Value::String("ab".into()))
        .build();
    let at = bad_utf8.windows(2).position(|w| w == b"ab").unwrap();
    bad_utf8[at + 1] = 0xFF;
    assert!(err(bad_utf8).contains("UTF-8"));
    let mut bad_bool = GgufBuilder::new().kv("k", Value::Bool(true)).build();
    // header (24) + key (8 + 1) + type (4): the bool byte.
    bad_bool[37] = 2;
    assert!(err(bad_bool).contains("bool byte"));
    let mut deep = Array::U8(vec![1]);
    for _ in 0..6 {
        deep = Array::Array(vec![deep]);
    }
    assert!(err(GgufBuilder::new().kv("k", Value::Array(deep)).build()).contains("nested deeper"));
}

/// Rewrites one field of the first tensor's info in a one-tensor file (name "t").
fn with_tensor(dims: &[u64], ty: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut v = header(1, 0);
    v.extend_from_slice(&1u64.to_le_bytes());
    v.push(b't');
    v.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        v.extend_from_slice(&d.to_le_bytes());
    }
    v.extend_from_slice(&ty.to_le_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v.resize(v.len().next_multiple_of(32) + data_len, 0);
    v
}

#[test]
fn bad_tensors_are_rejected() {
    assert!(Gguf::from_bytes(with_tensor(&[32], 3, 0, 20)).is_ok());
    assert!(err(with_tensor(&[32], 3, 0, 19)).contains("runs past the end"));
    assert!(err(with_tensor(&[32], 77, 0, 20)).contains("unknown ggml type id 77"));
    assert!(err(with_tensor(&[33], 3, 0, 40)).contains("not a multiple"));
    assert!(err(with_tensor(&[32], 3, 8, 40)).contains("not aligned"));
    assert!(err(with_tensor(&[32], 3, 1 << 63, 20)).contains("past the end"));
    assert!(err(with_tensor(&[u64::MAX, 2], 0, 0, 0)).contains("overflows"));
    assert!(err(with_tensor(&[1 << 32, 1 << 32], 0, 0, 0)).contains("overflows"));
    assert!(err(with_tensor(&[0], 0, 0, 0)).contains("dimension 0 is zero"));
    assert!(err(with_tensor(&[1, 1, 1, 1, 1], 0, 0, 4)).contains("rank 5"));
    assert!(err(with_tensor(&[], 0, 0, 4)).contains("rank 0"));
    let dup = GgufBuilder::new()
        .tensor("w", &[1], GgmlType::F32, vec![0; 4])
        .tensor("w", &[1], GgmlType::F32, vec![0; 4])
        .build();
    assert!(err(dup).contains("appears twice"));
}

#[test]
fn random_corruption_never_panics() {
    let base = sample().build();
    // xorshift: deterministic, no dependency.
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for _ in 0..20_000 {
        let mut v = base.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() % v.len() as u64) as usize;
            v[i] = next() as u8;
        }
        if next() % 8 == 0 {
            let cut = (next() % v.len() as u64) as usize;
            v.truncate(cut);
        }
        if let Ok(g) = Gguf::from_bytes(v) {
            for t in g.tensors() {
                assert_eq!(g.tensor_data(t).len() as u64, t.size);
            }
        }
    }
}

#[test]
fn reads_a_file_written_by_gguf_py() {
    // tools/gen_fuzz_seeds.py seed 1: written by gguf-py's GGUFWriter, an independent implementation.
    let g = Gguf::from_bytes(include_bytes!("../../testdata/gguf_py_q4_1.gguf").to_vec()).unwrap();
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 11);
    let w = g.tensor("w").unwrap();
    assert_eq!(
        (w.ty, w.dims.as_slice(), w.size),
        (GgmlType::Q4_1, &[64u64, 2][..], 80)
    );
    let tok = crate::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.encode("<|im_start|>ab", true).unwrap(), vec![0, 4]);
    assert_eq!(tok.eog(), &[1]);
}
