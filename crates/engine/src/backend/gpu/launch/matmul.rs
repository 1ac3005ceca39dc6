//! Launches of the quantized matrix products and what feeds them: the activations' quantizers (alone and
//! fused behind the RMS norm and SwiGLU), the matrix-vector products (decode and batches of up to
//! [`MATVEC_TOKENS`], with their prologues) and the tensor-core products for larger batches, and the
//! embedding rows dequantized from the same formats. Every quantized product computes the canonical
//! product of `cuda/blocks.cuh`, so a token's output has the same bits in whichever kernel and batch.

use super::*;

/// The most tokens one matrix-vector launch takes (`MV_TOKENS` in `matvec.cu`); more are split. 16: a
/// decode step's draft tree of up to 15 nodes reads every matrix once.
pub const MATVEC_TOKENS: usize = 16;
/// Output rows per matrix-vector block (`MV_ROWS`).
const MATVEC_ROWS: usize = 4;
/// The most blocks a matrix-vector launch with a prologue uses: each block prepares the input once and
/// strides over rows, so a tall matrix (an LM head) does not prepare it once per 4 rows.
const PROLOGUE_BLOCKS: usize = 1024;
/// The most dynamic shared memory a prologue stages its quantized input in (with the kernel's 9.3 KiB of
/// static scratch, within the 48 KiB every CUDA GPU gives a block without opting in).
pub const PROLOGUE_SHARED: usize = 36 * 1024;
/// Tokens one block of a tensor-core product takes (`GEMM_TOKENS` in `gemm.cu`): the weights are read
/// once per this many tokens.
pub const GEMM_TOKENS: usize = 32;
/// Rows one block of a tensor-core product takes (`GEMM_ROWS`).
const GEMM_ROWS: usize = 64;

/// A block format's kernels in the GGUF layout, one table for all of them.
#[derive(Debug, Clone, Copy)]
struct BlockKernels {
    ty: GgmlType,
    matvec: &'static str,
    gemm: &'static str,
    embed: &'static str,
}

impl BlockKernels {
    const ALL: [BlockKernels; 6] = [
        BlockKernels::new(GgmlType::Q4_0, "matvec_q4_0", "gemm_q4_0", "embed_q4_0"),
        BlockKernels::new(GgmlType::Q4_1, "matvec_q4_1", "gemm_q4_1", "embed_q4_1"),
        BlockKernels::new(GgmlType::Q8_0, "matvec_q8_0", "gemm_q8_0", "embed_q8_0"),
        BlockKernels::new(GgmlType::Q4_K, "matvec_q4_k", "gemm_q4_k", "embed_q4_k"),
        BlockKernels::new(GgmlType::Q6_K, "matvec_q6_k", "gemm_q6_k", "embed_q6_k"),
        BlockKernels::new(GgmlType::NVFP4, "matvec_nvfp4", "gemm_nvfp4", "embed_nvfp4"),
    ];

    const fn new(
        ty: GgmlType,
        matvec: &'static str,
        gemm: &'static str,
        embed: &'static str,
    ) -> Self {
        BlockKernels {
            ty,
            matvec,
            gemm,
            embed,
        }
    }

    /// The kernels of block format `ty` (`None`: not a block format the kernels take).
    fn of(ty: GgmlType) -> Option<BlockKernels> {
        Self::ALL.into_iter().find(|k| k.ty == ty)
    }
}

/// A matrix product's input: `tokens` rows of `cols` values, prepared as [`Prep`] says: quantized into `q`,
/// one int8 per value, and `ds`, per block of 32 the pair `(d, d * Σq)` as two floats (by
/// [`quantize_q8_1`] or a fused kernel), or left for each product to prepare in its prologue from the floats
/// at `x`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acts {
    /// `tokens × cols` floats (for [`Prep::Norm`] the rows before the norm, for [`Prep::Swiglu`]
    /// `tokens × 2 cols` gate and up values).
    pub x: DevPtr,
    /// `tokens × cols` int8 ([`Prep::Quantized`] only).
    pub q: DevPtr,
    /// `tokens × cols / 32` float pairs ([`Prep::Quantized`] only).
    pub ds: DevPtr,
    /// Rows.
    pub tokens: usize,
    /// Values per row.
    pub cols: usize,
    /// What is ready and what each product does first.
    pub prep: Prep,
}

