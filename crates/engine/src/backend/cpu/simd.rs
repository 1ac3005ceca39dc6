//! The CPU kernels, chosen at run time by [`Isa`] (defined here): x86-64 (AVX-512 VNNI, AVX2+FMA) and
//! aarch64 (NEON, dot product, int8 matrix multiply). Each has a scalar reference in `qmatmul.rs` or
//! `ops.rs` that the tests hold it to, on every ISA the machine has.
//!
//! The rooms: `matmul` (quantization, quantized and float products: the dispatch), `x86_matmul` (their
//! x86 kernels), `neon` (the aarch64 kernels but attention's), `vector` (reductions, softmax's
//! exponentials, the element-wise row ops), `attention` (the attention entry points and their portable
//! path), `row_kernel` (the SIMD attention row driver, written once over the ISAs) and its per-ISA kernels
//! `attend_avx512`, `attend_avx2` and `attend_neon`, and `attend_bf16` (attention with bf16 products on
//! AVX-512 BF16, its own walk).
#![allow(
    unsafe_code,
    reason = "SIMD intrinsics; every block carries a SAFETY note"
)]
#![allow(
    clippy::missing_safety_doc,
    reason = "module-private kernels, callers are the dispatchers below"
)]

#[cfg(target_arch = "x86_64")]
mod attend_avx2;
#[cfg(target_arch = "x86_64")]
mod attend_avx512;
#[cfg(target_arch = "x86_64")]
mod attend_bf16;
#[cfg(target_arch = "aarch64")]
mod attend_neon;
mod attention;
mod matmul;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod row_kernel;
mod vector;
#[cfg(target_arch = "x86_64")]
mod x86_matmul;

pub use attention::{
    AttnKernels, MAX_GROUP, MAX_HEAD_DIM, MAX_TILE, PartialAttn, attend_group, attend_tile,
    merge_partials, prefetch,
};
pub use matmul::{dot_f32, dot4_f32, matmul, quantize};
pub use vector::{add, argmax, exp_sub, logsumexp, max, rmsnorm, silu_mul};

/// The instruction set the kernels use on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F/BW/VL + VNNI (`vpdpbusd`).
    Avx512Vnni,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// aarch64 NEON with the dot-product (`sdot`) and int8 matrix-multiply (`smmla`, `usmmla`)
    /// extensions: Neoverse V2/V3 (Jetson Thor, Grace), Cortex-A710 and later, Apple M2 and later.
    NeonI8mm,
    /// aarch64 NEON with the dot-product extension: Cortex-A76/A78 (Raspberry Pi 5, Jetson Orin's
    /// A78AE), Neoverse N1, Apple M1.
    NeonDotprod,
    /// aarch64 NEON alone (Advanced SIMD, in every aarch64 CPU: Cortex-A53/A72, Raspberry Pi 3/4).
    Neon,
    /// Portable scalar code (the reference kernels).
    Scalar,
}

impl Isa {
    /// Every ISA, best first within each architecture.
    pub(crate) const ALL: [Isa; 6] = [
        Isa::Avx512Vnni,
        Isa::Avx2,
        Isa::NeonI8mm,
        Isa::NeonDotprod,
        Isa::Neon,
        Isa::Scalar,
    ];

    /// The best ISA this CPU supports; `THORN_ISA=<name>` (see [`Isa::name`]) caps it to one it also
    /// supports, for tests and comparisons.
    pub fn detect() -> Isa {
        let cap = std::env::var("THORN_ISA").ok();
        Self::capped(cap.as_deref())
    }

    /// The best ISA available at or below `cap` (a [`Isa::name`]); the best of all for none or an unknown
    /// name.
    pub(crate) fn capped(cap: Option<&str>) -> Isa {
        let available = Self::available();
        match cap.and_then(|c| available.iter().position(|i| i.name() == c)) {
            Some(k) => available[k],
            None => available[0],
        }
    }

    /// The name reports and `THORN_ISA` use: `avx512vnni`, `avx2`, `neon-i8mm`, `neon-dotprod`, `neon`,
    /// `scalar`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Avx2 => "avx2",
            Isa::NeonI8mm => "neon-i8mm",
            Isa::NeonDotprod => "neon-dotprod",
            Isa::Neon => "neon",
            Isa::Scalar => "scalar",
        }
    }

    /// Whether this CPU can run the kernels of `self`.
    pub fn supported(self) -> bool {
        self == Isa::Scalar || self.supported_here()
    }

    #[cfg(target_arch = "x86_64")]
    fn supported_here(self) -> bool {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        match self {
            Isa::Avx2 => avx2,
            Isa::Avx512Vnni => {
                avx2 && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            _ => false,
        }
    }

    #[cfg(target_arch = "aarch64")]
    fn supported_here(self) -> bool {
        // NEON (with IEEE half-precision conversions) is part of the aarch64 base architecture.
        let dot = std::arch::is_aarch64_feature_detected!("dotprod");
        match self {
            Isa::Neon => true,
            Isa::NeonDotprod => dot,
            Isa::NeonI8mm => dot && std::arch::is_aarch64_feature_detected!("i8mm"),
            _ => false,
        }
    }

    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    fn supported_here(self) -> bool {
        false
    }

    /// ISAs this machine can run, best first (tests compare each against the scalar reference).
    pub fn available() -> Vec<Isa> {
        Self::ALL.into_iter().filter(|i| i.supported()).collect()
    }

    /// Whether this is one of the aarch64 ISAs.
    #[cfg(target_arch = "aarch64")]
    fn is_neon(self) -> bool {
        matches!(self, Isa::NeonI8mm | Isa::NeonDotprod | Isa::Neon)
    }
}
