// Activation quantization for the quantized matrix products: blocks of 32 floats to 8-bit integers with
// one scale, as the CPU backend does (the prelude's quantize_lane). The matrix products can also quantize
// their own input in a prologue (matvec.cu); these kernels serve the inputs too wide or too many for that.
//
// One thread per value, one warp per block of 32 (the block's max and sum are warp shuffles). `n` is a
// multiple of 32 (rows x cols, cols a multiple of 32) and blockDim.x a multiple of 32, so every warp is
// either wholly in range or wholly out.

// x: n floats; q: n int8; ds: n / 32 pairs (d, s).
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, signed char* __restrict__ q,
                                         float2* __restrict__ ds, int n) {
    GRID_WAIT();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    quantize_lane(x[i], i, q, ds);
}

// The same quantization fused behind the two ops that feed most matrix products, so neither leaves its
// float result in memory only to be read back: each computes its values exactly as the unfused kernel does
// (the same operations in the same order), so fused and unfused results are identical.

// RMS norm then quantization of each row (rmsnorm_f32's arithmetic, then quantize_q8_1's): x rows of d
// (a multiple of 32); q, ds as quantize_q8_1 writes them; `out`, when not null, gets the normed floats too
// (for float matrices). One block per row, blockDim.x a multiple of 32 (at most 1024); warp 0 computes the
// row's scale (the prelude's warp_rms_scale, the order every norm uses).
extern "C" __global__ void rmsnorm_quantize_q8_1(const float* __restrict__ x, const float* __restrict__ w,
                                                 signed char* __restrict__ q, float2* __restrict__ ds,
                                                 float* __restrict__ out, int d, float eps) {
    GRID_WAIT();
    const long r = blockIdx.x;
    const float* xr = x + r * d;
    const float scale = block_rms_scale(xr, d, eps);
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int b = threadIdx.x >> 5; b < d / 32; b += warps) {
        const int i = 32 * b + lane;
        const float v = xr[i] * scale * w[i];
        if (out != nullptr) {
            out[r * d + i] = v;
        }
        quantize_lane(v, r * d + i, q, ds);
    }
}

// SwiGLU of fused gate/up rows ([gate (f) | up (f)], swiglu_rows_f32's arithmetic) then quantization of the
// result (rows x f, f a multiple of 32): the down projection's input; `out`, when not null, gets the floats
// too (for float matrices). One thread per output value, whole warps per block of 32; 256 threads a block,
// one per value (no grid-stride: the grid covers rows x f).
extern "C" __global__ void swiglu_quantize_q8_1(const float* __restrict__ gu, signed char* __restrict__ q,
                                                float2* __restrict__ ds, float* __restrict__ out, int rows,
                                                int f) {
    GRID_WAIT();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * f) {
        return;
    }
    const long t = i / f;
    const long j = i - t * f;
    const float g = gu[t * 2 * f + j];
    const float v = g / (1.0f + expf(-g)) * gu[t * 2 * f + f + j];
    if (out != nullptr) {
        out[i] = v;
    }
    quantize_lane(v, i, q, ds);
}
