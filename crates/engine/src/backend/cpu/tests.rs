//! Every SIMD kernel against its scalar reference, on every ISA this machine has.

use super::qmatmul::{Layout, QActs, QMatrix, matmul_ref, quantize_ref};
use super::*;
use crate::backend::Buf;
use crate::kv::{Batch, KvCache, KvConfig, KvDtype, KvShape, KvSlice, SeqKv};
use crate::quant::GgmlType;

use crate::testutil::{data, fill_seq, quantize_rows};

#[test]
fn repacked_matrices_dequantize_like_the_reference() {
    for (ty, layout) in [
        (GgmlType::Q4_0, Layout::Nibble),
        (GgmlType::Q4_1, Layout::Nibble),
        (GgmlType::Q4_K, Layout::Nibble),
        (GgmlType::Q8_0, Layout::Byte),
        (GgmlType::Q6_K, Layout::F32),
        (GgmlType::F32, Layout::F32),
    ] {
        let (rows, cols) = (3, 768);
        let bytes = quantize_rows(ty, rows, cols, 7);
        let m = QMatrix::from_ggml(ty, rows, cols, &bytes).unwrap();
        assert_eq!(m.layout, layout, "{ty}");
        let rb = ty.row_bytes(cols).unwrap();
        for r in 0..rows {
            let mut want = vec![0f32; cols];
            crate::quant::dequantize_ref(ty, &bytes[r * rb..(r + 1) * rb], &mut want).unwrap();
            let mut got = vec![0f32; cols];
            m.dequantize_row(r, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // Q8_0 is stored offset by 128, so d*(q+128) - 128d rounds differently from d*q.
                let tol = if ty == GgmlType::Q8_0 {
                    1e-6 * (w.abs() + 1.0)
                } else {
                    0.0
                };
                assert!((g - w).abs() <= tol, "{ty} row {r} element {i}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn concatenated_matrices_hold_each_parts_rows() {
    // Whole groups are joined as they are; a part that ends inside a group makes the rest regroup.
    for (ty, parts) in [
        (GgmlType::Q4_1, vec![16, 32, 7]),
        (GgmlType::Q4_1, vec![33, 7, 20]),
        (GgmlType::Q8_0, vec![5, 16]),
        (GgmlType::Q4_K, vec![16, 3]),
    ] {
        let cols = 256;
        let ms: Vec<QMatrix> = parts
            .iter()
            .enumerate()
            .map(|(i, &rows)| {
                QMatrix::from_ggml(
                    ty,
                    rows,
                    cols,
                    &quantize_rows(ty, rows, cols, 20 + i as u64),
                )
                .unwrap()
            })
            .collect();
        let joined = QMatrix::concat(&ms).unwrap();
        assert_eq!(joined.rows, parts.iter().sum::<usize>(), "{ty} {parts:?}");
        let mut r0 = 0;
        for m in &ms {
            for r in 0..m.rows {
                let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
                m.dequantize_row(r, &mut want);
                joined.dequantize_row(r0 + r, &mut got);
                assert_eq!(want, got, "{ty} {parts:?} row {}", r0 + r);
            }
            r0 += m.rows;
        }
    }
}

#[test]
fn simd_quantize_is_bit_exact() {
    for isa in Isa::available() {
        for (n, cols) in [(1, 576), (5, 1536), (3, 64)] {
            let x = data(n * cols, n as u64);
            let (mut a, mut b) = (QActs::default(), QActs::default());
            quantize_ref(&x, n, cols, &mut a);
            simd::quantize(isa, &x, n, cols, &mut b);
            assert_eq!(
                (a.q, a.d, a.s, a.sum),
                (b.q, b.d, b.s, b.sum),
                "{isa:?} n={n} cols={cols}"
            );
        }
    }
}

#[test]
fn simd_matmul_matches_reference() {
    for isa in Isa::available() {
        let cpu = Cpu::with_isa(2, isa);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q4_K,
            GgmlType::Q8_0,
            GgmlType::F32,
        ] {
            // 33 rows (two whole groups of 16 and one row of a third), 1 to 13 tokens (every tile width and
            // remainder: 4 + 1, 8 + 5, and the tiles that take several groups at once), and for Q8_0 an odd
            // number of blocks.
            let cols = if ty == GgmlType::Q4_K {
                512
            } else if ty == GgmlType::Q8_0 {
                608
            } else {
                576
            };
            let rows = 33;
            let w = QMatrix::from_ggml(ty, rows, cols, &quantize_rows(ty, rows, cols, 3)).unwrap();
            let all = data(13 * cols, 11);
            let mut first: Option<Vec<f32>> = None;
            for n in [13, 1, 2, 3, 5, 6, 7, 8] {
                let x = &all[..n * cols];
                let mut qa = QActs::default();
                cpu.quantize(x, n, cols, &mut qa);
                let mut want = vec![0f32; n * rows];
                matmul_ref(&w, &qa, x, 0..rows, &mut want);
                let mut got = vec![0f32; n * rows];
                cpu.matmul(&w, &qa, x, &mut got);
                // A token's result does not depend on how many tokens share the call (bit for bit).
                let full = first.get_or_insert_with(|| got.clone());
                assert!(
                    got[..] == full[..n * rows],
                    "{isa:?} {ty} n={n}: batch-dependent result"
                );
                if ty != GgmlType::F32 {
                    // The quantized kernels make the reference's exact integer block sums and its two
                    // fused multiply-adds per block: every ISA gives the reference's bits.
                    for (i, (g, v)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            g.to_bits() == v.to_bits(),
                            "{isa:?} {ty} n={n} out {i}: {g} vs {v}"
                        );
                    }
                    continue;
                }
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
                for (i, (g, v)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - v).abs() <= 2e-5 * scale,
                        "{isa:?} {ty} n={n} out {i}: {g} vs {v}"
                    );
                }
            }
        }
    }
}

