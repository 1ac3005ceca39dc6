// The CUDA C dialect of thorn's kernels, as plain C++ on the CPU (tests only).
//
// Each kernel module is compiled by the host's C++ compiler after this header. A block's warps are OS
// threads and a warp's lanes are fibers on its thread (runtime.cpp); blocks run one after another, so
// `__shared__` variables (function statics here) are the running block's. Warp shuffles exchange through
// per-warp slots, `__syncthreads` is a barrier of the block's warps. What a GPU leaves undefined aborts
// with a message here: a shuffle whose mask is not the whole warp or names an exited lane, and lanes of
// one warp stopping at different synchronisation points. `__device__` means `static`, so it is for free
// functions and variables only (no member functions).
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#define THORN_SIM 1

struct dim3 {
    unsigned x, y, z;
};
struct float2 {
    float x, y;
};
struct int2 {
    int x, y;
};
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
// 16-byte vector (its alignment is the launch code's to check: a GPU faults on a misaligned one).
struct uint4 {
    unsigned x, y, z, w;
};
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

namespace thorn_sim {
extern thread_local dim3 thread_idx;
extern thread_local dim3 block_idx;
extern dim3 block_dim;
extern dim3 grid_dim;
void sync_threads();
void sync_warp(unsigned mask);
uint64_t exchange(uint64_t bits, int src_lane, unsigned mask, const char* what);
int lane_id();
unsigned char* dynamic_shared();

template <class T>
static inline T from_bits(uint64_t b) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T>
static inline uint64_t to_bits(T v) {
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
}  // namespace thorn_sim

#define threadIdx (thorn_sim::thread_idx)
#define blockIdx (thorn_sim::block_idx)
#define blockDim (thorn_sim::block_dim)
#define gridDim (thorn_sim::grid_dim)
#define __global__
#define __device__ static
#define __constant__ static
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)
#define THORN_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(thorn_sim::dynamic_shared())

static inline void __syncthreads() { thorn_sim::sync_threads(); }
static inline void __threadfence() {}  // blocks run one after another: every write is seen
static inline void __syncwarp(unsigned mask = 0xffffffffu) { thorn_sim::sync_warp(mask); }

template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = thorn_sim::lane_id();
    int src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return thorn_sim::from_bits<T>(thorn_sim::exchange(thorn_sim::to_bits(v), src, mask, "__shfl_xor_sync"));
}
template <class T>
static inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    const int lane = thorn_sim::lane_id();
    const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
    return thorn_sim::from_bits<T>(thorn_sim::exchange(thorn_sim::to_bits(v), src, mask, "__shfl_sync"));
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = thorn_sim::lane_id();
    int src = lane + (int)delta;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return thorn_sim::from_bits<T>(thorn_sim::exchange(thorn_sim::to_bits(v), src, mask, "__shfl_down_sync"));
}

static inline float __int_as_float(int i) { return thorn_sim::from_bits<float>((uint32_t)i); }
static inline int __float_as_int(float f) { return (int)(uint32_t)thorn_sim::to_bits(f); }
static inline unsigned __float_as_uint(float f) { return (uint32_t)thorn_sim::to_bits(f); }
static inline float __uint_as_float(unsigned u) { return thorn_sim::from_bits<float>(u); }
// Round to nearest, ties to even (the default rounding mode, as cvt.rni).
static inline int __float2int_rn(float f) { return (int)nearbyintf(f); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// Rounded once each and never fused into a multiply-add (the simulator is built with -ffp-contract=off).
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }  // rounded once
#define __expf expf  // glibc declares its own __expf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) {
        c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    }
    return c;
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    }
    return r;
}
template <class T>
static inline T __ldg(const T* p) { return *p; }
using std::max;
using std::min;

static inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
static inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
static inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

#include <utility>

namespace thorn_sim {
using Entry = void (*)(void**);

// Calls kernel `f` with its arguments read from `params` (each a pointer to one argument's value, as
// cuLaunchKernel's kernelParams), deducing each argument's type from the kernel's signature.
template <class... A, size_t... I>
static inline void call_with(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}
template <class... A>
static inline void call(void (*f)(A...), void** params) {
    call_with(f, params, std::index_sequence_for<A...>{});
}
// How many parameters kernel `f` takes.
template <class... A>
static constexpr int arity(void (*)(A...)) {
    return (int)sizeof...(A);
}
}  // namespace thorn_sim
