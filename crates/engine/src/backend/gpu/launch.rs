//! The CUDA kernels' launches, written once for any place that runs them: a CUDA stream, or the CPU
//! simulator of the tests (`thorn-kernel-sim`, which compiles the same kernel sources as C++).
//!
//! Each op here checks its shapes, picks the launch shape its kernel's header comment asks for, and hands
//! the kernel its arguments as the C types it declares. A [`Launcher`] only runs `(module, kernel, grid,
//! block, shared memory, arguments)`; device memory is addressed by [`DevPtr`] (a device pointer on a GPU,
//! a host address in the simulator). So the code that decides how a kernel is launched is the code the
//! tests run, on every machine, against the CPU backend's scalar references.
//!
//! Ops take device addresses and sizes, never host slices: they queue work and return. Every size is
//! checked here, before anything runs ([`DeviceError::Unsupported`] names what does not fit), because a
//! kernel trusts the sizes it is given.

use crate::backend::DeviceError;
use crate::backend::batch::Batch;
use crate::backend::pages::{KvDtype, KvShape};
use crate::quant::GgmlType;
use thorn_kernels::Module;

pub use crate::backend::buf::DevPtr;

mod attention;
mod gdn;
mod logits;
mod packed;
pub use attention::{
    ATTENTION_MAX_GROUP, ATTENTION_MAX_HEAD_DIM, ATTENTION_TILE, BatchMeta, DevBatch, KvStore,
    SPLIT_TOKENS, attention, attention_counters, copy_page, move_rows, rope_kv_write, split_cap,
    write_kv,
};
pub use gdn::{
    DevSteps, gdn_chunk, gdn_chunk_work, gdn_conv, gdn_gated_norm, gdn_gates, gdn_normalize_qk,
    gdn_recurrence, sigmoid_gate,
};
pub use logits::{
    ROW_BEST_FLOATS, TOP_CANDIDATES, TOP_FLOATS, TOPK_MAX, row_best, row_top, topk_rows,
};
pub use packed::{Layout, packed_row_bytes, repack_q4_1};

/// One kernel argument, as the C type the kernel declares (pointers, `int`, `float`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A pointer.
    Ptr(DevPtr),
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
}

/// The most arguments a kernel of the catalog takes.
pub const MAX_ARGS: usize = 24;

/// Arguments laid out as `cuLaunchKernel` reads them: one 8-byte slot per argument, each holding the
/// value's bytes from its start (little-endian), so a pointer to slot `i` is a pointer to argument `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Params {
    slots: [u64; MAX_ARGS],
    len: usize,
}

impl Params {
    /// The slots for `args`.
    pub fn new(args: &[Arg]) -> Self {
        assert!(
            args.len() <= MAX_ARGS,
            "a kernel takes at most {MAX_ARGS} arguments"
        );
        let mut slots = [0u64; MAX_ARGS];
        for (s, a) in slots.iter_mut().zip(args) {
            *s = match *a {
                Arg::Ptr(p) => p.0,
                Arg::I32(v) => u64::from(v as u32),
                Arg::F32(v) => u64::from(v.to_bits()),
            };
        }
        Params {
            slots,
            len: args.len(),
        }
    }

    /// The pointer to each argument (`kernelParams`); valid while `self` is neither moved nor dropped.
    pub fn pointers(&mut self) -> [*mut std::ffi::c_void; MAX_ARGS] {
        let mut p = [std::ptr::null_mut(); MAX_ARGS];
        for (ptr, slot) in p.iter_mut().zip(&mut self.slots[..self.len]) {
            *ptr = std::ptr::from_mut(slot).cast();
        }
        p
    }

    /// How many arguments there are.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A launch's shape: `grid` blocks of `block` threads, with `shared` bytes of dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Blocks (x, y, z).
    pub grid: [u32; 3],
    /// Threads per block (x, y, z).
    pub block: [u32; 3],
    /// Dynamic shared memory per block, bytes.
    pub shared: u32,
}

impl Shape {
    /// A one-dimensional launch: `blocks` blocks of `threads` threads, no dynamic shared memory.
    fn line(blocks: usize, threads: u32) -> Result<Shape, DeviceError> {
        Ok(Shape {
            grid: [int(blocks, "blocks")? as u32, 1, 1],
            block: [threads, 1, 1],
            shared: 0,
        })
    }

    /// One block per row of `d` values with up to 1,024 threads in whole warps: the RMS norms' shape,
    /// shared by the plain and the fused kernel so that both reduce in the same order (the same bits).
    fn per_row(rows: usize, d: usize) -> Result<Shape, DeviceError> {
        Shape::line(rows, d.next_multiple_of(32).clamp(32, 1024) as u32)
    }
}

/// Runs kernels (in order, on one stream).
pub trait Launcher {
    /// Queues `kernel` of `module` with `shape` and its arguments laid out in `params`.
    fn launch_params(
        &self,
        module: &'static Module,
        kernel: &'static str,
        shape: Shape,
        params: &Params,
    ) -> Result<(), DeviceError>;

