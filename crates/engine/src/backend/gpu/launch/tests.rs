//! Every kernel, launched by this module's ops, run in the CPU simulator (and, in a CUDA build on a machine
//! with a GPU, on the GPU too) and checked against the CPU backend's scalar references. Each test states its tolerance: exact where the kernel does the reference's
//! IEEE operations in its order, a bound on float reassociation where it sums in another order.

use super::*;
use crate::backend::Rope;
use crate::backend::cpu::ops;
use crate::backend::cpu::qmatmul::{QActs, quantize_ref};
use crate::backend::cpu::simd::Isa;
use crate::backend::gpu::sim::Sim;
use crate::backend::pages::{KvDtype, KvShape};
use crate::quant::dequantize_ref;
use crate::testutil::{data, quantize_rows};

/// Memory a test device holds for a [`Mem`].
enum Backing {
    /// Host words (8-byte aligned).
    Host(Vec<u64>),
    /// GPU memory.
    #[cfg(feature = "cuda")]
    Gpu(crate::backend::gpu::cuda::DevBuf),
}

/// Where the kernel tests run: the launcher and its memory.
trait TestDev: Launcher + Sync {
    /// Memory holding `bytes`, and its address.
    fn put(&self, bytes: &[u8]) -> (Backing, DevPtr);
    /// The bytes of a [`Backing`], after the work queued so far.
    fn get(&self, b: &Backing, len: usize) -> Vec<u8>;
}

impl TestDev for Sim {
    fn put(&self, bytes: &[u8]) -> (Backing, DevPtr) {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        let ptr = DevPtr(words.as_ptr() as u64);
        (Backing::Host(words), ptr)
    }

    fn get(&self, b: &Backing, len: usize) -> Vec<u8> {
        match b {
            Backing::Host(words) => {
                let mut v: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                v.truncate(len);
                v
            }
            #[cfg(feature = "cuda")]
            Backing::Gpu(_) => unreachable!("simulator memory is host memory"),
        }
    }
}

#[cfg(feature = "cuda")]
impl TestDev for crate::backend::gpu::cuda::Gpu {
    fn put(&self, bytes: &[u8]) -> (Backing, DevPtr) {
        let buf = self.alloc(bytes.len()).expect("GPU memory");
        self.upload(buf.ptr(), bytes).expect("copy to the GPU");
        let ptr = buf.ptr();
        (Backing::Gpu(buf), ptr)
    }

    fn get(&self, b: &Backing, len: usize) -> Vec<u8> {
        match b {
            Backing::Gpu(buf) => {
                let mut v = vec![0u8; len];
                self.download(buf.ptr(), &mut v).expect("copy from the GPU");
                v
            }
            Backing::Host(_) => unreachable!("GPU memory is device memory"),
        }
    }
}

