// gemm.cu -- tensor-core GEMM with fp32 accumulate for prefill-sized M, with an optional fused
// epilogue (bias, residual add); an fp32 SIMT instantiation of the same contract for tests.
//
// Computes, for every row m < M and column n < N:
//   out[m, n] = sum_k a[m, k] * B[k, n]  (+ bias[n] if bias != nullptr)
//                                        (+ residual[m, n] if residual != nullptr)
// products and sums in fp32, one rounding to the output type at the end.
//
// Pointers (T = float | __half | __nv_bfloat16, OutT = T or float per instantiation; all
// contiguous, row-major):
//   a         [M, K]                         T    (activations)
//   b         layout "nk": [N, K]            T    (HF nn.Linear weight, out x in)
//             layout "kn": [K, N]            T    (pre-transposed weight, x @ W)
//   bias      [N]                            T    or nullptr
//   residual  [M, N]                         OutT or nullptr (may alias out: read before write)
//   out       [M, N]                         OutT
//
// Tensor-core path (f16 / bf16): CTA tile 128 x 128 x 64, 8 warps as 2 (m) x 4 (n), each warp
// 64 x 32 = 4 x 4 mma.sync m16n8k16 tiles (64 fp32 accumulators per thread). A 3-stage
// cp.async pipeline (cp_async_wait<kStages - 2>) keeps two k-tiles in flight while the third
// is multiplied; one __syncthreads per k-tile. Within a k-tile the A / B fragments are double-
// buffered in registers: k-step s + 1's ldmatrix is issued before k-step s's 16 mma (the last
// k-step prefetches k-step 0 of the next tile, after the barrier that publishes it).
// Shared tiles are XOR-swizzled so every ldmatrix phase (8 rows x 16 bytes) hits the 8 bank
// quads of a 128-byte line without padding:
//   K-major tiles (A, and B in "nk"): [rows][64] elements = 8 16-byte chunks per 128-byte row,
//     chunk' = chunk ^ (row & 7): the 8 consecutive rows of one phase get 8 distinct chunks.
//   N-major tile (B in "kn"): [64][128] = 16 chunks per 256-byte row, chunk' = chunk ^ (row & 7);
//     fragments come through ldmatrix .trans.
// Rasterization: blockIdx is remapped so consecutive CTAs walk 8 m-tiles of one n-tile before
// the next n-tile (grouped order): the resident wave shares a and B panels in L2.
// "aligned" instantiations need K % 8 == 0 (and N % 8 == 0 for "kn") so every 16-byte chunk
// is either wholly inside the matrix (cp.async) or wholly outside (zero-filled, reads nothing).
// "unaligned" instantiations load the same tiles element by element with bounds checks
// (synchronous): the wrapper picks them for awkward K (e.g. the tests' K = 111) and for a or b
// not starting on a 16-byte boundary (a row view of a larger matrix); there is no fp32-output
// unaligned instantiation.
// Split-K (aligned 16-bit only, for tile grids well under the SM count): gemm_DT_L_splitk runs
// grid.z = num_splits CTAs per tile, split z summing k in [z * k_split, min(K, (z + 1) *
// k_split)) (k_split a multiple of 64) into partial[z] = fp32 [num_splits, M, N]; then
// gemm_splitk_reduce_DT_oODT (cuda/gemm_skinny.cu) adds the splits in order and applies bias
// and residual once (each output element read before written, so residual may alias out).
// Epilogue: fragments straight from registers; 2-element stores where N is even.
//
// fp32 path (the test instantiation; no fp32 mma): CTA tile 64 x 64 x 16, 256 threads each
// owning a 4 x 4 block of outputs, both layouts, bounds-checked loads; never split.
//
// Launch geometry: grid (ceil(N / tile_n), ceil(M / tile_m)[, num_splits]), block 256; tile
// 128 x 128 for f16/bf16, 64 x 64 for f32. Dynamic shared memory:
//   f16/bf16: kStages * (128 * 64 + 128 * 64) * 2 = 98,304 bytes: above the 48 KiB default,
//     so the wrapper opts in (max_dynamic_shared_size_bytes); 3 stages fit sm_86 / sm_89's
//     99 KiB per CTA, one CTA per SM on sm_80 (164 KiB) as the registers allow anyway
//   f32:      0 (static 2 * 16 * (64 + 4) * 4 = 8,704 bytes)
// (gemm_smem_bytes in runtime/kernels/gemm.py).
//
// Instantiations (extern "C"; DT in {f16, bf16}, L in {nk, kn}):
//   gemm_DT_L_oDT, gemm_DT_L_oDT_unaligned, gemm_DT_L_of32 (aligned, fp32 out: logits),
//   gemm_DT_L_splitk (aligned, fp32 partials), gemm_f32_L_of32.
// Scalars: int M, N, K (+ int k_split). Signatures: (out, a, b, bias, residual, M, N, K);
// splitk: (partial, a, b, M, N, K, k_split).
// Launched by runtime/kernels/gemm.py: gemm / linear, following runtime/kernels/gemm_plan.py
// (tensor_core_plan / tensor_core_splits pick aligned vs unaligned and the split of K; decode-
// sized M with an "nk" weight goes to gemm_skinny.cu instead).
//
// Register budget: 232 per thread at 256 threads (64 accumulators, 2 x (16 A + 8 B) fragment
// registers, the loader's chunk addresses); one CTA (8 warps) per SM either way, since the
// 96 KiB of stages allow one on sm_80; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet (benchmarks/kernels/bench_gemm.py writes TFLOP/s vs cupy.matmul).
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "ptx.cuh"