#[test]
fn quantized_matmul_tracks_the_float_product() {
    // The 8-bit activation path stays close to the exact f32 product (this bounds the approximation).
    let (rows, cols) = (16, 576);
    let bytes = quantize_rows(GgmlType::Q4_1, rows, cols, 5);
    let w = QMatrix::from_ggml(GgmlType::Q4_1, rows, cols, &bytes).unwrap();
    let x = data(cols, 9);
    let mut qa = QActs::default();
    quantize_ref(&x, 1, cols, &mut qa);
    let mut got = vec![0f32; rows];
    matmul_ref(&w, &qa, &x, 0..rows, &mut got);
    let rb = GgmlType::Q4_1.row_bytes(cols).unwrap();
    for r in 0..rows {
        let exact =
            crate::quant::dot_ref(GgmlType::Q4_1, &bytes[r * rb..(r + 1) * rb], &x).unwrap();
        let norm: f32 = x.iter().map(|v| v.abs()).sum::<f32>() * 0.2;
        assert!(
            (got[r] - exact).abs() < 0.01 * norm,
            "row {r}: {} vs {exact}",
            got[r]
        );
    }
}

#[test]
fn simd_attention_matches_reference() {
    // Groups of 3, 4 and 5 query heads per KV head (odd ones leave a row of the kernel's pairs alone);
    // every head width the AVX-512 kernel has, and one it has not.
    for (heads, kv_heads, hd) in [
        (6, 2, 64),
        (8, 2, 64),
        (10, 2, 64),
        (6, 2, 128),
        (6, 2, 32),
        (6, 2, 48),
    ] {
        attention_case(heads, kv_heads, hd);
    }
}

