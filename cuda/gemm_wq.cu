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
//   Weights pre-shuffled by runtime/kernels/wq_pack.py (pack_w4 / pack_w8, pack_groups); Ng =
//   ceil(N / 32) column groups of 32 output rows, rows past N zero:
//   W4A16:
//     qweight [K / 32, Ng, 32, 4]    uint32: the mma fragments. Word [kt, ng, l, j] holds the 8
//             weights W[32 ng + 8j + l / 4][32 kt + 8 (l % 4) + e], e = 0..7, element e in
//             nibble (e >> 1) + 4 * (e & 1), i.e. nibbles hold e = 0,2,4,6,1,3,5,7: pair
//             (2i, 2i+1) sits in bits [4i, 4i+4) and [4i+16, 4i+20), so `(w >> 4i) & 0x000f000f`
//             yields both halves of a packed pair at once (the magic-number conversion
//             1024 + q (f16 0x6400) / 128 + q (bf16 0x4300), see dequant_pair). One
//             (k-tile, column group) is a contiguous 512-byte run: lane l's 16 bytes at 16 l.
//     zeros   [K / g, Ng * 32]       uint8 (0..15), in the scales' order (one 4-byte load)
//   W8A16:
//     qweight [K / 32, Ng, 32, 8]    uint32: the same fragments, a byte per weight: words
//             [kt, ng, l, 2j + h] hold W[32 ng + 8j + l / 4][32 kt + 8 (l % 4) + 4h + b] in
//             byte b; lane l's 32 bytes (two 16-byte loads) at 32 l of a 1 KiB run
//   scales    [K / g, Ng * 32]       T; within a group of 32 columns, column 4r + j holds
//             column 8j + r (a lane's four n8 tiles: one 8-byte load); padding 0
//
// Two designs:
// - Decode (M <= 16, gemm_w{4,8}a16_DT_m8 / _m16: 1 or 2 tiles of 8 tokens), dequantized in
//   registers, no shared memory and no barrier (gemm_wq_decode below): out^T = W x^T with W as
//   the mma's A operand, x as its B operand, k permuted within each 32-k tile identically for
//   both so that a lane's weight bytes and its 16 bytes of each token row are exactly its
//   fragments. 4 warps per CTA, one 32-column group each; loads run 4 k-tiles ahead in a
//   register ring.
// - The shared-memory tile (prefill, M > 16, gemm_w{4,8}a16_DT_m64): CTA = 128 threads (4
//   warps), tile 64 x 64 x 32. Each k-tile: x tile [64][32] T (16-byte loads, zero rows past M)
//   and the dequantized weight tile [64][32] T go to shared memory, swizzled as in gemm.cu's
//   K-major tiles (chunk' = chunk ^ ((row >> 1) & 3): conflict-free ldmatrix); each warp owns
//   16 columns (2 n8 tiles) and all 64 rows (4 m16 tiles). Not pipelined: load -> dequantize
//   -> __syncthreads -> mma -> __syncthreads.
// A k-tile lies in one quantization group because g % 32 == 0: one scale (and zero) per column
// per k-tile.
//
// Split-K (decode): with partial != nullptr, CTA z covers k-tiles [z * kps, (z + 1) * kps)
// (kps = k_tiles_per_split) and writes its raw fp32 sums to partial [splits, M, N] (no bias);
// gemm_wq_splitk_reduce_DT adds the slices and the bias and rounds once to T. Without it the
// decode grid is only N / 128 CTAs: fewer than one per SM at N = 4096.
//
// Bytes in flight (decode, H200; Little's law wants 4.8 TB/s x 700 ns / 132 SMs ~ 25 KiB per
// SM; numbers from docs/kernel_report.md). W4 m8: 96 registers (<= 128 by launch bounds), so
// 5 CTAs = 20 warps per SM, each with 4 k-tiles x 512 B of weights outstanding: ~40 KiB per
// SM. Issue: ~107 non-memory, non-tensor SASS instructions per warp per k-tile (16
// dequantizing HADD2 + 16 HMUL2, 16 LOP3, 12 shifts, 8 PRMT for scales and zero points, the
// rest addressing), ~115 issue slots per 512 B of weights: ~18 B per SM clock at 4 warps
// issuing, ~4.6 TB/s -- about HBM's 4.8, so the kernel should sit at the bandwidth with little
// room to spare (the target: >= 80% of copy bandwidth counted in int4 bytes). W8 m8: 103
// (f16) / 123 (bf16) registers, 4 CTAs per SM, 4 x 1 KiB per warp in flight (~64 KiB per SM);
// ~108 (f16: magic-number conversion, one PRMT per pair) / ~148 (bf16: through float) other
// instructions per 1 KiB k-tile: twice the bytes per instruction of W4, not issue-bound.
// Prefill (m64) runs 16 mma per warp per k-tile against ~90-116 other instructions:
// issue-bound on loads and dequantization (46-56% of the tensor peak in the model).
//
// Launch geometry: decode: grid (ceil(N / 128), ceil(M / (8 NT)), splits), block 128, no
// shared memory; the tile: grid (ceil(N / 64), ceil(M / 64), 1), block 128, static shared
// memory 2 x 64 x 32 x 2 bytes; reduce: grid ceil(M * N / 128), block 128.
// runtime/kernels/gemm_wq.py picks the kernel by M (m8 for M <= 8, m16 for M <= 16, m64).
// Instantiations (extern "C"; DT in {f16, bf16}, BITS in {4, 8}, BM in {8, 16, 64}):
//   gemm_wBITSa16_DT_mBM(out, partial, x, qweight, scales, zeros, bias, M, N, K, group_size,
//                        kps)        (zeros: nullptr for W8)
//   gemm_wq_splitk_reduce_DT(out, partial, bias, M, N, num_splits)
// (partial: float [splits, M, N] or nullptr; with nullptr, pass kps = K / 32, one split.)
//
// Register budget: 128 per thread at 128 threads (32 accumulators in the 64-row tile; the
// decode ring: 4 x (16 or 32 + 16 NT + 12) bytes per lane); the gate must show 0 spill bytes.
// Measured: none (no GPU run yet).
#include "common.cuh"
#include "gemm_epilogue.cuh"
#include "ptx.cuh"

