// Tensor-core products for batches of more than 16 tokens (prefill chunks, batched decode with draft trees):
// out[t * stride + r] = scale * W[r] . x[t], optionally added to `out` (`add`), over the quantized input
// (`q`, `ds` as quantize_q8_1 makes them), with the arguments and results of the matrix-vector kernels
// (matvec.cu), bit for bit: both compute blocks.cuh's canonical product. The weights are read once per 32
// tokens instead of once per 16, and the integer dot products run on the tensor cores.
//
// A block of 4 warps computes 64 rows x 32 tokens; a warp 16 rows x 32 tokens, as four int8 mma tiles of
// 16 x 8 per 32-value block: m16n8k32 (the block's whole integer dot product), or for the formats with a
// scale per 16 values two m16n8k16 (one per half). Each lane unpacks its share of the weights' fragment
// with the same unpacking as the matrix-vector kernels, reads its share of the activations' fragment from
// `q`, and folds its four results per tile into their sums in block order. Launch with block (128) and grid
// (ceil(rows / 64), ceil(nt / 32)); rows and tokens past the ends are computed from zeros and not stored.

#define GEMM_ROWS 64
#define GEMM_TOKENS 32
// The packed Q4_1 layout (matvec_q4_1p's), as one more format of the products below.
#define FMT_Q4_1P 6

// One row's share of block b in a lane's A fragment: its words t (values 4t..4t + 3) and 4 + t
// (16 + 4t..), and the block's scales as block_term takes them. A missing row (past the end) is zeros.
struct Frag {
    unsigned lo, hi;
    float2 s;
};

template <int F>
__device__ __forceinline__ Frag frag(const unsigned char* row, int b, int t, int cols) {
    Frag a = {0u, 0u, make_float2(0.0f, 0.0f)};
    if (row == nullptr) {
        return a;
    }
    if constexpr (F == FMT_Q4_1P) {
        const unsigned v = load_u32_a4(row + 16 * b + 4 * t);
        a.lo = v & 0x0f0f0f0fu;
        a.hi = (v >> 4) & 0x0f0f0f0fu;
        const unsigned dm = load_u32_a4(row + 16 * (cols >> 5) + 4 * b);
        a.s = make_float2(f16_to_f32((unsigned short)(dm & 0xffffu)), f16_to_f32((unsigned short)(dm >> 16)));
    } else {
        // Word t is half (t & 1) of quarter t / 2; word 4 + t the same of quarter 2 + t / 2.
        const Quarter l = quarter<F>(row, b, t >> 1);
        const Quarter h = quarter<F>(row, b, 2 + (t >> 1));
        a.lo = (t & 1) ? l.v1 : l.v0;
        a.hi = (t & 1) ? h.v1 : h.v0;
        a.s = two_scales<F>() ? make_float2(l.d, h.d) : make_float2(l.d, l.m);
    }
    return a;
}

template <int F>
__device__ __forceinline__ long gemm_row_bytes(int cols) {
    if constexpr (F == FMT_Q4_1P) {
        return q4_1p_row_bytes(cols);
    } else {
        return row_bytes<F>(cols);
    }
}