fn attention_case(heads: usize, kv_heads: usize, hd: usize) {
    let shape = KvShape {
        n_layers: 1,
        n_kv_heads: kv_heads,
        head_dim: hd,
        recurrent: 0,
    };
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8] {
        for page_size in [32, 7, 64] {
            let mut kv = KvCache::new(
                shape,
                KvConfig {
                    dtype,
                    page_size,
                    memory: 1 << 22,
                    cache_output: false,
                    ..KvConfig::default()
                },
            );
            // Two sequences in one batch: a 3-token prefill chunk after 300 cached positions, and a decode
            // step at position 137 (so a batch mixes lengths, pages and the split/unsplit paths).
            let lens = [(300usize, 3usize), (137, 1)];
            let seqs: Vec<SeqKv> = lens
                .iter()
                .enumerate()
                .map(|(i, &(prev, new))| fill_seq(&mut kv, prev + new, prev, 100 * i as u64))
                .collect();
            let mut batch = Batch::default();
            for (s, &(_, new)) in seqs.iter().zip(&lens) {
                batch.push(s, &vec![0; new], crate::kv::Logits::Last);
            }
            let n = batch.len();
            let q = data(n * heads * hd, 77);
            for kernels in simd::AttnKernels::available() {
                let isa = kernels.isa;
                // bf16 products round the query, the keys and values (the reference gets them rounded
                // too: a score's error grows with its size, and the data's outliers make scores of ~50)
                // and the weights (a few thousandths of an output, where a wrong layout moves it by its
                // whole size). f32 pages, and head widths the bf16 kernels do not have, take the f32
                // kernels whatever is asked.
                let bf16 = kernels.bf16 && dtype != KvDtype::F32 && matches!(hd, 32 | 64 | 128);
                let tol = if bf16 { 1e-2 } else { 1e-4 };
                let bf = |x: &[f32]| -> Vec<f32> {
                    if bf16 {
                        x.iter()
                            .map(|&v| half::bf16::from_f32(v).to_f32())
                            .collect()
                    } else {
                        x.to_vec()
                    }
                };
                for threads in [1, 2] {
                    let cpu = Cpu::with_isa(threads, isa);
                    assert_eq!(cpu.set_bf16_attention(kernels.bf16), kernels.bf16);
                    let mut got = vec![0f32; n * heads * hd];
                    cpu.attention(
                        kv.pool(),
                        0,
                        &batch,
                        &q,
                        heads * hd,
                        heads,
                        kv_heads,
                        hd,
                        &mut got,
                        &mut Vec::new(),
                        &mut Vec::new(),
                    );
                    for t in 0..n {
                        let (span, pos) = batch.locate(t);
                        let pages = batch.pages(span);
                        let npos = pos + 1;
                        for h in 0..heads {
                            let kvh = h / (heads / kv_heads);
                            // The reference reads the same pages row by row into contiguous memory.
                            let gather = |keys: bool| -> Vec<f32> {
                                (0..npos)
                                    .flat_map(|p| {
                                        let page = pages[p / page_size];
                                        let s = if keys {
                                            kv.pool().keys(page, 0, kvh)
                                        } else {
                                            kv.pool().values(page, 0, kvh)
                                        };
                                        s.row(p % page_size, hd)
                                    })
                                    .collect()
                            };
                            let (kk, vv) = (bf(&gather(true)), bf(&gather(false)));
                            let i = t * heads + h;
                            let mut want = vec![0f32; hd];
                            ops::attention_ref(
                                &bf(&q[i * hd..(i + 1) * hd]),
                                KvSlice::F32(&kk),
                                KvSlice::F32(&vv),
                                npos,
                                1.0 / (hd as f32).sqrt(),
                                &mut want,
                            );
                            for (d, (g, w)) in
                                got[i * hd..(i + 1) * hd].iter().zip(&want).enumerate()
                            {
                                assert!(
                                    (g - w).abs() < tol * (1.0 + w.abs()),
                                    "{kernels:?} {dtype:?} group {}, pages of {page_size}, {threads} threads, \
                                     t={t} h={h} d={d}: {g} vs {w}",
                                    heads / kv_heads
                                );
                            }
                        }
                    }
                }
            }
            for s in seqs {
                kv.release(s, None);
            }
        }
    }
}

