//! Devices and their kernels. Everything device-specific lives below this module; the model code above it
//! calls one API and never sees a `cfg`.
//!
//! * [`cpu`]: the backend that runs everywhere: a spin/park thread pool, AVX-512 VNNI and AVX2 kernels chosen
//!   at run time, and a scalar `*_ref` version of every kernel that the tests use as the oracle.
//! * [`cuda`]: the GPU backend for Thor. Without the `cuda` feature it is a stub with the same API whose
//!   constructor reports that CUDA was not compiled in.

pub mod cpu;
#[cfg(not(feature = "cuda"))]
#[path = "backend/no_cuda.rs"]
pub mod cuda;

/// Why a device could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The binary was built without the `cuda` feature.
    #[error("this build of thorn has no CUDA backend (rebuild with --features cuda)")]
    CudaNotCompiled,
}
