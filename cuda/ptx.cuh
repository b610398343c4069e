// ptx.cuh -- the inline PTX (`asm`) of the shipped kernels: mma.sync, ldmatrix, cp.async
// (sm_80 and later). The only other file in cuda/ with `asm` is hopper_groundwork.cuh
// (sm_90a wgmma / TMA / mbarrier: groundwork, no shipped kernel includes it yet).
//
// Each instruction sits in one small __device__ __forceinline__ function. On nvcc / NVRTC the
// function is the instruction. Under the CPU harness (PAGEDRUN_SIM) the same function is a
// "twin" in cuda/sim/twins.cuh that performs the instruction at warp level, following the
// PTX ISA fragment layouts, so kernels using these calls run unchanged on the host.
// tests/sim/test_twins.py checks each twin against a scalar reference on random fragments;
// tests/gpu/test_ptx_twins.py checks each twin against the real instruction.
//
// Contract (names and signatures are relied on by the kernel files; keep them):
//   mma_m16n8k16_bf16(d[4] f32, a[4] b32 = 8 bf16, b[2] b32 = 4 bf16, c[4] f32)
//   mma_m16n8k16_f16 (same, f16 inputs)      row.col, fp32 accumulate: D = A(16x16) B(16x8) + C
//     lane l, g = l/4, t = l%4:
//       a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..]  a[3] = A[g+8][2t+8..]
//       b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//       c/d[0..1] = C[g][2t..2t+1]   c/d[2..3] = C[g+8][2t..2t+1]
//     (the lower-indexed element is in the low 16 bits of each b32)
//   mma_m16n8k16_acc<T>(d, a, b): d += A B with the instruction for element type T
//     (__half or __nv_bfloat16), for kernels templated on T; no PTX of its own.
//   ldmatrix_x{1,2,4}[_trans](r, smem): m8n8 b16 matrices; matrix i's 8 row addresses come from
//     lanes 8i..8i+7 (each row 16 bytes, 16-byte aligned, in shared memory); lane l receives
//     r[i] = M_i[l/4][2(l%4)..+1] (trans: M_i[2(l%4)..+1][l/4]).
//   cp_async_16(smem_dst, gmem_src), cp_async_16_zfill(smem_dst, gmem_src, src_bytes 0..16):
//     16-byte asynchronous copy, both addresses 16-byte aligned; zfill reads src_bytes and
//     writes zeros for the rest. cp_async_commit() closes a group; cp_async_wait<N>() waits
//     until at most N committed groups are pending; cp_async_wait_all() waits for everything.
//     The harness twin poisons the destination with NaN at issue and writes it only at the
//     wait, so a pipeline that waits one group too few reads NaN every time.
//
// Included by gemm.cu and paged_attention_prefill.cu (and by cuda/hopper_groundwork.cuh).
#pragma once
#include "common.cuh"

#if defined(PAGEDRUN_SIM)
#include "sim/twins.cuh"
#else

__device__ __forceinline__ uint32_t pagedrun_smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void ldmatrix_x1(uint32_t (&r)[1], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(pagedrun_smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(pagedrun_smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pagedrun_smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t (&r)[1], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(pagedrun_smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(pagedrun_smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pagedrun_smem_addr(smem)));
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"(pagedrun_smem_addr(smem_dst)), "l"(gmem_src) : "memory");
}
// src_bytes in 0..16; bytes src_bytes..15 of the destination are written as zero.
__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src,
                                                  int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(pagedrun_smem_addr(smem_dst)), "l"(gmem_src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

#endif  // PAGEDRUN_SIM

// Element-type dispatch over the two m16n8k16 instructions above (their twins under the
// harness), accumulating in place: what a kernel templated on T calls.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16_acc(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void mma_m16n8k16_acc<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
    mma_m16n8k16_f16(d, a, b, d);
}
template <>
__device__ __forceinline__ void mma_m16n8k16_acc<__nv_bfloat16>(float (&d)[4],
                                                                const uint32_t (&a)[4],
                                                                const uint32_t (&b)[2]) {
    mma_m16n8k16_bf16(d, a, b, d);
}
