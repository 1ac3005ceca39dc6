//! The CUDA backend (built with the `cuda` feature). It finds the driver at run time, so the binary builds
//! and starts on machines without CUDA; [`Cuda::new`] then reports a typed error.
//!
//! Its kernels (NVRTC-compiled from `thorn-kernels`, device weights and KV pages, CUDA graphs) are the CUDA
//! backend's own work; until they land no device is handed out: with a driver present, [`Cuda::new`]
//! reports that this build has no kernels for it rather than pretending to run.

use super::DeviceError;

/// A CUDA device (not constructed until the backend's kernels land).
#[derive(Debug)]
pub struct Cuda {
    never: std::convert::Infallible,
}

/// Where the NVIDIA kernel driver announces itself on Linux.
const DRIVER_VERSION: &str = "/proc/driver/nvidia/version";

impl Cuda {
    /// Opens GPU `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        if !Self::is_available() {
            return Err(DeviceError::NoGpu(format!(
                "no NVIDIA driver ({DRIVER_VERSION} is missing)"
            )));
        }
        Err(DeviceError::Unsupported {
            device: "this build's CUDA backend",
            what: format!(
                "GPU {ordinal}: its kernels are not built yet ({} kernel modules)",
                thorn_kernels::ALL.len()
            ),
        })
    }

    /// Whether an NVIDIA driver is loaded.
    pub fn is_available() -> bool {
        std::path::Path::new(DRIVER_VERSION).exists()
    }

    /// Proof that no value exists: lets every op's CUDA arm type-check without a body.
    pub fn never(&self) -> ! {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_opening_one_is_a_typed_error() {
        match Cuda::new(0) {
            Err(DeviceError::NoGpu(_)) => assert!(!Cuda::is_available()),
            Err(DeviceError::Unsupported { .. }) => assert!(Cuda::is_available()),
            other => panic!("unexpected: {other:?}"),
        }
    }
}
