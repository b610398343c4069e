// gemm_wq.cu -- weight-only quantized GEMM (W8A16, W4A16): 16-bit activations, int8 or 4-bit
// weights dequantized on the fly, tensor cores (mma.sync m16n8k16) with fp32 accumulation.
//
// Computes, for every row m < M and column n < N:
//   out[m, n] = sum_k x[m, k] * W[n, k]  (+ bias[n] if bias != nullptr)
// with W[n, k] = dequant(q)[n, k] rounded once to T (the mma operand type), products and sums
// in fp32, one rounding to T at the end.
//   W8A16: W[n, k] = s[k / g, n] * q8[n, k]                 (symmetric int8)
//   W4A16: W[n, k] = s[k / g, n] * (q4[n, k] - z[k / g, n]) (AWQ / GPTQ asymmetric, q4, z in
//          0..15)
// g = group_size along K: 32, 64, 128 (or K itself: per-channel); K % 32 == 0, K % g == 0.
//
// Pointers (T = __half | __nv_bfloat16 per instantiation; all contiguous, row-major):
//   out       [M, N]                 T
//   x         [M, K]                 T    (16-byte aligned)
//   bias      [N]                    T    or nullptr
//   W8A16:
//     qweight [N, K]                 int8 (the HF [out, in] layout; 16-byte aligned)
//     scales  [K / g, N]             T
//   W4A16 (layout produced by runtime/kernels/wq_pack.py: pack_w4):
//     qweight [K / 32, N, 4]         uint32: k-tile kt (32 k), row n = 4 words = 16 bytes, so
//             one k-tile of 64 rows is one contiguous 1 KiB run and each thread loads its row
//             half (8 bytes) with consecutive threads on consecutive addresses (coalesced, no
//             bank or sector waste). Word w covers k = kt*32 + w*8 + e, e = 0..7, with element
//             e in nibble (e >> 1) + 4 * (e & 1), i.e. nibbles hold e = 0,2,4,6,1,3,5,7: pair
//             (2i, 2i+1) sits in bits [4i, 4i+4) and [4i+16, 4i+20), so `(w >> 4i) & 0x000f000f`
//             yields both halves of a packed pair at once (the magic-number conversion
//             1024 + q (f16 0x6400) / 128 + q (bf16 0x4300), see dequant_pair).
//     scales  [K / g, N]             T
//     zeros   [K / g, N]             uint8 (0..15)
//
// One kernel family for any M: CTA = 128 threads (4 warps), tile BM x 64 x 32, BM = 16 * MT
// (MT = 1: decode, M <= 16; MT = 4: prefill). Each k-tile: x tile [BM][32] T (16-byte loads,
// zero rows past M) and the dequantized weight tile [64][32] T go to shared memory, swizzled as
// in gemm.cu's K-major tiles (chunk' = chunk ^ ((row >> 1) & 3): conflict-free ldmatrix);
// each warp owns 16 columns (2 n8 tiles) and all BM rows (MT m16 tiles). The weight tile lies
// in one quantization group because g % 32 == 0, so a thread reads one scale (and zero) per
// k-tile. Not pipelined: load -> dequantize -> __syncthreads -> mma -> __syncthreads.
//
// Split-K (decode): with partial != nullptr, CTA z covers k-tiles [z * kps, (z + 1) * kps)
// (kps = k_tiles_per_split) and writes its raw fp32 sums to partial [splits, M, N] (no bias);
// gemm_wq_splitk_reduce_DT adds the slices and the bias and rounds once to T. Without it the
// decode grid is only N / 64 CTAs (64 for N = 4096: fewer than one per SM).
//
// Bytes in flight (decode, H200): one k-tile per CTA is outstanding at a time (synchronous
// loads). Per k-tile a CTA loads qweight 64 x 16 B (W4) or 64 x 32 B (W8), scales 64 x 2 B,
// zeros 64 B (W4) and x BM x 64 B (only M real rows: 64 B at M = 1) ~ 1.3 KiB (W4, M = 1) /
// 2.2 KiB (W8). Little's law wants 4.8 TB/s x 700 ns / 132 SMs ~ 25 KiB per SM. The decode
// tile uses 48 registers (<= 64 by launch bounds) and 5 KiB of shared memory, so 10 CTAs fit
// per SM (register-limited): ~13 KiB (W4) / ~22 KiB (W8) in flight, i.e. at most ~50% / ~85%
// of HBM bandwidth, and only if the grid fills the machine -- runtime/kernels/gemm_wq.py picks the
// split count for >= 8 CTAs per SM. Issue: the k-tile loop is ~140 SASS instructions per warp
// (docs/kernel_report.md), 4 warps per CTA: ~140 SM clocks per ~1.3 KiB (W4, M = 1) -> ~9
// B/clock/SM ~ 2.3 TB/s, about half of HBM -- so decode is issue-bound about as much as
// latency-bound. Next: a cp.async double buffer (twice the bytes in flight), more rows per
// thread (fewer address / index instructions per weight byte), a register-only decode path.
// W4 dequantizes two weights per HSUB2 + HMUL2 (magic-number conversion, dequant_pair); W8
// still converts through float. Prefill (MT = 4) runs 16 mma per warp per k-tile against the
// same ~130 other instructions: issue-bound on loads and dequantization, not on tensor cores.
//
// Launch geometry: grid (ceil(N / 64), ceil(M / BM), splits), block 128, no dynamic shared
// memory (static (BM + 64) x 32 x 2 bytes); reduce: grid ceil(M * N / 128), block 128.
// runtime/kernels/gemm_wq.py picks MT = 1 for M <= 16.
// Instantiations (extern "C"; DT in {f16, bf16}, BM in {16, 64} for MT = 1, 4):
//   gemm_w8a16_DT_mBM(out, partial, x, qweight, scales, bias, M, N, K, group_size, kps)
//   gemm_w4a16_DT_mBM(out, partial, x, qweight, scales, zeros, bias, M, N, K, group_size, kps)
//   gemm_wq_splitk_reduce_DT(out, partial, bias, M, N, num_splits)
// (partial: float [splits, M, N] or nullptr; with nullptr, pass kps = K / 32, one split.)
//
// Register budget: 128 per thread at 128 threads (32 accumulators at MT = 4); the gate must
// show 0 spill bytes.
// Measured: none (no GPU run yet).
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "ptx.cuh"

