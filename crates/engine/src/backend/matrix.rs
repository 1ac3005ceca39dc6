//! Weights in a device's layout ([`Matrix`]: a CPU [`QMatrix`] or a [`gpu::GpuMatrix`]), a matmul's
//! prepared [`Input`], and the per-forward buffers a caller keeps ([`Workspace`]).

use super::View;
use super::cpu::qmatmul::{QActs, QMatrix};
use super::gpu;

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
