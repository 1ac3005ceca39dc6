//! The GPU device's tests on the kernel simulator: what a pass uploads, waits for and launches.

use crate::backend::gpu::sim::Counting;
use crate::backend::{Device, Workspace};
use crate::kv::{Batch, KvCache, KvConfig, KvDtype, KvShape, Logits};
use crate::testutil::data;
use std::sync::Arc;

/// A pass's layers share its batch: the metadata the KV writes and attention read is uploaded by the
/// first layer's op and only read by the others, and nothing waits. The next step (new positions,
/// slots) uploads what changed.
#[test]
fn the_batch_metadata_is_uploaded_once_per_pass_and_nothing_waits() {
    let rt = Counting::new();
    let dev = Device::gpu(Arc::clone(&rt) as _);
    // Launched as queued, so that they are counted as they come.
    dev.set_graphs(false);
    let (layers, kv_heads, heads, hd) = (4, 2, 4, 64);
    let shape = KvShape {
        n_layers: layers,
        n_kv_heads: kv_heads,
        head_dim: hd,
        recurrent: 0,
    };
    let mut kv = KvCache::on(
        &dev,
        shape,
        KvConfig {
            dtype: KvDtype::F16,
            page_size: 16,
            memory: 1 << 22,
            cache_output: false,
            ..KvConfig::default()
        },
    )
    .unwrap();
    let mut seq = kv.acquire(&[]);
    let w = kv_heads * hd;
    let mut out = Default::default();
    let mut ws = Workspace::default();
    let mut batch = Batch::default();
    for (step, new) in [(0, 5), (1, 1), (2, 1)] {
        let want = seq.len() + new;
        kv.reserve(&mut seq, want).unwrap();
        batch.clear();
        batch.push(&seq, &vec![0; new], Logits::Last);
        let k = dev.buf(data(new * w, step)).unwrap();
        let q = dev.buf(data(new * heads * hd, 10 + step)).unwrap();
        dev.grow(&mut out, new * heads * hd).unwrap();
        rt.take();
        for layer in 0..layers {
            dev.write_kv_rows(kv.pool_mut(), &batch, layer, &k, &k, w);
            let pool = kv.pool();
            dev.attention(
                pool,
                layer,
                &batch,
                &q,
                heads * hd,
                heads,
                kv_heads,
                hd,
                &mut out,
                &mut ws,
            );
        }
        let c = rt.take();
        assert!(c.launches >= 2 * layers, "step {step}: {c:?}");
        // Five metadata arrays at most, uploaded by the first layer's op, and the attention merge's
        // counters when they grow (the first step).
        assert!(
            c.uploads <= 5 + usize::from(step == 0),
            "step {step}: {c:?}"
        );
        assert_eq!(c.downloads, 0, "step {step}: {c:?}");
        // The first step sizes the staging (growing it waits for the queued work); after that
        // nothing waits.
        if step > 0 {
            assert_eq!(c.waits, 0, "step {step}: {c:?}");
        }
        dev.finish();
        assert!(
            out.read_back(new * heads * hd)
                .iter()
                .all(|v| v.is_finite())
        );
        seq.advance(new);
    }
    kv.release(seq, None);
}

/// Two ops of one recorded segment given different staging contents (RoPE rows of other positions):
/// the second upload waits for the first op's segment to run, so graphs on compute what graphs off do;
/// and host edits of a buffer reach the ops recorded after them.
#[test]
fn staging_a_recorded_op_was_handed_is_not_changed_under_it() {
    use crate::backend::{Rope, rope_angles};
    let (hd, heads, rows) = (16, 2, 3);
    let w = heads * hd;
    let mut table = Vec::new();
    for p in 0..8 {
        rope_angles(hd, p, 10000.0, &mut table);
    }
    let run = |graphs: bool| {
        let rt = Counting::new();
        let dev = Device::gpu(Arc::clone(&rt) as _);
        dev.set_graphs(graphs);
        let mut a = dev.buf(data(rows * w, 1)).unwrap();
        let mut b = dev.buf(data(rows * w, 2)).unwrap();
        dev.rope_rows(
            Rope::Normal,
            &mut a,
            rows,
            w,
            w,
            hd,
            &[0, 1, 2],
            &table,
            hd / 2,
        );
        dev.rope_rows(
            Rope::Normal,
            &mut b,
            rows,
            w,
            w,
            hd,
            &[5, 6, 7],
            &table,
            hd / 2,
        );
        {
            let mut e = a.edit();
            e[0] = 42.0;
        }
        dev.add(&mut b, &a);
        (
            a.read_back(rows * w).to_vec(),
            b.read_back(rows * w).to_vec(),
        )
    };
    let (want, got) = (run(false), run(true));
    assert_eq!(got, want);
    // And they are rotations at those positions (the CPU's).
    let cpu = Device::cpu(1);
    let (mut a, mut b) = (data(rows * w, 1), data(rows * w, 2));
    cpu.rope_rows(
        Rope::Normal,
        &mut a,
        rows,
        w,
        w,
        hd,
        &[0, 1, 2],
        &table,
        hd / 2,
    );
    cpu.rope_rows(
        Rope::Normal,
        &mut b,
        rows,
        w,
        w,
        hd,
        &[5, 6, 7],
        &table,
        hd / 2,
    );
    a[0] = 42.0;
    cpu.add(&mut b, &a);
    let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| (p - q).abs() <= 1e-5);
    assert!(close(&want.0, &a) && close(&want.1, &b));
}

