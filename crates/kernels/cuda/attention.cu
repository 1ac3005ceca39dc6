// Paged attention for decode, prefill chunks and draft trees (flash-decoding): every new token's query heads
// against the KV rows its position sees, over the page pool the CPU backend uses, in the same layout:
// element (page, layer, kv head, slot, d) at (((page * n_layers + layer) * n_kv_heads + head) * page_size
// + slot) * head_dim + d, f32, f16 (bits) or FP8 E4M3 bytes with one scale per (page, layer, kv head).
//
// q: each token's n_heads x head_dim query, token rows `q_stride` floats apart (a fused QKV row's Q part).
//
// An item is (token, kv head) with its `group` query heads (GQA). A token's positions [attend_from, its
// position] are cut into tiles of ATTN_TILE, and the tiles into at most `cap` splits of equally many
// consecutive tiles (split_plan): from the token's length and `cap` alone (the device's choice, from its SM
// count and the model's KV heads), never from the batch, so a token's result is the same bits in any
// batch and any grid. A split is one block's work: tile by tile with an online softmax (running max m, sum
// l of exp(score - m), unnormalised output o per query head). The splits are then folded in split order,
// (M, L, O) + (m, l, o) -> (max, L a + l b, O a + o b) with a = exp(M - max), b = exp(m - max), and the output
// is O / L. The grid is (tokens x kv heads, G) with 128 threads, and G is 1 or `cap`:
// - G == cap: block y runs split y (blocks past the token's splits return at once, so one grid serves any
//   depth: a decode step's launch, and its graph, never change as the context grows) and writes its
//   partial, laid out [m (group) | l (group) | o (group x head_dim)]; with `counters` (one int per item,
//   zero before the launch and again after it) the last of an item's splits to finish folds them all, else
//   attention_merge does in a launch of its own;
// - G == 1 (large batches: enough items to fill the GPU): the block runs the token's splits in order and
//   folds each as it ends, with the same arithmetic, then writes the output.
//
// A tile's scores and weighted values run on the tensor cores for f16 and FP8 pages whose head_dim is whole
// 16s (the _tc kernels: queries and weights as two f16 each, keys and values f16, f32 sums; see
// tile_scores_tc), else on the scalar units (f32 pages, other widths). Either way a token's work is its
// items' alone, so the bits do not depend on the batch.
//
// Token metadata, 4 ints per token: [page table offset, positions seen (its position + 1), first position
// not in place (`direct`: a draft-tree node's ancestors from there on sit at other slots), offset of those
// ancestors' slots in `seen`]. A position p < direct is at slot p; slot_of(p) = seen[off + p - direct]
// otherwise. Positions before `attend_from` are not seen.

#define ATTN_TILE 64
#define ATTN_THREADS 128
#define ATTN_MAX_GROUP 16
#define ATTN_MAX_HEAD_DIM 256
// Positions whose values a thread loads before it uses them (loads in flight together).
#define ATTN_ROWS 4

#define KV_F32 0
#define KV_F16 1
#define KV_FP8 2

// Element i of a KV store of type KV (FP8 without its scale).
template <int KV>
__device__ __forceinline__ float kv_load(const void* store, long i) {
    if constexpr (KV == KV_F32) {
        return ((const float*)store)[i];
    } else if constexpr (KV == KV_F16) {
        return f16_to_f32(((const unsigned short*)store)[i]);
    } else {
        return e4m3_to_f32(((const unsigned char*)store)[i]);
    }
}

// A load that bypasses the L1 cache: the merging block reads partials other blocks wrote during the launch.
__device__ __forceinline__ float ld_cg(const float* p) {
#ifdef THORN_SIM
    return *p;
#else
    return __ldcg(p);
#endif
}

// How a token's positions [from, npos) are cut: `splits` splits of `span` positions (the last one
// shorter), each a whole number of ATTN_TILE tiles, at most `cap` of them.
struct SplitPlan {
    int from;
    int span;
    int splits;
};

