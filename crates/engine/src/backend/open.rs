//! Which device to open ([`DeviceKind`]: `--device cpu|cuda[:N]|auto`, with the kernel cache a GPU
//! compiles into) and why a device cannot be used or an op not run ([`DeviceError`]).

use super::Device;
use crate::quant::QuantError;

/// Why a device could not be used, or an op not run.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The binary was built without the `cuda` feature.
    #[error("this build of thorn has no CUDA backend (rebuild with --features cuda)")]
    CudaNotCompiled,
    /// A library the CUDA backend loads at run time is not on the loader path.
    #[error("no CUDA GPU can be used: {library} was not found ({hint})")]
    MissingLibrary {
        /// The library (`libcuda`, `libnvrtc`).
        library: &'static str,
        /// Where it comes from.
        hint: &'static str,
    },
    /// No NVIDIA driver or GPU was found.
    #[error("no CUDA GPU found: {0}")]
    NoGpu(String),
    /// A kernel module did not compile (NVRTC's log says why).
    #[error("kernel module {module} does not compile for {arch}: {log}")]
    Compile {
        /// The module.
        module: &'static str,
        /// The virtual architecture (`compute_90`).
        arch: &'static str,
        /// The compiler's log, or what is missing from its output.
        log: String,
    },
    /// The device cannot run this op or weight type.
    #[error("{device} cannot run {what}")]
    Unsupported {
        /// The device.
        device: &'static str,
        /// The op or type.
        what: String,
    },
    /// Weights that cannot be decoded.
    #[error(transparent)]
    Quant(#[from] QuantError),
}

/// Which device to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// The CPU.
    #[default]
    Cpu,
    /// CUDA GPU `ordinal`.
    Cuda(usize),
    /// GPU 0 when one can be used, else the CPU (saying why in the log).
    Auto,
}

/// The products of the CPU's attention kernels (`--attention`): their accuracy against f32 is in
/// BENCHMARKS.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionMath {
    /// f32 products everywhere (the default: bf16's error at the quantized precision is just past the
    /// bound `quantized_precision_tracks_the_reference_and_llama_cpp` holds the engine to).
    #[default]
    F32,
    /// bf16 products where the CPU has them (AVX-512 BF16), else f32: queries, keys, values and softmax
    /// weights rounded to bf16, products summed in f32 (the softmax itself stays f32).
    Bf16,
}

impl AttentionMath {
    /// Whether this machine's CPU backend runs `self` (bf16: AVX-512 BF16 at the ISA it picks).
    pub fn runs_here(self) -> bool {
        use super::cpu::simd::{AttnKernels, Isa};
        self == AttentionMath::F32 || AttnKernels::has_bf16(Isa::detect())
    }
}

impl std::str::FromStr for AttentionMath {
    type Err = String;

    /// `f32` or `bf16`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(AttentionMath::F32),
            "bf16" => Ok(AttentionMath::Bf16),
            _ => Err(format!("{s:?}: expected f32 or bf16")),
        }
    }
}

/// Where a GPU caches its compiled kernels when the caller names no place: `kernels/` under thorn's cache
/// directory ([`crate::cache_dir`]; `None` without one).
pub fn default_kernel_cache() -> Option<std::path::PathBuf> {
    crate::cache_dir().map(|d| d.join("kernels"))
}

impl DeviceKind {
    /// Opens the device (`threads`: CPU worker threads, 0 = one per physical core; `kernel_cache`: the
    /// directory a GPU caches its compiled kernels in, `None`: compiled every time).
    pub fn open(
        self,
        threads: usize,
        kernel_cache: Option<&std::path::Path>,
    ) -> Result<Device, DeviceError> {
        match self {
            DeviceKind::Cpu => Ok(Device::cpu(threads)),
            DeviceKind::Cuda(ordinal) => Device::cuda(ordinal, kernel_cache),
            DeviceKind::Auto => Ok(Device::cuda(0, kernel_cache).unwrap_or_else(|e| {
                tracing::warn!("running on the CPU: {e}");
                Device::cpu(threads)
            })),
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    /// `cpu`, `cuda` (GPU 0), `cuda:N` or `auto`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceKind::Cpu),
            "auto" => Ok(DeviceKind::Auto),
            "cuda" | "gpu" => Ok(DeviceKind::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceKind::Cuda)
                .ok_or_else(|| format!("{s:?}: expected cpu, cuda, cuda:N or auto")),
        }
    }
}
