// gemm_skinny.cu -- memory-bound GEMM for decode-sized M (<= 64 rows): every weight byte is
// read once, split over K when N alone cannot fill the GPU; on tensor cores from M = 8 in
// 16-bit types, on CUDA cores below (and for f32); plus the split-K reduction with the fused
// epilogue.
//
// Computes out[m, n] = sum_k a[m, k] * w[n, k] (+ bias[n]) (+ residual[m, n]), fp32 math.
//
// Pointers (T = float | __half | __nv_bfloat16, OutT = T or float; contiguous, row-major; a and
// w 16-byte aligned):
//   a         [M, K]              T     activations, M <= 64 per m-tile row of the grid
//   w         [N, K]              T     weight in the HF "nk" layout (out x in)
//   bias      [N]                 T     or nullptr
//   residual  [M, N]              OutT  or nullptr (may alias out: each element is read and
//                                       written by the same thread)
//   out       [M, N]              OutT  written when num_splits == 1
//   partial   [num_splits, M, N]  float written when num_splits > 1 (then the reduce kernel
//                                       applies bias / residual and writes out)
// Needs K % (16 / sizeof(T)) == 0 (the wrapper's plan falls back to gemm.cu otherwise).
//
// CUDA-core path (gemm_skinny_*_mMT; M < 8, and f32): a CTA of 8 warps walks its K range in
// tiles of 32 lanes x 16 bytes (256 elements for 16-bit T, 128 for f32). Per tile the CTA
// stages the [M_TILE, tile] slice of `a` in shared memory (one 16-byte load per chunk); each
// warp owns ROWS_PER_WARP weight rows, each lane loads 16 contiguous bytes of each (coalesced
// 512-byte row segments per warp), and accumulates M_TILE x ROWS_PER_WARP dot products in
// registers (a read once from shared memory per m and reused across the warp's rows). The warp
// then sums its lanes with one transposed shuffle reduction over the rows present (rows padded
// to a power of two: ROWS_PER_WARP x 8 sums take 31 shuffles, not 5 each; bit-identical to a
// butterfly per sum, see warp_transpose_sum), and each sum is written by the lane that ends
// with it. M_TILE = 8 keeps 4 weight rows per warp (fewer, longer CTAs
// for batch-1 decode); M_TILE = 64 takes one row per warp to stay within the register budget.
// From M = 9 that is one weight row per warp and one synchronous 16-byte load per lane per
// tile: too few bytes in flight, hence the tensor-core path.
// Launch: grid (ceil(N / (8 * ROWS_PER_WARP)), ceil(M / M_TILE), num_splits), block 256;
// k_split a multiple of the tile (256 or 128). Dynamic shared memory M_TILE * 512 bytes.
//
// Tensor-core path (gemm_skinny_tc_*; f16 / bf16, M >= 8): mma.sync m16n8k16 with the WEIGHT
// as the "A" operand (16 weight rows in the m16 dimension) and the activations as "B" (8
// activation rows in the n8 dimension), so M = 8..64 fills whole n8 tiles: no tensor work is
// spent on padding rows beyond the next multiple of 8 (16-row groups past M are skipped, the
// tail of the last group is zero-filled and its outputs dropped). A CTA of 4 warps owns 128
// weight rows (32 per warp: two m16 tiles that share every activation fragment) and up to 64
// activation rows (8 n8 tiles, 64 fp32 accumulators per thread). Per k-tile of 32 elements a
// stage holds the weight slice [128][32] (8 KiB: 64-byte row segments, 4 x 16-byte cp.async
// per thread) and the activation slice [64][32] (4 KiB; only the 16-row groups that hold rows
// < M are loaded, from L2: a is reused by every CTA). Tiles are XOR-swizzled as gemm.cu's
// K-major tiles (chunk' = chunk ^ ((row >> 1) & 3)): conflict-free ldmatrix x4 for both
// operands. A 4-stage cp.async pipeline (cp_async_wait<2>) keeps 3 k-tiles in flight while the
// 4th is multiplied.
//   Bytes in flight: 3 stages x 8 KiB = 24 KiB of weight per CTA. 4 x 48 KiB shared memory and
//   __launch_bounds__(128, 4) (<= 128 registers) give 4 CTAs per SM: up to 96 KiB per SM,
//   against Little's law's 4.8 TB/s x ~700 ns / 132 SMs = 25 KiB. One CTA per SM already
//   covers it, so the plan only needs a grid of >= ~132 CTAs (N / 128 x num_splits).
//   Per 8 KiB weight k-tile a CTA issues 4 warps x 2 k16 x 2 m16 x 8 n8 = 128 mma (M = 64:
//   ~210 SM clocks at the assumed 65% of the dense peak) and moves 12 KiB into and 24 KiB out
//   of shared memory (~290 clocks at 128 B/clk), against ~445 clocks for the SM's share of HBM
//   (18.4 B/clk) to deliver those 8 KiB: the weight stream stays the bound at M <= 64.
//   Split-K: the plan (runtime/kernels/gemm_plan.py: skinny_tc_plan) picks the split count
//   that minimises (weight bytes + fp32 partial bytes) / bandwidth fill; partials cost
//   num_splits x M x N x 4 bytes, which is what keeps M = 64 on small N below the target.
//   Model estimate on H200 (plan model, not measured), bf16, Llama-3-8B shapes: M = 8: 98-100%
//   of HBM bandwidth; M = 16: 96-100%; M = 32: 93-100%; M = 64: 86% (N = K = 4096), 91%
//   (qkv 6144 x 4096), 96% (down 4096 x 14336), 100% (gate_up, lm_head); N = 1024 x 4096
//   (a lone k/v projection) drops to 62% at M = 64.
// Launch: grid (ceil(N / 128), ceil(M / 64), num_splits), block 128; k_split a multiple of 32.
// Dynamic shared memory 4 x (128 + 64) x 32 x 2 = 49,152 bytes (the 48 KiB default limit).
//
// Reduce: grid ceil(M * N / 256), block 256, no shared memory.
//
// Instantiations: gemm_skinny_DT_oODT_mMT for DT in {f16, bf16} with ODT in {DT, f32}, and
// DT = ODT = f32; MT in {8, 64}. gemm_skinny_tc_DT_oODT for DT in {f16, bf16}, ODT in {DT, f32}.
// gemm_splitk_reduce_DT_oODT for every (DT, ODT) pair above.
// Scalars: int M, N, K, k_split (skinny, skinny_tc); int M, N, num_splits (reduce).
// Signatures: gemm_skinny_*(out, partial, a, w, bias, residual, M, N, K, k_split) (the same for
// gemm_skinny_tc_*) -- with num_splits > 1 the wrapper passes out, bias and residual as null and
// the reduce applies them; gemm_splitk_reduce_*(out, partial, bias, residual, M, N, num_splits).
// Launched by runtime/kernels/gemm.py: gemm / linear when runtime/kernels/gemm_plan.py picks
// "skinny" or "skinny_tc" (the m-tile and the split of K are chosen there).
//
// Register budget: 128 per thread (CUDA-core m64: 64 accumulators at 256 threads, 120-122
// used; m8: 32 accumulators plus 4 rows of 8 weights; tensor-core: 64 accumulators + 8 weight
// and 4 activation fragment registers at 128 threads, 108-111 used, capped at 128 by
// __launch_bounds__(128, 4)); the gate must show 0 spill bytes.
// Measured: no GPU numbers yet (benchmarks/kernels/bench_gemm.py: GB/s of weight reads vs a
// device-to-device copy).
#include "common.cuh"
#include "ptx.cuh"

