// Gated DeltaNet (the recurrent layers of hybrid models such as Qwen3.5) over a run of tokens of one
// sequence, in the CPU backend's layouts (backend/cpu/gdn.rs): per token the convolution input and output
// are [q | k | v] (kh x dk, kh x dk, vh x dv), value head h reads key head h % kh; the state of one value
// head is [dk][dv]; the convolution window is [channel][kernel - 1], oldest first. Each kernel does the
// CPU's float operations in the CPU's order for each of its outputs, so results agree to the rounding of
// fused multiply-adds (bit for bit where nothing is fused).

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Causal depthwise convolution then SiLU: y[t][ch] = silu(sum_j taps[ch][j] * in(t + j)), where in() is the
// window followed by this run's inputs. The window then holds the last kernel - 1 inputs; with steps, the
// window after each of the last `count` tokens goes to steps[i * stride + offset ..] as well. One thread per
// channel (grid-stride), 256 threads a block.
extern "C" __global__ void gdn_conv(const float* __restrict__ taps, float* __restrict__ window,
                                    const float* __restrict__ x, float* __restrict__ y, int n, int conv_dim,
                                    int kernel, float* __restrict__ steps, int stride, int offset, int count) {
    GRID_WAIT();
    const int w = kernel - 1;
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < conv_dim; ch += gridDim.x * blockDim.x) {
        float* win = window + (long)ch * w;
        const float* tp = taps + (long)ch * kernel;
        // in(j): j < w is the window, then the run's inputs.
#define GDN_IN(j) ((j) < w ? win[(j)] : x[(long)((j) - w) * conv_dim + ch])
        for (int t = 0; t < n; t++) {
            float acc = 0.0f;
            for (int j = 0; j < kernel; j++) {
                acc += tp[j] * GDN_IN(t + j);
            }
            y[(long)t * conv_dim + ch] = silu_f(acc);
        }
        for (int i = 0; i < count; i++) {
            const int t = n - count + i;
            float* dst = steps + (long)i * stride + offset + (long)ch * w;
            for (int j = 0; j < w; j++) {
                dst[j] = GDN_IN(t + 1 + j);
            }
        }
        float last[8];
        for (int j = 0; j < w; j++) {
            last[j] = GDN_IN(n + j);
        }
        for (int j = 0; j < w; j++) {
            win[j] = last[j];
        }
#undef GDN_IN
    }
}

// L2 norm of every q and k head of n tokens of y (conv_dim floats per token), q also scaled by
// 1 / sqrt(dk). One warp per (token, head): grid (n, 2 kh), block 32. The sum of squares runs in lane
// order, then across lanes, so it is not the CPU's sequential sum: agreement to rounding.
extern "C" __global__ void gdn_normalize_qk(float* __restrict__ y, int conv_dim, int kh, int dk) {
    GRID_WAIT();
    const int t = blockIdx.x;
    const int head = blockIdx.y;
    float* h = y + (long)t * conv_dim + (long)head * dk;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dk; i += 32) {
        ss += h[i] * h[i];
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    const float scale = head < kh ? inv * (1.0f / sqrtf((float)dk)) : inv;
    for (int i = threadIdx.x; i < dk; i += 32) {
        h[i] *= scale;
    }
}

// The gates per token and value head, in place: alpha becomes g = a * softplus(alpha + dt_bias), b becomes
// beta = sigmoid(b). n x vh each; one thread per element, grid-stride.
extern "C" __global__ void gdn_gates(const float* __restrict__ a, const float* __restrict__ dt_bias,
                                     float* __restrict__ alpha, float* __restrict__ b, int n, int vh) {
    GRID_WAIT();
    const long total = (long)n * vh;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int h = (int)(i % vh);
        alpha[i] = a[h] * softplus_f(alpha[i] + dt_bias[h]);
        b[i] = sigmoid_f(b[i]);
    }
}

