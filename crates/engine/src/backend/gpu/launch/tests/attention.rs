//! The KV writes and paged attention against the CPU backend, on every device.

use super::*;
use crate::backend::batch::NO_PARENT;
use crate::backend::pages::{KvSlice, PageId, PagePool, RowMove};
use crate::kv::{Batch, KvCache, KvConfig, Logits, SeqKv};
use crate::testutil::fill_seq;

/// A page pool's contents as the device stores them (see [`KvStore`]).
struct DevPool<'d> {
    k: Mem<'d>,
    v: Mem<'d>,
    ks: Mem<'d>,
    vs: Mem<'d>,
}

impl<'d> DevPool<'d> {
    fn upload(d: &'d dyn TestDev, pool: &PagePool) -> Self {
        let s = pool.shape();
        let (mut k, mut v, mut ks, mut vs) = (vec![], vec![], vec![], vec![]);
        for page in 0..pool.total() as u32 {
            for layer in 0..s.n_layers {
                for h in 0..s.n_kv_heads {
                    for (bytes, scales, slice) in [
                        (&mut k, &mut ks, pool.keys(page, layer, h)),
                        (&mut v, &mut vs, pool.values(page, layer, h)),
                    ] {
                        match slice {
                            KvSlice::F32(d) => bytes.extend(d.iter().flat_map(|x| x.to_le_bytes())),
                            KvSlice::F16(d) => bytes.extend(d.iter().flat_map(|x| x.to_le_bytes())),
                            KvSlice::Fp8 { data, scale } => {
                                bytes.extend_from_slice(data);
                                scales.push(scale);
                            }
                        }
                    }
                }
            }
        }
        let scales = |v: &[f32]| Mem::from_f32(d, if v.is_empty() { &[0.0] } else { v });
        DevPool {
            k: Mem::from_bytes(d, &k),
            v: Mem::from_bytes(d, &v),
            ks: scales(&ks),
            vs: scales(&vs),
        }
    }

    fn store(&self, pool: &PagePool) -> KvStore {
        KvStore {
            k: self.k.ptr(),
            v: self.v.ptr(),
            kscale: self.ks.ptr(),
            vscale: self.vs.ptr(),
            dtype: pool.dtype(),
            shape: pool.shape(),
            page_size: pool.page_size(),
        }
    }
}

/// A batch's metadata in "device" memory.
struct DevMeta<'d> {
    _bufs: Vec<Mem<'d>>,
    b: DevBatch,
}

fn upload_batch<'d>(d: &'d dyn TestDev, batch: &Batch, page_size: usize) -> DevMeta<'d> {
    upload_batch_cut(d, batch, page_size, 4)
}

/// [`upload_batch`] with at most `split_cap` attention splits a token.
fn upload_batch_cut<'d>(
    d: &'d dyn TestDev,
    batch: &Batch,
    page_size: usize,
    split_cap: usize,
) -> DevMeta<'d> {
    let mut m = BatchMeta::default();
    m.build(batch, page_size, split_cap).unwrap();
    let ints = |v: &[i32]| {
        let v = if v.is_empty() { &[0][..] } else { v };
        Mem::from_bytes(
            d,
            &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
        )
    };
    let bufs = vec![
        ints(&m.table),
        ints(&m.meta),
        ints(&m.seen),
        ints(&m.dst),
        ints(&m.seqs),
    ];
    let b = m.on_device(std::array::from_fn(|i| bufs[i].ptr()));
    DevMeta { _bufs: bufs, b }
}

fn cache(shape: KvShape, dtype: KvDtype, page_size: usize) -> KvCache {
    KvCache::new(
        shape,
        KvConfig {
            dtype,
            page_size,
            memory: 1 << 22,
            cache_output: false,
            ..KvConfig::default()
        },
    )
}

#[test]
fn kv_rows_are_written_like_the_page_pool_writes_them() {
    on_every_device(kv_rows_are_written_like_the_page_pool_writes_them_on);
}