__device__ __forceinline__ SplitPlan split_plan(int npos, int attend_from, int cap) {
    const int n = max(npos - attend_from, 0);
    const int tiles = (n + ATTN_TILE - 1) / ATTN_TILE;
    const int s = min(cap, tiles);
    const int chunk = s > 0 ? (tiles + s - 1) / s : 0;
    return SplitPlan{attend_from, chunk * ATTN_TILE, chunk > 0 ? (tiles + chunk - 1) / chunk : 0};
}

// One step of the fold of splits, (M, L, O) + (m, l, o): the new max, and the weights a of the fold so far
// and b of the split. Rounded as written wherever it is inlined (no contraction into fused multiply-adds),
// so that the two places that fold give the same bits.
__device__ __forceinline__ float fold_max(float M, float m, float* a, float* b) {
    const float mx = fmaxf(M, m);
    *a = expf(M - mx);
    *b = expf(m - mx);
    return mx;
}

__device__ __forceinline__ float fold_add(float X, float x, float a, float b) {
    return __fadd_rn(__fmul_rn(X, a), __fmul_rn(x, b));
}

// Folds an item's `splits` partials in split order and writes its output: out is n_tokens x n_heads x
// head_dim; the block's threads stride over head_dim.
__device__ void merge_item(const float* partials, float* __restrict__ out, int item, int slots, int splits,
                           int n_heads, int n_kv_heads, int head_dim) {
    const int t = item / n_kv_heads;
    const int kvh = item % n_kv_heads;
    const int group = n_heads / n_kv_heads;
    const int stride = group * (head_dim + 2);
    const float* parts = partials + (long)item * slots * stride;
    for (int h = 0; h < group; h++) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float M = NEG_INF;
            float L = 0.0f;
            float O = 0.0f;
            for (int p = 0; p < splits; p++) {
                const float* part = parts + p * stride;
                float a;
                float b;
                M = fold_max(M, ld_cg(part + h), &a, &b);
                L = fold_add(L, ld_cg(part + group + h), a, b);
                O = fold_add(O, ld_cg(part + 2 * group + h * head_dim + d), a, b);
            }
            out[((long)t * n_heads + kvh * group + h) * head_dim + d] = L > 0.0f ? O * (1.0f / L) : 0.0f;
        }
    }
}

// Elements i .. i + 7 of a KV store (i a multiple of 8: a row starts at a multiple of head_dim, and
// head_dim is one here), with one 16-byte load (8 for FP8) on the GPU; the stores are allocations, so
// aligned to that.
template <int KV>
__device__ __forceinline__ void kv_load8(const void* store, long i, float* out) {
#ifdef THORN_SIM
    for (int u = 0; u < 8; u++) {
        out[u] = kv_load<KV>(store, i + u);
    }
#else
    if constexpr (KV == KV_F32) {
        const float4 a = ((const float4*)store)[i / 4];
        const float4 b = ((const float4*)store)[i / 4 + 1];
        out[0] = a.x;
        out[1] = a.y;
        out[2] = a.z;
        out[3] = a.w;
        out[4] = b.x;
        out[5] = b.y;
        out[6] = b.z;
        out[7] = b.w;
    } else if constexpr (KV == KV_F16) {
        const uint4 w = ((const uint4*)store)[i / 8];
        const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int u = 0; u < 4; u++) {
            out[2 * u] = f16_to_f32((unsigned short)(words[u] & 0xffffu));
            out[2 * u + 1] = f16_to_f32((unsigned short)(words[u] >> 16));
        }
    } else {
        const uint2 w = ((const uint2*)store)[i / 8];
#if __CUDA_ARCH__ >= 890
        // The hardware's conversion, two bytes to two f16 an instruction: exact, as e4m3_to_f32 (which
        // decodes the never-stored NaN codes as 480; the hardware, as NaN).
        const unsigned words[2] = {w.x, w.y};
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const unsigned short pair = (unsigned short)(words[u / 2] >> (16 * (u % 2)));
            unsigned h2;
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
            out[2 * u] = f16_to_f32((unsigned short)(h2 & 0xffffu));
            out[2 * u + 1] = f16_to_f32((unsigned short)(h2 >> 16));
        }
