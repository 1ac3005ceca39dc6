// The simulator's launcher (see cuda_sim.hpp). A block's warps run on OS threads (the caller's for a
// one-warp block, workers kept across launches otherwise); a warp's 32 lanes are
// fibers on its thread (a few instructions of context switch on x86-64, ucontext elsewhere), run one after another from one synchronisation point to the next, like
// a GPU warp that diverged and reconverges there. A shuffle or __syncwarp is such a point inside the warp
// (every live lane must reach the same one, else the kernel is wrong and the simulator aborts); at
// __syncthreads the warp's thread meets the block's other warps at a barrier. Blocks run one after another.
#include "cuda_sim.hpp"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <barrier>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <latch>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
// A fiber switch: saves the callee-saved registers and the FPU/SSE control words on the current stack,
// stores its pointer in *from, and continues from the stack `to` (System V ABI: everything else is
// caller-saved). No system call, unlike swapcontext's signal-mask calls, which made up most of a
// simulated launch's time.
extern "C" void thorn_sim_switch(void** from, void* to);
extern "C" void thorn_sim_trampoline();
asm(R"(
    .text
    .globl thorn_sim_switch
    .type thorn_sim_switch,@function
thorn_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size thorn_sim_switch, .-thorn_sim_switch

    .globl thorn_sim_trampoline
    .type thorn_sim_trampoline,@function
thorn_sim_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size thorn_sim_trampoline, .-thorn_sim_trampoline
)");
#endif

namespace thorn_sim {

thread_local dim3 thread_idx;
thread_local dim3 block_idx;
dim3 block_dim;
dim3 grid_dim;

namespace {

constexpr size_t STACK = 64 * 1024;

// Where a lane stopped.
enum class At { Running, Exchange, SyncWarp, SyncThreads, Exited };

struct Lane {
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
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
#if defined(__x86_64__)
    void* sched = nullptr;
#else
    ucontext_t sched;
#endif
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
#if defined(__x86_64__)
    thorn_sim_switch(&l.sp, w.sched);
#else
    swapcontext(&l.ctx, &w.sched);
#endif
}

void lane_main(int lane) {
    Warp& w = *current;
    (void)lane;
    entry_fn(entry_params);
    w.lanes[w.running].at = At::Exited;
#if defined(__x86_64__)
    void* dead;
    thorn_sim_switch(&dead, w.sched);
#else
    setcontext(&w.sched);
#endif
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
#if defined(__x86_64__)
        thorn_sim_switch(&w.sched, w.lanes[i].sp);
#else
        swapcontext(&w.sched, &w.lanes[i].ctx);
#endif
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
#if defined(__x86_64__)
        // A first frame for thorn_sim_switch to "return" into: the trampoline, which calls lane_main(i)
        // with a 16-byte aligned stack. Layout from the saved stack pointer up: control words, r15, r14,
        // r13 (the function), r12 (its argument), rbx, rbp, the return address.
        uintptr_t top = (reinterpret_cast<uintptr_t>(l.stack.get()) + STACK) & ~uintptr_t(15);
        uintptr_t s = top - 16;
        uint64_t* f = reinterpret_cast<uint64_t*>(s - 64);
        const uint32_t mxcsr = 0x1f80;
        const uint16_t fpucw = 0x037f;
        memcpy(&f[0], &mxcsr, 4);
        memcpy(reinterpret_cast<char*>(&f[0]) + 4, &fpucw, 2);
        f[1] = 0;                                                  // r15
        f[2] = 0;                                                  // r14
        f[3] = reinterpret_cast<uint64_t>(&lane_main);             // r13
        f[4] = (uint64_t)i;                                        // r12
        f[5] = 0;                                                  // rbx
        f[6] = 0;                                                  // rbp
        f[7] = reinterpret_cast<uint64_t>(&thorn_sim_trampoline);  // return address
        l.sp = f;
#else
        getcontext(&l.ctx);
        l.ctx.uc_stack.ss_sp = l.stack.get();
        l.ctx.uc_stack.ss_size = STACK;
        l.ctx.uc_link = nullptr;
        makecontext(&l.ctx, reinterpret_cast<void (*)()>(lane_main), 1, i);
#endif
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

namespace {

// This thread's warp: its fibers' stacks are kept from launch to launch.
thorn_sim::Warp& cached_warp(int wi, long n) {
    thread_local std::unique_ptr<thorn_sim::Warp> w;
    if (!w) w = std::make_unique<thorn_sim::Warp>();
    w->first = 32 * wi;
    w->size = (int)std::min<long>(32, n - 32L * wi);
    w->block = nullptr;
    w->running = -1;
    return *w;
}

// Worker threads that outlive launches (starting threads was most of a small launch's time). Launches are
// serialised, so only one launch hands out jobs at a time.
struct Worker {
    std::mutex m;
    std::condition_variable cv;
    std::function<void()> job;
};

std::vector<Worker*>& workers() {
    static std::vector<Worker*> w;
    return w;
}

void post(int i, std::function<void()> job) {
    auto& ws = workers();
    while ((int)ws.size() <= i) {
        Worker* w = new Worker();  // lives as long as the process, like its thread
        std::thread([w] {
            for (;;) {
                std::function<void()> job;
                {
                    std::unique_lock<std::mutex> lock(w->m);
                    w->cv.wait(lock, [w] { return (bool)w->job; });
                    job = std::move(w->job);
                    w->job = nullptr;
                }
                job();
            }
        }).detach();
        ws.push_back(w);
    }
    Worker* w = ws[i];
    {
        std::lock_guard<std::mutex> lock(w->m);
        w->job = std::move(job);
    }
    w->cv.notify_one();
}

}  // namespace

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
    long next = -1;
    std::unique_ptr<thorn_sim::Block> cur;
    auto advance = [&]() noexcept {
        next++;
        cur = next < blocks ? std::make_unique<thorn_sim::Block>(warps, shared) : nullptr;
    };
    auto run_blocks = [&](thorn_sim::Warp& w, auto&& next_block) {
        thorn_sim::current = &w;
        for (;;) {
            next_block();
            if (!cur) break;
            thorn_sim::run_warp(w, *cur, (unsigned)(next % grid.x), (unsigned)(next / grid.x % grid.y),
                                (unsigned)(next / ((long)grid.x * grid.y)));
        }
        thorn_sim::current = nullptr;
    };
    if (warps == 1) {
        // One warp: its fibers run on this thread, block after block.
        run_blocks(cached_warp(0, n), advance);
        return 0;
    }
    // One worker per warp, stepping through the blocks together: the pool barrier's completion step (run
    // once every warp is done with a block) sets up the next block.
    std::barrier pool(warps, advance);
    std::latch done(warps);
    for (int wi = 0; wi < warps; wi++) {
        post(wi, [&, wi] {
            run_blocks(cached_warp(wi, n), [&] { pool.arrive_and_wait(); });
            done.count_down();
        });
    }
    done.wait();
    return 0;
}
