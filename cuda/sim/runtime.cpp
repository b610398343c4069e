// runtime.cpp -- the CPU harness scheduler: runs a CUDA grid block by block, each CUDA thread
// a fiber on its own small stack, switched by a 6-register assembly context switch (x86-64
// SysV). Owns: fiber stacks, block/warp rendezvous, the schedule (index order or seeded
// random, see "Schedules"), deadlock reports, cp.async groups, shared-memory poisoning and
// guards, and the sanitizer fiber hooks.
//
// Built once per sanitizer mode (plain / ASan / TSan) by runtime/kernels/sim_module.py and
// linked into every kernel module. It is deliberately NOT instrumented by the sanitizers: it
// touches every thread's state from the scheduler, and TSan would report the harness itself.
// Instead it tells the sanitizers what the kernel code needs to know:
//   * ASan: __sanitizer_{start,finish}_switch_fiber around every switch; the guard after
//     dynamic shared memory is poisoned, so an overflow is reported at the faulting line.
//   * TSan: each CUDA thread is a TSan fiber, switched with no_sync (a switch is not a
//     synchronisation); barriers are release (arrive) / acquire (leave) on the barrier.
#include "runtime_api.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#if defined(PAGEDRUN_SIM_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(PAGEDRUN_SIM_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

extern "C" {
void pagedrun_fiber_switch(void** save_sp, void* new_sp) __attribute__((visibility("hidden")));
void pagedrun_fiber_trampoline() __attribute__((visibility("hidden")));
}

// Saves the callee-saved registers on the current stack, stores the stack pointer in
// *save_sp, loads new_sp and restores the registers saved there. A fresh fiber's stack is
// laid out so that the restore lands in pagedrun_fiber_trampoline with r12 = argument and
// r13 = entry function.
asm(R"(
    .text
    .globl pagedrun_fiber_switch
    .hidden pagedrun_fiber_switch
    .type pagedrun_fiber_switch,@function
pagedrun_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size pagedrun_fiber_switch, .-pagedrun_fiber_switch

    .globl pagedrun_fiber_trampoline
    .hidden pagedrun_fiber_trampoline
    .type pagedrun_fiber_trampoline,@function
pagedrun_fiber_trampoline:
    movq %r12, %rdi
    call *%r13
    ud2
    .size pagedrun_fiber_trampoline, .-pagedrun_fiber_trampoline
)");