namespace gemm_skinny {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVecBytes = 16;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T> struct Vec { static constexpr int kElems = kVecBytes / sizeof(T); };

// 16 bytes as 4 words, copied byte-wise under the harness (no type punning of T there), one
// vector load on the GPU.
__device__ __forceinline__ uint4 load16(const void* p) {
#if defined(PAGEDRUN_SIM)
    uint4 v;
    memcpy(&v, p, kVecBytes);
    return v;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}
__device__ __forceinline__ void store16(void* p, uint4 v) {
#if defined(PAGEDRUN_SIM)
    memcpy(p, &v, kVecBytes);
#else
    *reinterpret_cast<uint4*>(p) = v;
#endif
}

// The elements of a 16-byte word group as floats.
template <typename T> __device__ __forceinline__ void unpack(const uint4& v, float* f);
template <> __device__ __forceinline__ void unpack<float>(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}
template <> __device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
template <> __device__ __forceinline__ void unpack<__half>(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
        f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
}

__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int ilog2(int v) { return v <= 1 ? 0 : 1 + ilog2(v / 2); }

// The sums over the warp's 32 lanes of N per-lane values (N a power of two <= 32), transposed:
// at each xor step a lane keeps half of its values, sends the other half and adds what its
// partner sent for the half it kept, so N values take N - 1 + 5 - log2 N shuffles instead of
// 5 N. Lane l ends with the sum of value l >> (5 - log2 N). Each sum is the same tree of the
// same additions as a butterfly (v += shfl_xor(v, o), o = 16 .. 1) on that value alone --
// "own + partner's" at every level, and IEEE addition commutes -- so the results are
// bit-identical to it whatever N is.
// One xor step of warp_transpose_sum (offset 16 >> STEP), then the next: recursion on a
// template parameter so every index is a constant (a runtime one puts v in local memory).
template <int N, int STEP>
__device__ __forceinline__ void transpose_sum_step(float (&v)[N], int lane) {
    constexpr int kOffset = 16 >> STEP;
    constexpr int kHalf = (N >> STEP) / 2;
    if constexpr (kHalf >= 1) {
        const bool upper = (lane & kOffset) != 0;
#pragma unroll
        for (int i = 0; i < kHalf; ++i) {
            const float send = upper ? v[i] : v[i + kHalf];
            const float keep = upper ? v[i + kHalf] : v[i];
            v[i] = keep + __shfl_xor_sync(kFullMask, send, kOffset);
        }
    } else {
        v[0] += __shfl_xor_sync(kFullMask, v[0], kOffset);
    }
    if constexpr (STEP < 4) transpose_sum_step<N, STEP + 1>(v, lane);
}
template <int N>
__device__ __forceinline__ float warp_transpose_sum(float (&v)[N], int lane) {
    transpose_sum_step<N, 0>(v, lane);
    return v[0];
}

template <typename T, typename OutT>
__device__ __forceinline__ void finish(OutT* out, const T* bias, const OutT* residual, int m,
                                       int n, int N, float v) {
    if (bias != nullptr) v += to_f32(bias[n]);
    const long long idx = static_cast<long long>(m) * N + n;
    if (residual != nullptr) v += to_f32(residual[idx]);
    out[idx] = from_f32<OutT>(v);
}

// The epilogue of the CUDA-core path for MP activation rows (a power of two >= rows): the
// R x MP sums acc[r][m] (slot r * MP + m), reduced over the lanes 32 slots at a time by
// warp_transpose_sum, each written by the lane that ends with it.
template <typename T, typename OutT, int M_TILE, int R, int MP>
__device__ __forceinline__ void store_sums(const float (&acc)[R][M_TILE], OutT* out,
                                           float* partial, const T* bias, const OutT* residual,
                                           int M, int N, int m0, int rows, int n_first,
                                           int lane) {
    constexpr int kSlots = R * MP;
    constexpr int kChunk = cmin(kSlots, 32);
    constexpr int kShift = 5 - ilog2(kChunk);
#pragma unroll
    for (int c = 0; c < kSlots / kChunk; ++c) {
        float v[kChunk];
#pragma unroll
        for (int i = 0; i < kChunk; ++i) v[i] = acc[(c * kChunk + i) / MP][(c * kChunk + i) % MP];
        const float sum = warp_transpose_sum<kChunk>(v, lane);
        if (lane & ((1 << kShift) - 1)) continue;
        const int slot = c * kChunk + (lane >> kShift);
        const int m = slot % MP, n = n_first + slot / MP;
        if (m >= rows || n >= N) continue;
        if (gridDim.z == 1) {
            finish<T, OutT>(out, bias, residual, m0 + m, n, N, sum);
        } else {
            partial[(static_cast<long long>(blockIdx.z) * M + m0 + m) * N + n] = sum;
        }
    }
}

// store_sums for the smallest power of two MP >= rows (MP <= M_TILE): a compile-time MP per
// branch, so every index into acc stays a constant.
template <typename T, typename OutT, int M_TILE, int R, int MP = 1>
__device__ __forceinline__ void store_sums_padded(const float (&acc)[R][M_TILE], OutT* out,
                                                  float* partial, const T* bias,
                                                  const OutT* residual, int M, int N, int m0,
                                                  int rows, int n_first, int lane) {
    if constexpr (MP >= M_TILE) {
        store_sums<T, OutT, M_TILE, R, M_TILE>(acc, out, partial, bias, residual, M, N, m0, rows,
                                               n_first, lane);
    } else if (rows <= MP) {
        store_sums<T, OutT, M_TILE, R, MP>(acc, out, partial, bias, residual, M, N, m0, rows,
                                           n_first, lane);
    } else {
        store_sums_padded<T, OutT, M_TILE, R, 2 * MP>(acc, out, partial, bias, residual, M, N,
                                                      m0, rows, n_first, lane);
    }
}

template <typename T, typename OutT, int M_TILE, int ROWS_PER_WARP>
__device__ __forceinline__ void skinny(OutT* out, float* partial, const T* __restrict__ a,
                                       const T* __restrict__ w, const T* __restrict__ bias,
                                       const OutT* residual, int M, int N, int K, int k_split) {
    constexpr int VEC = Vec<T>::kElems;
    constexpr int TILE_K = 32 * VEC;
    DYNAMIC_SMEM(T, s_a);  // [M_TILE][TILE_K]
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int m0 = blockIdx.y * M_TILE;
    const int rows = min(M_TILE, M - m0);
    const int n_first = (blockIdx.x * kWarps + warp) * ROWS_PER_WARP;
    const int k_begin = blockIdx.z * k_split;
    const int k_end = min(K, k_begin + k_split);

    float acc[ROWS_PER_WARP][M_TILE];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
        for (int m = 0; m < M_TILE; ++m) acc[r][m] = 0.f;

    for (int k0 = k_begin; k0 < k_end; k0 += TILE_K) {
        __syncthreads();  // every warp is done with the previous tile of a
        for (int idx = threadIdx.x; idx < M_TILE * 32; idx += kThreads) {
            const int m = idx / 32, chunk = idx % 32;
            const int k = k0 + chunk * VEC;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (m < rows && k < k_end) v = load16(a + static_cast<long long>(m0 + m) * K + k);
            store16(s_a + m * TILE_K + chunk * VEC, v);
        }
        __syncthreads();
        const int k = k0 + lane * VEC;
        if (k >= k_end) continue;  // no barrier until the loop head: lanes may skip
        float wf[ROWS_PER_WARP][VEC];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int n = n_first + r;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (n < N) v = load16(w + static_cast<long long>(n) * K + k);
            unpack<T>(v, wf[r]);
        }
#pragma unroll
        for (int m = 0; m < M_TILE; ++m) {
            if (m >= rows) break;
            float af[VEC];
            unpack<T>(load16(s_a + m * TILE_K + lane * VEC), af);
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[r][m] = fmaf(af[e], wf[r][e], acc[r][m]);
        }
    }

