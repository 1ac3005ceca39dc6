// The prelude of every kernel module. The catalog puts this text in front of each source, so NVRTC compiles
// each module on its own with no include path (no toolkit headers), and the CPU simulator of the tests
// compiles the same text. Only what several modules share lives here.

#ifndef THORN_SIM
// Dynamic shared memory (the simulator defines its own).
#define THORN_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

// Programmatic dependent launch (sm_90 and later, when the runtime launches with it): a kernel may start
// while the kernel before it finishes. Every kernel calls GRID_WAIT() before it reads or writes memory that
// the kernels before it write or read (at its top, or after loading only weights, which nothing writes):
// it waits until the previous kernel has finished and its writes are visible, then lets the next kernel
// start. Without the launch attribute (or before sm_90, or in the simulator) there is nothing to wait for.
#if defined(THORN_SIM) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
#define GRID_WAIT() \
    do {            \
    } while (0)
#else
#define GRID_WAIT()                                       \
    do {                                                  \
        asm volatile("griddepcontrol.wait;" ::: "memory"); \
        asm volatile("griddepcontrol.launch_dependents;");   \
    } while (0)
#endif

// Sum over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// Maximum over the 32 lanes of a warp; every lane gets it.
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// A block-wide sum of each thread's `v`; every thread gets the total. blockDim a multiple of 32, at most
// 1024, every thread of the block calling it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int lane = t & 31;
    const int warp = t >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = (blockDim.x * blockDim.y * blockDim.z + 31) >> 5;
    v = lane < warps ? partial[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// The RMS norm's scale of a row of `d` floats, 1 / sqrt(mean(x^2) + eps): the exact squares summed in f64
// as the CPU does (so both devices get the same scale, and the same 8-bit activations after it, but at the
// rare rounding boundary where the order of the sum moves it), in one fixed order: lane j sums elements j,
// j + 32, ..., then the warp's butterfly (commutative at each step, so every lane holds the same total).
// Every kernel that norms a row (rmsnorm_f32, rmsnorm_quantize_q8_1, the matrix products' prologue) calls
// this, so they all get the same bits whatever their block shape. All 32 lanes of a warp call it (lane =
// threadIdx.x % 32, blockDim.x a multiple of 32); every lane gets the scale.
__device__ __forceinline__ float warp_rms_scale(const float* __restrict__ x, int d, float eps) {
    double ss = 0.0;
    for (int i = threadIdx.x & 31; i < d; i += 32) {
        const double v = x[i];
        ss += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) {
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    return (float)(1.0 / sqrt(ss / (double)d + (double)eps));
}

// warp_rms_scale of a row for a whole block: warp 0 computes it, every thread of the block gets it (all
// call this; the block's threads wait for warp 0).
__device__ __forceinline__ float block_rms_scale(const float* __restrict__ x, int d, float eps) {
    __shared__ float row_scale;
    if (threadIdx.x < 32 && threadIdx.y == 0 && threadIdx.z == 0) {
        const float s = warp_rms_scale(x, d, eps);
        if (threadIdx.x == 0) {
            row_scale = s;
        }
    }
    __syncthreads();
    return row_scale;
}

// Value `v` at index `i` quantized to 8 bits with the 31 other lanes of its warp, which hold the rest of its
// block of 32 (indices i & ~31 .. i | 31), as the CPU backend does (`quantize_block_ref`): the block's scale
// d = max|v| / 127, q = round-half-even(v * (1 / d)), and lane 0 writes (d, d * sum q) (the sum for the
// weight formats with a minimum, Q4_1). Same IEEE operations in the same order as the CPU reference, so the
// two agree bit for bit. Every lane of the warp calls it.
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

// IEEE half (as its bits) to float, exactly.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const unsigned sign = (unsigned)(h & 0x8000u) << 16;
    const unsigned e = (h >> 10) & 0x1fu;
    const unsigned m = h & 0x3ffu;
    if (e == 0) {
        // Zero or subnormal: m * 2^-24, exact in float.
        const float v = (float)m * 5.9604644775390625e-8f;
        return __uint_as_float(__float_as_uint(v) | sign);
    }
    if (e == 31) {
        return __uint_as_float(sign | 0x7f800000u | (m << 13));
    }
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
#endif
}

// Float to IEEE half (as its bits), rounding to nearest, ties to even; overflow gives infinity.
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    const unsigned x = __float_as_uint(f);
    const unsigned sign = (x >> 16) & 0x8000u;
    const unsigned ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        return (unsigned short)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) {
        return (unsigned short)(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) {
        // Below the smallest normal half: the subnormal count of 2^-24, rounded to nearest even (1024 is
        // the smallest normal's bit pattern, which is right).
        return (unsigned short)(sign | (unsigned)__float2int_rn(__uint_as_float(ax) * 16777216.0f));
    }
    const unsigned r = ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u;
    return (unsigned short)(sign | (r >> 13));
#endif
}

// Loads of GGUF block fields. Blocks of 18, 34 and 210 bytes leave their fields 2-byte aligned only, so a
// 32-bit word is read as two halves there.
__device__ __forceinline__ unsigned load_u32_a2(const unsigned char* p) {
    const unsigned short* h = (const unsigned short*)p;
    return (unsigned)h[0] | ((unsigned)h[1] << 16);
}
__device__ __forceinline__ unsigned load_u32_a4(const unsigned char* p) {
    return *(const unsigned*)p;
}
__device__ __forceinline__ float load_f16(const unsigned char* p) {
    return f16_to_f32(*(const unsigned short*)p);
}

// Minus infinity (no math header here).
#define NEG_INF __uint_as_float(0xff800000u)

// A block-wide maximum of each thread's `v`, like block_sum.
__device__ float block_max(float v) {
    __shared__ float partial[32];
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int lane = t & 31;
    const int warp = t >> 5;
    v = warp_max(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = (blockDim.x * blockDim.y * blockDim.z + 31) >> 5;
    v = lane < warps ? partial[lane] : NEG_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// FP8 E4M3 (OCP E4M3FN) to float, exactly: the magnitude bits moved up 7 places are the f16 with the same
// mantissa and an exponent 8 lower, so the value is that f16 times 256. 0x7F and 0xFF (NaN) decode as 480;
// the KV cache never stores them.
__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    return f16_to_f32((unsigned short)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))) * 256.0f;
}
