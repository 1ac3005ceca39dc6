//! The matrix products' prologue (an input normed, SwiGLU'd or quantized by the product's own kernel)
//! against the unfused launches it replaces, bit for bit, on every device.

use super::*;

/// How the prologue's input is made, for one test case.
#[derive(Clone, Copy, Debug)]
enum Case {
    Floats,
    Norm,
    Swiglu,
}

/// `tokens` rows of `cols` through a product of `ty` with the input prepared by the unfused kernels and by
/// the prologue; the outputs (plain and added to a residual) must have the same bits.
fn check(
    d: &dyn TestDev,
    case: Case,
    (ty, layout): (GgmlType, Layout),
    rows: usize,
    cols: usize,
    tokens: usize,
) {
    let what = format!("{case:?} {ty} ({layout:?}) {rows}x{cols}, {tokens} tokens");
    let width = match case {
        Case::Swiglu => 2 * cols,
        _ => cols,
    };
    let src = Mem::from_f32(d, &data(tokens * width, 31 + cols as u64));
    let nw = Mem::from_f32(d, &data(cols, 32));
    let eps = 1e-5;
    // Unfused: the floats the prologue would compute, then their quantized copy.
    let floats = Mem::zeroed(d, 4 * tokens * cols);
    let x = match case {
        Case::Floats => src.ptr(),
        Case::Norm => {
            rmsnorm(d, src.ptr(), nw.ptr(), floats.ptr(), tokens, cols, eps).unwrap();
            floats.ptr()
        }
        Case::Swiglu => {
            swiglu_rows(d, src.ptr(), floats.ptr(), tokens, cols).unwrap();
            floats.ptr()
        }
    };
    let (q, ds) = (
        Mem::zeroed(d, Acts::q_bytes(tokens, cols)),
        Mem::zeroed(d, Acts::ds_bytes(tokens, cols)),
    );
    let eager = Acts {
        x,
        q: q.ptr(),
        ds: ds.ptr(),
        tokens,
        cols,
        prep: Prep::Quantized,
    };
    quantize_q8_1(d, &eager).unwrap();
    let deferred = Acts {
        x: src.ptr(),
        q: DevPtr(0),
        ds: DevPtr(0),
        prep: match case {
            Case::Floats => Prep::Floats,
            Case::Norm => Prep::Norm { w: nw.ptr(), eps },
            Case::Swiglu => Prep::Swiglu,
        },
        ..eager
    };
    let bytes = weights(ty, rows, cols, 33);
    let wmem = Mem::from_bytes(d, &laid_out(&bytes, ty, layout, rows, cols));
    let w = Weights {
        ptr: wmem.ptr(),
        ty,
        rows,
        cols,
        scale: 1.0,
        layout,
    };
    let residual = data(tokens * rows, 34);
    let mut outs = vec![];
    for a in [&eager, &deferred] {
        let (plain, added) = (
            Mem::zeroed(d, 4 * tokens * rows),
            Mem::from_f32(d, &residual),
        );
        matvec(d, &w, a, plain.ptr(), rows, false).unwrap();
        matvec(d, &w, a, added.ptr(), rows, true).unwrap();
        outs.push((plain.bytes(), added.bytes()));
    }
    assert_eq!(outs[0].0, outs[1].0, "{what}: the products");
    assert_eq!(outs[0].1, outs[1].1, "{what}: the products added");
    // And they are products: not all zero.
    assert!(outs[1].0.iter().any(|&b| b != 0), "{what}: all zero");
}

#[test]
fn a_prologue_gives_the_bits_of_the_unfused_launches() {
    on_every_device(a_prologue_gives_the_bits_of_the_unfused_launches_on);
}

fn a_prologue_gives_the_bits_of_the_unfused_launches_on(d: &dyn TestDev) {
    let layouts = FORMATS
        .map(|ty| (ty, Layout::Gguf))
        .into_iter()
        .chain([(GgmlType::Q4_1, Layout::Packed)]);
    for (ty, layout) in layouts {
        let cols = if ty.block_size() == 256 { 512 } else { 576 };
        for case in [Case::Floats, Case::Norm, Case::Swiglu] {
            // Rows not a multiple of the block's 4; one token (decode), an odd count, a full launch, two
            // launches (each with its own prologue).
            for tokens in [1, 3, MATVEC_TOKENS, MATVEC_TOKENS + 3] {
                check(d, case, (ty, layout), 13, cols, tokens);
            }
        }
    }
    // More rows than the prologue's capped grid covers: blocks stride over them (a packed warp's first
    // row was loaded before its prologue, the next ones after).
    check(
        d,
        Case::Norm,
        (GgmlType::Q8_0, Layout::Gguf),
        4 * 1024 + 9,
        64,
        1,
    );
    check(
        d,
        Case::Norm,
        (GgmlType::Q4_1, Layout::Packed),
        4 * 1024 + 9,
        64,
        1,
    );
}

#[test]
fn a_prologue_takes_only_what_fits_its_shared_memory() {
    on_every_device(a_prologue_takes_only_what_fits_its_shared_memory_on);
}

fn a_prologue_takes_only_what_fits_its_shared_memory_on(d: &dyn TestDev) {
    assert!(Acts::deferrable(MATVEC_TOKENS, 576));
    assert!(
        !Acts::deferrable(MATVEC_TOKENS + 1, 576),
        "two launches: quantized once instead"
    );
    assert!(!Acts::deferrable(1, 48), "not whole blocks");
    assert!(!Acts::deferrable(8, 8192), "beyond the shared memory");
    let w = Weights {
        ptr: DevPtr(0),
        ty: GgmlType::Q4_0,
        rows: 4,
        cols: 8192,
        scale: 1.0,
        layout: Layout::Gguf,
    };
    let a = Acts {
        x: DevPtr(0),
        q: DevPtr(0),
        ds: DevPtr(0),
        tokens: MATVEC_TOKENS,
        cols: 8192,
        prep: Prep::Floats,
    };
    let r = matvec(d, &w, &a, DevPtr(0), 4, false);
    assert!(
        matches!(r, Err(DeviceError::Unsupported { .. })),
        "a prologue of {} x {}: {r:?}",
        a.tokens,
        a.cols
    );
}
