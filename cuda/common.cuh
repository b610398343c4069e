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
#if !defined(__CUDACC_RTC__)
#include <cstdint>
#endif
// NVRTC has no <cstdint> unless the toolkit headers are on its -I path; cuda_fp16.h brings
// the fixed-width types in both cases.
#define PAGEDRUN_DYN_SMEM_ALIGN 16
#define DYNAMIC_SMEM(type, name)                                                   \
    extern __shared__ __align__(PAGEDRUN_DYN_SMEM_ALIGN) unsigned char             \
        pagedrun_dynamic_smem_[];                                                  \
    type* name = reinterpret_cast<type*>(pagedrun_dynamic_smem_)
#endif
