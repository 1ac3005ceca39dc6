// Quantized matrix-vector products over GGUF blocks as stored: decode, and batches of up to 16 tokens (draft
// trees, small prefill chunks), out[t * stride + r] = scale * W[r] . x[t] (stride >= rows: a matrix that is
// one part of a stacked output, such as a fused QKV whose parts stay where the model file has them). With
// `add` set the product is added to what `out` holds (a residual, x += W . h, in one launch): rounded once,
// then added with one more rounding, as a separate add kernel would.
//
// Weights are the GGUF tensor's bytes, uploaded once or read in place: `rows` rows of `cols` weights.
// Activations are `nt` tokens quantized as quantize_q8_1 does: `q` (nt x cols int8) and `ds` (nt x cols/32
// pairs (d, d * sum q)), given, or made by the kernel's own prologue from floats (see MV_QUANTIZED below).
// `scale` is the tensor scale (NVFP4's second level; 1 for the others).
//
// One warp per output row, 4 rows per block: launch with block (32, 4) and a grid of at most ceil(rows / 4)
// blocks (the blocks stride over the rows). Each lane
// takes a quarter (8 values) of a 32-value activation block, so a warp covers 8 blocks per step; the
// quarter's weights are unpacked to 8-bit integers and multiplied by dp4a, exactly. A quarter's weights are
// w_j = d * (v_j - z) plus a per-block offset m, so its share of the dot product is
// d * dx * (sum v_j q_j - z * sum q_j), and the block's m * (dx * sum q) is added once, by the first
// quarter. This is the CPU backend's algebra (d * dx * isum + m * sx per block, see its qmatmul); only the
// order of the float sums differs, so results agree to rounding, not bit for bit.

#define MV_ROWS 4
#define MV_TOKENS 16

#define FMT_Q4_0 0
#define FMT_Q4_1 1
#define FMT_Q8_0 2
#define FMT_Q4_K 3
#define FMT_Q6_K 4
#define FMT_NVFP4 5

// Eight weights of one quarter as two words of four int8, and how to scale them.
struct Quarter {
    unsigned v0, v1;
    float d;  // scale of the integers
    float m;  // per-block offset, times the block's dx * sum q
    int z;    // zero point subtracted from each integer
};

// Unsigned E4M3 block scale (NVFP4), decoded as ggml does: 0x00 and 0x7F are zero, the sign bit ignored.
__device__ __forceinline__ float ue4m3_to_f32(unsigned x) {
    if (x == 0 || x == 0x7f) {
        return 0.0f;
    }
    const unsigned e = (x >> 3) & 0xf;
    const unsigned m = x & 7;
    if (e == 0) {
        return (float)m * (1.0f / 512.0f);
    }
    return __uint_as_float(((e + 120) << 23) | (m << 20));
}

// Four E2M1 codes (one per byte, 0..15) to their doubled values {0, 1, 2, 3, 4, 6, 8, 12} with sign, as
// int8: two byte-permute table lookups (the positive and the negative table) and a per-byte select.
__device__ __forceinline__ unsigned e2m1x4_to_i8x4(unsigned codes) {
    const unsigned c = codes & 0x07070707u;
    const unsigned t = c | (c >> 4);
    const unsigned sel = ((t & 0xffu) | ((t >> 8) & 0xff00u)) & 0x7777u;
    const unsigned pos = __byte_perm(0x03020100u, 0x0c080604u, sel);
    const unsigned neg = __byte_perm(0xfdfeff00u, 0xf4f8fafcu, sel);
    const unsigned sign = ((codes >> 3) & 0x01010101u) * 0xffu;
    return (pos & ~sign) | (neg & sign);
}

