//! The GPU device's fused ops: what two or three device ops do, in one launch, with their bits (see
//! [`crate::backend::Device::norm_input`] and the ops beside it). Where a kernel cannot take the shape
//! (widths that are not whole blocks of 32, FP8 pages, NeoX rotation) they say so and run nothing: the
//! device API runs the unfused ops then, as on the CPU.

use super::{GpuDevice, Quantized, fail};
use crate::backend::Rope;
use crate::backend::batch::Batch;
use crate::backend::buf::{View, ViewMut};
use crate::backend::gpu::launch::{self, Acts, Prep};
use crate::backend::pages::PagePool;
use crate::kv::KvDtype;

impl GpuDevice {
    /// RMS norm of `n` rows of `d` floats of `x` (weight `w`) as the matrix products' input: left to each
    /// product's prologue where it can take it (no launch here, `out` not written), else into `out` and
    /// its quantized copy, `rmsnorm_rows` then `input` in one launch. `None`: `d` is not whole blocks of
    /// 32, nothing ran (the caller runs the unfused ops).
    #[expect(
        clippy::too_many_arguments,
        reason = "a norm's shape and its two outputs"
    )]
    pub fn norm_input(
        &self,
        x: View<'_>,
        w: View<'_>,
        eps: f32,
        n: usize,
        d: usize,
        out: ViewMut<'_>,
        s: &mut Quantized,
    ) -> Option<Acts> {
        if !d.is_multiple_of(32) {
            return None;
        }
        assert!(
            x.len() >= n * d && out.len() >= n * d && w.len() >= d,
            "rmsnorm sizes"
        );
        let prep = Prep::Norm { w: w.ptr(), eps };
        if let Some(a) = Self::deferred(x.ptr(), n, d, prep, s) {
            return Some(a);
        }
        let (xp, wp, op) = (x.ptr(), w.ptr(), out.ptr());
        let a = self.acts(op, n, d, s);
        self.run("norm", |l| {
            launch::rmsnorm_quantize(l, xp, wp, &a, Some(op), eps)
        });
        Some(a)
    }

    /// SwiGLU of `n` fused `[gate | up]` rows of `2 f` as the down projection's input: left to its
    /// prologue where it can take it (no launch here, `out` not written), else into `out` and its quantized
    /// copy, `swiglu_rows` then `input` in one launch. `None`: `f` is not whole blocks of 32, nothing ran.
    pub fn swiglu_input(
        &self,
        gu: View<'_>,
        n: usize,
        f: usize,
        out: ViewMut<'_>,
        s: &mut Quantized,
    ) -> Option<Acts> {
        if !f.is_multiple_of(32) {
            return None;
        }
        assert!(gu.len() >= n * 2 * f && out.len() >= n * f, "swiglu sizes");
        if let Some(a) = Self::deferred(gu.ptr(), n, f, Prep::Swiglu, s) {
            return Some(a);
        }
        let (g, o) = (gu.ptr(), out.ptr());
        let a = self.acts(o, n, f, s);
        self.run("swiglu", |l| launch::swiglu_quantize(l, g, &a, Some(o)));
        Some(a)
    }

    /// RoPE of fused `[Q | K | V]` rows (`n_heads` query heads, then the pool's KV heads, of `head_dim`)
    /// and the write of their K and V into `layer`'s page slots: `rope_rows` then `write_kv_rows` in one
    /// launch, for normal rotation over f32 and f16 pages. `false`: another rotation or FP8 pages (which
    /// rescale in token order), nothing ran.
    #[expect(
        clippy::too_many_arguments,
        reason = "a strided batch of rows and its pages"
    )]
    pub fn rope_write_kv(
        &self,
        kind: Rope,
        pool: &mut PagePool,
        batch: &Batch,
        layer: usize,
        rows: ViewMut<'_>,
        stride: usize,
        n_heads: usize,
        table: &[(f32, f32)],
        n_angles: usize,
    ) -> bool {
        if kind != Rope::Normal || pool.dtype() == KvDtype::Fp8 {
            return false;
        }
        let shape = pool.shape();
        let (hd, kvw) = (shape.head_dim, shape.n_kv_heads * shape.head_dim);
        let n = batch.len();
        assert!(
            n == 0 || rows.len() >= (n - 1) * stride + n_heads * hd + 2 * kvw,
            "fused QKV rows"
        );
        let s = &mut *self.staging();
        let (pp, tp) = s
            .rope_rows(&self.q, &batch.pos[..n], table, n_angles)
            .unwrap_or_else(|e| fail("RoPE and KV write", e));
        let b = s
            .batch(&self.q, batch, pool.page_size(), self.split_cap(pool))
            .unwrap_or_else(|e| fail("RoPE and KV write", e));
        let store = Self::store_mut(pool);
        let xp = rows.ptr();
        self.run("RoPE and KV write", |l| {
            launch::rope_kv_write(l, &store, &b, layer, xp, stride, n_heads, pp, tp, n_angles)
        });
        true
    }
}
