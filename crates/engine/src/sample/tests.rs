//! The sampler's tests: greedy, bias and penalties, seeded draws and truncation, the fast paths' distributions
//! against the exact softmax, and the host's cost of a sampled token (printed).

use super::*;

fn logits() -> Vec<f32> {
    vec![1.0, 3.0, 2.0, -1.0, 2.5, 0.0]
}

#[test]
fn greedy_takes_the_argmax_with_its_logprob() {
    let mut s = Sampler::new(
        SamplingParams {
            top_logprobs: 3,
            ..Default::default()
        },
        6,
    );
    let mut l = logits();
    let out = s.sample(&mut l, &[]);
    assert_eq!(out.token, 1);
    let lse = logits().iter().map(|v| v.exp()).sum::<f32>().ln();
    assert!((out.logprob - (3.0 - lse)).abs() < 1e-5);
    assert_eq!(
        out.top.iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![1, 4, 2]
    );
}

#[test]
fn bias_and_penalties_change_the_choice() {
    let mut s = Sampler::new(
        SamplingParams {
            logit_bias: vec![(5, 10.0)],
            ..Default::default()
        },
        6,
    );
    assert_eq!(s.sample(&mut logits(), &[]).token, 5);
    let mut s = Sampler::new(
        SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        },
        6,
    );
    // 3.0 / 2 = 1.5 < 2.5: token 4 wins once token 1 is in the history.
    assert_eq!(s.sample(&mut logits(), &[1]).token, 4);
    let mut s = Sampler::new(
        SamplingParams {
            frequency_penalty: 0.3,
            ..Default::default()
        },
        6,
    );
    // Token 1 seen twice: 3.0 - 0.6 = 2.4 < 2.5.
    assert_eq!(s.sample(&mut logits(), &[1, 1]).token, 4);
    let mut s = Sampler::new(
        SamplingParams {
            presence_penalty: 0.6,
            ..Default::default()
        },
        6,
    );
    assert_eq!(s.sample(&mut logits(), &[1, 1, 1]).token, 4);
}

#[test]
fn same_seed_same_tokens_and_truncation_is_respected() {
    let params = SamplingParams {
        temperature: 1.5,
        seed: Some(42),
        ..Default::default()
    };
    let run = |params: &SamplingParams| {
        let mut s = Sampler::new(params.clone(), 6);
        (0..200)
            .map(|_| s.sample(&mut logits(), &[]).token)
            .collect::<Vec<_>>()
    };
    let a = run(&params);
    assert_eq!(a, run(&params));
    assert!(
        a.iter().collect::<std::collections::HashSet<_>>().len() >= 4,
        "high temperature explores"
    );
    assert_ne!(
        a,
        run(&SamplingParams {
            seed: Some(43),
            ..params.clone()
        })
    );
    let top2 = run(&SamplingParams {
        top_k: 2,
        ..params.clone()
    });
    assert!(top2.iter().all(|&t| t == 1 || t == 4));
    // softmax(logits / 1.5): p(1) ≈ 0.39, p(4) ≈ 0.28: top_p 0.5 keeps exactly those two.
    let top_p = run(&SamplingParams {
        top_p: 0.5,
        ..params.clone()
    });
    assert!(top_p.iter().all(|&t| t == 1 || t == 4) && top_p.contains(&4));
    let min_p = run(&SamplingParams {
        min_p: 0.9,
        ..params.clone()
    });
    assert!(min_p.iter().all(|&t| t == 1));
    let banned = run(&SamplingParams {
        logit_bias: vec![(1, f32::NEG_INFINITY)],
        ..params
    });
    assert!(!banned.contains(&1));
}

