//! Fused ops: what two or three device ops do, as one step where the device can (on a GPU, one kernel
//! launch instead of two or three), with the unfused ops' results bit for bit; the CPU runs the unfused
//! ops. A model calls them where one op's output only feeds the next: a norm or SwiGLU feeding a matrix
//! product, a product feeding the residual add, RoPE feeding the KV write.

use super::batch::Batch;
use super::pages::PagePool;
use super::{Buf, Device, Input, Matrix, Rope, View, ViewMut, Workspace, gpu};

impl<'a> Input<'a> {
    /// The input a GPU prepared (`acts`) for `n` rows of `cols`, with `out` as its floats.
    fn prepared(
        out: &'a Buf,
        n: usize,
        cols: usize,
        ws: &'a Workspace,
        acts: gpu::launch::Acts,
    ) -> Self {
        Input {
            x: out.at(..n * cols),
            n,
            cols,
            qa: &ws.qa,
            acts: Some(acts),
        }
    }

    /// The floats it was prepared from (`rows × cols`). An input a GPU left to the products' prologue
    /// (a norm or a SwiGLU) has not written them: a caller that reads them prepares its inputs with an
    /// eager workspace ([`Workspace::eager`]).
    pub fn floats(&self) -> View<'a> {
        debug_assert!(
            self.acts.is_none_or(|a| matches!(
                a.prep,
                gpu::launch::Prep::Quantized | gpu::launch::Prep::Floats
            )),
            "the floats of an input left to the products' prologue"
        );
        self.x
    }

    /// Rows (tokens).
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }
}

impl Device {
    /// RMS norm of `n` rows of `d` floats of `x` (weight `w`) into `out` (grown to `n × d` by the caller),
    /// prepared as the input of the matrix products that read them: [`Device::rmsnorm_rows`] then
    /// [`Device::input`]. A GPU may leave the norm to each product's prologue (then `out` is not written,
    /// and the input keeps `x` and `w` borrowed; see [`Workspace::eager`]).
    #[expect(
        clippy::too_many_arguments,
        reason = "a norm's shape and its two outputs"
    )]
    pub fn norm_input<'a>(
        &self,
        x: impl Into<View<'a>>,
        w: impl Into<View<'a>>,
        eps: f32,
        n: usize,
        d: usize,
        out: &'a mut Buf,
        ws: &'a mut Workspace,
    ) -> Input<'a> {
        let (x, w) = (x.into(), w.into());
        if let Device::Cuda(g) = self
            && let Some(acts) = g.norm_input(x, w, eps, n, d, out.at_mut(..n * d), &mut ws.gpu)
        {
            return Input::prepared(out, n, d, ws, acts);
        }
        self.rmsnorm_rows(x, w, eps, n, d, out.at_mut(..n * d));
        let out: &'a Buf = out;
        self.input(out.at(..n * d), n, d, ws)
    }

    /// SwiGLU of `n` fused `[gate (f) | up (f)]` rows of `gu` into `out` (grown to `n × f` by the caller),
    /// prepared as the down projection's input: [`Device::swiglu_rows`] then [`Device::input`]. A GPU may
    /// leave the SwiGLU to the product's prologue (then `out` is not written).
    pub fn swiglu_input<'a>(
        &self,
        gu: impl Into<View<'a>>,
        n: usize,
        f: usize,
        out: &'a mut Buf,
        ws: &'a mut Workspace,
    ) -> Input<'a> {
        let gu = gu.into();
        if let Device::Cuda(g) = self
            && let Some(acts) = g.swiglu_input(gu, n, f, out.at_mut(..n * f), &mut ws.gpu)
        {
            return Input::prepared(out, n, f, ws, acts);
        }
        self.swiglu_rows(gu, n, f, out.at_mut(..n * f));
        let out: &'a Buf = out;
        self.input(out.at(..n * f), n, f, ws)
    }

    /// `out[t * w.rows + r] += W[r] · x[t]` for every row of `x` (a residual; `out` holds at least
    /// `x.rows × w.rows`): [`Device::matmul`] into `tmp` then [`Device::add`] (a GPU adds as it writes and
    /// leaves `tmp` alone).
    pub fn matmul_add(&self, w: &Matrix, x: &Input<'_>, out: &mut Buf, tmp: &mut Buf) {
        debug_assert_eq!(x.cols, w.cols(), "matmul input width");
        let n = x.n * w.rows();
        assert!(out.len() >= n, "matmul_add output too small");
        match self {
            Device::Cpu(_) => {
                self.matmul(w, x, tmp);
                self.add(out.at_mut(..n), tmp.at(..n));
            }
            Device::Cuda(g) => g.matmul(w.gpu(), x.x, x.n, x.acts, out.at_mut(..n), true),
        }
    }

    /// RoPE of fused QKV rows `stride` apart (`n_heads` query heads, then the pool's KV heads for K and
    /// for V, `head_dim` each) at the batch's positions, then their K and V into `layer`'s page slots:
    /// [`Device::rope_rows`] over the Q and K heads then [`Device::write_kv_rows`].
    #[expect(
        clippy::too_many_arguments,
        reason = "a strided batch of rows and its pages"
    )]
    pub fn rope_write_kv<'v>(
        &self,
        kind: Rope,
        pool: &mut PagePool,
        batch: &Batch,
        layer: usize,
        rows: impl Into<ViewMut<'v>>,
        stride: usize,
        n_heads: usize,
        table: &[(f32, f32)],
        n_angles: usize,
    ) {
        let mut rows = rows.into();
        if let Device::Cuda(g) = self
            && g.rope_write_kv(
                kind,
                pool,
                batch,
                layer,
                rows.slice(..),
                stride,
                n_heads,
                table,
                n_angles,
            )
        {
            return;
        }
        let shape = pool.shape();
        let hd = shape.head_dim;
        let (qw, width) = (n_heads * hd, (n_heads + shape.n_kv_heads) * hd);
        self.rope_rows(
            kind,
            rows.slice(..),
            batch.len(),
            stride,
            width,
            hd,
            &batch.pos,
            table,
            n_angles,
        );
        let all = rows.as_view();
        self.write_kv_rows(
            pool,
            batch,
            layer,
            all.slice(qw..),
            all.slice(width..),
            stride,
        );
    }
}