/// Runs a test body on the simulator, then on GPU 0 when this build has CUDA and the machine a GPU (else a
/// line says the GPU run is skipped, and why).
fn on_every_device(body: fn(&dyn TestDev)) {
    body(&Sim);
    #[cfg(feature = "cuda")]
    {
        static GPU: std::sync::OnceLock<Result<crate::backend::gpu::cuda::Gpu, String>> =
            std::sync::OnceLock::new();
        match GPU.get_or_init(|| {
            crate::backend::gpu::cuda::Gpu::open(0, None).map_err(|e| e.to_string())
        }) {
            Ok(gpu) => {
                body(gpu);
                gpu.synchronize().expect("the GPU finished");
            }
            Err(e) => eprintln!("skip: the GPU run ({e})"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    eprintln!("skip: the GPU run (this build has no CUDA backend)");
}

/// Guard bytes on each side of a buffer.
const GUARD_BYTES: usize = 64;
const GUARD: u8 = 0xa5;

/// A test buffer in a device's memory, fenced by guard bytes on both sides, so a kernel that writes out of
/// bounds fails the test instead of passing silently.
struct Mem<'d> {
    dev: &'d dyn TestDev,
    backing: Backing,
    base: DevPtr,
    bytes: usize,
}

impl<'d> Mem<'d> {
    fn from_bytes(dev: &'d dyn TestDev, b: &[u8]) -> Self {
        let mut all = vec![GUARD; 2 * GUARD_BYTES + b.len().next_multiple_of(8)];
        all[GUARD_BYTES..GUARD_BYTES + b.len()].copy_from_slice(b);
        let (backing, base) = dev.put(&all);
        Mem {
            dev,
            backing,
            base,
            bytes: b.len(),
        }
    }

    fn zeroed(dev: &'d dyn TestDev, bytes: usize) -> Self {
        Mem::from_bytes(dev, &vec![0; bytes])
    }

    fn from_f32(dev: &'d dyn TestDev, v: &[f32]) -> Self {
        Mem::from_bytes(
            dev,
            &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
        )
    }

    fn from_u16(dev: &'d dyn TestDev, v: &[u16]) -> Self {
        Mem::from_bytes(
            dev,
            &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
        )
    }

    fn ptr(&self) -> DevPtr {
        self.base.offset(GUARD_BYTES)
    }

    /// The contents, after checking the guards.
    fn bytes(&self) -> Vec<u8> {
        let total = 2 * GUARD_BYTES + self.bytes.next_multiple_of(8);
        let all = self.dev.get(&self.backing, total);
        let end = GUARD_BYTES + self.bytes.next_multiple_of(8);
        assert!(
            all[..GUARD_BYTES]
                .iter()
                .chain(&all[end..])
                .all(|&b| b == GUARD),
            "a kernel wrote outside its buffer"
        );
        all[GUARD_BYTES..GUARD_BYTES + self.bytes].to_vec()
    }

    fn f32s(&self) -> Vec<f32> {
        self.bytes()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn u16s(&self) -> Vec<u16> {
        self.bytes()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    }
}

/// `|got - want| <= rel * scale + abs` for each element, with the first failure named.
#[track_caller]
fn close(got: &[f32], want: &[f64], scale: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= rel * s + 1e-30,
            "{what}[{i}]: got {g}, want {w} (error {err:e}, bound {:e})",
            rel * s
        );
    }
}

/// Every weight format the matrix-vector kernels take.
const FORMATS: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::NVFP4,
    GgmlType::F32,
    GgmlType::F16,
];

/// Weights of `ty` for the matvec tests, as GGUF bytes.
/// GGUF `bytes` of a `ty` matrix as the kernels read them in `layout`.
fn laid_out(bytes: &[u8], ty: GgmlType, layout: Layout, rows: usize, cols: usize) -> Vec<u8> {
    match (layout, ty) {
        (Layout::Gguf, _) => bytes.to_vec(),
        (Layout::Packed, GgmlType::Q4_1) => repack_q4_1(bytes, rows, cols).expect("whole rows"),
        (Layout::Packed, ty) => panic!("no packed layout for {ty}"),
    }
}

fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    match ty {
        GgmlType::F16 => data(rows * cols, seed)
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => quantize_rows(ty, rows, cols, seed),
    }
}

#[test]
fn half_to_float_is_exact_for_every_half() {
    on_every_device(half_to_float_is_exact_for_every_half_on);
}

