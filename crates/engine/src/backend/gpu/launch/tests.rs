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

/// Runs quantize_q8_1 on `tokens` rows of `cols` floats.
fn quantize_on_device<'d>(
    d: &'d dyn TestDev,
    xs: &[f32],
    tokens: usize,
    cols: usize,
) -> (Mem<'d>, Mem<'d>, Mem<'d>) {
    let x = Mem::from_f32(d, xs);
    let q = Mem::zeroed(d, Acts::q_bytes(tokens, cols));
    let ds = Mem::zeroed(d, Acts::ds_bytes(tokens, cols));
    let a = Acts {
        x: x.ptr(),
        q: q.ptr(),
        ds: ds.ptr(),
        tokens,
        cols,
    };
    quantize_q8_1(d, &a).unwrap();
    (x, q, ds)
}

#[test]
fn activation_quantization_is_bit_exact() {
    on_every_device(activation_quantization_is_bit_exact_on);
}

fn activation_quantization_is_bit_exact_on(d: &dyn TestDev) {
    let (tokens, cols) = (3, 576);
    let mut xs = data(tokens * cols, 4);
    // An all-zero block and one of ties (x.5 after scaling) exercise d = 0 and round-half-even.
    xs[32..64].fill(0.0);
    for (j, v) in xs[64..96].iter_mut().enumerate() {
        *v = (j as f32 - 16.0) + 0.5;
    }
    let (_x, q, ds) = quantize_on_device(d, &xs, tokens, cols);
    let mut want = QActs::default();
    quantize_ref(&xs, tokens, cols, &mut want);
    let got_q: Vec<i8> = q.bytes().iter().map(|&b| b as i8).collect();
    let got_ds = ds.f32s();
    for t in 0..tokens {
        for b in 0..cols / 32 {
            let i = t * (cols / 32) + b;
            let wi = t * want.blocks + b;
            assert_eq!(
                &got_q[t * cols + 32 * b..][..32],
                &want.q[t * want.cols + 32 * b..][..32],
                "token {t} block {b}"
            );
            assert_eq!(
                got_ds[2 * i].to_bits(),
                want.d[wi].to_bits(),
                "d, token {t} block {b}"
            );
            assert_eq!(
                got_ds[2 * i + 1].to_bits(),
                want.s[wi].to_bits(),
                "s, token {t} block {b}"
            );
        }
    }
    let bad = Acts {
        cols: 40,
        ..Acts {
            x: DevPtr(0),
            q: DevPtr(0),
            ds: DevPtr(0),
            tokens: 1,
            cols: 0,
        }
    };
    assert!(matches!(
        quantize_q8_1(d, &bad),
        Err(DeviceError::Unsupported { .. })
    ));
}

/// Weights of `ty` for the matvec tests, as GGUF bytes.
fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    match ty {
        GgmlType::F16 => data(rows * cols, seed)
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => quantize_rows(ty, rows, cols, seed),
    }
}

/// Checks matvec for `ty` over `tokens` tokens against the dequantized weights times the dequantized
/// activations (the quantized ones for block formats), summed in f64; with `gap`, its outputs are one
/// part of rows `rows + gap` apart, and the gap is left as it was.
fn check_matvec(
    d: &dyn TestDev,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    tokens: usize,
    scale: f32,
    gap: usize,
) {
    let stride = rows + gap;
    let bytes = weights(ty, rows, cols, 11 + cols as u64);
    let xs = data(tokens * cols, 12);
    let (x, q, ds) = quantize_on_device(d, &xs, tokens, cols);
    let wmem = Mem::from_bytes(d, &bytes);
    let out = Mem::from_f32(d, &vec![7.0; tokens * stride]);
    let w = Weights {
        ptr: wmem.ptr(),
        ty,
        rows,
        cols,
        scale,
    };
    let a = Acts {
        x: x.ptr(),
        q: q.ptr(),
        ds: ds.ptr(),
        tokens,
        cols,
    };
    matvec(d, &w, &a, out.ptr(), stride).unwrap();
    let (_, quantized) = w.kernel().unwrap();
    // The activations the kernel sees: dx * q for block formats, the floats otherwise.
    let mut qa = QActs::default();
    quantize_ref(&xs, tokens, cols, &mut qa);
    let xin: Vec<f64> = (0..tokens * cols)
        .map(|i| {
            let (t, c) = (i / cols, i % cols);
            if quantized {
                f64::from(qa.d[t * qa.blocks + c / 32]) * f64::from(qa.q[t * qa.cols + c])
            } else {
                f64::from(xs[i])
            }
        })
        .collect();
    let rb = ty.row_bytes(cols).unwrap();
    let mut row = vec![0.0f32; cols];
    let (mut want, mut bound) = (vec![7.0; tokens * stride], vec![0.0; tokens * stride]);
    for r in 0..rows {
        dequantize_ref(ty, &bytes[r * rb..(r + 1) * rb], &mut row).unwrap();
        for t in 0..tokens {
            let xr = &xin[t * cols..(t + 1) * cols];
            let dot: f64 = row.iter().zip(xr).map(|(&w, &x)| f64::from(w) * x).sum();
            let mag: f64 = row
                .iter()
                .zip(xr)
                .map(|(&w, &x)| (f64::from(w) * x).abs())
                .sum();
            want[t * stride + r] = dot * f64::from(scale);
            bound[t * stride + r] = mag * f64::from(scale.abs());
        }
    }
    // Exact integer dot products; the float error is the reassociation of a few dozen partial sums.
    close(
        &out.f32s(),
        &want,
        &bound,
        2e-5,
        &format!("matvec {ty} {rows}x{cols}, {tokens} tokens"),
    );
}