/// How a matrix product's input is prepared (`MV_*` in `matvec.cu`). All but [`Prep::Quantized`] are done by
/// each product's own prologue, with the unfused kernels' arithmetic, so the products' bits do not depend on
/// where the preparation ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Prep {
    /// `q` and `ds` hold the quantized input and `x` its floats.
    Quantized,
    /// `x` holds the floats; each product quantizes them.
    Floats,
    /// `x` holds rows before their RMS norm with weight `w` (`cols` floats); each product norms and
    /// quantizes them.
    Norm { w: DevPtr, eps: f32 },
    /// `x` holds `[gate | up]` rows of `2 cols`; each product applies SwiGLU and quantizes.
    Swiglu,
}

impl Prep {
    /// The kernels' `mode` argument.
    fn mode(self) -> i32 {
        match self {
            Prep::Quantized => 0,
            Prep::Floats => 1,
            Prep::Norm { .. } => 2,
            Prep::Swiglu => 3,
        }
    }
}

impl Acts {
    /// Bytes of `q` for `tokens` rows of `cols`.
    pub fn q_bytes(tokens: usize, cols: usize) -> usize {
        tokens * cols
    }

    /// Bytes of `ds` for `tokens` rows of `cols`.
    pub fn ds_bytes(tokens: usize, cols: usize) -> usize {
        8 * tokens * cols.div_ceil(32)
    }

    /// Whether `tokens` rows of `cols` can be left to the products' prologue: one launch of them (at most
    /// [`MATVEC_TOKENS`]), whole blocks of 32, and their quantized copy within [`PROLOGUE_SHARED`].
    pub fn deferrable(tokens: usize, cols: usize) -> bool {
        tokens <= MATVEC_TOKENS
            && cols.is_multiple_of(32)
            && Self::ds_bytes(tokens, cols) + Self::q_bytes(tokens, cols) <= PROLOGUE_SHARED
    }
}

/// The launch of a quantizer that takes one thread per value of `a` and a warp per block of 32 (`None`:
/// nothing to quantize); the width must be whole blocks.
fn one_thread_per_value(a: &Acts) -> Result<Option<(Shape, usize)>, DeviceError> {
    if !a.cols.is_multiple_of(32) {
        return Err(unsupported(format!(
            "activations of width {} (not a multiple of 32)",
            a.cols
        )));
    }
    let n = a.tokens * a.cols;
    if n == 0 {
        return Ok(None);
    }
    // Whole warps: n is a multiple of 32 and so is the block.
    let shape = Shape::line(n.div_ceil(THREADS as usize), THREADS)?;
    Ok(Some((shape, n)))
}

/// Quantizes the rows of `a.x` into `a.q` and `a.ds` (`a.cols` a multiple of 32).
pub fn quantize_q8_1(l: &dyn Launcher, a: &Acts) -> Result<(), DeviceError> {
    let Some((shape, n)) = one_thread_per_value(a)? else {
        return Ok(());
    };
    let args = [
        Arg::Ptr(a.x),
        Arg::Ptr(a.q),
        Arg::Ptr(a.ds),
        Arg::I32(int(n, "an activation size")?),
    ];
    l.launch(&thorn_kernels::QUANTIZE, "quantize_q8_1", shape, &args)
}

