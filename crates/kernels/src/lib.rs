//! CUDA C sources for thorn's GPU backend.
//!
//! The backend compiles these at run time with NVRTC (no nvcc on the build machines), lazily, one module at
//! a time, and caches the loaded modules per device. This crate has no dependencies and no code that runs
//! on the host: each kernel family is a `.cu` file under `kernels/cuda/`, exposed as a [`Module`] constant
//! with its source and the names of the kernels it defines. A module's source is the shared prelude
//! (`cuda/common.cuh`: warp and block reductions, half conversions, GGUF field loads) followed by its own
//! file, so each compiles alone, with no include path and no toolkit header.
//!
//! Every source is checked without a GPU, twice: CI compiles each module to PTX with NVRTC and assembles it
//! with ptxas for sm_90 (H100/H200) and Thor (`scripts/cuda-compile-check`), and the engine's tests run
//! every kernel on the CPU through `thorn-kernel-sim` against the CPU backend's scalar references. On a GPU
//! machine the same tests run on the GPU.

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

/// The prelude every module's source starts with.
pub const PRELUDE: &str = include_str!("../cuda/common.cuh");

/// Residual add and the SiLU-gated products.
pub const ELEMENTWISE: Module = Module {
    name: "elementwise",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/elementwise.cu")
    ),
    kernels: &["copy_f32", "add_f32", "silu_mul_f32", "swiglu_rows_f32"],
};

/// RMS norm over rows.
pub const NORM: Module = Module {
    name: "norm",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/norm.cu")
    ),
    kernels: &["rmsnorm_f32"],
};

/// Activation quantization to 8-bit blocks of 32 (the matrix products' input), alone and fused behind the
/// RMS norm and behind SwiGLU.
pub const QUANTIZE: Module = Module {
    name: "quantize",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/quantize.cu")
    ),
    kernels: &[
        "quantize_q8_1",
        "rmsnorm_quantize_q8_1",
        "swiglu_quantize_q8_1",
    ],
};

/// Conversions between f32 and IEEE half.
pub const CONVERT: Module = Module {
    name: "convert",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/convert.cu")
    ),
    kernels: &["f16_to_f32_n", "f32_to_f16_n"],
};

/// Weight block formats and the canonical order of a quantized product, shared by [`MATVEC`] and [`GEMM`].
pub const BLOCKS: &str = include_str!("../cuda/blocks.cuh");

/// Warp-level tensor-core products (int8 and f16 `mma.sync`, emulated where there is none), shared by
/// [`GEMM`] and [`ATTENTION`].
pub const MMA: &str = include_str!("../cuda/mma.cuh");

/// Matrix-vector products over GGUF block formats (and f32/f16 weights), up to 16 tokens at once, and
/// embedding rows dequantized from the same formats.
pub const MATVEC: Module = Module {
    name: "matvec",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/blocks.cuh"),
        include_str!("../cuda/matvec.cu")
    ),
    kernels: &[
        "matvec_q4_0",
        "matvec_q4_1",
        "matvec_q8_0",
        "matvec_q4_k",
        "matvec_q6_k",
        "matvec_nvfp4",
        "matvec_q4_1p",
        "matvec_f32",
        "matvec_f16",
        "embed_q4_0",
        "embed_q4_1",
        "embed_q8_0",
        "embed_q4_k",
        "embed_q6_k",
        "embed_nvfp4",
        "embed_f32",
        "embed_f16",
    ],
};

/// Tensor-core products of the same block formats for batches of more than 16 tokens, with the bits of
/// [`MATVEC`]'s.
pub const GEMM: Module = Module {
    name: "gemm",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/blocks.cuh"),
        include_str!("../cuda/mma.cuh"),
        include_str!("../cuda/gemm.cu")
    ),
    kernels: &[
        "gemm_q4_0",
        "gemm_q4_1",
        "gemm_q8_0",
        "gemm_q4_k",
        "gemm_q6_k",
        "gemm_nvfp4",
        "gemm_q4_1p",
    ],
};

/// Rotary position embedding from a (cos, sin) table, alone and fused with the KV write.
pub const ROPE: Module = Module {
    name: "rope",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/rope.cu")
    ),
    kernels: &["rope_f32", "rope_kv_write_f32", "rope_kv_write_f16"],
};

/// Paged attention over f32, f16 and FP8 pages (split into partials, then merged; f16 and FP8 pages on
/// the tensor cores).
pub const ATTENTION: Module = Module {
    name: "attention",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/mma.cuh"),
        include_str!("../cuda/attention.cu")
    ),
    kernels: &[
        "attention_f32",
        "attention_f16",
        "attention_fp8",
        "attention_f16_tc",
        "attention_fp8_tc",
        "attention_merge",
    ],
};

/// New KV rows into their pages, converted to the cache's type; copies between pages.
pub const KV_WRITE: Module = Module {
    name: "kvwrite",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/kvwrite.cu")
    ),
    kernels: &[
        "kv_write_f32",
        "kv_write_f16",
        "kv_write_fp8",
        "kv_copy_page",
        "kv_move_rows",
        "kv_move_rows_fp8",
    ],
};

/// Gated DeltaNet: convolution, q/k norm, gates, the delta-rule recurrence (token by token, and in chunked
/// WY form), the gated output norm; and the sigmoid output gate of gated attention.
pub const GDN: Module = Module {
    name: "gdn",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/gdn.cu")
    ),
    kernels: &[
        "gdn_conv",
        "gdn_normalize_qk",
        "gdn_gates",
        "gdn_recurrence",
        "gdn_chunk",
        "gdn_gated_norm",
        "sigmoid_gate",
    ],
};

/// Reductions over logits rows: the k best of each row (k = 1 is greedy).
pub const LOGITS: Module = Module {
    name: "logits",
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/logits.cu")
    ),
    kernels: &["topk_rows", "row_best", "row_top"],
};

/// Every module, for the compile check and for tests that load the whole catalog on a GPU machine.
pub const ALL: &[Module] = &[
    ELEMENTWISE,
    NORM,
    QUANTIZE,
    CONVERT,
    MATVEC,
    GEMM,
    ROPE,
    ATTENTION,
    KV_WRITE,
    GDN,
    LOGITS,
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The `extern "C" __global__` kernels a source defines, in order.
    fn defined(source: &str) -> Vec<&str> {
        source
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .filter_map(|rest| rest.split('(').next())
            .map(str::trim)
            .collect()
    }

    #[test]
    fn the_catalog_names_exactly_the_kernels_each_source_defines() {
        let mut names = std::collections::HashSet::new();
        for m in ALL {
            assert!(
                m.source.starts_with(PRELUDE),
                "module {} lacks the prelude",
                m.name
            );
            assert_eq!(defined(m.source), m.kernels, "module {}", m.name);
            for k in m.kernels {
                assert!(names.insert(*k), "kernel {k} is defined twice");
            }
        }
    }

    #[test]
    fn sources_are_self_contained() {
        // NVRTC runs without the toolkit's headers on the build machines.
        for m in ALL {
            assert!(
                !m.source.contains("#include"),
                "module {} includes a header",
                m.name
            );
        }
    }
}
