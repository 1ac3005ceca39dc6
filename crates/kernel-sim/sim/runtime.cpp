// The simulator's launcher (see cuda_sim.hpp). A block's warps are OS threads; a warp's 32 lanes are
// fibers (ucontext) on its thread, run one after another from one synchronisation point to the next, like
// a GPU warp that diverged and reconverges there. A shuffle or __syncwarp is such a point inside the warp
// (every live lane must reach the same one, else the kernel is wrong and the simulator aborts); at
// __syncthreads the warp's thread meets the block's other warps at a barrier. Blocks run one after another.
#include "cuda_sim.hpp"

#include <ucontext.h>

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

constexpr size_t STACK = 256 * 1024;

// Where a lane stopped.
enum class At { Running, Exchange, SyncWarp, SyncThreads, Exited };

struct Lane {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack;
    At at = At::Running;
    const char* what = nullptr;
    unsigned mask = 0;
};

struct Block;

// One warp: its lanes' fibers, run by one OS thread.
struct Warp {
    Block* block = nullptr;
    int first = 0;  // linear id of lane 0
    int size = 0;   // lanes in this warp
    ucontext_t sched;
    Lane lanes[32];
    int running = -1;
    // Shuffle slots, double-buffered by exchange parity: a lane resumed after exchange k may reach exchange
    // k + 1 (and write its slot) before a later lane has read its value of exchange k.
    uint64_t slot[2][32] = {};
    int parity = 0;
};

struct Block {
    explicit Block(int warps, size_t shared) : bar(warps), shared(shared + 16) {}
    std::barrier<> bar;
    std::vector<unsigned char> shared;
};

thread_local Warp* current = nullptr;
void (*entry_fn)(void**) = nullptr;
void** entry_params = nullptr;

[[noreturn]] void fail(const char* what) {
    fprintf(stderr, "thorn kernel simulator: %s (block %u,%u,%u thread %u,%u,%u)\n", what, block_idx.x, block_idx.y,
            block_idx.z, thread_idx.x, thread_idx.y, thread_idx.z);
    fflush(stderr);
    abort();
}

void set_index(Warp& w, int lane) {
    const long t = w.first + lane;
    thread_idx = dim3{(unsigned)(t % block_dim.x), (unsigned)(t / block_dim.x % block_dim.y),
                      (unsigned)(t / ((long)block_dim.x * block_dim.y))};
}

// Back to the warp's scheduler, recording where this lane stopped.
void stop(At at, const char* what, unsigned mask) {
    Warp& w = *current;
    Lane& l = w.lanes[w.running];
    l.at = at;
    l.what = what;
    l.mask = mask;
    swapcontext(&l.ctx, &w.sched);
}

void lane_main(int lane) {
    Warp& w = *current;
    (void)lane;
    entry_fn(entry_params);
    w.lanes[w.running].at = At::Exited;
    setcontext(&w.sched);
}

void check_mask(Warp& w, unsigned mask, const char* what) {
    const unsigned full = w.size == 32 ? 0xffffffffu : ((1u << w.size) - 1);
    if (mask != full) {
        char buf[160];
        snprintf(buf, sizeof buf, "%s with mask %#x in a warp of %d lanes (only whole-warp masks are supported)", what,
                 mask, w.size);
        fail(buf);
    }
}

// Resumes every lane of `w` once, in order.
void resume_all(Warp& w) {
    for (int i = 0; i < w.size; i++) {
        if (w.lanes[i].at == At::Exited) continue;
        w.lanes[i].at = At::Running;
        w.running = i;
        set_index(w, i);
        swapcontext(&w.sched, &w.lanes[i].ctx);
    }
    w.running = -1;
}

