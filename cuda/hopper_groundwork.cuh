// hopper_groundwork.cuh -- the sm_90a building blocks (mbarrier, TMA tensor loads, wgmma,
// setmaxnreg) with host twins in cuda/sim/hopper.cuh. Used by cuda/gemm_hopper.cu (the Hopper
// GEMM: TMA -> 4-stage mbarrier ring -> wgmma m64n256k16, warp-specialized) and by the probe
// kernels of tests/sim/test_hopper_twins.py (tests/sim/kernels/hopper_probes.cu,
// hopper_unguarded.cu) and tests/gpu/test_ptx_twins.py. Host side: runtime/kernels/tma.py
// builds the TMA descriptors. Nothing here has run on a GPU yet: the fragment layout and the
// descriptor / swizzle model are checked against the PTX ISA description and the twins only.
//
// Include it after common.cuh (it includes ptx.cuh itself). The compile gates
// (scripts/compile_gates.py) build a file naming wgmma*, mbarrier*, setmaxnreg or tma_* for
// sm_90a instead of sm_90; tests/sim/test_hopper_twins.py checks that among cuda/*.cu only
// gemm_hopper.cu does.
//
// The Hopper-only instructions (sm_90a) sit behind tile-level functions; their harness twins
// (cuda/sim/hopper.cuh) work on the logical tile. Available where PAGEDRUN_HAS_HOPPER is 1
// (nvcc/NVRTC for sm_90a, and the harness); on any other arch a call is a compile error
// (static_assert naming sm_90a). Guard Hopper kernel bodies with `#if PAGEDRUN_HAS_HOPPER`.
//   mbarrier_init(bar, arrive_count): bar is a uint64_t in shared memory (8-byte aligned);
//     call from one thread, then __syncthreads before anyone else uses it.
//   mbarrier_arrive(bar), mbarrier_arrive_expect_tx(bar, tx_bytes): one arrival (the second
//     first adds tx_bytes to the transaction bytes the current phase waits for). A phase
//     completes when all arrive_count arrivals came and its transaction bytes completed.
//   mbarrier_try_wait_parity(bar, phase) -> bool, mbarrier_wait_parity(bar, phase): has the
//     phase with parity `phase` (0/1) completed; the wait spins until it has.
//   tma_load_2d(smem_dst, desc, coord_inner, coord_outer, bar): one thread copies the box
//     [coord_outer.., coord_inner..] of a 2-D row-major tensor into smem_dst (row after row,
//     swizzled as the descriptor says; out-of-bounds elements are zero) and completes the
//     box's bytes on bar. smem_dst 128-byte aligned (1024 with a swizzle). desc: the address
//     of a `const __grid_constant__ TmaDescriptor` kernel parameter built on the host by
//     pagedrun.runtime.kernels.tma (a CUtensorMap on the GPU). Why a parameter: it is
//     constant for the whole launch, so TMA may read it with no fence, and no per-call upload
//     exists for a CUDA graph to lose. A map in global memory would need
//     `fence.proxy.tensormap::generic.acquire` (CUDA programming guide, TMA) before its first
//     use in every launch; no kernel here keeps one there.
//   make_smem_desc(smem, swizzle, leading_byte_offset, stride_byte_offset) -> uint64_t: the
//     wgmma shared-memory matrix descriptor of a K-major 16-bit operand starting at smem.
//     swizzle: kSmemSwizzleNone (core matrices of 8 rows x 16 bytes; LBO = bytes between
//     core matrices adjacent in K, SBO = between core matrices adjacent in M/N) or
//     kSmemSwizzle128B/64B/32B (8-row atoms of rows of that many bytes, 16-byte chunks
//     XOR-swizzled by address bits 7..9; SBO = bytes between 8-row atoms; LBO unused).
//   wgmma_m64n{64,128,256}k16_{bf16,f16}(d, desc_a, desc_b, scale_d): warpgroup (128 threads,
//     warps 4g..4g+3) D[64,N] = A[64,16] * B[16,N] + (scale_d ? D : 0), f32 accumulate, A and
//     B K-major in shared memory (B given as N rows of 16 K values). Thread t of the group,
//     w = t/32, g = (t%32)/4, q = t%4, holds for n-block i = 0..N/8-1:
//       d[4i+0..1] = D[16w+g][8i+2q..+1]   d[4i+2..3] = D[16w+g+8][8i+2q..+1]
//   wgmma_fence() before the first wgmma that reads registers written otherwise;
//   wgmma_commit_group() closes a group; wgmma_wait_group<N>() waits until <= N groups pend.
//     The accumulators (and the shared-memory operands) of a wgmma belong to it until the
//     wait that retires its group: read d, or let TMA refill its operands, only after it.
//   warpgroup_reg_dealloc<R>() / warpgroup_reg_alloc<R>(): setmaxnreg.dec / .inc, the
//     warpgroup's registers per thread become R (24..256, multiple of 8).
//   fence_proxy_async(): makes generic-proxy shared-memory writes visible to wgmma/TMA.
#pragma once
#include "ptx.cuh"  // common.cuh, pagedrun_smem_addr, and the sm_80 twins under the harness

