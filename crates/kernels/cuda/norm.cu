// RMS norm over rows: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
//
// One block per row; blockDim.x a multiple of 32, at most 1024 (the prelude's block_sum: full-warp shuffles
// and one shared slot per warp). The sum of squares is f32 here (the CPU sums exact squares in f64), so the
// GPU result is checked against the CPU's with a tolerance, not bit for bit.

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
