//! The CUDA backend's API when CUDA is compiled out: same names, and [`open`] returns
//! [`super::DeviceError::CudaNotCompiled`].

use super::DeviceError;
use super::gpu::GpuDevice;

/// Opens GPU `ordinal` (never, in this build).
pub fn open(ordinal: usize) -> Result<GpuDevice, DeviceError> {
    let _ = ordinal;
    Err(DeviceError::CudaNotCompiled)
}

/// Whether a CUDA driver is present (never, without the feature).
pub fn is_available() -> bool {
    false
}
