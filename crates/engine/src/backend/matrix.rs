//! Weights in a device's layout ([`Matrix`]: a CPU [`QMatrix`] or a [`gpu::GpuMatrix`]), a matmul's
//! prepared [`Input`], the per-forward buffers a caller keeps ([`Workspace`]), and the [`Device`] ops that
//! make the matrices and multiply by them.

use super::cpu::qmatmul::{QActs, QMatrix};
use super::{Buf, Device, DeviceError, View, ViewMut, cpu, gpu};
use crate::quant::GgmlType;

/// A weight matrix in its device's layout (`rows` outputs of `cols` inputs).
#[derive(Debug)]
pub struct Matrix {
    pub(super) m: MatrixKind,
}

#[derive(Debug)]
pub(super) enum MatrixKind {
    Cpu(QMatrix),
    Gpu(gpu::GpuMatrix),
}

impl Matrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        match &self.m {
            MatrixKind::Cpu(q) => q.rows,
            MatrixKind::Gpu(g) => g.rows(),
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match &self.m {
            MatrixKind::Cpu(q) => q.cols,
            MatrixKind::Gpu(g) => g.cols(),
        }
    }

    /// Bytes a matrix-vector product reads.
    pub fn bytes(&self) -> usize {
        match &self.m {
            MatrixKind::Cpu(q) => q.bytes(),
            MatrixKind::Gpu(g) => g.bytes(),
        }
    }

    /// Whether its weights are read in place in host memory (see [`Device::mapped_matrix`]).
    pub fn in_place(&self) -> bool {
        matches!(&self.m, MatrixKind::Gpu(g) if g.in_place())
    }

    pub(super) fn cpu(&self) -> &QMatrix {
        match &self.m {
            MatrixKind::Cpu(q) => q,
            MatrixKind::Gpu(_) => panic!("a GPU matrix given to the CPU device"),
        }
    }

    pub(super) fn gpu(&self) -> &gpu::GpuMatrix {
        match &self.m {
            MatrixKind::Gpu(g) => g,
            MatrixKind::Cpu(_) => panic!("a CPU matrix given to the GPU device"),
        }
    }
}

/// Per-forward device buffers (quantized activations, attention partials), reused across calls.
#[derive(Debug, Default)]
pub struct Workspace {
    pub(super) qa: QActs,
    pub(super) partials: Vec<f32>,
    /// The CPU attention's tiles of tokens (first, end, whether every position they see is in place).
    pub(super) tiles: Vec<(usize, usize, bool)>,
    pub(super) gpu: gpu::Quantized,
}

impl Workspace {
    /// Whether the inputs prepared with it are prepared at once, their floats written (on by the reference
    /// path, which reads them), or may be left to each matrix product's prologue on a GPU (the default).
    pub fn eager(&mut self, on: bool) {
        self.gpu.eager = on;
    }
}

/// Activations prepared as a matmul input: `n` rows of `cols` floats (and their 8-bit blocks: the CPU's, or
/// the GPU's quantized copy).
#[derive(Debug)]
pub struct Input<'a> {
    pub(super) x: View<'a>,
    pub(super) n: usize,
    pub(super) cols: usize,
    pub(super) qa: &'a QActs,
    pub(super) acts: Option<gpu::launch::Acts>,
}

impl Device {
    /// `rows` rows of `cols` weights of type `ty` (GGUF bytes) in this device's layout.
    pub fn matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Matrix, DeviceError> {
        match self {
            Device::Cpu(_) => Ok(Matrix {
                m: MatrixKind::Cpu(QMatrix::from_ggml(ty, rows, cols, data)?),
            }),
            Device::Cuda(g) => Ok(Matrix {
                m: MatrixKind::Gpu(g.matrix(ty, rows, cols, data)?),
            }),
        }
    }