namespace gemm_wq {

using gemm_epilogue::epilogue_pair;

constexpr int kThreads = 128;
// __launch_bounds__ min blocks per SM, 4 for both (<= 128 registers): the 64-row tile (without
// the hint ptxas (sm_90) picks 64 registers for the W4 tile and spills 8 bytes) and the
// register-only decode kernel (its load ring).
constexpr int kTileMinBlocks = 4;
constexpr int kDecodeMinBlocks = 4;
constexpr int kBN = 64;         // CTA columns: 4 warps x 16
constexpr int kBK = 32;         // k per tile; the K granularity
constexpr int kWarpN = 16;
constexpr int kChunkElems = 8;  // 16 bytes of T
constexpr int kKChunks = kBK / kChunkElems;
constexpr int kW4GroupN = 32;      // W4: output rows per column group (one decode warp)
constexpr int kW4GroupWords = 128;  // W4: uint32 per (k-tile, column group): 32 lanes x 4
constexpr int kW8GroupWords = 256;  // W8: 32 lanes x 8
constexpr int kDecodeWarps = kThreads / 32;
constexpr int kDecodeStages = 4;    // W4 decode: k-tiles loaded ahead into registers

__device__ __forceinline__ int kmajor_offset(int row, int chunk) {
    return row * kBK + ((chunk ^ ((row >> 1) & 3)) * kChunkElems);
}

// One vector load of V (uint4 / uint2 / uint32_t: 16 / 8 / 4 bytes, aligned by the caller) on
// the GPU; byte-wise under the harness (no type punning there).
template <typename V>
__device__ __forceinline__ V load_vec(const void* p) {
#if defined(PAGEDRUN_SIM)
    V v;
    memcpy(&v, p, sizeof(V));
    return v;
#else
    return *reinterpret_cast<const V*>(p);
#endif
}
__device__ __forceinline__ uint4 load16(const void* p) { return load_vec<uint4>(p); }
__device__ __forceinline__ uint2 load8(const void* p) { return load_vec<uint2>(p); }
__device__ __forceinline__ uint32_t load4(const void* p) { return load_vec<uint32_t>(p); }
// The bits of a 16-bit scale, in the low half of a word.
__device__ __forceinline__ uint32_t scale_bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t scale_bits(__nv_bfloat16 v) {
    return __bfloat16_as_ushort(v);
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

// Bits [0, 4) and [16, 20) of `word` as the packed T pair s * (q - z), by the magic-number
// conversion: OR-ing a nibble q into the mantissa of 1024.0 (f16 0x6400) or 128.0 (bf16
// 0x4300) gives the T value base + q exactly; subtracting base + z (exact: integers up to
// 1039 / 143 are representable) leaves q - z, and one multiplication by s rounds once -- the
// same value as s * (q - z) computed in float and rounded to T (the product of s and a 5-bit
// integer is exact in float). Two 16-bit lanes per instruction.
template <typename T> struct Magic;
template <> struct Magic<__half> {
    using T2 = __half2;
    static constexpr bool kIsHalf = true;
    static constexpr uint32_t kBits = 0x64006400u;
    static constexpr uint32_t kHighBytes = 0x64646464u;  // kBits' high byte, in every byte
    static __device__ __forceinline__ T2 from_bits(uint32_t b) {
#if defined(PAGEDRUN_SIM)
        return __halves2half2(__ushort_as_half(static_cast<unsigned short>(b & 0xffffu)),
                              __ushort_as_half(static_cast<unsigned short>(b >> 16)));
#else
        return *reinterpret_cast<const T2*>(&b);  // one register, no repacking
#endif
    }
    static __device__ __forceinline__ uint32_t to_bits(T2 v) {
#if defined(PAGEDRUN_SIM)
        return static_cast<uint32_t>(__half_as_ushort(v.x)) |
               (static_cast<uint32_t>(__half_as_ushort(v.y)) << 16);
#else
        return *reinterpret_cast<const uint32_t*>(&v);
#endif
    }
};
template <> struct Magic<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    static constexpr bool kIsHalf = false;
    static constexpr uint32_t kBits = 0x43004300u;
    static constexpr uint32_t kHighBytes = 0x43434343u;
    static __device__ __forceinline__ T2 from_bits(uint32_t b) {
#if defined(PAGEDRUN_SIM)
        return __halves2bfloat162(
            __ushort_as_bfloat16(static_cast<unsigned short>(b & 0xffffu)),
            __ushort_as_bfloat16(static_cast<unsigned short>(b >> 16)));
#else
        return *reinterpret_cast<const T2*>(&b);
#endif
    }
    static __device__ __forceinline__ uint32_t to_bits(T2 v) {
#if defined(PAGEDRUN_SIM)
        return static_cast<uint32_t>(__bfloat16_as_ushort(v.x)) |
               (static_cast<uint32_t>(__bfloat16_as_ushort(v.y)) << 16);
#else
        return *reinterpret_cast<const uint32_t*>(&v);
#endif
    }
};

// (a & mask) | bits in one LOP3 (the compiler otherwise emits two: one immediate each).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
#if defined(PAGEDRUN_SIM)
    return (a & mask) | bits;
#else
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
#endif
}

