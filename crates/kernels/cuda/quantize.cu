// Activation quantization for the quantized matrix products: blocks of 32 floats to 8-bit integers with
// one scale, as the CPU backend does (`quantize_block_ref`): d = max|x| / 127, q = round-half-even(x / d)
// (as x * (1 / d)), and s = d * sum(q) for the weight formats with a minimum (Q4_1). Same IEEE operations
// in the same order as the CPU reference, so the two are meant to agree bit for bit.
//
// One thread per value, one warp per block of 32 (the block's max and sum are warp shuffles). `n` is a
// multiple of 32 (rows x cols, cols a multiple of 32) and blockDim.x a multiple of 32, so every warp is
// either wholly in range or wholly out. Self-contained (float2 is an NVRTC built-in type).

// x: n floats; q: n int8; ds: n / 32 pairs (d, s).
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, signed char* __restrict__ q,
                                         float2* __restrict__ ds, int n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float v = x[i];
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
    if ((threadIdx.x & 31) == 0) {
        ds[i / 32] = make_float2(d, d * (float)sum);
    }
}
