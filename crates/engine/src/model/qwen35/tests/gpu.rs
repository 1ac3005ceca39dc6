//! The hybrid model on the GPU device (its kernels run by the simulator, and on a GPU where the build has
//! CUDA): against the goldens and the CPU, batched, verified and chunked, its weights in place on unified
//! memory, and its recurrent states kept on the device between passes.

use super::*;

/// On a GPU a sequence's recurrent state moves to the device at its first pass and stays: a decode step
/// uploads its inputs (well under one state) and reads back only its logits, and a speculative pass's
/// kept steps, its roll-back and a snapshot taken and restored are copies on the device (nothing read
/// back). The states are those of the CPU.
#[test]
fn recurrent_states_stay_on_the_gpu_between_passes() {
    let gold = golden();
    let ids = ids_of(&gold["sequences"][2]);
    let rt = crate::backend::sim::Counting::new();
    let dev = Device::gpu(Arc::clone(&rt) as _);
    let mut gpu = Runner::on(Qwen35::from_gguf(&gguf(), &dev).unwrap(), dev);
    let mut cpu = Runner::new(Qwen35::from_gguf(&gguf(), &load_dev()).unwrap());
    let state_bytes = 4 * gpu.model.config().state_floats();
    let (mut g, mut c) = (gpu.seq(), cpu.seq());
    gpu.run(&mut g, &ids[..40], Logits::None);
    cpu.run(&mut c, &ids[..40], Logits::None);
    for &t in &ids[40..43] {
        rt.take();
        gpu.run(&mut g, &[t], Logits::Last);
        let n = rt.take();
        assert!(
            n.upload_bytes < state_bytes / 4,
            "{n:?}, a state of {state_bytes} bytes"
        );
        assert_eq!(n.downloads, 1, "the logits alone: {n:?}");
        cpu.run(&mut c, &[t], Logits::Last);
    }
    // A verification pass keeps 3 steps; accepting one rolls back on the device.
    rt.take();
    gpu.run(&mut g, &ids[43..46], Logits::Tail(3));
    gpu.kv.keep_path(&mut g, 44, &[0]);
    let n = rt.take();
    assert_eq!(n.downloads, 1, "the logits alone: {n:?}");
    cpu.run(&mut c, &ids[43..46], Logits::Tail(3));
    cpu.kv.keep_path(&mut c, 44, &[0]);
    assert_eq!((g.rec.len, c.rec.len), (45, 45));
    let (gs, cs) = (g.rec.state.to_vec(), c.rec.state.to_vec());
    assert!(max_diff(&gs, &cs) < 1e-4, "the rolled-back state");
    // A snapshot at the sequence's end, restored into the next sequence of the same prompt.
    rt.take();
    gpu.kv.release(g, Some(&ids[..45]));
    let again = gpu.kv.acquire(&ids[..46]);
    let n = rt.take();
    assert_eq!(again.rec.len, 45, "resumed from the snapshot");
    assert!(
        n.upload_bytes < state_bytes / 4 && n.downloads == 0,
        "{n:?}"
    );
    assert!(again.rec.state.to_vec() == gs, "the snapshot's state");
    gpu.kv.release(again, None);
}

/// The whole forward pass on the GPU device, run by the CUDA kernels in the simulator: every golden
/// sequence prefilled, then one decoded token by token after a prefill, against the goldens within the
/// fixture's tolerance (the kernels sum in other orders than the CPU; every op but the embedding rows runs
/// as a kernel, the DeltaNet ones on the states the pass stages in device memory; see `backend::gpu`).
#[test]
fn the_forward_pass_on_the_gpu_device_matches_the_goldens() {
    for graphs in [true, false] {
        for dev in crate::backend::sim::gpu_devices() {
            dev.set_graphs(graphs);
            gpu_forward_matches_the_goldens(dev, graphs);
        }
    }
}

fn gpu_forward_matches_the_goldens(dev: Device, graphs: bool) {
    let gold = golden();
    let model = Qwen35::from_gguf(&gguf(), &dev).unwrap();
    assert!(dev.name().starts_with("cuda/"), "{}", dev.name());
    let mut r = Runner::on(model, dev);
    for s in gold["sequences"].as_array().unwrap() {
        let ids = ids_of(s);
        let mut seq = r.seq();
        let got = r.run(&mut seq, &ids, Logits::All);
        let what = format!("GPU device, sequence {}", s["name"]);
        assert_close(&got, &golden_rows(s), &what);
        eprintln!("{what}: max diff {:e}", max_diff(&got, &golden_rows(s)));
        r.kv.release(seq, None);
    }
    let c = &gold["sequences"][2];
    let ids = ids_of(c);
    let want = golden_tensor("continuation.C.logits");
    let mut seq = r.seq();
    r.run(&mut seq, &ids[..70], Logits::None);
    let before = r.dev.graph_stats().unwrap();
    for (i, &t) in ids[70..].iter().enumerate() {
        let got = r.run(&mut seq, &[t], Logits::Last);
        let what = format!("GPU device, decode at {}", 70 + i);
        assert_close(&got, &want[i * 256..(i + 1) * 256], &what);
    }
    r.kv.release(seq, None);
    // A decode step's launches do not change from one position to the next (positions, lengths and
    // slots are in device buffers), and its recurrent states stay on the device (no host trip splits
    // it): with graphs on, a step is one segment, captured at the second step and replayed from the
    // third.
    let st = r.dev.graph_stats().unwrap();
    eprintln!("GPU device, graphs {graphs}: {st:?}");
    if graphs {
        let steps = ids[70..].len();
        assert_eq!(
            (st.replays - before.replays, st.captures - before.captures),
            (steps - 2, 1),
            "{st:?}"
        );
        let (in_graphs, single) = (
            st.graph_kernels - before.graph_kernels,
            st.kernels - before.kernels,
        );
        assert!(in_graphs > 10 * single, "{st:?}");
    } else {
        assert_eq!((st.replays, st.captures, st.graph_kernels), (0, 0, 0));
    }
}

