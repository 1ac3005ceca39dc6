//! The GPU wing: every [`Device`](super::Device) op run by the CUDA kernels through [`launch`], on any
//! [`GpuRuntime`] (a CUDA GPU, or the kernel simulator in the tests).
//!
//! Its memory is device memory: weights (uploaded once; on a GPU that reads host memory in place, such as
//! Jetson Thor's unified memory, read where the model file's mapping has them), the model's [`Buf`](super::Buf)s ([`GpuBuf`]), and the
//! device's own staging (batch metadata, RoPE rows, attention partials, quantized activations:
//! [`DevVec`]s). An op queues its kernels on the runtime's one stream and returns; nothing waits until the
//! host needs a result ([`Buf::read_back`](super::Buf::read_back), [`Buf::edit`](super::Buf::edit), [`GpuDevice::finish`] at the end
//! of a pass). Host data an op needs (batch metadata, RoPE rows, embedding rows) is uploaded in stream
//! order, so a queued kernel still sees what it was given, and staging that already holds the same bytes
//! is not uploaded again: a decode step uploads its batch metadata once for all its layers.
//!
//! With CUDA graphs on (the default), the launches between two host waits are recorded and a repeated
//! segment is replayed as one captured graph ([`Queue`]). A model's forward pass goes further ([`plan`]):
//! it stages its inputs first (its embedding rows, batch metadata and RoPE rows in one buffer, one upload
//! through a page-locked buffer; a kernel of the pass copies the rows into place), and a pass seen before
//! under the same [`StepKey`] is replayed whole, its ops not run on the host at all (a decode step's host
//! time is then that upload, one graph launch and
//! reading back each logits row's greedy token and log-normaliser, reduced on the device:
//! [`Device::logit_best`](super::Device::logit_best); a top-k sampler's step adds the row's 64 best
//! values, [`Device::logit_top`](super::Device::logit_top), from which it draws the token the row would
//! give).
//!
//! The KV page pool is plain device memory ([`PoolMem`]) that the host never touches: the prefix cache's
//! copy-on-write and a draft's accepted rows are copied by kernels (`kv_copy_page`, `kv_move_rows`) queued
//! in order with the passes, through the pool's [`PageDevice`](super::pages::PageDevice). A hybrid model's
//! recurrent states are device [`Buf`](super::Buf)s too: a sequence's moves to the device at its first
//! pass and stays, its kept steps, roll-backs and prefix-cache snapshots copied on the device, so a
//! decode step uploads its inputs and reads back its logits only. On the host still:
//! embedding rows (a few rows of exact dequantization from the mapped file, then uploaded) and the f64
//! reference matmul.

//!
//! # Which type is what
//!
//! | type | what |
//! |---|---|
//! | [`Device::Cuda`](super::Device::Cuda) | the GPU arm of the device enum: a [`GpuDevice`] (on a CUDA GPU, or the simulator in the tests) |
//! | [`GpuDevice`] ([`device`]) | the GPU device: every op as kernel launches on a [`Queue`], its weights ([`GpuMatrix`]) and staging |
//! | [`GpuRuntime`] ([`runtime`]) | where the kernels run and the memory lives: a CUDA GPU or the simulator; [`Queue`] records and replays its launches as graphs |
//! | [`StepKey`] ([`plan`]) | a forward pass's step plan: what its launches depend on; a pass seen before replays whole |
//! | [`DevMem`], [`GpuBuf`], [`PoolMem`], [`DevVec`] ([`mem`]) | device memory: an allocation, a `Buf`'s storage, a KV pool's store, staging |
//! | [`launch`] | each kernel's launch (its arguments and checks), shared by every runtime; its tests run on the simulator |
//! | `cuda::Gpu` ([`cuda`]) | the CUDA runtime (built with the `cuda` feature): one context and stream, kernels compiled by `nvrtc` into the kernel cache; `cuda::Cuda` is the driver's probes. Without the feature [`cuda`] is a stub whose `open` says so |
//! | `nvrtc::KernelCache` | NVRTC's compiled PTX on disk, by module, architecture and source hash |
//! | `sim::Sim` | the kernel simulator as a runtime (tests only) |

pub mod device;
pub mod launch;
pub mod mem;
pub mod plan;
pub mod runtime;

#[cfg(not(feature = "cuda"))]
#[path = "gpu/no_cuda.rs"]
pub mod cuda;
#[cfg(feature = "cuda")]
#[path = "gpu/cuda.rs"]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(test)]
pub(crate) mod sim;
#[cfg(test)]
mod tests;

pub use device::{GpuDevice, GpuMatrix, Quantized};
pub use mem::{DevMem, DevVec, GpuBuf, PoolMem};
pub use plan::{PlanId, StepKey};
pub use runtime::{GpuRuntime, Graph, GraphStats, KernelTimes, Queue};
