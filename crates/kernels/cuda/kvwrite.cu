// Writing a layer's new KV rows into their pages (the layout of attention.cu), converted to the cache's type
// exactly as the CPU's page pool converts them: f32 as is, f16 rounded to nearest even, FP8 E4M3 with the
// page's power-of-two scale per (page, layer, kv head).
//
// k, v: each token's n_kv_heads x head_dim floats, token rows `src_stride` floats apart (the K and V parts
// of fused QKV rows); dst: per token, its [page, slot].

// Element offset of (page, layer, head, slot).
__device__ __forceinline__ long kv_row(int page, int layer, int head, int slot, int n_layers, int n_kv_heads,
                                       int page_size, int head_dim) {
    return ((((long)page * n_layers + layer) * n_kv_heads + head) * page_size + slot) * head_dim;
}

// f32 and f16 pages: one thread per element, grid-stride, 256 threads a block.
template <bool HALF>
__device__ __forceinline__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                         void* __restrict__ kstore, void* __restrict__ vstore,
                                         const int* __restrict__ dst, int n_tokens, int n_kv_heads, int head_dim,
                                         int page_size, int n_layers, int layer, int src_stride) {
    const long n = (long)n_tokens * n_kv_heads * head_dim;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const int d = (int)(i % head_dim);
        const long th = i / head_dim;
        const int h = (int)(th % n_kv_heads);
        const int t = (int)(th / n_kv_heads);
        const long o = kv_row(dst[2 * t], layer, h, dst[2 * t + 1], n_layers, n_kv_heads, page_size, head_dim) + d;
        const long src = (long)t * src_stride + (long)h * head_dim + d;
        if (HALF) {
            ((unsigned short*)kstore)[o] = f32_to_f16(k[src]);
            ((unsigned short*)vstore)[o] = f32_to_f16(v[src]);
        } else {
            ((float*)kstore)[o] = k[src];
            ((float*)vstore)[o] = v[src];
        }
    }
}

extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* kstore, float* vstore,
                                        const int* dst, int n_tokens, int n_kv_heads, int head_dim, int page_size,
                                        int n_layers, int layer, int src_stride) {
    GRID_WAIT();
    kv_write<false>(k, v, kstore, vstore, dst, n_tokens, n_kv_heads, head_dim, page_size, n_layers, layer,
                    src_stride);
}
extern "C" __global__ void kv_write_f16(const float* k, const float* v, unsigned short* kstore,
                                        unsigned short* vstore, const int* dst, int n_tokens, int n_kv_heads,
                                        int head_dim, int page_size, int n_layers, int layer, int src_stride) {
    GRID_WAIT();
    kv_write<true>(k, v, kstore, vstore, dst, n_tokens, n_kv_heads, head_dim, page_size, n_layers, layer,
                   src_stride);
}

// Float to E4M3, as the CPU's f32_to_fp8_e4m3: round to nearest even, saturating to +-448, NaN to 0x7F.
// On sm_89 and later the hardware's conversion does it (cvt.rn.satfinite: nearest even, infinities and
// anything past 448 to +-448, the sign of zeros and of values that round to zero kept), NaN still set
// apart here since its code is not pinned there; the simulator and older GPUs take the integer form below.
__device__ __forceinline__ unsigned f32_to_e4m3(float x) {
#if !defined(THORN_SIM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (x != x) {
        return 0x7f;
    }
    unsigned short pair;
    // The second source goes to the low byte.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
    return pair & 0xffu;
#else
    const unsigned bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return 0x7f;
    }
    const unsigned sign = (bits >> 24) & 0x80u;
    const float a = fabsf(x);
    if (a >= 448.0f) {
        return sign | 0x7e;
    }
    if (a < 1.0f / 64.0f) {
        // Subnormal: q * 2^-9 (q == 8 is the smallest normal, whose code is also 8).
        return sign | (unsigned)__float2int_rn(a * 512.0f);
    }
    const unsigned ab = __float_as_uint(a);
    int e = (int)((ab >> 23) & 0xff) - 127 + 7;
    unsigned keep = (ab & 0x7fffffu) >> 20;
    const unsigned rem = ab & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) {
        keep++;
        if (keep == 8) {
            keep = 0;
            e++;
        }
    }
    if (e > 15 || (e == 15 && keep == 7)) {
        return sign | 0x7e;
    }
    return sign | ((unsigned)e << 3) | keep;