// Swizzle codes of the wgmma shared-memory descriptor (bits 62..63).
constexpr int kSmemSwizzleNone = 0;
constexpr int kSmemSwizzle128B = 1;
constexpr int kSmemSwizzle64B = 2;
constexpr int kSmemSwizzle32B = 3;

#if defined(PAGEDRUN_SIM) || \
    (defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define PAGEDRUN_HAS_HOPPER 1
#else
#define PAGEDRUN_HAS_HOPPER 0
#endif

#if defined(PAGEDRUN_SIM)
#include "sim/hopper.cuh"  // mbarrier, TMA, wgmma twins
#else

// The tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned) built on the host by
// pagedrun.runtime.kernels.tma.cuda_descriptor; kernels take it by value as a
// `const __grid_constant__ TmaDescriptor` parameter (PTX: .param .align 64 .b8 [128]).
struct __align__(64) TmaDescriptor {
    uint64_t opaque[16];
};

// Descriptor fields (PTX ISA, wgmma matrix descriptor): bits 0..13 start address >> 4,
// 16..29 leading byte offset >> 4, 32..45 stride byte offset >> 4, 49..51 base offset (0:
// operands start on a swizzle-pattern boundary or at an offset inside a 128-byte row),
// 62..63 swizzle code.
__device__ __forceinline__ uint64_t make_smem_desc(const void* smem, int swizzle,
                                                   uint32_t leading_byte_offset,
                                                   uint32_t stride_byte_offset) {
    uint64_t addr = pagedrun_smem_addr(smem);
    return ((addr & 0x3FFFF) >> 4) | (uint64_t((leading_byte_offset >> 4) & 0x3FFF) << 16) |
           (uint64_t((stride_byte_offset >> 4) & 0x3FFF) << 32) |
           (uint64_t(swizzle & 3) << 62);
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n"
                 :: "r"(pagedrun_smem_addr(bar)), "r"(arrive_count) : "memory");
    // Makes the initialised barrier visible to the async proxy (TMA) and other threads.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, int tx_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(pagedrun_smem_addr(bar)), "r"(tx_bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n"
                 :: "r"(pagedrun_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, int phase) {
    uint32_t done;
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(pagedrun_smem_addr(bar)), "r"(phase) : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, int phase) {
    while (!mbarrier_try_wait_parity(bar, phase)) {
    }
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const TmaDescriptor* desc,
                                            int coord_inner, int coord_outer, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3}], [%4];\n"
        :: "r"(pagedrun_smem_addr(smem_dst)), "l"(desc), "r"(coord_inner), "r"(coord_outer),
           "r"(pagedrun_smem_addr(bar))
        : "memory");
}

__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// The wgmma wrappers, one per (N, type), generated by PAGEDRUN_WGMMA: the accumulator operands
// "+f"(d[0..N/2)) are %0..%(N/2 - 1), then desc_a, desc_b, and scale_d as the predicate.
#define PAGEDRUN_WGMMA_REGS32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PAGEDRUN_WGMMA_REGS64 PAGEDRUN_WGMMA_REGS32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PAGEDRUN_WGMMA_REGS128 PAGEDRUN_WGMMA_REGS64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define PAGEDRUN_WGMMA_D8(i) \
    "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), \
    "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define PAGEDRUN_WGMMA_D32(i) PAGEDRUN_WGMMA_D8(i), PAGEDRUN_WGMMA_D8((i) + 8), \
    PAGEDRUN_WGMMA_D8((i) + 16), PAGEDRUN_WGMMA_D8((i) + 24)
#define PAGEDRUN_WGMMA(N, TYPE, REGS, DESC_A, DESC_B, PRED, ...)                                   \
    __device__ __forceinline__ void wgmma_m64n##N##k16_##TYPE(float (&d)[(N) / 2],               \
                                                             uint64_t desc_a, uint64_t desc_b,  \
                                                             int scale_d) {                     \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #PRED ", 0;\n"                         \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TYPE "." #TYPE " {" REGS \
                     "}, %" #DESC_A ", %" #DESC_B ", p, 1, 1, 0, 0;\n}\n"                        \
                     : __VA_ARGS__                                                               \
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                  \
    }

