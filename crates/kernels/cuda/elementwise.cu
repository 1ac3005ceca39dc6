// Element-wise kernels of the forward pass: residual add, SiLU-gated products (SwiGLU).
//
// Every kernel walks its elements with a grid-stride loop, so any grid covers any size; launch with
// 256 threads per block and enough blocks to fill the device (the backend caps the grid). Self-contained:
// no toolkit headers, so NVRTC compiles it without an include path.

// dst[i] = src[i] for i < n (a pass's staged embedding rows into its residual stream, inside its graph).
extern "C" __global__ void copy_f32(float* __restrict__ dst, const float* __restrict__ src, int n) {
    GRID_WAIT();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}

// x[i] += y[i] for i < n.
extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, int n) {
    GRID_WAIT();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)) (the CPU's formula, with expf).
extern "C" __global__ void silu_mul_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                        float* __restrict__ out, int n) {
    GRID_WAIT();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// The fused gate/up layout: row t of `gu` is [gate (f) | up (f)]; out row t = silu(gate) * up (f).
extern "C" __global__ void swiglu_rows_f32(const float* __restrict__ gu, float* __restrict__ out,
                                           int rows, int f) {
    GRID_WAIT();
    const long total = (long)rows * f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const long t = i / f;
        const long j = i - t * f;
        const float g = gu[t * 2 * f + j];
        out[i] = g / (1.0f + expf(-g)) * gu[t * 2 * f + f + j];
    }
}