namespace pagedrun_sim {

ThreadCtx* g_thread = nullptr;
LaunchCtx g_launch{};

namespace {

// Plain builds need little stack per CUDA thread; ASan's redzones need more.
#if defined(PAGEDRUN_SIM_ASAN) || defined(PAGEDRUN_SIM_TSAN)
constexpr std::size_t kStackBytes = 256 * 1024;
#else
constexpr std::size_t kStackBytes = 128 * 1024;
#endif
constexpr std::size_t kGuardBytes = 4096;
constexpr std::size_t kCacheLine = 64;
constexpr std::size_t kStackColors = 61;  // prime, so lanes and warps spread over L1 sets
constexpr std::size_t kSmemGuardBytes = 256;   // poisoned tail after dynamic shared memory
constexpr std::size_t kSmemAlign = 128;
constexpr unsigned char kPoisonByte = 0xFF;    // f32/f16/bf16 NaN, integer -1
constexpr unsigned char kGuardByte = 0xA5;
constexpr std::size_t kMaxDynSmem = 227 * 1024;  // sm_90 opt-in maximum per block
constexpr unsigned kMaxThreads = 1024;

enum class State { Runnable, WaitBlock, WaitWarp, WaitCond, Done };

struct PendingCopy {
    unsigned char* dst;
    unsigned char data[16];
};

struct Fiber {
    ThreadCtx ctx{};
    void* sp = nullptr;
    unsigned char* stack_lo = nullptr;
    State state = State::Runnable;
    Loc site{};
    const char* what = nullptr;
    uint32_t mask = 0;
    WaitReady ready = nullptr;  // State::WaitCond: the scheduler resumes the fiber once true
    void* ready_ctx = nullptr;
    void* asan_fake = nullptr;
    void* tsan_fiber = nullptr;
    std::vector<PendingCopy> open_group;
    std::deque<std::vector<PendingCopy>> committed;
};

struct Warp {
    uint32_t exists = 0;   // lanes present in the block
    uint32_t exited = 0;   // lanes whose thread has returned
    uint32_t arrived = 0;  // lanes waiting in a collective
    void* data[kWarpSize]{};
};

struct Launch {
    const char* name = nullptr;
    KernelBody body = nullptr;
    void* fn = nullptr;
    void** args = nullptr;
    unsigned nthreads = 0;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    Fiber* cur = nullptr;
    void* sched_sp = nullptr;
    unsigned sweep_last = 0;  // index order: the last fiber this sweep ran (see hand_off)
    bool failed = false;
    std::string error;
    // Shuffled schedules only (g_schedule_seed != 0; see "Schedules" below).
    bool shuffled = false;
    bool by_priority = false;        // this block's policy: priorities, else uniform picks
    std::vector<unsigned> ready;     // uniform: runnable fibers, not running
    std::vector<uint32_t> warp_ready;  // priority: the same set as a lane mask per warp
    unsigned num_ready = 0;
    std::vector<int64_t> warp_key;   // by_priority: higher runs first; demotion goes negative
    std::vector<uint32_t> lane_key;  // by_priority: tie-break inside a warp
    int64_t lowest_key = 0;
    uint64_t last_block_switches = 0;  // the previous block's length: sizes the change points
    unsigned block_arrived = 0;
    int block_acc = 0;
    int block_kind = 0;
    // sanitizer bookkeeping
    void* sched_fake = nullptr;
    const void* sched_stack_bottom = nullptr;
    std::size_t sched_stack_size = 0;
    void* tsan_sched = nullptr;
    // Block start is released by the scheduler and acquired by each fiber; block end the
    // reverse. Two tokens, so that one fiber finishing does not order it before the next.
    char tsan_block_start = 0, tsan_block_end = 0, tsan_barrier_token = 0, tsan_warp_token = 0;
    char tsan_cond_token = 0;
};

Launch* g_L = nullptr;
uint64_t g_block_serial = 0;  // bumped per block: twins' side state keyed by it resets itself

// Schedules (pagedrun_sim_set_schedule_seed; Python: sim_module.Schedule).
//
// Seed 0, index order: blocks run in grid order; inside a block, rounds over the threads in
// index order, each runnable thread running until its next rendezvous (__syncthreads, a warp
// collective, a blocking wait_until) or its exit. Deterministic, and blind to any race whose
// outcome that order fixes: a thread reading, with no barrier between, what a lower-indexed
// thread wrote always sees it; warp 0 never runs ahead of warp 1; block 0 always runs first.
//
// Seed != 0, shuffled: the block order of each launch is a random permutation, and every
// switch point is a random choice among the runnable threads. A rendezvous is a switch point
// for every thread in it, the one completing it too (it re-enters the ready set instead of
// running on), so the order in which threads leave a barrier is random as well as the order
// in which they reach it. Each block draws one of two policies:
//   * uniform: the next thread is drawn uniformly from the ready set -- fine-grained
//     interleavings of all warps;
//   * priority (PCT, Burckhardt et al. 2010): each warp gets a random priority, each lane a
//     random rank in its warp, and the highest ready thread runs; at 0 (half the blocks), 1
//     or 2 change points, drawn uniformly over the block's expected length in switches (the
//     previous block's), the running warp drops below all others. One warp runs through
//     several rendezvous before another starts -- the schedule that exposes "warp 1 wrote
//     it by now" assumptions, which a uniform draw over hundreds of threads never produces.
// Both are legal GPU schedules: barriers and warp collectives keep their semantics, only the
// order between them changes. Waiters in wait_until are polled when the ready set is empty
// and at a random quarter of the switches (a waiter resuming late is legal). Each launch
// draws from (seed, launches since the seed was set), so a seed replays a test exactly.
// cp.async needs no shuffling: a copy poisons its destination (NaN) at issue and lands only
// at the issuing thread's covering cp_async_wait, the latest legal point, so a read before
// the wait always sees NaN and a read of another thread's copy sees it unless the issuer's
// wait ran first -- which the shuffled order decides.
uint64_t g_schedule_seed = 0;
uint64_t g_schedule_state = 0;
uint64_t g_launch_serial = 0;

uint64_t next_random() {  // splitmix64
    uint64_t z = (g_schedule_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <typename T>
void shuffle(std::vector<T>& v) {  // Fisher-Yates
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
}

// Static __shared__ variables are `static thread_local` (see sim.cuh: GCC drops section
// attributes on template-instantiated statics, but every thread_local of the module lands
// in its PT_TLS segment). This anchor forces the segment to exist in the calling thread.
thread_local unsigned char g_tls_anchor;
unsigned char* g_static_smem = nullptr;
std::size_t g_static_smem_bytes = 0;

// Finds this module's PT_TLS segment instance for the calling thread (cached per thread id:
// launches are serialised, and a thread_local cache would itself be poisoned).
pthread_t g_static_smem_thread{};
bool locate_static_smem() {
    g_tls_anchor = 0;
    if (g_static_smem && pthread_equal(g_static_smem_thread, pthread_self()) &&
        &g_tls_anchor >= g_static_smem && &g_tls_anchor < g_static_smem + g_static_smem_bytes)
        return true;
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&locate_static_smem), &info)) return false;
    struct Found { const void* base; unsigned char* lo; std::size_t size; } found{
        info.dli_fbase, nullptr, 0};
    dl_iterate_phdr(
        [](dl_phdr_info* i, std::size_t, void* p) -> int {
            auto* f = static_cast<Found*>(p);
            if (reinterpret_cast<const void*>(i->dlpi_addr) != f->base) return 0;
            for (int k = 0; k < i->dlpi_phnum; ++k)
                if (i->dlpi_phdr[k].p_type == PT_TLS) {
                    f->lo = static_cast<unsigned char*>(i->dlpi_tls_data);
                    f->size = i->dlpi_phdr[k].p_memsz;
                }
            return 1;
        },
        &found);
    auto* anchor = &g_tls_anchor;
    if (!found.lo || anchor < found.lo || anchor >= found.lo + found.size) return false;
    g_static_smem = found.lo;
    g_static_smem_bytes = found.size;
    g_static_smem_thread = pthread_self();
    return true;
}
std::mutex g_launch_mutex;  // the static __shared__ storage exists once per module

unsigned char* g_stacks = nullptr;
std::size_t g_stacks_count = 0;

void tsan_release(void* p) {
#if defined(PAGEDRUN_SIM_TSAN)
    __tsan_release(p);
#else
    (void)p;
#endif
}
void tsan_acquire(void* p) {
#if defined(PAGEDRUN_SIM_TSAN)
    __tsan_acquire(p);
#else
    (void)p;
#endif
}

void push_ready(unsigned i) {
    Launch& L = *g_L;
    ++L.num_ready;
    if (L.by_priority)
        L.warp_ready[i / kWarpSize] |= 1u << (i % kWarpSize);
    else
        L.ready.push_back(i);
}

// Takes the next fiber to run out of the ready set (not empty): uniform, or the ready lane
// with the highest rank in the ready warp with the highest priority (O(warps + lanes)).
unsigned pop_ready() {
    Launch& L = *g_L;
    --L.num_ready;
    if (!L.by_priority) {
        const std::size_t pick = next_random() % L.ready.size();
        const unsigned i = L.ready[pick];
        L.ready[pick] = L.ready.back();
        L.ready.pop_back();
        return i;
    }
    unsigned w = ~0u;
    for (unsigned v = 0; v < L.warp_ready.size(); ++v)
        if (L.warp_ready[v] && (w == ~0u || L.warp_key[v] > L.warp_key[w])) w = v;
    unsigned best = ~0u;
    for (uint32_t m = L.warp_ready[w]; m; m &= m - 1) {
        const unsigned i = w * kWarpSize + unsigned(std::countr_zero(m));
        if (best == ~0u || L.lane_key[i] > L.lane_key[best]) best = i;
    }
    L.warp_ready[w] &= ~(1u << (best % kWarpSize));
    return best;
}

// Marks a waiting fiber runnable; shuffled schedules also put it in the ready set (the
// running fiber re-enters it itself when it yields, see reschedule).
void wake(Fiber& o) {
    Launch& L = *g_L;
    o.state = State::Runnable;
    if (L.shuffled && &o != L.cur) push_ready(o.ctx.linear);
}

std::string fmt_loc(const Loc& loc) {
    const char* file = loc.file_name();
    const char* slash = std::strrchr(file, '/');
    return std::string(slash ? slash + 1 : file) + ":" + std::to_string(loc.line());
}

std::string thread_name(const Fiber& f) {
    char buf[160];
    const uint3& b = g_launch.block_idx;
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u) [warp %u lane %u]", b.x,
                  b.y, b.z, f.ctx.thread_idx.x, f.ctx.thread_idx.y, f.ctx.thread_idx.z,
                  f.ctx.warp, f.ctx.lane);
    return buf;
}

