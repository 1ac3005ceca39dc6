// Weight blocks as GGUF stores them, shared by the matrix-vector products (matvec.cu) and the tensor-core
// products (gemm.cu): each format's 32-value blocks unpacked to 8-bit integers and their scales, and the one
// order in which every product kernel turns a block's exact integer dot product into floats and adds them up,
// so that a token's product has the same bits in whichever kernel, batch or launch it is computed.

#define FMT_Q4_0 0
#define FMT_Q4_1 1
#define FMT_Q8_0 2
#define FMT_Q4_K 3
#define FMT_Q6_K 4
#define FMT_NVFP4 5

// Eight weights of one quarter as two words of four int8, and how to scale them.
struct Quarter {
    unsigned v0, v1;
    float d;  // scale of the integers (of the quarter's half of the block, for two-scale formats)
    float m;  // per-block offset, times the block's dx * sum q
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

// Four 6-bit values (one per byte, 0..63) minus 32, as int8: bit 5 flipped gives v - 32 for v >= 32 and
// the low 6 bits of it otherwise, where bits 6 and 7 must be set too (per byte, no carries).
__device__ __forceinline__ unsigned centered6(unsigned v) {
    const unsigned x = v ^ 0x20202020u;
    return x | ((x & 0x20202020u) * 6u);
}

// Quarter k (0..3) of 32-value block b of a row of format F: values 8k..8k + 7.
template <int F>
__device__ __forceinline__ Quarter quarter(const unsigned char* row, int b, int k) {
    Quarter w;
    w.m = 0.0f;
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
        // high 2 bits are bits 2g of qh[32n + l]; values are 6-bit with zero point 32,
        // returned minus 32 (signed).
        const int sub = b & 7;
        const int n = sub >> 2;
        const int g = sub & 3;
        const unsigned char* blk = row + 210 * (b >> 3);
        const unsigned char* ql = blk + 64 * n + 32 * (g & 1) + 8 * k;
        const unsigned char* qh = blk + 128 + 32 * n + 8 * k;
        const int lo = 4 * (g >> 1);
        const int hi = 2 * g;
        w.v0 = centered6(((load_u32_a2(ql) >> lo) & 0x0f0f0f0fu) | (((load_u32_a2(qh) >> hi) & 0x03030303u) << 4));
        w.v1 = centered6(((load_u32_a2(ql + 4) >> lo) & 0x0f0f0f0fu) |
                         (((load_u32_a2(qh + 4) >> hi) & 0x03030303u) << 4));
        w.d = load_f16(blk + 208) * (float)(signed char)blk[192 + 8 * n + 2 * g + (k >> 1)];
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

// Bytes of a packed Q4_1 row (the engine's `repack_q4_1`): nb x 16 bytes of nibbles (block b's at 16b:
// element j in the low nibble of byte j, element 16 + j in the high, as in GGUF), then nb (d, m) f16 pairs,
// padded to a multiple of 16 bytes.
__device__ __forceinline__ long q4_1p_row_bytes(int cols) {
    const int nb = cols >> 5;
    return 16L * nb + ((4L * nb + 15) & ~15L);
}

// Whether format F scales the two halves (16 values each) of a 32-value block on their own (Q6_K's scales
// are per 16, NVFP4's per 16 of its 64-value blocks); the others have one scale d and one offset m per 32.
template <int F>
__device__ __forceinline__ constexpr bool two_scales() {
    return F == FMT_Q6_K || F == FMT_NVFP4;
}

// The canonical product. For a weight row and a token, block b contributes one term, from the exact integer
// dot products of its halves, lo (values 0..15) and hi (16..31), the block's scales s and the token's
// (dx, dx * sum q) for the block:
//   one scale  (s = (d, m)):   fma(m, dx * sum q, (d * dx) * (lo + hi))
//   two scales (s = (d0, d1)): fma(d1 * dx, hi, (d0 * dx) * lo)
// each operation rounded once as written (no contraction: the intrinsics say so). The output is the terms
// added one block after another, from 0 and in block order, then times the tensor scale. Every product
// kernel computes exactly this, whatever it splits among lanes, warps or tensor-core fragments, and
// whatever tokens share its launch: decode, a draft tree and a prefill chunk give a token the same bits.
template <int F>
__device__ __forceinline__ float block_term(float2 s, float2 dx, int lo, int hi) {
    if constexpr (two_scales<F>()) {
        return __fmaf_rn(__fmul_rn(s.y, dx.x), (float)hi, __fmul_rn(__fmul_rn(s.x, dx.x), (float)lo));
    } else {
        return __fmaf_rn(s.y, dx.y, __fmul_rn(__fmul_rn(s.x, dx.x), (float)(lo + hi)));
    }
}

// Stores one output: the product, or (add) the product added to what is there. __fadd_rn is never fused
// into a multiply-add, so the sum is rounded exactly as the unfused add kernel rounds it.
__device__ __forceinline__ void store_out(float* o, float v, int add) {
    *o = add ? __fadd_rn(*o, v) : v;
}
