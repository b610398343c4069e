// gemm_hopper.cu -- Hopper (sm_90a) GEMM for prefill-sized M: TMA tile loads into 128B-swizzled
// shared memory, a 4-stage mbarrier pipeline, one producer warpgroup issuing TMA and two
// consumer warpgroups issuing wgmma m64n256k16 with fp32 accumulators, and the fused epilogue
// of cuda/gemm.cu (bias, residual). Built from cuda/hopper_groundwork.cuh.
//
// Computes, for every row m < M and column n < N:
//   out[m, n] = sum_k a[m, k] * b[n, k]  (+ bias[n] if bias != nullptr)
//                                        (+ residual[m, n] if residual != nullptr)
// products exact, sums in fp32, one rounding to the output type at the end.
//
// Pointers (T = __half | __nv_bfloat16, OutT = T or float per instantiation):
//   desc_a    TmaDescriptor of a [M, K] T, row-major     box 128 rows x 64 K, 128B swizzle
//   desc_b    TmaDescriptor of b [N, K] T, row-major     box 256 rows x 64 K, 128B swizzle
//             ("nk": the HF nn.Linear weight; K-major B is the operand wgmma reads)
//             Both by value: `const __grid_constant__` kernel parameters (128 bytes each,
//             64-byte aligned in the parameter space: .param .align 64 .b8 [128]).
//   bias      [N]      T    or nullptr
//   residual  [M, N]   OutT or nullptr (may alias out: each element is read before it is written,
//                      by the thread that writes it)
//   out       [M, N]   OutT, contiguous
// The descriptors (built on the host by runtime/kernels/gemm_hopper.py through
// runtime/kernels/tma.py) travel in the launch's parameters, as the CUDA programming guide
// recommends: TMA reads them through the parameter's generic address, nothing is uploaded per
// call, and a captured CUDA graph keeps them in its kernel node. A map in global memory would
// instead need `fence.proxy.tensormap::generic.acquire` before its first use in every launch
// (a TMA could read a stale map) and a device buffer per call, which kept this GEMM out of graph
// capture. TMA needs 16-byte row strides and bases: K % 8 == 0, a and b 16-byte aligned. Rows and K values past the matrix arrive as zeros (TMA out-of-bounds fill), so
// partial tiles in M, N and K need no masking in the main loop; the epilogue masks rows and
// columns.
//
// CTA tile 128 x 256 x 64, 384 threads = 3 warpgroups:
//   warpgroup 0 (producer): setmaxnreg down to 40; thread 0 waits on empty[s], arms full[s]
//     with the stage's 48 KiB and issues the two TMA boxes of k-tile kt into stage s = kt % 4.
//   warpgroups 1, 2 (consumers): setmaxnreg up to 232; consumer c owns rows 64c..64c+63 of the
//     tile: per k-tile it waits on full[s], issues 4 wgmma m64n256k16 (k16 steps inside the
//     128-byte swizzled rows: descriptor start + 32 bytes each), commits, waits until at most
//     one group is pending (wgmma_wait_group<1>: k-tile kt-1's wgmmas have read their stage)
//     and releases stage (kt-1) % 4 with one arrival on empty (count 2: both consumers).
//   Why this tile: smem per stage (128 + 256) x 64 x 2 = 48 KiB, 4 stages = 192 KiB + 1 KiB
//     alignment of the 227 KiB a CTA may have, 1 CTA/SM. Per k a 128 x 256 tile reads
//     (128 + 256) x 2 bytes for 2 x 128 x 256 FLOPs: 85 FLOP per byte of shared memory and L2
//     traffic (128 x 128: 64), and its m64n256 wgmma reads A once per 256 columns.
//     Registers: 128 fp32 accumulators per consumer thread (64 x 256 /
//     128 threads) + descriptors, addresses and the epilogue fit in 232; the producer needs few,
//     and 128 x 40 + 256 x 232 = 64,512 <= the 65,536-register file at 384 threads.
// Tile order: 1-D grid of ceil(M / 128) * ceil(N / 256) CTAs, grouped by kGroupM m-blocks (each
// group sweeps N with kGroupM m-blocks in flight), so one wave of 132 CTAs reads about 8 A
// row-blocks and 17 B row-blocks from HBM and the rest from L2.
// Epilogue: accumulators straight from registers (fragment layout in hopper_groundwork.cuh),
// 2-element stores where N is even; no shared-memory staging (a TMA store epilogue is the next
// step if the profile shows the epilogue).
//
// Launch: grid (gemm_hopper_grid(M, N),), block 384, dynamic smem kSmemBytes = 4 x 49,152 +
// 1,024 = 197,632 bytes (needs max_dynamic_shared_size_bytes; runtime/kernels/gemm_hopper.py).
// Instantiations (extern "C"): gemm_hopper_{f16,bf16}_nk_o{same, f32}. Scalars: int M, N, K.
// Signature: (out, desc_a, desc_b, bias, residual, M, N, K); desc_a / desc_b by value.
// Bodies exist where PAGEDRUN_HAS_HOPPER (sm_90a and the CPU harness); elsewhere they trap, so
// the sm_80 gate compiles the file to empty kernels.
//
// Register budget: 168 per thread at 384 threads (the launch-time allocation; setmaxnreg moves
// registers to the consumers at run time); the gate must show 0 spill bytes. 168 is also the
// minimum: 384 x 168 = 128 x 40 + 256 x 232, and setmaxnreg.inc waits until its registers are
// free, so a build with fewer hangs. runtime/kernels/gemm_hopper.py (hopper_kernel) reads the
// loaded kernel's count and refuses any other, logging it; gemm() then takes the mma.sync GEMM.
// Measured: no GPU numbers yet; static model in docs/kernel_report.md.
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "hopper_groundwork.cuh"