    // Sum each (row, m) over the lanes: one transposed reduction for the rows present,
    // padded to a power of two (uniform over the CTA: rows is).
    store_sums_padded<T, OutT, M_TILE, ROWS_PER_WARP>(acc, out, partial, bias, residual, M, N,
                                                      m0, rows, n_first, lane);
}

template <typename T, typename OutT>
__device__ __forceinline__ void splitk_reduce(OutT* out, const float* __restrict__ partial,
                                              const T* __restrict__ bias, const OutT* residual,
                                              int M, int N, int num_splits) {
    const long long total = static_cast<long long>(M) * N;
    const long long idx = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
    if (idx >= total) return;
    float v = 0.f;
    for (int s = 0; s < num_splits; ++s) v += partial[s * total + idx];
    finish<T, OutT>(out, bias, residual, static_cast<int>(idx / N), static_cast<int>(idx % N),
                    N, v);
}

}  // namespace gemm_skinny

// ---------------------------------------------------------------- tensor-core skinny path
// See the header: weight rows are the mma "A" operand (m16), activation rows the "B" operand
// (n8), so M = 8..64 fills whole n8 tiles and the weight streams once through a 4-stage
// cp.async pipeline.
namespace gemm_skinny_tc {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMinCtasPerSm = 4;          // 4 x 48 KiB shared memory per SM; <= 128 registers
constexpr int kWarpRows = 32;             // weight rows per warp: two m16 tiles
constexpr int kMTiles = kWarpRows / 16;
constexpr int kBN = kWarps * kWarpRows;   // weight rows per CTA (128)
constexpr int kBM = 64;                   // activation rows per CTA: eight n8 tiles
constexpr int kNTiles = kBM / 8;
constexpr int kBK = 32;                   // k per pipeline stage: 64-byte row segments
constexpr int kStages = 4;                // 3 stages in flight while the 4th is multiplied
constexpr int kChunkElems = 8;            // 16-byte chunk of 16-bit elements
constexpr int kChunkBytes = 16;
constexpr int kKChunks = kBK / kChunkElems;   // chunks per 64-byte row (4)
constexpr int kStageElems = (kBN + kBM) * kBK;

// Element offset of chunk `chunk` of row `row` in a [rows][kBK] tile, XOR-swizzled as in
// gemm.cu's K-major tiles: the 8 rows of one ldmatrix land on 8 distinct bank quads.
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * kBK + ((chunk ^ ((row >> 1) & 3)) * kChunkElems);
}

