//! CUDA kernel modules compiled at run time by NVRTC, cached on disk (built with the `cuda` feature).
//!
//! The CUDA backend compiles each [`thorn_kernels::Module`] once per GPU architecture. The PTX is kept in
//! a cache directory under a name made of the module, the architecture, a hash of the source and NVRTC's
//! version, so a restart (or a second process) loads it instead of compiling, and a changed source or
//! compiler never reuses a stale entry. An entry is written to a temporary file and renamed into place,
//! so a concurrent reader never sees half of one; an unreadable entry is compiled again.
//!
//! NVRTC needs no GPU: this runs (and is tested in CI) on machines with only `libnvrtc` on the loader
//! path. Like [`super::cuda`], it probes the library before the first call (cudarc panics without it)
//! and runs cudarc under `catch_unwind`.

use crate::backend::DeviceError;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use thorn_kernels::Module;

/// Whether NVRTC can be loaded.
#[expect(unsafe_code, reason = "cudarc's library probe is an unsafe fn")]
pub fn is_present() -> bool {
    // SAFETY: tries to dlopen NVRTC under each soname cudarc would use (no symbol is called).
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn missing() -> DeviceError {
    DeviceError::MissingLibrary {
        library: "libnvrtc (the CUDA runtime compiler)",
        hint: "install CUDA's NVRTC (e.g. the nvidia-cuda-nvrtc-cu12 wheel) on the loader path",
    }
}

/// NVRTC's version, `(major, minor)`.
#[expect(unsafe_code, reason = "a raw NVRTC call")]
pub fn version() -> Result<(i32, i32), DeviceError> {
    if !is_present() {
        return Err(missing());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (probed above); nvrtcVersion writes two ints through valid pointers.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
    }));
    match r {
        Ok(cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS) => Ok((major, minor)),
        _ => Err(missing()),
    }
}

/// FNV-1a over the source: a stable name for its cache entries (not a security boundary: the cache is
/// the user's own directory).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Compiled PTX by module and architecture, on disk when a directory is given.
#[derive(Debug, Default)]
pub struct KernelCache {
    dir: Option<PathBuf>,
    /// NVRTC's version, probed on first use.
    nvrtc: Option<(i32, i32)>,
    compiled: usize,
    hits: usize,
}

impl KernelCache {
    /// A cache in `dir` (`None`: compile every time).
    pub fn new(dir: Option<PathBuf>) -> Self {
        KernelCache {
            dir,
            ..KernelCache::default()
        }
    }

    /// Modules compiled and modules read from the cache, so far.
    pub fn stats(&self) -> (usize, usize) {
        (self.compiled, self.hits)
    }

    /// The PTX of `module` for `arch` (a virtual architecture: `compute_90`), from the cache or compiled;
    /// every kernel the module names is checked to be in it.
    pub fn ptx(&mut self, module: &Module, arch: &'static str) -> Result<String, DeviceError> {
        let (major, minor) = match self.nvrtc {
            Some(v) => v,
            None => *self.nvrtc.insert(version()?),
        };
        let entry = format!(
            "{}-{arch}-{:016x}-nvrtc{major}.{minor}.ptx",
            module.name,
            fnv1a(module.source)
        );
        let path = self.dir.as_ref().map(|d| d.join(&entry));
        if let Some(p) = &path
            && let Ok(ptx) = std::fs::read_to_string(p)
            && defines_all(&ptx, module)
        {
            self.hits += 1;
            return Ok(ptx);
        }
        let ptx = compile(module, arch)?;
        self.compiled += 1;
        if let (Some(dir), Some(p)) = (&self.dir, &path) {
            let tmp = dir.join(format!("{entry}.{}.tmp", std::process::id()));
            let stored = std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&tmp, &ptx))
                .and_then(|()| std::fs::rename(&tmp, p));
            if let Err(e) = stored {
                tracing::debug!("kernel cache {}: {e}", dir.display());
                let _ = std::fs::remove_file(&tmp);
            }
        }
        Ok(ptx)
    }
}

/// Whether `ptx` has an entry for every kernel `module` names.
fn defines_all(ptx: &str, module: &Module) -> bool {
    module.kernels.iter().all(|k| {
        ptx.lines().any(|l| {
            l.trim_start()
                .strip_prefix(".visible .entry ")
                .and_then(|r| r.strip_prefix(k))
                .is_some_and(|r| r.starts_with('('))
        })
    })
}

/// How many parameters `kernel` takes, read off its `.entry` in `ptx` (`None` when it is not there): the
/// launcher checks every launch's argument count against it, since `cuLaunchKernel` cannot.
pub fn ptx_arity(ptx: &str, kernel: &str) -> Option<usize> {
    let head = format!(".entry {kernel}(");
    let start = ptx.find(&head)? + head.len();
    let end = start + ptx[start..].find(')')?;
    Some(ptx[start..end].matches(".param").count())
}