void ensure_stacks(unsigned n) {
    if (g_stacks_count >= n) return;
    if (g_stacks) munmap(g_stacks, g_stacks_count * (kStackBytes + kGuardBytes));
    std::size_t bytes = std::size_t(n) * (kStackBytes + kGuardBytes);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        std::fprintf(stderr, "pagedrun sim: cannot map %zu bytes of fiber stacks\n", bytes);
        std::abort();
    }
    g_stacks = static_cast<unsigned char*>(p);
    g_stacks_count = n;
    for (unsigned i = 0; i < n; ++i)  // guard page below each stack catches overflow
        mprotect(g_stacks + i * (kStackBytes + kGuardBytes), kGuardBytes, PROT_NONE);
}

[[noreturn]] void fiber_main(Fiber* f);

void init_fiber_stack(Fiber& f) {
    // Initial frame, from the top: return address = trampoline, then rbp rbx r12 r13 r14 r15.
    // Stagger stack tops by a few cache lines per fiber: equal strides would put every
    // fiber's hot frame in the same L1 set and make each switch a miss.
    std::size_t color = (f.ctx.linear % kStackColors) * kCacheLine;
    auto* top = reinterpret_cast<uint64_t*>(f.stack_lo + kStackBytes - color);
    top[-1] = reinterpret_cast<uint64_t>(&pagedrun_fiber_trampoline);
    top[-2] = 0;                                          // rbp: ends frame-pointer walks
    top[-3] = 0;                                          // rbx
    top[-4] = reinterpret_cast<uint64_t>(&f);             // r12: argument
    top[-5] = reinterpret_cast<uint64_t>(&fiber_main);    // r13: entry
    top[-6] = 0;                                          // r14
    top[-7] = 0;                                          // r15
    f.sp = &top[-7];
}

