//! CUDA C sources for thorn's GPU backend.
//!
//! The backend compiles these at run time with NVRTC (no nvcc on the build machines), lazily, one module at
//! a time, and caches the loaded modules per device. This crate has no dependencies and no code that runs
//! on the host: each kernel family is a `.cu` file under `kernels/cuda/`, exposed as a [`Module`] constant
//! with its source (`include_str!`) and the names of the kernels it defines.
//!
//! The catalog is filled in by the CUDA backend work; until then it is empty and the CPU backend is the only
//! one.

/// One CUDA source file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    /// Module name (used as the NVRTC program name and cache key).
    pub name: &'static str,
    /// CUDA C source.
    pub source: &'static str,
    /// `extern "C"` kernel names defined by the source.
    pub kernels: &'static [&'static str],
}

/// Every module, for tests that compile the whole catalog on a GPU machine.
pub const ALL: &[Module] = &[];