/// The GPU device's DeltaNet kernels on the states a pass stages on the device: one batch with a
/// verification pass (six kept steps) beside a prefill, then a chunked prefill, against the CPU device
/// (logits within the fixture's tolerance; states and steps within 1e-4 of the CPU's).
#[test]
fn the_gpu_device_batches_verifies_and_chunks_like_the_cpu() {
    let gold = golden();
    let a = ids_of(&gold["sequences"][1]);
    let ids = ids_of(&gold["sequences"][2]);
    let mut cpu = Runner::new(Qwen35::from_gguf(&gguf(), &load_dev()).unwrap());
    let (want, want_st) = verify_beside_a_prefill(&mut cpu, &a, &ids);
    cpu.model.set_chunked_prefill(true);
    let mut sc = cpu.seq();
    let want_chunked = cpu.run(&mut sc, &ids, Logits::All);
    for dev in crate::backend::sim::gpu_devices() {
        let mut gpu = Runner::on(Qwen35::from_gguf(&gguf(), &dev).unwrap(), dev);
        let (got, got_st) = verify_beside_a_prefill(&mut gpu, &a, &ids);
        assert_close(&got, &want, "GPU device, verification beside a prefill");
        let floats = gpu.model.config().state_floats();
        for (g, w) in got_st.iter().zip(&want_st) {
            assert_eq!(
                (g.len, g.steps_len, g.steps_from),
                (w.len, w.steps_len, w.steps_from)
            );
            assert!(
                max_diff(&g.state.to_vec(), &w.state.to_vec()) < 1e-4,
                "GPU device, state"
            );
            let kept = w.steps_len * floats;
            assert!(
                max_diff(&g.steps.to_vec()[..kept], &w.steps.to_vec()[..kept]) < 1e-4,
                "GPU device, kept steps"
            );
        }
        assert_eq!(got_st[0].steps_len, 6);
        gpu.model.set_chunked_prefill(true);
        let mut sg = gpu.seq();
        let got = gpu.run(&mut sg, &ids, Logits::All);
        assert_close(&got, &want_chunked, "GPU device, chunked prefill");
        assert!(
            max_diff(&sg.rec.state.to_vec(), &sc.rec.state.to_vec()) < 1e-4,
            "GPU device, chunked prefill's state"
        );
    }
}

/// On a GPU that reads host memory in place (the counting simulator standing for Jetson Thor's unified
/// memory), qwen35-tiny's matrices stay in the GGUF's mapping (all but `attn_q`'s two halves, which are
/// picked rows) and every golden sequence gives the bits of the device that uploads its weights.
#[test]
fn a_unified_memory_gpu_reads_the_hybrids_weights_in_place() {
    let gold = golden();
    let rt = crate::backend::sim::Counting::unified();
    let dev = Device::gpu(Arc::clone(&rt) as _);
    let g = gguf();
    let model = Qwen35::from_gguf(&g, &dev).unwrap();
    let loaded = rt.take();
    let weights = model.weight_bytes();
    eprintln!(
        "in place: {weights} bytes of weights, {} bytes uploaded while loading",
        loaded.upload_bytes
    );
    assert!(loaded.upload_bytes < weights / 2, "{loaded:?}");
    for l in &model.layers {
        match &l.mixer {
            Mixer::DeltaNet(m) => assert!(m.qkv.in_place() && m.out.in_place()),
            Mixer::Attention(a) => assert!(a.k.in_place() && !a.q.in_place()),
        }
    }
    let uploaded = Device::gpu(Arc::new(crate::backend::sim::Sim));
    let mut a = Runner::on(model, dev);
    let mut b = Runner::on(Qwen35::from_gguf(&g, &uploaded).unwrap(), uploaded);
    for s in gold["sequences"].as_array().unwrap() {
        let ids = ids_of(s);
        let (mut sa, mut sb) = (a.seq(), b.seq());
        assert_eq!(
            a.run(&mut sa, &ids, Logits::All),
            b.run(&mut sb, &ids, Logits::All),
            "sequence {}",
            s["name"]
        );
        a.kv.release(sa, None);
        b.kv.release(sb, None);
    }
}