// Scheduler -> fiber.
void run_fiber(Fiber& f) {
    Launch& L = *g_L;
    L.cur = &f;
    L.sweep_last = f.ctx.linear;
    g_thread = &f.ctx;
#if defined(PAGEDRUN_SIM_ASAN)
    __sanitizer_start_switch_fiber(&L.sched_fake, f.stack_lo, kStackBytes);
#endif
#if defined(PAGEDRUN_SIM_TSAN)
    __tsan_switch_to_fiber(f.tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
    pagedrun_fiber_switch(&L.sched_sp, f.sp);
#if defined(PAGEDRUN_SIM_ASAN)
    __sanitizer_finish_switch_fiber(L.sched_fake, nullptr, nullptr);
#endif
    L.cur = nullptr;
}

#if !defined(PAGEDRUN_SIM_ASAN) && !defined(PAGEDRUN_SIM_TSAN)
bool poll_waiter(Fiber& f);

// Index order, plain builds: a yielding fiber switches straight to the fiber the scheduler
// would run next -- the next runnable one after it in this sweep -- instead of through the
// scheduler: one context switch per rendezvous and thread instead of two (the harness spends
// most of its time switching). The order is exactly the scheduler's: it would visit the same
// fibers in the same states, nothing running in between. At the end of the sweep (nothing
// runnable after this fiber) the fiber returns to the scheduler, which recounts and starts
// the next sweep from L.sweep_last. Sanitizer builds keep the scheduler round trip: their
// fiber annotations track one scheduler stack.
bool hand_off(Fiber& f) {
    Launch& L = *g_L;
    if (L.shuffled || L.failed) return false;
    for (unsigned j = f.ctx.linear + 1; j < L.nthreads; ++j) {
        Fiber& o = L.fibers[j];
        if (o.state == State::WaitCond && poll_waiter(o)) o.state = State::Runnable;
        if (o.state != State::Runnable) continue;
        L.cur = &o;
        L.sweep_last = j;
        g_thread = &o.ctx;
        pagedrun_fiber_switch(&f.sp, o.sp);  // f resumes here (by the scheduler or a fiber)
        return true;
    }
    return false;
}
#endif

// Fiber -> scheduler. `final`: the fiber will never be resumed.
void yield_to_scheduler(bool final) {
    Launch& L = *g_L;
    Fiber& f = *L.cur;
#if !defined(PAGEDRUN_SIM_ASAN) && !defined(PAGEDRUN_SIM_TSAN)
    if (hand_off(f)) return;
#endif
#if defined(PAGEDRUN_SIM_ASAN)
    __sanitizer_start_switch_fiber(final ? nullptr : &f.asan_fake, L.sched_stack_bottom,
                                   L.sched_stack_size);
#else
    (void)final;
#endif
#if defined(PAGEDRUN_SIM_TSAN)
    __tsan_switch_to_fiber(L.tsan_sched, __tsan_switch_to_fiber_no_sync);
#endif
    pagedrun_fiber_switch(&f.sp, L.sched_sp);
#if defined(PAGEDRUN_SIM_ASAN)
    __sanitizer_finish_switch_fiber(f.asan_fake, &L.sched_stack_bottom, &L.sched_stack_size);
#endif
}

// The running fiber completed a rendezvous: under a shuffled schedule that is a switch point
// for it as for the threads it released, so it re-enters the ready set and yields.
void reschedule() {
    Launch& L = *g_L;
    if (!L.shuffled) return;
    push_ready(L.cur->ctx.linear);
    yield_to_scheduler(false);
}

void fiber_main(Fiber* f) {
    Launch& L = *g_L;
#if defined(PAGEDRUN_SIM_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &L.sched_stack_bottom, &L.sched_stack_size);
#endif
    tsan_acquire(&L.tsan_block_start);
    L.body(L.args, L.fn);
    f->state = State::Done;
    L.warps[f->ctx.warp].exited |= 1u << f->ctx.lane;
    tsan_release(&L.tsan_block_end);
    yield_to_scheduler(true);
    __builtin_unreachable();
}

void describe_wait(const Fiber& f, std::string& out) {
    switch (f.state) {
        case State::Done: out = "have exited"; break;
        case State::Runnable: out = "are runnable"; break;
        case State::WaitBlock: out = "wait at __syncthreads (" + fmt_loc(f.site) + ")"; break;
        case State::WaitCond: out = std::string("wait at ") + f.what + " (" + fmt_loc(f.site) + ")"; break;
        case State::WaitWarp: {
            char m[16];
            std::snprintf(m, sizeof m, "0x%08x", f.mask);
            out = std::string("wait at ") + f.what + " mask " + m + " (" + fmt_loc(f.site) + ")";
            break;
        }
    }
}

std::string deadlock_report() {
    Launch& L = *g_L;
    const uint3& b = g_launch.block_idx;
    char head[200];
    std::snprintf(head, sizeof head,
                  "kernel %s: deadlock in block (%u,%u,%u) of %u threads: no thread can "
                  "proceed (divergent barrier or warp operation):",
                  L.name, b.x, b.y, b.z, L.nthreads);
    std::string out = head;
    unsigned i = 0;
    while (i < L.nthreads) {
        std::string what;
        describe_wait(L.fibers[i], what);
        unsigned j = i + 1;
        for (; j < L.nthreads; ++j) {
            std::string w2;
            describe_wait(L.fibers[j], w2);
            if (w2 != what) break;
        }
        char range[64];
        if (j - i == 1)
            std::snprintf(range, sizeof range, "\n  thread %u ", i);
        else
            std::snprintf(range, sizeof range, "\n  threads %u-%u ", i, j - 1);
        out += range + what;
        i = j;
    }
    return out;
}

void poison_shared() {
    std::memset(g_static_smem, kPoisonByte, g_static_smem_bytes);
    if (g_launch.dyn_smem) std::memset(g_launch.dyn_smem, kPoisonByte, g_launch.dyn_smem_bytes);
}

bool check_smem_guard(std::string& err) {
    unsigned char* guard = g_launch.dyn_smem + g_launch.dyn_smem_bytes;
    for (std::size_t i = 0; i < kSmemGuardBytes; ++i) {
        if (guard[i] != kGuardByte) {
            const uint3& b = g_launch.block_idx;
            char buf[256];
            std::snprintf(buf, sizeof buf,
                          "kernel %s: shared memory overflow in block (%u,%u,%u): byte %zu past "
                          "the end of the %zu bytes of dynamic shared memory was written",
                          g_L->name, b.x, b.y, b.z, i, g_launch.dyn_smem_bytes);
            err = buf;
            return false;
        }
    }
    return true;
}

// After a failed block the scheduler takes over memory the abandoned fibers touched: order
// everything they released (arrivals at barriers, exits, the error message) before it.
void acquire_all_fibers() {
    Launch& L = *g_L;
    tsan_acquire(&L.tsan_block_end);
    tsan_acquire(&L.tsan_barrier_token);
    tsan_acquire(&L.tsan_warp_token);
    tsan_acquire(&L.tsan_cond_token);
}

void run_block_index_order();
void run_block_shuffled();

void run_block() {
    Launch& L = *g_L;
    ++g_block_serial;
    poison_shared();
    L.block_arrived = 0;
    L.block_acc = 0;
    for (auto& w : L.warps) w.arrived = w.exited = 0;
    for (auto& f : L.fibers) {
        f.state = State::Runnable;
        f.open_group.clear();
        f.committed.clear();
        init_fiber_stack(f);
    }
    tsan_release(&L.tsan_block_start);
    if (L.shuffled)
        run_block_shuffled();
    else
        run_block_index_order();
    if (L.failed) return;
    tsan_acquire(&L.tsan_block_end);
    std::string err;
    if (!check_smem_guard(err)) {
        L.failed = true;
        L.error = err;
    }
}

// Polls a fiber blocked in wait_until; true if it became runnable.
bool poll_waiter(Fiber& f) {
    Launch& L = *g_L;
    tsan_acquire(&L.tsan_cond_token);  // the predicate reads what waiters released
    const bool now = f.ready(f.ready_ctx);
    tsan_release(&L.tsan_cond_token);  // ... and before the waiter reuses its stack
    return now;
}

void run_block_index_order() {
    Launch& L = *g_L;
    unsigned done = 0;
    while (done < L.nthreads) {
        bool progress = false;
        for (unsigned i = 0; i < L.nthreads; ++i) {
            Fiber& f = L.fibers[i];
            if (f.state == State::WaitCond && poll_waiter(f)) f.state = State::Runnable;
            if (f.state == State::Runnable) {
                run_fiber(f);  // plain builds: runs on through the sweep (hand_off)
                progress = true;
                if (L.failed) {
                    acquire_all_fibers();
                    return;
                }
                i = L.sweep_last;  // every fiber up to it had its turn in this sweep
            }
        }
        // A fiber finishes only during its turn and has one turn per sweep: counting after
        // the sweep counts what the sweep's visits would have.
        done = 0;
        for (const auto& f : L.fibers) done += f.state == State::Done;
        if (done < L.nthreads && !progress) {
            acquire_all_fibers();
            L.failed = true;
            L.error = deadlock_report();
            return;
        }
    }
}

// See "Schedules" above.
void run_block_shuffled() {
    Launch& L = *g_L;
    const unsigned n = L.nthreads;
    L.by_priority = next_random() & 1;
    L.ready.clear();
    std::fill(L.warp_ready.begin(), L.warp_ready.end(), 0u);
    L.num_ready = 0;
    for (unsigned i = 0; i < n; ++i) push_ready(i);
    if (L.by_priority) {
        for (auto& k : L.warp_key) k = int64_t(next_random() >> 33) + 1;  // > every demotion
        for (unsigned i = 0; i < n; ++i) L.lane_key[i] = uint32_t(next_random());
        L.lowest_key = 0;
    }
    uint64_t change_at[2] = {~0ull, ~0ull};  // switch counts at which the running warp drops
    if (L.by_priority && (next_random() & 1)) {
        const uint64_t horizon = L.last_block_switches ? L.last_block_switches : 4ull * n;
        change_at[0] = next_random() % horizon;
        if (next_random() & 1) change_at[1] = next_random() % horizon;
    }
    uint64_t switches = 0;
    unsigned done = 0, waiting = 0;
    while (done < n) {
        if (waiting && (L.num_ready == 0 || next_random() % 4 == 0)) {
            for (Fiber& f : L.fibers)
                if (f.state == State::WaitCond && poll_waiter(f)) {
                    --waiting;
                    wake(f);
                }
        }
        if (L.num_ready == 0) {
            acquire_all_fibers();
            L.failed = true;
            L.error = deadlock_report();
            return;
        }
        Fiber& f = L.fibers[pop_ready()];
        run_fiber(f);
        if (L.failed) {
            acquire_all_fibers();
            return;
        }
        if (f.state == State::Done) ++done;
        if (f.state == State::WaitCond) ++waiting;
        if (switches == change_at[0] || switches == change_at[1])
            L.warp_key[f.ctx.warp] = --L.lowest_key;
        ++switches;
    }
    L.last_block_switches = switches;
}

// ---- faults -------------------------------------------------------------------------------
// In plain builds a SIGSEGV/SIGBUS raised by kernel code (wild pointer, fiber stack overflow)
// becomes a SimKernelError naming kernel, block and thread: the handler (on an alternate
// stack) jumps back to the scheduler and the fiber is abandoned. Under ASan/TSan the
// sanitizer's own report is better, so the handler is not installed there.
#if !defined(PAGEDRUN_SIM_ASAN) && !defined(PAGEDRUN_SIM_TSAN)
constexpr std::size_t kAltStackBytes = 64 * 1024;
sigjmp_buf g_fault_jmp;
void* volatile g_fault_addr = nullptr;
volatile int g_fault_signal = 0;
Fiber* volatile g_fault_fiber = nullptr;

void on_fault(int sig, siginfo_t* info, void*) {
    if (g_L && g_L->cur) {
        g_fault_addr = info->si_addr;
        g_fault_signal = sig;
        g_fault_fiber = g_L->cur;
        siglongjmp(g_fault_jmp, 1);
    }
    signal(sig, SIG_DFL);  // not ours: let the default action (or the re-raise) happen
}

struct FaultGuard {
    struct sigaction old_segv {}, old_bus {};
    stack_t old_alt{};
    void* alt = nullptr;
    FaultGuard() {
        alt = std::malloc(kAltStackBytes);
        stack_t ss{};
        ss.ss_sp = alt;
        ss.ss_size = kAltStackBytes;
        sigaltstack(&ss, &old_alt);
        struct sigaction sa {};
        sa.sa_sigaction = &on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &old_segv);
        sigaction(SIGBUS, &sa, &old_bus);
    }
    ~FaultGuard() {
        sigaction(SIGSEGV, &old_segv, nullptr);
        sigaction(SIGBUS, &old_bus, nullptr);
        sigaltstack(old_alt.ss_size ? &old_alt : nullptr, nullptr);
        if (!old_alt.ss_size) {
            stack_t off{};
            off.ss_flags = SS_DISABLE;
            sigaltstack(&off, nullptr);
        }
        std::free(alt);
    }
};
#endif