fn kv_rows_are_written_like_the_page_pool_writes_them_on(d: &dyn TestDev) {
    let shape = KvShape {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 64,
        recurrent: 0,
    };
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8] {
        let mut kv = cache(shape, dtype, 7);
        // Two sequences of new rows across several pages; the rows grow, so FP8 pages rescale.
        let lens = [(5usize, 12usize), (0, 9)];
        let mut batch = Batch::default();
        // (Layer 0 is filled; layer 1 is written here.)
        let seqs: Vec<SeqKv> = lens
            .iter()
            .map(|&(prev, new)| fill_seq(&mut kv, prev + new, prev, 3))
            .collect();
        for (s, &(_, new)) in seqs.iter().zip(&lens) {
            batch.push(s, &vec![0; new], Logits::Last);
        }
        let dev = DevPool::upload(d, kv.pool());
        let w = shape.n_kv_heads * shape.head_dim;
        // The first token's rows start with FP8's edge cases at a page scale of 1 (their largest is 448):
        // ties to even among normals and subnormals, the largest value and what rounds to it, zeros of
        // both signs, a value that rounds to zero (the hardware conversion on sm_89 and later must agree).
        const EDGES: [f32; 12] = [
            448.0,
            -432.0,
            0.0,
            -0.0,
            1.0625,
            -1.1875,
            0.75 / 512.0,
            -1.5 / 512.0,
            0.5 / 512.0,
            0.2 / 512.0,
            17.0,
            1.0 / 64.0,
        ];
        let grow = |t: usize, seed| -> Vec<f32> {
            let mut r: Vec<f32> = data(w, seed).iter().map(|x| x * (1.0 + t as f32)).collect();
            if t == 0 {
                r[..EDGES.len()].copy_from_slice(&EDGES);
            }
            r
        };
        let (k, v): (Vec<f32>, Vec<f32>) = (
            (0..batch.len())
                .flat_map(|t| grow(t, 40 + t as u64))
                .collect(),
            (0..batch.len())
                .flat_map(|t| grow(t, 90 + t as u64))
                .collect(),
        );
        let meta = upload_batch(d, &batch, 7);
        // Fused rows [k | v | 8 more], as a QKV projection leaves them.
        let stride = 2 * w + 8;
        let rows: Vec<f32> = (0..batch.len())
            .flat_map(|t| {
                let mut r = k[t * w..(t + 1) * w].to_vec();
                r.extend_from_slice(&v[t * w..(t + 1) * w]);
                r.extend([0.0; 8]);
                r
            })
            .collect();
        let rm = Mem::from_f32(d, &rows);
        let store = dev.store(kv.pool());
        write_kv(
            d,
            &store,
            &meta.b,
            1,
            rm.ptr(),
            rm.ptr().offset(4 * w),
            stride,
        )
        .unwrap();
        for t in 0..batch.len() {
            let (span, slot) = batch.locate(t);
            let page = batch.pages(span)[slot / 7];
            kv.pool_mut().write(
                page,
                slot % 7,
                1,
                &k[t * w..(t + 1) * w],
                &v[t * w..(t + 1) * w],
            );
        }
        let want = DevPool::upload(d, kv.pool());
        assert!(dev.k.bytes() == want.k.bytes(), "{dtype:?}: keys differ");
        assert!(dev.v.bytes() == want.v.bytes(), "{dtype:?}: values differ");
        assert_eq!(dev.ks.f32s(), want.ks.f32s(), "{dtype:?}: key scales");
        assert_eq!(dev.vs.f32s(), want.vs.f32s(), "{dtype:?}: value scales");
        for s in seqs {
            kv.release(s, None);
        }
    }
}

/// The pool's copies as kernels: copy-on-write of a partial page, and row moves within a page, across
/// pages (FP8: into a page whose scale the row does not fit) and several in a row; the bytes and scales
/// equal the CPU pool's after the same copies.
#[test]
fn page_copies_and_row_moves_are_the_page_pools() {
    on_every_device(page_copies_and_row_moves_are_the_page_pools_on);
}