#else
#pragma unroll
        for (int u = 0; u < 4; u++) {
            out[u] = e4m3_to_f32((w.x >> (8 * u)) & 0xffu);
            out[4 + u] = e4m3_to_f32((w.y >> (8 * u)) & 0xffu);
        }
#endif
    }
#endif
}

// Elements i and i + 1 of a KV store (i even) as two f16 in one register, times `scale` (FP8's page scale,
// a power of two: exact while the value is within f16's range, as an f16 cache's values are).
template <int KV>
__device__ __forceinline__ unsigned kv_pair(const void* store, long i, float scale) {
    if constexpr (KV == KV_F16) {
        return *(const unsigned*)((const unsigned short*)store + i);
    } else {
        const unsigned short b = *(const unsigned short*)((const unsigned char*)store + i);
        return f16_pair(f32_to_f16(e4m3_to_f32(b & 0xffu) * scale), f32_to_f16(e4m3_to_f32(b >> 8) * scale));
    }
}

// Element i of a KV store as f16 bits, times `scale` as kv_pair.
template <int KV>
__device__ __forceinline__ unsigned short kv_half(const void* store, long i, float scale) {
    if constexpr (KV == KV_F16) {
        return ((const unsigned short*)store)[i];
    } else {
        return f32_to_f16(e4m3_to_f32(((const unsigned char*)store)[i]) * scale);
    }
}

// The tensor-core form of a tile's scores (f16 and FP8 pages, head_dim a multiple of 16): es[h][j] =
// scale * (q_h . k_j) for the group's heads h and the tile's positions j < len. The queries (rows of 16, those
// past the group zero) are held as two f16 each (qh + ql: about 21 bits), the keys are f16, so each product is
// two f16 tensor-core products per 16 dimensions, summed in f32. Warp w of W takes the tile's positions in
// tiles of 8, w, w + W, ...; its lanes load their keys' pairs straight from the pages.
template <int KV>
__device__ __forceinline__ void tile_scores_tc(const void* __restrict__ kstore, const long* rows, const float* ksc,
                                               const unsigned short* qh, const unsigned short* ql, float* es,
                                               int group, int hd, int len, float scale) {
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    for (int n = warp; n < ATTN_TILE / 8; n += warps) {
        const int j0 = 8 * n;
        if (j0 >= len) {
            break;  // the same for the whole warp
        }
        // This lane's key (B's column g) and its scale.
        const int j = j0 + g;
        const bool valid = j < len;
        const long r = valid ? rows[j] : 0;
        const float ks = KV == KV_FP8 && valid ? ksc[j] : 1.0f;
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k0 = 0; k0 < hd; k0 += 16) {
            const unsigned b[2] = {valid ? kv_pair<KV>(kstore, r + k0 + 2 * t, ks) : 0u,
                                   valid ? kv_pair<KV>(kstore, r + k0 + 2 * t + 8, ks) : 0u};
            const int i0 = g * hd + k0 + 2 * t;
            const int i1 = (g + 8) * hd + k0 + 2 * t;
            const unsigned ahi[4] = {*(const unsigned*)(qh + i0), *(const unsigned*)(qh + i1),
                                     *(const unsigned*)(qh + i0 + 8), *(const unsigned*)(qh + i1 + 8)};
            const unsigned alo[4] = {*(const unsigned*)(ql + i0), *(const unsigned*)(ql + i1),
                                     *(const unsigned*)(ql + i0 + 8), *(const unsigned*)(ql + i1 + 8)};
            mma_f16(ahi, b, c);
            mma_f16(alo, b, c);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int h = (i >> 1) ? g + 8 : g;
            const int jj = j0 + 2 * t + (i & 1);
            if (h < group && jj < len) {
                es[h * ATTN_TILE + jj] = c[i] * scale;
            }
        }
    }
}

