// RMS norm over rows: out[r] = x[r] / sqrt(mean(x^2) + eps) * w.
//
// One block per row; blockDim.x a multiple of 32, at most 1024. Warp 0 computes the row's scale with the
// prelude's warp_rms_scale (the exact squares summed in f64 like the CPU, the scale 1 / sqrt(mean + eps)
// in f64 rounded to f32, in the one order every norm kernel uses); only the order of the f64 sum differs
// from the CPU's, so the result equals the CPU's except where that order moves the scale across an f32
// rounding boundary.

// x, out: rows x d (row-major); w: d.
extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ out, int d, float eps) {
    GRID_WAIT();
    const float* xr = x + (long)blockIdx.x * d;
    float* orow = out + (long)blockIdx.x * d;
    const float scale = block_rms_scale(xr, d, eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        orow[i] = xr[i] * scale * w[i];
    }
}
