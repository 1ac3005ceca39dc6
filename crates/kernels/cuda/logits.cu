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