#[test]
fn rope_rotates_adjacent_pairs() {
    let mut x = vec![1.0, 0.0, 0.0, 1.0];
    ops::rope_ref(&mut x, 4, 1, 10000.0);
    // Pair 0 rotates by 1 rad, pair 1 by 1/100 rad.
    assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
    assert!((x[2] + 0.01f32.sin()).abs() < 1e-6 && (x[3] - 0.01f32.cos()).abs() < 1e-6);
    let mut y = vec![0.3, -0.7];
    ops::rope_ref(&mut y, 2, 0, 10000.0);
    assert_eq!(y, vec![0.3, -0.7]);
}

#[test]
fn rope_table_equals_rope_ref() {
    let x = data(9 * 64, 3);
    for pos in [0, 1, 17, 4095] {
        let (mut a, mut b) = (x.clone(), x.clone());
        ops::rope_ref(&mut a, 64, pos, 100000.0);
        let mut t = Vec::new();
        ops::rope_angles(64, pos, 100000.0, &mut t);
        ops::rope_table(&mut b, 64, &t);
        assert_eq!(a, b, "pos {pos}");
    }
}

#[test]
fn simd_reductions_match_reference() {
    for isa in Isa::available() {
        for n in [0usize, 1, 7, 8, 9, 100, 49152] {
            let mut x = data(n, n as u64 + 3);
            x.iter_mut().for_each(|v| *v *= 20.0);
            if n > 50 {
                // Ties resolve to the first, and -inf entries (masked logits) are ignored by the sum.
                x[40] = 1e3;
                x[n - 1] = 1e3;
                x[10] = f32::NEG_INFINITY;
            }
            assert_eq!(simd::argmax(isa, &x), ops::argmax(&x), "{isa:?} n={n}");
            let (a, b) = (simd::logsumexp(isa, &x), ops::logsumexp_ref(&x));
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0) || (a == b),
                "{isa:?} n={n}: {a} vs {b}"
            );
        }
        let masked = [f32::NEG_INFINITY; 12];
        assert_eq!(simd::logsumexp(isa, &masked), f32::NEG_INFINITY);
    }
}