namespace gemm_wq {

using gemm_epilogue::epilogue_pair;

constexpr int kThreads = 128;
// __launch_bounds__ min blocks per SM: 8 for the decode tile (<= 64 registers: 48 are used),
// 4 for the prefill tile (<= 128). Without the hint ptxas (sm_90) picks 64 registers for the
// 64-row W4 tile and spills 8 bytes.
template <int MT> constexpr int kMinBlocks = MT == 1 ? 8 : 4;
constexpr int kBN = 64;         // CTA columns: 4 warps x 16
constexpr int kBK = 32;         // k per tile; the K granularity
constexpr int kWarpN = 16;
constexpr int kChunkElems = 8;  // 16 bytes of T
constexpr int kKChunks = kBK / kChunkElems;
constexpr int kW4WordsPerRow = kBK / 8;  // 4 uint32 per (k-tile, row)

__device__ __forceinline__ int kmajor_offset(int row, int chunk) {
    return row * kBK + ((chunk ^ ((row >> 1) & 3)) * kChunkElems);
}

// 16 bytes as 4 words, byte-wise under the harness (no type punning there), one load on GPU.
__device__ __forceinline__ uint4 load16(const void* p) {
#if defined(PAGEDRUN_SIM)
    uint4 v;
    memcpy(&v, p, 16);
    return v;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}
__device__ __forceinline__ uint2 load8(const void* p) {
#if defined(PAGEDRUN_SIM)
    uint2 v;
    memcpy(&v, p, 8);
    return v;
#else
    return *reinterpret_cast<const uint2*>(p);
#endif
}
__device__ __forceinline__ void store_chunk(void* dst, uint32_t w0, uint32_t w1, uint32_t w2,
                                            uint32_t w3) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w0, w1, w2, w3);
}