fn half_to_float_is_exact_for_every_half_on(d: &dyn TestDev) {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let (h, f) = (Mem::from_u16(d, &all), Mem::zeroed(d, 4 * all.len()));
    f16_to_f32(d, h.ptr(), f.ptr(), all.len()).unwrap();
    for (&bits, got) in all.iter().zip(f.f32s()) {
        let want = half::f16::from_bits(bits).to_f32();
        if want.is_nan() {
            assert!(got.is_nan(), "{bits:#06x}: got {got}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
        }
    }
}

#[test]
fn float_to_half_rounds_to_nearest_even_like_the_host() {
    on_every_device(float_to_half_rounds_to_nearest_even_like_the_host_on);
}

fn float_to_half_rounds_to_nearest_even_like_the_host_on(d: &dyn TestDev) {
    // Every half, the midpoints on both sides of each (the ties), a float either side of each midpoint,
    // the overflow and underflow edges, and the specials.
    let mut v = Vec::new();
    for bits in (0..=u16::MAX).step_by(7) {
        let x = half::f16::from_bits(bits).to_f32();
        let next = half::f16::from_bits(bits.wrapping_add(1)).to_f32();
        v.push(x);
        if x.is_finite() && next.is_finite() && (bits & 0x7fff) != 0x7bff {
            let mid = (f64::from(x) + f64::from(next)) / 2.0;
            let m = mid as f32;
            v.extend([
                m,
                f32::from_bits(m.to_bits() + 1),
                f32::from_bits(m.to_bits() - 1),
            ]);
        }
    }
    v.extend([
        65504.0,
        65519.99,
        65520.0,
        1e9,
        -1e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        2.0f32.powi(-25),
        2.0f32.powi(-25) * 1.0001,
        2.0f32.powi(-26),
        -0.0,
        f32::MIN_POSITIVE,
    ]);
    v.extend(data(20_000, 7).iter().map(|x| x * 1e-3));
    let (f, h) = (Mem::from_f32(d, &v), Mem::zeroed(d, 2 * v.len()));
    f32_to_f16(d, f.ptr(), h.ptr(), v.len()).unwrap();
    for (&x, got) in v.iter().zip(h.u16s()) {
        let want = half::f16::from_f32(x);
        if want.is_nan() {
            assert!(half::f16::from_bits(got).is_nan(), "{x:e}: got {got:#06x}");
        } else {
            assert_eq!(got, want.to_bits(), "{x:e} ({:#010x})", x.to_bits());
        }
    }
}

#[test]
fn elementwise_kernels_match_the_references() {
    on_every_device(elementwise_kernels_match_the_references_on);
}

fn elementwise_kernels_match_the_references_on(d: &dyn TestDev) {
    // More values than one launch's blocks cover, so the grid-stride loops run.
    let n = 256 * MAX_BLOCKS + 1000;
    let (a, b) = (data(n, 1), data(n, 2));
    let (x, y, out) = (
        Mem::from_f32(d, &a),
        Mem::from_f32(d, &b),
        Mem::zeroed(d, 4 * n),
    );
    add(d, x.ptr(), y.ptr(), n).unwrap();
    let mut want = a.clone();
    ops::add_ref(&mut want, &b);
    assert_eq!(x.f32s(), want, "add: one IEEE add per element, exact");

    silu_mul(d, y.ptr(), x.ptr(), out.ptr(), n).unwrap();
    let mut want = vec![0.0; n];
    ops::silu_mul_ref(&b, &x.f32s(), &mut want);
    // expf differs between libraries by an ulp or two.
    let w64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
    let scale: Vec<f64> = w64.iter().map(|v| v.abs() + 1e-30).collect();
    close(&out.f32s(), &w64, &scale, 1e-6, "silu_mul");

    let (rows, f) = (37, 96);
    let gu = data(rows * 2 * f, 3);
    let (g, o) = (Mem::from_f32(d, &gu), Mem::zeroed(d, 4 * rows * f));
    swiglu_rows(d, g.ptr(), o.ptr(), rows, f).unwrap();
    let mut want = vec![0.0; rows * f];
    for t in 0..rows {
        let r = &gu[t * 2 * f..(t + 1) * 2 * f];
        ops::silu_mul_ref(&r[..f], &r[f..], &mut want[t * f..(t + 1) * f]);
    }
    let w64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
    let scale: Vec<f64> = w64.iter().map(|v| v.abs() + 1e-30).collect();
    close(&o.f32s(), &w64, &scale, 1e-6, "swiglu_rows");
}

#[test]
fn rmsnorm_matches_the_reference() {
    on_every_device(rmsnorm_matches_the_reference_on);
}

fn rmsnorm_matches_the_reference_on(dev: &dyn TestDev) {
    // Widths below, at and above one block of threads, and not multiples of 32.
    for d in [8, 64, 576, 1000, 2048] {
        let rows = 5;
        let (xs, ws) = (data(rows * d, d as u64), data(d, 9));
        let (x, w, out) = (
            Mem::from_f32(dev, &xs),
            Mem::from_f32(dev, &ws),
            Mem::zeroed(dev, 4 * rows * d),
        );
        rmsnorm(dev, x.ptr(), w.ptr(), out.ptr(), rows, d, 1e-5).unwrap();
        let mut want = vec![0.0; rows * d];
        for r in 0..rows {
            ops::rmsnorm_ref(
                &xs[r * d..(r + 1) * d],
                &ws,
                1e-5,
                &mut want[r * d..(r + 1) * d],
            );
        }
        // The kernel sums squares in f32 (the reference in f64): a relative error of a few ulps per term.
        let w64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        let scale: Vec<f64> = w64.iter().map(|v| v.abs()).collect();
        close(&out.f32s(), &w64, &scale, 1e-5, &format!("rmsnorm d={d}"));
    }
}

#[test]
fn rope_matches_the_cpu_for_both_layouts_and_partial_rotation() {
    on_every_device(rope_matches_the_cpu_for_both_layouts_and_partial_rotation_on);
}

fn rope_matches_the_cpu_for_both_layouts_and_partial_rotation_on(d: &dyn TestDev) {
    let (heads, hd) = (3, 64);
    let positions = [0usize, 7, 100, 3, 4095];
    for (kind, n_angles) in [(Rope::Normal, 32), (Rope::Neox, 16)] {
        let mut table = Vec::new();
        for p in 0..=4095 {
            ops::rope_angles(2 * n_angles, p, 10000.0, &mut table);
        }
        let flat: Vec<f32> = table.iter().flat_map(|&(c, s)| [c, s]).collect();
        // Rows of a fused QKV layout: the rotated heads, then 40 floats that must stay as they are.
        let stride = heads * hd + 40;
        let xs = data(positions.len() * stride, 21);
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let x = Mem::from_f32(d, &xs);
        let (pm, tm) = (
            Mem::from_bytes(
                d,
                &pos.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<_>>(),
            ),
            Mem::from_f32(d, &flat),
        );
        rope(
            d,
            kind,
            x.ptr(),
            pm.ptr(),
            tm.ptr(),
            positions.len(),
            stride,
            heads,
            hd,
            n_angles,
        )
        .unwrap();
        let mut want = xs.clone();
        for (t, &p) in positions.iter().enumerate() {
            let angles = &table[p * n_angles..(p + 1) * n_angles];
            let row = &mut want[t * stride..t * stride + heads * hd];
            match kind {
                Rope::Normal => ops::rope_table(row, hd, angles),
                Rope::Neox => row
                    .chunks_exact_mut(hd)
                    .for_each(|h| ops::rope_neox(h, angles)),
            }
        }
        // Two products and a sum per element: the GPU may fuse them, so a bound of a few ulps.
        let w64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        // Per row: twice its largest magnitude (a rotated value is a sum of two products of them).
        let scale: Vec<f64> = (0..xs.len())
            .map(|i| {
                let r = &xs[i / stride * stride..][..stride];
                2.0 * r.iter().fold(0f64, |m, v| m.max(f64::from(v.abs()))) + 1e-6
            })
            .collect();
        close(&x.f32s(), &w64, &scale, 1e-6, &format!("{kind:?}"));
    }
}

#[test]
fn embedding_rows_dequantize_exactly() {
    on_every_device(embedding_rows_dequantize_exactly_on);
}

fn embedding_rows_dequantize_exactly_on(dev: &dyn TestDev) {
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::NVFP4,
        GgmlType::F32,
        GgmlType::F16,
    ] {
        let (rows, d) = (17, 512);
        let mut bytes = weights(ty, rows, d, 5);
        // Negative scales in every other block: the products' signed zeros must match too.
        let scale_at = match ty {
            GgmlType::Q6_K => Some(209),
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q4_K => Some(1),
            _ => None,
        };
        if let Some(at) = scale_at {
            for blk in bytes.chunks_exact_mut(ty.type_size()).step_by(2) {
                blk[at] |= 0x80;
            }
        }
        let tokens: Vec<i32> = vec![3, 0, 16, 3, 9];
        let (tm, km, om) = (
            Mem::from_bytes(dev, &bytes),
            Mem::from_bytes(
                dev,
                &tokens
                    .iter()
                    .flat_map(|t| t.to_le_bytes())
                    .collect::<Vec<_>>(),
            ),
            Mem::zeroed(dev, 4 * tokens.len() * d),
        );
        embed(dev, ty, tm.ptr(), d, km.ptr(), tokens.len(), om.ptr()).unwrap();
        let rb = ty.row_bytes(d).unwrap();
        let mut want = vec![0f32; tokens.len() * d];
        for (t, &tok) in tokens.iter().enumerate() {
            let r = tok as usize;
            dequantize_ref(
                ty,
                &bytes[r * rb..(r + 1) * rb],
                &mut want[t * d..(t + 1) * d],
            )
            .unwrap();
        }
        let got = om.f32s();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ty} value {i}: {g} vs {w}");
        }
    }
}