/// RMS norm of the `a.tokens` rows of `d = a.cols` floats at `x` (weight `w`) quantized straight into
/// `a.q` and `a.ds`, the normed floats also written to `out` when given: one launch instead of
/// [`rmsnorm`] then [`quantize_q8_1`], with the same bits.
pub fn rmsnorm_quantize(
    l: &dyn Launcher,
    x: DevPtr,
    w: DevPtr,
    a: &Acts,
    out: Option<DevPtr>,
    eps: f32,
) -> Result<(), DeviceError> {
    if !a.cols.is_multiple_of(32) {
        return Err(unsupported(format!(
            "activations of width {} (not a multiple of 32)",
            a.cols
        )));
    }
    if a.tokens == 0 {
        return Ok(());
    }
    let shape = Shape::per_row(a.tokens, a.cols)?;
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(w),
        Arg::Ptr(a.q),
        Arg::Ptr(a.ds),
        Arg::Ptr(out.unwrap_or(DevPtr(0))),
        Arg::I32(int(a.cols, "a width")?),
        Arg::F32(eps),
    ];
    l.launch(
        &thorn_kernels::QUANTIZE,
        "rmsnorm_quantize_q8_1",
        shape,
        &args,
    )
}

/// SwiGLU of `a.tokens` fused gate/up rows at `gu` (`[gate (f) | up (f)]`, `f = a.cols`) quantized straight
/// into `a.q` and `a.ds`, the floats also written to `out` when given: [`swiglu_rows`] then
/// [`quantize_q8_1`] in one launch, with the same bits.
pub fn swiglu_quantize(
    l: &dyn Launcher,
    gu: DevPtr,
    a: &Acts,
    out: Option<DevPtr>,
) -> Result<(), DeviceError> {
    let Some((shape, _)) = one_thread_per_value(a)? else {
        return Ok(());
    };
    let args = [
        Arg::Ptr(gu),
        Arg::Ptr(a.q),
        Arg::Ptr(a.ds),
        Arg::Ptr(out.unwrap_or(DevPtr(0))),
        Arg::I32(int(a.tokens, "rows")?),
        Arg::I32(int(a.cols, "a width")?),
    ];
    l.launch(
        &thorn_kernels::QUANTIZE,
        "swiglu_quantize_q8_1",
        shape,
        &args,
    )
}

/// A weight matrix in device memory: `rows` rows of `cols` weights of type `ty`, as GGUF stores them (f32
/// for `F32`, IEEE half bits for `F16`), times `scale` (NVFP4's tensor scale; 1 otherwise).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// The bytes.
    pub ptr: DevPtr,
    /// Their type.
    pub ty: GgmlType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The tensor scale.
    pub scale: f32,
    /// How the rows are laid out.
    pub layout: Layout,
}

impl Weights {
    /// The matrix-vector kernel for this type and layout, and whether it reads quantized activations.
    pub fn kernel(&self) -> Result<(&'static str, bool), DeviceError> {
        if self.layout == Layout::Packed {
            return match self.ty {
                GgmlType::Q4_1 => Ok(("matvec_q4_1p", true)),
                ty => Err(unsupported(format!("packed weights of type {ty}"))),
            };
        }
        if let Some(k) = BlockKernels::of(self.ty) {
            return Ok((k.matvec, true));
        }
        Ok(match self.ty {
            GgmlType::F32 => ("matvec_f32", false),
            GgmlType::F16 => ("matvec_f16", false),
            ty => return Err(unsupported(format!("weights of type {ty}"))),
        })
    }

    /// The tensor-core product's kernel for this matrix (batches of more than [`MATVEC_TOKENS`] quantized
    /// tokens): every block format has one.
    pub fn gemm_kernel(&self) -> Option<&'static str> {
        match (self.layout, self.ty) {
            (Layout::Packed, GgmlType::Q4_1) => Some("gemm_q4_1p"),
            (Layout::Packed, _) => None,
            (_, ty) => BlockKernels::of(ty).map(|k| k.gemm),
        }
    }

    /// Checks that the kernels can take this matrix: a known type and whole blocks per row.
    pub fn check(&self) -> Result<(), DeviceError> {
        let (_, quantized) = self.kernel()?;
        let block = if quantized {
            self.ty.block_size().max(32)
        } else {
            1
        };
        if self.cols == 0 || !self.cols.is_multiple_of(block) {
            return Err(unsupported(format!(
                "rows of {} weights of type {} (blocks of {block})",
                self.cols, self.ty
            )));
        }
        int(self.rows, "rows")?;
        int(self.cols, "a width")?;
        if self.layout == Layout::Packed && !self.ptr.0.is_multiple_of(16) {
            return Err(unsupported(
                "packed weights not 16-byte aligned".to_string(),
            ));
        }
        if self.scale != 1.0 && !quantized {
            return Err(unsupported(format!(
                "a tensor scale on {} weights",
                self.ty
            )));
        }
        Ok(())
    }
}