// x tile [BM][32] of k-tile starting at k0: one 16-byte chunk per thread-iteration, zeros
// past M (K % 32 == 0, so every chunk is inside K).
template <typename T, int BM>
__device__ __forceinline__ void load_x_tile(T* s_x, const T* x, int m0, int k0, int M, int K) {
    // A compile-time trip count (1 or 2): a strided loop on threadIdx.x compiled to a generic
    // 4x-unrolled loop with ~170 SASS instructions per k-tile.
#pragma unroll
    for (int i = 0; i < (BM * kKChunks + kThreads - 1) / kThreads; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        if (BM * kKChunks % kThreads != 0 && idx >= BM * kKChunks) break;
        const int row = idx / kKChunks, chunk = idx % kKChunks;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m0 + row < M)
            v = load16(x + static_cast<long long>(m0 + row) * K + k0 + chunk * kChunkElems);
        store_chunk(s_x + kmajor_offset(row, chunk), v.x, v.y, v.z, v.w);
    }
}

// Dequantized int8 weight tile [64][32]: thread t takes row t / 2, k half t % 2 (16 k).
template <typename T>
__device__ __forceinline__ void load_w8_tile(T* s_w, const int8_t* q, const T* scales, int n0,
                                             int k0, int N, int K, int group_size) {
    const int row = threadIdx.x / 2, half = threadIdx.x % 2;
    const int n = n0 + row;
    uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (n < N) {
        const float s = to_f32(scales[static_cast<long long>(k0 / group_size) * N + n]);
        const uint4 v = load16(q + static_cast<long long>(n) * K + k0 + half * 16);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t word = words[i / 2];
            const int sh = 16 * (i % 2);
            const float lo = static_cast<float>(static_cast<int8_t>((word >> sh) & 0xffu));
            const float hi = static_cast<float>(static_cast<int8_t>((word >> (sh + 8)) & 0xffu));
            w[i] = pack2<T>(s * lo, s * hi);
        }
    }
    store_chunk(s_w + kmajor_offset(row, 2 * half), w[0], w[1], w[2], w[3]);
    store_chunk(s_w + kmajor_offset(row, 2 * half + 1), w[4], w[5], w[6], w[7]);
}

// Bits [0, 4) and [16, 20) of `word` as the packed T pair s * (q - z), by the magic-number
// conversion: OR-ing a nibble q into the mantissa of 1024.0 (f16 0x6400) or 128.0 (bf16
// 0x4300) gives the T value base + q exactly; subtracting base + z (exact: integers up to
// 1039 / 143 are representable) leaves q - z, and one multiplication by s rounds once -- the
// same value as s * (q - z) computed in float and rounded to T (the product of s and a 5-bit
// integer is exact in float). Two 16-bit lanes per instruction.
template <typename T> struct Magic;
template <> struct Magic<__half> {
    using T2 = __half2;
    static constexpr uint32_t kBits = 0x64006400u;
    static constexpr float kBase = 1024.f;
    static __device__ __forceinline__ T2 from_bits(uint32_t b) {
        return __halves2half2(__ushort_as_half(static_cast<unsigned short>(b & 0xffffu)),
                              __ushort_as_half(static_cast<unsigned short>(b >> 16)));
    }
    static __device__ __forceinline__ uint32_t to_bits(T2 v) {
        return static_cast<uint32_t>(__half_as_ushort(v.x)) |
               (static_cast<uint32_t>(__half_as_ushort(v.y)) << 16);
    }
    static __device__ __forceinline__ T2 splat(float v) { return __float2half2_rn(v); }
};
template <> struct Magic<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    static constexpr uint32_t kBits = 0x43004300u;
    static constexpr float kBase = 128.f;
    static __device__ __forceinline__ T2 from_bits(uint32_t b) {
        return __halves2bfloat162(
            __ushort_as_bfloat16(static_cast<unsigned short>(b & 0xffffu)),
            __ushort_as_bfloat16(static_cast<unsigned short>(b >> 16)));
    }
    static __device__ __forceinline__ uint32_t to_bits(T2 v) {
        return static_cast<uint32_t>(__bfloat16_as_ushort(v.x)) |
               (static_cast<uint32_t>(__bfloat16_as_ushort(v.y)) << 16);
    }
    static __device__ __forceinline__ T2 splat(float v) { return __float2bfloat162_rn(v); }
};