namespace gemm_tc {

using gemm_epilogue::epilogue_pair;

constexpr int kThreads = 256;
constexpr int kBM = 128;          // CTA rows
constexpr int kBN = 128;          // CTA columns
constexpr int kBK = 64;           // k per pipeline stage: one 128-byte row per tile row
constexpr int kStages = 3;        // 3 x 32 KiB = 96 KiB: fits sm_86 / sm_89's 99 KiB per CTA
constexpr int kWarpsN = 4;        // warp grid 2 x 4
constexpr int kWarpM = 64;        // rows per warp
constexpr int kWarpN = 32;        // columns per warp
constexpr int kMTiles = kWarpM / 16;
constexpr int kNTiles = kWarpN / 8;
constexpr int kKSteps = kBK / 16;  // mma k-steps per stage (even: the fragment buffers alternate)
constexpr int kChunkElems = 8;    // 16-byte chunk of 16-bit elements
constexpr int kChunkBytes = 16;
constexpr int kKChunks = kBK / kChunkElems;   // chunks per K-major row (8)
constexpr int kNChunks = kBN / kChunkElems;   // chunks per N-major row (16)
constexpr int kSwizzleMask = 7;   // 8 bank quads of 16 bytes make one 128-byte bank line
constexpr int kStageElems = kBM * kBK + kBN * kBK;
// Rasterization: CTAs launched one after another walk kGroupM m-tiles down before stepping
// right, so the ~132 resident CTAs share 8 a row-panels and ~16 b column-panels in L2.
constexpr int kGroupM = 8;
static_assert(kKSteps % 2 == 0, "the last k-step's prefetch must land in fragment buffer 0");

enum Layout { kLayoutNK = 0, kLayoutKN = 1 };

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled K-major [rows][64] tile
// (8 chunks per 128-byte row; the 8 rows of one ldmatrix phase hit 8 distinct bank quads).
__device__ __forceinline__ int kmajor_offset(int row, int chunk) {
    return row * kBK + ((chunk ^ (row & kSwizzleMask)) * kChunkElems);
}
// ... and in the N-major [kBK][kBN] tile (16 chunks per 256-byte row).
__device__ __forceinline__ int nmajor_offset(int row, int chunk) {
    return row * kBN + ((chunk ^ (row & kSwizzleMask)) * kChunkElems);
}

template <typename T> __device__ __forceinline__ uint32_t bits16(T v);
template <> __device__ __forceinline__ uint32_t bits16<__half>(__half v) {
    return __half_as_ushort(v);
}
template <> __device__ __forceinline__ uint32_t bits16<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat16_as_ushort(v);
}