#endif
}

// The smallest power of two s with amax / s <= 448 (0 for 0 or non-finite), as the CPU's e4m3_scale.
__device__ __forceinline__ float e4m3_scale(float amax) {
    if (!(amax > 0.0f) || amax > 3.4028235e38f) {
        return 0.0f;
    }
    const float x = amax / 448.0f;
    const unsigned xb = __float_as_uint(x);
    float s;
    if ((xb >> 23) == 0) {
        // Below the smallest normal float: the next power of two up, by doubling.
        s = 1.17549435e-38f;
        while (s * 0.5f >= x && s * 0.5f > 0.0f) {
            s *= 0.5f;
        }
    } else {
        s = (xb & 0x7fffffu) == 0 ? x : __uint_as_float(((xb >> 23) + 1) << 23);
    }
    return amax / s > 448.0f ? s * 2.0f : s;
}

// FP8 pages. A row whose largest magnitude does not fit its page's scale raises the scale and re-encodes
// the page's rows already written, so rows sharing a (page, layer, head) are written in token order: one
// block per (kv head, sequence) walks the sequence's tokens. seqs: per sequence [first token, tokens].
// 128 threads a block.
__device__ __forceinline__ void fp8_row(const float* __restrict__ src, unsigned char* __restrict__ store,
                                        float* __restrict__ scales, long head, long row, int page_size,
                                        int head_dim) {
    float amax = 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        amax = fmaxf(amax, fabsf(src[d]));
    }
    amax = block_max(amax);
    const float old = scales[head];
    const float need = e4m3_scale(amax);
    float scale = old;
    if (need > old) {
        if (old > 0.0f) {
            // Shift the page's rows to the larger scale (exact for normal numbers).
            const float f = old / need;
            unsigned char* blk = store + head * page_size * head_dim;
            for (int i = threadIdx.x; i < page_size * head_dim; i += blockDim.x) {
                blk[i] = (unsigned char)f32_to_e4m3(e4m3_to_f32(blk[i]) * f);
            }
        }
        scale = need;
    }
    // The rescale above and the row below touch the same bytes from different threads.
    __syncthreads();
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        store[row + d] = (unsigned char)f32_to_e4m3(src[d] * inv);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        scales[head] = scale;
    }
    __syncthreads();
}

extern "C" __global__ void kv_write_fp8(const float* __restrict__ k, const float* __restrict__ v,
                                        unsigned char* __restrict__ kstore, unsigned char* __restrict__ vstore,
                                        float* __restrict__ kscale, float* __restrict__ vscale,
                                        const int* __restrict__ dst, const int* __restrict__ seqs,
                                        int n_kv_heads, int head_dim, int page_size, int n_layers, int layer,
                                        int src_stride) {
    GRID_WAIT();
    const int h = blockIdx.x;
    const int first = seqs[2 * blockIdx.y];
    const int count = seqs[2 * blockIdx.y + 1];
    for (int t = first; t < first + count; t++) {
        const int page = dst[2 * t];
        const int slot = dst[2 * t + 1];
        const long head = ((long)page * n_layers + layer) * n_kv_heads + h;
        const long row = (head * page_size + slot) * head_dim;
        const long src = (long)t * src_stride + (long)h * head_dim;
        fp8_row(k + src, kstore, kscale, head, row, page_size, head_dim);
        fp8_row(v + src, vstore, vscale, head, row, page_size, head_dim);
    }
}

// Copies inside the pool, as the CPU's PagePool::copy and move_rows: one block per (layer, kv head), 128
// threads. `heads` below is n_layers x n_kv_heads; an element is `elem` bytes (4, 2 or 1).

