// The simulator's launcher: one OS thread per GPU thread of a block, the blocks one after another (see
// cuda_sim.hpp).
#include "cuda_sim.hpp"

#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace thorn_sim {

thread_local dim3 thread_idx;
thread_local dim3 block_idx;
dim3 block_dim;
dim3 grid_dim;

namespace {

struct Warp {
    explicit Warp(int n) : size(n), bar(n) {
        for (int i = 0; i < 32; i++) alive[i].store(i < n);
    }
    int size;
    std::barrier<> bar;
    uint64_t slot[32] = {};
    std::atomic<bool> alive[32];
};

struct Block {
    explicit Block(int n, size_t shared) : threads(n), bar(n), shared(shared + 16) {
        for (int w = 0; w < (n + 31) / 32; w++) warps.push_back(std::make_unique<Warp>(std::min(32, n - 32 * w)));
    }
    int threads;
    std::barrier<> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<unsigned char> shared;
};

thread_local Block* current = nullptr;
thread_local int linear = 0;

[[noreturn]] void fail(const char* what) {
    fprintf(stderr, "thorn kernel simulator: %s (block %u,%u,%u thread %u,%u,%u)\n", what, block_idx.x, block_idx.y,
            block_idx.z, thread_idx.x, thread_idx.y, thread_idx.z);
    fflush(stderr);
    abort();
}

Warp& my_warp() { return *current->warps[linear / 32]; }

void check_mask(Warp& w, unsigned mask, const char* what) {
    const unsigned full = w.size == 32 ? 0xffffffffu : ((1u << w.size) - 1);
    if (mask != full) {
        char buf[160];
        snprintf(buf, sizeof buf, "%s with mask %#x in a warp of %d lanes (only whole-warp masks are supported)", what,
                 mask, w.size);
        fail(buf);
    }
    for (int l = 0; l < w.size; l++) {
        if (!w.alive[l].load()) {
            char buf[160];
            snprintf(buf, sizeof buf, "%s names lane %d, which has exited", what, l);
            fail(buf);
        }
    }
}

}  // namespace

int lane_id() { return linear % 32; }

unsigned char* dynamic_shared() {
    // 16-byte aligned, as the GPU's dynamic shared memory is.
    uintptr_t p = reinterpret_cast<uintptr_t>(current->shared.data());
    return reinterpret_cast<unsigned char*>((p + 15) & ~uintptr_t(15));
}

void sync_threads() { current->bar.arrive_and_wait(); }

void sync_warp(unsigned mask) {
    Warp& w = my_warp();
    check_mask(w, mask, "__syncwarp");
    w.bar.arrive_and_wait();
}

uint64_t exchange(uint64_t bits, int src, unsigned mask, const char* what) {
    Warp& w = my_warp();
    check_mask(w, mask, what);
    const int lane = linear % 32;
    w.slot[lane] = bits;
    w.bar.arrive_and_wait();
    const uint64_t r = src >= 0 && src < w.size ? w.slot[src] : bits;
    w.bar.arrive_and_wait();
    return r;
}

}  // namespace thorn_sim

using Entry = void (*)(void**);
extern "C" Entry thorn_sim_find(const char* module, const char* kernel);

// Runs `kernel` of `module` over `grid` x `block` threads with `shared` bytes of dynamic shared memory;
// `params` points to each argument, as cuLaunchKernel's kernelParams. Returns 0, or 1 if the kernel is unknown
// and 2 if the launch shape is invalid (a kernel that misbehaves aborts the process with a message).
extern "C" int thorn_sim_launch(const char* module, const char* kernel, dim3 grid, dim3 block, size_t shared,
                                void** params) {
    static std::mutex one_at_a_time;
    const Entry entry = thorn_sim_find(module, kernel);
    if (entry == nullptr) return 1;
    const long n = (long)block.x * block.y * block.z;
    if (n <= 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || shared > 232448) return 2;
    std::lock_guard<std::mutex> lock(one_at_a_time);
    thorn_sim::grid_dim = grid;
    thorn_sim::block_dim = block;
    // One thread per GPU thread for the whole launch, stepping through the blocks together: the pool
    // barrier's completion step (run once all threads are done with a block) sets up the next block.
    const long blocks = (long)grid.x * grid.y * grid.z;
    long next = -1;
    std::unique_ptr<thorn_sim::Block> cur;
    auto advance = [&]() noexcept {
        next++;
        cur = next < blocks ? std::make_unique<thorn_sim::Block>((int)n, shared) : nullptr;
    };
    std::barrier pool((std::ptrdiff_t)n, advance);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (long t = 0; t < n; t++) {
        threads.emplace_back([&, t] {
            thorn_sim::linear = (int)t;
            thorn_sim::thread_idx = dim3{(unsigned)(t % block.x), (unsigned)(t / block.x % block.y),
                                         (unsigned)(t / ((long)block.x * block.y))};
            for (;;) {
                pool.arrive_and_wait();
                if (!cur) break;
                thorn_sim::Block& b = *cur;
                thorn_sim::current = &b;
                thorn_sim::block_idx = dim3{(unsigned)(next % grid.x), (unsigned)(next / grid.x % grid.y),
                                            (unsigned)(next / ((long)grid.x * grid.y))};
                entry(params);
                thorn_sim::Warp& w = *b.warps[t / 32];
                w.alive[t % 32].store(false);
                w.bar.arrive_and_drop();
                b.bar.arrive_and_drop();
            }
        });
    }
    for (auto& th : threads) th.join();
    return 0;
}