template <typename T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t word, typename Magic<T>::T2 s2,
                                                 typename Magic<T>::T2 base_z2) {
    const auto v = Magic<T>::from_bits(and_or(word, 0x000f000fu, Magic<T>::kBits));
    return Magic<T>::to_bits(__hmul2(__hsub2(v, base_z2), s2));
}

// One PRMT each: both lanes scale j of the 4 T scales in `sc` (2 per word), and both lanes
// base + z_j for the 4 zero points in the bytes of `zp` (z_j in the low byte, base's high
// byte above it: base + z exactly, as the weights' own magic-number conversion).
template <typename T>
__device__ __forceinline__ typename Magic<T>::T2 scale_pair(uint2 sc, int j) {
    return Magic<T>::from_bits(__byte_perm(j < 2 ? sc.x : sc.y, 0u, (j & 1) ? 0x3232u : 0x1010u));
}
template <typename T>
__device__ __forceinline__ typename Magic<T>::T2 base_zero_pair(uint32_t zp, int j) {
    return Magic<T>::from_bits(__byte_perm(zp, Magic<T>::kHighBytes, 0x4040u + 0x0101u * j));
}

// The 8 weights of one pre-shuffled word as 4 packed T pairs s * (q - z), pair i = elements
// (2i, 2i + 1).
template <typename T>
__device__ __forceinline__ void dequant_word(uint32_t (&pairs)[4], uint32_t word,
                                             typename Magic<T>::T2 s2,
                                             typename Magic<T>::T2 base_z2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = dequant_pair<T>(word >> (4 * i), s2, base_z2);
}