fn page_copies_and_row_moves_are_the_page_pools_on(d: &dyn TestDev) {
    let shape = KvShape {
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 64,
        recurrent: 0,
    };
    let (ps, w) = (7, shape.n_kv_heads * shape.head_dim);
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8] {
        let mut kv = cache(shape, dtype, ps);
        let pool = kv.pool_mut();
        let pages: Vec<PageId> = (0..4).map(|_| pool.alloc().unwrap()).collect();
        // Rows grow with their page, so a row moved to an earlier page raises its FP8 scale.
        for (i, &page) in pages.iter().enumerate() {
            for slot in 0..ps {
                for layer in 0..shape.n_layers {
                    let seed = (100 * i + 10 * slot + layer) as u64;
                    let f = (1 + 3 * i) as f32;
                    let k: Vec<f32> = data(w, seed).iter().map(|x| x * f).collect();
                    let v: Vec<f32> = data(w, seed + 7).iter().map(|x| x * f).collect();
                    pool.write(page, slot, layer, &k, &v);
                }
            }
        }
        let dev = DevPool::upload(d, pool);
        let store = dev.store(pool);
        copy_page(d, &store, pages[1], pages[0], 5).unwrap();
        pool.copy(pages[1], pages[0], 5);
        let moves: [RowMove; 4] = [
            [pages[0], 6, pages[0], 5],
            [pages[3], 2, pages[0], 6],
            [pages[3], 4, pages[2], 0],
            [pages[2], 3, pages[2], 1],
        ];
        let staged = Mem::from_bytes(d, bytemuck::cast_slice(&moves));
        move_rows(d, &store, staged.ptr(), moves.len()).unwrap();
        pool.move_rows(&moves);
        let want = DevPool::upload(d, pool);
        assert!(dev.k.bytes() == want.k.bytes(), "{dtype:?}: keys differ");
        assert!(dev.v.bytes() == want.v.bytes(), "{dtype:?}: values differ");
        assert_eq!(dev.ks.f32s(), want.ks.f32s(), "{dtype:?}: key scales");
        assert_eq!(dev.vs.f32s(), want.vs.f32s(), "{dtype:?}: value scales");
    }
}

/// `λ` of the probabilistic rounding-error bounds below: a sum of `n` rounded terms is off by at most
/// `λ √n u` of its terms' magnitudes except with probability `2 exp(-λ²/2)` (Higham and Mary, "A new
/// approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019): at `λ = 8`,
/// 2.5e-14 per element. The test's data are fixed, so a run is deterministic either way.
const LAMBDA: f64 = 8.0;

