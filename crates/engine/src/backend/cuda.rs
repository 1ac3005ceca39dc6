//! The CUDA backend (built with the `cuda` feature), on cudarc with dynamic loading: the driver
//! (`libcuda`) and NVRTC (`libnvrtc`) are found at run time, so the binary builds and starts on machines
//! without CUDA.
//!
//! cudarc panics when a library it needs is missing, so [`Cuda::new`] probes both libraries first and
//! reports which one is missing ([`DeviceError::MissingLibrary`]); a driver without a usable GPU is
//! [`DeviceError::NoGpu`]. Every call into cudarc runs under `catch_unwind`, so a missing symbol in an old
//! driver is an error too, never a panic.
//!
//! Its kernels (NVRTC-compiled from `thorn-kernels`, device weights and KV pages, CUDA graphs) land with
//! the rest of the backend; until then no device is handed out: on a machine with a usable GPU,
//! [`Cuda::new`] names the GPU and says that this build has no kernels for it rather than pretending to
//! run.

use super::DeviceError;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// A CUDA device (not constructed until the backend's kernels land).
#[derive(Debug)]
pub struct Cuda {
    never: std::convert::Infallible,
}

/// What a probe found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// The GPU's name.
    pub name: String,
    /// Its compute capability (`(9, 0)` for sm_90).
    pub capability: (i32, i32),
}

#[expect(unsafe_code, reason = "cudarc's library probe is an unsafe fn")]
fn driver_present() -> bool {
    // SAFETY: tries to dlopen the driver library under each soname cudarc would use (no symbol is called).
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Cuda {
    /// Finds GPU `ordinal`: the libraries, the driver, the device.
    pub fn probe(ordinal: usize) -> Result<Probe, DeviceError> {
        if !driver_present() {
            return Err(DeviceError::MissingLibrary {
                library: "libcuda (the NVIDIA driver)",
                hint: "install the NVIDIA driver, or run with --device cpu",
            });
        }
        // The kernels are compiled at run time: no NVRTC, no kernels.
        super::nvrtc::version()?;
        let found = catch_unwind(AssertUnwindSafe(|| {
            let ctx = cudarc::driver::CudaContext::new(ordinal)
                .map_err(|e| format!("GPU {ordinal}: {e}"))?;
            let name = ctx.name().map_err(|e| e.to_string())?;
            let capability = ctx.compute_capability().map_err(|e| e.to_string())?;
            Ok::<_, String>(Probe { name, capability })
        }));
        match found {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => Err(DeviceError::NoGpu(e)),
            Err(_) => Err(DeviceError::NoGpu(
                "the CUDA driver failed while opening the device (is it older than CUDA 12.8?)"
                    .into(),
            )),
        }
    }

    /// Opens GPU `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        let p = Self::probe(ordinal)?;
        Err(DeviceError::Unsupported {
            device: "this build's CUDA backend",
            what: format!(
                "GPU {ordinal} ({}, sm_{}{}): its kernels are not built yet ({} kernel modules)",
                p.name,
                p.capability.0,
                p.capability.1,
                thorn_kernels::ALL.len()
            ),
        })
    }

    /// Whether the driver library can be loaded.
    pub fn is_available() -> bool {
        driver_present()
    }

    /// Proof that no value exists: lets every op's CUDA arm type-check without a body.
    pub fn never(&self) -> ! {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_opening_one_is_a_typed_error() {
        match Cuda::new(0) {
            Err(DeviceError::MissingLibrary { library, .. }) => {
                assert!(library.starts_with("libcuda") != Cuda::is_available());
            }
            Err(DeviceError::NoGpu(why)) => assert!(Cuda::is_available(), "{why}"),
            Err(DeviceError::Unsupported { what, .. }) => {
                assert!(what.contains("sm_"), "{what}");
                println!("found {what}");
            }
            other => panic!("unexpected: {other:?}"),
        }
    }
}