// One thread's share of a stage's loads, fixed for the whole K range: thread t copies chunk
// t % 4 of rows t / 4 + 32 i (weight i = 0..3, activations i = 0..1). Rows 32 apart share the
// swizzle ((32 i >> 1) & 3 == 0), so one shared offset serves all of them.
template <typename T>
struct StageLoader {
    static constexpr int kRowStep = kThreads / kKChunks;  // 32
    const T* w_src;      // weight row n0 + t / 4 at the thread's chunk of the split's first k
    const T* a_src;      // activation row m0 + t / 4, likewise
    long long row_step;  // kRowStep rows, in elements
    int s_offset;        // swizzled(t / 4, t % 4)
    int k_first;         // k of the thread's chunk in the split's first tile
    int w_rows;          // weight rows of this thread that are < N (a prefix of 0..4)
    int a_rows;          // activation rows that are < M (a prefix of 0..2)
    int a_loaded;        // activation rows inside the 16-row groups the warps read

    __device__ __forceinline__ StageLoader(const T* w, const T* a, int n0, int m0, int rows,
                                           int m_groups, int N, int K, int k_begin) {
        const int r0 = threadIdx.x / kKChunks, chunk = threadIdx.x % kKChunks;
        k_first = k_begin + chunk * kChunkElems;
        w_src = w + static_cast<long long>(n0 + r0) * K + k_first;
        a_src = a + static_cast<long long>(m0 + r0) * K + k_first;
        row_step = static_cast<long long>(kRowStep) * K;
        s_offset = swizzled(r0, chunk);
        w_rows = max(0, min(kBN / kRowStep, (N - n0 - r0 + kRowStep - 1) / kRowStep));
        a_rows = max(0, min(kBM / kRowStep, (rows - r0 + kRowStep - 1) / kRowStep));
        a_loaded = max(0, min(kBM / kRowStep, (m_groups * 16 - r0 + kRowStep - 1) / kRowStep));
    }

