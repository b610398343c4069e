// cpu_thread_pool.h -- the CPU kernels' helper thread: one per process, shared by every
// extension module that splits work in two (cpu_gemm's GEMM tiles, cpu_ops' decode attention,
// cpu_decode_step's GEMM halves and attention halves).
//
// run_pair(fn, ctx): fn(ctx, 0) on the calling thread while the helper runs fn(ctx, 1); returns
// when both are done. fn must not call run_pair itself (there is one helper: a nested call would
// wait for its own caller). Concurrent callers take turns (one pair at a time).
//
// Why polled: a decode step splits a GEMM every 20-200 us, and a condition variable's wake-up
// costs 10-50 us on a busy 2-core box: at M = 1 two threads were no faster than one (10.4 vs
// 10.8 GB/s). So the hand-off is a generation counter the helper polls, for at most
// HELPER_SPIN_US after its last job (then it sleeps on a condition variable, and the caller
// wakes it), and the caller polls for the helper's completion the same way; a half the helper
// has not claimed when the caller is done with its own, the caller runs too (measured: with the
// other core busy, waiting for a late helper turned 12 ms of decode GEMMs into 86). Measured on
// Zen 4 at M = 1: 2 threads 20-26 GB/s against one thread's 17-18. The spin is bounded: an idle
// server's helper sleeps.
//
// One instance per process. Every extension module is its own shared object, so a `static` in
// a header is one copy per module: that is how cpu_gemm and cpu_decode_step each came to run a
// polling helper (two spinning per process). The instance lives in one module,
// pagedrun.pyx.cpu_thread_pool (cpu_thread_pool.pyx: init_process_helper() at its import), which
// exports its run_pair through cpu_thread_pool.pxd; every kernel module cimports it and binds
// that pointer at import (bind_run_pair). The cimport is Cython's cross-module C API (a capsule
// in the owner's __pyx_capi__, its signature checked when the importing module loads), so no
// shared library, link step or rpath is needed, and the owner is imported before any call can
// run. The other modules' copies of g_process_helper stay null and never start a thread.
//
// Lifetime: the helper object is made at the owner's import, its thread on the first run_pair;
// neither is destroyed (a condvar must not be destroyed under its waiter at exit). A forked
// child gets a fresh helper (pthread_atfork), since fork copies no threads.
#pragma once

#include <pthread.h>
#include <stdint.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDRUN_THREAD_POOL_X86 1
#else
#define PAGEDRUN_THREAD_POOL_X86 0
#endif