/// Plain temperature sampling over a row of several chunks (the vector-exp path): the softmax's
/// distribution at temperature 0.8, never a banned (minus infinity) or NaN logit, the same tokens for
/// the same seed.
#[test]
fn plain_temperature_sampling_over_many_chunks_follows_the_distribution() {
    let vocab = 3000;
    let mut row = vec![-12.0f32; vocab];
    for (t, v) in [
        (5, 2.0f32),
        (1500, 2.0 + std::f32::consts::LN_2),
        (2999, 1.0),
        (600, 0.5),
    ] {
        row[t] = v;
    }
    row[7] = f32::NEG_INFINITY;
    row[8] = f32::NAN;
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(11),
        ..Default::default()
    };
    let run = |n: usize| {
        let mut s = Sampler::new(params.clone(), vocab);
        (0..n)
            .map(|_| s.sample(&mut row.clone(), &[]).token)
            .collect::<Vec<_>>()
    };
    let n = 20_000;
    let drawn = run(n);
    assert_eq!(drawn[..50], run(50)[..], "the same seed, the same tokens");
    assert!(
        !drawn.contains(&7) && !drawn.contains(&8),
        "a banned or NaN logit drawn"
    );
    let w: Vec<f64> = row
        .iter()
        .map(|&v| {
            if v.is_finite() {
                (f64::from(v) / 0.8).exp()
            } else {
                0.0
            }
        })
        .collect();
    let z: f64 = w.iter().sum();
    for t in [5, 1500, 2999, 600] {
        let got = drawn.iter().filter(|&&d| d as usize == t).count() as f64 / n as f64;
        assert!(
            (got - w[t] / z).abs() < 0.015,
            "token {t}: {got} vs {}",
            w[t] / z
        );
    }
}

/// Top-p over a row of 3,000 tokens (the exponent-histogram path): exactly the nucleus, drawn in
/// proportion, never a token outside it (nor a banned or NaN one); the general path (the same
/// semantics, asked for through a top-k of the whole vocabulary) draws the same distribution.
#[test]
fn top_p_draws_exactly_the_nucleus() {
    let vocab = 3000;
    let mut row: Vec<f32> = crate::testutil::data(vocab, 21)
        .iter()
        .map(|x| x.clamp(-1.0, 1.0) - 4.0)
        .collect();
    for (t, v) in [(10, 3.0f32), (20, 2.5), (30, 2.0), (2500, 1.5)] {
        row[t] = v;
    }
    row[7] = f32::NEG_INFINITY;
    row[8] = f32::NAN;
    let top_p = 0.6;
    // The nucleus in f64: the most likely tokens until their mass reaches top_p.
    let w: Vec<f64> = row
        .iter()
        .map(|&v| {
            if v.is_finite() {
                f64::from(v - 3.0).exp()
            } else {
                0.0
            }
        })
        .collect();
    let z: f64 = w.iter().sum();
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    let mut acc = 0.0;
    let cut = order.iter().position(|&t| {
        acc += w[t];
        acc >= top_p * z
    });
    let nucleus = &order[..=cut.unwrap()];
    let mass: f64 = nucleus.iter().map(|&t| w[t]).sum();
    let draw = |top_k: usize| {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                top_p: top_p as f32,
                top_k,
                seed: Some(5),
                ..Default::default()
            },
            vocab,
        );
        (0..20_000)
            .map(|_| s.sample(&mut row.clone(), &[]).token as usize)
            .collect::<Vec<_>>()
    };
    for (path, drawn) in [("histogram", draw(0)), ("general", draw(vocab))] {
        assert!(
            drawn.iter().all(|t| nucleus.contains(t)),
            "{path}: outside the nucleus"
        );
        for &t in nucleus {
            let got = drawn.iter().filter(|&&d| d == t).count() as f64 / drawn.len() as f64;
            assert!(
                (got - w[t] / mass).abs() < 0.015,
                "{path}, token {t}: {got} vs {}",
                w[t] / mass
            );
        }
    }
}

/// A small top-k found in one pass holds exactly what sorting the finite logits (ties to the lower
/// id) and keeping k gives: with ties at the cut, NaN and infinities, rows shorter than k.
#[test]
fn a_small_top_k_is_the_sorted_rows_prefix() {
    let mut row: Vec<f32> = crate::testutil::data(2000, 9)
        .iter()
        .map(|x| (x * 8.0).round())
        .collect();
    row[3] = f32::NAN;
    row[700] = f32::INFINITY;
    row[701] = f32::NEG_INFINITY;
    for (len, k) in [
        (2000, 1),
        (2000, 5),
        (2000, 20),
        (2000, 64),
        (10, 20),
        (300, 64),
    ] {
        let row = &row[..len];
        let mut s = Sampler::new(SamplingParams::default(), len);
        s.top_k_into_cand(row, k);
        let mut want: Vec<(TokenId, f32)> = row
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as TokenId, v))
            .collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        want.truncate(k);
        assert_eq!(s.cand, want, "{len} logits, top {k}");
    }
}