// Output tiles of 8 dimensions a warp holds in the tensor-core form (w, w + W, ... of a block of W >= 4
// warps): at most 256 / 32.
#define ATTN_TC_TILES (ATTN_MAX_HEAD_DIM / 32)

// The tensor-core form of a tile's weighted values: o[u] (this lane's share of the outputs' 16 x 8 tile
// warp + W u: heads g and g + 8 by dimensions 2t, 2t + 1) += sum over the tile's positions j < len of
// es[h][j] * v_j, with the weights as two f16 each (about 21 bits) and the values f16, 16 positions a step.
template <int KV>
__device__ __forceinline__ void tile_values_tc(const void* __restrict__ vstore, const long* rows, const float* vsc,
                                               const float* es, int group, int hd, int len,
                                               float (*o)[4]) {
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int tiles = hd >> 3;
    for (int k0 = 0; k0 < len; k0 += 16) {
        // A: the weights of heads g and g + 8 at positions k0 + 2t, + 1 (a0, a1) and k0 + 2t + 8, + 9 (a2, a3).
        unsigned ahi[4];
        unsigned alo[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int h = (q & 1) ? g + 8 : g;
            const int j = k0 + 2 * t + 8 * (q >> 1);
            const float w0 = h < group && j < len ? es[h * ATTN_TILE + j] : 0.0f;
            const float w1 = h < group && j + 1 < len ? es[h * ATTN_TILE + j + 1] : 0.0f;
            const F16Split s0 = f16_split(w0);
            const F16Split s1 = f16_split(w1);
            ahi[q] = f16_pair(s0.hi, s1.hi);
            alo[q] = f16_pair(s0.lo, s1.lo);
        }
        // B: value rows k0 + 2t, + 1 and k0 + 2t + 8, + 9 at dimension 8 tile + g.
        const int j = k0 + 2 * t;
        long vr[4];
        float vs[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int jq = j + (q & 1) + 8 * (q >> 1);
            vr[q] = jq < len ? rows[jq] : -1;
            vs[q] = KV == KV_FP8 && jq < len ? vsc[jq] : 1.0f;
        }
#pragma unroll
        for (int u = 0; u < ATTN_TC_TILES; u++) {
            const int tile = warp + warps * u;
            if (tile < tiles) {
                const int d = 8 * tile + g;
                unsigned short v[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    v[q] = vr[q] >= 0 ? kv_half<KV>(vstore, vr[q] + d, vs[q]) : (unsigned short)0;
                }
                const unsigned b[2] = {f16_pair(v[0], v[1]), f16_pair(v[2], v[3])};
                mma_f16(ahi, b, o[u]);
                mma_f16(alo, b, o[u]);
            }
        }
    }
}

// acc[h] += es[h][j] * value j's element d over positions j in [from, to), for each of the group's query
// heads, added in position order; the values of ATTN_ROWS positions are loaded before any is used (their
// loads in flight together).
template <int KV>
__device__ __forceinline__ void weigh_values(const void* __restrict__ vstore, const long* rows, const float* vsc,
                                             const float* es, int group, int d, int from, int to,
                                             float* acc) {
    for (int j0 = from; j0 < to; j0 += ATTN_ROWS) {
        float v[ATTN_ROWS];
#pragma unroll
        for (int u = 0; u < ATTN_ROWS; u++) {
            const int j = j0 + u;
            v[u] = j < to ? kv_load<KV>(vstore, rows[j] + d) * (KV == KV_FP8 ? vsc[j] : 1.0f) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < ATTN_ROWS; u++) {
            if (j0 + u < to) {
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        acc[h] += es[h * ATTN_TILE + j0 + u] * v[u];
                    }
                }
            }
        }
    }
}