    // Issues the cp.async loads of k-tile kt of the split into one stage; chunks past N, M or
    // k_end read nothing and land as zeros.
    __device__ __forceinline__ void load(T* s_stage, const T* w, const T* a, int kt,
                                         int k_end) const {
        const int k_offset = kt * kBK;
        const bool k_ok = k_first + k_offset < k_end;
        T* s_w = s_stage + s_offset;
        T* s_a = s_stage + kBN * kBK + s_offset;
#pragma unroll
        for (int i = 0; i < kBN / kRowStep; ++i) {
            const bool valid = k_ok && i < w_rows;
            const T* p = valid ? w_src + i * row_step + k_offset : w;
            cp_async_16_zfill(s_w + i * kRowStep * kBK, p, valid ? kChunkBytes : 0);
        }
#pragma unroll
        for (int i = 0; i < kBM / kRowStep; ++i) {
            if (i >= a_loaded) break;  // rows no n8 tile reads
            const bool valid = k_ok && i < a_rows;
            const T* p = valid ? a_src + i * row_step + k_offset : a;
            cp_async_16_zfill(s_a + i * kRowStep * kBK, p, valid ? kChunkBytes : 0);
        }
    }
};

template <typename T, typename OutT>
__device__ __forceinline__ void skinny_tc(OutT* out, float* partial, const T* __restrict__ a,
                                          const T* __restrict__ w, const T* __restrict__ bias,
                                          const OutT* residual, int M, int N, int K,
                                          int k_split) {
    DYNAMIC_SMEM(T, smem);  // kStages x ([kBN][kBK] weight, [kBM][kBK] activations)
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int n0 = blockIdx.x * kBN;
    const int m0 = blockIdx.y * kBM;
    const int rows = min(kBM, M - m0);
    const int m_groups = (rows + 15) / 16;  // 16-row groups of activations (one ldmatrix_x4)
    const int k_begin = blockIdx.z * k_split;
    const int k_end = min(K, k_begin + k_split);
    const int num_k_tiles = (k_end - k_begin + kBK - 1) / kBK;

    float acc[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;

    const StageLoader<T> loader(w, a, n0, m0, rows, m_groups, N, K, k_begin);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_k_tiles) loader.load(smem + s * kStageElems, w, a, s, k_end);
        cp_async_commit();
    }

    for (int kt = 0; kt < num_k_tiles; ++kt) {
        cp_async_wait<kStages - 2>();  // tile kt has landed (for this thread) ...
        __syncthreads();               // ... for every thread; and stage kt-1 is free
        const int next = kt + kStages - 1;
        if (next < num_k_tiles)
            loader.load(smem + (next % kStages) * kStageElems, w, a, next, k_end);
        cp_async_commit();

        const T* s_w = smem + (kt % kStages) * kStageElems;
        const T* s_a = s_w + kBN * kBK;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            uint32_t w_frag[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const int row = warp * kWarpRows + mt * 16 + (lane & 15);
                ldmatrix_x4(w_frag[mt], s_w + swizzled(row, kk * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int g = 0; g < kNTiles / 2; ++g) {
                if (g >= m_groups) break;  // uniform: activation rows past M
                uint32_t r[4];
                const int arow = g * 16 + (lane >> 4) * 8 + (lane & 7);
                ldmatrix_x4(r, s_a + swizzled(arow, kk * 2 + ((lane >> 3) & 1)));
                const uint32_t b_lo[2] = {r[0], r[1]};
                const uint32_t b_hi[2] = {r[2], r[3]};
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    mma_m16n8k16_acc<T>(acc[mt][2 * g], w_frag[mt], b_lo);
                    mma_m16n8k16_acc<T>(acc[mt][2 * g + 1], w_frag[mt], b_hi);
                }
            }
        }
    }
    cp_async_wait_all();  // only empty groups remain; leave nothing pending at exit

    // acc[mt][nt][j]: weight row n = .. + (lane >> 2) (+ 8 for j >= 2), activation row
    // m = nt * 8 + 2 (lane & 3) (+ 1 for odd j).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            if (nt * 8 >= rows) break;  // uniform
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int n = n0 + warp * kWarpRows + mt * 16 + (lane >> 2) + (j >> 1) * 8;
                const int m = nt * 8 + (lane & 3) * 2 + (j & 1);
                if (n >= N || m >= rows) continue;
                if (gridDim.z == 1) {
                    gemm_skinny::finish<T, OutT>(out, bias, residual, m0 + m, n, N,
                                                 acc[mt][nt][j]);
                } else {
                    partial[(static_cast<long long>(blockIdx.z) * M + m0 + m) * N + n] =
                        acc[mt][nt][j];
                }
            }
        }
    }
}

}  // namespace gemm_skinny_tc