template <int F>
__device__ __forceinline__ void gemm(const unsigned char* __restrict__ w, const signed char* __restrict__ q,
                                     const float2* __restrict__ ds, float* __restrict__ out, int rows, int cols,
                                     int nt, int stride, float scale, int add) {
    constexpr int TILES = GEMM_TOKENS / 8;
    // The format as block_term knows it (packed Q4_1 is Q4_1).
    constexpr int FT = F == FMT_Q4_1P ? FMT_Q4_1 : F;
    const int nb = cols >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    // This lane's rows (of A and of its results).
    const int r0 = blockIdx.x * GEMM_ROWS + (threadIdx.x >> 5) * 16 + g;
    const int r1 = r0 + 8;
    const long rb = gemm_row_bytes<F>(cols);
    const unsigned char* w0 = r0 < rows ? w + (long)r0 * rb : nullptr;
    const unsigned char* w1 = r1 < rows ? w + (long)r1 * rb : nullptr;
    // Tile j's first token; this lane's B column is token tok0 + 8j + g, its results tokens tok0 + 8j + 2t
    // and + 1.
    const int tok0 = blockIdx.y * GEMM_TOKENS;
    float acc[TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; j++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[j][i] = 0.0f;
        }
    }
    for (int b = 0; b < nb; b++) {
        const Frag f0 = frag<F>(w0, b, t, cols);
        const Frag f1 = frag<F>(w1, b, t, cols);
        const unsigned a[4] = {f0.lo, f1.lo, f0.hi, f1.hi};
#pragma unroll
        for (int j = 0; j < TILES; j++) {
            const int tb = tok0 + 8 * j + g;
            unsigned x[2] = {0u, 0u};
            if (tb < nt) {
                const signed char* xq = q + (long)tb * cols + 32 * b;
                x[0] = load_u32_a4((const unsigned char*)xq + 4 * t);
                x[1] = load_u32_a4((const unsigned char*)xq + 16 + 4 * t);
            }
            int lo[4];
            int hi[4] = {0, 0, 0, 0};
            if constexpr (two_scales<FT>()) {
                const unsigned alo[2] = {a[0], a[1]};
                const unsigned ahi[2] = {a[2], a[3]};
                mma_k16(alo, &x[0], lo);
                mma_k16(ahi, &x[1], hi);
            } else {
                mma_k32(a, x, lo);
            }
            const int tc = tok0 + 8 * j + 2 * t;
            const float2 dx0 = tc < nt ? ds[(long)tc * nb + b] : make_float2(0.0f, 0.0f);
            const float2 dx1 = tc + 1 < nt ? ds[(long)(tc + 1) * nb + b] : make_float2(0.0f, 0.0f);
            acc[j][0] = __fadd_rn(acc[j][0], block_term<FT>(f0.s, dx0, lo[0], hi[0]));
            acc[j][1] = __fadd_rn(acc[j][1], block_term<FT>(f0.s, dx1, lo[1], hi[1]));
            acc[j][2] = __fadd_rn(acc[j][2], block_term<FT>(f1.s, dx0, lo[2], hi[2]));
            acc[j][3] = __fadd_rn(acc[j][3], block_term<FT>(f1.s, dx1, lo[3], hi[3]));
        }
    }
#pragma unroll
    for (int j = 0; j < TILES; j++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = (i >> 1) ? r1 : r0;
            const int tok = tok0 + 8 * j + 2 * t + (i & 1);
            if (r < rows && tok < nt) {
                store_out(out + (long)tok * stride + r, __fmul_rn(acc[j][i], scale), add);
            }
        }
    }
}

#define GEMM_ARGS                                                                                          \
    const unsigned char *w, const signed char *q, const float2 *ds, float *out, int rows, int cols, int nt, \
        int stride, float scale, int add
#define GEMM_CALL w, q, ds, out, rows, cols, nt, stride, scale, add

extern "C" __global__ void gemm_q4_0(GEMM_ARGS) { GRID_WAIT(); gemm<FMT_Q4_0>(GEMM_CALL); }
extern "C" __global__ void gemm_q4_1(GEMM_ARGS) { GRID_WAIT(); gemm<FMT_Q4_1>(GEMM_CALL); }
extern "C" __global__ void gemm_q8_0(GEMM_ARGS) { GRID_WAIT(); gemm<FMT_Q8_0>(GEMM_CALL); }
extern "C" __global__ void gemm_q4_k(GEMM_ARGS) { GRID_WAIT(); gemm<FMT_Q4_K>(GEMM_CALL); }
extern "C" __global__ void gemm_q6_k(GEMM_ARGS) { GRID_WAIT(); gemm<FMT_Q6_K>(GEMM_CALL); }
extern "C" __global__ void gemm_nvfp4(GEMM_ARGS) { GRID_WAIT(); gemm<FMT_NVFP4>(GEMM_CALL); }
extern "C" __global__ void gemm_q4_1p(GEMM_ARGS) { GRID_WAIT(); gemm<FMT_Q4_1P>(GEMM_CALL); }
