//! The GPU device's weight matrices ([`GpuMatrix`]): uploaded (Q4_1 packed for aligned loads), read in
//! place on a GPU that reads host memory, or stacked (fused QKV, gate/up).

use super::GpuDevice;
use super::launch::{self, DevPtr, Layout, Weights};
use crate::backend::DeviceError;
use crate::backend::gpu::mem::DevMem;
use crate::quant::{GgmlType, dequantize_ref};
use std::sync::Arc;

/// A weight matrix in device memory.
///
/// Its rows are one or more parts, each contiguous: one, for a matrix uploaded (or stacked by a copy); a
/// stacked matrix whose parts are read in place where the model file has them keeps them apart, and a
/// product runs one launch per part into its rows of the output.
#[derive(Debug)]
pub struct GpuMatrix {
    /// The whole matrix (its address is the first part's).
    pub(super) w: Weights,
    pub(super) parts: Vec<Weights>,
    /// The memory behind the parts (or the mapping that holds them).
    pub(super) mems: Vec<DevMem>,
}

impl GpuMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.w.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.w.cols
    }

    /// Bytes a matrix-vector product reads.
    pub fn bytes(&self) -> usize {
        self.mems.iter().map(|m| m.bytes).sum()
    }

    /// Whether its weights are read in place in host memory (see [`GpuRuntime::host_address`](crate::backend::gpu::GpuRuntime::host_address)).
    pub fn in_place(&self) -> bool {
        self.mems.iter().any(|m| m.in_place)
    }
}

impl GpuDevice {
    /// `rows × cols` weights of type `ty` (GGUF bytes), in device memory. Types without a kernel are
    /// dequantized on the host and uploaded as f32.
    pub fn matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<GpuMatrix, DeviceError> {
        let w = Weights {
            ptr: DevPtr(0),
            ty,
            rows,
            cols,
            scale: 1.0,
            layout: Layout::Gguf,
        };
        if w.check().is_err() {
            let rb = ty.row_bytes(cols).ok_or_else(|| DeviceError::Unsupported {
                device: "the GPU",
                what: format!("rows of {cols} weights of type {ty}"),
            })?;
            let mut f = vec![0f32; rows * cols];
            for (src, dst) in data.chunks_exact(rb).zip(f.chunks_exact_mut(cols)) {
                dequantize_ref(ty, src, dst)?;
            }
            return self.matrix_f32(rows, cols, &f);
        }
        self.upload_weights(w, data)
    }

    /// `rows × cols` f32 weights (row-major), in device memory.
    pub fn matrix_f32(
        &self,
        rows: usize,
        cols: usize,
        f: &[f32],
    ) -> Result<GpuMatrix, DeviceError> {
        let w = Weights {
            ptr: DevPtr(0),
            ty: GgmlType::F32,
            rows,
            cols,
            scale: 1.0,
            layout: Layout::Gguf,
        };
        self.upload_weights(w, bytemuck::cast_slice(f))
    }

    /// Weights from a mapping `owner` keeps alive (a model file's tensor): read where they are on a GPU
    /// that reads host memory in place ([`GpuRuntime::host_address`](crate::backend::gpu::GpuRuntime::host_address): unified memory, as on Jetson Thor),
    /// else as [`GpuDevice::matrix`] does.
    pub fn mapped_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
        owner: &Arc<dyn Send + Sync>,
    ) -> Result<GpuMatrix, DeviceError> {
        let mut w = Weights {
            ptr: DevPtr(0),
            ty,
            rows,
            cols,
            scale: 1.0,
            layout: Layout::Gguf,
        };
        let Some(ptr) = self.q.rt.host_address(data).filter(|_| w.check().is_ok()) else {
            return self.matrix(ty, rows, cols, data);
        };
        if ty.row_bytes(cols).map(|rb| rb * rows) != Some(data.len()) {
            return Err(DeviceError::Unsupported {
                device: "the GPU",
                what: format!(
                    "{} bytes for {rows} rows of {cols} weights of type {ty}",
                    data.len()
                ),
            });
        }
        w.ptr = ptr;
        let mem = DevMem {
            ptr,
            bytes: data.len(),
            in_place: true,
            _owner: Box::new(Arc::clone(owner)),
        };
        Ok(GpuMatrix {
            w,
            parts: vec![w],
            mems: vec![mem],
        })
    }

    fn upload_weights(&self, mut w: Weights, data: &[u8]) -> Result<GpuMatrix, DeviceError> {
        w.check()?;
        let packed = (w.ty == GgmlType::Q4_1
            && self.packed.load(std::sync::atomic::Ordering::Relaxed))
        .then(|| launch::repack_q4_1(data, w.rows, w.cols))
        .flatten();
        if packed.is_some() {
            w.layout = Layout::Packed;
        }
        let data = packed.as_deref().unwrap_or(data);
        let mem = self.q.alloc(data.len())?;
        self.q.upload(mem.ptr(), data)?;
        w.ptr = mem.ptr();
        Ok(GpuMatrix {
            w,
            parts: vec![w],
            mems: vec![mem],
        })
    }

    /// Matrices of one type and width stacked along the output dimension (fused QKV, gate/up): copied
    /// into one allocation, or, for weights read in place, kept where they are as the parts of one matrix.
    pub fn concat(&self, parts: Vec<GpuMatrix>) -> Option<GpuMatrix> {
        let first = parts.first()?.w;
        if parts.iter().any(|p| {
            p.w.ty != first.ty
                || p.w.cols != first.cols
                || p.w.scale != first.scale
                || p.w.layout != first.layout
        }) {
            return None;
        }
        let w = Weights {
            rows: parts.iter().map(|p| p.w.rows).sum(),
            ..first
        };
        if parts.iter().any(GpuMatrix::in_place) {
            let (mut ws, mut mems) = (Vec::new(), Vec::new());
            for p in parts {
                ws.extend(p.parts);
                mems.extend(p.mems);
            }
            return Some(GpuMatrix { w, parts: ws, mems });
        }
        let total: usize = parts.iter().map(GpuMatrix::bytes).sum();
        let mem = self.q.alloc(total).ok()?;
        let mut at = 0;
        for p in &parts {
            for (part, m) in p.parts.iter().zip(&p.mems) {
                self.q.copy(mem.ptr().offset(at), part.ptr, m.bytes).ok()?;
                at += m.bytes;
            }
        }
        let w = Weights {
            ptr: mem.ptr(),
            ..w
        };
        Some(GpuMatrix {
            w,
            parts: vec![w],
            mems: vec![mem],
        })
    }
}
