//! The CUDA backend's API when CUDA is compiled out: same names, and [`open`] returns
//! [`crate::backend::DeviceError::CudaNotCompiled`].

use super::GpuDevice;
use crate::backend::DeviceError;

/// Opens GPU `ordinal` with its kernels cached in `kernel_cache` (never, in this build).
pub fn open(
    ordinal: usize,
    kernel_cache: Option<&std::path::Path>,
) -> Result<GpuDevice, DeviceError> {
    let _ = (ordinal, kernel_cache);
    Err(DeviceError::CudaNotCompiled)
}

/// Whether a CUDA driver is present (never, without the feature).
pub fn is_available() -> bool {
    false
}