fn compile(module: &Module, arch: &'static str) -> Result<String, DeviceError> {
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        name: Some(format!("{}.cu", module.name)),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let fail = |log: String| DeviceError::Compile {
        module: module.name,
        arch,
        log,
    };
    let out = catch_unwind(AssertUnwindSafe(|| {
        cudarc::nvrtc::compile_ptx_with_opts(module.source, opts)
    }))
    .map_err(|_| fail("NVRTC failed (a missing symbol: is it older than CUDA 12.8?)".into()))?;
    let ptx = match out {
        Ok(p) => p.to_src(),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => {
            return Err(fail(log.to_string_lossy().into_owned()));
        }
        Err(e) => return Err(fail(e.to_string())),
    };
    if !defines_all(&ptx, module) {
        return Err(fail(format!(
            "the PTX lacks some of the kernels {:?}",
            module.kernels
        )));
    }
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC is here, or the test says it skipped (CI sets `THORN_REQUIRE_NVRTC=1`: there it must run).
    fn nvrtc_here() -> bool {
        if is_present() {
            return true;
        }
        assert!(
            std::env::var_os("THORN_REQUIRE_NVRTC").is_none(),
            "THORN_REQUIRE_NVRTC is set but libnvrtc is not on the loader path"
        );
        println!(
            "skipped: libnvrtc is not on the loader path (see scripts/cuda-compile-check --lib-dir)"
        );
        false
    }

    #[test]
    fn the_catalog_compiles_for_hopper_and_thor_and_comes_back_from_the_cache() {
        if !nvrtc_here() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut cache = KernelCache::new(Some(dir.path().join("kernels")));
        // Jetson AGX Thor is compute capability 10.1 to CUDA 12.8 and 12.9, and 11.0 from CUDA 13 on
        // (whose NVRTC refuses `compute_101`: seen on an H200 machine's CUDA 13 NVRTC).
        let thor = if version().unwrap().0 >= 13 {
            "compute_110"
        } else {
            "compute_101"
        };
        let archs = ["compute_90", thor];
        for round in 0..2 {
            for m in thorn_kernels::ALL {
                for arch in archs {
                    let ptx = cache.ptx(m, arch).unwrap();
                    for k in m.kernels {
                        assert!(
                            ptx_arity(&ptx, k).is_some_and(|n| n > 0),
                            "{} {arch}: {k}",
                            m.name
                        );
                    }
                    if m.name == "elementwise" {
                        // add_f32(float* x, const float* y, int n)
                        assert_eq!(ptx_arity(&ptx, "add_f32"), Some(3));
                        assert_eq!(ptx_arity(&ptx, "swiglu_rows_f32"), Some(4));
                    }
                    assert!(
                        ptx.contains(&format!(".target sm_{}", &arch[8..])),
                        "{arch}"
                    );
                }
            }
            let n = thorn_kernels::ALL.len() * archs.len();
            let want = if round == 0 { (n, 0) } else { (n, n) };
            assert_eq!(
                cache.stats(),
                want,
                "round {round}: (compiled, from the cache)"
            );
        }
        // A damaged entry is compiled again, not used.
        for e in std::fs::read_dir(dir.path().join("kernels")).unwrap() {
            std::fs::write(e.unwrap().path(), "garbage").unwrap();
        }
        cache.ptx(&thorn_kernels::NORM, "compute_90").unwrap();
        assert_eq!(cache.stats().0, thorn_kernels::ALL.len() * archs.len() + 1);
    }

    #[test]
    fn a_kernel_that_does_not_compile_is_an_error_with_nvrtcs_log() {
        if !nvrtc_here() {
            return;
        }
        let bad = Module {
            name: "broken",
            source: "extern \"C\" __global__ void k(float* x) { x[0] = not_declared; }",
            kernels: &["k"],
        };
        match KernelCache::new(None).ptx(&bad, "compute_90") {
            Err(DeviceError::Compile { module, log, .. }) => {
                assert_eq!(module, "broken");
                assert!(log.contains("not_declared"), "{log}");
            }
            other => panic!("unexpected: {other:?}"),
        }
        let missing = Module {
            name: "missing",
            source: "extern \"C\" __global__ void present(float* x) { x[0] = 1.0f; }",
            kernels: &["present", "absent"],
        };
        assert!(matches!(
            KernelCache::new(None).ptx(&missing, "compute_90"),
            Err(DeviceError::Compile { .. })
        ));
    }
}