/// Attention computed in f64 from the pool's stored rows (as f32, the kernels' loads): for each token and
/// head, every position it sees (through [`Batch::slot_seen`], so a tree node sees its ancestors), an exact
/// two-pass softmax. The oracle the f32 kernels are measured against, with each element's rounding-error
/// bound for an f32 attention in any summation order (unit roundoff `u`): score `j`, a sum of `hd`
/// products, is off by `e_j = λ √hd u A_j` (`A_j = scale Σ |q k_j|`), which moves weight `w_j` by a factor
/// `e_j + Σ_i w_i e_i`; the softmax sum, the rescalings of the online softmax and the weighted sum of `n`
/// values add `λ (2 √n + 8) u`; so output `d` is off by at most
/// `Σ_j w_j |v_jd| (e_j + Σ_i w_i e_i + λ (2 √n + 8) u)`.
fn attention_f64(
    pool: &PagePool,
    batch: &Batch,
    q: &[f32],
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> (Vec<f64>, Vec<f64>) {
    let ps = pool.page_size();
    let scale = 1.0 / (hd as f64).sqrt();
    let u = f64::from(f32::EPSILON) / 2.0;
    let mut out = vec![0f64; batch.len() * heads * hd];
    let mut bound = vec![0f64; batch.len() * heads * hd];
    for t in 0..batch.len() {
        let (span, _) = batch.locate(t);
        let pages = batch.pages(span);
        let seen: Vec<usize> = (batch.attend_from..=batch.position(t))
            .map(|p| batch.slot_seen(t, p))
            .collect();
        let n = seen.len() as f64;
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let qi = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            let row = |keys: bool, slot: usize| {
                let page = pages[slot / ps];
                let s = if keys {
                    pool.keys(page, 0, kvh)
                } else {
                    pool.values(page, 0, kvh)
                };
                s.row(slot % ps, hd)
            };
            let (mut scores, mut errs) = (Vec::with_capacity(seen.len()), Vec::new());
            for &slot in &seen {
                let k = row(true, slot);
                let (mut dot, mut abs) = (0f64, 0f64);
                for (&a, &b) in qi.iter().zip(&k) {
                    dot += f64::from(a) * f64::from(b);
                    abs += (f64::from(a) * f64::from(b)).abs();
                }
                scores.push(dot * scale);
                errs.push(LAMBDA * (hd as f64).sqrt() * u * abs * scale);
            }
            let m = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
            let e: Vec<f64> = scores.iter().map(|&s| (s - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            let mean_err: f64 = e.iter().zip(&errs).map(|(w, d)| w / sum * d).sum();
            let sums = LAMBDA * (2.0 * n.sqrt() + 8.0) * u;
            let at = (t * heads + h) * hd;
            let (o, bd) = (&mut out[at..at + hd], &mut bound[at..at + hd]);
            for ((&slot, w), d) in seen.iter().zip(&e).zip(&errs) {
                let w = w / sum;
                for ((o, b), v) in o.iter_mut().zip(bd.iter_mut()).zip(row(false, slot)) {
                    let v = f64::from(v);
                    *o += w * v;
                    *b += w * v.abs() * (d + mean_err + sums);
                }
            }
        }
    }
    (out, bound)
}

/// GPU attention and the CPU backend's on the same pool and batch, each against the exact attention:
/// chunks, decode, and a draft tree whose nodes are not all in place.
fn attention_case(d: &dyn TestDev, heads: usize, kv_heads: usize, hd: usize) {
    let shape = KvShape {
        n_layers: 1,
        n_kv_heads: kv_heads,
        head_dim: hd,
        recurrent: 0,
    };
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Fp8] {
        for page_size in [32, 7] {
            let mut kv = cache(shape, dtype, page_size);
            let lens = [(300usize, 3usize), (137, 1), (40, 5)];
            let seqs: Vec<SeqKv> = lens
                .iter()
                .enumerate()
                .map(|(i, &(prev, new))| fill_seq(&mut kv, prev + new, prev, 100 * i as u64))
                .collect();
            let mut batch = Batch::default();
            batch.push(&seqs[0], &[0; 3], Logits::All);
            batch.push(&seqs[1], &[0], Logits::Last);
            // Node 2's parent is 0, so it and its child 4 see ancestors stored away from their positions.
            batch.push_tree(&seqs[2], &[0; 5], &[NO_PARENT, 0, 0, 1, 2], Logits::All);
            let n = batch.len();
            let q = data(n * heads * hd, 77);
            // The CPU backend on every ISA this machine has (scalar, AVX2, AVX-512).
            let cpu: Vec<(Isa, Vec<f32>)> = Isa::available()
                .into_iter()
                .map(|isa| {
                    let mut want = vec![0f32; n * heads * hd];
                    crate::backend::cpu::Cpu::with_isa(1, isa).attention(
                        kv.pool(),
                        0,
                        &batch,
                        &q,
                        heads * hd,
                        heads,
                        kv_heads,
                        hd,
                        &mut want,
                        &mut Vec::new(),
                        &mut Vec::new(),
                    );
                    (isa, want)
                })
                .collect();
            let dev = DevPool::upload(d, kv.pool());
            // The queries inside wider rows (a fused QKV row's Q part).
            let q_stride = heads * hd + 2 * kv_heads * hd;
            let qrows: Vec<f32> = (0..n)
                .flat_map(|t| {
                    let mut r = q[t * heads * hd..(t + 1) * heads * hd].to_vec();
                    r.resize(q_stride, 7.0);
                    r
                })
                .collect();
            let qm = Mem::from_f32(d, &qrows);
            let store = dev.store(kv.pool());
            let qp = qm.ptr();
            let items = n * kv_heads;
            let (exact, bound) = attention_f64(kv.pool(), &batch, &q, heads, kv_heads, hd);
            // Up to 300 positions: one split of up to 5 tiles, 2 or 3 splits of several tiles, a split a
            // tile.
            for cap in [1, 2, 3, 64] {
                let meta = upload_batch_cut(d, &batch, page_size, cap);
                let out = Mem::zeroed(d, 4 * n * heads * hd);
                let parts = Mem::zeroed(
                    d,
                    4 * meta.b.partial_floats(kv_heads, heads / kv_heads, hd).max(1),
                );
                let (o, pp) = (out.ptr(), parts.ptr());
                attention(d, &store, &meta.b, 0, qp, q_stride, heads, o, pp, None).unwrap();
                // Folded by each item's last block in the same launch: the same bits, and the counters
                // left at zero for the next launch.
                let (fused, counters) = (
                    Mem::zeroed(d, 4 * n * heads * hd),
                    Mem::zeroed(d, attention_counters(n, kv_heads)),
                );
                let (fo, cp) = (fused.ptr(), counters.ptr());
                for _ in 0..2 {
                    attention(d, &store, &meta.b, 0, qp, q_stride, heads, fo, pp, Some(cp))
                        .unwrap();
                    assert_eq!(fused.bytes(), out.bytes(), "folded in the attention launch");
                    assert_eq!(
                        counters.bytes(),
                        vec![0; 4 * items],
                        "counters left at zero"
                    );
                }
                // A grid of one row (a large batch's): each block runs its token's splits in order, the
                // same bits.
                let one = DevBatch {
                    splits: 1,
                    ..meta.b
                };
                let serial = Mem::zeroed(d, 4 * n * heads * hd);
                attention(
                    d,
                    &store,
                    &one,
                    0,
                    qp,
                    q_stride,
                    heads,
                    serial.ptr(),
                    pp,
                    None,
                )
                .unwrap();
                assert_eq!(
                    serial.bytes(),
                    out.bytes(),
                    "split cap {cap}: one block per item"
                );
                let what = format!(
                    "{dtype:?}, pages of {page_size}, {heads}/{kv_heads} heads of {hd}, {cap} splits"
                );
                // Within each element's rounding-error bound (see below).
                close(&out.f32s(), &exact, &bound, 1.0, &format!("device, {what}"));
            }
            let what = format!("{dtype:?}, pages of {page_size}, {heads}/{kv_heads} heads of {hd}");
            // The device's and the CPU's f32 attentions against the exact one, each element within its rounding-error bound (an
            // f32 result is no oracle for another: the device and the CPU kernels sum in different orders).
            // Measured here: at most 0.04 of the bound (the scalar path; the simulator and the SIMD
            // kernels 0.01), while a position left out moves a typical row's worst element ~1000 times past it
            // (over 120 times on 90% of rows).
            let eps = 1.0;
            for (isa, want) in &cpu {
                close(
                    want,
                    &exact,
                    &bound,
                    eps,
                    &format!("CPU backend ({isa:?}), {what}"),
                );
            }
            for s in seqs {
                kv.release(s, None);
            }
        }
    }
}

#[test]
fn paged_attention_matches_the_cpu_backend() {
    on_every_device(paged_attention_matches_the_cpu_backend_on);
}

fn paged_attention_matches_the_cpu_backend_on(d: &dyn TestDev) {
    attention_case(d, 6, 2, 64);
    attention_case(d, 16, 1, 128);
    // The widest head: the scalar f32 kernel's 256 threads, the tensor cores' 4 warps of 8 output tiles.
    attention_case(d, 2, 1, 256);
    // Heads that leave threads of the block idle in the values' shares (128 = 2 x 48 + 32, 6 x 20 + 8),
    // the second also not whole 8-element loads.
    attention_case(d, 4, 2, 48);
    attention_case(d, 2, 1, 20);
}

#[test]
fn attention_rejects_shapes_outside_its_kernels() {
    on_every_device(attention_rejects_shapes_outside_its_kernels_on);
}

fn attention_rejects_shapes_outside_its_kernels_on(d: &dyn TestDev) {
    let store = KvStore {
        k: DevPtr(0),
        v: DevPtr(0),
        kscale: DevPtr(0),
        vscale: DevPtr(0),
        dtype: KvDtype::F16,
        shape: KvShape {
            n_layers: 1,
            n_kv_heads: 2,
            head_dim: 64,
            recurrent: 0,
        },
        page_size: 16,
    };
    let b = DevBatch {
        table: DevPtr(0),
        meta: DevPtr(0),
        seen: DevPtr(0),
        dst: DevPtr(0),
        seqs: DevPtr(0),
        tokens: 1,
        n_seqs: 1,
        splits: 1,
        split_cap: 1,
        attend_from: 0,
    };
    for heads in [3, 34] {
        let r = attention(
            d,
            &store,
            &b,
            0,
            DevPtr(0),
            64 * heads,
            heads,
            DevPtr(0),
            DevPtr(0),
            None,
        );
        assert!(
            matches!(r, Err(DeviceError::Unsupported { .. })),
            "{heads}: {r:?}"
        );
    }
}

#[test]
fn fused_rope_and_kv_write_equal_the_unfused_kernels() {
    on_every_device(fused_rope_kv_on);
}

fn fused_rope_kv_on(d: &dyn TestDev) {
    let (heads, kvh, hd) = (6, 2, 64);
    let shape = KvShape {
        n_layers: 2,
        n_kv_heads: kvh,
        head_dim: hd,
        recurrent: 0,
    };
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut kv = cache(shape, dtype, 7);
        let seqs: Vec<SeqKv> = [(5usize, 4usize), (0, 9)]
            .iter()
            .map(|&(prev, new)| fill_seq(&mut kv, prev + new, prev, 3))
            .collect();
        let mut batch = Batch::default();
        batch.push(&seqs[0], &[0; 4], Logits::Last);
        batch.push(&seqs[1], &[0; 9], Logits::Last);
        let n = batch.len();
        let stride = (heads + 2 * kvh) * hd + 8;
        let rows = data(n * stride, 61);
        let n_angles = hd / 2;
        let mut table = Vec::new();
        for p in 0..16 {
            ops::rope_angles(hd, p, 10000.0, &mut table);
        }
        let flat: Vec<f32> = table.iter().flat_map(|&(c, s)| [c, s]).collect();
        let meta = upload_batch(d, &batch, 7);
        let mut bm = BatchMeta::default();
        bm.build(&batch, 7, 4).unwrap();
        let pos = Mem::from_bytes(
            d,
            &bm.pos
                .iter()
                .flat_map(|p| p.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let tab = Mem::from_f32(d, &flat);

        // Unfused: rotate Q and K in the rows, then write K and V.
        let (r0, pool0) = (Mem::from_f32(d, &rows), DevPool::upload(d, kv.pool()));
        let st0 = pool0.store(kv.pool());
        rope(
            d,
            Rope::Normal,
            r0.ptr(),
            pos.ptr(),
            tab.ptr(),
            n,
            stride,
            heads + kvh,
            hd,
            n_angles,
        )
        .unwrap();
        let (k, v) = (
            r0.ptr().offset(4 * heads * hd),
            r0.ptr().offset(4 * (heads + kvh) * hd),
        );
        write_kv(d, &st0, &meta.b, 1, k, v, stride).unwrap();
        // Fused.
        let (r1, pool1) = (Mem::from_f32(d, &rows), DevPool::upload(d, kv.pool()));
        let st1 = pool1.store(kv.pool());
        let (rp, pp, tp) = (r1.ptr(), pos.ptr(), tab.ptr());
        rope_kv_write(d, &st1, &meta.b, 1, rp, stride, heads, pp, tp, n_angles).unwrap();
        assert_eq!(r1.bytes(), r0.bytes(), "{dtype:?}: rotated rows");
        assert_eq!(pool1.k.bytes(), pool0.k.bytes(), "{dtype:?}: keys");
        assert_eq!(pool1.v.bytes(), pool0.v.bytes(), "{dtype:?}: values");
        for s in seqs {
            kv.release(s, None);
        }
    }
    // FP8 pages take the unfused pair.
    let mut kv = cache(shape, KvDtype::Fp8, 7);
    let pool = DevPool::upload(d, kv.pool());
    let st = pool.store(kv.pool());
    let s = fill_seq(&mut kv, 1, 0, 3);
    let mut batch = Batch::default();
    batch.push(&s, &[0], Logits::Last);
    let meta = upload_batch(d, &batch, 7);
    let r = rope_kv_write(
        d,
        &st,
        &meta.b,
        0,
        DevPtr(0),
        640,
        heads,
        DevPtr(0),
        DevPtr(0),
        32,
    );
    assert!(matches!(r, Err(DeviceError::Unsupported { .. })), "{r:?}");
    kv.release(s, None);
}