/// A tile of a prefill chunk's tokens gets, token by token, the bits `attend_group` gives each token alone
/// (what makes a prompt's result independent of how it was chunked and batched): every KV type, groups of
/// 1, 3 and 5 heads, 32-, 64- and 128-wide heads (each width the AVX-512 kernel has) and 40-wide ones
/// (scalar tails), tokens that see none, part or all of the block.
#[test]
fn a_tile_of_tokens_attends_bit_for_bit_like_each_alone() {
    let rows = 150;
    for hd in [64, 32, 128, 40] {
        let kf = data(rows * hd, 5);
        let vf = data(rows * hd, 6);
        let kh: Vec<half::f16> = kf.iter().map(|&x| half::f16::from_f32(x)).collect();
        let vh: Vec<half::f16> = vf.iter().map(|&x| half::f16::from_f32(x)).collect();
        let k8: Vec<u8> = kf
            .iter()
            .map(|&x| crate::backend::fp8::e4m3_encode(x * 200.0))
            .collect();
        let v8: Vec<u8> = vf
            .iter()
            .map(|&x| crate::backend::fp8::e4m3_encode(x * 200.0))
            .collect();
        let kinds = [
            (KvSlice::F32(&kf), KvSlice::F32(&vf)),
            (KvSlice::F16(&kh), KvSlice::F16(&vh)),
            (
                KvSlice::Fp8 {
                    data: &k8,
                    scale: 0.005,
                },
                KvSlice::Fp8 {
                    data: &v8,
                    scale: 0.005,
                },
            ),
        ];
        for (keys, values) in kinds {
            for g in [1, 3, 5] {
                // Eight consecutive tokens from position 100 on, attending from position 3: ends 101..=108
                // (blocks of 64 from 3: the last block is partial for each); and a tile whose first tokens
                // see nothing past `start`.
                for (start, first_end) in [(3, 101), (60, 58)] {
                    let ends: Vec<usize> = (0..simd::MAX_TILE).map(|i| first_end + i).collect();
                    let qs: Vec<Vec<f32>> = (0..ends.len())
                        .map(|i| data(g * hd, 40 + i as u64))
                        .collect();
                    let fresh = || -> Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> {
                        (0..ends.len())
                            .map(|_| (vec![f32::NEG_INFINITY; g], vec![0.0; g], vec![0.0; g * hd]))
                            .collect()
                    };
                    for isa in simd::AttnKernels::available() {
                        let mut alone = fresh();
                        for ((q, &end), (m, l, o)) in qs.iter().zip(&ends).zip(&mut alone) {
                            if end > start {
                                let part = simd::PartialAttn { m, l, o };
                                simd::attend_group(isa, q, hd, keys, values, start..end, 0.1, part);
                            }
                        }
                        let mut tiled = fresh();
                        let mut parts: Vec<simd::PartialAttn<'_>> = tiled
                            .iter_mut()
                            .map(|(m, l, o)| simd::PartialAttn { m, l, o })
                            .collect();
                        let qr: Vec<&[f32]> = qs.iter().map(Vec::as_slice).collect();
                        simd::attend_tile(
                            isa, &qr, hd, keys, values, start, &ends, 0.1, &mut parts,
                        );
                        drop(parts);
                        let bits = |v: &[(Vec<f32>, Vec<f32>, Vec<f32>)]| -> Vec<u32> {
                            v.iter()
                                .flat_map(|(m, l, o)| {
                                    m.iter().chain(l).chain(o).map(|x| x.to_bits())
                                })
                                .collect()
                        };
                        assert_eq!(
                            bits(&tiled),
                            bits(&alone),
                            "{isa:?} hd {hd} group {g} from {start}, {:?}",
                            std::mem::discriminant(&keys)
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn dot4_is_four_dots_bit_for_bit() {
    for isa in Isa::available() {
        // Every length class: full 32-blocks, 8-lane tails and scalar tails.
        for n in [0, 1, 7, 8, 31, 32, 45, 64, 77, 576] {
            let a = data(n, 1);
            let b: Vec<Vec<f32>> = (0..4).map(|k| data(n, 10 + k)).collect();
            let got = simd::dot4_f32(isa, &a, [&b[0], &b[1], &b[2], &b[3]]);
            for (k, bk) in b.iter().enumerate() {
                assert_eq!(
                    got[k].to_bits(),
                    simd::dot_f32(isa, &a, bk).to_bits(),
                    "{isa:?} n={n} k={k}"
                );
            }
        }
    }
}

#[test]
fn element_wise_kernels_equal_their_references() {
    for n in [1usize, 7, 8, 9, 64, 576, 1000] {
        let x = data(n, n as u64);
        let w = data(n, 1000 + n as u64);
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        simd::rmsnorm(&x, &w, 1e-5, &mut a);
        ops::rmsnorm_ref(&x, &w, 1e-5, &mut b);
        // The lanes reorder an f64 sum of exact squares: equal unless a rounding boundary sits in between.
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() <= q.abs() * 2e-7, "rmsnorm {n}: {p} vs {q}");
        }
        simd::silu_mul(&x, &w, &mut a);
        ops::silu_mul_ref(&x, &w, &mut b);
        assert_eq!(a, b, "silu_mul {n}");
        let (mut s1, mut s2) = (x.clone(), x.clone());
        simd::add(&mut s1, &w);
        ops::add_ref(&mut s2, &w);
        assert_eq!(s1, s2, "add {n}");
    }
}

#[test]
fn neox_rope_rotates_halves_and_leaves_the_rest() {
    let mut head: Vec<f32> = (0..8).map(|i| i as f32).collect();
    // Partial: pairs (0, 2) and (1, 3) rotate by 90 and 180 degrees; dims 4.. stay.
    ops::rope_neox(&mut head, &[(0.0, 1.0), (-1.0, 0.0)]);
    assert_eq!(head, vec![-2.0, -1.0, 0.0, -3.0, 4.0, 5.0, 6.0, 7.0]);
}

#[test]
fn device_matmul_quantizes_inside_exactly_like_the_kernel_calls() {
    use crate::backend::{Device, Workspace};
    let (rows, cols, n) = (40, 256, 3);
    let bytes = quantize_rows(GgmlType::Q4_1, rows, cols, 11);
    let x = data(n * cols, 12);
    // The kernels called by hand: quantize the activations, then the quantized product.
    let cpu = Cpu::new(2);
    let w = QMatrix::from_ggml(GgmlType::Q4_1, rows, cols, &bytes).unwrap();
    let mut qa = QActs::default();
    cpu.quantize(&x, n, cols, &mut qa);
    let mut want = vec![0f32; n * rows];
    cpu.matmul(&w, &qa, &x, &mut want);
    // The device API: the weights in its layout, the quantization inside `input`.
    let dev = Device::cpu(2);
    let m = dev.matrix(GgmlType::Q4_1, rows, cols, &bytes).unwrap();
    let mut ws = Workspace::default();
    let mut got = Buf::default();
    let input = dev.input(&x, n, cols, &mut ws);
    dev.matmul(&m, &input, &mut got);
    assert_eq!(got.read_back(n * rows), &want[..]);
}

#[test]
fn isa_names_cap_the_dispatch_to_what_the_cpu_has() {
    let available = Isa::available();
    assert_eq!(available.last(), Some(&Isa::Scalar));
    // This architecture's base SIMD is always there: aarch64 always has NEON.
    #[cfg(target_arch = "aarch64")]
    assert!(available.contains(&Isa::Neon), "{available:?}");
    for (k, &isa) in available.iter().enumerate() {
        // A cap names an ISA; the best available one at or below it is taken.
        assert_eq!(Isa::capped(Some(isa.name())), isa);
        assert!(isa.supported());
        assert!(available[k + 1..].iter().all(|&lower| lower != isa));
    }
    assert_eq!(Isa::capped(None), available[0]);
    assert_eq!(Isa::capped(Some("no-such-isa")), available[0]);
    // An ISA this CPU lacks (the other architecture's) is refused, and a backend asked for it runs scalar.
    for isa in Isa::ALL.into_iter().filter(|i| !available.contains(i)) {
        assert!(!isa.supported(), "{isa:?}");
        assert_eq!(Isa::capped(Some(isa.name())), available[0]);
        assert_eq!(Cpu::with_isa(1, isa).isa(), Isa::Scalar);
    }
}

/// What run-time detection picks on this CPU under `THORN_ISA`'s cap. `scripts/test-aarch64` runs this test
/// on several emulated CPUs with `THORN_EXPECT_ISA` naming the ISA each must get (Cortex-A72: `neon`,
/// Neoverse N1: `neon-dotprod`, qemu's max: `neon-i8mm`, ...); anywhere, the pick is the best one the
/// CPU has at or below the cap.
#[test]
fn detection_picks_the_best_isa_the_cap_allows() {
    let got = Isa::detect();
    assert!(got.supported(), "{got:?}");
    let cap = std::env::var("THORN_ISA").ok();
    let available = Isa::available();
    if cap.is_none() {
        assert_eq!(got, available[0]);
    }
    if let Ok(want) = std::env::var("THORN_EXPECT_ISA") {
        assert_eq!(
            got.name(),
            want,
            "THORN_ISA={cap:?} on a CPU with {available:?}"
        );
    }
}
