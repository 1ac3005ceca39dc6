//! The activation quantizers (plain and fused behind the norm and SwiGLU) and the matrix-vector products
//! over every weight format, against the CPU backend's references.

use super::*;

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
        prep: Prep::Quantized,
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
            prep: Prep::Quantized,
        }
    };
    assert!(matches!(
        quantize_q8_1(d, &bad),
        Err(DeviceError::Unsupported { .. })
    ));
}

/// Checks matvec for `ty` over `tokens` tokens against the dequantized weights times the dequantized
/// activations (the quantized ones for block formats), summed in f64; with `gap`, its outputs are one
/// part of rows `rows + gap` apart, and the gap is left as it was. With `add` the products are added to
/// what the output holds, with the bits of the product then a separate add.
#[expect(clippy::too_many_arguments, reason = "a test case's shape")]
fn check_matvec(
    d: &dyn TestDev,
    ty: GgmlType,
    layout: Layout,
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
    let wmem = Mem::from_bytes(d, &laid_out(&bytes, ty, layout, rows, cols));
    let out = Mem::from_f32(d, &vec![7.0; tokens * stride]);
    let w = Weights {
        ptr: wmem.ptr(),
        ty,
        rows,
        cols,
        scale,
        layout,
    };
    let a = Acts {
        x: x.ptr(),
        q: q.ptr(),
        ds: ds.ptr(),
        tokens,
        cols,
        prep: Prep::Quantized,
    };
    matvec(d, &w, &a, out.ptr(), stride, false).unwrap();
    let base = data(tokens * stride, 13);
    let acc = Mem::from_f32(d, &base);
    matvec(d, &w, &a, acc.ptr(), stride, true).unwrap();
    let products = out.f32s();
    for (i, (&got, &b)) in acc.f32s().iter().zip(&base).enumerate() {
        let want = if i % stride < rows {
            b + products[i]
        } else {
            b
        };
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "matvec {ty} with add, output {i}"
        );
    }
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
    for ty in FORMATS {
        // Rows not a multiple of the block's 4; 1, 16 and 19 tokens, some a part of a wider output (19:
        // a tensor-core product for the block formats, two launches for float weights); 45 tokens over a
        // partial tile of 64 rows.
        let cols = if ty.block_size() == 256 { 512 } else { 576 };
        check_matvec(d, ty, Layout::Gguf, 13, cols, 1, 1.0, 0);
        check_matvec(d, ty, Layout::Gguf, 6, cols, MATVEC_TOKENS, 1.0, 2);
        check_matvec(d, ty, Layout::Gguf, 6, cols, 19, 1.0, 5);
        check_matvec(d, ty, Layout::Gguf, 70, cols, 45, 1.0, 3);
    }
    check_matvec(d, GgmlType::NVFP4, Layout::Gguf, 9, 256, 3, 0.375, 0);
    check_matvec(d, GgmlType::NVFP4, Layout::Gguf, 9, 256, 40, 0.375, 0);
    // Packed Q4_1: rows of fewer blocks than lanes (2, 18), of more (48: a lane takes two blocks).
    for cols in [64, 576, 1536] {
        check_matvec(d, GgmlType::Q4_1, Layout::Packed, 13, cols, 1, 1.0, 0);
        check_matvec(d, GgmlType::Q4_1, Layout::Packed, 6, cols, 19, 1.0, 5);
        check_matvec(d, GgmlType::Q4_1, Layout::Packed, 70, cols, 45, 1.0, 3);
    }
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
        prep: Prep::Quantized,
    };
    let w = |ty, cols, scale| Weights {
        ptr: DevPtr(0),
        ty,
        rows: 4,
        cols,
        scale,
        layout: Layout::Gguf,
    };
    for (ty, cols, scale) in [
        (GgmlType::Q4_K, 288, 1.0), // not whole super-blocks
        (GgmlType::Q5_0, 288, 1.0), // no kernel
        (GgmlType::F32, 288, 0.5),  // a tensor scale on floats
        (GgmlType::Q4_0, 320, 1.0), // input width differs
    ] {
        let r = matvec(d, &w(ty, cols, scale), &a, DevPtr(0), 6, false);
        assert!(
            matches!(r, Err(DeviceError::Unsupported { .. })),
            "{ty} {cols}: {r:?}"
        );
    }
    // More tokens than a tensor-core product's grid takes.
    let many = Acts {
        tokens: 65_535 * GEMM_TOKENS + 1,
        ..a
    };
    let r = matvec(d, &w(GgmlType::Q4_0, 288, 1.0), &many, DevPtr(0), 6, false);
    assert!(
        matches!(r, Err(DeviceError::Unsupported { .. })),
        "{} tokens: {r:?}",
        many.tokens
    );
    // Outputs closer together than the matrix's rows.
    let r = matvec(d, &w(GgmlType::Q4_0, 288, 1.0), &a, DevPtr(0), 3, false);
    assert!(
        matches!(r, Err(DeviceError::Unsupported { .. })),
        "a stride of 3 for 4 rows: {r:?}"
    );
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
            prep: Prep::Quantized,
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
        let floats = Mem::zeroed(dev, 4 * rows * width);
        swiglu_quantize(
            dev,
            gu.ptr(),
            &acts(DevPtr(0), &q1, &ds1),
            Some(floats.ptr()),
        )
        .unwrap();
        assert_eq!(q1.bytes(), q0.bytes(), "swiglu+quantize q, width {width}");
        assert_eq!(
            floats.bytes(),
            act.bytes(),
            "swiglu+quantize floats, width {width}"
        );
        assert_eq!(
            ds1.bytes(),
            ds0.bytes(),
            "swiglu+quantize scales, width {width}"
        );
    }
}