#[test]
fn matvec_matches_dequantized_weights_for_every_format() {
    on_every_device(matvec_matches_dequantized_weights_for_every_format_on);
}

fn matvec_matches_dequantized_weights_for_every_format_on(d: &dyn TestDev) {
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
        // Rows not a multiple of the block's 4; 1, 3 and 11 tokens (11: two launches), one of them a part
        // of a wider output.
        let cols = if ty.block_size() == 256 { 512 } else { 576 };
        check_matvec(d, ty, 13, cols, 1, 1.0, 0);
        check_matvec(d, ty, 6, cols, 11, 1.0, 5);
    }
    check_matvec(d, GgmlType::NVFP4, 9, 256, 3, 0.375, 0);
}

#[test]
fn matvec_rejects_what_its_kernels_cannot_take() {
    on_every_device(matvec_rejects_what_its_kernels_cannot_take_on);
}

fn matvec_rejects_what_its_kernels_cannot_take_on(d: &dyn TestDev) {
    let a = Acts {
        x: DevPtr(0),
        q: DevPtr(0),
        ds: DevPtr(0),
        tokens: 1,
        cols: 288,
    };
    let w = |ty, cols, scale| Weights {
        ptr: DevPtr(0),
        ty,
        rows: 4,
        cols,
        scale,
    };
    for (ty, cols, scale) in [
        (GgmlType::Q4_K, 288, 1.0), // not whole super-blocks
        (GgmlType::Q5_0, 288, 1.0), // no kernel
        (GgmlType::F32, 288, 0.5),  // a tensor scale on floats
        (GgmlType::Q4_0, 320, 1.0), // input width differs
    ] {
        let r = matvec(d, &w(ty, cols, scale), &a, DevPtr(0), 6);
        assert!(
            matches!(r, Err(DeviceError::Unsupported { .. })),
            "{ty} {cols}: {r:?}"
        );
    }
    // Outputs closer together than the matrix's rows.
    let r = matvec(d, &w(GgmlType::Q4_0, 288, 1.0), &a, DevPtr(0), 3);
    assert!(
        matches!(r, Err(DeviceError::Unsupported { .. })),
        "a stride of 3 for 4 rows: {r:?}"
    );
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

use crate::backend::batch::NO_PARENT;
use crate::backend::pages::{KvSlice, PagePool};
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
    let mut m = BatchMeta::default();
    m.build(batch, page_size).unwrap();
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
    let b = DevBatch {
        table: bufs[0].ptr(),
        meta: bufs[1].ptr(),
        seen: bufs[2].ptr(),
        dst: bufs[3].ptr(),
        seqs: bufs[4].ptr(),
        tokens: batch.len(),
        n_seqs: batch.seqs.len(),
        splits: m.splits,
        attend_from: m.attend_from,
    };
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
        let grow = |t: usize, seed| -> Vec<f32> {
            data(w, seed).iter().map(|x| x * (1.0 + t as f32)).collect()
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
            let meta = upload_batch(d, &batch, page_size);
            // The queries inside wider rows (a fused QKV row's Q part).
            let q_stride = heads * hd + 2 * kv_heads * hd;
            let qrows: Vec<f32> = (0..n)
                .flat_map(|t| {
                    let mut r = q[t * heads * hd..(t + 1) * heads * hd].to_vec();
                    r.resize(q_stride, 7.0);
                    r
                })
                .collect();
            let (qm, out) = (Mem::from_f32(d, &qrows), Mem::zeroed(d, 4 * n * heads * hd));
            let parts = Mem::zeroed(d, 4 * meta.b.partial_floats(kv_heads, heads / kv_heads, hd));
            let store = dev.store(kv.pool());
            let (qp, o, pp) = (qm.ptr(), out.ptr(), parts.ptr());
            attention(d, &store, &meta.b, 0, qp, q_stride, heads, o, pp).unwrap();
            let (exact, bound) = attention_f64(kv.pool(), &batch, &q, heads, kv_heads, hd);
            let what = format!("{dtype:?}, pages of {page_size}, {heads}/{kv_heads} heads of {hd}");
            // Both f32 attentions against the exact one, each element within its rounding-error bound (an
            // f32 result is no oracle for another: the device and the CPU kernels sum in different orders).
            // Measured here: at most 0.04 of the bound (the scalar path; the simulator and the SIMD
            // kernels 0.01), while a position left out moves a typical row's worst element ~1000 times past it
            // (over 120 times on 90% of rows).
            let eps = 1.0;
            close(&out.f32s(), &exact, &bound, eps, &format!("device, {what}"));
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
        );
        assert!(
            matches!(r, Err(DeviceError::Unsupported { .. })),
            "{heads}: {r:?}"
        );
    }
}

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

