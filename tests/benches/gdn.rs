//! The Gated DeltaNet recurrence on CPU, token by token against the chunked (WY) form, for one layer of a
//! Qwen3.6-27B-shaped model (16 key / 48 value heads of 128): what justifies prefilling token by token on
//! CPU (see `thorn_engine::model::qwen35::gdn`). Also the decode step (one token) and a state snapshot copy.
//!
//! `cargo bench -p thorn-tests --bench gdn`; `THORN_BENCH_QUICK=1` shortens it (a smoke run).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;
use thorn_engine::backend::gdn::{self, HeadRun, Shape};

const SHAPE: Shape = Shape {
    kh: 16,
    vh: 48,
    dk: 128,
    dv: 128,
    kernel: 4,
};

fn noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
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

struct Inputs {
    y: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn inputs(n: usize) -> Inputs {
    let s = &SHAPE;
    let mut y = noise(1, n * s.conv_dim(), 1.0);
    gdn::normalize_qk(s, &mut y, n);
    let mut g = noise(2, n * s.vh, 1.0);
    let mut beta = noise(3, n * s.vh, 1.0);
    let a: Vec<f32> = (0..s.vh).map(|h| -0.1 - 0.05 * h as f32).collect();
    gdn::gates(&a, &vec![0.0; s.vh], &mut g, &mut beta);
    Inputs { y, g, beta }
}

/// One layer (every value head) over `n` tokens.
fn layer(inp: &Inputs, n: usize, state: &mut [f32], o: &mut [f32], chunked: bool) {
    let s = &SHAPE;
    let hs = s.dk * s.dv;
    for h in 0..s.vh {
        let r = HeadRun {
            y: &inp.y,
            g: &inp.g,
            beta: &inp.beta,
            n,
            head: h,
        };
        let st = &mut state[h * hs..(h + 1) * hs];
        if chunked {
            gdn::chunked(s, &r, st, o);
        } else {
            gdn::recurrence(s, &r, st, o, None);
        }
    }
}

fn bench(c: &mut Criterion) {
    let quick = std::env::var_os("THORN_BENCH_QUICK").is_some();
    let n = if quick { 64 } else { 256 };
    let inp = inputs(n);
    let mut state = vec![0f32; SHAPE.matrix_floats()];
    let mut o = vec![0f32; n * SHAPE.vh * SHAPE.dv];
    let mut g = c.benchmark_group("gdn_prefill_layer");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(if quick { 100 } else { 1000 }))
        .measurement_time(Duration::from_secs(if quick { 1 } else { 10 }));
    for (name, chunked) in [("token_by_token", false), ("chunked", true)] {
        g.bench_with_input(BenchmarkId::new(name, n), &chunked, |b, &ch| {
            b.iter(|| layer(&inp, n, black_box(&mut state), &mut o, ch));
        });
    }
    g.finish();
    let one = inputs(1);
    c.bench_function("gdn_decode_step_layer", |b| {
        b.iter(|| layer(&one, 1, black_box(&mut state), &mut o, false));
    });
    // A snapshot of every DeltaNet layer's state of the 27B shape (48 layers): 149.6 MiB.
    let floats = 48 * SHAPE.floats();
    let src = vec![0.5f32; floats];
    let mut dst = vec![0f32; floats];
    let mut g = c.benchmark_group("snapshot_copy_27b");
    g.sample_size(10);
    g.bench_function("149.6 MiB", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