/// The host's cost of a sampled token on a 49,152-logit row (SmolLM2's vocabulary), greedy, at
/// temperature 1, with top-p 0.9, and with Qwen's recommended top-k 20: printed, not asserted
/// (`cargo test -p thorn-engine --lib sampling_cost -- --nocapture`); what is asserted is that each
/// draw is a token of the row.
#[test]
fn sampling_cost_per_token() {
    let vocab = 49_152;
    let row: Vec<f32> = crate::testutil::data(vocab, 3)
        .iter()
        .map(|x| x * 4.0)
        .collect();
    for (name, temperature, top_p, top_k) in [
        ("greedy", 0.0, 1.0, 0),
        ("temperature 1", 1.0, 1.0, 0),
        ("top-p 0.9", 1.0, 0.9, 0),
        ("top-k 20, top-p 0.8, temperature 0.7", 0.7, 0.8, 20),
    ] {
        let params = SamplingParams {
            temperature,
            top_p,
            top_k,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, vocab);
        let mut l = row.clone();
        let n = 200;
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            l.copy_from_slice(&row);
            let t = s.sample(&mut l, &[]).token;
            assert!((t as usize) < vocab);
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / f64::from(n);
        println!("sampling, {name}: {us:.1} us a token");
    }
}

#[test]
fn temperature_sampling_follows_the_distribution() {
    let mut s = Sampler::new(
        SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        },
        6,
    );
    let n = 20_000;
    let mut hits = [0usize; 6];
    for _ in 0..n {
        hits[s.sample(&mut logits(), &[]).token as usize] += 1;
    }
    let z: f32 = logits().iter().map(|v| v.exp()).sum();
    for (i, &h) in hits.iter().enumerate() {
        let p = logits()[i].exp() / z;
        assert!(
            (h as f32 / n as f32 - p).abs() < 0.015,
            "token {i}: {} vs {p}",
            h as f32 / n as f32
        );
    }
}

/// A top-k pick from the row's best values (as a GPU finds them: any order, ties at the cut to the lower
/// id) is the pick from the row itself: the same token for the same seed, step after step, the same
/// log-probabilities; a sampler with bias, penalties, no top-k or too large a one does not draw so.
#[test]
fn a_pick_from_the_rows_top_values_is_the_rows_pick() {
    let vocab = 5000;
    let reduce = HostReduce::detect();
    for (k, top_p, min_p, t) in [
        (1, 1.0, 0.0, 0.7),
        (20, 0.8, 0.0, 0.7),
        (40, 1.0, 0.05, 1.3),
        (64, 0.95, 0.0, 1.0),
    ] {
        let params = SamplingParams {
            temperature: t,
            top_k: k,
            top_p,
            min_p,
            seed: Some(7),
            top_logprobs: k.min(5),
            ..Default::default()
        };
        let (mut a, mut b) = (
            Sampler::new(params.clone(), vocab),
            Sampler::new(params, vocab),
        );
        assert!(b.draws_from_top(64));
        for step in 0..50u64 {
            // Values with many equals (ties at the cut), and minus infinity (never a candidate).
            let mut row: Vec<f32> = crate::testutil::data(vocab, step)
                .iter()
                .map(|x| (x * 8.0).round() / 2.0)
                .collect();
            row[(step as usize * 13 + 1) % vocab] = f32::NEG_INFINITY;
            let want = a.pick(&row);
            let mut top: Vec<(TokenId, f32)> = row
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (i as TokenId, v))
                .collect();
            top.sort_by(|x, y| y.1.partial_cmp(&x.1).unwrap().then(x.0.cmp(&y.0)));
            top.truncate(64);
            top.reverse();
            let got = b.pick_from_top(top.into_iter(), reduce.logsumexp(&row));
            assert_eq!(got.token, want.token, "top-k {k}, step {step}");
            assert_eq!(got.logprob.to_bits(), want.logprob.to_bits(), "step {step}");
            assert_eq!(got.top, want.top, "top-k {k}, step {step}");
        }
    }
    let with = |p: SamplingParams| Sampler::new(p, vocab).draws_from_top(64);
    let base = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        ..Default::default()
    };
    assert!(with(base.clone()));
    assert!(!with(SamplingParams {
        logit_bias: vec![(3, 1.0)],
        ..base.clone()
    }));
    assert!(!with(SamplingParams {
        top_k: 0,
        ..base.clone()
    }));
    assert!(!with(SamplingParams {
        top_k: 65,
        ..base.clone()
    }));
    assert!(!with(SamplingParams {
        temperature: 0.0,
        ..base
    }));
}