void run_grid(const unsigned* grid) {
    Launch& L = *g_L;
    ++g_launch_serial;
    if (g_schedule_seed) {
        L.shuffled = true;
        L.warp_key.resize(L.warps.size());
        L.warp_ready.resize(L.warps.size());
        L.lane_key.resize(L.nthreads);
        g_schedule_state = g_schedule_seed ^ (g_launch_serial * 0xd1b54a32d192ed03ull);
        std::vector<uint3> blocks;
        blocks.reserve(std::size_t(grid[0]) * grid[1] * grid[2]);
        for (unsigned z = 0; z < grid[2]; ++z)
            for (unsigned y = 0; y < grid[1]; ++y)
                for (unsigned x = 0; x < grid[0]; ++x) blocks.push_back({x, y, z});
        shuffle(blocks);
        for (const uint3& b : blocks) {
            if (L.failed) break;
            g_launch.block_idx = b;
            run_block();
        }
        return;
    }
    for (unsigned z = 0; z < grid[2] && !L.failed; ++z)
        for (unsigned y = 0; y < grid[1] && !L.failed; ++y)
            for (unsigned x = 0; x < grid[0] && !L.failed; ++x) {
                g_launch.block_idx = {x, y, z};
                run_block();
            }
}

// Runs the grid; in plain builds a fault in kernel code ends it with an error.
void run_grid_guarded(const unsigned* grid) {
#if !defined(PAGEDRUN_SIM_ASAN) && !defined(PAGEDRUN_SIM_TSAN)
    FaultGuard guard;
    if (sigsetjmp(g_fault_jmp, 1) != 0) {
        Launch& L = *g_L;
        Fiber& f = *g_fault_fiber;
        L.cur = nullptr;
        L.failed = true;
        char buf[160];
        bool in_guard = false;
        auto* a = static_cast<unsigned char*>(g_fault_addr);
        if (a >= f.stack_lo - kGuardBytes && a < f.stack_lo) in_guard = true;
        std::snprintf(buf, sizeof buf, "%s at address %p%s",
                      g_fault_signal == SIGBUS ? "bus error" : "segmentation fault",
                      g_fault_addr, in_guard ? " (fiber stack overflow: per-thread arrays too big)" : "");
        L.error = std::string("kernel ") + L.name + ": " + thread_name(f) + ": " + buf;
        return;
    }
#endif
    run_grid(grid);
}

}  // namespace

