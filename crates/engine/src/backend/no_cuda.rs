//! The CUDA backend's API when CUDA is compiled out: same names, and [`Cuda::new`] returns
//! [`super::DeviceError::CudaNotCompiled`], so a `Cuda` never exists and every
//! op's CUDA arm is unreachable by construction.

use super::DeviceError;

/// A CUDA device (never constructed in this build).
#[derive(Debug)]
pub struct Cuda {
    never: std::convert::Infallible,
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

    /// Proof that no value exists: lets every op's CUDA arm type-check without a body.
    pub fn never(&self) -> ! {
        match self.never {}
    }
}