template <typename T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t word, typename Magic<T>::T2 s2,
                                                 typename Magic<T>::T2 base_z2) {
    const auto v = Magic<T>::from_bits((word & 0x000f000fu) | Magic<T>::kBits);
    return Magic<T>::to_bits(__hmul2(__hsub2(v, base_z2), s2));
}

// Dequantized 4-bit weight tile [64][32]: thread t takes row t / 2, words 2(t % 2), +1.
template <typename T>
__device__ __forceinline__ void load_w4_tile(T* s_w, const uint32_t* q, const T* scales,
                                             const uint8_t* zeros, int n0, int kt, int N,
                                             int group_size) {
    const int row = threadIdx.x / 2, half = threadIdx.x % 2;
    const int n = n0 + row;
    uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (n < N) {
        const long long g = static_cast<long long>(kt * kBK / group_size) * N + n;
        const auto s2 = Magic<T>::splat(to_f32(scales[g]));
        const auto base_z2 = Magic<T>::splat(Magic<T>::kBase + static_cast<float>(zeros[g]));
        const uint2 v = load8(q + (static_cast<long long>(kt) * N + n) * kW4WordsPerRow +
                              2 * half);
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // pair (2i, 2i + 1): nibbles i and i + 4
            w[i] = dequant_pair<T>(v.x >> (4 * i), s2, base_z2);
            w[4 + i] = dequant_pair<T>(v.y >> (4 * i), s2, base_z2);
        }
    }
    store_chunk(s_w + kmajor_offset(row, 2 * half), w[0], w[1], w[2], w[3]);
    store_chunk(s_w + kmajor_offset(row, 2 * half + 1), w[4], w[5], w[6], w[7]);
}


// W4 = false: q is int8 [N, K]; W4 = true: q is uint32 [K / 32, N, 4] and zeros is used.
template <typename T, int MT, bool W4>
__device__ __forceinline__ void gemm_wq(T* out, const T* __restrict__ x, const void* q,
                                        const T* __restrict__ scales,
                                        const uint8_t* __restrict__ zeros,
                                        const T* __restrict__ bias, float* partial, int M,
                                        int N, int K, int group_size, int k_tiles_per_split) {
    constexpr int kBM = 16 * MT;
    __shared__ __align__(16) T s_x[kBM * kBK];
    __shared__ __align__(16) T s_w[kBN * kBK];
    const int m0 = blockIdx.y * kBM;
    const int n0 = blockIdx.x * kBN;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;

    const int kt_begin = blockIdx.z * k_tiles_per_split;
    const int kt_end = min(K / kBK, kt_begin + k_tiles_per_split);
    for (int kt = kt_begin; kt < kt_end; ++kt) {
        const int k0 = kt * kBK;
        load_x_tile<T, kBM>(s_x, x, m0, k0, M, K);
        if constexpr (W4)
            load_w4_tile<T>(s_w, static_cast<const uint32_t*>(q), scales, zeros, n0, kt, N,
                            group_size);
        else
            load_w8_tile<T>(s_w, static_cast<const int8_t*>(q), scales, n0, k0, N, K,
                            group_size);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            uint32_t b4[4];
            const int nrow = warp * kWarpN + (lane >> 4) * 8 + (lane & 7);
            ldmatrix_x4(b4, s_w + kmajor_offset(nrow, kk * 2 + ((lane >> 3) & 1)));
            const uint32_t b_frag[2][2] = {{b4[0], b4[1]}, {b4[2], b4[3]}};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                uint32_t a_frag[4];
                ldmatrix_x4(a_frag, s_x + kmajor_offset(mt * 16 + (lane & 15),
                                                        kk * 2 + (lane >> 4)));
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
                    mma_m16n8k16_acc<T>(acc[mt][nt], a_frag, b_frag[nt]);
            }
        }
        __syncthreads();  // the next k-tile overwrites both tiles
    }

    if (partial != nullptr) {  // split-K: raw fp32 sums of this K slice, no bias
        float* p = partial + static_cast<long long>(blockIdx.z) * M * N;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int row = m0 + mt * 16 + (lane >> 2) + 8 * (j / 2);
                    const int col = n0 + warp * kWarpN + nt * 8 + (lane & 3) * 2 + (j % 2);
                    if (row < M && col < N)
                        p[static_cast<long long>(row) * N + col] = acc[mt][nt][j];
                }
        return;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int row = m0 + mt * 16 + (lane >> 2);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int col = n0 + warp * kWarpN + nt * 8 + (lane & 3) * 2;
            epilogue_pair<T, T>(out, bias, nullptr, row, col, acc[mt][nt][0], acc[mt][nt][1], M,
                                N);
            epilogue_pair<T, T>(out, bias, nullptr, row + 8, col, acc[mt][nt][2], acc[mt][nt][3],
                                M, N);
        }
    }
}

