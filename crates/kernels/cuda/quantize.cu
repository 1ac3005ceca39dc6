// Activation quantization for the quantized matrix products: blocks of 32 floats to 8-bit integers with
// one scale, as the CPU backend does (`quantize_block_ref`): d = max|x| / 127, q = round-half-even(x / d)
// (as x * (1 / d)), and s = d * sum(q) for the weight formats with a minimum (Q4_1). Same IEEE operations
// in the same order as the CPU reference, so the two are meant to agree bit for bit.
//
// One thread per value, one warp per block of 32 (the block's max and sum are warp shuffles). `n` is a
// multiple of 32 (rows x cols, cols a multiple of 32) and blockDim.x a multiple of 32, so every warp is
// either wholly in range or wholly out. Self-contained (float2 is an NVRTC built-in type).

// Value `v` at index `i` quantized with the 31 other lanes of its warp, which hold the rest of its block of
// 32 (indices i & ~31 .. i | 31): the block's scale d = max|v| / 127, q = round-half-even(v * (1 / d)), and
// lane 0 writes (d, d * sum q). Every lane of the warp calls it.
__device__ __forceinline__ void quantize_lane(float v, long i, signed char* __restrict__ q,
                                              float2* __restrict__ ds) {
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int r = __float2int_rn(v * id);
    q[i] = (signed char)r;
    int sum = r;
    for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if ((i & 31) == 0) {
        ds[i / 32] = make_float2(d, d * (float)sum);
    }
}

// x: n floats; q: n int8; ds: n / 32 pairs (d, s).
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, signed char* __restrict__ q,
                                         float2* __restrict__ ds, int n) {
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
// (for float matrices). One block per row with blockDim as rmsnorm_f32 takes it (d rounded up to 32, at
// most 1024), so the sum of squares is reduced in the same order.
extern "C" __global__ void rmsnorm_quantize_q8_1(const float* __restrict__ x, const float* __restrict__ w,
                                                 signed char* __restrict__ q, float2* __restrict__ ds,
                                                 float* __restrict__ out, int d, float eps) {
    const long r = blockIdx.x;
    const float* xr = x + r * d;
    double ss = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const double v = xr[i];
        ss += v * v;
    }
    const float scale = (float)(1.0 / sqrt(block_sum_f64(ss) / (double)d + (double)eps));
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
// result (rows x f, f a multiple of 32): the down projection's input. One thread per output value, whole
// warps per block of 32; 256 threads a block, one per value (no grid-stride: the grid covers rows x f).
extern "C" __global__ void swiglu_quantize_q8_1(const float* __restrict__ gu, signed char* __restrict__ q,
                                                float2* __restrict__ ds, int rows, int f) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * f) {
        return;
    }
    const long t = i / f;
    const long j = i - t * f;
    const float g = gu[t * 2 * f + j];
    quantize_lane(g / (1.0f + expf(-g)) * gu[t * 2 * f + f + j], i, q, ds);
}