    /// Queues `kernel` of `module` with `shape` and `args`.
    fn launch(
        &self,
        module: &'static Module,
        kernel: &'static str,
        shape: Shape,
        args: &[Arg],
    ) -> Result<(), DeviceError> {
        self.launch_params(module, kernel, shape, &Params::new(args))
    }
}

/// One kernel launch, as a graph records it.
#[derive(Debug, Clone, Copy)]
pub struct Launch {
    /// The module.
    pub module: &'static Module,
    /// The kernel.
    pub kernel: &'static str,
    /// Its shape.
    pub shape: Shape,
    /// Its arguments.
    pub params: Params,
}

impl PartialEq for Launch {
    fn eq(&self, o: &Launch) -> bool {
        self.module.name == o.module.name
            && self.kernel == o.kernel
            && self.shape == o.shape
            && self.params == o.params
    }
}

impl Eq for Launch {}

impl Launch {
    /// Queues it on `l`.
    pub fn run(&self, l: &dyn Launcher) -> Result<(), DeviceError> {
        l.launch_params(self.module, self.kernel, self.shape, &self.params)
    }
}

/// The most tokens one matrix-vector launch takes (`MV_TOKENS` in `matvec.cu`); more are split. 16: a
/// decode step's draft tree of up to 15 nodes reads every matrix once.
pub const MATVEC_TOKENS: usize = 16;
/// Output rows per matrix-vector block (`MV_ROWS`).
const MATVEC_ROWS: usize = 4;
/// The most blocks a matrix-vector launch with a prologue uses: each block prepares the input once and
/// strides over rows, so a tall matrix (an LM head) does not prepare it once per 4 rows.
const PROLOGUE_BLOCKS: usize = 1024;
/// The most dynamic shared memory a prologue stages its quantized input in (within the 48 KiB every CUDA
/// GPU gives a block without opting in).
pub const PROLOGUE_SHARED: usize = 40 * 1024;
/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// The most blocks an element-wise launch uses (its kernels loop over the rest).
const MAX_BLOCKS: usize = 4096;

fn unsupported(what: String) -> DeviceError {
    DeviceError::Unsupported {
        device: "the CUDA kernels",
        what,
    }
}

fn int(v: usize, what: &str) -> Result<i32, DeviceError> {
    i32::try_from(v).map_err(|_| unsupported(format!("{what} of {v} (more than 2^31 - 1)")))
}

/// A grid-stride launch over `n` elements: blocks of 256 threads (fewer, in whole warps, for small `n`).
fn elementwise(n: usize) -> Shape {
    let threads = n.next_multiple_of(32).clamp(32, THREADS as usize);
    Shape {
        grid: [n.div_ceil(threads).clamp(1, MAX_BLOCKS) as u32, 1, 1],
        block: [threads as u32, 1, 1],
        shared: 0,
    }
}

/// `dst[i] = src[i]` for `n` floats, as a kernel (inside a pass's graph, unlike a copy).
pub fn copy(l: &dyn Launcher, dst: DevPtr, src: DevPtr, n: usize) -> Result<(), DeviceError> {
    let args = [Arg::Ptr(dst), Arg::Ptr(src), Arg::I32(int(n, "a length")?)];
    l.launch(
        &thorn_kernels::ELEMENTWISE,
        "copy_f32",
        elementwise(n),
        &args,
    )
}

/// `x[i] += y[i]` for `n` floats.
pub fn add(l: &dyn Launcher, x: DevPtr, y: DevPtr, n: usize) -> Result<(), DeviceError> {
    let args = [Arg::Ptr(x), Arg::Ptr(y), Arg::I32(int(n, "a length")?)];
    l.launch(
        &thorn_kernels::ELEMENTWISE,
        "add_f32",
        elementwise(n),
        &args,
    )
}

/// `out[i] = silu(gate[i]) * up[i]` for `n` floats.
pub fn silu_mul(
    l: &dyn Launcher,
    gate: DevPtr,
    up: DevPtr,
    out: DevPtr,
    n: usize,
) -> Result<(), DeviceError> {
    let args = [
        Arg::Ptr(gate),
        Arg::Ptr(up),
        Arg::Ptr(out),
        Arg::I32(int(n, "a length")?),
    ];
    l.launch(
        &thorn_kernels::ELEMENTWISE,
        "silu_mul_f32",
        elementwise(n),
        &args,
    )
}

/// The fused gate/up layout: row `t` of `gu` is `[gate (f) | up (f)]`, row `t` of `out` is
/// `silu(gate) * up`.
pub fn swiglu_rows(
    l: &dyn Launcher,
    gu: DevPtr,
    out: DevPtr,
    rows: usize,
    f: usize,
) -> Result<(), DeviceError> {
    int(2 * rows * f, "an activation size")?;
    let args = [
        Arg::Ptr(gu),
        Arg::Ptr(out),
        Arg::I32(int(rows, "rows")?),
        Arg::I32(int(f, "a width")?),
    ];
    l.launch(
        &thorn_kernels::ELEMENTWISE,
        "swiglu_rows_f32",
        elementwise(rows * f),
        &args,
    )
}