    /// [`Device::matrix`] of bytes a mapping keeps where they are while `owner` lives (a model file's
    /// tensor): a GPU that reads host memory in place (unified memory: Jetson Thor) keeps `owner` and reads
    /// the weights there instead of a copy; every other device lays them out as [`Device::matrix`] does.
    pub fn mapped_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
        owner: &std::sync::Arc<dyn Send + Sync>,
    ) -> Result<Matrix, DeviceError> {
        match self {
            Device::Cpu(_) => self.matrix(ty, rows, cols, data),
            Device::Cuda(g) => Ok(Matrix {
                m: MatrixKind::Gpu(g.mapped_matrix(ty, rows, cols, data, owner)?),
            }),
        }
    }

    /// A matrix of f32 rows (`f` is `rows × cols`, row-major).
    pub fn matrix_f32(&self, rows: usize, cols: usize, f: Vec<f32>) -> Result<Matrix, DeviceError> {
        Ok(Matrix {
            m: match self {
                Device::Cpu(_) => MatrixKind::Cpu(QMatrix::from_f32(rows, cols, f)),
                Device::Cuda(g) => MatrixKind::Gpu(g.matrix_f32(rows, cols, &f)?),
            },
        })
    }

    /// Matrices with the same input size and layout stacked along the output dimension (fused QKV, gate/up);
    /// `None` when they do not share a layout.
    pub fn concat(&self, parts: Vec<Matrix>) -> Option<Matrix> {
        if parts.len() == 1 {
            return parts.into_iter().next();
        }
        let n = parts.len();
        match self {
            Device::Cpu(_) => {
                let qs: Vec<QMatrix> = parts
                    .into_iter()
                    .filter_map(|m| match m.m {
                        MatrixKind::Cpu(q) => Some(q),
                        MatrixKind::Gpu(_) => None,
                    })
                    .collect();
                if qs.len() != n {
                    return None;
                }
                QMatrix::concat(&qs).map(|q| Matrix {
                    m: MatrixKind::Cpu(q),
                })
            }
            Device::Cuda(g) => {
                let gs: Vec<gpu::GpuMatrix> = parts
                    .into_iter()
                    .filter_map(|m| match m.m {
                        MatrixKind::Gpu(g) => Some(g),
                        MatrixKind::Cpu(_) => None,
                    })
                    .collect();
                if gs.len() != n {
                    return None;
                }
                g.concat(gs).map(|m| Matrix {
                    m: MatrixKind::Gpu(m),
                })
            }
        }
    }

    /// Prepares `n` rows of `cols` activations of `x` as the input of one or more [`Device::matmul`]s (the
    /// CPU quantizes them to 8 bits per block of 32 here, once for every matrix that reads them).
    pub fn input<'a>(
        &self,
        x: impl Into<View<'a>>,
        n: usize,
        cols: usize,
        ws: &'a mut Workspace,
    ) -> Input<'a> {
        let x = x.into().slice(..n * cols);
        let acts = match self {
            Device::Cpu(c) => {
                c.quantize(x.host(), n, cols, &mut ws.qa);
                None
            }
            Device::Cuda(g) => g.input(x, n, cols, &mut ws.gpu),
        };
        Input {
            x,
            n,
            cols,
            qa: &ws.qa,
            acts,
        }
    }

    /// `out[t * w.rows + r] = W[r] · x[t]` for every row of `x` (`out` grows to fit).
    pub fn matmul(&self, w: &Matrix, x: &Input<'_>, out: &mut Buf) {
        debug_assert_eq!(x.cols, w.cols(), "matmul input width");
        let n = x.n * w.rows();
        if let Err(e) = self.grow(out, n) {
            panic!("matmul output: {e}");
        }
        match self {
            Device::Cpu(c) => c.matmul(w.cpu(), x.qa, x.x.host(), out.at_mut(..).host()),
            Device::Cuda(g) => g.matmul(w.gpu(), x.x, x.n, x.acts, out.at_mut(..n), false),
        }
    }

    /// The check path of a matmul: rows `row0..row0 + rows` of `out` (stride `stride` per token) from `rows`
    /// stored rows of type `ty` dotted with f32 `x` (`n` tokens of `cols`), accumulated in f64 by the scalar
    /// reference kernel. Slow by design; the fast path is [`Device::matmul`].
    #[expect(clippy::too_many_arguments, reason = "a strided block of the output")]
    pub fn matmul_reference<'v>(
        &self,
        ty: GgmlType,
        data: &[u8],
        rows: usize,
        x: impl Into<View<'v>>,
        n: usize,
        cols: usize,
        out: impl Into<ViewMut<'v>>,
        stride: usize,
        row0: usize,
    ) -> Result<(), DeviceError> {
        let (x, mut out) = (x.into(), out.into());
        if !ty.has_reference_kernel() {
            return Err(DeviceError::Unsupported {
                device: "the reference path",
                what: format!("weights of type {ty}"),
            });
        }
        let rb = ty.row_bytes(cols).ok_or_else(|| DeviceError::Unsupported {
            device: "the reference path",
            what: format!("rows of {cols} weights of type {ty}"),
        })?;
        match self {
            Device::Cpu(c) => {
                c.reference_matmul(
                    ty,
                    data,
                    rb,
                    rows,
                    x.host(),
                    n,
                    cols,
                    out.host(),
                    stride,
                    row0,
                );
            }
            // The check path runs on the host for every device: the GPU's buffers make the trip.
            Device::Cuda(g) => {
                let (x, mut o) = (g.download(x), g.download(out.as_view()));
                cpu::rows::reference_matmul(ty, data, rb, rows, &x, n, cols, &mut o, stride, row0);
                g.upload(&out.slice(..), &o);
            }
        }
        Ok(())
    }
}