// Runs one block's share of this warp to the end.
void run_warp(Warp& w, Block& b, unsigned bx, unsigned by, unsigned bz) {
    w.block = &b;
    block_idx = dim3{bx, by, bz};
    w.parity = 0;
    for (int i = 0; i < w.size; i++) {
        Lane& l = w.lanes[i];
        if (!l.stack) l.stack.reset(new char[STACK]);
        getcontext(&l.ctx);
        l.ctx.uc_stack.ss_sp = l.stack.get();
        l.ctx.uc_stack.ss_size = STACK;
        l.ctx.uc_link = nullptr;
        makecontext(&l.ctx, reinterpret_cast<void (*)()>(lane_main), 1, i);
        l.at = At::Running;
    }
    resume_all(w);
    for (;;) {
        // Every live lane stopped at the same kind of point, or the kernel diverged around one.
        int live = 0;
        At at = At::Exited;
        const char* what = nullptr;
        for (int i = 0; i < w.size; i++) {
            const Lane& l = w.lanes[i];
            if (l.at == At::Exited) continue;
            if (live > 0 && l.at != at) {
                set_index(w, i);
                fail("lanes of a warp stopped at different synchronisation points (divergent shuffle or barrier)");
            }
            at = l.at;
            what = l.what;
            live++;
        }
        if (live == 0) {
            b.bar.arrive_and_drop();
            return;
        }
        if (at == At::Exchange || at == At::SyncWarp) {
            if (live != w.size) {
                char buf[160];
                snprintf(buf, sizeof buf, "%s with a full mask after %d lanes of the warp exited", what,
                         w.size - live);
                fail(buf);
            }
            if (at == At::Exchange) w.parity ^= 1;
        } else if (at == At::SyncThreads) {
            b.bar.arrive_and_wait();
        }
        resume_all(w);
    }
}

}  // namespace

int lane_id() {
    const Warp& w = *current;
    return (w.first + w.running) % 32;
}

unsigned char* dynamic_shared() {
    // 16-byte aligned, as the GPU's dynamic shared memory is.
    uintptr_t p = reinterpret_cast<uintptr_t>(current->block->shared.data());
    return reinterpret_cast<unsigned char*>((p + 15) & ~uintptr_t(15));
}

void sync_threads() { stop(At::SyncThreads, "__syncthreads", 0); }

void sync_warp(unsigned mask) {
    check_mask(*current, mask, "__syncwarp");
    stop(At::SyncWarp, "__syncwarp", mask);
}

uint64_t exchange(uint64_t bits, int src, unsigned mask, const char* what) {
    Warp& w = *current;
    check_mask(w, mask, what);
    const int lane = w.running;
    // Written into the next parity's slots; the scheduler flips parity once every lane has written.
    w.slot[w.parity ^ 1][lane] = bits;
    stop(At::Exchange, what, mask);
    return src >= 0 && src < w.size ? w.slot[w.parity][src] : bits;
}

}  // namespace thorn_sim

using Entry = void (*)(void**);
extern "C" Entry thorn_sim_find(const char* module, const char* kernel, int* arity);

// Runs `kernel` of `module` over `grid` x `block` threads with `shared` bytes of dynamic shared memory;
// `params` points to each of its `n_params` arguments, as cuLaunchKernel's kernelParams. Returns 0, or 1 if the
// kernel is unknown, 2 if the launch shape is invalid, 3 if the kernel takes another number of parameters
// (a kernel that misbehaves aborts the process with a message).
extern "C" int thorn_sim_launch(const char* module, const char* kernel, dim3 grid, dim3 block, size_t shared,
                                void** params, int n_params) {
    static std::mutex one_at_a_time;
    int arity = -1;
    const Entry entry = thorn_sim_find(module, kernel, &arity);
    if (entry == nullptr) return 1;
    if (arity != n_params) return 3;
    const long n = (long)block.x * block.y * block.z;
    if (n <= 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || shared > 232448) return 2;
    std::lock_guard<std::mutex> lock(one_at_a_time);
    thorn_sim::grid_dim = grid;
    thorn_sim::block_dim = block;
    thorn_sim::entry_fn = entry;
    thorn_sim::entry_params = params;
    const int warps = (int)((n + 31) / 32);
    const long blocks = (long)grid.x * grid.y * grid.z;
    // One OS thread per warp for the whole launch, stepping through the blocks together: the pool barrier's
    // completion step (run once every warp is done with a block) sets up the next block.
    long next = -1;
    std::unique_ptr<thorn_sim::Block> cur;
    auto advance = [&]() noexcept {
        next++;
        cur = next < blocks ? std::make_unique<thorn_sim::Block>(warps, shared) : nullptr;
    };
    std::barrier pool(warps, advance);
    std::vector<std::thread> threads;
    threads.reserve(warps);
    for (int wi = 0; wi < warps; wi++) {
        threads.emplace_back([&, wi] {
            auto w = std::make_unique<thorn_sim::Warp>();
            w->first = 32 * wi;
            w->size = (int)std::min<long>(32, n - 32L * wi);
            thorn_sim::current = w.get();
            for (;;) {
                pool.arrive_and_wait();
                if (!cur) break;
                thorn_sim::run_warp(*w, *cur, (unsigned)(next % grid.x), (unsigned)(next / grid.x % grid.y),
                                    (unsigned)(next / ((long)grid.x * grid.y)));
            }
        });
    }
    for (auto& th : threads) th.join();
    return 0;
}
