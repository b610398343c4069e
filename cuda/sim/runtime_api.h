// runtime_api.h -- the interface between the harness headers (compiled into each kernel
// translation unit) and cuda/sim/runtime.cpp (the fiber scheduler, compiled once per
// sanitizer mode and linked into every kernel module).
//
// Everything here is hidden-visibility: each module .so carries its own scheduler state, and
// only the generated launch thunks (pagedrun_launch_<kernel>) are exported.
#pragma once
#include <cstddef>
#include <cstdint>
#include <source_location>

#define PAGEDRUN_SIM_HIDDEN __attribute__((visibility("hidden")))

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
};

namespace pagedrun_sim {

constexpr int kWarpSize = 32;

// What the header-side code of a CUDA thread may see about itself.
struct ThreadCtx {
    uint3 thread_idx;
    unsigned linear;  // x + y*bx + z*bx*by
    unsigned warp;
    unsigned lane;
    int block_result;  // result of __syncthreads_count/_and/_or, set at release
};

struct LaunchCtx {
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned char* dyn_smem;
    std::size_t dyn_smem_bytes;
};

PAGEDRUN_SIM_HIDDEN extern ThreadCtx* g_thread;
PAGEDRUN_SIM_HIDDEN extern LaunchCtx g_launch;

using Loc = std::source_location;

// Block-wide rendezvous. `kind`: 0 plain, 1 count, 2 and, 3 or (pred combined into
// ThreadCtx::block_result).
PAGEDRUN_SIM_HIDDEN void block_barrier(int kind, int pred, const Loc& loc);

// Warp rendezvous over exactly the lanes in `mask`. Every lane of the mask must call with
// the same mask and the same `what`; the last lane to arrive runs `fn` once with the
// per-lane data pointers (indexed by lane, nullptr outside the mask), then all continue.
using WarpFn = void (*)(void* const* lane_data, uint32_t mask, void* ctx);
PAGEDRUN_SIM_HIDDEN void warp_collective(uint32_t mask, const char* what, void* lane_data,
                                         WarpFn fn, void* ctx, const Loc& loc);
// Lanes of the current thread's warp that exist and have not exited.
PAGEDRUN_SIM_HIDDEN uint32_t active_mask();

// A kernel-side error: records the message with kernel, block and thread, abandons the
// launch and returns to Python as an exception. Never returns.
[[noreturn]] PAGEDRUN_SIM_HIDDEN void fail(const Loc& loc, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

// cp.async bookkeeping for the current thread (see cuda/ptx.cuh for the contract).
PAGEDRUN_SIM_HIDDEN void cp_async(void* smem_dst, const void* gmem_src, int src_bytes,
                                  const Loc& loc);
PAGEDRUN_SIM_HIDDEN void cp_async_commit();
PAGEDRUN_SIM_HIDDEN void cp_async_wait(int pending_groups_allowed);

// Blocks the calling thread until ready(ctx) is true (polled by the scheduler between fiber
// runs; returns at once when already true). A wait no thread can satisfy is reported as a
// deadlock naming `what` and the call site. Release/acquire for the sanitizers: data written
// before any thread's wait_until is visible after every later one returns (mbarrier twins).
using WaitReady = bool (*)(void* ctx);
PAGEDRUN_SIM_HIDDEN void wait_until(WaitReady ready, void* ctx, const char* what,
                                    const Loc& loc);
// A number that changes at the start of every block of every launch: header-side twin state
// (mbarrier transactions, warpgroup rendezvous) keyed by it resets itself per block.
PAGEDRUN_SIM_HIDDEN uint64_t block_serial();

// True if p lies in this launch's shared memory (static __shared__ or dynamic).
PAGEDRUN_SIM_HIDDEN bool is_shared(const void* p, std::size_t bytes);

// Runs one kernel launch: calls body(args) for every thread of every block.
using KernelBody = void (*)(void** args, void* fn);
PAGEDRUN_SIM_HIDDEN int launch(const char* kernel_name, KernelBody body, void* fn,
                               const unsigned* grid, const unsigned* block,
                               std::size_t dyn_smem_bytes, void** args, char* err,
                               std::size_t err_len);

}  // namespace pagedrun_sim
