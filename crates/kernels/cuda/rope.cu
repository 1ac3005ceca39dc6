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
