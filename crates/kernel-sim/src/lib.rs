//! thorn's CUDA kernels, run on the CPU: the harness that lets their numerics be tested on machines
//! without a GPU (every build machine of this project, and CI).
//!
//! The build compiles each module of the `thorn-kernels` catalog, the very text NVRTC compiles for a GPU,
//! as C++ after a header (`sim/cuda_sim.hpp`) that maps the CUDA dialect the kernels use onto the CPU: a
//! block's warps are OS threads and each warp's 32 lanes are fibers on its thread, run from one
//! synchronisation point to the next (a shuffle, `__syncwarp`, `__syncthreads`); blocks run one after
//! another, so `__shared__` variables are function statics of the running block. [`launch`] takes arguments the way
//! `cuLaunchKernel` does (a pointer to each value), so the backend's launch code is the same for a GPU
//! stream and for this harness; here the pointers are host addresses.
//!
//! What it proves: the kernels' arithmetic, indexing, launch shapes and reductions, against the CPU
//! backend's scalar references. What it cannot: the GPU's memory model and alignment rules, timing, and
//! the `__CUDA_ARCH__` branches (inline PTX conversions), which only a GPU runs. The simulator is strict
//! where a GPU would be undefined: a shuffle or `__syncwarp` whose mask is not the whole warp or names a
//! lane that has exited, or lanes of one warp stopping at different synchronisation points, abort the
//! process with a message. Races between warps are real races here (their threads run concurrently);
//! within a warp the lanes' order between synchronisation points is one valid interleaving. Launches are
//! serialised.
//!
//! Tests only: it is slow (a fiber switch per lane per shuffle), and it is never a device.

/// A launch's grid or block shape.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dim3 {
    /// Fastest-varying dimension.
    pub x: u32,
    /// Second.
    pub y: u32,
    /// Slowest.
    pub z: u32,
}

impl From<[u32; 3]> for Dim3 {
    fn from([x, y, z]: [u32; 3]) -> Self {
        Dim3 { x, y, z }
    }
}

/// Why a launch did not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchError {
    /// No kernel of that name in that module of the catalog.
    UnknownKernel(String),
    /// More than 1,024 threads per block, an empty grid, or more shared memory than a GPU has.
    BadShape,
    /// The kernel takes another number of parameters than were given.
    Arity,
}

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LaunchError::UnknownKernel(k) => write!(f, "no kernel {k} in the simulated catalog"),
            LaunchError::BadShape => f.write_str("invalid launch shape"),
            LaunchError::Arity => f.write_str("the kernel takes another number of parameters"),
        }
    }
}

impl std::error::Error for LaunchError {}

#[expect(unsafe_code, reason = "the simulator's C++ entry point")]
mod ffi {
    use super::Dim3;
    use std::ffi::{c_char, c_int, c_void};

    unsafe extern "C" {
        pub fn thorn_sim_launch(
            module: *const c_char,
            kernel: *const c_char,
            grid: Dim3,
            block: Dim3,
            shared: usize,
            params: *mut *mut c_void,
            n_params: c_int,
        ) -> c_int;
    }
}

/// Runs `kernel` of catalog module `module` over `grid` blocks of `block` threads, with `shared` bytes of
/// dynamic shared memory; `params[i]` points to the value of the kernel's argument `i`. A kernel that takes
/// another number of parameters is [`LaunchError::Arity`], checked before anything runs.
///
/// # Safety
/// As for `cuLaunchKernel`: `params` must hold exactly one pointer per kernel parameter, each to a value
/// of that parameter's C type, and every pointer argument must address host memory that is valid for
/// everything the kernel reads and writes with this shape.
#[expect(
    unsafe_code,
    reason = "calls a kernel through the simulator's C++ launcher"
)]
pub unsafe fn launch(
    module: &str,
    kernel: &str,
    grid: Dim3,
    block: Dim3,
    shared: usize,
    params: &mut [*mut std::ffi::c_void],
) -> Result<(), LaunchError> {
    let cstr =
        |s: &str| std::ffi::CString::new(s).map_err(|_| LaunchError::UnknownKernel(s.into()));
    let (m, k) = (cstr(module)?, cstr(kernel)?);
    let n = std::ffi::c_int::try_from(params.len()).map_err(|_| LaunchError::Arity)?;
    // SAFETY: the names are NUL-terminated strings that outlive the call, `n` is the length of `params`
    // (the launcher checks it against the kernel's parameter count first); the caller guarantees the
    // parameters themselves (this function's contract).
    let rc = unsafe {
        ffi::thorn_sim_launch(
            m.as_ptr(),
            k.as_ptr(),
            grid,
            block,
            shared,
            params.as_mut_ptr(),
            n,
        )
    };
    match rc {
        0 => Ok(()),
        1 => Err(LaunchError::UnknownKernel(format!("{module}::{kernel}"))),
        3 => Err(LaunchError::Arity),
        _ => Err(LaunchError::BadShape),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[expect(unsafe_code, reason = "launches the simulator with bad requests")]
    fn bad_launches_are_errors_before_anything_runs() {
        let one = Dim3 { x: 1, y: 1, z: 1 };
        let mut none: [*mut std::ffi::c_void; 0] = [];
        // SAFETY: none of these launches runs a kernel: each is refused first.
        unsafe {
            assert_eq!(
                launch("elementwise", "add_f32", one, one, 0, &mut none),
                Err(LaunchError::Arity)
            );
            assert!(matches!(
                launch("elementwise", "nope", one, one, 0, &mut none),
                Err(LaunchError::UnknownKernel(_))
            ));
            let huge = Dim3 {
                x: 2048,
                y: 1,
                z: 1,
            };
            let mut three = [std::ptr::null_mut(); 3];
            assert_eq!(
                launch("elementwise", "add_f32", one, huge, 0, &mut three),
                Err(LaunchError::BadShape)
            );
        }
    }
}