// TC: the tile's scores and weighted values on the tensor cores (tile_scores_tc, tile_values_tc), each
// lane holding its share of the outputs as mma fragments; else a thread per position for the scores and a
// thread per dimension for the values (f32 pages, and head dims that are not whole 16s).
template <int KV, bool TC>
__device__ __forceinline__ void attention_impl(const float* __restrict__ q, const void* __restrict__ kstore,
                                          const void* __restrict__ vstore, const float* __restrict__ kscale,
                                          const float* __restrict__ vscale, const int* __restrict__ table,
                                          const int* __restrict__ meta, const int* __restrict__ seen,
                                          float* __restrict__ partials, int n_heads, int n_kv_heads,
                                          int head_dim, int page_size, int n_layers, int layer,
                                          int attend_from, float scale, int q_stride, float* __restrict__ out,
                                          int* __restrict__ counters, int cap) {
    // The group's queries: floats, or (TC) each as two f16 (rows past the group zero).
    __shared__ union {
        float f[ATTN_MAX_GROUP * ATTN_MAX_HEAD_DIM];
        struct {
            unsigned short hi[ATTN_MAX_GROUP * ATTN_MAX_HEAD_DIM];
            unsigned short lo[ATTN_MAX_GROUP * ATTN_MAX_HEAD_DIM];
        } h;
    } qsh;
    float* qs = qsh.f;
    __shared__ float es[ATTN_MAX_GROUP * ATTN_TILE];
    __shared__ long rows[ATTN_TILE];
    __shared__ float ksc[ATTN_TILE];
    __shared__ float vsc[ATTN_TILE];
    // The value shares of the block's parts other than the first, added by the first at a split's end.
    __shared__ float xs[ATTN_THREADS * ATTN_MAX_GROUP];
    // Per query head: the split's running max and sum and the rescale of its last tile; the fold's max
    // and sum (G == 1). The same for every thread: written by thread 0 between barriers.
    __shared__ float sm[ATTN_MAX_GROUP];
    __shared__ float sl[ATTN_MAX_GROUP];
    __shared__ float salpha[ATTN_MAX_GROUP];
    __shared__ float sM[ATTN_MAX_GROUP];
    __shared__ float sL[ATTN_MAX_GROUP];
    const int item = blockIdx.x;
    const int y = blockIdx.y;
    const int grid = gridDim.y;
    const int t = item / n_kv_heads;
    const int kvh = item % n_kv_heads;
    const int group = n_heads / n_kv_heads;
    const int hd = head_dim;
    const int* m4 = meta + 4 * t;
    const int npos = m4[1];
    const int direct = m4[2];
    const SplitPlan plan = split_plan(npos, attend_from, cap);
    float* o_item = out + ((long)t * n_heads + kvh * group) * hd;
    if (plan.splits == 0) {
        // Nothing seen: zeros (from the first block).
        for (int i = threadIdx.x; y == 0 && i < group * hd; i += blockDim.x) {
            o_item[i] = 0.0f;
        }
        return;
    }
    if (y >= plan.splits) {
        return;
    }
    if constexpr (TC) {
        for (int i = threadIdx.x; i < ATTN_MAX_GROUP * hd; i += blockDim.x) {
            const F16Split v = f16_split(i < group * hd ? q[(long)t * q_stride + (long)kvh * group * hd + i] : 0.0f);
            qsh.h.hi[i] = v.hi;
            qsh.h.lo[i] = v.lo;
        }
    } else {
        for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
            qs[i] = q[(long)t * q_stride + (long)kvh * group * hd + i];
        }
    }
    if (threadIdx.x < ATTN_MAX_GROUP) {
        sM[threadIdx.x] = NEG_INF;
        sL[threadIdx.x] = 0.0f;
    }

    // Outputs: a thread per dimension d (the block is at least head_dim wide), accumulating every query
    // head of the group. Where the head is at most half the block wide, the block's `parts` groups of
    // head_dim threads take one contiguous share of each tile's positions, added into the first part's
    // at a split's end (xs); `mine`: whether this thread holds a dimension's whole output.
    const int parts = !TC && hd <= (int)blockDim.x / 2 ? (int)blockDim.x / hd : 1;
    const int part = (int)threadIdx.x / hd;
    const int d = (int)threadIdx.x % hd;
    const bool mine = !TC && part == 0;
    // TC: this lane's share of the outputs, tile warp + W u of 8 dimensions (W warps): (head, dimension)
    // of element i of tile u is (g + 8 (i / 2), 8 (warp + W u) + 2t + i % 2) (tc_owns says which are real).
    const int warp = threadIdx.x >> 5;
    const int warps = (int)blockDim.x >> 5;
    const int tg = (threadIdx.x & 31) >> 2;
    const int tt = threadIdx.x & 3;
    float o[TC ? ATTN_TC_TILES : 1][4];
    auto tc_head = [&](int i) { return tg + 8 * (i >> 1); };
    auto tc_dim = [&](int u, int i) { return 8 * (warp + warps * u) + 2 * tt + (i & 1); };
    auto tc_owns = [&](int u, int i) { return TC && tc_head(i) < group && warp + warps * u < (hd >> 3); };
    for (int split = y; split < plan.splits; split += grid) {
        const int p0 = plan.from + split * plan.span;
        const int p1 = min(p0 + plan.span, npos);
        float acc[ATTN_MAX_GROUP];
#pragma unroll
        for (int h = 0; h < ATTN_MAX_GROUP; h++) {
            acc[h] = 0.0f;
        }
#pragma unroll
        for (int u = 0; u < (TC ? ATTN_TC_TILES : 1); u++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                o[u][i] = 0.0f;
            }
        }
        for (int start = p0; start < p1; start += ATTN_TILE) {
            const int len = min(ATTN_TILE, p1 - start);
            // The tile before is done with rows, es and the softmax state (and the queries and the fold's
            // state are in place, the first time).
            __syncthreads();
            if (start == p0 && threadIdx.x < ATTN_MAX_GROUP) {
                sm[threadIdx.x] = NEG_INF;
                sl[threadIdx.x] = 0.0f;
            }
            // Where each position's row starts (the same offset in the key and the value store).
            for (int j = threadIdx.x; j < len; j += blockDim.x) {
                const int p = start + j;
                const int slot = p < direct ? p : seen[m4[3] + p - direct];
                const long page = table[m4[0] + slot / page_size];
                const long head = (page * n_layers + layer) * n_kv_heads + kvh;
                rows[j] = (head * page_size + slot % page_size) * hd;
                if constexpr (KV == KV_FP8) {
                    ksc[j] = kscale[head];
                    vsc[j] = vscale[head];
                }
            }
            __syncthreads();

            // Scores: on the tensor cores, or a thread per position, each query head's dot product summed in
            // order over the dimensions: no shuffles, and a row's loads are its thread's own, 8 elements at a
            // time where head_dim allows (the same sums either way). The query heads are read from shared
            // memory, the same word by every thread.
            if constexpr (TC) {
                tile_scores_tc<KV>(kstore, rows, ksc, qsh.h.hi, qsh.h.lo, es, group, hd, len, scale);
            }
            for (int j = threadIdx.x; !TC && j < len; j += blockDim.x) {
                const long r = rows[j];
                const float ks = KV == KV_FP8 ? ksc[j] : 1.0f;
                float s[ATTN_MAX_GROUP];
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    s[h] = 0.0f;
                }
                if ((hd & 7) == 0) {
                    for (int d0 = 0; d0 < hd; d0 += 8) {
                        float k[8];
                        kv_load8<KV>(kstore, r + d0, k);
#pragma unroll
                        for (int u = 0; u < 8; u++) {
#pragma unroll
                            for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                                if (h < group) {
                                    s[h] += qs[h * hd + d0 + u] * (k[u] * ks);
                                }
                            }
                        }
                    }
                } else {
                    for (int e = 0; e < hd; e++) {
                        const float k = kv_load<KV>(kstore, r + e);
#pragma unroll
                        for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                            if (h < group) {
                                s[h] += qs[h * hd + e] * (k * ks);
                            }
                        }
                    }
                }
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        es[h * ATTN_TILE + j] = s[h] * scale;
                    }
                }
            }
            __syncthreads();

            // The online softmax: each head's running max takes the tile's, the running sum and the
            // outputs so far are rescaled to it, and the scores become exp(score - m).
            for (int h = 0; h < group; h++) {
                float mx = NEG_INF;
                for (int j = threadIdx.x; j < len; j += blockDim.x) {
                    mx = fmaxf(mx, es[h * ATTN_TILE + j]);
                }
                const float m = sm[h];
                mx = fmaxf(m, block_max(mx));
                float e_sum = 0.0f;
                for (int j = threadIdx.x; j < len; j += blockDim.x) {
                    const float e = expf(es[h * ATTN_TILE + j] - mx);
                    es[h * ATTN_TILE + j] = e;
                    e_sum += e;
                }
                e_sum = block_sum(e_sum);
                if (threadIdx.x == 0) {
                    const float alpha = expf(m - mx);
                    salpha[h] = alpha;
                    sl[h] = sl[h] * alpha + e_sum;
                    sm[h] = mx;
                }
            }
            __syncthreads();

            if constexpr (TC) {
                // The outputs so far rescaled to the new max, then the tile's weighted values added.
#pragma unroll
                for (int u = 0; u < ATTN_TC_TILES; u++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        if (tc_head(i) < group) {
                            o[u][i] *= salpha[tc_head(i)];
                        }
                    }
                }
                tile_values_tc<KV>(vstore, rows, vsc, es, group, hd, len, o);
            } else if (part < parts && d < hd) {
                const int share = parts > 1 ? (len + parts - 1) / parts : len;
                // The outputs so far rescaled to the new max, then the tile's weighted values added.
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        acc[h] *= salpha[h];
                    }
                }
                weigh_values<KV>(vstore, rows, vsc, es, group, d, min(part * share, len),
                                 min((part + 1) * share, len), acc);
            }
        }

        // The split's outputs whole: the parts' shares added into the first part's, in part order.
        if (parts > 1) {
            if (part > 0 && part < parts) {
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        xs[((part - 1) * group + h) * hd + d] = acc[h];
                    }
                }
            }
            __syncthreads();
            if (mine) {
                for (int o = 1; o < parts; o++) {
#pragma unroll
                    for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                        if (h < group) {
                            acc[h] += xs[((o - 1) * group + h) * hd + d];
                        }
                    }
                }
            }
        }
        if (grid > 1) {
            // One split per block: its partial.
            float* pp = partials + ((long)item * grid + split) * group * (hd + 2);
            if (threadIdx.x == 0) {
                for (int h = 0; h < group; h++) {
                    pp[h] = sm[h];
                    pp[group + h] = sl[h];
                }
            }
            if (mine) {
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        pp[2 * group + h * hd + d] = acc[h];
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < (TC ? ATTN_TC_TILES : 1); u++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    if (tc_owns(u, i)) {
                        pp[2 * group + tc_head(i) * hd + tc_dim(u, i)] = o[u][i];
                    }
                }
            }
            continue;
        }
        // G == 1: the split into the fold, whose outputs O wait in `out` (each its owner thread's). Every
        // thread reads the fold's state before thread 0 moves it.