#[test]
fn topk_rows_match_a_sort() {
    on_every_device(topk_rows_match_a_sort_on);
}

fn topk_rows_match_a_sort_on(d: &dyn TestDev) {
    let (rows, vocab) = (4, 3001);
    let mut x = data(rows * vocab, 51);
    // Ties (the lower index wins), a NaN (never chosen) and a row of all minus infinity but two numbers.
    x[10] = 99.0;
    x[2000] = 99.0;
    x[17] = f32::NAN;
    let r3 = 3 * vocab;
    x[r3..r3 + vocab].fill(f32::NEG_INFINITY);
    x[r3 + 5] = 1.0;
    x[r3 + 7] = 2.0;
    for k in [1, 2, 8] {
        let (lm, im, vm) = (
            Mem::from_f32(d, &x),
            Mem::zeroed(d, 4 * rows * k),
            Mem::zeroed(d, 4 * rows * k),
        );
        topk_rows(d, lm.ptr(), rows, vocab, k, im.ptr(), vm.ptr()).unwrap();
        let idx: Vec<i32> = im
            .bytes()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let val = vm.f32s();
        for r in 0..rows {
            let row = &x[r * vocab..(r + 1) * vocab];
            let mut order: Vec<usize> = (0..vocab).filter(|&c| !row[c].is_nan()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for j in 0..k {
                assert_eq!(idx[r * k + j], order[j] as i32, "row {r}, k {k}, rank {j}");
                assert_eq!(val[r * k + j].to_bits(), row[order[j]].to_bits());
            }
        }
        assert_eq!(idx[0], 10, "ties go to the lower index");
    }
    assert!(topk_rows(d, DevPtr(0), 1, 10, 9, DevPtr(0), DevPtr(0)).is_err());
}

/// The greedy token and log-normaliser of each row against the CPU's argmax and `logsumexp_ref`: the same
/// token (ties to the lower index, NaN never chosen), the same logit bits, the normaliser to rounding.
#[test]
fn row_best_matches_the_cpu() {
    on_every_device(row_best_matches_the_cpu_on);
}

fn row_best_matches_the_cpu_on(d: &dyn TestDev) {
    use crate::backend::cpu::ops::{argmax, logsumexp_ref};
    let (rows, vocab) = (5, 49_152);
    let mut x = data(rows * vocab, 61);
    // Row 1: a tie (the lower index wins) and a NaN; row 2: minus infinity but two numbers; row 3: all
    // minus infinity (its normaliser too); row 4: all NaN but one number at the end.
    x[vocab + 10] = 99.0;
    x[vocab + 40_000] = 99.0;
    x[vocab + 3] = f32::NAN;
    let (r2, r3, r4) = (2 * vocab, 3 * vocab, 4 * vocab);
    x[r2..r2 + vocab].fill(f32::NEG_INFINITY);
    x[r2 + 5] = 1.0;
    x[r2 + 7] = 2.0;
    x[r3..r3 + vocab].fill(f32::NEG_INFINITY);
    x[r4..r4 + vocab].fill(f32::NAN);
    x[r4 + vocab - 1] = -3.0;
    let (lm, om) = (
        Mem::from_f32(d, &x),
        Mem::zeroed(d, 4 * ROW_BEST_FLOATS * rows),
    );
    row_best(d, lm.ptr(), rows, vocab, om.ptr()).unwrap();
    let got = om.f32s();
    for r in 0..rows {
        let row = &x[r * vocab..(r + 1) * vocab];
        let g = &got[r * ROW_BEST_FLOATS..(r + 1) * ROW_BEST_FLOATS];
        let numbers: Vec<f32> = row
            .iter()
            .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v })
            .collect();
        let want = argmax(&numbers).unwrap();
        assert_eq!(g[0], want as f32, "row {r}: the token");
        assert_eq!(g[1].to_bits(), row[want].to_bits(), "row {r}: its logit");
        // A NaN in the row makes its normaliser NaN, as on the CPU.
        let lse = logsumexp_ref(row);
        if lse.is_nan() {
            assert!(g[2].is_nan(), "row {r}: {}", g[2]);
        } else if lse == f32::NEG_INFINITY {
            assert_eq!(g[2], lse, "row {r}");
        } else {
            assert!(
                (g[2] - lse).abs() <= 1e-5 * lse.abs().max(1.0),
                "row {r}: {} vs {lse}",
                g[2]
            );
        }
    }
    assert_eq!(got[ROW_BEST_FLOATS], 10.0, "ties go to the lower index");
    assert_eq!(
        got[4 * ROW_BEST_FLOATS],
        (vocab - 1) as f32,
        "NaN is never chosen"
    );
    assert!(row_best(d, DevPtr(0), 1, 1 << 24, DevPtr(0)).is_err());
}