// Quarter k (0..3) of 32-value block b of a row of format F.
template <int F>
__device__ __forceinline__ Quarter quarter(const unsigned char* row, int b, int k) {
    Quarter w;
    w.m = 0.0f;
    w.z = 0;
    if constexpr (F == FMT_Q4_0) {
        // 18 bytes: d (f16), 16 bytes: element j in the low nibble of byte j, element 16 + j in the high.
        const unsigned char* blk = row + 18 * b;
        const unsigned char* qs = blk + 2 + 8 * (k & 1);
        const int shift = 4 * (k >> 1);
        w.v0 = (load_u32_a2(qs) >> shift) & 0x0f0f0f0fu;
        w.v1 = (load_u32_a2(qs + 4) >> shift) & 0x0f0f0f0fu;
        w.d = load_f16(blk);
        w.m = -8.0f * w.d;
    } else if constexpr (F == FMT_Q4_1) {
        // 20 bytes: d, m (f16), nibbles as Q4_0.
        const unsigned char* blk = row + 20 * b;
        const unsigned char* qs = blk + 4 + 8 * (k & 1);
        const int shift = 4 * (k >> 1);
        w.v0 = (load_u32_a4(qs) >> shift) & 0x0f0f0f0fu;
        w.v1 = (load_u32_a4(qs + 4) >> shift) & 0x0f0f0f0fu;
        w.d = load_f16(blk);
        w.m = load_f16(blk + 2);
    } else if constexpr (F == FMT_Q8_0) {
        // 34 bytes: d (f16), 32 signed bytes.
        const unsigned char* blk = row + 34 * b;
        w.v0 = load_u32_a2(blk + 2 + 8 * k);
        w.v1 = load_u32_a2(blk + 6 + 8 * k);
        w.d = load_f16(blk);
    } else if constexpr (F == FMT_Q4_K) {
        // 144 bytes per 256: d, dmin (f16), 12 bytes of 6-bit scales and minimums for 8 sub-blocks of 32,
        // then 128 bytes: sub-blocks 2i and 2i + 1 in the low and high nibbles of bytes 32i..32i + 32.
        const int sub = b & 7;
        const unsigned char* blk = row + 144 * (b >> 3);
        const unsigned char* sc = blk + 4;
        unsigned s, mn;
        if (sub < 4) {
            s = sc[sub] & 63;
            mn = sc[sub + 4] & 63;
        } else {
            s = (sc[sub + 4] & 0xf) | ((sc[sub - 4] >> 6) << 4);
            mn = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
        }
        const unsigned char* qs = blk + 16 + 32 * (sub >> 1) + 8 * k;
        const int shift = 4 * (sub & 1);
        w.v0 = (load_u32_a4(qs) >> shift) & 0x0f0f0f0fu;
        w.v1 = (load_u32_a4(qs + 4) >> shift) & 0x0f0f0f0fu;
        w.d = load_f16(blk) * (float)s;
        w.m = -(load_f16(blk + 2) * (float)mn);
    } else if constexpr (F == FMT_Q6_K) {
        // 210 bytes per 256: ql (128), qh (64), 16 int8 scales (one per 16), d (f16). Each half of 128
        // values has 4 groups of 32: group g's low 4 bits are nibble g / 2 of ql[64n + 32(g % 2) + l], its
        // high 2 bits are bits 2g of qh[32n + l]; values are 6-bit with zero point 32.
        const int sub = b & 7;
        const int n = sub >> 2;
        const int g = sub & 3;
        const unsigned char* blk = row + 210 * (b >> 3);
        const unsigned char* ql = blk + 64 * n + 32 * (g & 1) + 8 * k;
        const unsigned char* qh = blk + 128 + 32 * n + 8 * k;
        const int lo = 4 * (g >> 1);
        const int hi = 2 * g;
        w.v0 = ((load_u32_a2(ql) >> lo) & 0x0f0f0f0fu) | (((load_u32_a2(qh) >> hi) & 0x03030303u) << 4);
        w.v1 = ((load_u32_a2(ql + 4) >> lo) & 0x0f0f0f0fu) | (((load_u32_a2(qh + 4) >> hi) & 0x03030303u) << 4);
        w.d = load_f16(blk + 208) * (float)(signed char)blk[192 + 8 * n + 2 * g + (k >> 1)];
        w.z = 32;
    } else {
        // NVFP4 as ggml stores it: 36 bytes per 64, four UE4M3 scales (one per 16), then 32 bytes: element
        // 16s + j in the low nibble of byte 8s + j, element 16s + 8 + j in its high nibble. E2M1 values are
        // doubled to integers, so the scale is halved.
        const unsigned char* blk = row + 36 * (b >> 1);
        const int s = 2 * (b & 1) + (k >> 1);
        const unsigned char* qs = blk + 4 + 8 * s;
        const int shift = 4 * (k & 1);
        w.v0 = e2m1x4_to_i8x4((load_u32_a4(qs) >> shift) & 0x0f0f0f0fu);
        w.v1 = e2m1x4_to_i8x4((load_u32_a4(qs + 4) >> shift) & 0x0f0f0f0fu);
        w.d = 0.5f * ue4m3_to_f32(blk[s]);
    }
    return w;
}

