//! The GGUF reader on the real default model.

use thorn_engine::gguf::Gguf;
use thorn_engine::quant::{GgmlType, dequantize_ref, dot_ref};
use thorn_tests::{default_model, fixture, golden};

#[test]
fn reads_the_default_model_as_the_fixture_metadata_says() {
    let g = Gguf::open(default_model()).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2/meta.json")).unwrap())
            .unwrap();
    let m = &meta["gguf"];
    assert_eq!(g.file_len(), meta["model_bytes"].as_u64().unwrap());
    assert_eq!(
        g.architecture().unwrap(),
        m["architecture"].as_str().unwrap()
    );
    for (key, field) in [
        ("block_count", "block_count"),
        ("embedding_length", "embedding_length"),
        ("feed_forward_length", "feed_forward_length"),
        ("attention.head_count", "head_count"),
        ("attention.head_count_kv", "head_count_kv"),
        ("rope.dimension_count", "rope_dimension_count"),
        ("vocab_size", "vocab_size"),
        ("context_length", "context_length"),
    ] {
        assert_eq!(
            u64::from(g.arch_u32(key).unwrap()),
            m[field].as_u64().unwrap(),
            "{key}"
        );
    }
    assert_eq!(
        f64::from(g.arch_f32("attention.layer_norm_rms_epsilon").unwrap()),
        m["rms_norm_eps_f32"].as_f64().unwrap()
    );
    assert_eq!(
        f64::from(g.arch_f32("rope.freq_base").unwrap()),
        m["rope_freq_base"].as_f64().unwrap()
    );
    let count = |ty: GgmlType| g.tensors().iter().filter(|t| t.ty == ty).count() as u64;
    for (name, n) in m["tensor_types"].as_object().unwrap() {
        let ty = GgmlType::ALL
            .iter()
            .copied()
            .find(|t| t.name() == name)
            .unwrap();
        assert_eq!(count(ty), n.as_u64().unwrap(), "{name} tensors");
    }
    let embd = g.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ty, embd.dims.as_slice()),
        (GgmlType::Q8_0, &[576u64, 49152][..])
    );
    assert!(
        g.tensor("output.weight").is_err(),
        "SmolLM2 ties the output matrix to the embedding"
    );
}

#[test]
fn every_tensor_decodes_to_finite_values() {
    let g = Gguf::open(default_model()).unwrap();
    for t in g.tensors() {
        let (rows, cols) = t.rows_cols();
        let row_bytes = t.ty.row_bytes(cols as usize).unwrap();
        let data = g.tensor_data(t);
        assert_eq!(data.len(), rows as usize * row_bytes, "{}", t.name);
        // First and last row of every tensor: finite values, and dot_ref agrees with dequantize + sum.
        let mut row = vec![0f32; cols as usize];
        for r in [0, rows as usize - 1] {
            let bytes = &data[r * row_bytes..(r + 1) * row_bytes];
            dequantize_ref(t.ty, bytes, &mut row).unwrap();
            assert!(row.iter().all(|v| v.is_finite()), "{} row {r}", t.name);
            let ones = vec![1f32; cols as usize];
            let sum: f64 = row.iter().map(|&v| f64::from(v)).sum();
            let dot = f64::from(dot_ref(t.ty, bytes, &ones).unwrap());
            assert!(
                (dot - sum).abs() <= 1e-4 * sum.abs().max(1.0),
                "{} row {r}: {dot} vs {sum}",
                t.name
            );
        }
    }
}

#[test]
fn metadata_and_tensor_table_golden() {
    let g = Gguf::open(default_model()).unwrap();
    let mut out = format!(
        "GGUF v{} alignment {} data at {}\n",
        g.version, g.alignment, g.data_offset
    );
    for (k, v) in g.metadata() {
        out.push_str(&format!("{k} = {}\n", v.summary(60).replace('\n', "\\n")));
    }
    for t in g.tensors().iter().take(12) {
        out.push_str(&format!(
            "{} {} {:?} @{} +{}\n",
            t.name, t.ty, t.dims, t.offset, t.size
        ));
    }
    golden("gguf/smollm2_header.txt", &out);
}

/// `scripts/gguf-skeleton.py` (what `scripts/gpu-peer` gives the GPU machine instead of the model): the
/// default model's header alone, then filled with seeded random weights, is a GGUF of the same size,
/// metadata and tensor table whose weights are not the model's, and the engine runs it.
#[test]
fn a_skeleton_of_the_default_model_has_its_header_and_runs() {
    use thorn_engine::backend::Device;
    use thorn_engine::kv::{Batch, KvCache, KvConfig, Logits};
    use thorn_engine::model::llama::{Llama, Scratch};
    let dir = tempfile::tempdir().unwrap();
    let (header, filled) = (dir.path().join("h.gguf"), dir.path().join("s.gguf"));
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gguf-skeleton.py");
    let python = std::env::var("THORN_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    for (mode, src, dst) in [
        ("header", default_model(), header.clone()),
        ("fill", header.clone(), filled.clone()),
    ] {
        let st = std::process::Command::new(&python)
            .arg(&script)
            .args([std::ffi::OsStr::new(mode), src.as_os_str(), dst.as_os_str()])
            .status()
            .unwrap();
        assert!(st.success(), "gguf-skeleton.py {mode}");
    }
    let (real, skel) = (
        Gguf::open(default_model()).unwrap(),
        Gguf::open(&filled).unwrap(),
    );
    assert_eq!(std::fs::metadata(&header).unwrap().len(), real.data_offset);
    assert_eq!(skel.file_len(), real.file_len());
    assert_eq!(skel.metadata().len(), real.metadata().len());
    let names = |g: &Gguf| -> Vec<_> {
        g.tensors()
            .iter()
            .map(|t| (t.name.clone(), t.ty, t.dims.clone(), t.offset))
            .collect()
    };
    assert_eq!(names(&skel), names(&real));
    let t = &real.tensors()[1];
    assert_ne!(
        skel.tensor_data(t),
        real.tensor_data(t),
        "the weights are not the model's"
    );
    // The engine loads and runs it (the numbers mean nothing, but none is NaN).
    let dev = Device::cpu(1);
    let model = Llama::load(std::sync::Arc::new(skel), &dev).unwrap();
    let mut kv = KvCache::on(
        &dev,
        model.kv_shape(),
        KvConfig {
            memory: 1 << 24,
            ..KvConfig::default()
        },
    )
    .unwrap();
    let mut seq = kv.acquire(&[]);
    kv.reserve(&mut seq, 4).unwrap();
    let mut batch = Batch::default();
    batch.push(&seq, &[1, 2, 3, 4], Logits::Last);
    let mut s = Scratch::default();
    let logits = model.forward(&dev, kv.pool_mut(), &batch, &mut s).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
    seq.advance(4);
    kv.release(seq, None);
}