PAGEDRUN_WGMMA(64, bf16, PAGEDRUN_WGMMA_REGS32, 32, 33, 34, PAGEDRUN_WGMMA_D32(0))
PAGEDRUN_WGMMA(64, f16, PAGEDRUN_WGMMA_REGS32, 32, 33, 34, PAGEDRUN_WGMMA_D32(0))
PAGEDRUN_WGMMA(128, bf16, PAGEDRUN_WGMMA_REGS64, 64, 65, 66, PAGEDRUN_WGMMA_D32(0),
               PAGEDRUN_WGMMA_D32(32))
PAGEDRUN_WGMMA(128, f16, PAGEDRUN_WGMMA_REGS64, 64, 65, 66, PAGEDRUN_WGMMA_D32(0),
               PAGEDRUN_WGMMA_D32(32))
PAGEDRUN_WGMMA(256, bf16, PAGEDRUN_WGMMA_REGS128, 128, 129, 130, PAGEDRUN_WGMMA_D32(0),
               PAGEDRUN_WGMMA_D32(32), PAGEDRUN_WGMMA_D32(64), PAGEDRUN_WGMMA_D32(96))
PAGEDRUN_WGMMA(256, f16, PAGEDRUN_WGMMA_REGS128, 128, 129, 130, PAGEDRUN_WGMMA_D32(0),
               PAGEDRUN_WGMMA_D32(32), PAGEDRUN_WGMMA_D32(64), PAGEDRUN_WGMMA_D32(96))

// setmaxnreg: a warpgroup-wide change of the registers per thread (24..256, a multiple of 8).
// A producer warpgroup that only issues TMA gives registers back (dealloc) so the consumer
// warpgroups that hold the wgmma accumulators can take them (alloc); the sum over the CTA's
// warpgroups must stay within the register file the launch reserved.
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, x8");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, x8");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegs));
}

#else  // not sm_90a: every Hopper call is a compile error naming the target it needs

template <class T>
struct pagedrun_needs_sm90a { static constexpr bool value = false; };
#if defined(__CUDA_ARCH__)
#define PAGEDRUN_HOPPER_ONLY(T)                                                          \
    static_assert(pagedrun_needs_sm90a<T>::value,                                          \
                  "Hopper-only instruction (wgmma / TMA / mbarrier): compile for sm_90a "  \
                  "and guard the kernel body with #if PAGEDRUN_HAS_HOPPER")
#else
#define PAGEDRUN_HOPPER_ONLY(T)  // nvcc's host pass never runs device code
#endif
template <class T = void>
__device__ void mbarrier_init(uint64_t*, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void mbarrier_arrive_expect_tx(uint64_t*, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void mbarrier_arrive(uint64_t*) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ bool mbarrier_try_wait_parity(uint64_t*, int) { PAGEDRUN_HOPPER_ONLY(T); return false; }
template <class T = void>
__device__ void mbarrier_wait_parity(uint64_t*, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void tma_load_2d(void*, const TmaDescriptor*, int, int, uint64_t*) {
    PAGEDRUN_HOPPER_ONLY(T);
}
template <class T = void>
__device__ void fence_proxy_async() { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void wgmma_fence() { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void wgmma_commit_group() { PAGEDRUN_HOPPER_ONLY(T); }
template <int N>
struct pagedrun_wait_group_tag {};
template <int N>
__device__ void wgmma_wait_group() { PAGEDRUN_HOPPER_ONLY(pagedrun_wait_group_tag<N>); }
template <class T = void>
__device__ void wgmma_m64n64k16_bf16(float (&)[32], uint64_t, uint64_t, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void wgmma_m64n64k16_f16(float (&)[32], uint64_t, uint64_t, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void wgmma_m64n128k16_bf16(float (&)[64], uint64_t, uint64_t, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void wgmma_m64n128k16_f16(float (&)[64], uint64_t, uint64_t, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void wgmma_m64n256k16_bf16(float (&)[128], uint64_t, uint64_t, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <class T = void>
__device__ void wgmma_m64n256k16_f16(float (&)[128], uint64_t, uint64_t, int) { PAGEDRUN_HOPPER_ONLY(T); }
template <int N>
struct pagedrun_setmaxnreg_tag {};
template <int kRegs>
__device__ void warpgroup_reg_dealloc() { PAGEDRUN_HOPPER_ONLY(pagedrun_setmaxnreg_tag<kRegs>); }
template <int kRegs>
__device__ void warpgroup_reg_alloc() { PAGEDRUN_HOPPER_ONLY(pagedrun_setmaxnreg_tag<kRegs>); }
#undef PAGEDRUN_HOPPER_ONLY

#endif  // sm_90a

#endif  // PAGEDRUN_SIM