#pragma unroll
        for (int h = 0; h < ATTN_MAX_GROUP; h++) {
            if (h < group && mine) {
                float a;
                float b;
                fold_max(sM[h], sm[h], &a, &b);
                float* oo = o_item + h * hd + d;
                *oo = fold_add(split == y ? 0.0f : *oo, acc[h], a, b);
            }
        }
#pragma unroll
        for (int u = 0; u < (TC ? ATTN_TC_TILES : 1); u++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (tc_owns(u, i)) {
                    const int h = tc_head(i);
                    float a;
                    float b;
                    fold_max(sM[h], sm[h], &a, &b);
                    float* oo = o_item + h * hd + tc_dim(u, i);
                    *oo = fold_add(split == y ? 0.0f : *oo, o[u][i], a, b);
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int h = 0; h < group; h++) {
                float a;
                float b;
                const float mx = fold_max(sM[h], sm[h], &a, &b);
                sL[h] = fold_add(sL[h], sl[h], a, b);
                sM[h] = mx;
            }
        }
    }
    if (grid == 1) {
        __syncthreads();
        if (mine) {
#pragma unroll
            for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                if (h < group) {
                    const float L = sL[h];
                    float* oo = o_item + h * hd + d;
                    *oo = L > 0.0f ? *oo * (1.0f / L) : 0.0f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < (TC ? ATTN_TC_TILES : 1); u++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (tc_owns(u, i)) {
                    const float L = sL[tc_head(i)];
                    float* oo = o_item + tc_head(i) * hd + tc_dim(u, i);
                    *oo = L > 0.0f ? *oo * (1.0f / L) : 0.0f;
                }
            }
        }
        return;
    }
    if (counters == nullptr) {
        return;  // attention_merge runs next
    }
    // Every thread's partial is visible before the count says so; the last block then folds.
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&counters[item], 1) == plan.splits - 1;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        merge_item(partials, out, item, grid, plan.splits, n_heads, n_kv_heads, hd);
        if (threadIdx.x == 0) {
            counters[item] = 0;
        }
    }
}