// 16-byte shared store of 8 elements given as 4 packed words (integers only: no type punning
// of 16-bit element types, which g++ -O2 may reorder under the harness).
__device__ __forceinline__ void store_chunk(void* dst, uint32_t w0, uint32_t w1, uint32_t w2,
                                            uint32_t w3) {
    uint4* p = reinterpret_cast<uint4*>(dst);
    *p = make_uint4(w0, w1, w2, w3);
}

// One 16-byte chunk of `src` row `row` starting at column `col` (bounds rows x cols, row
// stride `ld`), element by element; zeros outside. The unaligned path's loader.
template <typename T>
__device__ __forceinline__ void load_chunk_checked(T* dst, const T* src, int row, int col,
                                                   int rows, int cols, int ld) {
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (row < rows) {
        const T* p = src + static_cast<long long>(row) * ld;
#pragma unroll
        for (int e = 0; e < kChunkElems; ++e)
            if (col + e < cols) w[e / 2] |= bits16<T>(p[col + e]) << (16 * (e % 2));
    }
    store_chunk(dst, w[0], w[1], w[2], w[3]);
}

template <typename T, bool ALIGNED>
__device__ __forceinline__ void load_chunk(T* dst, const T* src, int row, int col, int rows,
                                           int cols, int ld) {
    if constexpr (ALIGNED) {
        const bool valid = row < rows && col < cols;
        const T* p = valid ? src + static_cast<long long>(row) * ld + col : src;
        cp_async_16_zfill(dst, p, valid ? kChunkBytes : 0);
    } else {
        load_chunk_checked<T>(dst, src, row, col, rows, cols, ld);
    }
}

// Issues the loads of the k-tile starting at column k0 into stage buffer `s_stage`; columns
// at or past k_end read as zeros (k_end: K, or the end of this CTA's split).
template <typename T, int LAYOUT, bool ALIGNED>
__device__ __forceinline__ void load_tile(T* s_stage, const T* a, const T* b, int m0, int n0,
                                          int k0, int k_end, int M, int N, int K) {
    T* s_a = s_stage;
    T* s_b = s_stage + kBM * kBK;
#pragma unroll
    for (int i = 0; i < kBM * kKChunks / kThreads; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        const int row = idx / kKChunks, chunk = idx % kKChunks;
        load_chunk<T, ALIGNED>(s_a + kmajor_offset(row, chunk), a, m0 + row,
                               k0 + chunk * kChunkElems, M, k_end, K);
    }
    if constexpr (LAYOUT == kLayoutNK) {
#pragma unroll
        for (int i = 0; i < kBN * kKChunks / kThreads; ++i) {
            const int idx = threadIdx.x + i * kThreads;
            const int row = idx / kKChunks, chunk = idx % kKChunks;
            load_chunk<T, ALIGNED>(s_b + kmajor_offset(row, chunk), b, n0 + row,
                                   k0 + chunk * kChunkElems, N, k_end, K);
        }
    } else {
#pragma unroll
        for (int i = 0; i < kBK * kNChunks / kThreads; ++i) {
            const int idx = threadIdx.x + i * kThreads;
            const int row = idx / kNChunks, chunk = idx % kNChunks;
            load_chunk<T, ALIGNED>(s_b + nmajor_offset(row, chunk), b, k0 + row,
                                   n0 + chunk * kChunkElems, k_end, N, N);
        }
    }
}

