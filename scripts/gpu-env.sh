# Sourced by scripts/gpu-check and scripts/gpu-peer on a GPU machine: what both need before thorn runs
# there. Not a command of its own.
#
# gpu_nvrtc: thorn's CUDA backend loads libnvrtc at run time, by the name libnvrtc.so first. A machine with
# CUDA 13 only has libnvrtc.so.13; this finds one (the CUDA toolkit, thorn's cache of NVIDIA's wheels, or
# the nvidia-cuda-nvrtc Python package), links it as libnvrtc.so in a temporary directory and puts that
# on LD_LIBRARY_PATH. Sets NVRTC to the library found (empty if none).
gpu_nvrtc() {
  NVRTC=$(python3 - <<'PY' || true
import glob, os, sys
home = os.environ.get("THORN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "thorn")
roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
         os.path.join(home, "cuda-tools", "**")]
try:
    import nvidia
    roots += [os.path.join(p, "**") for p in nvidia.__path__]
except Exception:
    pass
for r in roots:
    for f in sorted(glob.glob(os.path.join(r, "libnvrtc.so*"), recursive=True)):
        if "builtins" not in f and "alt" not in f:
            print(f)
            sys.exit(0)
PY
)
  if [ -n "$NVRTC" ]; then
    local libdir
    libdir=$(mktemp -d)
    ln -sf "$NVRTC" "$libdir/libnvrtc.so"
    export LD_LIBRARY_PATH="$libdir:$(dirname "$NVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
}

# gpu_tests_binary DIR: the engine's test binary from .gpu/ (scripts/gpu-check build) unpacked into DIR, and
# the path it was built under made to point here (its tests find their fixtures there). Prints its path.
gpu_tests_binary() {
  xz -dc .gpu/engine-tests.xz > "$1/engine-tests" && chmod +x "$1/engine-tests"
  local root
  root=$(cat .gpu/source-root 2>/dev/null || true)
  if [ -n "$root" ] && [ "$root" != "$PWD" ] && [ ! -e "$root" ]; then
    mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"
  fi
  echo "$1/engine-tests"
}
