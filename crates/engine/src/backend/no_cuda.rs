//! The CUDA backend's API when CUDA is compiled out: same names, every constructor returns
//! [`DeviceError::CudaNotCompiled`](super::DeviceError::CudaNotCompiled).

use super::DeviceError;

/// A CUDA device (never constructed in this build).
#[derive(Debug)]
pub struct Cuda {
    _never: std::convert::Infallible,
}

impl Cuda {
    /// Opens GPU `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        let _ = ordinal;
        Err(DeviceError::CudaNotCompiled)
    }

    /// Whether a CUDA driver is present (never, without the feature).
    pub fn is_available() -> bool {
        false
    }
}