/// Top-k sampling candidates against the k best finite values sorted on the host (value first, the lower
/// index among equals; -0 equal to +0): the same set, at every k, through ties at the k-th value, NaN and
/// infinities (never candidates), a row with fewer finite values than k, and a short row.
#[test]
fn row_top_finds_the_cpu_samplers_candidates() {
    on_every_device(row_top_finds_the_cpu_samplers_candidates_on);
}

fn row_top_finds_the_cpu_samplers_candidates_on(d: &dyn TestDev) {
    let vocab = 49_152;
    let mut rows: Vec<Vec<f32>> = (0..5).map(|r| data(vocab, 80 + r)).collect();
    // Row 1: many ties at the values around the boundary, NaN and infinities at the top, zeros of both
    // signs; row 2: seven finite values; row 3: quantized, so every value has thousands of equals.
    for i in (0..vocab).step_by(97) {
        rows[1][i] = 0.5;
    }
    rows[1][5] = f32::NAN;
    rows[1][6] = f32::INFINITY;
    rows[1][7] = f32::NEG_INFINITY;
    rows[1][100] = -0.0;
    rows[1][200] = 0.0;
    rows[2].fill(f32::NEG_INFINITY);
    for (j, i) in [3, 9000, 17, 40_000, 12, 5, 49_151].into_iter().enumerate() {
        rows[2][i] = j as f32 * 0.25;
    }
    for v in rows[3].iter_mut() {
        *v = (*v * 4.0).round();
    }
    // Row 4: the k-th among zeros of both signs, and 70 equal values above the rest.
    rows[4].fill(f32::NEG_INFINITY);
    for (i, v) in [(10, 1.0), (20, -0.0), (30, 0.0), (40, -0.0)] {
        rows[4][i] = v;
    }
    for i in 0..70 {
        rows[4][1000 + 300 * i] = 3.0;
    }
    let want = |row: &[f32], k: usize| -> Vec<(u32, f32)> {
        let mut c: Vec<(u32, f32)> = row
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        c.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
        c.truncate(k);
        c
    };
    let check = |rows: &[Vec<f32>], width: usize, k: usize| {
        let flat: Vec<f32> = rows
            .iter()
            .flat_map(|r| r[..width].iter().copied())
            .collect();
        let (lm, om) = (
            Mem::from_f32(d, &flat),
            Mem::zeroed(d, 4 * TOP_FLOATS * rows.len()),
        );
        row_top(d, lm.ptr(), rows.len(), width, k, om.ptr()).unwrap();
        let got = om.f32s();
        for (r, row) in rows.iter().enumerate() {
            let g = &got[r * TOP_FLOATS..(r + 1) * TOP_FLOATS];
            let n = g[0] as usize;
            let mut c: Vec<(u32, f32)> = (0..n)
                .map(|j| (g[1 + 2 * j] as u32, g[2 + 2 * j]))
                .collect();
            c.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
            let w = want(&row[..width], k);
            assert_eq!(c.len(), w.len(), "row {r}, k {k}, width {width}: the count");
            for (a, b) in c.iter().zip(&w) {
                assert!(a.0 == b.0 && a.1 == b.1, "row {r}, k {k}: {a:?} vs {b:?}");
            }
        }
    };
    for k in [1, 2, 20, 64] {
        check(&rows, vocab, k);
    }
    // Rows shorter than the block and than k.
    check(&rows, 37, 64);
    check(&rows, 37, 5);
    assert!(row_top(d, DevPtr(0), 1, 10, 65, DevPtr(0)).is_err());
}

mod attention;
mod canonical;
mod gdn;
mod matvec;
mod prologue;
