// Warp-level tensor-core products (mma.sync, sm_80 and later), shared by the tensor-core GEMM (gemm.cu) and
// attention (attention.cu). Where there is no mma (the simulator, GPUs before sm_80) each lane gathers the
// rows and columns of its results from the lanes that hold them with shuffles and forms them itself, so the
// fragments' layouts and every kernel's tiling are tested on any machine.

// Fragments of an m16n8 int8 product (lane = 4 g + t): A (16 rows x K, row-major) a0 = A[g][4t..4t + 3],
// a1 = A[g + 8][4t..], and for K = 32 a2 = A[g][16 + 4t..], a3 = A[g + 8][16 + 4t..]; B (K x 8, by column)
// b0 = B[4t..4t + 3][g], and for K = 32 b1 = B[16 + 4t..][g]; D (16 x 8 int32) d0, d1 = D[g][2t], D[g][2t + 1],
// d2, d3 = D[g + 8][2t], D[g + 8][2t + 1]. Where there is no mma (the simulator, GPUs before sm_80) each lane
// gathers the A rows and B columns of its four results from the lanes that hold them and forms them with
// dp4a: the same exact integers.
template <int K>
__device__ __forceinline__ void mma_gathered(const unsigned* a, const unsigned* b, int* d) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    int sum[4] = {0, 0, 0, 0};
#pragma unroll
    for (int s = 0; s < 4; s++) {
#pragma unroll
        for (int h = 0; h < K / 16; h++) {
            // Words s of half h of A's rows g and g + 8, and of B's columns 2t and 2t + 1.
            const int row_g = (int)__shfl_sync(0xffffffffu, a[2 * h], 4 * g + s);
            const int row_g8 = (int)__shfl_sync(0xffffffffu, a[2 * h + 1], 4 * g + s);
            const int col0 = (int)__shfl_sync(0xffffffffu, b[h], 4 * (2 * t) + s);
            const int col1 = (int)__shfl_sync(0xffffffffu, b[h], 4 * (2 * t + 1) + s);
            sum[0] = __dp4a(row_g, col0, sum[0]);
            sum[1] = __dp4a(row_g, col1, sum[1]);
            sum[2] = __dp4a(row_g8, col0, sum[2]);
            sum[3] = __dp4a(row_g8, col1, sum[3]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        d[i] = sum[i];
    }
}

// D = A . B, K = 32: a[4], b[2] as above.
__device__ __forceinline__ void mma_k32(const unsigned* a, const unsigned* b, int* d) {
#if defined(THORN_SIM) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
    mma_gathered<32>(a, b, d);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
#endif
}

// D = A . B, K = 16: a[2], b[1] as above.
__device__ __forceinline__ void mma_k16(const unsigned* a, const unsigned* b, int* d) {
#if defined(THORN_SIM) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
    mma_gathered<16>(a, b, d);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(0));
#endif
}


// Fragments of an m16n8k16 f16 product with f32 accumulation (lane = 4 g + t), each register two f16, the
// lower index in the low half: A (16 x 16, row-major) a0 = A[g][2t, 2t + 1], a1 = A[g + 8][2t, 2t + 1],
// a2 = A[g][2t + 8, 2t + 9], a3 = A[g + 8][2t + 8, 2t + 9]; B (16 x 8, by column) b0 = B[2t, 2t + 1][g],
// b1 = B[2t + 8, 2t + 9][g]; C and D (f32) as the int8 products'. D = A . B + C: the products are exact in
// f32; where emulated they are added to C one k after another (the tensor cores' own order of the sum is
// theirs, the same for every element: a result depends only on its row of A and column of B).
__device__ __forceinline__ float f16_lo(unsigned pair) {
    return f16_to_f32((unsigned short)(pair & 0xffffu));
}
__device__ __forceinline__ float f16_hi(unsigned pair) {
    return f16_to_f32((unsigned short)(pair >> 16));
}

__device__ __forceinline__ void mma_f16(const unsigned* a, const unsigned* b, float* c) {
#if defined(THORN_SIM) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 800
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    float row[2][16];  // A's rows g and g + 8
    float col[2][16];  // B's columns 2t and 2t + 1
#pragma unroll
    for (int s = 0; s < 4; s++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const unsigned lo = __shfl_sync(0xffffffffu, a[r], 4 * g + s);
            const unsigned hi = __shfl_sync(0xffffffffu, a[2 + r], 4 * g + s);
            row[r][2 * s] = f16_lo(lo);
            row[r][2 * s + 1] = f16_hi(lo);
            row[r][8 + 2 * s] = f16_lo(hi);
            row[r][9 + 2 * s] = f16_hi(hi);
            const unsigned b0 = __shfl_sync(0xffffffffu, b[0], 4 * (2 * t + r) + s);
            const unsigned b1 = __shfl_sync(0xffffffffu, b[1], 4 * (2 * t + r) + s);
            col[r][2 * s] = f16_lo(b0);
            col[r][2 * s + 1] = f16_hi(b0);
            col[r][8 + 2 * s] = f16_lo(b1);
            col[r][9 + 2 * s] = f16_hi(b1);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float sum = c[i];
        for (int k = 0; k < 16; k++) {
            sum += row[i >> 1][k] * col[i & 1][k];
        }
        c[i] = sum;
    }
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Two f16 (their bits) as one register, `lo` in the low half.
__device__ __forceinline__ unsigned f16_pair(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// A float as the sum of two f16, hi = f16(x) and lo = f16(x - hi): products with an f16 operand through two
// f16 products keep about 21 bits of x (x within f16's range).
struct F16Split {
    unsigned short hi, lo;
};
__device__ __forceinline__ F16Split f16_split(float x) {
    const unsigned short hi = f32_to_f16(x);
    return F16Split{hi, f32_to_f16(x - f16_to_f32(hi))};
}
