// Paged attention for decode, prefill chunks and draft trees (flash-decoding): every new token's query heads
// against the KV rows its position sees, over the page pool the CPU backend uses, in the same layout:
// element (page, layer, kv head, slot, d) at (((page * n_layers + layer) * n_kv_heads + head) * page_size
// + slot) * head_dim + d, f32, f16 (bits) or FP8 E4M3 bytes with one scale per (page, layer, kv head).
//
// q: each token's n_heads x head_dim query, token rows `q_stride` floats apart (a fused QKV row's Q part).
//
// Work is split like the CPU's: an item is (token, kv head) with its `group` query heads (GQA), and its
// positions are cut into splits of ATTN_SPLIT (64; smaller than the CPU's, for more blocks at depth) at
// fixed offsets, so a token's result never depends on what it was batched with. The grid may have more
// splits than a token's positions fill (a power of two): those see nothing and the merge skips them. attention_* writes one partial per (item, split): per query head the running
// max m, the sum l of exp(score - m), and the unnormalised output o, laid out [m (group) | l (group) |
// o (group x head_dim)] like the CPU's partials, and the splits are combined (merge_item): by the last of
// an item's blocks to finish, when the launch gives `counters` (one int per item, zero before the launch and
// zero again after it), else by attention_merge in a launch of its own. The merge reads the splits in a fixed
// order, so whichever block runs it, and in whichever launch, the bits are the same. Launch attention_* with
// grid (tokens x kv heads, splits) and 128 threads; attention_merge with grid (tokens x kv heads) and
// head_dim threads.
//
// Token metadata, 4 ints per token: [page table offset, positions seen (its position + 1), first position
// not in place (`direct`: a draft-tree node's ancestors from there on sit at other slots), offset of those
// ancestors' slots in `seen`]. A position p < direct is at slot p; slot_of(p) = seen[off + p - direct]
// otherwise. Positions before `attend_from` are not seen.

#define ATTN_SPLIT 64
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

// Combines an item's splits (as the CPU's merge_partials): per query head, the outputs weighted by
// exp(m_split - max m), over the total of l weighted the same way; splits with nothing seen are skipped.
// out: n_tokens x n_heads x head_dim; the block's threads stride over head_dim.
__device__ void merge_item(const float* partials, float* __restrict__ out, int item, int splits, int n_heads,
                           int n_kv_heads, int head_dim) {
    const int t = item / n_kv_heads;
    const int kvh = item % n_kv_heads;
    const int group = n_heads / n_kv_heads;
    const int stride = group * (head_dim + 2);
    const float* parts = partials + (long)item * splits * stride;
    for (int h = 0; h < group; h++) {
        float mx = NEG_INF;
        for (int p = 0; p < splits; p++) {
            mx = fmaxf(mx, ld_cg(parts + p * stride + h));
        }
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float total = 0.0f;
            float o = 0.0f;
            for (int p = 0; p < splits; p++) {
                const float l = ld_cg(parts + p * stride + group + h);
                if (l == 0.0f) {
                    continue;
                }
                const float w = expf(ld_cg(parts + p * stride + h) - mx);
                total += l * w;
                o += w * ld_cg(parts + p * stride + 2 * group + h * head_dim + d);
            }
            out[((long)t * n_heads + kvh * group + h) * head_dim + d] = total > 0.0f ? o * (1.0f / total) : 0.0f;
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
#pragma unroll
        for (int u = 0; u < 4; u++) {
            out[u] = e4m3_to_f32((w.x >> (8 * u)) & 0xffu);
            out[4 + u] = e4m3_to_f32((w.y >> (8 * u)) & 0xffu);
        }
    }
#endif
}

// acc[h] = sum over positions j in [from, to) of es[h][j] * value j's element d, for each of the group's
// query heads, added in position order; the values of ATTN_ROWS positions are loaded before any is used
// (their loads in flight together).
template <int KV>
__device__ __forceinline__ void weigh_values(const void* __restrict__ vstore, const long* rows, const float* vsc,
                                             const float* es, int group, int d, int from, int to,
                                             float* acc) {
#pragma unroll
    for (int h = 0; h < ATTN_MAX_GROUP; h++) {
        acc[h] = 0.0f;
    }
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
                        acc[h] += es[h * ATTN_SPLIT + j0 + u] * v[u];
                    }
                }
            }
        }
    }
}

template <int KV>
__device__ __forceinline__ void attention(const float* __restrict__ q, const void* __restrict__ kstore,
                                          const void* __restrict__ vstore, const float* __restrict__ kscale,
                                          const float* __restrict__ vscale, const int* __restrict__ table,
                                          const int* __restrict__ meta, const int* __restrict__ seen,
                                          float* __restrict__ partials, int n_heads, int n_kv_heads,
                                          int head_dim, int page_size, int n_layers, int layer,
                                          int attend_from, float scale, int q_stride, float* __restrict__ out,
                                          int* __restrict__ counters) {
    __shared__ float qs[ATTN_MAX_GROUP * ATTN_MAX_HEAD_DIM];
    __shared__ float es[ATTN_MAX_GROUP * ATTN_SPLIT];
    __shared__ long rows[ATTN_SPLIT];
    __shared__ float ksc[ATTN_SPLIT];
    __shared__ float vsc[ATTN_SPLIT];
    const int item = blockIdx.x;
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const int t = item / n_kv_heads;
    const int kvh = item % n_kv_heads;
    const int group = n_heads / n_kv_heads;
    const int hd = head_dim;
    const int* m4 = meta + 4 * t;
    const int npos = m4[1];
    const int direct = m4[2];
    const int start = max(split * ATTN_SPLIT, attend_from);
    const int end = min((split + 1) * ATTN_SPLIT, npos);
    const int len = max(end - start, 0);
    float* part = partials + ((long)item * splits + split) * group * (hd + 2);

    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        qs[i] = q[(long)t * q_stride + (long)kvh * group * hd + i];
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

    // Scores: a thread per position, each query head's dot product summed in order over the dimensions:
    // no shuffles, and a row's loads are its thread's own, 8 elements at a time where head_dim allows (the
    // same sums either way). The query heads are read from shared memory, the same word by every thread.
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
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
            for (int d = 0; d < hd; d++) {
                const float k = kv_load<KV>(kstore, r + d);
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        s[h] += qs[h * hd + d] * (k * ks);
                    }
                }
            }
        }
