// gemm_skinny.cu -- memory-bound GEMM for decode-sized M (<= 64 rows): every weight byte is
// read once with 16-byte loads, split over K when N alone cannot fill the GPU; plus the
// split-K reduction with the fused epilogue.
//
// Computes out[m, n] = sum_k a[m, k] * w[n, k] (+ bias[n]) (+ residual[m, n]), fp32 math.
//
// Pointers (T = float | __half | __nv_bfloat16, OutT = T or float; contiguous, row-major):
//   a         [M, K]              T     activations, M <= 64 per m-tile row of the grid
//   w         [N, K]              T     weight in the HF "nk" layout (out x in)
//   bias      [N]                 T     or nullptr
//   residual  [M, N]              OutT  or nullptr (may alias out)
//   out       [M, N]              OutT  written when num_splits == 1
//   partial   [num_splits, M, N]  float written when num_splits > 1 (then the reduce kernel
//                                       applies bias / residual and writes out)
//
// Algorithm: a CTA of 8 warps walks its K range in tiles of 32 lanes x 16 bytes (256 elements
// for 16-bit T, 128 for f32). Per tile the CTA stages the [M_TILE, tile] slice of `a` in shared
// memory (one 16-byte load per chunk); each warp owns ROWS_PER_WARP weight rows, each lane
// loads 16 contiguous bytes of each (coalesced 512-byte row segments per warp), and
// accumulates M_TILE x ROWS_PER_WARP dot products in registers (a read once from shared
// memory per m and reused across the warp's rows). The warp then sums lanes with shuffles.
// M_TILE = 8 keeps 4 weight rows per warp (fewer, longer CTAs for batch-1 decode); M_TILE = 64
// takes one row per warp to stay within the register budget.
// Needs K % (16 / sizeof(T)) == 0 (the wrapper's plan falls back to gemm.cu otherwise).
//
// Launch geometry: grid (ceil(N / (8 * ROWS_PER_WARP)), ceil(M / M_TILE), num_splits),
// block 256; k_split (elements per split) is a multiple of the tile (256 or 128). Dynamic
// shared memory: M_TILE * 512 bytes (4 KiB at M_TILE 8, 32 KiB at 64).
// Reduce: grid ceil(M * N / 256), block 256, no shared memory.
//
// Instantiations: gemm_skinny_DT_oODT_mMT for DT in {f16, bf16} with ODT in {DT, f32}, and
// DT = ODT = f32; MT in {8, 64}. gemm_splitk_reduce_DT_oODT for the same (DT, ODT) pairs.
// Scalars: int M, N, K, k_split (skinny); int M, N, num_splits (reduce).
// Signatures: gemm_skinny_*(out, partial, a, w, bias, residual, M, N, K, k_split) -- with
// num_splits > 1 the wrapper passes out, bias and residual as null and the reduce applies them;
// gemm_splitk_reduce_*(out, partial, bias, residual, M, N, num_splits).
// Launched by runtime/kernels/gemm.py: gemm / linear when runtime/kernels/gemm_plan.py picks
// "skinny" (the m-tile and the split of K are chosen there).
//
// Register budget: 128 per thread at 256 threads (m64: 64 accumulators; m8: 32 accumulators
// plus 4 rows of 8 weights); the gate must show 0 spill bytes.
// Measured: no GPU numbers yet (benchmarks/kernels/bench_gemm.py: GB/s of weight reads vs a
// device-to-device copy).
#include "common.cuh"

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

template <typename T, typename OutT>
__device__ __forceinline__ void finish(OutT* out, const T* bias, const OutT* residual, int m,
                                       int n, int N, float v) {
    if (bias != nullptr) v += to_f32(bias[n]);
    const long long idx = static_cast<long long>(m) * N + n;
    if (residual != nullptr) v += to_f32(residual[idx]);
    out[idx] = from_f32<OutT>(v);
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

#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int n = n_first + r;
#pragma unroll
        for (int m = 0; m < M_TILE; ++m) {
            if (m >= rows) break;  // uniform over the warp
            float v = acc[r][m];
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1)
                v += __shfl_xor_sync(kFullMask, v, offset);
            if (lane != 0 || n >= N) continue;
            if (gridDim.z == 1) {
                finish<T, OutT>(out, bias, residual, m0 + m, n, N, v);
            } else {
                partial[(static_cast<long long>(blockIdx.z) * M + m0 + m) * N + n] = v;
            }
        }
    }
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