#define ATTENTION_ARGS                                                                                      \
    const float *q, const void *kstore, const void *vstore, const float *kscale, const float *vscale,      \
        const int *table, const int *meta, const int *seen, float *partials, int n_heads, int n_kv_heads, \
        int head_dim, int page_size, int n_layers, int layer, int attend_from, float scale, int q_stride,    \
        float *out, int *counters, int cap
#define ATTENTION_CALL                                                                                     \
    q, kstore, vstore, kscale, vscale, table, meta, seen, partials, n_heads, n_kv_heads, head_dim, page_size, \
        n_layers, layer, attend_from, scale, q_stride, out, counters, cap

// The _tc kernels: f16 and FP8 pages on the tensor cores, for head dims of whole 16s (the launcher picks them
// there; any block of whole warps).
extern "C" __global__ void attention_f32(ATTENTION_ARGS) { GRID_WAIT(); attention_impl<KV_F32, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_f16(ATTENTION_ARGS) { GRID_WAIT(); attention_impl<KV_F16, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_fp8(ATTENTION_ARGS) { GRID_WAIT(); attention_impl<KV_FP8, false>(ATTENTION_CALL); }
extern "C" __global__ void attention_f16_tc(ATTENTION_ARGS) {
    GRID_WAIT();
    attention_impl<KV_F16, true>(ATTENTION_CALL);
}
extern "C" __global__ void attention_fp8_tc(ATTENTION_ARGS) {
    GRID_WAIT();
    attention_impl<KV_FP8, true>(ATTENTION_CALL);
}

// The fold as a launch of its own (an attention launch of G > 1 without counters): grid (tokens x kv heads),
// head_dim threads; `slots` is the attention launch's G.
extern "C" __global__ void attention_merge(const float* __restrict__ partials, float* __restrict__ out,
                                           const int* __restrict__ meta, int slots, int n_heads, int n_kv_heads,
                                           int head_dim, int attend_from, int cap) {
    GRID_WAIT();
    const SplitPlan plan = split_plan(meta[4 * (blockIdx.x / n_kv_heads) + 1], attend_from, cap);
    if (plan.splits > 0) {
        merge_item(partials, out, blockIdx.x, slots, plan.splits, n_heads, n_kv_heads, head_dim);
    }
}