// One warp's A and B fragments of k-step `kk` of a stage (64 x 16 of a, 16 x 32 of B).
template <typename T, int LAYOUT>
__device__ __forceinline__ void load_fragments(uint32_t (&a_frag)[kMTiles][4],
                                               uint32_t (&b_frag)[kNTiles][2], const T* s_a,
                                               const T* s_b, int kk, int warp_m, int warp_n,
                                               int lane) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        const int row = warp_m * kWarpM + mt * 16 + (lane & 15);
        ldmatrix_x4(a_frag[mt], s_a + kmajor_offset(row, kk * 2 + (lane >> 4)));
    }
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t r[4];
        if constexpr (LAYOUT == kLayoutNK) {
            const int nrow = warp_n * kWarpN + np * 16 + (lane >> 4) * 8 + (lane & 7);
            ldmatrix_x4(r, s_b + kmajor_offset(nrow, kk * 2 + ((lane >> 3) & 1)));
        } else {
            const int krow = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
            const int nchunk = (warp_n * kWarpN + np * 16) / kChunkElems + (lane >> 4);
            ldmatrix_x4_trans(r, s_b + nmajor_offset(krow, nchunk));
        }
        b_frag[2 * np][0] = r[0];
        b_frag[2 * np][1] = r[1];
        b_frag[2 * np + 1][0] = r[2];
        b_frag[2 * np + 1][1] = r[3];
    }
}

// This CTA's (m-tile, n-tile) under the grouped rasterization: launch order (blockIdx.x
// fastest) walks kGroupM m-tiles of one n-tile, then the next n-tile; a bijection on the grid.
__device__ __forceinline__ void raster_tile(int& m_tile, int& n_tile) {
    const int num_n = gridDim.x, num_m = gridDim.y;
    const int pid = blockIdx.y * num_n + blockIdx.x;
    const int per_group = kGroupM * num_n;
    const int first_m = (pid / per_group) * kGroupM;
    const int group_m = min(num_m - first_m, kGroupM);
    const int in_group = pid % per_group;
    m_tile = first_m + in_group % group_m;
    n_tile = in_group / group_m;
}


// ------------------------------------------------------------------ tensor-core path
// Sums k in [k_begin, k_end) (k_begin a multiple of kBK) into the CTA's 128 x 128 tile.
template <typename T, typename OutT, int LAYOUT, bool ALIGNED>
__device__ __forceinline__ void gemm_mma(OutT* out, const T* __restrict__ a,
                                         const T* __restrict__ b, const T* __restrict__ bias,
                                         const OutT* residual, int M, int N, int K, int k_begin,
                                         int k_end) {
    DYNAMIC_SMEM(T, smem);
    int m_tile, n_tile;
    raster_tile(m_tile, n_tile);
    const int m0 = m_tile * kBM;
    const int n0 = n_tile * kBN;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int warp_m = warp / kWarpsN;
    const int warp_n = warp % kWarpsN;
    const int num_k_tiles = (k_end - k_begin + kBK - 1) / kBK;

    float acc[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;

    // Prologue: kStages - 1 tiles in flight (one commit group each, empty past the end).
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_k_tiles)
            load_tile<T, LAYOUT, ALIGNED>(smem + s * kStageElems, a, b, m0, n0,
                                          k_begin + s * kBK, k_end, M, N, K);
        cp_async_commit();
    }
    cp_async_wait<kStages - 2>();  // tile 0 has landed (for this thread) ...
    __syncthreads();               // ... for every thread

    // Fragments double-buffered in registers: k-step kk + 1's ldmatrix is issued before
    // k-step kk's mma, so shared-memory latency hides behind 16 mma per warp.
    uint32_t a_frag[2][kMTiles][4];
    uint32_t b_frag[2][kNTiles][2];
    load_fragments<T, LAYOUT>(a_frag[0], b_frag[0], smem, smem + kBM * kBK, 0, warp_m, warp_n,
                              lane);

    for (int kt = 0; kt < num_k_tiles; ++kt) {
        const T* s_a = smem + (kt % kStages) * kStageElems;
        const T* s_b = s_a + kBM * kBK;
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
            const int nbuf = (kk + 1) % 2;
            if (kk < kKSteps - 1) {
                load_fragments<T, LAYOUT>(a_frag[nbuf], b_frag[nbuf], s_a, s_b, kk + 1, warp_m,
                                          warp_n, lane);
            } else {
                // Every read of stage kt is issued (its last fragments are in registers);
                // wait for tile kt + 1 and let every thread see it. After this barrier no
                // thread reads stage kt again, so the next iteration may refill it.
                cp_async_wait<kStages - 2>();
                __syncthreads();
                if (kt + 1 < num_k_tiles) {
                    const T* n_a = smem + ((kt + 1) % kStages) * kStageElems;
                    load_fragments<T, LAYOUT>(a_frag[nbuf], b_frag[nbuf], n_a, n_a + kBM * kBK,
                                              0, warp_m, warp_n, lane);
                }
            }
            if (kk == 0) {
                // Refill the stage of tile kt - 1 (free since the barrier above, one k-tile
                // ago) with tile kt + kStages - 1.
                const int next = kt + kStages - 1;
                if (next < num_k_tiles)
                    load_tile<T, LAYOUT, ALIGNED>(smem + (next % kStages) * kStageElems, a, b,
                                                  m0, n0, k_begin + next * kBK, k_end, M, N, K);
                cp_async_commit();
            }
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt)
                    mma_m16n8k16_acc<T>(acc[mt][nt], a_frag[kk % 2][mt], b_frag[kk % 2][nt]);
        }
    }
    cp_async_wait_all();  // only empty groups remain; leave nothing pending at exit