// Bytes of one row of `cols` weights of format F.
template <int F>
__device__ __forceinline__ long row_bytes(int cols) {
    if constexpr (F == FMT_Q4_0) {
        return (long)(cols / 32) * 18;
    } else if constexpr (F == FMT_Q4_1) {
        return (long)(cols / 32) * 20;
    } else if constexpr (F == FMT_Q8_0) {
        return (long)(cols / 32) * 34;
    } else if constexpr (F == FMT_Q4_K) {
        return (long)(cols / 256) * 144;
    } else if constexpr (F == FMT_Q6_K) {
        return (long)(cols / 256) * 210;
    } else {
        return (long)(cols / 64) * 36;
    }
}

// Stores one output: the product, or (add) the product added to what is there. __fadd_rn is never fused
// into a multiply-add, so the sum is rounded exactly as the unfused add kernel rounds it.
__device__ __forceinline__ void store_out(float* o, float v, int add) {
    *o = add ? __fadd_rn(*o, v) : v;
}

// How a product gets its input. MV_QUANTIZED: `q` and `ds` hold it, quantized by quantize_q8_1 or a fused
// kernel beside it. The others quantize it in the kernel's prologue, each block into its own shared memory,
// from floats at `x`: MV_FLOATS as they are, MV_NORM after the RMS norm with weight `nw` and `eps`, MV_SWIGLU
// after SwiGLU of [gate (cols) | up (cols)] rows. The prologue computes each value with the unfused
// kernels' arithmetic (rmsnorm_f32, swiglu_rows_f32, then quantize_lane), so the product's bits are those of
// the unfused launches: one launch where there were two. Float weights read the values the same way, one
// at a time, without quantizing them.
#define MV_QUANTIZED 0
#define MV_FLOATS 1
#define MV_NORM 2
#define MV_SWIGLU 3

// Each warp computes the norm scale of tokens warp, warp + MV_ROWS, ... (the prelude's warp_rms_scale, the
// order every norm uses) into `scales`; the block then waits for all of them.
__device__ __forceinline__ void mv_norm_scales(const float* __restrict__ x, int cols, int nt, float eps,
                                               float* scales) {
    for (int t = threadIdx.y; t < nt; t += MV_ROWS) {
        const float s = warp_rms_scale(x + (long)t * cols, cols, eps);
        if (threadIdx.x == 0) {
            scales[t] = s;
        }
    }
    __syncthreads();
}

// Value i of token t of the input in `mode` (not MV_QUANTIZED), as the unfused kernels compute it.
__device__ __forceinline__ float mv_value(const float* __restrict__ x, const float* __restrict__ nw,
                                          const float* scales, int mode, int t, int i, int cols) {
    if (mode == MV_NORM) {
        return x[(long)t * cols + i] * scales[t] * nw[i];
    }
    if (mode == MV_SWIGLU) {
        const float g = x[(long)t * 2 * cols + i];
        return g / (1.0f + expf(-g)) * x[(long)t * 2 * cols + cols + i];
    }
    return x[(long)t * cols + i];
}

// The prologue: the block's 4 warps quantize the nt x cols input into shared memory, a block of 32 values a
// warp at a time, then wait for each other.
__device__ __forceinline__ void mv_prologue(const float* __restrict__ x, const float* __restrict__ nw, int mode,
                                            int nt, int cols, const float* scales, signed char* q, float2* ds) {
    const int nb = cols >> 5;
    for (int idx = threadIdx.y; idx < nt * nb; idx += MV_ROWS) {
        const int t = idx / nb;
        const int i = 32 * (idx - t * nb) + threadIdx.x;
        quantize_lane(mv_value(x, nw, scales, mode, t, i, cols), (long)t * cols + i, q, ds);
    }
    __syncthreads();
}

// A prologue's dynamic shared memory: ds (nt x cols / 32 pairs), then q (nt x cols int8); the host sizes it
// the same way (launch.rs, matvec).

// The product's input: as given (MV_QUANTIZED), or made by the prologue into the block's shared memory (the
// norm scales, then the quantized copy), `q` and `ds` pointed at it.
__device__ __forceinline__ void mv_input(const float* __restrict__ x, const float* __restrict__ nw, int mode,
                                         int nt, int cols, float eps, const signed char*& q, const float2*& ds) {
    if (mode == MV_QUANTIZED) {
        return;
    }
    __shared__ float scales[MV_TOKENS];
    THORN_DYNAMIC_SHARED(float2, staged);
    if (mode == MV_NORM) {
        mv_norm_scales(x, cols, nt, eps, scales);
    }
    signed char* sq = (signed char*)(staged + nt * (cols >> 5));
    mv_prologue(x, nw, mode, nt, cols, scales, sq, staged);
    q = sq;
    ds = staged;
}

