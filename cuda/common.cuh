// common.cuh -- the prelude every cuda/*.cu kernel file includes first.
//
// One source, three compilers:
//   * nvcc / NVRTC (the path CuPy takes): pulls in cuda_fp16.h / cuda_bf16.h and defines
//     DYNAMIC_SMEM on top of `extern __shared__`.
//   * g++ under the CPU harness (PAGEDRUN_SIM defined by runtime/kernels/sim_module.py):
//     includes cuda/sim/sim.cuh, which supplies the qualifiers, built-in indices, warp
//     intrinsics, atomics, half/bfloat16 and its own DYNAMIC_SMEM.
//
// DYNAMIC_SMEM(type, name) declares `type* name` pointing at the launch's dynamic shared
// memory (16-byte aligned on every path; the harness aligns to 128). Plain
// `extern __shared__ T x[];` cannot compile on the host, so kernels use this macro instead.
// The rules a kernel source must follow to run under the harness are in docs/kernels.md.
#pragma once

#if defined(PAGEDRUN_SIM)
#include "sim/sim.cuh"
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>  // CUDART_INF_F, CUDART_NAN_F: use these, not INFINITY/NAN
#if defined(__CUDACC_RTC__)
// NVRTC ships no <cstdint>; the fixed-width types kernels and ptx.cuh use.
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <cstdint>
#endif
#define PAGEDRUN_DYN_SMEM_ALIGN 16
#define DYNAMIC_SMEM(type, name)                                                   \
    extern __shared__ __align__(PAGEDRUN_DYN_SMEM_ALIGN) unsigned char             \
        pagedrun_dynamic_smem_[];                                                  \
    type* name = reinterpret_cast<type*>(pagedrun_dynamic_smem_)
#endif

// to_f32 / from_f32<T>: the element-type conversions (one copy for every kernel).
#include "dtype.cuh"
