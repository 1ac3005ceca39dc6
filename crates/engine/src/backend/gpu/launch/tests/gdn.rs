//! The Gated DeltaNet kernels against the CPU, on every device.

use super::*;

#[test]
fn gated_deltanet_kernels_match_the_cpu() {
    on_every_device(gated_deltanet_kernels_match_the_cpu_on);
}

fn gated_deltanet_kernels_match_the_cpu_on(d: &dyn TestDev) {
    use crate::backend::gdn::{self, HeadRun, Shape as G, Steps};
    // dv = 48: one partial block of columns; three steps kept (verification of a short draft).
    let s = G {
        kh: 2,
        vh: 4,
        dk: 32,
        dv: 48,
        kernel: 4,
    };
    let (n, count) = (7, 3);
    let cd = s.conv_dim();
    let w = s.kernel - 1;
    let stride = s.floats();
    let taps = data(cd * s.kernel, 31);
    let window0 = data(cd * w, 32);
    let x = data(n * cd, 33);

    // Convolution, with the window after each of the last three tokens kept at the window's offset.
    let (mut window, mut y) = (window0.clone(), vec![0.0; n * cd]);
    let mut steps = vec![0.0; count * stride];
    gdn::conv(
        &s,
        &taps,
        &mut window,
        &x,
        n,
        &mut y,
        Some(&mut Steps {
            buf: &mut steps,
            stride,
            offset: s.matrix_floats(),
            count,
        }),
    );
    let (tm, wm, xm, ym) = (
        Mem::from_f32(d, &taps),
        Mem::from_f32(d, &window0),
        Mem::from_f32(d, &x),
        Mem::zeroed(d, 4 * n * cd),
    );
    let sm = Mem::zeroed(d, 4 * count * stride);
    let dsteps = |offset| DevSteps {
        buf: sm.ptr(),
        stride,
        offset,
        count,
    };
    gdn_conv(
        d,
        &s,
        tm.ptr(),
        wm.ptr(),
        xm.ptr(),
        n,
        ym.ptr(),
        Some(dsteps(s.matrix_floats())),
    )
    .unwrap();
    let f64s = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| f64::from(x)).collect() };
    let exact = |got: &[f32], want: &[f32], what: &str| {
        let w64 = f64s(want);
        let scale: Vec<f64> = w64.iter().map(|v| v.abs() + 1e-6).collect();
        close(got, &w64, &scale, 1e-5, what);
    };
    // A convolution output is a sum of `kernel` products that can cancel, and a GPU contracts its
    // multiply-adds into FMAs (the CPU and the simulator round each product): the two differ by a few
    // roundings of the products' magnitudes, not of the (possibly much smaller) sum. So its scale is
    // Σ|tap · input| (silu's slope is below 1.1). The H200 missed a bound relative to the sum by 4%.
    let conv_scale: Vec<f64> = (0..n * cd)
        .map(|i| {
            let (t, ch) = (i / cd, i % cd);
            let input = |j: usize| {
                if j < w {
                    window0[ch * w + j]
                } else {
                    x[(j - w) * cd + ch]
                }
            };
            (0..s.kernel)
                .map(|j| f64::from(taps[ch * s.kernel + j] * input(t + j)).abs())
                .sum::<f64>()
                + f64::from(y[i]).abs()
                + 1e-6
        })
        .collect();
    close(&ym.f32s(), &f64s(&y), &conv_scale, 1e-5, "conv output");
    exact(&wm.f32s(), &window, "conv window");

    // Normalisation and gates, each stage from the CPU's output of the stage before.
    let ym = Mem::from_f32(d, &y);
    gdn::normalize_qk(&s, &mut y, n);
    gdn_normalize_qk(d, &s, ym.ptr(), n).unwrap();
    exact(&ym.f32s(), &y, "normalised q and k");
    let (a, dt) = (data(s.vh, 34), data(s.vh, 35));
    let (mut g, mut beta) = (data(n * s.vh, 36), data(n * s.vh, 37));
    let (am, dm, gm, bm) = (
        Mem::from_f32(d, &a),
        Mem::from_f32(d, &dt),
        Mem::from_f32(d, &g),
        Mem::from_f32(d, &beta),
    );
    gdn::gates(&a, &dt, &mut g, &mut beta);
    gdn_gates(d, am.ptr(), dm.ptr(), gm.ptr(), bm.ptr(), n, s.vh).unwrap();
    exact(&gm.f32s(), &g, "log decay");
    exact(&bm.f32s(), &beta, "beta");

    // The recurrence over every head, with the state after each of the last three tokens.
    let state0: Vec<f32> = data(s.matrix_floats(), 38)
        .iter()
        .map(|v| v * 0.1)
        .collect();
    let mut state = state0.clone();
    let mut o = vec![0.0; n * s.vh * s.dv];
    let run_y = ym.f32s();
    let hs = s.dk * s.dv;
    for h in 0..s.vh {
        let run = HeadRun {
            y: &run_y,
            g: &g,
            beta: &beta,
            n,
            head: h,
        };
        gdn::recurrence(
            &s,
            &run,
            &mut state[h * hs..(h + 1) * hs],
            &mut o,
            Some(&mut Steps {
                buf: &mut steps,
                stride,
                offset: h * hs,
                count,
            }),
        );
    }
    let (stm, om) = (
        Mem::from_f32(d, &state0),
        Mem::zeroed(d, 4 * n * s.vh * s.dv),
    );
    gdn_recurrence(
        d,
        &s,
        ym.ptr(),
        gm.ptr(),
        bm.ptr(),
        stm.ptr(),
        om.ptr(),
        n,
        Some(dsteps(0)),
    )
    .unwrap();
    // The recurrence's outputs and states are dot products over a head's dk or dv that cancel too, and
    // compound over the tokens: each element is held to the rounding of the largest magnitude in its
    // block (a token's head of outputs, a head's matrix), as a wrong or missing term would miss by that
    // magnitude itself. The H200 missed an output's own magnitude by 12%.
    let blocked = |got: &[f32], want: &[f32], block: usize, what: &str| {
        let w64 = f64s(want);
        let scale: Vec<f64> = w64
            .chunks(block)
            .flat_map(|b| {
                let m = b.iter().fold(0f64, |m, v| m.max(v.abs()));
                b.iter().map(move |v| v.abs() + m + 1e-6)
            })
            .collect();
        close(got, &w64, &scale, 1e-5, what);
    };
    blocked(&om.f32s(), &o, s.dv, "recurrence output");
    blocked(&stm.f32s(), &state, hs, "recurrence state");
    let (got_steps, m) = (sm.f32s(), s.matrix_floats());
    for (j, (got, want)) in got_steps
        .chunks(stride)
        .zip(steps.chunks(stride))
        .enumerate()
    {
        blocked(
            &got[..m],
            &want[..m],
            hs,
            &format!("kept step {j}: matrices"),
        );
        exact(&got[m..], &want[m..], &format!("kept step {j}: windows"));
    }

    // The gated output norm and the sigmoid gate.
    let (z, wt) = (data(n * s.vh * s.dv, 39), data(s.dv, 40));
    let (zm, wtm) = (Mem::from_f32(d, &z), Mem::from_f32(d, &wt));
    // From the CPU's recurrence output, like every stage.
    let om = Mem::from_f32(d, &o);
    gdn::gated_norm(&s, &mut o, &z, &wt, 1e-6);
    gdn_gated_norm(d, om.ptr(), zm.ptr(), wtm.ptr(), n * s.vh, s.dv, 1e-6).unwrap();
    exact(&om.f32s(), &o, "gated norm");
    let mut xs = data(1000, 41);
    let gate = data(1000, 42);
    let (xm, gm2) = (Mem::from_f32(d, &xs), Mem::from_f32(d, &gate));
    for (v, &g) in xs.iter_mut().zip(&gate) {
        *v *= gdn::sigmoid(g);
    }
    sigmoid_gate(d, xm.ptr(), gm2.ptr(), 1000).unwrap();
    exact(&xm.f32s(), &xs, "sigmoid gate");
}

