// Quantized matrix-vector products over GGUF blocks as stored: decode, and batches of up to 16 tokens (draft
// trees, small prefill chunks), out[t * stride + r] = scale * W[r] . x[t] (stride >= rows: a matrix that is
// one part of a stacked output, such as a fused QKV whose parts stay where the model file has them). With
// `add` set the product is added to what `out` holds (a residual, x += W . h, in one launch): rounded once,
// then added with one more rounding, as a separate add kernel would. Larger batches take the tensor-core
// products (gemm.cu), which give the same bits (blocks.cuh: the canonical product).
//
// Weights are the GGUF tensor's bytes, uploaded once or read in place: `rows` rows of `cols` weights.
// Activations are `nt` tokens quantized as quantize_q8_1 does: `q` (nt x cols int8) and `ds` (nt x cols/32
// pairs (d, d * sum q)), given, or made by the kernel's own prologue from floats (see MV_QUANTIZED below).
// `scale` is the tensor scale (NVFP4's second level; 1 for the others).
//
// One warp per output row, 4 rows per block: launch with block (32, 4) and a grid of at most ceil(rows / 4)
// blocks (the blocks stride over the rows). Each lane takes a quarter (8 values) of a 32-value block, so a
// warp covers 8 blocks per step; the quarter's weights are unpacked to 8-bit integers and multiplied by
// dp4a, exactly. The lanes leave each token's quarter sums in the warp's shared scratch, and lane t then
// folds token t's blocks of the step in order (blocks.cuh's block_term): integer sums exact, floats in the
// canonical order, so every token of a batch is folded by its own lane at once.

#define MV_ROWS 4
#define MV_TOKENS 16

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

// A warp's scratch for folding its products in block order: per token, each lane's integer sum of its
// quarter, or (packed Q4_1) each lane's block term; rows of 36 words, so that the folding lanes' 16-byte
// reads of 8 tokens fall in distinct banks. Per block of the step (GGUF formats), the block's scales.
#define MV_FOLD_PAD 36
struct MvFold {
    union {
        int isum[MV_TOKENS][MV_FOLD_PAD];
        float term[MV_TOKENS][MV_FOLD_PAD];
    };
    float2 scale[8];
};

