//! The CPU device's batch-wide row ops: the loops that run a kernel of [`super::simd`], [`super::ops`] or
//! [`super::gdn`] over every row (token, head) of a batch, for the [`Device`](crate::backend::Device) ops
//! that the CPU runs on the calling thread, and the host half of the reference matmul and the embedding
//! that every device shares.

use super::ops::{rope_neox, rope_table};
use super::{Cpu, gdn, simd};
use crate::backend::Rope;
use crate::backend::batch::Batch;
use crate::backend::pages::PagePool;
use crate::quant::{GgmlType, QuantError, dequantize_ref, dot_ref};

/// Row `token` of an embedding table of type `ty` (`rb` bytes a row), dequantized exactly into `out`.
pub fn embed_row(
    ty: GgmlType,
    table: &[u8],
    rb: usize,
    token: u32,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let r = token as usize;
    dequantize_ref(ty, &table[r * rb..(r + 1) * rb], out)
}

/// Rows `tokens` of an embedding table (`d` values a row of `rb` bytes) into `out` (`tokens.len() × d`).
pub fn embed(
    ty: GgmlType,
    table: &[u8],
    rb: usize,
    d: usize,
    tokens: &[u32],
    out: &mut [f32],
) -> Result<(), QuantError> {
    for (t, &token) in tokens.iter().enumerate() {
        embed_row(ty, table, rb, token, &mut out[t * d..(t + 1) * d])?;
    }
    Ok(())
}

/// RMSNorm of `n` rows of `d` floats of `x` with weight `w` into `out`.
pub fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, n: usize, d: usize, out: &mut [f32]) {
    for (xr, o) in x[..n * d].chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        simd::rmsnorm(xr, w, eps, o);
    }
}

/// RoPE of the rows of `x` at `positions` (see [`Device::rope_rows`](crate::backend::Device::rope_rows)).
#[expect(clippy::too_many_arguments, reason = "a strided batch of rows")]
pub fn rope_rows(
    kind: Rope,
    x: &mut [f32],
    stride: usize,
    width: usize,
    head_dim: usize,
    positions: &[u32],
    table: &[(f32, f32)],
    n_angles: usize,
) {
    for (t, &p) in positions.iter().enumerate() {
        let p = p as usize;
        let angles = &table[p * n_angles..(p + 1) * n_angles];
        let row = &mut x[t * stride..t * stride + width];
        match kind {
            Rope::Normal => rope_table(row, head_dim, angles),
            Rope::Neox => {
                for head in row.chunks_exact_mut(head_dim) {
                    rope_neox(head, angles);
                }
            }
        }
    }
}

/// Every token's keys and values of `layer` into its KV page slot (token `t`'s at `k[t * stride..]` and
/// `v[t * stride..]`).
pub fn write_kv_rows(
    pool: &mut PagePool,
    batch: &Batch,
    layer: usize,
    k: &[f32],
    v: &[f32],
    stride: usize,
) {
    let w = pool.shape().n_kv_heads * pool.shape().head_dim;
    let ps = pool.page_size();
    for t in 0..batch.len() {
        let (span, slot) = batch.locate(t);
        let (k, v) = (
            &k[t * stride..t * stride + w],
            &v[t * stride..t * stride + w],
        );
        pool.write(batch.pages(span)[slot / ps], slot % ps, layer, k, v);
    }
}

/// `x *= sigmoid(gate)`, element-wise.
pub fn sigmoid_gate(x: &mut [f32], gate: &[f32]) {
    for (v, &g) in x.iter_mut().zip(gate) {
        *v *= gdn::sigmoid(g);
    }
}

/// The delta-rule recurrence of every value head over a run (`run.head` is ignored): `state` holds the
/// heads' `[dk][dv]` matrices; `steps` keeps each head's matrix after the run's last tokens, from its offset.
pub fn gdn_recurrence(
    shape: &gdn::Shape,
    run: &gdn::HeadRun<'_>,
    state: &mut [f32],
    out: &mut [f32],
    mut steps: Option<gdn::Steps<'_>>,
) {
    let base = steps.as_ref().map_or(0, |s| s.offset);
    let hs = shape.dk * shape.dv;
    for (h, head) in state.chunks_exact_mut(hs).take(shape.vh).enumerate() {
        if let Some(st) = steps.as_mut() {
            st.offset = base + h * hs;
        }
        let run = gdn::HeadRun { head: h, ..*run };
        gdn::recurrence(shape, &run, head, out, steps.as_mut());
    }
}

/// The chunked (WY) recurrence of every value head over a run (`run.head` is ignored).
pub fn gdn_chunked(shape: &gdn::Shape, run: &gdn::HeadRun<'_>, state: &mut [f32], out: &mut [f32]) {
    let hs = shape.dk * shape.dv;
    for (h, head) in state.chunks_exact_mut(hs).take(shape.vh).enumerate() {
        let run = gdn::HeadRun { head: h, ..*run };
        gdn::chunked(shape, &run, head, out);
    }
}

/// The reference dot product of stored row `r` (type `ty`, `rb` bytes a row of `data`) with token `t` of
/// `x` (`cols` floats a token), accumulated in f64; NaN where the row does not decode.
pub fn reference_dot(
    ty: GgmlType,
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    r: usize,
    t: usize,
) -> f32 {
    dot_ref(
        ty,
        &data[r * rb..(r + 1) * rb],
        &x[t * cols..(t + 1) * cols],
    )
    .unwrap_or(f32::NAN)
}

/// The reference matmul on the host, on one thread: `out[t * stride + row0 + r]` for `r < rows`, `t < n`
/// (a GPU's check path, on its buffers' host copies).
#[expect(clippy::too_many_arguments, reason = "a strided block of the output")]
pub fn reference_matmul(
    ty: GgmlType,
    data: &[u8],
    rb: usize,
    rows: usize,
    x: &[f32],
    n: usize,
    cols: usize,
    out: &mut [f32],
    stride: usize,
    row0: usize,
) {
    for t in 0..n {
        for r in 0..rows {
            out[t * stride + row0 + r] = reference_dot(ty, data, rb, cols, x, r, t);
        }
    }
}

impl Cpu {
    /// The reference matmul with the rows split across threads (see [`reference_matmul`]).
    #[expect(clippy::too_many_arguments, reason = "a strided block of the output")]
    pub fn reference_matmul(
        &self,
        ty: GgmlType,
        data: &[u8],
        rb: usize,
        rows: usize,
        x: &[f32],
        n: usize,
        cols: usize,
        out: &mut [f32],
        stride: usize,
        row0: usize,
    ) {
        self.map_rows(rows, n, stride, row0, out, &|r, t| {
            reference_dot(ty, data, rb, cols, x, r, t)
        });
    }
}