/// `out[t * stride + r] = scale * W[r] · x[t]` for the `a.tokens` rows of the input (`stride >= w.rows`:
/// `W` may be one part of a stacked output), prepared as `a.prep` says (its quantized copy for block types,
/// see [`quantize_q8_1`], its floats for f32 and f16 weights; or by the kernel's prologue). With `add` the
/// products are added to what `out` holds. A batch of more than [`MATVEC_TOKENS`] quantized tokens is one
/// tensor-core product (the weights read once per [`GEMM_TOKENS`]); other large batches run as several
/// launches. Either way each token's output has the bits it has alone.
pub fn matvec(
    l: &dyn Launcher,
    w: &Weights,
    a: &Acts,
    out: DevPtr,
    stride: usize,
    add: bool,
) -> Result<(), DeviceError> {
    w.check()?;
    let (kernel, quantized) = w.kernel()?;
    if a.cols != w.cols {
        return Err(unsupported(format!(
            "an input of width {} for a matrix of width {}",
            a.cols, w.cols
        )));
    }
    if stride < w.rows {
        return Err(unsupported(format!(
            "outputs {stride} apart from a matrix of {} rows",
            w.rows
        )));
    }
    let staged = quantized && a.prep != Prep::Quantized;
    // Each launch's prologue stages at most MATVEC_TOKENS rows.
    if staged && !Acts::deferrable(a.tokens.min(MATVEC_TOKENS), a.cols) {
        return Err(unsupported(format!(
            "a prologue over rows of {} (more shared memory than {PROLOGUE_SHARED} bytes)",
            a.cols
        )));
    }
    if quantized
        && !staged
        && a.tokens > MATVEC_TOKENS
        && let Some(kernel) = w.gemm_kernel()
    {
        return gemm(l, kernel, w, a, out, stride, add);
    }
    let stride = int(stride, "an output stride")?;
    let mut blocks = w.rows.div_ceil(MATVEC_ROWS);
    if a.prep != Prep::Quantized {
        blocks = blocks.min(PROLOGUE_BLOCKS);
    }
    // Float weights read the floats the eager preparations wrote.
    let mode = match a.prep {
        Prep::Quantized if !quantized => Prep::Floats,
        p => p,
    };
    let (nw, eps) = match a.prep {
        Prep::Norm { w, eps } => (w, eps),
        _ => (DevPtr(0), 0.0),
    };
    let row_floats = if a.prep == Prep::Swiglu {
        2 * w.cols
    } else {
        w.cols
    };
    let (rows, cols) = (int(w.rows, "rows")?, int(w.cols, "a width")?);
    let mut t0 = 0;
    while t0 < a.tokens {
        let nt = (a.tokens - t0).min(MATVEC_TOKENS);
        let shape = Shape {
            grid: [int(blocks, "blocks")? as u32, 1, 1],
            block: [32, MATVEC_ROWS as u32, 1],
            shared: if staged {
                (Acts::ds_bytes(nt, w.cols) + Acts::q_bytes(nt, w.cols)) as u32
            } else {
                0
            },
        };
        let o = Arg::Ptr(out.offset(4 * t0 * stride as usize));
        let x = Arg::Ptr(a.x.offset(4 * t0 * row_floats));
        let (rows, cols, nt) = (Arg::I32(rows), Arg::I32(cols), Arg::I32(nt as i32));
        let (st, add) = (Arg::I32(stride), Arg::I32(i32::from(add)));
        let (nw, mode, eps) = (Arg::Ptr(nw), Arg::I32(mode.mode()), Arg::F32(eps));
        if quantized {
            let (q, ds) = if staged {
                (DevPtr(0), DevPtr(0))
            } else {
                (
                    a.q.offset(Acts::q_bytes(t0, w.cols)),
                    a.ds.offset(Acts::ds_bytes(t0, w.cols)),
                )
            };
            let args = [
                Arg::Ptr(w.ptr),
                Arg::Ptr(q),
                Arg::Ptr(ds),
                x,
                nw,
                o,
                rows,
                cols,
                nt,
                st,
                Arg::F32(w.scale),
                add,
                mode,
                eps,
            ];
            l.launch(&thorn_kernels::MATVEC, kernel, shape, &args)?;
        } else {
            let args = [
                Arg::Ptr(w.ptr),
                x,
                nw,
                o,
                rows,
                cols,
                nt,
                st,
                add,
                mode,
                eps,
            ];
            l.launch(&thorn_kernels::MATVEC, kernel, shape, &args)?;
        }
        t0 += MATVEC_TOKENS;
    }
    Ok(())
}