template <int F>
__device__ __forceinline__ void matvec(const unsigned char* __restrict__ w, const signed char* q,
                                       const float2* ds, const float* __restrict__ x,
                                       const float* __restrict__ nw, float* __restrict__ out, int rows, int cols,
                                       int nt, int stride, float scale, int add, int mode, float eps) {
    const int nb = cols >> 5;
    mv_input(x, nw, mode, nt, cols, eps, q, ds);
    const int lane = threadIdx.x;
    const int k = lane & 3;
    // Rows a warp at a time, the grid striding over them (a prologue's grid is capped, so each block's
    // prologue serves many rows).
    for (int r = blockIdx.x * MV_ROWS + threadIdx.y; r < rows; r += gridDim.x * MV_ROWS) {
        const unsigned char* row = w + (long)r * row_bytes<F>(cols);
        float acc[MV_TOKENS];
#pragma unroll
        for (int t = 0; t < MV_TOKENS; t++) {
            acc[t] = 0.0f;
        }
        for (int b = lane >> 2; b < nb; b += 8) {
            const Quarter wq = quarter<F>(row, b, k);
#pragma unroll
            for (int t = 0; t < MV_TOKENS; t++) {
                if (t < nt) {
                    const int* xq = (const int*)(q + (long)t * cols + 32 * b + 8 * k);
                    const int x0 = xq[0];
                    const int x1 = xq[1];
                    int isum = __dp4a((int)wq.v0, x0, __dp4a((int)wq.v1, x1, 0));
                    if (wq.z != 0) {
                        isum -= wq.z * __dp4a(0x01010101, x0, __dp4a(0x01010101, x1, 0));
                    }
                    const float2 dx = ds[(long)t * nb + b];
                    acc[t] += wq.d * dx.x * (float)isum;
                    if (k == 0) {
                        acc[t] += wq.m * dx.y;
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MV_TOKENS; t++) {
            if (t < nt) {
                const float v = warp_sum(acc[t]);
                if (lane == 0) {
                    store_out(out + (long)t * stride + r, v * scale, add);
                }
            }
        }
    }
}

#define MATVEC_ARGS                                                                                         \
    const unsigned char *w, const signed char *q, const float2 *ds, const float *x, const float *nw,       \
        float *out, int rows, int cols, int nt, int stride, float scale, int add, int mode, float eps
#define MATVEC_CALL w, q, ds, x, nw, out, rows, cols, nt, stride, scale, add, mode, eps

extern "C" __global__ void matvec_q4_0(MATVEC_ARGS) { GRID_WAIT(); matvec<FMT_Q4_0>(MATVEC_CALL); }
extern "C" __global__ void matvec_q4_1(MATVEC_ARGS) { GRID_WAIT(); matvec<FMT_Q4_1>(MATVEC_CALL); }
extern "C" __global__ void matvec_q8_0(MATVEC_ARGS) { GRID_WAIT(); matvec<FMT_Q8_0>(MATVEC_CALL); }
extern "C" __global__ void matvec_q4_k(MATVEC_ARGS) { GRID_WAIT(); matvec<FMT_Q4_K>(MATVEC_CALL); }
extern "C" __global__ void matvec_q6_k(MATVEC_ARGS) { GRID_WAIT(); matvec<FMT_Q6_K>(MATVEC_CALL); }
extern "C" __global__ void matvec_nvfp4(MATVEC_ARGS) { GRID_WAIT(); matvec<FMT_NVFP4>(MATVEC_CALL); }

// Float weights (f32, or f16 as bits) times float activations (nt x cols, read in `mode` as above, never
// MV_QUANTIZED), for the matrices that are not block-quantized. Same launch shape; lanes stride over the
// columns.
// Q4_1 rows repacked at load for aligned loads (the engine's `repack_q4_1`): a row of nb blocks is nb x 16
// bytes of nibbles (block b's at 16b: element j in the low nibble of byte j, element 16 + j in the high, as
// in GGUF), then nb (d, m) f16 pairs, padded to a multiple of 16 bytes. One warp per output row, 4 rows per
// block as above; lane l takes blocks l, l + 32, ...: a block is one 16-byte and one 4-byte load, and the
// lane's first block of its first row is loaded before the prologue, so that the weights' round trip
// overlaps it (a row of up to 1024 values is then one round trip). Per block the integer dot product is
// exact and d * dx * isum + m * (dx * sum q) is added once: the algebra of the GGUF kernel, with the float
// sums in another order.
__device__ __forceinline__ long q4_1p_row_bytes(int cols) {
    const int nb = cols >> 5;
    return 16L * nb + ((4L * nb + 15) & ~15L);
}

extern "C" __global__ void matvec_q4_1p(MATVEC_ARGS) {
    const int nb = cols >> 5;
    const int lane = threadIdx.x;
    const long rb = q4_1p_row_bytes(cols);
    int r = blockIdx.x * MV_ROWS + threadIdx.y;
    uint4 wq = make_uint4(0, 0, 0, 0);
    unsigned wdm = 0;
    if (r < rows && lane < nb) {
        const unsigned char* row = w + (long)r * rb;
        wq = *(const uint4*)(row + 16 * lane);
        wdm = *(const unsigned*)(row + 16 * nb + 4 * lane);
    }
    // Only weights were read: the rest depends on the kernels before this one.
    GRID_WAIT();
    mv_input(x, nw, mode, nt, cols, eps, q, ds);
    bool loaded = true;
    for (; r < rows; r += gridDim.x * MV_ROWS) {
        const unsigned char* row = w + (long)r * rb;
        float acc[MV_TOKENS];
#pragma unroll
        for (int t = 0; t < MV_TOKENS; t++) {
            acc[t] = 0.0f;
        }
        for (int b = lane; b < nb; b += 32) {
            if (!loaded) {
                wq = *(const uint4*)(row + 16 * b);
                wdm = *(const unsigned*)(row + 16 * nb + 4 * b);
            }
            loaded = false;
            const unsigned lo[4] = {wq.x & 0x0f0f0f0fu, wq.y & 0x0f0f0f0fu, wq.z & 0x0f0f0f0fu,
                                    wq.w & 0x0f0f0f0fu};
            const unsigned hi[4] = {(wq.x >> 4) & 0x0f0f0f0fu, (wq.y >> 4) & 0x0f0f0f0fu,
                                    (wq.z >> 4) & 0x0f0f0f0fu, (wq.w >> 4) & 0x0f0f0f0fu};
            const float d = f16_to_f32((unsigned short)(wdm & 0xffffu));
            const float m = f16_to_f32((unsigned short)(wdm >> 16));
#pragma unroll
            for (int t = 0; t < MV_TOKENS; t++) {
                if (t < nt) {
                    const int* xq = (const int*)(q + (long)t * cols + 32 * b);
                    int isum = 0;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        isum = __dp4a((int)lo[i], xq[i], isum);
                        isum = __dp4a((int)hi[i], xq[4 + i], isum);
                    }
                    const float2 dx = ds[(long)t * nb + b];
                    acc[t] += d * dx.x * (float)isum + m * dx.y;
                }
            }
        }
        loaded = false;
#pragma unroll
        for (int t = 0; t < MV_TOKENS; t++) {
            if (t < nt) {
                const float v = warp_sum(acc[t]);
                if (lane == 0) {
                    store_out(out + (long)t * stride + r, v * scale, add);
                }
            }
        }
    }
}

template <bool HALF>
__device__ __forceinline__ void matvec_float(const void* __restrict__ w, const float* __restrict__ x,
                                             const float* __restrict__ nw, float* __restrict__ out, int rows,
                                             int cols, int nt, int stride, int add, int mode, float eps) {
    __shared__ float scales[MV_TOKENS];
    if (mode == MV_NORM) {
        mv_norm_scales(x, cols, nt, eps, scales);
    }
    for (int r = blockIdx.x * MV_ROWS + threadIdx.y; r < rows; r += gridDim.x * MV_ROWS) {
        float acc[MV_TOKENS];
#pragma unroll
        for (int t = 0; t < MV_TOKENS; t++) {
            acc[t] = 0.0f;
        }
        for (int c = threadIdx.x; c < cols; c += 32) {
            const long i = (long)r * cols + c;
            const float wv = HALF ? f16_to_f32(((const unsigned short*)w)[i]) : ((const float*)w)[i];
#pragma unroll
            for (int t = 0; t < MV_TOKENS; t++) {
                if (t < nt) {
                    acc[t] += wv * mv_value(x, nw, scales, mode, t, c, cols);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MV_TOKENS; t++) {
            if (t < nt) {
                const float v = warp_sum(acc[t]);
                if (threadIdx.x == 0) {
                    store_out(out + (long)t * stride + r, v, add);
                }
            }
        }
    }
}

extern "C" __global__ void matvec_f32(const float* w, const float* x, const float* nw, float* out, int rows,
                                      int cols, int nt, int stride, int add, int mode, float eps) {
    GRID_WAIT();
    matvec_float<false>(w, x, nw, out, rows, cols, nt, stride, add, mode, eps);
}
extern "C" __global__ void matvec_f16(const unsigned short* w, const float* x, const float* nw, float* out,
                                      int rows, int cols, int nt, int stride, int add, int mode, float eps) {
    GRID_WAIT();
    matvec_float<true>(w, x, nw, out, rows, cols, nt, stride, add, mode, eps);
}

// Embedding rows: out[t] = row tokens[t] of a table of `d` columns of format F, dequantized exactly as the
// CPU's dequantize_ref does (d * (q - 8), d * q + m, d * q: each format's own expression). One thread per
// quarter block (8 values), grid-stride, 256 threads a block.
template <int F>
__device__ __forceinline__ void embed(const unsigned char* __restrict__ table, const int* __restrict__ tokens,
                                      float* __restrict__ out, int n, int d) {
    const int quarters = d / 8;
    const long total = (long)n * quarters;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int t = (int)(i / quarters);
        const int qi = (int)(i % quarters);
        const unsigned char* row = table + (long)tokens[t] * row_bytes<F>(d);
        float* o = out + (long)t * d + 8 * qi;
        if constexpr (F == FMT_NVFP4) {
            // E2M1 value times its block scale, as the reference (code 8 is minus zero).
            const int b = qi >> 2;
            const int k = qi & 3;
            const unsigned char* blk = row + 36 * (b >> 1);
            const int s = 2 * (b & 1) + (k >> 1);
            const float scale = ue4m3_to_f32(blk[s]);
            for (int j = 0; j < 8; j++) {
                const unsigned code = (blk[4 + 8 * s + j] >> (4 * (k & 1))) & 0xf;
                const unsigned mag = __byte_perm(0x03020100u, 0x0c080604u, code & 7) & 0xff;
                const float v = __uint_as_float(__float_as_uint(0.5f * (float)mag) | ((code & 8u) << 28));
                o[j] = v * scale;
            }
            continue;
        }
        const Quarter w = quarter<F>(row, qi >> 2, qi & 3);
        for (int j = 0; j < 8; j++) {
            const unsigned word = j < 4 ? w.v0 : w.v1;
            const int v = (int)(signed char)(word >> (8 * (j & 3))) - w.z;
            // The reference's own expression per format (signed zeros included).
            if constexpr (F == FMT_Q4_0) {
                o[j] = w.d * (float)(v - 8);
            } else if constexpr (F == FMT_Q4_1 || F == FMT_Q4_K) {
                o[j] = w.d * (float)v + w.m;
            } else {
                o[j] = w.d * (float)v;
            }
        }
    }
}

extern "C" __global__ void embed_q4_0(const unsigned char* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed<FMT_Q4_0>(table, tokens, out, n, d);
}
extern "C" __global__ void embed_q4_1(const unsigned char* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed<FMT_Q4_1>(table, tokens, out, n, d);
}
extern "C" __global__ void embed_q8_0(const unsigned char* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed<FMT_Q8_0>(table, tokens, out, n, d);
}
extern "C" __global__ void embed_q4_k(const unsigned char* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed<FMT_Q4_K>(table, tokens, out, n, d);
}
extern "C" __global__ void embed_q6_k(const unsigned char* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed<FMT_Q6_K>(table, tokens, out, n, d);
}
extern "C" __global__ void embed_nvfp4(const unsigned char* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed<FMT_NVFP4>(table, tokens, out, n, d);
}

// Float tables: f32 copied, f16 converted.
template <bool HALF>
__device__ __forceinline__ void embed_float(const void* __restrict__ table, const int* __restrict__ tokens,
                                            float* __restrict__ out, int n, int d) {
    const long total = (long)n * d;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const long src = (long)tokens[i / d] * d + i % d;
        out[i] = HALF ? f16_to_f32(((const unsigned short*)table)[src]) : ((const float*)table)[src];
    }
}

extern "C" __global__ void embed_f32(const float* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed_float<false>(table, tokens, out, n, d);
}
extern "C" __global__ void embed_f16(const unsigned short* table, const int* tokens, float* out, int n, int d) {
    GRID_WAIT();
    embed_float<true>(table, tokens, out, n, d);
}