// The delta rule, token by token, for every value head: S <- S e^g; delta = (v - S^T k) beta;
// S <- S + k delta^T; o = S^T q. Each column d of a head's state depends only on its own column, so a thread
// owns column d (its dk values, strided by dv, stay in global memory, coalesced across the block) and does
// the CPU's operations for that column in the CPU's order. o: n x vh x dv. With steps, the state after each
// of the last `count` tokens goes to steps[i * stride + offset + head * dk * dv ..]. Grid (vh, ceil(dv /
// 128)), block 128; q and k of each token are staged in shared memory (dk <= 512).
extern "C" __global__ void gdn_recurrence(const float* __restrict__ y, const float* __restrict__ g,
                                          const float* __restrict__ beta, float* __restrict__ state,
                                          float* __restrict__ o, int n, int kh, int vh, int dk, int dv,
                                          float* __restrict__ steps, int stride, int offset, int count) {
    GRID_WAIT();
    __shared__ float qs[512];
    __shared__ float ks[512];
    const int head = blockIdx.x;
    const int d = blockIdx.y * blockDim.x + threadIdx.x;
    const int conv_dim = 2 * kh * dk + vh * dv;
    const int kk = head % kh;
    float* s = state + (long)head * dk * dv;
    for (int t = 0; t < n; t++) {
        const float* row = y + (long)t * conv_dim;
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = row[kk * dk + i];
            ks[i] = row[(kh + kk) * dk + i];
        }
        __syncthreads();
        if (d >= dv) {
            continue;
        }
        const float decay = expf(g[(long)t * vh + head]);
        const float bt = beta[(long)t * vh + head];
        for (int i = 0; i < dk; i++) {
            s[(long)i * dv + d] *= decay;
        }
        float delta = row[2 * kh * dk + head * dv + d];
        for (int i = 0; i < dk; i++) {
            delta -= s[(long)i * dv + d] * ks[i];
        }
        delta *= bt;
        float out = 0.0f;
        for (int i = 0; i < dk; i++) {
            const float sv = s[(long)i * dv + d] + ks[i] * delta;
            s[(long)i * dv + d] = sv;
            out += sv * qs[i];
        }
        o[((long)t * vh + head) * dv + d] = out;
        const int step = t - (n - count);
        if (step >= 0) {
            float* dst = steps + (long)step * stride + offset + (long)head * dk * dv;
            for (int i = 0; i < dk; i++) {
                dst[(long)i * dv + d] = s[(long)i * dv + d];
            }
        }
    }
}