void fail(const Loc& loc, const char* fmt, ...) {
    Launch& L = *g_L;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    L.failed = true;
    L.error = std::string("kernel ") + L.name + ": " + thread_name(*L.cur) + ": " + msg +
              " (at " + fmt_loc(loc) + ")";
    tsan_release(&L.tsan_block_end);  // the scheduler reads the message
    yield_to_scheduler(true);
    __builtin_unreachable();
}

void block_barrier(int kind, int pred, const Loc& loc) {
    Launch& L = *g_L;
    Fiber& f = *L.cur;
    if (L.block_arrived == 0) {
        L.block_kind = kind;
        L.block_acc = kind == 2 ? 1 : 0;
    } else if (L.block_kind != kind) {
        fail(loc, "block barrier mismatch: this thread is in a different __syncthreads variant "
                  "than threads already waiting");
    }
    if (kind == 1) L.block_acc += pred != 0;
    if (kind == 2) L.block_acc &= pred != 0;
    if (kind == 3) L.block_acc |= pred != 0;
    f.state = State::WaitBlock;
    f.site = loc;
    tsan_release(&L.tsan_barrier_token);
    if (++L.block_arrived == L.nthreads) {
        // Every thread must wait at the same __syncthreads: a barrier reached from two
        // different call sites is divergent control flow, undefined on hardware.
        for (auto& o : L.fibers) {
            if (o.site.line() != loc.line() ||
                (o.site.file_name() != loc.file_name() &&
                 std::strcmp(o.site.file_name(), loc.file_name()) != 0)) {
                fail(loc, "divergent __syncthreads: thread %u waits at %s while this thread "
                          "waits here",
                     o.ctx.linear, fmt_loc(o.site).c_str());
            }
        }
        L.block_arrived = 0;
        for (auto& o : L.fibers) {
            o.ctx.block_result = L.block_acc;
            if (&o != &f) wake(o);
        }
        f.state = State::Runnable;
        reschedule();
    } else {
        yield_to_scheduler(false);
    }
    tsan_acquire(&L.tsan_barrier_token);
}