/// The tensor-core product ([`matvec`]'s arguments, checked there) with `kernel`, over the quantized input.
fn gemm(
    l: &dyn Launcher,
    kernel: &'static str,
    w: &Weights,
    a: &Acts,
    out: DevPtr,
    stride: usize,
    add: bool,
) -> Result<(), DeviceError> {
    if w.rows == 0 || a.tokens == 0 {
        return Ok(());
    }
    int(a.tokens * a.cols, "an activation size")?;
    // A grid's y dimension holds at most 65,535 blocks.
    let tiles = a.tokens.div_ceil(GEMM_TOKENS);
    if tiles > 65_535 {
        return Err(unsupported(format!(
            "a batch of {} tokens in one product (at most {})",
            a.tokens,
            65_535 * GEMM_TOKENS
        )));
    }
    let shape = Shape {
        grid: [
            int(w.rows.div_ceil(GEMM_ROWS), "row tiles")? as u32,
            tiles as u32,
            1,
        ],
        block: [128, 1, 1],
        shared: 0,
    };
    let args = [
        Arg::Ptr(w.ptr),
        Arg::Ptr(a.q),
        Arg::Ptr(a.ds),
        Arg::Ptr(out),
        Arg::I32(int(w.rows, "rows")?),
        Arg::I32(int(w.cols, "a width")?),
        Arg::I32(int(a.tokens, "tokens")?),
        Arg::I32(int(stride, "an output stride")?),
        Arg::F32(w.scale),
        Arg::I32(i32::from(add)),
    ];
    l.launch(&thorn_kernels::GEMM, kernel, shape, &args)
}

/// `table`, dequantized into `out` (`n × d` floats), exactly as the CPU's `dequantize_ref`.
pub fn embed(
    l: &dyn Launcher,
    ty: GgmlType,
    table: DevPtr,
    d: usize,
    tokens: DevPtr,
    n: usize,
    out: DevPtr,
) -> Result<(), DeviceError> {
    let w = Weights {
        ptr: table,
        ty,
        rows: 1,
        cols: d,
        scale: 1.0,
        layout: Layout::Gguf,
    };
    w.check()?;
    let (kernel, quantized) = match (BlockKernels::of(ty), ty) {
        (Some(k), _) => (k.embed, true),
        (None, GgmlType::F16) => ("embed_f16", false),
        (None, _) => ("embed_f32", false),
    };
    let threads = if quantized { n * d / 8 } else { n * d };
    let args = [
        Arg::Ptr(table),
        Arg::Ptr(tokens),
        Arg::Ptr(out),
        Arg::I32(int(n, "tokens")?),
        Arg::I32(int(d, "a width")?),
    ];
    l.launch(&thorn_kernels::MATVEC, kernel, elementwise(threads), &args)
}
