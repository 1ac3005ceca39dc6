// RMS norm over rows: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
//
// One block per row; blockDim.x a multiple of 32, at most 1024 (the reductions use full-warp shuffles
// and one shared slot per warp). The sum of squares is f32 here (the CPU sums exact squares in f64), so
// the GPU result is checked against the CPU's with a tolerance, not bit for bit. Self-contained.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// A block-wide sum of each thread's `v`; every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// x, out: rows x d (row-major); w: d.
extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ out, int d, float eps) {
    const float* xr = x + (long)blockIdx.x * d;
    float* orow = out + (long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = xr[i];
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        orow[i] = xr[i] * scale * w[i];
    }
}