#pragma unroll
        for (int h = 0; h < ATTN_MAX_GROUP; h++) {
            if (h < group) {
                es[h * ATTN_SPLIT + j] = s[h] * scale;
            }
        }
    }
    __syncthreads();

    // Softmax statistics per query head; the scores become exp(score - m).
    for (int h = 0; h < group; h++) {
        float mx = NEG_INF;
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            mx = fmaxf(mx, es[h * ATTN_SPLIT + j]);
        }
        mx = block_max(mx);
        float l = 0.0f;
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            const float e = expf(es[h * ATTN_SPLIT + j] - mx);
            es[h * ATTN_SPLIT + j] = e;
            l += e;
        }
        l = block_sum(l);
        if (threadIdx.x == 0) {
            part[h] = len > 0 ? mx : NEG_INF;
            part[group + h] = len > 0 ? l : 0.0f;
        }
    }
    __syncthreads();

    // Outputs: threads across the dimensions, each accumulating every query head of the group. Where the
    // head is at most half the block wide, the block's `parts` groups of head_dim threads take one
    // contiguous share of the positions each, and share 0's threads add the others' in order at the end
    // (qs, no longer read, holds them).
    const int parts = hd <= (int)blockDim.x / 2 ? (int)blockDim.x / hd : 1;
    if (parts > 1) {
        const int p = (int)threadIdx.x / hd;
        const int d = (int)threadIdx.x % hd;
        const int share = (len + parts - 1) / parts;
        float acc[ATTN_MAX_GROUP];
        if (p < parts) {
            weigh_values<KV>(vstore, rows, vsc, es, group, d, min(p * share, len), min((p + 1) * share, len),
                             acc);
            if (p > 0) {
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        qs[((p - 1) * group + h) * hd + d] = acc[h];
                    }
                }
            }
        }
        __syncthreads();
        if (p == 0) {
            for (int o = 1; o < parts; o++) {
#pragma unroll
                for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                    if (h < group) {
                        acc[h] += qs[((o - 1) * group + h) * hd + d];
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                if (h < group) {
                    part[2 * group + h * hd + d] = acc[h];
                }
            }
        }
    } else {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float acc[ATTN_MAX_GROUP];
            weigh_values<KV>(vstore, rows, vsc, es, group, d, 0, len, acc);
#pragma unroll
            for (int h = 0; h < ATTN_MAX_GROUP; h++) {
                if (h < group) {
                    part[2 * group + h * hd + d] = acc[h];
                }
            }
        }
    }
    if (counters == nullptr) {
        return;  // attention_merge runs next
    }
    // Every thread's partial is visible before the count says so; the last block then merges.
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&counters[item], 1) == splits - 1;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        merge_item(partials, out, item, splits, n_heads, n_kv_heads, hd);
        if (threadIdx.x == 0) {
            counters[item] = 0;
        }
    }
}

#define ATTENTION_ARGS                                                                                      \
    const float *q, const void *kstore, const void *vstore, const float *kscale, const float *vscale,      \
        const int *table, const int *meta, const int *seen, float *partials, int n_heads, int n_kv_heads, \
        int head_dim, int page_size, int n_layers, int layer, int attend_from, float scale, int q_stride,    \
        float *out, int *counters
#define ATTENTION_CALL                                                                                     \
    q, kstore, vstore, kscale, vscale, table, meta, seen, partials, n_heads, n_kv_heads, head_dim, page_size, \
        n_layers, layer, attend_from, scale, q_stride, out, counters

extern "C" __global__ void attention_f32(ATTENTION_ARGS) { GRID_WAIT(); attention<KV_F32>(ATTENTION_CALL); }
extern "C" __global__ void attention_f16(ATTENTION_ARGS) { GRID_WAIT(); attention<KV_F16>(ATTENTION_CALL); }
extern "C" __global__ void attention_fp8(ATTENTION_ARGS) { GRID_WAIT(); attention<KV_FP8>(ATTENTION_CALL); }

// The merge as a launch of its own (an attention launch without counters): grid (tokens x kv heads),
// head_dim threads.
extern "C" __global__ void attention_merge(const float* __restrict__ partials, float* __restrict__ out,
                                           int splits, int n_heads, int n_kv_heads, int head_dim) {
    GRID_WAIT();
    merge_item(partials, out, blockIdx.x, splits, n_heads, n_kv_heads, head_dim);
}