// out[m, n] = sum_z partial[z, m, n] (+ bias[n]): one thread per output.
template <typename T>
__device__ __forceinline__ void splitk_reduce(T* out, const float* partial, const T* bias, int M,
                                              int N, int num_splits) {
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long size = static_cast<long long>(M) * N;
    if (idx >= size) return;
    float v = 0.f;
    for (int z = 0; z < num_splits; ++z) v += partial[z * size + idx];
    if (bias != nullptr) v += to_f32(bias[idx % N]);
    out[idx] = from_f32<T>(v);
}

}  // namespace gemm_wq

#define PAGEDRUN_GEMM_WQ(DT, T, MT, BM)                                                        \
    extern "C" __global__ void __launch_bounds__(gemm_wq::kThreads, gemm_wq::kMinBlocks<MT>)   \
        gemm_w8a16_##DT##_m##BM(T* out, float* partial, const T* x, const int8_t* qweight,     \
                                const T* scales, const T* bias, int M, int N, int K,           \
                                int group_size, int k_tiles_per_split) {                       \
        gemm_wq::gemm_wq<T, MT, false>(out, x, qweight, scales, nullptr, bias, partial, M, N,  \
                                       K, group_size, k_tiles_per_split);                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(gemm_wq::kThreads, gemm_wq::kMinBlocks<MT>)   \
        gemm_w4a16_##DT##_m##BM(T* out, float* partial, const T* x, const uint32_t* qweight,   \
                                const T* scales, const uint8_t* zeros, const T* bias, int M,   \
                                int N, int K, int group_size, int k_tiles_per_split) {         \
        gemm_wq::gemm_wq<T, MT, true>(out, x, qweight, scales, zeros, bias, partial, M, N, K,  \
                                      group_size, k_tiles_per_split);                          \
    }

#define PAGEDRUN_GEMM_WQ_REDUCE(DT, T)                                                         \
    extern "C" __global__ void __launch_bounds__(gemm_wq::kThreads)                            \
        gemm_wq_splitk_reduce_##DT(T* out, const float* partial, const T* bias, int M, int N,  \
                                   int num_splits) {                                           \
        gemm_wq::splitk_reduce<T>(out, partial, bias, M, N, num_splits);                       \
    }

PAGEDRUN_GEMM_WQ(f16, __half, 1, 16)
PAGEDRUN_GEMM_WQ(f16, __half, 4, 64)
PAGEDRUN_GEMM_WQ(bf16, __nv_bfloat16, 1, 16)
PAGEDRUN_GEMM_WQ(bf16, __nv_bfloat16, 4, 64)
PAGEDRUN_GEMM_WQ_REDUCE(f16, __half)
PAGEDRUN_GEMM_WQ_REDUCE(bf16, __nv_bfloat16)