// The 8 int8 weights of one pre-shuffled W8 word pair (w0: elements 0..3, w1: 4..7, a byte
// each) as 4 packed T pairs s * q, pair i = elements (2i, 2i + 1); sbits: s's bits in the low
// 16. f16: the magic-number conversion -- q + 128 (the byte with its sign bit flipped) below
// 0x64 is 1024 + q + 128 exactly (one PRMT per pair), minus 1152 is q, times s rounds once.
// bf16 has too few mantissa bits for an 8-bit q under its magic: through float (q and s * q
// exact there), rounded once by the pack.
template <typename T>
__device__ __forceinline__ void dequant_w8(uint32_t (&pairs)[4], uint32_t w0, uint32_t w1,
                                           uint32_t sbits) {
    if constexpr (Magic<T>::kIsHalf) {
        const auto s2 = Magic<T>::from_bits(__byte_perm(sbits, 0u, 0x1010u));
        const auto base2 = Magic<T>::from_bits(0x64806480u);  // 1152 = 1024 + 128
        const uint32_t biased[2] = {w0 ^ 0x80808080u, w1 ^ 0x80808080u};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const auto v = Magic<T>::from_bits(
                __byte_perm(biased[i / 2], 0x64646464u, (i & 1) ? 0x4342u : 0x4140u));
            pairs[i] = Magic<T>::to_bits(__hmul2(__hsub2(v, base2), s2));
        }
    } else {
        const float s = to_f32(__ushort_as_bfloat16(static_cast<unsigned short>(sbits & 0xffffu)));
        const uint32_t words[2] = {w0, w1};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t word = words[i / 2] >> (16 * (i & 1));
            const float lo = static_cast<float>(static_cast<int8_t>(word & 0xffu));
            const float hi = static_cast<float>(static_cast<int8_t>((word >> 8) & 0xffu));
            pairs[i] = pack2<T>(s * lo, s * hi);
        }
    }
}

// The quantization group of k-tile kt: kt >> group_shift, or 0 per-channel (group_shift < 0).
__device__ __forceinline__ int w4_group_shift(int group_size, int K) {
    return group_size == K ? -1 : __ffs(group_size / kBK) - 1;
}
__device__ __forceinline__ int w4_group(int kt, int group_shift) {
    return group_shift < 0 ? 0 : kt >> group_shift;
}