// Positions 0..n of page `src` into page `dst` (copy-on-write of a shared partial page): the bytes, and on
// FP8 pages (kscale not null) src's scales.
extern "C" __global__ void kv_copy_page(unsigned char* __restrict__ kstore, unsigned char* __restrict__ vstore,
                                        float* __restrict__ kscale, float* __restrict__ vscale, int src, int dst,
                                        int n, int elem, int heads, int head_dim, int page_size) {
    GRID_WAIT();
    const long s = (long)src * heads + blockIdx.x;
    const long d = (long)dst * heads + blockIdx.x;
    const long span = (long)page_size * head_dim * elem;
    const long bytes = (long)n * head_dim * elem;
    if (((span | bytes) & 3) == 0) {
        const unsigned* ks = (const unsigned*)(kstore + s * span);
        const unsigned* vs = (const unsigned*)(vstore + s * span);
        unsigned* kd = (unsigned*)(kstore + d * span);
        unsigned* vd = (unsigned*)(vstore + d * span);
        for (long i = threadIdx.x; i < bytes / 4; i += blockDim.x) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    } else {
        for (long i = threadIdx.x; i < bytes; i += blockDim.x) {
            kstore[d * span + i] = kstore[s * span + i];
            vstore[d * span + i] = vstore[s * span + i];
        }
    }
    if (kscale != nullptr && threadIdx.x == 0) {
        kscale[d] = kscale[s];
        vscale[d] = vscale[s];
    }
}

// Row moves in order (a draft tree's accepted path into place), each [src page, src slot, dst page, dst
// slot]: f32 and f16 rows are copied as they are. No move reads a row an earlier one wrote.
extern "C" __global__ void kv_move_rows(unsigned char* __restrict__ kstore, unsigned char* __restrict__ vstore,
                                        const int* __restrict__ moves, int n_moves, int elem, int heads,
                                        int head_dim, int page_size) {
    GRID_WAIT();
    const long row = (long)head_dim * elem;
    for (int m = 0; m < n_moves; m++) {
        const int* mv = moves + 4 * m;
        const long s = (((long)mv[0] * heads + blockIdx.x) * page_size + mv[1]) * row;
        const long d = (((long)mv[2] * heads + blockIdx.x) * page_size + mv[3]) * row;
        for (long i = threadIdx.x; i < row; i += blockDim.x) {
            kstore[d + i] = kstore[s + i];
            vstore[d + i] = vstore[s + i];
        }
        __syncthreads();
    }
}

// kv_move_rows for FP8 pages: each row is decoded at its page's scale and written at the destination's as
// a new row (fp8_row: raising that page's scale when it does not fit), like the CPU's copy_row.
extern "C" __global__ void kv_move_rows_fp8(unsigned char* __restrict__ kstore, unsigned char* __restrict__ vstore,
                                            float* __restrict__ kscale, float* __restrict__ vscale,
                                            const int* __restrict__ moves, int n_moves, int heads, int head_dim,
                                            int page_size) {
    GRID_WAIT();
    __shared__ float k[256];
    __shared__ float v[256];
    for (int m = 0; m < n_moves; m++) {
        const int* mv = moves + 4 * m;
        const long sh = (long)mv[0] * heads + blockIdx.x;
        const long dh = (long)mv[2] * heads + blockIdx.x;
        const long s = (sh * page_size + mv[1]) * head_dim;
        const float ks = kscale[sh];
        const float vs = vscale[sh];
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
            k[i] = e4m3_to_f32(kstore[s + i]) * ks;
            v[i] = e4m3_to_f32(vstore[s + i]) * vs;
        }
        __syncthreads();
        const long row = (dh * page_size + mv[3]) * head_dim;
        fp8_row(k, kstore, kscale, dh, row, page_size, head_dim);
        fp8_row(v, vstore, vscale, dh, row, page_size, head_dim);
    }
}