uint32_t active_mask() {
    Launch& L = *g_L;
    Fiber& f = *L.cur;
    uint32_t m = 0;
    unsigned base = f.ctx.warp * kWarpSize;
    for (unsigned l = 0; l < kWarpSize && base + l < L.nthreads; ++l)
        if (L.fibers[base + l].state != State::Done) m |= 1u << l;
    return m;
}

void warp_collective(uint32_t mask, const char* what, void* lane_data, WarpFn fn, void* ctx,
                     const Loc& loc) {
    Launch& L = *g_L;
    Fiber& f = *L.cur;
    Warp& w = L.warps[f.ctx.warp];
    const uint32_t me = 1u << f.ctx.lane;
    if (!(mask & me))
        fail(loc, "%s with mask 0x%08x, which does not include the calling lane", what, mask);
    if (mask & ~w.exists)
        fail(loc,
             "%s with mask 0x%08x in a partial warp: warp %u has only lanes 0x%08x (block of "
             "%u threads); naming absent lanes is undefined on hardware",
             what, mask, f.ctx.warp, w.exists, L.nthreads);
    unsigned base = f.ctx.warp * kWarpSize;
    if (uint32_t gone = mask & w.exited)
        fail(loc, "%s with mask 0x%08x names lane %d, which has exited", what, mask,
             std::countr_zero(gone));
    // Every waiting lane whose operation overlaps this one must wait at the same operation
    // with the same mask. Lanes outside `mask` (usually none) are checked one by one: their
    // masks must not name this lane. Inside `mask` one waiting lane stands for all: once it
    // waits at this operation with this mask, every other waiting lane inside `mask` is inside
    // its mask, so overlaps it and (by this same check on arrival) waits at the same operation.
    // That keeps an arrival O(1) instead of O(lanes waiting): warp operations are most of the
    // harness's time.
    const uint32_t inside = w.arrived & mask;
    for (uint32_t pending = (w.arrived & ~mask) | (inside & (0u - inside)); pending;
         pending &= pending - 1) {
        unsigned l = unsigned(std::countr_zero(pending));
        const Fiber& o = L.fibers[base + l];
        bool overlaps = (mask & (1u << l)) || (o.mask & me);
        bool same = o.mask == mask && (o.what == what || std::strcmp(o.what, what) == 0);
        if (overlaps && !same)
            fail(loc,
                 "mismatched warp operations: this lane calls %s with mask 0x%08x while lane "
                 "%u waits at %s with mask 0x%08x (%s)",
                 what, mask, l, o.what, o.mask, fmt_loc(o.site).c_str());
    }
    f.state = State::WaitWarp;
    f.site = loc;
    f.what = what;
    f.mask = mask;
    w.data[f.ctx.lane] = lane_data;
    w.arrived |= me;
    tsan_release(&L.tsan_warp_token);
    if ((w.arrived & mask) == mask) {
        tsan_acquire(&L.tsan_warp_token);
        void* lanes[kWarpSize];
        for (unsigned l = 0; l < kWarpSize; ++l) lanes[l] = (mask >> l) & 1 ? w.data[l] : nullptr;
        fn(lanes, mask, ctx);
        w.arrived &= ~mask;
        for (unsigned l = 0; l < kWarpSize; ++l)
            if (mask & (1u << l)) wake(L.fibers[base + l]);
        tsan_release(&L.tsan_warp_token);
        reschedule();
    } else {
        yield_to_scheduler(false);
    }
    tsan_acquire(&L.tsan_warp_token);
}

void wait_until(WaitReady ready, void* ctx, const char* what, const Loc& loc) {
    Launch& L = *g_L;
    Fiber& f = *L.cur;
    const bool now = ready(ctx);  // read before the release: a scheduler that abandons
    tsan_release(&L.tsan_cond_token);  // this fiber after a deadlock acquires it
    if (!now) {
        f.state = State::WaitCond;
        f.ready = ready;
        f.ready_ctx = ctx;
        f.what = what;
        f.site = loc;
        yield_to_scheduler(false);
    }
    tsan_acquire(&L.tsan_cond_token);
}

uint64_t block_serial() { return g_block_serial; }

bool is_shared(const void* p, std::size_t bytes) {
    auto* c = static_cast<const unsigned char*>(p);
    if (c >= g_static_smem && c + bytes <= g_static_smem + g_static_smem_bytes) return true;
    return g_launch.dyn_smem && c >= g_launch.dyn_smem &&
           c + bytes <= g_launch.dyn_smem + g_launch.dyn_smem_bytes;
}

void cp_async(void* smem_dst, const void* gmem_src, int src_bytes, const Loc& loc) {
    Fiber& f = *g_L->cur;
    if (reinterpret_cast<uintptr_t>(smem_dst) % 16 != 0)
        fail(loc, "cp.async destination %p is not 16-byte aligned", smem_dst);
    if (!is_shared(smem_dst, 16))
        fail(loc, "cp.async destination %p is not in shared memory", smem_dst);
    if (src_bytes < 0 || src_bytes > 16)
        fail(loc, "cp.async src_bytes %d outside 0..16", src_bytes);
    if (src_bytes > 0 && reinterpret_cast<uintptr_t>(gmem_src) % 16 != 0)
        fail(loc, "cp.async source %p is not 16-byte aligned", gmem_src);
    PendingCopy pc;
    pc.dst = static_cast<unsigned char*>(smem_dst);
    std::memset(pc.data, 0, sizeof pc.data);
    if (src_bytes > 0) std::memcpy(pc.data, gmem_src, std::size_t(src_bytes));
    // Until the wait, the destination holds NaN: reading it early is a bug that shows.
    std::memset(pc.dst, kPoisonByte, 16);
    f.open_group.push_back(pc);
}