// The dequantized weight tile [64][32] of k-tile kt from the pre-shuffled layouts: the CTA's 64
// columns are column groups n0 / 32 and n0 / 32 + 1; thread t reads group t / 64 as the
// decode kernel's lane (t % 64) / 2 would, the half of it that holds n8 tiles 2 (t % 2) and
// + 1 (W4: words 2 (t % 2), + 1, 8 bytes; W8: words 4 (t % 2) .. + 3, 16 bytes), dequantizes
// them and stores each tile's 8 k as one 16-byte chunk: row 32 (t / 64) + 8j + lane / 4,
// chunk lane % 4. Consecutive threads read consecutive bytes (one run per group).
template <typename T, bool W4>
__device__ __forceinline__ void load_wq_tile(T* s_w, const uint32_t* q, const T* scales,
                                             const uint8_t* zeros, int n0, int kt,
                                             int num_groups, int group) {
    const int gi = threadIdx.x / 64;
    const int lane = (threadIdx.x % 64) / 2;
    const int jp = threadIdx.x % 2;
    const int ng = n0 / kW4GroupN + gi;
    uint32_t w[2][4] = {{0u, 0u, 0u, 0u}, {0u, 0u, 0u, 0u}};
    if (ng < num_groups) {
        const long long tile = static_cast<long long>(kt) * num_groups + ng;
        const long long gidx =
            (static_cast<long long>(group) * num_groups + ng) * kW4GroupN + (lane / 4) * 4 + 2 * jp;
        if constexpr (W4) {
            const uint2 v = load8(q + tile * kW4GroupWords + lane * 4 + 2 * jp);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const auto s2 = Magic<T>::from_bits(
                    __byte_perm(scale_bits(scales[gidx + h]), 0u, 0x1010u));
                const auto base_z2 = base_zero_pair<T>(zeros[gidx + h], 0);
                dequant_word<T>(w[h], h == 0 ? v.x : v.y, s2, base_z2);
            }
        } else {
            const uint4 v = load16(q + tile * kW8GroupWords + lane * 8 + 4 * jp);
            dequant_w8<T>(w[0], v.x, v.y, scale_bits(scales[gidx]));
            dequant_w8<T>(w[1], v.z, v.w, scale_bits(scales[gidx + 1]));
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
        store_chunk(s_w + kmajor_offset(gi * kW4GroupN + (2 * jp + h) * 8 + lane / 4, lane % 4),
                    w[h][0], w[h][1], w[h][2], w[h][3]);
}

// The 64-row shared-memory tile (prefill). W4 = false: q is the pre-shuffled W8 uint32
// [K / 32, Ng, 32, 8]; W4 = true: the W4 uint32 [K / 32, Ng, 32, 4] and zeros is used.
template <typename T, int MT, bool W4>
__device__ __forceinline__ void gemm_wq(T* out, const T* __restrict__ x, const uint32_t* q,
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
        const int num_groups = (N + kW4GroupN - 1) / kW4GroupN;
        const int group = w4_group(kt, w4_group_shift(group_size, K));
        load_wq_tile<T, W4>(s_w, q, scales, zeros, n0, kt, num_groups, group);
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

// W4A16 / W8A16 for M <= 8 * NT (decode), dequantized in registers: no shared memory, no
// barrier. The product is computed transposed, out^T = W x^T: the weights are the mma's A
// operand (16 output columns = two n8 tiles of the packing) and the activations its B operand
// (8 tokens), so M <= 8 wastes no half of every mma and the B fragments are loaded exactly as
// the registers the mma reads. Warp w of CTA b owns column group ng = 4 b + w (32 output
// columns: A tiles {0, 1} and {2, 3} of the packing) and the k-tiles of split blockIdx.z.
// Per k-tile, lane l (g = l / 4, c = l % 4) loads
//   - its 16 (W4) or 32 (W8) bytes of the pre-shuffled weights: n8 tile j's 8 weights
//     W[32 ng + 8j + g][32 kt + 8c + e], e = 0..7 (W4: word j; W8: words 2j, 2j + 1) --
//     A-fragment rows g (tile 2p) and g + 8 (tile 2p + 1) of two k16 steps;
//   - x[m0 + 8t + g][32 kt + 8c .. + 7] per token tile t (16 bytes; zero past M): the B
//     fragments of the same two steps. k is permuted within the tile identically for A and B
//     (fragment k-position 2c + {0, 1} is k = 8c + 4s + {0, 1}, 2c + 8 + {0, 1} is
//     8c + 4s + {2, 3} in step s): a sum over k does not depend on the order of its terms;
//   - 4 scales (8 bytes) and, W4, 4 zero points (4 bytes) of its columns in the k-tile's group.
// The loads run kDecodeStages k-tiles ahead of the math (a register ring, fully unrolled so it
// stays in registers): 4 x 512 (W4) / 1024 (W8) bytes of weights in flight per warp.
template <typename T, int NT, bool W4>
__device__ __forceinline__ void gemm_wq_decode(T* out, const T* __restrict__ x,
                                               const uint32_t* __restrict__ q,
                                               const T* __restrict__ scales,
                                               const uint8_t* __restrict__ zeros,
                                               const T* __restrict__ bias, float* partial, int M,
                                               int N, int K, int group_size,
                                               int k_tiles_per_split) {
    constexpr int S = kDecodeStages;
    constexpr int kLaneWords = W4 ? 4 : 8;          // per lane per (k-tile, column group)
    constexpr int kLoads = kLaneWords / 4;          // 16-byte loads
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const int num_groups = (N + kW4GroupN - 1) / kW4GroupN;
    const int ng = blockIdx.x * kDecodeWarps + warp;
    if (ng >= num_groups) return;  // whole warps only: no barrier below
    const int m0 = blockIdx.y * 8 * NT;
    const int group_shift = w4_group_shift(group_size, K);
    const int kt_begin = blockIdx.z * k_tiles_per_split;
    const int kt_end = min(K / kBK, kt_begin + k_tiles_per_split);
    // Offsets in 32 bits (one IMAD each per k-tile): the largest array, qweight, holds
    // K N / 8 words -- 2^26 for a 128K-vocabulary head of 4096 -- far below 2^32.
    bool token_ok[NT];
    const T* x_lane[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        token_ok[t] = m0 + 8 * t + g < M;
        x_lane[t] = x + static_cast<long long>(token_ok[t] ? m0 + 8 * t + g : 0) * K + 8 * c;
    }
    const uint32_t* q_lane = q + static_cast<long long>(ng) * 32 * kLaneWords + lane * kLaneWords;
    const uint32_t q_tile_stride = static_cast<uint32_t>(num_groups) * 32 * kLaneWords;
    const T* scales_lane = scales + static_cast<long long>(ng) * kW4GroupN + g * 4;
    const uint8_t* zeros_lane = zeros + static_cast<long long>(ng) * kW4GroupN + g * 4;
    const uint32_t g_stride = static_cast<uint32_t>(num_groups) * kW4GroupN;

    // The ring. A slot past kt_end is never read (its k-tile is skipped below), so it is not
    // cleared: only tokens past M must read as zeros.
    uint4 wq[S][kLoads], xv[S][NT];
    uint2 sc[S];
    uint32_t zp[S];
    auto fetch = [&](int s, int kt) {
        if (kt < kt_end) {
#pragma unroll
            for (int i = 0; i < kLoads; ++i)
                wq[s][i] = load16(q_lane + static_cast<uint32_t>(kt) * q_tile_stride + 4 * i);
#pragma unroll
            for (int t = 0; t < NT; ++t)
                xv[s][t] = token_ok[t] ? load16(x_lane[t] + kt * kBK) : make_uint4(0u, 0u, 0u, 0u);
            const uint32_t gi = static_cast<uint32_t>(w4_group(kt, group_shift)) * g_stride;
            sc[s] = load8(scales_lane + gi);
            if constexpr (W4) zp[s] = load4(zeros_lane + gi);
        }
    };

    float acc[2][NT][4];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[p][t][i] = 0.f;

#pragma unroll
    for (int s = 0; s < S; ++s) fetch(s, kt_begin + s);
    for (int kt0 = kt_begin; kt0 < kt_end; kt0 += S) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            if (kt0 + s < kt_end) {  // warp-uniform
                uint32_t words[kLaneWords];
#pragma unroll
                for (int i = 0; i < kLoads; ++i) {
                    words[4 * i] = wq[s][i].x;
                    words[4 * i + 1] = wq[s][i].y;
                    words[4 * i + 2] = wq[s][i].z;
                    words[4 * i + 3] = wq[s][i].w;
                }
                const uint32_t sbits[4] = {sc[s].x, sc[s].x >> 16, sc[s].y, sc[s].y >> 16};
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    uint32_t lo[4], hi[4];  // A rows g (tile 2p) and g + 8 (tile 2p + 1)
                    if constexpr (W4) {
                        dequant_word<T>(lo, words[2 * p], scale_pair<T>(sc[s], 2 * p),
                                        base_zero_pair<T>(zp[s], 2 * p));
                        dequant_word<T>(hi, words[2 * p + 1], scale_pair<T>(sc[s], 2 * p + 1),
                                        base_zero_pair<T>(zp[s], 2 * p + 1));
                    } else {
                        dequant_w8<T>(lo, words[4 * p], words[4 * p + 1], sbits[2 * p]);
                        dequant_w8<T>(hi, words[4 * p + 2], words[4 * p + 3], sbits[2 * p + 1]);
                    }
#pragma unroll
                    for (int step = 0; step < 2; ++step) {
                        const uint32_t a[4] = {lo[2 * step], hi[2 * step], lo[2 * step + 1],
                                               hi[2 * step + 1]};
#pragma unroll
                        for (int t = 0; t < NT; ++t) {
                            const uint32_t b[2] = {step == 0 ? xv[s][t].x : xv[s][t].z,
                                                   step == 0 ? xv[s][t].y : xv[s][t].w};
                            mma_m16n8k16_acc<T>(acc[p][t], a, b);
                        }
                    }
                }
            }
            fetch(s, kt0 + s + S);
        }
    }

    // D fragment: rows g / g + 8 are columns n of tiles 2p / 2p + 1, columns 2c + {0, 1} are
    // tokens.
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int token = m0 + 8 * t + 2 * c + (i % 2);
                const int n = ng * kW4GroupN + 8 * (2 * p + i / 2) + g;
                if (token >= M || n >= N) continue;
                const long long idx = static_cast<long long>(token) * N + n;
                if (partial != nullptr) {  // split-K: raw fp32 sums of this K slice, no bias
                    partial[static_cast<long long>(blockIdx.z) * M * N + idx] = acc[p][t][i];
                } else {
                    float v = acc[p][t][i];
                    if (bias != nullptr) v += to_f32(bias[n]);
                    out[idx] = from_f32<T>(v);
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

// The 8- and 16-row names are the register-only decode kernel (1 or 2 token tiles), the
// 64-row one the shared-memory tile.
#define PAGEDRUN_GEMM_WQ_DECODE(BITS, DT, T, NT, BM, W4)                                       \
    extern "C" __global__ void __launch_bounds__(gemm_wq::kThreads, gemm_wq::kDecodeMinBlocks) \
        gemm_w##BITS##a16_##DT##_m##BM(T* out, float* partial, const T* x,                     \
                                       const uint32_t* qweight, const T* scales,               \
                                       const uint8_t* zeros, const T* bias, int M, int N,      \
                                       int K, int group_size, int k_tiles_per_split) {         \
        gemm_wq::gemm_wq_decode<T, NT, W4>(out, x, qweight, scales, zeros, bias, partial, M,   \
                                           N, K, group_size, k_tiles_per_split);               \
    }