#define PAGEDRUN_SKINNY(DT, T, ODT, OutT, MT, RPW)                                               \
    extern "C" __global__ void __launch_bounds__(gemm_skinny::kThreads)                          \
        gemm_skinny_##DT##_o##ODT##_m##MT(OutT* out, float* partial, const T* a, const T* w,    \
                                           const T* bias, const OutT* residual, int M, int N,   \
                                           int K, int k_split) {                                \
        gemm_skinny::skinny<T, OutT, MT, RPW>(out, partial, a, w, bias, residual, M, N, K,       \
                                              k_split);                                         \
    }

#define PAGEDRUN_SPLITK_REDUCE(DT, T, ODT, OutT)                                                 \
    extern "C" __global__ void __launch_bounds__(gemm_skinny::kThreads)                          \
        gemm_splitk_reduce_##DT##_o##ODT(OutT* out, const float* partial, const T* bias,        \
                                         const OutT* residual, int M, int N, int num_splits) {  \
        gemm_skinny::splitk_reduce<T, OutT>(out, partial, bias, residual, M, N, num_splits);     \
    }

#define PAGEDRUN_SKINNY_PAIR(DT, T, ODT, OutT)   \
    PAGEDRUN_SKINNY(DT, T, ODT, OutT, 8, 4)      \
    PAGEDRUN_SKINNY(DT, T, ODT, OutT, 64, 1)     \
    PAGEDRUN_SPLITK_REDUCE(DT, T, ODT, OutT)