namespace gemm_hopper {

using gemm_epilogue::epilogue_pair;

constexpr int kThreads = 384;
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumers = 2;
constexpr int kBM = 128;                 // CTA rows: 2 consumers x 64 (the wgmma M)
constexpr int kBN = 256;                 // CTA columns: one wgmma n256 per consumer
constexpr int kBK = 64;                  // 64 16-bit values = one 128-byte swizzled row
constexpr int kStages = 4;
constexpr int kWgmmaM = 64;
constexpr int kWgmmaK = 16;
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows x 128 bytes: the SBO of a 128B-swizzled operand
constexpr int kRowBytes = kBK * 2;
constexpr int kLboUnused = 16;         // swizzled K-major: LBO ignored; 1 (x16 B) as in the probes
constexpr int kABytes = kBM * kRowBytes;               // 16 KiB
constexpr int kBBytes = kBN * kRowBytes;               // 32 KiB
constexpr int kStageBytes = kABytes + kBBytes;         // 48 KiB
constexpr int kSmemBytes = kStages * kStageBytes + kSwizzleAtomBytes;  // + alignment slack
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kGroupM = 8;               // m-blocks per raster group
constexpr int kAccum = kWgmmaM * kBN / kWarpgroupThreads;  // 128 fp32 per consumer thread
static_assert(kSmemBytes <= 227 * 1024, "more dynamic shared memory than a CTA may have");
static_assert(kBM == kConsumers * kWgmmaM, "one 64-row slab per consumer");
static_assert(kThreads == (1 + kConsumers) * kWarpgroupThreads, "producer + consumers");
static_assert(kWarpgroupThreads * kProducerRegs + kConsumers * kWarpgroupThreads * kConsumerRegs
                  <= 65536, "setmaxnreg split exceeds the register file");

#if PAGEDRUN_HAS_HOPPER

__device__ __forceinline__ unsigned char* align_up_1024(unsigned char* p) {
    return reinterpret_cast<unsigned char*>(
        (reinterpret_cast<size_t>(p) + kSwizzleAtomBytes - 1) & ~size_t(kSwizzleAtomBytes - 1));
}


template <bool BF16>
__device__ __forceinline__ void wgmma_n256(float (&d)[kAccum], uint64_t da, uint64_t db) {
    if constexpr (BF16) wgmma_m64n256k16_bf16(d, da, db, 1);
    else wgmma_m64n256k16_f16(d, da, db, 1);
}

// Grouped raster order: CTA `pid` -> (m_block, n_block).
__device__ __forceinline__ void tile_of(int pid, int M, int N, int& m_block, int& n_block) {
    const int m_blocks = (M + kBM - 1) / kBM, n_blocks = (N + kBN - 1) / kBN;
    const int per_group = kGroupM * n_blocks;
    const int first_m = (pid / per_group) * kGroupM;
    const int group_m = min(m_blocks - first_m, kGroupM);
    m_block = first_m + (pid % per_group) % group_m;
    n_block = (pid % per_group) / group_m;
}

// desc_a / desc_b: the addresses of the kernel's __grid_constant__ descriptor parameters.
template <typename T, typename OutT, bool BF16>
__device__ __forceinline__ void gemm_hopper(OutT* out, const TmaDescriptor* desc_a,
                                            const TmaDescriptor* desc_b, const T* bias,
                                            const OutT* residual, int M, int N, int K) {
    DYNAMIC_SMEM(unsigned char, smem_raw);
    __shared__ __align__(8) uint64_t full_bar[kStages];   // k-tile landed (TMA bytes)
    __shared__ __align__(8) uint64_t empty_bar[kStages];  // both consumers done reading
    unsigned char* smem = align_up_1024(smem_raw);
    const int warpgroup = threadIdx.x / kWarpgroupThreads;
    const int k_tiles = (K + kBK - 1) / kBK;
    int m_block, n_block;
    tile_of(blockIdx.x, M, N, m_block, n_block);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&full_bar[s], 1);
            mbarrier_init(&empty_bar[s], kConsumers);
        }
    }
    __syncthreads();

    if (warpgroup == 0) {  // producer
        warpgroup_reg_dealloc<kProducerRegs>();
        if (threadIdx.x == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % kStages;
                if (kt >= kStages) mbarrier_wait_parity(&empty_bar[s], (kt / kStages - 1) & 1);
                unsigned char* stage = smem + s * kStageBytes;
                mbarrier_arrive_expect_tx(&full_bar[s], kStageBytes);  // boxes count whole
                tma_load_2d(stage, desc_a, kt * kBK, m_block * kBM, &full_bar[s]);
                tma_load_2d(stage + kABytes, desc_b, kt * kBK, n_block * kBN, &full_bar[s]);
            }
        }
        return;
    }

    warpgroup_reg_alloc<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    float acc[kAccum];