#define PAGEDRUN_GEMM_WQ_TILE(BITS, DT, T, W4)                                                 \
    extern "C" __global__ void __launch_bounds__(gemm_wq::kThreads, gemm_wq::kTileMinBlocks)   \
        gemm_w##BITS##a16_##DT##_m64(T* out, float* partial, const T* x,                       \
                                     const uint32_t* qweight, const T* scales,                 \
                                     const uint8_t* zeros, const T* bias, int M, int N, int K, \
                                     int group_size, int k_tiles_per_split) {                  \
        gemm_wq::gemm_wq<T, 4, W4>(out, x, qweight, scales, zeros, bias, partial, M, N, K,     \
                                   group_size, k_tiles_per_split);                             \
    }
#define PAGEDRUN_GEMM_WQ_ALL(BITS, DT, T, W4)                                                  \
    PAGEDRUN_GEMM_WQ_DECODE(BITS, DT, T, 1, 8, W4)                                             \
    PAGEDRUN_GEMM_WQ_DECODE(BITS, DT, T, 2, 16, W4)                                            \
    PAGEDRUN_GEMM_WQ_TILE(BITS, DT, T, W4)

#define PAGEDRUN_GEMM_WQ_REDUCE(DT, T)                                                         \
    extern "C" __global__ void __launch_bounds__(gemm_wq::kThreads)                            \
        gemm_wq_splitk_reduce_##DT(T* out, const float* partial, const T* bias, int M, int N,  \
                                   int num_splits) {                                           \
        gemm_wq::splitk_reduce<T>(out, partial, bias, M, N, num_splits);                       \
    }

PAGEDRUN_GEMM_WQ_ALL(8, f16, __half, false)
PAGEDRUN_GEMM_WQ_ALL(8, bf16, __nv_bfloat16, false)
PAGEDRUN_GEMM_WQ_ALL(4, f16, __half, true)
PAGEDRUN_GEMM_WQ_ALL(4, bf16, __nv_bfloat16, true)
PAGEDRUN_GEMM_WQ_REDUCE(f16, __half)
PAGEDRUN_GEMM_WQ_REDUCE(bf16, __nv_bfloat16)