#[test]
fn fused_norm_and_swiglu_quantization_equal_the_unfused_kernels() {
    on_every_device(fused_quantization_on);
}

fn fused_quantization_on(dev: &dyn TestDev) {
    let rows = 3;
    for width in [64, 576, 2048] {
        let (xs, ws) = (data(rows * width, width as u64), data(width, 8));
        let (x, w) = (Mem::from_f32(dev, &xs), Mem::from_f32(dev, &ws));
        let acts = |x: DevPtr, q: &Mem<'_>, ds: &Mem<'_>| Acts {
            x,
            q: q.ptr(),
            ds: ds.ptr(),
            tokens: rows,
            cols: width,
        };
        // Unfused: the norm's floats, then their quantization.
        let normed = Mem::zeroed(dev, 4 * rows * width);
        rmsnorm(dev, x.ptr(), w.ptr(), normed.ptr(), rows, width, 1e-5).unwrap();
        let (q0, ds0) = (
            Mem::zeroed(dev, Acts::q_bytes(rows, width)),
            Mem::zeroed(dev, Acts::ds_bytes(rows, width)),
        );
        quantize_q8_1(dev, &acts(normed.ptr(), &q0, &ds0)).unwrap();
        // Fused.
        let (q1, ds1, out) = (
            Mem::zeroed(dev, Acts::q_bytes(rows, width)),
            Mem::zeroed(dev, Acts::ds_bytes(rows, width)),
            Mem::zeroed(dev, 4 * rows * width),
        );
        let a = acts(x.ptr(), &q1, &ds1);
        rmsnorm_quantize(dev, x.ptr(), w.ptr(), &a, Some(out.ptr()), 1e-5).unwrap();
        assert_eq!(q1.bytes(), q0.bytes(), "norm+quantize q, width {width}");
        assert_eq!(
            ds1.bytes(),
            ds0.bytes(),
            "norm+quantize scales, width {width}"
        );
        assert_eq!(
            out.bytes(),
            normed.bytes(),
            "norm+quantize floats, width {width}"
        );

        // SwiGLU of fused gate/up rows, then quantization; and fused.
        let gu = Mem::from_f32(dev, &data(rows * 2 * width, 9 + width as u64));
        let act = Mem::zeroed(dev, 4 * rows * width);
        swiglu_rows(dev, gu.ptr(), act.ptr(), rows, width).unwrap();
        quantize_q8_1(dev, &acts(act.ptr(), &q0, &ds0)).unwrap();
        swiglu_quantize(dev, gu.ptr(), &acts(DevPtr(0), &q1, &ds1)).unwrap();
        assert_eq!(q1.bytes(), q0.bytes(), "swiglu+quantize q, width {width}");
        assert_eq!(
            ds1.bytes(),
            ds0.bytes(),
            "swiglu+quantize scales, width {width}"
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
        bm.build(&batch, 7).unwrap();
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