#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        const int row = m0 + warp_m * kWarpM + mt * 16 + (lane >> 2);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            const int col = n0 + warp_n * kWarpN + nt * 8 + (lane & 3) * 2;
            epilogue_pair<T, OutT>(out, bias, residual, row, col, acc[mt][nt][0],
                                   acc[mt][nt][1], M, N);
            epilogue_pair<T, OutT>(out, bias, residual, row + 8, col, acc[mt][nt][2],
                                   acc[mt][nt][3], M, N);
        }
    }
}

// ------------------------------------------------------------------ fp32 SIMT path (tests)
constexpr int kSimtTile = 64;
constexpr int kSimtBK = 16;
constexpr int kSimtPad = 4;      // keeps the column reads of one warp off a single bank
constexpr int kSimtPerThread = 4;

template <int LAYOUT>
__device__ __forceinline__ void gemm_simt(float* out, const float* __restrict__ a,
                                          const float* __restrict__ b,
                                          const float* __restrict__ bias, const float* residual,
                                          int M, int N, int K) {
    __shared__ float s_a[kSimtBK][kSimtTile + kSimtPad];  // [k][m]
    __shared__ float s_b[kSimtBK][kSimtTile + kSimtPad];  // [k][n]
    const int m0 = blockIdx.y * kSimtTile;
    const int n0 = blockIdx.x * kSimtTile;
    const int tm = (threadIdx.x / (kSimtTile / kSimtPerThread)) * kSimtPerThread;
    const int tn = (threadIdx.x % (kSimtTile / kSimtPerThread)) * kSimtPerThread;
    float acc[kSimtPerThread][kSimtPerThread] = {};
    for (int k0 = 0; k0 < K; k0 += kSimtBK) {
        for (int idx = threadIdx.x; idx < kSimtBK * kSimtTile; idx += kThreads) {
            const int kk = idx % kSimtBK, mm = idx / kSimtBK;
            const int gm = m0 + mm, gk = k0 + kk;
            s_a[kk][mm] = (gm < M && gk < K) ? a[static_cast<long long>(gm) * K + gk] : 0.f;
            float bv = 0.f;
            if constexpr (LAYOUT == kLayoutNK) {
                const int gn = n0 + mm;
                if (gn < N && gk < K) bv = b[static_cast<long long>(gn) * K + gk];
                s_b[kk][mm] = bv;
            } else {
                const int kr = idx / kSimtTile, nn = idx % kSimtTile;  // coalesced along n
                const int gn = n0 + nn, gk2 = k0 + kr;
                if (gn < N && gk2 < K) bv = b[static_cast<long long>(gk2) * N + gn];
                s_b[kr][nn] = bv;
            }
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kSimtBK; ++kk)
#pragma unroll
            for (int i = 0; i < kSimtPerThread; ++i)
#pragma unroll
                for (int j = 0; j < kSimtPerThread; ++j)
                    acc[i][j] += s_a[kk][tm + i] * s_b[kk][tn + j];
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kSimtPerThread; ++i)
#pragma unroll
        for (int j = 0; j < kSimtPerThread; j += 2)
            epilogue_pair<float, float>(out, bias, residual, m0 + tm + i, n0 + tn + j, acc[i][j],
                                        acc[i][j + 1], M, N);
}

}  // namespace gemm_tc

