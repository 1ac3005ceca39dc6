// Reductions over rows of logits on the device, so a step's result leaves the GPU as a few numbers instead
// of whole rows: the greedy token and the top k of a row (the draft tree's candidates).
//
// Order: larger value first, the lower index first among equals (the CPU's argmax keeps the first of
// equals); NaN is never chosen. One block of 256 threads per row.

#define TOPK_MAX 8
#define TOPK_THREADS 256

// Whether (v, i) goes before (w, j); index -1 is padding, after every number.
__device__ __forceinline__ bool before(float v, int i, float w, int j) {
    return v > w || (v == w && i >= 0 && (j < 0 || i < j));
}

// The k best of each row of `vocab` logits: idx[r * k + i], val[r * k + i], best first (index -1 and minus
// infinity pad a row with fewer than k numbers). k <= 8.
extern "C" __global__ void topk_rows(const float* __restrict__ logits, int vocab, int k, int* __restrict__ idx,
                                     float* __restrict__ val) {
    GRID_WAIT();
    __shared__ float sv[TOPK_THREADS * TOPK_MAX];
    __shared__ int si[TOPK_THREADS * TOPK_MAX];
    const float* row = logits + (long)blockIdx.x * vocab;
    float bv[TOPK_MAX];
    int bi[TOPK_MAX];
    for (int j = 0; j < TOPK_MAX; j++) {
        bv[j] = NEG_INF;
        bi[j] = -1;
    }
    // Each thread's k best of its strided share, kept sorted by insertion.
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float v = row[c];
        if (v != v || !before(v, c, bv[k - 1], bi[k - 1])) {
            continue;
        }
        int j = k - 1;
        while (j > 0 && before(v, c, bv[j - 1], bi[j - 1])) {
            bv[j] = bv[j - 1];
            bi[j] = bi[j - 1];
            j--;
        }
        bv[j] = v;
        bi[j] = c;
    }
    for (int j = 0; j < k; j++) {
        sv[threadIdx.x * TOPK_MAX + j] = bv[j];
        si[threadIdx.x * TOPK_MAX + j] = bi[j];
    }
    __syncthreads();
    // Pairwise merges of sorted lists: thread t keeps the k best of lists t and t + half.
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if ((int)threadIdx.x < half) {
            const int a = threadIdx.x * TOPK_MAX;
            const int b = (threadIdx.x + half) * TOPK_MAX;
            int ia = 0;
            int ib = 0;
            for (int j = 0; j < k; j++) {
                const bool take_a =
                    ia < k && (ib >= k || before(sv[a + ia], si[a + ia], sv[b + ib], si[b + ib]));
                if (take_a) {
                    bv[j] = sv[a + ia];
                    bi[j] = si[a + ia];
                    ia++;
                } else {
                    bv[j] = sv[b + ib];
                    bi[j] = si[b + ib];
                    ib++;
                }
            }
        }
        __syncthreads();
        if ((int)threadIdx.x < half) {
            for (int j = 0; j < k; j++) {
                sv[threadIdx.x * TOPK_MAX + j] = bv[j];
                si[threadIdx.x * TOPK_MAX + j] = bi[j];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        for (int j = 0; j < k; j++) {
            idx[(long)blockIdx.x * k + j] = si[j];
            val[(long)blockIdx.x * k + j] = sv[j];
        }
    }
}

// A row's greedy token and log-normaliser, so that a greedy step reads back three numbers per row instead of
// the row: out[3r] = the index of row r's largest value (the lower index among equals, NaN never chosen; -1
// when every value is NaN) as a float (exact below 2^24), out[3r + 1] = that value, out[3r + 2] =
// ln(sum(exp(x))) over the row, computed as max + ln(sum(exp(x - max))) (minus infinity when every value
// is minus infinity). One block of 256 threads per row; the sums are added in a fixed order, so a row's
// numbers do not depend on the other rows.
extern "C" __global__ void row_best(const float* __restrict__ logits, int vocab, float* __restrict__ out) {
    GRID_WAIT();
    __shared__ float sv[TOPK_THREADS];
    __shared__ int si[TOPK_THREADS];
    const float* row = logits + (long)blockIdx.x * vocab;
    float bv = NEG_INF;
    int bi = -1;
    // Each thread's best of its strided share: its indices rise, so the first of equals stays.
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float v = row[c];
        if (v == v && before(v, c, bv, bi)) {
            bv = v;
            bi = c;
        }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if ((int)threadIdx.x < half) {
            const int o = threadIdx.x + half;
            if (before(sv[o], si[o], sv[threadIdx.x], si[threadIdx.x])) {
                sv[threadIdx.x] = sv[o];
                si[threadIdx.x] = si[o];
            }
        }
        __syncthreads();
    }
    const float mx = sv[0];
    const int best = si[0];
    __syncthreads();
    float s = 0.0f;
    if (mx != NEG_INF) {
        for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
            s += expf(row[c] - mx);
        }
    }
    sv[threadIdx.x] = s;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if ((int)threadIdx.x < half) {
            sv[threadIdx.x] += sv[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float* o = out + 3 * (long)blockIdx.x;
        o[0] = (float)best;
        o[1] = mx;
        o[2] = mx == NEG_INF ? NEG_INF : mx + logf(sv[0]);
    }
}