/// Kernel times: every kernel launched while timing is on, per name, with graphs turned off so each is
/// launched (and timed) on its own; nothing after timing stops; the CPU has none to time.
#[test]
fn kernels_are_timed_one_by_one_while_timing_is_on() {
    let rt = Counting::new();
    let dev = Device::gpu(Arc::clone(&rt) as _);
    let (mut x, y) = (
        dev.buf(data(4096, 1)).unwrap(),
        dev.buf(data(4096, 2)).unwrap(),
    );
    dev.time_kernels(true).unwrap();
    for _ in 0..3 {
        dev.add(x.at_mut(..), y.at(..));
    }
    let t = dev.kernel_times().unwrap();
    let (launches, seconds) = t.kernels["add_f32"];
    assert_eq!(launches, 3, "{t:?}");
    assert!(seconds > 0.0 && t.total() == seconds, "{t:?}");
    assert_eq!(
        dev.graph_stats().unwrap().replays,
        0,
        "timed kernels are not replayed from graphs"
    );
    // Read once: the next call has only what ran since.
    assert!(dev.kernel_times().unwrap().kernels.is_empty());
    dev.time_kernels(false).unwrap();
    dev.add(x.at_mut(..), y.at(..));
    assert!(dev.kernel_times().unwrap().kernels.is_empty());
    assert!(Device::cpu(1).time_kernels(true).is_err());
}

/// A GPU's page pool is device memory the host never addresses: written rows, copy-on-write and row moves
/// (one kernel for a whole path, no wait) leave it equal to a host pool given the same calls, FP8 scales
/// and a reused page's reset scale included, as read back whole.
#[test]
fn a_gpu_page_pool_is_copied_by_kernels_and_equals_the_host_pool() {
    use crate::backend::pages::{KvSlice, PagePool};
    let rt = Counting::new();
    let dev = Device::gpu(Arc::clone(&rt) as _);
    dev.set_graphs(false);
    let shape = KvShape {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 32,
        recurrent: 0,
    };
    let (ps, w) = (4, 64);
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8] {
        let mut host = PagePool::new(shape, ps, dtype, 6);
        let mut gpu = PagePool::on(&dev, shape, ps, dtype, 6).unwrap();
        for (on_gpu, pool) in [(false, &mut host), (true, &mut gpu)] {
            let pages: Vec<u32> = (0..4).map(|_| pool.alloc().unwrap()).collect();
            for (i, &page) in pages.iter().enumerate() {
                for slot in 0..ps {
                    for layer in 0..2 {
                        let seed = (50 * i + 5 * slot + layer) as u64;
                        let f = (1 + 2 * i) as f32;
                        let k: Vec<f32> = data(w, seed).iter().map(|x| x * f).collect();
                        pool.write(page, slot, layer, &k, &k);
                    }
                }
            }
            // A page freed and taken again starts unscaled.
            pool.release(pages[3]);
            assert_eq!(pool.alloc(), Some(pages[3]));
            pool.write(pages[3], 0, 1, &data(w, 9), &data(w, 10));
            rt.take();
            pool.copy(pages[1], pages[0], 3);
            pool.move_rows(&[[pages[0], 3, pages[0], 1], [pages[2], 2, pages[0], 2]]);
            pool.copy_row(pages[2], 3, pages[1], 0);
            let c = rt.take();
            if on_gpu {
                assert_eq!((c.launches, c.downloads), (3, 0), "{c:?}");
            }
            // Its staging in place, a path's moves are an upload and a launch, no wait.
            pool.move_rows(&[[pages[1], 3, pages[1], 2]]);
            let c = rt.take();
            if on_gpu {
                assert_eq!((c.launches, c.uploads, c.waits), (1, 1, 0), "{c:?}");
            }
        }
        let got = gpu.to_host();
        for page in 0..4 {
            for layer in 0..2 {
                for h in 0..2 {
                    for (a, b) in [
                        (got.keys(page, layer, h), host.keys(page, layer, h)),
                        (got.values(page, layer, h), host.values(page, layer, h)),
                    ] {
                        let same = match (a, b) {
                            (KvSlice::F32(a), KvSlice::F32(b)) => a == b,
                            (KvSlice::F16(a), KvSlice::F16(b)) => a
                                .iter()
                                .map(|x| x.to_bits())
                                .eq(b.iter().map(|x| x.to_bits())),
                            (
                                KvSlice::Fp8 { data: a, scale: x },
                                KvSlice::Fp8 { data: b, scale: y },
                            ) => a == b && x == y,
                            _ => false,
                        };
                        assert!(same, "{dtype:?}: page {page} layer {layer} head {h}");
                    }
                }
            }
        }
    }
}