void cp_async_commit() {
    Fiber& f = *g_L->cur;
    f.committed.push_back(std::move(f.open_group));
    f.open_group.clear();
}

void cp_async_wait(int pending_groups_allowed) {
    Fiber& f = *g_L->cur;
    while (f.committed.size() > std::size_t(std::max(pending_groups_allowed, 0))) {
        for (const PendingCopy& pc : f.committed.front()) std::memcpy(pc.dst, pc.data, 16);
        f.committed.pop_front();
    }
}

int launch(const char* kernel_name, KernelBody body, void* fn, const unsigned* grid,
           const unsigned* block, std::size_t dyn_smem_bytes, void** args, char* err,
           std::size_t err_len) {
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    auto report = [&](const std::string& msg) {
        std::snprintf(err, err_len, "%s", msg.c_str());
        return 1;
    };
    unsigned nthreads = block[0] * block[1] * block[2];
    if (nthreads == 0 || nthreads > kMaxThreads)
        return report(std::string("kernel ") + kernel_name + ": block of " +
                      std::to_string(nthreads) + " threads (allowed 1.." +
                      std::to_string(kMaxThreads) + ")");
    if (block[2] > 64)
        return report(std::string("kernel ") + kernel_name + ": blockDim.z > 64");
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535)
        return report(std::string("kernel ") + kernel_name + ": invalid grid");
    if (dyn_smem_bytes > kMaxDynSmem)
        return report(std::string("kernel ") + kernel_name + ": " +
                      std::to_string(dyn_smem_bytes) + " bytes of dynamic shared memory (max " +
                      std::to_string(kMaxDynSmem) + ")");

    if (!locate_static_smem())
        return report(std::string("kernel ") + kernel_name +
                      ": cannot locate the module's static shared memory (PT_TLS segment)");

    Launch L;
    L.name = kernel_name;
    L.body = body;
    L.fn = fn;
    L.args = args;
    L.nthreads = nthreads;
    L.fibers.resize(nthreads);
    L.warps.resize((nthreads + kWarpSize - 1) / kWarpSize);
    ensure_stacks(nthreads);
    for (unsigned i = 0; i < nthreads; ++i) {
        Fiber& f = L.fibers[i];
        f.ctx.thread_idx = {i % block[0], (i / block[0]) % block[1], i / (block[0] * block[1])};
        f.ctx.linear = i;
        f.ctx.warp = i / kWarpSize;
        f.ctx.lane = i % kWarpSize;
        f.stack_lo = g_stacks + i * (kStackBytes + kGuardBytes) + kGuardBytes;
        L.warps[f.ctx.warp].exists |= 1u << f.ctx.lane;
#if defined(PAGEDRUN_SIM_TSAN)
        f.tsan_fiber = __tsan_create_fiber(0);
#endif
    }
#if defined(PAGEDRUN_SIM_TSAN)
    L.tsan_sched = __tsan_get_current_fiber();
#endif
    std::size_t smem_alloc = (dyn_smem_bytes + kSmemGuardBytes + kSmemAlign - 1) / kSmemAlign * kSmemAlign;
    auto* smem = static_cast<unsigned char*>(std::aligned_alloc(kSmemAlign, smem_alloc));
    std::memset(smem + dyn_smem_bytes, kGuardByte, kSmemGuardBytes);
#if defined(PAGEDRUN_SIM_ASAN)
    __asan_poison_memory_region(smem + dyn_smem_bytes, smem_alloc - dyn_smem_bytes);
#endif
    g_launch.grid_dim = dim3(grid[0], grid[1], grid[2]);
    g_launch.block_dim = dim3(block[0], block[1], block[2]);
    g_launch.dyn_smem = smem;
    g_launch.dyn_smem_bytes = dyn_smem_bytes;

    Launch* outer = g_L;
    g_L = &L;
    run_grid_guarded(grid);
    g_L = outer;
    g_thread = nullptr;

#if defined(PAGEDRUN_SIM_ASAN)
    __asan_unpoison_memory_region(smem + dyn_smem_bytes, smem_alloc - dyn_smem_bytes);
    if (L.failed)  // abandoned fibers leave poisoned frames behind on the reused stacks
        __asan_unpoison_memory_region(g_stacks, g_stacks_count * (kStackBytes + kGuardBytes));
#endif
#if defined(PAGEDRUN_SIM_TSAN)
    for (auto& f : L.fibers) __tsan_destroy_fiber(f.tsan_fiber);
#endif
    std::free(smem);
    g_launch.dyn_smem = nullptr;
    if (L.failed) return report(L.error);
    return 0;
}

}  // namespace pagedrun_sim

// Python (runtime/kernels/sim_module.py: Schedule) sets it in each loaded module's copy of
// this runtime before a launch; 0 restores index order. Setting it (even to the same value)
// restarts the launch count, so the launches that follow replay exactly.
extern "C" __attribute__((visibility("default"))) void pagedrun_sim_set_schedule_seed(
    unsigned long long seed) {
    pagedrun_sim::g_schedule_seed = seed;
    pagedrun_sim::g_launch_serial = 0;  // launches from here on replay under this seed
}