#[test]
fn the_chunked_deltanet_kernel_matches_the_cpu() {
    on_every_device(the_chunked_deltanet_kernel_matches_the_cpu_on);
}

/// Two chunks and a partial one (150 tokens), two value heads per key head: the chunked kernel against the
/// CPU's chunked form (the same operations per output: to the rounding of fused multiply-adds), and both
/// against the token-by-token recurrence (another order of operations: to float rounding).
fn the_chunked_deltanet_kernel_matches_the_cpu_on(d: &dyn TestDev) {
    use crate::backend::gdn::{self, HeadRun, Shape as G};
    let s = G {
        kh: 2,
        vh: 4,
        dk: 32,
        dv: 40,
        kernel: 4,
    };
    let n = 2 * gdn::CHUNK + 22;
    let cd = s.conv_dim();
    let mut y = data(n * cd, 51);
    gdn::normalize_qk(&s, &mut y, n);
    // A model's `a` is `-exp(A_log)`: every step decays the state.
    let a: Vec<f32> = data(s.vh, 52).iter().map(|v| -v.abs() - 0.05).collect();
    let dt = data(s.vh, 53);
    let (mut g, mut beta) = (data(n * s.vh, 54), data(n * s.vh, 55));
    gdn::gates(&a, &dt, &mut g, &mut beta);
    let state0: Vec<f32> = data(s.matrix_floats(), 56)
        .iter()
        .map(|v| v * 0.1)
        .collect();
    let hs = s.dk * s.dv;
    let (mut chunked, mut stepped) = (state0.clone(), state0.clone());
    let (mut oc, mut os) = (vec![0.0; n * s.vh * s.dv], vec![0.0; n * s.vh * s.dv]);
    for h in 0..s.vh {
        let run = HeadRun {
            y: &y,
            g: &g,
            beta: &beta,
            n,
            head: h,
        };
        gdn::chunked(&s, &run, &mut chunked[h * hs..(h + 1) * hs], &mut oc);
        gdn::recurrence(&s, &run, &mut stepped[h * hs..(h + 1) * hs], &mut os, None);
    }
    let (ym, gm, bm, stm) = (
        Mem::from_f32(d, &y),
        Mem::from_f32(d, &g),
        Mem::from_f32(d, &beta),
        Mem::from_f32(d, &state0),
    );
    let om = Mem::zeroed(d, 4 * n * s.vh * s.dv);
    let work = Mem::zeroed(d, 4 * gdn_chunk_work(&s));
    gdn_chunk(
        d,
        &s,
        ym.ptr(),
        gm.ptr(),
        bm.ptr(),
        stm.ptr(),
        om.ptr(),
        work.ptr(),
        n,
    )
    .unwrap();
    let check = |got: &[f32], want: &[f32], rel: f64, what: &str| {
        let w64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        // Relative to the largest value: the outputs are sums of many terms of both signs.
        let big = w64.iter().fold(0f64, |m, v| m.max(v.abs()));
        close(got, &w64, &vec![big; w64.len()], rel, what);
    };
    check(&om.f32s(), &oc, 1e-5, "chunked outputs");
    check(&stm.f32s(), &chunked, 1e-5, "chunked state");
    check(&oc, &os, 1e-4, "chunked against token by token: outputs");
    check(
        &chunked,
        &stepped,
        1e-4,
        "chunked against token by token: state",
    );
}