/// RMS norm of `rows` rows of `d` floats of `x` with weight `w` (d floats) into `out`.
pub fn rmsnorm(
    l: &dyn Launcher,
    x: DevPtr,
    w: DevPtr,
    out: DevPtr,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), DeviceError> {
    if rows == 0 {
        return Ok(());
    }
    let shape = Shape::per_row(rows, d)?;
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(w),
        Arg::Ptr(out),
        Arg::I32(int(d, "a width")?),
        Arg::F32(eps),
    ];
    l.launch(&thorn_kernels::NORM, "rmsnorm_f32", shape, &args)
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
        Ok(match self.ty {
            GgmlType::Q4_0 => ("matvec_q4_0", true),
            GgmlType::Q4_1 => ("matvec_q4_1", true),
            GgmlType::Q8_0 => ("matvec_q8_0", true),
            GgmlType::Q4_K => ("matvec_q4_k", true),
            GgmlType::Q6_K => ("matvec_q6_k", true),
            GgmlType::NVFP4 => ("matvec_nvfp4", true),
            GgmlType::F32 => ("matvec_f32", false),
            GgmlType::F16 => ("matvec_f16", false),
            ty => return Err(unsupported(format!("weights of type {ty}"))),
        })
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
/// products are added to what `out` holds. Batches of more than [`MATVEC_TOKENS`] run as several launches.
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
    let (kernel, quantized) = match ty {
        GgmlType::Q4_0 => ("embed_q4_0", true),
        GgmlType::Q4_1 => ("embed_q4_1", true),
        GgmlType::Q8_0 => ("embed_q8_0", true),
        GgmlType::Q4_K => ("embed_q4_k", true),
        GgmlType::Q6_K => ("embed_q6_k", true),
        GgmlType::NVFP4 => ("embed_nvfp4", true),
        GgmlType::F16 => ("embed_f16", false),
        _ => ("embed_f32", false),
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

/// `n` IEEE half values (their bits, at `h`) to f32 at `f`.
pub fn f16_to_f32(l: &dyn Launcher, h: DevPtr, f: DevPtr, n: usize) -> Result<(), DeviceError> {
    let args = [Arg::Ptr(h), Arg::Ptr(f), Arg::I32(int(n, "a length")?)];
    l.launch(
        &thorn_kernels::CONVERT,
        "f16_to_f32_n",
        elementwise(n),
        &args,
    )
}

/// `n` floats at `f` to IEEE half bits at `h` (round to nearest even).
pub fn f32_to_f16(l: &dyn Launcher, f: DevPtr, h: DevPtr, n: usize) -> Result<(), DeviceError> {
    let args = [Arg::Ptr(f), Arg::Ptr(h), Arg::I32(int(n, "a length")?)];
    l.launch(
        &thorn_kernels::CONVERT,
        "f32_to_f16_n",
        elementwise(n),
        &args,
    )
}

/// Rotary embedding of the first `heads` heads of `head_dim` floats of `tokens` rows at `x`, `stride` floats
/// apart, in place (a fused QKV row rotates its Q and K heads at once): `pos` holds
/// each token's position (i32), `table` the `(cos, sin)` pairs (two f32) of `n_angles` pairs per position
/// (the CPU's `rope_angles`); `Rope::Neox` rotates `(i, i + n_angles)`, `Rope::Normal` `(2i, 2i + 1)`.
#[expect(clippy::too_many_arguments, reason = "a kernel's shape")]
pub fn rope(
    l: &dyn Launcher,
    kind: crate::backend::Rope,
    x: DevPtr,
    pos: DevPtr,
    table: DevPtr,
    tokens: usize,
    stride: usize,
    heads: usize,
    head_dim: usize,
    n_angles: usize,
) -> Result<(), DeviceError> {
    if stride < heads * head_dim {
        return Err(unsupported(format!(
            "rows of {stride} floats holding {heads} heads of {head_dim}"
        )));
    }
    if 2 * n_angles > head_dim || n_angles == 0 {
        return Err(unsupported(format!(
            "RoPE of {n_angles} pairs on heads of {head_dim}"
        )));
    }
    let pairs = tokens * heads * n_angles;
    if pairs == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(pos),
        Arg::Ptr(table),
        Arg::I32(int(tokens, "tokens")?),
        Arg::I32(int(heads, "heads")?),
        Arg::I32(int(head_dim, "a head width")?),
        Arg::I32(int(n_angles, "pairs")?),
        Arg::I32(i32::from(kind == crate::backend::Rope::Neox)),
        Arg::I32(int(stride, "a row stride")?),
    ];
    l.launch(&thorn_kernels::ROPE, "rope_f32", elementwise(pairs), &args)
}

#[cfg(test)]
mod tests;
