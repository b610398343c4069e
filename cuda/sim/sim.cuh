// sim.cuh -- lets an unchanged cuda/*.cu file compile with g++ -std=c++20 for the CPU
// harness. Included by cuda/common.cuh when PAGEDRUN_SIM is defined; never include directly.
//
// Execution model (cuda/sim/runtime.cpp): blocks run one at a time; each CUDA thread is a
// fiber; __syncthreads and warp intrinsics are rendezvous that switch fibers. Consequences
// the headers rely on:
//   * __shared__ is static (thread_local) storage, filled with 0xFF bytes (NaN
//     in f32/f16/bf16, -1 in integers) before every block, so reading shared memory that
//     the block never wrote shows up as NaN.
//   * threadIdx/blockIdx/blockDim/gridDim read the scheduler's current thread and block.
#pragma once
#ifndef PAGEDRUN_SIM
#error "sim.cuh is the CPU harness prelude; include common.cuh instead"
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include "runtime_api.h"

// ---- qualifiers -------------------------------------------------------------------------
#ifdef PAGEDRUN_SIM_SCAN
// Only for the kernel scan (g++ -E): marks kernel definitions and their launch bounds in the
// preprocessed text (runtime/kernels/sim_module.py turns the bounds into a launch check).
#define __global__ PAGEDRUN_KERNEL_MARK
#define __launch_bounds__(...) PAGEDRUN_BOUNDS_BEGIN __VA_ARGS__ PAGEDRUN_BOUNDS_END
#else
#define __global__
#define __launch_bounds__(...)
#endif
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
// A kernel parameter the GPU keeps constant for the launch (TMA descriptors by value); the
// harness's parameters are plain copies, so it has no meaning here.
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
// thread_local, not a named section: GCC ignores section attributes on statics of template
// instances. runtime.cpp finds the module's TLS segment and poisons it before each block.
#define __shared__ static thread_local
#define __CUDA_ARCH_SIM__ 1

#define threadIdx (::pagedrun_sim::g_thread->thread_idx)
#define blockIdx (::pagedrun_sim::g_launch.block_idx)
#define blockDim (::pagedrun_sim::g_launch.block_dim)
#define gridDim (::pagedrun_sim::g_launch.grid_dim)
constexpr int warpSize = ::pagedrun_sim::kWarpSize;

#define PAGEDRUN_DYN_SMEM_ALIGN 128
#define DYNAMIC_SMEM(type, name) \
    type* name = reinterpret_cast<type*>(::pagedrun_sim::g_launch.dyn_smem)

#include "vector_types.cuh"
#include "fp16.cuh"
#include "intrinsics.cuh"