#define PAGEDRUN_GEMM_MMA(DT, T, L, LAYOUT, ODT, OutT, SUFFIX, ALIGNED)                          \
    extern "C" __global__ void __launch_bounds__(gemm_tc::kThreads)                              \
        gemm_##DT##_##L##_o##ODT##SUFFIX(OutT* out, const T* a, const T* b, const T* bias,       \
                                         const OutT* residual, int M, int N, int K) {           \
        gemm_tc::gemm_mma<T, OutT, LAYOUT, ALIGNED>(out, a, b, bias, residual, M, N, K, 0, K);   \
    }

// Split-K partial sums: grid.z = num_splits, split z sums k in [z * k_split, (z + 1) * k_split)
// into partial[z] (fp32 [num_splits, M, N]); gemm_splitk_reduce_* adds the splits and applies
// the epilogue once.
#define PAGEDRUN_GEMM_SPLITK(DT, T, L, LAYOUT)                                                   \
    extern "C" __global__ void __launch_bounds__(gemm_tc::kThreads)                              \
        gemm_##DT##_##L##_splitk(float* partial, const T* a, const T* b, int M, int N, int K,    \
                                 int k_split) {                                                 \
        const int k_begin = blockIdx.z * k_split;                                               \
        gemm_tc::gemm_mma<T, float, LAYOUT, true>(                                               \
            partial + static_cast<long long>(blockIdx.z) * M * N, a, b, nullptr, nullptr, M, N,  \
            K, k_begin, min(K, k_begin + k_split));                                              \
    }

#define PAGEDRUN_GEMM_16BIT(DT, T)                                                   \
    PAGEDRUN_GEMM_MMA(DT, T, nk, gemm_tc::kLayoutNK, DT, T, , true)                  \
    PAGEDRUN_GEMM_MMA(DT, T, kn, gemm_tc::kLayoutKN, DT, T, , true)                  \
    PAGEDRUN_GEMM_MMA(DT, T, nk, gemm_tc::kLayoutNK, DT, T, _unaligned, false)       \
    PAGEDRUN_GEMM_MMA(DT, T, kn, gemm_tc::kLayoutKN, DT, T, _unaligned, false)       \
    PAGEDRUN_GEMM_MMA(DT, T, nk, gemm_tc::kLayoutNK, f32, float, , true)             \
    PAGEDRUN_GEMM_MMA(DT, T, kn, gemm_tc::kLayoutKN, f32, float, , true)             \
    PAGEDRUN_GEMM_SPLITK(DT, T, nk, gemm_tc::kLayoutNK)                              \
    PAGEDRUN_GEMM_SPLITK(DT, T, kn, gemm_tc::kLayoutKN)

PAGEDRUN_GEMM_16BIT(f16, __half)
PAGEDRUN_GEMM_16BIT(bf16, __nv_bfloat16)

#define PAGEDRUN_GEMM_SIMT(L, LAYOUT)                                                            \
    extern "C" __global__ void __launch_bounds__(gemm_tc::kThreads)                              \
        gemm_f32_##L##_of32(float* out, const float* a, const float* b, const float* bias,       \
                            const float* residual, int M, int N, int K) {                       \
        gemm_tc::gemm_simt<LAYOUT>(out, a, b, bias, residual, M, N, K);                          \
    }

PAGEDRUN_GEMM_SIMT(nk, gemm_tc::kLayoutNK)
PAGEDRUN_GEMM_SIMT(kn, gemm_tc::kLayoutKN)
