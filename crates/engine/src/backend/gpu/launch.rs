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
mod matmul;
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
pub use matmul::{
    Acts, GEMM_TOKENS, MATVEC_TOKENS, PROLOGUE_SHARED, Prep, Weights, embed, matvec, quantize_q8_1,
    rmsnorm_quantize, swiglu_quantize,
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