// The same recurrence in chunked (WY) form (backend/cpu/gdn.rs `chunked`), chunks of GDN_CHUNK tokens: per
// chunk the cumulative log decay gc, T = (I - A)^-1 for A_ij = -beta_i (k_i . k_j) e^(gc_i - gc_j) (j < i) by
// forward substitution, U = T (beta v), W = T (beta e^gc k), v_new = U - W S, then
// o_i = e^gc_i q_i S + sum_{j<=i} (q_i . k_j) e^(gc_i - gc_j) v_new_j and
// S = e^gc_last S + sum_j e^(gc_last - gc_j) k_j v_new_j^T. The state is read and written once per chunk.
// One block per value head (grid vh, block 256: the forward substitution needs GDN_CHUNK - 1 threads); T and
// then the chunk's q.k products in shared memory; U (then v_new) and W in `work` (vh x GDN_CHUNK x (dv + dk)
// floats). Every output's sum runs in the CPU's order.
#define GDN_CHUNK 64
extern "C" __global__ void gdn_chunk(const float* __restrict__ y, const float* __restrict__ g,
                                     const float* __restrict__ beta, float* __restrict__ state,
                                     float* __restrict__ o, float* __restrict__ work, int n, int kh, int vh,
                                     int dk, int dv) {
    GRID_WAIT();
    __shared__ float gc[GDN_CHUNK];
    __shared__ float a[GDN_CHUNK * GDN_CHUNK];
    const int head = blockIdx.x;
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const int kk = head % kh;
    const long conv_dim = 2L * kh * dk + (long)vh * dv;
    float* s = state + (long)head * dk * dv;
    float* u = work + (long)head * GDN_CHUNK * (dk + dv);
    float* w = u + (long)GDN_CHUNK * dv;
#define GDN_Q(t) (y + (long)(t) * conv_dim + (long)kk * dk)
#define GDN_K(t) (y + (long)(t) * conv_dim + (long)(kh + kk) * dk)
#define GDN_V(t) (y + (long)(t) * conv_dim + 2L * kh * dk + (long)head * dv)
    for (int t0 = 0; t0 < n; t0 += GDN_CHUNK) {
        const int m = min(GDN_CHUNK, n - t0);
        __syncthreads();
        if (tid == 0) {
            float acc = 0.0f;
            for (int i = 0; i < m; i++) {
                acc += g[(long)(t0 + i) * vh + head];
                gc[i] = acc;
            }
        }
        __syncthreads();
        // A strictly below the diagonal.
        for (int e = tid; e < m * GDN_CHUNK; e += nt) {
            const int i = e / GDN_CHUNK;
            const int j = e % GDN_CHUNK;
            float v = 0.0f;
            if (j < i) {
                const float* ki = GDN_K(t0 + i);
                const float* kj = GDN_K(t0 + j);
                float dot = 0.0f;
                for (int x = 0; x < dk; x++) {
                    dot += ki[x] * kj[x];
                }
                v = -beta[(long)(t0 + i) * vh + head] * dot * expf(gc[i] - gc[j]);
            }
            a[e] = v;
        }
        __syncthreads();
        // T row by row: T_ij = A_ij + sum_{j<q<i} A_iq T_qj (row i's A entries are read before any is
        // replaced).
        for (int i = 1; i < m; i++) {
            float v = 0.0f;
            if (tid < i) {
                v = a[i * GDN_CHUNK + tid];
                for (int q = tid + 1; q < i; q++) {
                    v += a[i * GDN_CHUNK + q] * a[q * GDN_CHUNK + tid];
                }
            }
            __syncthreads();
            if (tid < i) {
                a[i * GDN_CHUNK + tid] = v;
            }
            __syncthreads();
        }
        for (int i = tid; i < m; i += nt) {
            a[i * GDN_CHUNK + i] = 1.0f;
        }
        __syncthreads();
        // U = T (beta v) and W = T (beta e^gc k).
        for (int e = tid; e < m * dv; e += nt) {
            const int i = e / dv;
            const int d = e % dv;
            float acc = 0.0f;
            for (int j = 0; j <= i; j++) {
                const float tij = a[i * GDN_CHUNK + j];
                if (tij == 0.0f) {
                    continue;
                }
                acc += tij * beta[(long)(t0 + j) * vh + head] * GDN_V(t0 + j)[d];
            }
            u[e] = acc;
        }
        for (int e = tid; e < m * dk; e += nt) {
            const int i = e / dk;
            const int x = e % dk;
            float acc = 0.0f;
            for (int j = 0; j <= i; j++) {
                const float tij = a[i * GDN_CHUNK + j];
                if (tij == 0.0f) {
                    continue;
                }
                const float f = tij * beta[(long)(t0 + j) * vh + head];
                acc += f * expf(gc[j]) * GDN_K(t0 + j)[x];
            }
            w[e] = acc;
        }
        __syncthreads();
        // v_new = U - W S, over U.
        for (int e = tid; e < m * dv; e += nt) {
            const int i = e / dv;
            const int d = e % dv;
            float v = u[e];
            for (int x = 0; x < dk; x++) {
                v -= w[(long)i * dk + x] * s[(long)x * dv + d];
            }
            u[e] = v;
        }
        // The chunk's (q_i . k_j) e^(gc_i - gc_j), j <= i, over T.
        for (int e = tid; e < m * GDN_CHUNK; e += nt) {
            const int i = e / GDN_CHUNK;
            const int j = e % GDN_CHUNK;
            if (j <= i) {
                const float* qi = GDN_Q(t0 + i);
                const float* kj = GDN_K(t0 + j);
                float dot = 0.0f;
                for (int x = 0; x < dk; x++) {
                    dot += qi[x] * kj[x];
                }
                a[e] = dot * expf(gc[i] - gc[j]);
            }
        }
        __syncthreads();
        for (int e = tid; e < m * dv; e += nt) {
            const int i = e / dv;
            const int d = e % dv;
            const float* qi = GDN_Q(t0 + i);
            const float ex = expf(gc[i]);
            float out = 0.0f;
            for (int x = 0; x < dk; x++) {
                out += qi[x] * ex * s[(long)x * dv + d];
            }
            for (int j = 0; j <= i; j++) {
                out += a[i * GDN_CHUNK + j] * u[(long)j * dv + d];
            }
            o[((long)(t0 + i) * vh + head) * dv + d] = out;
        }
        __syncthreads();
        const float last = gc[m - 1];
        const float el = expf(last);
        for (long e = tid; e < (long)dk * dv; e += nt) {
            const int x = (int)(e / dv);
            const int d = (int)(e % dv);
            float v = s[e] * el;
            for (int j = 0; j < m; j++) {
                v += expf(last - gc[j]) * GDN_K(t0 + j)[x] * u[(long)j * dv + d];
            }
            s[e] = v;
        }
    }
#undef GDN_Q
#undef GDN_K
#undef GDN_V
}

// The gated RMSNorm of each value head's output, in place: o = o / sqrt(mean(o^2) + eps) * w * silu(z).
// o, z: rows of dv (every token's every head); w: dv. One warp per row: grid (rows), block 32.
extern "C" __global__ void gdn_gated_norm(float* __restrict__ o, const float* __restrict__ z,
                                          const float* __restrict__ w, int dv, float eps) {
    GRID_WAIT();
    float* oh = o + (long)blockIdx.x * dv;
    const float* zh = z + (long)blockIdx.x * dv;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dv; i += 32) {
        ss += oh[i] * oh[i];
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int i = threadIdx.x; i < dv; i += 32) {
        oh[i] = oh[i] * inv * w[i] * silu_f(zh[i]);
    }
}

// x *= sigmoid(gate), element-wise (gated attention's output gate). Grid-stride, 256 threads a block.
extern "C" __global__ void sigmoid_gate(float* __restrict__ x, const float* __restrict__ gate, int n) {
    GRID_WAIT();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        x[i] *= sigmoid_f(gate[i]);
    }
}