namespace pagedrun_threads {

// Longer than the host work between two GEMMs of one step (norms, rotary, attention: ~20-100
// us at batch 1), far shorter than the gap between steps of an idle server.
constexpr long HELPER_SPIN_US = 300;
// The caller's wait for a helper that claimed its half: pause this many polls, then yield the
// core (the helper was preempted mid-job).
constexpr long CALLER_SPIN_POLLS = 4096;
// The helper reads the clock every this many polls (~2-4 us): cheap, and precise enough.
constexpr long POLLS_PER_CLOCK_READ = 64;
static_assert((POLLS_PER_CLOCK_READ & (POLLS_PER_CLOCK_READ - 1)) == 0, "a power of two");
// The helper's name in /proc/<pid>/task/*/comm (at most 15 characters).
constexpr const char* HELPER_THREAD_NAME = "pagedrun-helper";

static inline void cpu_relax() {
#if PAGEDRUN_THREAD_POOL_X86
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

// The calling thread's kernel id (Linux tid; 1 elsewhere, where tests do not look).
static inline long current_thread_id() {
#if defined(__linux__)
    return static_cast<long>(syscall(SYS_gettid));
#else
    return 1;
#endif
}

// One half of a split: part 0 runs on the caller, part 1 on the helper (or the caller).
using PartFn = void (*)(const void* ctx, int part);

class HelperThread {
  public:
    void run_pair(PartFn fn, const void* ctx) {
        std::lock_guard<std::mutex> serial(call_mu_);  // one pair at a time
        if (!started_) {
            std::thread helper(&HelperThread::loop, this);
#if defined(__linux__)
            // Named by the creator, so the name is there once the first run_pair returns.
            pthread_setname_np(helper.native_handle(), HELPER_THREAD_NAME);
#endif
            helper.detach();
            // Once per process: wait for the thread to report its id (thread_id() is then
            // never 0 after a run_pair), a few microseconds.
            while (thread_id_.load(std::memory_order_acquire) == 0) std::this_thread::yield();
            started_ = true;
        }
        fn_ = fn;  // published by the seq_cst store of generation_; read only by a claimant
        ctx_ = ctx;
        const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
        // seq_cst store then seq_cst load, against the helper's sleeping_ store then
        // generation_ load: one of the two sides sees the other's store, so either the helper
        // sees the job before it sleeps or this side sees it asleep and wakes it.
        generation_.store(generation, std::memory_order_seq_cst);
        if (sleeping_.load(std::memory_order_seq_cst)) {
            std::lock_guard<std::mutex> lock(mu_);
            wake_cv_.notify_one();
        }
        fn(ctx, 0);
        uint64_t unclaimed = generation - 1;
        if (claimed_.compare_exchange_strong(unclaimed, generation, std::memory_order_acq_rel)) {
            fn(ctx, 1);  // the helper will see the claim taken and skip it
            return;
        }
        // The helper claimed it and is running it: poll, then yield the core if it is late.
        for (long spins = 0; done_.load(std::memory_order_acquire) != generation; ++spins) {
            if (spins < CALLER_SPIN_POLLS) cpu_relax();
            else std::this_thread::yield();
        }
    }

    // The helper's kernel thread id (Linux tid), 0 before the first run_pair.
    long thread_id() const { return thread_id_.load(std::memory_order_acquire); }

  private:
    void loop() {
        thread_id_.store(current_thread_id(), std::memory_order_release);
        uint64_t seen = 0;
        for (;;) {
            const auto idle_since = std::chrono::steady_clock::now();
            long polls = 0;
            while (generation_.load(std::memory_order_acquire) == seen) {
                cpu_relax();
                if ((++polls & (POLLS_PER_CLOCK_READ - 1)) == 0 &&
                    std::chrono::steady_clock::now() - idle_since >
                        std::chrono::microseconds(HELPER_SPIN_US)) {
                    std::unique_lock<std::mutex> lock(mu_);
                    sleeping_.store(true, std::memory_order_seq_cst);
                    wake_cv_.wait(lock, [this, seen] {
                        return generation_.load(std::memory_order_seq_cst) != seen;
                    });
                    sleeping_.store(false, std::memory_order_relaxed);
                    break;
                }
            }
            seen = generation_.load(std::memory_order_acquire);
            // Claim job `seen`: fails when the caller took it (and may already have published
            // the next job: fn_ / ctx_ must then not be read).
            uint64_t unclaimed = seen - 1;
            if (!claimed_.compare_exchange_strong(unclaimed, seen, std::memory_order_acq_rel))
                continue;
            fn_(ctx_, 1);
            done_.store(seen, std::memory_order_release);
        }
    }

    std::mutex call_mu_, mu_;
    std::condition_variable wake_cv_;
    PartFn fn_ = nullptr;
    const void* ctx_ = nullptr;
    // generation_: the last job published; claimed_: the last job claimed (by the helper or
    // the caller), generation_ - 1 while the current one is unclaimed; done_: the last job the
    // helper finished.
    std::atomic<uint64_t> generation_{0}, claimed_{0}, done_{0};
    std::atomic<bool> sleeping_{false};
    std::atomic<long> thread_id_{0};
    bool started_ = false;  // under call_mu_
};

// ---- the owner's side: only pagedrun.pyx.cpu_thread_pool calls these ------------------------
static HelperThread* g_process_helper = nullptr;

// The old helper is leaked, as at exit: its thread did not survive the fork.
static void fresh_helper_in_child() { g_process_helper = new HelperThread(); }

// Once, at the owner's import (under the GIL): no two callers race to create it.
static inline void init_process_helper() {
    if (g_process_helper != nullptr) return;
    g_process_helper = new HelperThread();
    pthread_atfork(nullptr, nullptr, fresh_helper_in_child);
}

static inline void process_helper_run_pair(PartFn fn, const void* ctx) {
    g_process_helper->run_pair(fn, ctx);
}

static inline long process_helper_thread_id() { return g_process_helper->thread_id(); }

// ---- every kernel module's side -------------------------------------------------------------
// The owner's run_pair, as this module bound it at import (cpu_thread_pool.pxd's run_pair).
using RunPairFn = void (*)(PartFn fn, const void* ctx);
static RunPairFn g_run_pair = nullptr;

static inline void bind_run_pair(RunPairFn owner_run_pair) { g_run_pair = owner_run_pair; }

// The address this module calls (tests compare it across modules: one pool per process).
static inline uintptr_t bound_run_pair_address() {
    return reinterpret_cast<uintptr_t>(g_run_pair);
}

static inline void run_pair(PartFn fn, const void* ctx) { g_run_pair(fn, ctx); }

// ---- a diagnostic of the binding (tests/pyx/test_cpu_thread_pool.py) -----------------------
// Which threads run the two parts of one run_pair through this module's binding. Part 0 (the
// caller) waits until part 1 has run, so part 1 cannot fall back to the caller: it runs on
// the helper, unless the helper takes longer than PROBE_WAIT_MS to claim it.
constexpr long PROBE_WAIT_MS = 2000;

struct PairProbe {
    std::atomic<long> thread_ids[2];
};

static void probe_part(const void* ctx, int part) {
    PairProbe* probe = const_cast<PairProbe*>(static_cast<const PairProbe*>(ctx));
    probe->thread_ids[part].store(current_thread_id(), std::memory_order_release);
    if (part != 0) return;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(PROBE_WAIT_MS);
    while (probe->thread_ids[1].load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
}

// thread_ids[0]: the caller's id, thread_ids[1]: the id of the thread that ran part 1.
static inline void probe_run_pair(long* thread_ids) {
    PairProbe probe;
    probe.thread_ids[0].store(0);
    probe.thread_ids[1].store(0);
    run_pair(probe_part, &probe);
    thread_ids[0] = probe.thread_ids[0].load();
    thread_ids[1] = probe.thread_ids[1].load();
}

}  // namespace pagedrun_threads