#pragma unroll
    for (int r = 0; r < kAccum; ++r) acc[r] = 0.f;
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % kStages;
        mbarrier_wait_parity(&full_bar[s], (kt / kStages) & 1);
        unsigned char* a_tile = smem + s * kStageBytes + consumer * kWgmmaM * kRowBytes;
        unsigned char* b_tile = smem + s * kStageBytes + kABytes;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / kWgmmaK; ++kk) {
            const uint64_t da = make_smem_desc(a_tile + kk * kWgmmaK * 2, kSmemSwizzle128B,
                                               kLboUnused, kSwizzleAtomBytes);
            const uint64_t db = make_smem_desc(b_tile + kk * kWgmmaK * 2, kSmemSwizzle128B,
                                               kLboUnused, kSwizzleAtomBytes);
            wgmma_n256<BF16>(acc, da, db);
        }
        wgmma_commit_group();
        wgmma_wait_group<1>();  // k-tile kt-1's wgmmas are done reading their stage
        if (kt > 0 && threadIdx.x % kWarpgroupThreads == 0)
            mbarrier_arrive(&empty_bar[(kt - 1) % kStages]);
    }
    wgmma_wait_group<0>();

    const int t = threadIdx.x % kWarpgroupThreads;
    const int w = t / 32, g = (t % 32) / 4, q = t % 4;
    const int row = m_block * kBM + consumer * kWgmmaM + 16 * w + g;
    const int col0 = n_block * kBN + 2 * q;
#pragma unroll
    for (int i = 0; i < kBN / 8; ++i) {
        epilogue_pair<T, OutT>(out, bias, residual, row, col0 + 8 * i, acc[4 * i],
                               acc[4 * i + 1], M, N);
        epilogue_pair<T, OutT>(out, bias, residual, row + 8, col0 + 8 * i, acc[4 * i + 2],
                               acc[4 * i + 3], M, N);
    }
}

#endif  // PAGEDRUN_HAS_HOPPER

}  // namespace gemm_hopper

#if PAGEDRUN_HAS_HOPPER
#define PAGEDRUN_GEMM_HOPPER_BODY(T, OutT, BF16) \
    gemm_hopper::gemm_hopper<T, OutT, BF16>(out, &desc_a, &desc_b, bias, residual, M, N, K);
#else
#define PAGEDRUN_GEMM_HOPPER_BODY(T, OutT, BF16) __trap();
#endif

#define PAGEDRUN_GEMM_HOPPER(DT, T, ODT, OutT, BF16)                                           \
    extern "C" __global__ void __launch_bounds__(gemm_hopper::kThreads, 1)                     \
        gemm_hopper_##DT##_nk_o##ODT(OutT* out, const __grid_constant__ TmaDescriptor desc_a,  \
                                     const __grid_constant__ TmaDescriptor desc_b,             \
                                     const T* bias, const OutT* residual, int M, int N,        \
                                     int K) {                                                  \
        PAGEDRUN_GEMM_HOPPER_BODY(T, OutT, BF16)                                               \
    }

PAGEDRUN_GEMM_HOPPER(f16, __half, f16, __half, false)
PAGEDRUN_GEMM_HOPPER(f16, __half, f32, float, false)
PAGEDRUN_GEMM_HOPPER(bf16, __nv_bfloat16, bf16, __nv_bfloat16, true)
PAGEDRUN_GEMM_HOPPER(bf16, __nv_bfloat16, f32, float, true)

#undef PAGEDRUN_GEMM_HOPPER
#undef PAGEDRUN_GEMM_HOPPER_BODY