PAGEDRUN_SKINNY_PAIR(f32, float, f32, float)
PAGEDRUN_SKINNY_PAIR(f16, __half, f16, __half)
PAGEDRUN_SKINNY_PAIR(f16, __half, f32, float)
PAGEDRUN_SKINNY_PAIR(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
PAGEDRUN_SKINNY_PAIR(bf16, __nv_bfloat16, f32, float)

#define PAGEDRUN_SKINNY_TC(DT, T, ODT, OutT)                                                     \
    extern "C" __global__ void __launch_bounds__(gemm_skinny_tc::kThreads,                       \
                                                 gemm_skinny_tc::kMinCtasPerSm)                 \
        gemm_skinny_tc_##DT##_o##ODT(OutT* out, float* partial, const T* a, const T* w,         \
                                     const T* bias, const OutT* residual, int M, int N, int K,  \
                                     int k_split) {                                             \
        gemm_skinny_tc::skinny_tc<T, OutT>(out, partial, a, w, bias, residual, M, N, K,         \
                                           k_split);                                            \
    }

PAGEDRUN_SKINNY_TC(f16, __half, f16, __half)
PAGEDRUN_SKINNY_TC(f16, __half, f32, float)
PAGEDRUN_SKINNY_TC(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
PAGEDRUN_SKINNY_TC(bf16, __nv_bfloat16, f32, float)