template <int F>
__device__ __forceinline__ void matvec(const unsigned char* __restrict__ w, const signed char* q,
                                       const float2* ds, const float* __restrict__ x,
                                       const float* __restrict__ nw, float* __restrict__ out, int rows, int cols,
                                       int nt, int stride, float scale, int add, int mode, float eps) {
    const int nb = cols >> 5;
    mv_input(x, nw, mode, nt, cols, eps, q, ds);
    __shared__ MvFold folds[MV_ROWS];
    MvFold& f = folds[threadIdx.y];
    const int lane = threadIdx.x;
    const int g = lane >> 2;
    const int k = lane & 3;
    // Rows a warp at a time, the grid striding over them (a prologue's grid is capped, so each block's
    // prologue serves many rows).
    for (int r = blockIdx.x * MV_ROWS + threadIdx.y; r < rows; r += gridDim.x * MV_ROWS) {
        const unsigned char* row = w + (long)r * row_bytes<F>(cols);
        // Lane t < nt: token t's sum so far.
        float acc = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += 8) {
            // Group g takes block b0 + g (past the row's end: nothing, but it still writes its zeros).
            const int b = b0 + g;
            Quarter wq = {0u, 0u, 0.0f, 0.0f};
            if (b < nb) {
                wq = quarter<F>(row, b, k);
            }
            // The block's scales: (d, m), or the halves' (d0, d1) from quarters 0 and 2.
            if (k == 0) {
                f.scale[g].x = wq.d;
            }
            if (k == (two_scales<F>() ? 2 : 1)) {
                f.scale[g].y = two_scales<F>() ? wq.d : wq.m;
            }
#pragma unroll
            for (int t = 0; t < MV_TOKENS; t++) {
                if (t < nt) {
                    int isum = 0;
                    if (b < nb) {
                        const int* xq = (const int*)(q + (long)t * cols + 32 * b + 8 * k);
                        isum = __dp4a((int)wq.v0, xq[0], __dp4a((int)wq.v1, xq[1], 0));
                    }
                    f.isum[t][lane] = isum;
                }
            }
            __syncwarp();
            if (lane < nt) {
                const int n = min(8, nb - b0);
                for (int j = 0; j < n; j++) {
                    const uint4 s = *(const uint4*)&f.isum[lane][4 * j];
                    const float2 dx = ds[(long)lane * nb + b0 + j];
                    acc = __fadd_rn(acc, block_term<F>(f.scale[j], dx, (int)(s.x + s.y), (int)(s.z + s.w)));
                }
            }
            __syncwarp();
        }
        if (lane < nt) {
            store_out(out + (long)lane * stride + r, __fmul_rn(acc, scale), add);
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

// Q4_1 rows repacked at load for aligned loads (blocks.cuh's q4_1p_row_bytes). One warp per output row, 4
// rows per block as above; lane l takes blocks l, l + 32, ...: a block is one 16-byte and one 4-byte load,
// and the lane's first block of its first row is loaded before the prologue, so that the weights' round
// trip overlaps it (a row of up to 1024 values is then one round trip). Each lane computes its block's term
// for every token (blocks.cuh's block_term) into the warp's scratch, and lane t folds token t's terms of
// the step in block order: the canonical product, as the GGUF kernels and the tensor-core products.
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
    __shared__ MvFold folds[MV_ROWS];
    MvFold& f = folds[threadIdx.y];
    bool loaded = true;
    for (; r < rows; r += gridDim.x * MV_ROWS) {
        const unsigned char* row = w + (long)r * rb;
        float acc = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += 32) {
            const int b = b0 + lane;
            if (!loaded && b < nb) {
                wq = *(const uint4*)(row + 16 * b);
                wdm = *(const unsigned*)(row + 16 * nb + 4 * b);
            }
            loaded = false;
            const unsigned lo[4] = {wq.x & 0x0f0f0f0fu, wq.y & 0x0f0f0f0fu, wq.z & 0x0f0f0f0fu,
                                    wq.w & 0x0f0f0f0fu};
            const unsigned hi[4] = {(wq.x >> 4) & 0x0f0f0f0fu, (wq.y >> 4) & 0x0f0f0f0fu,
                                    (wq.z >> 4) & 0x0f0f0f0fu, (wq.w >> 4) & 0x0f0f0f0fu};
            const float2 dm = make_float2(f16_to_f32((unsigned short)(wdm & 0xffffu)),
                                          f16_to_f32((unsigned short)(wdm >> 16)));
            if (b < nb) {
#pragma unroll
                for (int t = 0; t < MV_TOKENS; t++) {
                    if (t < nt) {
                        const int* xq = (const int*)(q + (long)t * cols + 32 * b);
                        int ilo = 0;
                        int ihi = 0;
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            ilo = __dp4a((int)lo[i], xq[i], ilo);
                            ihi = __dp4a((int)hi[i], xq[4 + i], ihi);
                        }
                        f.term[t][lane] = block_term<FMT_Q4_1>(dm, ds[(long)t * nb + b], ilo, ihi);
                    }
                }
            }
            __syncwarp();
            if (lane < nt) {
                const int n = min(32, nb - b0);
                for (int j = 0; j < n; j++) {
                    acc = __fadd_rn(acc, f.term[lane][j]);
                }
            }
            __syncwarp();
        }
        loaded = false;
        if (lane < nt) {
            store_out(out + (long)lane * stride + r, __fmul_rn(acc, scale), add);
        }
    }
}

// Float weights (f32, or f16 as bits) times float activations (nt x cols, read in `mode` as above, never
// MV_QUANTIZED), for the matrices that are not block-quantized. Same launch shape; lanes stride over the
// columns.
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
            const int v = (int)(signed char)(word >> (8 * (j & 3)));
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