// A row's k best finite values as sampling candidates (top-k sampling reads these instead of the row): the
// k largest, the lower index first among equals (as the CPU sampler's top-k keeps them), found by a radix
// select of the k-th largest value's order-preserving key, eight bits a pass, then collected. out per row:
// [count, then count pairs (index as a float, value)], unsorted; count < k only when the row has fewer
// finite values. -0 counts as +0. One block of 256 threads per row; k <= TOP_CANDIDATES.
#define TOP_CANDIDATES 64

// The order-preserving key of a finite value (larger value, larger key; never 0).
__device__ __forceinline__ unsigned top_key(float v) {
    const unsigned b = v == 0.0f ? 0u : __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

extern "C" __global__ void row_top(const float* __restrict__ logits, int vocab, int k, float* __restrict__ out) {
    GRID_WAIT();
    __shared__ int hist[256];
    __shared__ unsigned s_prefix;
    __shared__ int s_need;
    __shared__ int s_above;
    __shared__ int s_base[TOPK_THREADS];
    __shared__ int s_next;
    const float* row = logits + (long)blockIdx.x * vocab;
    float* o = out + (long)blockIdx.x * (1 + 2 * TOP_CANDIDATES);
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_need = k;
        s_above = 0;
        s_next = 0;
    }
    // The k-th largest key, a byte at a time from the top: at each pass, the byte under which the keys
    // sharing the bytes chosen so far reach the number still needed.
    unsigned mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            hist[i] = 0;
        }
        __syncthreads();
        const unsigned prefix = s_prefix;
        for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
            const float v = row[c];
            if (v - v == 0.0f) {
                const unsigned key = top_key(v);
                if ((key & mask) == prefix) {
                    atomicAdd(&hist[(key >> shift) & 255u], 1);
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int acc = 0;
            int sel = -1;
            for (int d = 255; d >= 0; d--) {
                if (acc + hist[d] >= s_need) {
                    sel = d;
                    break;
                }
                acc += hist[d];
            }
            if (sel < 0) {
                // Fewer than k finite values from here: every one of them is a candidate.
                s_above += acc;
                s_need = 0;
                s_prefix = 0;
            } else if (s_need > 0) {
                s_above += acc;
                s_need -= acc;
                s_prefix = prefix | ((unsigned)sel << shift);
            }
        }
        __syncthreads();
        if (s_need == 0) {
            break;
        }
        mask |= 255u << shift;
    }
    // Keys above the k-th's are all candidates (any order); of those equal to it, the first `need` by
    // index: each thread's contiguous share counts its equals, and the shares' counts are summed in
    // index order.
    const unsigned kth = s_prefix;
    const int need = s_need;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int c0 = threadIdx.x * chunk;
    const int c1 = min(c0 + chunk, vocab);
    int eq = 0;
    for (int c = c0; c < c1; c++) {
        const float v = row[c];
        if (v - v == 0.0f && top_key(v) == kth) {
            eq++;
        }
    }
    s_base[threadIdx.x] = eq;
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int t = 0; t < (int)blockDim.x; t++) {
            const int n = s_base[t];
            s_base[t] = acc;
            acc += n;
        }
    }
    __syncthreads();
    const int above = s_above;
    int rank = s_base[threadIdx.x];
    for (int c = c0; c < c1; c++) {
        const float v = row[c];
        if (v - v != 0.0f) {
            continue;
        }
        const unsigned key = top_key(v);
        int slot = -1;
        if (key > kth) {
            slot = atomicAdd(&s_next, 1);
        } else if (key == kth && need > 0 && rank < need) {
            slot = above + rank;
            rank++;
        }
        if (slot >= 0) {
            o[1 + 2 * slot] = (float)c;
            o[2 + 2 * slot] = v;
        }
    }
    if (threadIdx.x == 0) {
        o[0] = (float)(above + need);
    }
}
