// Conversions between f32 and IEEE half, element-wise (f16 weights and KV pages, f16 embedding rows). The
// prelude's f16_to_f32 and f32_to_f16 are the conversions every kernel uses; these kernels expose them so
// they are tested exhaustively against the host's half conversions. Grid-stride loops, 256 threads a block.

extern "C" __global__ void f16_to_f32_n(const unsigned short* __restrict__ h, float* __restrict__ f, int n) {
    GRID_WAIT();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        f[i] = f16_to_f32(h[i]);
    }
}

extern "C" __global__ void f32_to_f16_n(const float* __restrict__ f, unsigned short* __restrict__ h, int n) {
    GRID_WAIT();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        h[i] = f32_to_f16(f[i]);
    }
}
