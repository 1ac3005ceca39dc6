// Rotary position embedding, in place, from a table of (cos, sin) pairs the host computes once per model
// (the CPU backend's rope_angles: f64 angles rounded to f32), so the GPU rotates by exactly the CPU's numbers.
//
// x: n_tokens rows, `stride` floats apart, each starting with `heads` heads of `head_dim` floats (a fused
// QKV row rotates its Q and K heads in one launch); pos: each token's position (device memory, so a
// captured graph replays with new positions); table: (cos, sin) of pair i at position p at
// [p * n_angles + i]. Normal RoPE (llama.cpp's) rotates adjacent pairs (2i, 2i + 1); NeoX rotates
// (i, i + n_angles) and leaves dimensions from 2 * n_angles on alone (partial rotary). One thread per pair,
// grid-stride; 256 threads a block.

extern "C" __global__ void rope_f32(float* __restrict__ x, const int* __restrict__ pos,
                                    const float2* __restrict__ table, int n_tokens, int heads, int head_dim,
                                    int n_angles, int neox, int stride) {
    GRID_WAIT();
    const long pairs = (long)n_tokens * heads * n_angles;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < pairs; i += (long)gridDim.x * blockDim.x) {
        const int a = (int)(i % n_angles);
        const long th = i / n_angles;  // token * heads + head
        const int t = (int)(th / heads);
        const float2 cs = table[(long)pos[t] * n_angles + a];
        float* h = x + (long)t * stride + (th % heads) * head_dim;
        const int i0 = neox ? a : 2 * a;
        const int i1 = neox ? a + n_angles : 2 * a + 1;
        const float v0 = h[i0];
        const float v1 = h[i1];
        if (neox) {
            h[i0] = v0 * cs.x - v1 * cs.y;
            h[i1] = v1 * cs.x + v0 * cs.y;
        } else {
            h[i0] = v0 * cs.x - v1 * cs.y;
            h[i1] = v0 * cs.y + v1 * cs.x;
        }
    }
}

// RoPE of a fused QKV row fused with the KV write (f32 and f16 pages; FP8 pages rescale in token order and
// take rope_f32 then kv_write_fp8): Q heads are rotated in place; K heads are rotated and written, with V,
// into their page slots (the layout of attention.cu). rows: n_tokens rows `stride` floats apart holding
// [Q (n_heads x head_dim) | K (n_kv_heads x head_dim) | V (n_kv_heads x head_dim)]; dst: per token
// [page, slot]. Normal RoPE only (adjacent pairs; the fused rows are llama's). One thread per pair of Q or K
// and per pair of V values, grid-stride, 256 threads a block. The rotated K stays in the row as well.
template <bool HALF>
__device__ __forceinline__ void rope_kv(float* __restrict__ rows, const int* __restrict__ pos,
                                        const float2* __restrict__ table, void* __restrict__ kstore,
                                        void* __restrict__ vstore, const int* __restrict__ dst, int n_tokens,
                                        int n_heads, int n_kv_heads, int head_dim, int n_angles, int stride,
                                        int page_size, int n_layers, int layer) {
    const int half = head_dim / 2;
    const int per_token = (n_heads + 2 * n_kv_heads) * half;  // pairs of Q, K and V
    const long total = (long)n_tokens * per_token;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int t = (int)(i / per_token);
        const int p = (int)(i % per_token);
        const int head = p / half;  // 0..n_heads + 2 n_kv_heads
        const int a = p % half;
        float* h = rows + (long)t * stride + (long)head * head_dim;
        float v0 = h[2 * a];
        float v1 = h[2 * a + 1];
        if (head < n_heads + n_kv_heads && a < n_angles) {
            const float2 cs = table[(long)pos[t] * n_angles + a];
            const float r0 = v0 * cs.x - v1 * cs.y;
            const float r1 = v0 * cs.y + v1 * cs.x;
            h[2 * a] = r0;
            h[2 * a + 1] = r1;
            v0 = r0;
            v1 = r1;
        }
        if (head < n_heads) {
            continue;
        }
        const bool is_v = head >= n_heads + n_kv_heads;
        const int kvh = head - n_heads - (is_v ? n_kv_heads : 0);
        const long o = ((((long)dst[2 * t] * n_layers + layer) * n_kv_heads + kvh) * page_size + dst[2 * t + 1]) *
                           head_dim +
                       2 * a;
        void* store = is_v ? vstore : kstore;
        if (HALF) {
            ((unsigned short*)store)[o] = f32_to_f16(v0);
            ((unsigned short*)store)[o + 1] = f32_to_f16(v1);
        } else {
            ((float*)store)[o] = v0;
            ((float*)store)[o + 1] = v1;
        }
    }
}

#define ROPE_KV_ARGS                                                                                          \
    float *rows, const int *pos, const float2 *table, void *kstore, void *vstore, const int *dst, int n_tokens, \
        int n_heads, int n_kv_heads, int head_dim, int n_angles, int stride, int page_size, int n_layers, int layer
#define ROPE_KV_CALL                                                                                        \
    rows, pos, table, kstore, vstore, dst, n_tokens, n_heads, n_kv_heads, head_dim, n_angles, stride, page_size, \
        n_layers, layer

extern "C" __global__ void rope_kv_write_f32(ROPE_KV_ARGS) { GRID_WAIT(); rope_kv<false>(ROPE_KV_CALL); }
extern "C" __global__ void rope_kv_write_f16(ROPE_KV_ARGS) { GRID_WAIT(); rope_kv<true>(ROPE_KV_CALL); }
