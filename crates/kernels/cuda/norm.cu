// RMS norm over rows: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
//
// One block per row; blockDim.x a multiple of 32, at most 1024 (the prelude's block_sum_f64: full-warp
// shuffles and one shared slot per warp). Like the CPU, the exact squares are summed in f64 and the scale is
// 1 / sqrt(mean + eps) in f64 rounded to f32; only the order of the f64 sum differs, so the result equals
// the CPU's except where that order moves the scale across an f32 rounding boundary.

// x, out: rows x d (row-major); w: d.
extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ out, int d, float eps) {
    const float* xr = x + (long)blockIdx.x * d;
    float* orow = out + (long)blockIdx.x * d;
    double ss = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const double v = xr[i];
        ss += v * v;
    }
    const float scale = (float)(1.0 / sqrt(block_sum_f64(ss) / (double)d + (double)eps));
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        orow[i] = xr[i] * scale * w[i];
    }
}
