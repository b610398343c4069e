// cpu_gemm_kernels.h: the bf16-weight and int8-weight GEMMs of the cpu backends (pyx/cpu_gemm.pyx
// wraps them; the int8 format is described at its section below). The GEMM over GGUF blocks
// is in cpu_quant_kernels.h, run through this file's TileJob and two-way split.
//
//   y[M, N] (float32) = x[M, K] (bf16 bits) @ W[N, K]^T (bf16 bits, packed) (+ bias[N])
//
// Packed weight layout (pagedrun.pyx.cpu_gemm.pack_weight builds it at load):
//   wp[num_tiles][kp][TILE_N][2] uint16, num_tiles = ceil(N / TILE_N), kp = ceil(K / 2)
//   wp[t][p][j][e] = W[t * TILE_N + j, 2 * p + e], zero past N and K.
// One 32-bit lane holds the pair (k, k+1) of one output: the operand vdpbf16ps multiplies by a
// broadcast pair of x. x is bf16 [M][kp * 2] with its pad column zeroed by the caller.
//
// Three paths over the same layout: AVX512-BF16, AVX2 + FMA (chosen at run time, compiled with
// per-function target attributes so the module builds for any x86-64) and a portable scalar
// one. All accumulate in float32; the products of two bf16 values are exact in float32.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDRUN_X86 1
#else
#define PAGEDRUN_X86 0
#endif

#include "cpu_quant_kernels.h"  // the GGUF-block GEMM (GgufJob, gguf_tiles): run by TileJob too
#include "cpu_thread_pool.h"    // run_pair: the process's one helper thread

namespace pagedrun_gemm {

constexpr int TILE_N = 16;   // outputs per tile: one zmm of float32 accumulators
constexpr int MR = 8;        // x rows per micro-kernel (8 x 2 tiles = 16 accumulators)
constexpr int NR = 2;        // tiles per micro-kernel

// float32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN with its sign (top 16
// bits, quiet bit 0x40 set). The cpu GEMM's only bf16 rounding (activations, and weights
// through cpu_gemm.to_bf16_bits); the same rules as runtime/weights.py's to_bf16_bits, and
// tests/foundation/test_bf16_rounding.py checks the two agree bit for bit.
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// x[M, K] float32 with strides (in elements) -> xb[M, kp2] bf16 bits, zero pad past K.
static inline void convert_rows(const float* x, long stride_m, long stride_k, int M, int K,
                                uint16_t* xb, int kp2) {
    for (int m = 0; m < M; ++m) {
        const float* row = x + (long)m * stride_m;
        uint16_t* out = xb + (long)m * kp2;
        if (stride_k == 1) {
            for (int k = 0; k < K; ++k) out[k] = f32_to_bf16(row[k]);
        } else {
            for (int k = 0; k < K; ++k) out[k] = f32_to_bf16(row[(long)k * stride_k]);
        }
        for (int k = K; k < kp2; ++k) out[k] = 0;
    }
}

// ------------------------------------------------------------------------- portable path

// Tiles [tile_begin, tile_end) of y; y rows have ldy floats.
static inline void gemm_tiles_scalar(const uint16_t* xb, int M, int kp, const uint16_t* wp,
                                     int N, int tile_begin, int tile_end, const float* bias,
                                     float* y, long ldy) {
    const long tile_elems = (long)kp * TILE_N * 2;
    for (int t = tile_begin; t < tile_end; ++t) {
        const uint16_t* wt = wp + t * tile_elems;
        const int n0 = t * TILE_N;
        const int width = N - n0 < TILE_N ? N - n0 : TILE_N;
        for (int m = 0; m < M; ++m) {
            const uint16_t* xr = xb + (long)m * kp * 2;
            float acc[TILE_N] = {0};
            for (int p = 0; p < kp; ++p) {
                const float x0 = bf16_to_f32(xr[2 * p]), x1 = bf16_to_f32(xr[2 * p + 1]);
                const uint16_t* w = wt + (long)p * TILE_N * 2;
                for (int j = 0; j < TILE_N; ++j)
                    acc[j] += x0 * bf16_to_f32(w[2 * j]) + x1 * bf16_to_f32(w[2 * j + 1]);
            }
            float* yr = y + (long)m * ldy + n0;
            for (int j = 0; j < width; ++j) yr[j] = acc[j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

// ------------------------------------------------------------------------- AVX512-BF16 path
#if PAGEDRUN_X86
#define PAGEDRUN_BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw")))

// MR_ x rows by NR_ tiles over all of K: MR_ * NR_ accumulators, each weight vector loaded once
// and used for MR_ rows, each x pair broadcast once and used for NR_ tiles.
// Weight lines requested ahead of use (pairs; one pair of a tile is one 64-byte line).
constexpr int PREFETCH_PAIRS = 16;

// The lanes of the tile starting at output nc that are < N (a partial last tile).
static inline __mmask16 tile_mask(int nc, int N) {
    const int width = N - nc < TILE_N ? N - nc : TILE_N;
    return (__mmask16)((1u << width) - 1u);
}

// acc[r][c] += x[row r, pair p] . w[c] for MR_ rows and NR_ tiles: the register-blocked core
// of every micro-kernel below (force-inlined: the accumulators must stay in registers).
template <int MR_, int NR_>
PAGEDRUN_BF16_TARGET __attribute__((always_inline)) static inline void dot_pair(
        __m512 (&acc)[MR_][NR_], const uint32_t* x32, int kp, int p, const __m512bh (&w)[NR_]) {
    #pragma GCC unroll 16
    for (int r = 0; r < MR_; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x32[(long)r * kp + p]);
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
    }
}

// y[r, tile c] = sum[r][c] + bias for MR_ rows and NR_ tiles from output n0, masked past N:
// the epilogue of the micro-kernels that finish their sums in registers.
template <int MR_, int NR_>
PAGEDRUN_BF16_TARGET __attribute__((always_inline)) static inline void store_tiles(
        const __m512 (&sum)[MR_][NR_], const float* bias, int n0, int N, float* y, long ldy) {
    #pragma GCC unroll 16
    for (int c = 0; c < NR_; ++c) {
        const int nc = n0 + c * TILE_N;
        const __mmask16 mask = tile_mask(nc, N);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + nc) : _mm512_setzero_ps();
        #pragma GCC unroll 16
        for (int r = 0; r < MR_; ++r)
            _mm512_mask_storeu_ps(y + (long)r * ldy + nc, mask, _mm512_add_ps(sum[r][c], b));
    }
}

// All of K, then the bias.
template <int MR_, int NR_>
PAGEDRUN_BF16_TARGET static inline void micro_avx512(const uint16_t* xb, int kp,
                                                     const uint16_t* wt, long tile_elems,
                                                     const float* bias, int n0, int N,
                                                     float* y, long ldy) {
    // Every loop over r and c is unrolled: the accumulators must live in registers (at -O2 gcc
    // kept them in a stack array, a load and a store around every vdpbf16ps).
    __m512 acc[MR_][NR_];
    #pragma GCC unroll 16
    for (int r = 0; r < MR_; ++r)
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c)
            acc[r][c] = _mm512_setzero_ps();
    const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb);  // one pair per uint32
    for (int p = 0; p < kp; ++p) {
        // One 64-byte line per tile per pair: ask for the line PREFETCH_PAIRS ahead, so a
        // weight panel streaming from DRAM overlaps the multiply-adds (small M is bound by it).
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c)
            _mm_prefetch(reinterpret_cast<const char*>(wt + c * tile_elems +
                                                       (long)(p + PREFETCH_PAIRS) * TILE_N * 2),
                         _MM_HINT_T0);
        __m512bh w[NR_];
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c)
            w[c] = (__m512bh)_mm512_loadu_si512(wt + c * tile_elems + (long)p * TILE_N * 2);
        dot_pair<MR_, NR_>(acc, x32, kp, p, w);
    }
    store_tiles<MR_, NR_>(acc, bias, n0, N, y, ldy);
}

// Decode-sized M (<= SKINNY_MAX_M rows): the GEMM is a weight stream and nothing else, so
// the loop is shaped for the stream. Each tile's panel is read once, front to back over all
// of K (no K blocking: a block boundary restarts the hardware prefetcher on every tile), with
// two accumulator sets (even and odd pairs) so no vdpbf16ps waits on the previous one's
// result, and no software prefetch (the hardware prefetcher keeps up with one sequential
// stream per tile; measured on Zen 4, 2 threads: 10.4 -> 24-26 GB/s at M = 1, the machine's
// 2-thread read bandwidth being ~26 GB/s).
constexpr int SKINNY_MAX_M = 4;

template <int MR_, int NR_>
PAGEDRUN_BF16_TARGET static inline void skinny_avx512(const uint16_t* xb, int kp,
                                                      const uint16_t* wt, long tile_elems,
                                                      const float* bias, int n0, int N,
                                                      float* y, long ldy) {
    __m512 acc[2][MR_][NR_];
    #pragma GCC unroll 16
    for (int u = 0; u < 2; ++u)
        #pragma GCC unroll 16
        for (int r = 0; r < MR_; ++r)
            #pragma GCC unroll 16
            for (int c = 0; c < NR_; ++c) acc[u][r][c] = _mm512_setzero_ps();
    const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb);  // one pair per uint32
    const int kp_even = kp & ~1;
    for (int p = 0; p < kp; p += 2) {
        // u = 1 past an odd K's last pair is skipped (the branch is uniform, predicted).
        #pragma GCC unroll 2
        for (int u = 0; u < 2; ++u) {
            if (u == 1 && p >= kp_even) break;
            __m512bh w[NR_];
            #pragma GCC unroll 16
            for (int c = 0; c < NR_; ++c)
                w[c] = (__m512bh)_mm512_loadu_si512(wt + c * tile_elems +
                                                    (long)(p + u) * TILE_N * 2);
            dot_pair<MR_, NR_>(acc[u], x32, kp, p + u, w);
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < MR_; ++r)
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c) acc[0][r][c] = _mm512_add_ps(acc[0][r][c], acc[1][r][c]);
    store_tiles<MR_, NR_>(acc[0], bias, n0, N, y, ldy);
}

template <int MR_>
PAGEDRUN_BF16_TARGET static void skinny_tiles_avx512(const uint16_t* xb, int kp,
                                                     const uint16_t* wp, int N, int tile_begin,
                                                     int tile_end, const float* bias, float* y,
                                                     long ldy) {
    const long tile_elems = (long)kp * TILE_N * 2;
    // One tile per call at M 1-2 (one stream, 2-4 accumulators: measured best), two at 3-4
    // (the x broadcasts are then shared by two tiles).
    constexpr int NR_S = MR_ <= 2 ? 1 : 2;
    int t = tile_begin;
    for (; t + NR_S <= tile_end; t += NR_S)
        skinny_avx512<MR_, NR_S>(xb, kp, wp + t * tile_elems, tile_elems, bias, t * TILE_N, N,
                                 y, ldy);
    for (; t < tile_end; ++t)
        skinny_avx512<MR_, 1>(xb, kp, wp + t * tile_elems, tile_elems, bias, t * TILE_N, N, y,
                              ldy);
}

template <int NR_>
PAGEDRUN_BF16_TARGET static inline void rows_avx512(const uint16_t* xb, int M, int kp,
                                                    const uint16_t* wt, long tile_elems,
                                                    const float* bias, int n0, int N, float* y,
                                                    long ldy) {
    const long xrow = (long)kp * 2;
    int m = 0;
    for (; m + MR <= M; m += MR)
        micro_avx512<MR, NR_>(xb + m * xrow, kp, wt, tile_elems, bias, n0, N,
                              y + m * ldy, ldy);
    const uint16_t* xr = xb + m * xrow;
    float* yr = y + m * ldy;
    switch (M - m) {  // the remainder rows, one instantiation each
        case 7: micro_avx512<7, NR_>(xr, kp, wt, tile_elems, bias, n0, N, yr, ldy); break;
        case 6: micro_avx512<6, NR_>(xr, kp, wt, tile_elems, bias, n0, N, yr, ldy); break;
        case 5: micro_avx512<5, NR_>(xr, kp, wt, tile_elems, bias, n0, N, yr, ldy); break;
        case 4: micro_avx512<4, NR_>(xr, kp, wt, tile_elems, bias, n0, N, yr, ldy); break;
        case 3: micro_avx512<3, NR_>(xr, kp, wt, tile_elems, bias, n0, N, yr, ldy); break;
        case 2: micro_avx512<2, NR_>(xr, kp, wt, tile_elems, bias, n0, N, yr, ldy); break;
        case 1: micro_avx512<1, NR_>(xr, kp, wt, tile_elems, bias, n0, N, yr, ldy); break;
        default: break;
    }
}

// x rows per pass over the weights: a pass's bf16 rows (rows * K * 2 bytes) stay in L2 while
// every tile of the weights streams past them. Decode batches (M <= a few hundred) take one
// pass, so the weights stream from memory once; a long prefill re-streams them per pass.
constexpr long X_BLOCK_BYTES = 256 * 1024;
// No blocking of K: every tile pair's panel is walked front to back over all of K for each
// 8-row block, so each panel is one sequential stream from memory (a K block boundary restarts
// the hardware prefetcher on every tile) and then stays in L2 (<= 100 KB at K 1536) for the
// pass's other row blocks. Measured against 128-pair K blocks (2 threads, Zen 4, the default
// model's matrices): M 8 17.0 -> 21.4-23.7 GB/s, M 16-64 +5-15%, M 256 unchanged.

static inline int rows_per_pass(int kp) {
    long rows = X_BLOCK_BYTES / ((long)kp * 4);
    rows = rows / MR * MR;
    return rows < MR ? MR : (int)rows;
}

// Tiles [tile_begin, tile_end) of y, NR tiles at a time: the weights of those tiles (NR * 16 *
// K * 2 bytes, <= 100 KB at K 1536) stay in L1/L2 for all rows of the pass.
PAGEDRUN_BF16_TARGET static void gemm_tiles_avx512(const uint16_t* xb, int M, int kp,
                                                   const uint16_t* wp, int N, int tile_begin,
                                                   int tile_end, const float* bias, float* y,
                                                   long ldy) {
    switch (M) {
        case 1: skinny_tiles_avx512<1>(xb, kp, wp, N, tile_begin, tile_end, bias, y, ldy); return;
        case 2: skinny_tiles_avx512<2>(xb, kp, wp, N, tile_begin, tile_end, bias, y, ldy); return;
        case 3: skinny_tiles_avx512<3>(xb, kp, wp, N, tile_begin, tile_end, bias, y, ldy); return;
        case 4: skinny_tiles_avx512<4>(xb, kp, wp, N, tile_begin, tile_end, bias, y, ldy); return;
        default: break;
    }
    static_assert(SKINNY_MAX_M == 4, "the switch above covers M = 1 .. SKINNY_MAX_M");
    const long tile_elems = (long)kp * TILE_N * 2;
    const int pass_rows = rows_per_pass(kp);
    for (int m0 = 0; m0 < M; m0 += pass_rows) {
        const int rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        const uint16_t* xp = xb + (long)m0 * kp * 2;
        float* yp = y + (long)m0 * ldy;
        int t = tile_begin;
        for (; t + NR <= tile_end; t += NR)
            rows_avx512<NR>(xp, rows, kp, wp + t * tile_elems, tile_elems, bias,
                            t * TILE_N, N, yp, ldy);
        if (t < tile_end)
            rows_avx512<1>(xp, rows, kp, wp + t * tile_elems, tile_elems, bias,
                           t * TILE_N, N, yp, ldy);
    }
}
#endif

// ------------------------------------------------------------------------- AVX2 + FMA path
// For x86-64 CPUs without AVX512-BF16 (same packed layout): a 32-bit lane's pair is widened to
// two float32 vectors (k even: the low half shifted up; k odd: the high half masked), then two
// FMAs. MR_ rows by one tile (two ymm halves): 2 * MR_ accumulators + 4 weight registers.
#if PAGEDRUN_X86
#define PAGEDRUN_AVX2_TARGET __attribute__((target("avx2,fma")))
constexpr int MR_AVX2 = 4;

// acc[r][h] += x[r, 2p] * we[h] + x[r, 2p + 1] * wo[h] for MR_ rows, the tile's two halves
// (we/wo: the pair's even/odd weights as float32): the core of both AVX2 micro-kernels. x: the
// rows widened to float32 once per call (widen_rows_avx2), so each x is one broadcast load:
// widened here per use, a bf16 cost a scalar shift and a move into a vector per row and pair,
// twice the FMAs' own uops (2.2x slower at 64 rows on Zen 3).
template <int MR_>
PAGEDRUN_AVX2_TARGET __attribute__((always_inline)) static inline void fma_pair_avx2(
        __m256 (&acc)[MR_][2], const float* xf, int kp, int p, const __m256 (&we)[2],
        const __m256 (&wo)[2]) {
#pragma GCC unroll 8
    for (int r = 0; r < MR_; ++r) {
        const float* xr = xf + (long)r * kp * 2 + 2 * p;
        const __m256 x0 = _mm256_broadcast_ss(xr);
        const __m256 x1 = _mm256_broadcast_ss(xr + 1);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
            acc[r][h] = _mm256_fmadd_ps(x1, wo[h], _mm256_fmadd_ps(x0, we[h], acc[r][h]));
    }
}

// xb [M][2 kp] bf16 -> float32 (exact: bits << 16) in a buffer of the calling thread's, grown
// as needed and kept for its next call. nullptr if it cannot be had.
PAGEDRUN_AVX2_TARGET static inline const float* widen_rows_avx2(const uint16_t* xb, int M,
                                                                  int kp) {
    static thread_local float* buf = nullptr;
    static thread_local long cap = 0;
    const long n = (long)M * kp * 2;
    if (n > cap) {
        float* grown = static_cast<float*>(realloc(buf, (size_t)n * sizeof(float)));
        if (!grown) return nullptr;
        buf = grown;
        cap = n;
    }
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + i));
        _mm256_storeu_ps(buf + i,
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    for (; i < n; ++i) buf[i] = bf16_to_f32(xb[i]);
    return buf;
}

// y[r, n0 .. n0 + 16) = sum[r] + bias for MR_ rows, the outputs past N left alone.
template <int MR_>
PAGEDRUN_AVX2_TARGET __attribute__((always_inline)) static inline void store_tile_avx2(
        const __m256 (&sum)[MR_][2], const float* bias, int n0, int N, float* y, long ldy) {
    const int width = N - n0 < TILE_N ? N - n0 : TILE_N;
#pragma GCC unroll 8
    for (int r = 0; r < MR_; ++r) {
        float tmp[TILE_N];
        _mm256_storeu_ps(tmp, sum[r][0]);
        _mm256_storeu_ps(tmp + 8, sum[r][1]);
        float* yr = y + (long)r * ldy + n0;
        for (int j = 0; j < width; ++j) yr[j] = tmp[j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

template <int MR_>
PAGEDRUN_AVX2_TARGET static inline void micro_avx2(const float* xb, int kp, const uint16_t* wt,
                                                   const float* bias, int n0, int N, float* y,
                                                   long ldy) {
    __m256 acc[MR_][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR_; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int p = 0; p < kp; ++p) {
        const uint16_t* w = wt + (long)p * TILE_N * 2;
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + TILE_N));
        const __m256 we[2] = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                              _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
        const __m256 wo[2] = {_mm256_castsi256_ps(_mm256_and_si256(lo, odd_mask)),
                              _mm256_castsi256_ps(_mm256_and_si256(hi, odd_mask))};
        fma_pair_avx2<MR_>(acc, xb, kp, p, we, wo);
    }
    store_tile_avx2<MR_>(acc, bias, n0, N, y, ldy);
}

PAGEDRUN_AVX2_TARGET static void gemm_tiles_avx2(const uint16_t* xb, int M, int kp,
                                                 const uint16_t* wp, int N, int tile_begin,
                                                 int tile_end, const float* bias, float* y,
                                                 long ldy) {
    const long tile_elems = (long)kp * TILE_N * 2;
    const long xrow = (long)kp * 2;
    const float* xf = widen_rows_avx2(xb, M, kp);
    if (!xf) {  // no buffer: the portable loop needs none
        gemm_tiles_scalar(xb, M, kp, wp, N, tile_begin, tile_end, bias, y, ldy);
        return;
    }
    for (int t = tile_begin; t < tile_end; ++t) {
        const uint16_t* wt = wp + t * tile_elems;
        const int n0 = t * TILE_N;
        int m = 0;
        for (; m + MR_AVX2 <= M; m += MR_AVX2)
            micro_avx2<MR_AVX2>(xf + m * xrow, kp, wt, bias, n0, N, y + m * ldy, ldy);
        const float* xr = xf + m * xrow;
        float* yr = y + m * ldy;
        switch (M - m) {
            case 3: micro_avx2<3>(xr, kp, wt, bias, n0, N, yr, ldy); break;
            case 2: micro_avx2<2>(xr, kp, wt, bias, n0, N, yr, ldy); break;
            case 1: micro_avx2<1>(xr, kp, wt, bias, n0, N, yr, ldy); break;
            default: break;
        }
    }
}
#endif

static inline int cpu_has_avx2_fma() {
#if PAGEDRUN_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static inline int cpu_has_avx512bf16() {
#if PAGEDRUN_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

// ------------------------------------------------------------------------- AMX (bf16 tiles)
// Intel AMX (Sapphire Rapids on): TDPBF16PS multiplies a 16-row x 32-bf16 tile of x by a
// 16-pair x 16-output tile of W into 16 x 16 float32 accumulators, ~1,000 multiply-adds a cycle
// against vdpbf16ps's 32. The packed layout already is the B operand: one pair row of a weight
// tile (16 outputs x (k, k+1)) is one 64-byte tile row, so 16 consecutive pair rows load as a B
// tile with a 64-byte stride; x rows (kp pairs, 4 * kp bytes apart) load as A tiles.
// Requirements the caller meets: kp a multiple of AMX_PAIRS (else it takes the AVX512 path),
// xb holding a multiple of AMX_ROWS rows (the pad rows zero: they are computed, never stored),
// and the process's AMX permission (amx_available()). Per weight tile pair, every row block of x
// runs before the next pair, so a decode step streams each weight from memory once; the pair's
// weights (64 * kp bytes per tile) stay in L1/L2 for the row blocks.
constexpr int AMX_ROWS = 16;   // rows of an A / C tile
constexpr int AMX_PAIRS = 16;  // K pairs per tile step: one 64-byte A row, 16 B rows
// Fewer rows of x than this take the AVX512 kernels even on the AMX path: a decode GEMM of a
// few rows is bound by streaming the weights, which both do alike, and the skinny AVX512
// kernels waste no padded rows (measured in docs/kernels.md, "cpu GEMM").
constexpr int AMX_MIN_ROWS = 8;

#if PAGEDRUN_X86
#define PAGEDRUN_AMX_TARGET \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512vl,avx512bw")))

struct alignas(64) AmxTileConfig {  // the LDTILECFG memory operand, palette 1
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// C tile (row block rb, weight tile tb) + bias -> y rows [m0 + 16 rb, ...), valid rows/outputs.
PAGEDRUN_AMX_TARGET static inline void amx_store(const float* c, int rows, int n0, int N,
                                                 const float* bias, float* y, long ldy) {
    const __mmask16 mask = tile_mask(n0, N);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r)
        _mm512_mask_storeu_ps(y + (long)r * ldy + n0, mask,
                              _mm512_add_ps(_mm512_load_ps(c + r * TILE_N), b));
}

PAGEDRUN_AMX_TARGET static void gemm_tiles_amx(const uint16_t* xb, int M, int kp,
                                               const uint16_t* wp, int N, int tile_begin,
                                               int tile_end, const float* bias, float* y,
                                               long ldy) {
    // tmm0-3: accumulators (row blocks 0/1 x weight tiles 0/1); tmm4, 5: x row blocks;
    // tmm6, 7: weight tiles. Each thread loads the configuration (it is per-thread state).
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.rows[i] = AMX_ROWS;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
    const long tile_elems = (long)kp * TILE_N * 2;
    const long x_stride = (long)kp * 4;  // bytes from one x row to the next
    alignas(64) float c[4][AMX_ROWS * TILE_N];
    for (int t = tile_begin; t < tile_end; t += 2) {
        const bool two_tiles = t + 1 < tile_end;
        const uint16_t* w0 = wp + t * tile_elems;
        const uint16_t* w1 = w0 + tile_elems;
        for (int m0 = 0; m0 < M; m0 += 2 * AMX_ROWS) {
            const bool two_blocks = M - m0 > AMX_ROWS;
            const uint16_t* x0 = xb + (long)m0 * kp * 2;
            const uint16_t* x1 = x0 + (long)AMX_ROWS * kp * 2;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int p = 0; p < kp; p += AMX_PAIRS) {
                _tile_loadd(4, x0 + 2 * p, x_stride);
                _tile_loadd(6, w0 + (long)p * TILE_N * 2, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_tiles) {
                    _tile_loadd(7, w1 + (long)p * TILE_N * 2, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_blocks) {
                    _tile_loadd(5, x1 + 2 * p, x_stride);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_tiles) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            const int rows0 = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
            amx_store(c[0], rows0, t * TILE_N, N, bias, y + (long)m0 * ldy, ldy);
            if (two_tiles)
                amx_store(c[1], rows0, (t + 1) * TILE_N, N, bias, y + (long)m0 * ldy, ldy);
            if (two_blocks) {
                const int rows1 = M - m0 - AMX_ROWS < AMX_ROWS ? M - m0 - AMX_ROWS : AMX_ROWS;
                float* y1 = y + (long)(m0 + AMX_ROWS) * ldy;
                amx_store(c[2], rows1, t * TILE_N, N, bias, y1, ldy);
                if (two_tiles) amx_store(c[3], rows1, (t + 1) * TILE_N, N, bias, y1, ldy);
            }
        }
    }
    _tile_release();
}
#endif

// AMX-BF16 usable (cpu_quant_kernels.h amx_usable: CPUID and the kernel's permission for the
// tile data state) and AVX512-BF16: 1 if the AMX path may run here.
static inline int amx_available() {
#if PAGEDRUN_X86
    static const int ok = amx_usable(CPUID7_EDX_AMX_BF16) && cpu_has_avx512bf16();
    return ok;
#else
    return 0;
#endif
}

// path 3: AMX (kp a multiple of AMX_PAIRS, M >= AMX_MIN_ROWS and xb padded to AMX_ROWS rows;
// else AVX512-BF16),
// 2: AVX2 + FMA, 1: AVX512-BF16 (the caller checked the CPU has it), 0: portable.
static inline void gemm_tiles(int path, const uint16_t* xb, int M, int kp, const uint16_t* wp,
                              int N, int tile_begin, int tile_end, const float* bias, float* y,
                              long ldy) {
#if PAGEDRUN_X86
    if (path == 3 && kp % AMX_PAIRS == 0 && M >= AMX_MIN_ROWS) {
        gemm_tiles_amx(xb, M, kp, wp, N, tile_begin, tile_end, bias, y, ldy);
        return;
    }
    if (path == 1 || path == 3) {
        gemm_tiles_avx512(xb, M, kp, wp, N, tile_begin, tile_end, bias, y, ldy);
        return;
    }
    if (path == 2) {
        gemm_tiles_avx2(xb, M, kp, wp, N, tile_begin, tile_end, bias, y, ldy);
        return;
    }
#endif
    gemm_tiles_scalar(xb, M, kp, wp, N, tile_begin, tile_end, bias, y, ldy);
}

// ------------------------------------------------------------------------- int8 weights
// Weight-only int8 (EngineConfig.quantization "int8"): K is cut into groups of group_pairs
// pairs (2 * group_pairs weights; the last group may be short) and W[n, k] ~= scale[n, g] *
// q[n, k] for k in group g, q int8 in [-127, 127] (symmetric). Packed like the bf16 layout at
// one byte per weight, scales tiled the same way:
//   wq[num_tiles][kp][TILE_N][2] int8, wq[t][p][j][e] = q[t * TILE_N + j, 2 * p + e], zero past
//   N and K;
//   scales[num_tiles][num_groups][TILE_N] float32, num_groups = ceil(kp / group_pairs), zero
//   past N.
// y[m, n] = sum_g scale[n, g] * (sum_{k in g} bf16(x[m, k]) * q[n, k]) (+ bias[n]). A 32-byte
// pair row of a tile widens to the 32 bf16 lanes of one vdpbf16ps operand (int8 -> int32 ->
// float32 -> bf16, exact: every int8 is a bf16), so a group's sum is the bf16 GEMM's with q for
// W; one FMA per group and 16 outputs applies its scales. Half the bf16 bytes stream per step
// (plus 4 bytes of scale per 2 * group_pairs weights).

static inline void gemm_int8_tiles_scalar(const uint16_t* xb, int M, int kp, const int8_t* wq,
                                          const float* scales, int group_pairs, int N,
                                          int tile_begin, int tile_end, const float* bias,
                                          float* y, long ldy) {
    const long tile_bytes = (long)kp * TILE_N * 2;
    const int num_groups = (kp + group_pairs - 1) / group_pairs;
    for (int t = tile_begin; t < tile_end; ++t) {
        const int8_t* wt = wq + t * tile_bytes;
        const float* st = scales + (long)t * num_groups * TILE_N;
        const int n0 = t * TILE_N;
        const int width = N - n0 < TILE_N ? N - n0 : TILE_N;
        for (int m = 0; m < M; ++m) {
            const uint16_t* xr = xb + (long)m * kp * 2;
            float total[TILE_N] = {0};
            for (int g = 0; g < num_groups; ++g) {
                const int p1 = (g + 1) * group_pairs < kp ? (g + 1) * group_pairs : kp;
                float acc[TILE_N] = {0};
                for (int p = g * group_pairs; p < p1; ++p) {
                    const float x0 = bf16_to_f32(xr[2 * p]), x1 = bf16_to_f32(xr[2 * p + 1]);
                    const int8_t* w = wt + (long)p * TILE_N * 2;
                    for (int j = 0; j < TILE_N; ++j)
                        acc[j] += x0 * (float)w[2 * j] + x1 * (float)w[2 * j + 1];
                }
                for (int j = 0; j < TILE_N; ++j) total[j] += acc[j] * st[g * TILE_N + j];
            }
            float* yr = y + (long)m * ldy + n0;
            for (int j = 0; j < width; ++j) yr[j] = total[j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

#if PAGEDRUN_X86
// 32 int8 weights (one pair row of one tile) -> one bf16 operand, lanes in memory order.
PAGEDRUN_BF16_TARGET static inline __m512bh int8_pair_row(const int8_t* src) {
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lo -> lanes 0-15, hi -> lanes 16-31
}

// MR_ rows by NR_ tiles over all of K, group by group: U_ accumulator sets per group (2 at
// decode sizes, so no vdpbf16ps waits on the previous one; 1 when MR_ * NR_ accumulators
// already hide it), folded into the totals with the group's scales.
template <int MR_, int NR_, int U_>
PAGEDRUN_BF16_TARGET static inline void micro_int8_avx512(const uint16_t* xb, int kp,
                                                          const int8_t* wt, long tile_bytes,
                                                          const float* st, int group_pairs,
                                                          const float* bias, int n0, int N,
                                                          float* y, long ldy) {
    const int num_groups = (kp + group_pairs - 1) / group_pairs;
    const long scale_stride = (long)num_groups * TILE_N;  // floats per tile of scales
    __m512 total[MR_][NR_];
    #pragma GCC unroll 16
    for (int r = 0; r < MR_; ++r)
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c) total[r][c] = _mm512_setzero_ps();
    const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb);  // one pair per uint32
    for (int g = 0; g < num_groups; ++g) {
        const int p0 = g * group_pairs;
        const int p1 = p0 + group_pairs < kp ? p0 + group_pairs : kp;
        __m512 acc[U_][MR_][NR_];
        #pragma GCC unroll 16
        for (int u = 0; u < U_; ++u)
            #pragma GCC unroll 16
            for (int r = 0; r < MR_; ++r)
                #pragma GCC unroll 16
                for (int c = 0; c < NR_; ++c) acc[u][r][c] = _mm512_setzero_ps();
        for (int p = p0; p < p1; p += U_) {
            #pragma GCC unroll 2
            for (int u = 0; u < U_; ++u) {
                if (u > 0 && p + u >= p1) break;  // an odd last pair of the group
                __m512bh w[NR_];
                #pragma GCC unroll 16
                for (int c = 0; c < NR_; ++c)
                    w[c] = int8_pair_row(wt + c * tile_bytes + (long)(p + u) * TILE_N * 2);
                dot_pair<MR_, NR_>(acc[u], x32, kp, p + u, w);
            }
        }
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c) {
            const __m512 scale = _mm512_loadu_ps(st + c * scale_stride + (long)g * TILE_N);
            #pragma GCC unroll 16
            for (int r = 0; r < MR_; ++r) {
                __m512 sum = acc[0][r][c];
                if (U_ > 1) sum = _mm512_add_ps(sum, acc[U_ - 1][r][c]);
                total[r][c] = _mm512_fmadd_ps(sum, scale, total[r][c]);
            }
        }
    }
    store_tiles<MR_, NR_>(total, bias, n0, N, y, ldy);
}

// MR_ rows by NR_ tiles for M > 2: the group's sums in registers (MR_ x NR_), the running
// totals in y itself (one masked load, FMA and store per group, from L1), so 8-row blocks fit
// the registers and each widened weight operand serves 8 rows (4 with totals in registers).
template <int MR_, int NR_>
PAGEDRUN_BF16_TARGET static inline void micro_int8_rows(const uint16_t* xb, int kp,
                                                        const int8_t* wt, long tile_bytes,
                                                        const float* st, int group_pairs,
                                                        const float* bias, int n0, int N,
                                                        float* y, long ldy) {
    const int num_groups = (kp + group_pairs - 1) / group_pairs;
    const long scale_stride = (long)num_groups * TILE_N;
    __mmask16 mask[NR_];
    #pragma GCC unroll 16
    for (int c = 0; c < NR_; ++c) {
        mask[c] = tile_mask(n0 + c * TILE_N, N);
    }
    const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb);  // one pair per uint32
    for (int g = 0; g < num_groups; ++g) {
        const int p0 = g * group_pairs;
        const int p1 = p0 + group_pairs < kp ? p0 + group_pairs : kp;
        __m512 acc[MR_][NR_];
        #pragma GCC unroll 16
        for (int r = 0; r < MR_; ++r)
            #pragma GCC unroll 16
            for (int c = 0; c < NR_; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int p = p0; p < p1; ++p) {
            __m512bh w[NR_];
            #pragma GCC unroll 16
            for (int c = 0; c < NR_; ++c)
                w[c] = int8_pair_row(wt + c * tile_bytes + (long)p * TILE_N * 2);
            dot_pair<MR_, NR_>(acc, x32, kp, p, w);
        }
        #pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c) {
            const int nc = n0 + c * TILE_N;
            const __m512 scale = _mm512_loadu_ps(st + c * scale_stride + (long)g * TILE_N);
            // The first group starts from the bias (or zero), later ones from y.
            const __m512 b = g > 0 ? _mm512_setzero_ps()
                             : bias ? _mm512_maskz_loadu_ps(mask[c], bias + nc)
                                    : _mm512_setzero_ps();
            #pragma GCC unroll 16
            for (int r = 0; r < MR_; ++r) {
                float* yr = y + (long)r * ldy + nc;
                const __m512 base = g > 0 ? _mm512_maskz_loadu_ps(mask[c], yr) : b;
                _mm512_mask_storeu_ps(yr, mask[c], _mm512_fmadd_ps(acc[r][c], scale, base));
            }
        }
    }
}

// Rows of x in blocks of 8 against NR_ tiles; the remainder rows one instantiation each.
template <int NR_>
PAGEDRUN_BF16_TARGET static inline void int8_tile_group(const uint16_t* xb, int M, int kp,
                                                        const int8_t* wt, long tile_bytes,
                                                        const float* st, int group_pairs,
                                                        const float* bias, int n0, int N,
                                                        float* y, long ldy) {
    const long xrow = (long)kp * 2;
    int m = 0;
    for (; m + MR <= M; m += MR)
        micro_int8_rows<MR, NR_>(xb + m * xrow, kp, wt, tile_bytes, st, group_pairs, bias, n0,
                                 N, y + m * ldy, ldy);
    const uint16_t* xr = xb + m * xrow;
    float* yr = y + m * ldy;
    switch (M - m) {
#define PAGEDRUN_INT8_REST(R)                                                                  \
        case R: micro_int8_rows<R, NR_>(xr, kp, wt, tile_bytes, st, group_pairs, bias, n0, N, \
                                        yr, ldy); break;
        PAGEDRUN_INT8_REST(7) PAGEDRUN_INT8_REST(6) PAGEDRUN_INT8_REST(5)
        PAGEDRUN_INT8_REST(4) PAGEDRUN_INT8_REST(3) PAGEDRUN_INT8_REST(2)
        PAGEDRUN_INT8_REST(1)
#undef PAGEDRUN_INT8_REST
        default: break;
    }
}

// Tiles [tile_begin, tile_end) of y. M 1-2 streams one tile over all of K with two accumulator
// sets and the totals in registers; larger M runs 8-row blocks by two tiles (totals in y), in
// passes of rows whose bf16 x stays in L2 while the tiles' int8 panels (<= 48 KB at K 1536)
// are reused from L1/L2 by every block.
PAGEDRUN_BF16_TARGET static void gemm_int8_tiles_avx512(const uint16_t* xb, int M, int kp,
                                                        const int8_t* wq, const float* scales,
                                                        int group_pairs, int N, int tile_begin,
                                                        int tile_end, const float* bias,
                                                        float* y, long ldy) {
    const long tile_bytes = (long)kp * TILE_N * 2;
    const long scale_stride = (long)((kp + group_pairs - 1) / group_pairs) * TILE_N;
    if (M <= 2) {
        for (int t = tile_begin; t < tile_end; ++t) {
            const int8_t* wt = wq + t * tile_bytes;
            const float* st = scales + t * scale_stride;
            if (M == 1)
                micro_int8_avx512<1, 1, 2>(xb, kp, wt, tile_bytes, st, group_pairs, bias,
                                           t * TILE_N, N, y, ldy);
            else
                micro_int8_avx512<2, 1, 2>(xb, kp, wt, tile_bytes, st, group_pairs, bias,
                                           t * TILE_N, N, y, ldy);
        }
        return;
    }
    const int pass_rows = rows_per_pass(kp);
    for (int m0 = 0; m0 < M; m0 += pass_rows) {
        const int rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        const uint16_t* xp = xb + (long)m0 * kp * 2;
        float* yp = y + (long)m0 * ldy;
        int t = tile_begin;
        for (; t + 2 <= tile_end; t += 2)
            int8_tile_group<2>(xp, rows, kp, wq + t * tile_bytes, tile_bytes,
                                     scales + t * scale_stride, group_pairs, bias, t * TILE_N,
                                     N, yp, ldy);
        if (t < tile_end)
            int8_tile_group<1>(xp, rows, kp, wq + t * tile_bytes, tile_bytes,
                                     scales + t * scale_stride, group_pairs, bias, t * TILE_N,
                                     N, yp, ldy);
    }
}
#endif

#if PAGEDRUN_X86
// The int8 format on AVX2 + FMA CPUs: 16 int8 of a pair row (8 outputs x (k even, k odd)) are
// sign-extended to int16, so each 32-bit lane holds one output's pair; shifts split the pair
// into two int32 vectors (even, odd), converted to float32 (exact), then two FMAs per row.
// MR_ rows (<= 2: 2 x 2 group sums + 2 x 2 totals + 4 weight vectors fit the 16 ymm) by one
// tile, group by group as the AVX512 kernel.
template <int MR_>
PAGEDRUN_AVX2_TARGET static inline void micro_int8_avx2(const float* xb, int kp,
                                                        const int8_t* wt, const float* st,
                                                        int group_pairs, const float* bias,
                                                        int n0, int N, float* y, long ldy) {
    const int num_groups = (kp + group_pairs - 1) / group_pairs;
    __m256 total[MR_][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR_; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < num_groups; ++g) {
        const int p0 = g * group_pairs;
        const int p1 = p0 + group_pairs < kp ? p0 + group_pairs : kp;
        __m256 acc[MR_][2];
#pragma GCC unroll 8
        for (int r = 0; r < MR_; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int p = p0; p < p1; ++p) {
            const int8_t* w = wt + (long)p * TILE_N * 2;
            __m256 we[2], wo[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
                const __m256i pairs = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * h)));
                we[h] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16));
                wo[h] = _mm256_cvtepi32_ps(_mm256_srai_epi32(pairs, 16));
            }
            fma_pair_avx2<MR_>(acc, xb, kp, p, we, wo);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const __m256 scale = _mm256_loadu_ps(st + (long)g * TILE_N + 8 * h);
#pragma GCC unroll 8
            for (int r = 0; r < MR_; ++r)
                total[r][h] = _mm256_fmadd_ps(acc[r][h], scale, total[r][h]);
        }
    }
    store_tile_avx2<MR_>(total, bias, n0, N, y, ldy);
}

PAGEDRUN_AVX2_TARGET static void gemm_int8_tiles_avx2(const uint16_t* xb, int M, int kp,
                                                      const int8_t* wq, const float* scales,
                                                      int group_pairs, int N, int tile_begin,
                                                      int tile_end, const float* bias,
                                                      float* y, long ldy) {
    const long tile_bytes = (long)kp * TILE_N * 2;
    const long scale_stride = (long)((kp + group_pairs - 1) / group_pairs) * TILE_N;
    const long xrow = (long)kp * 2;
    const float* xf = widen_rows_avx2(xb, M, kp);
    if (!xf) {  // no buffer: the portable loop needs none
        gemm_int8_tiles_scalar(xb, M, kp, wq, scales, group_pairs, N, tile_begin, tile_end,
                               bias, y, ldy);
        return;
    }
    for (int t = tile_begin; t < tile_end; ++t) {
        const int8_t* wt = wq + t * tile_bytes;
        const float* st = scales + t * scale_stride;
        int m = 0;
        for (; m + 2 <= M; m += 2)
            micro_int8_avx2<2>(xf + m * xrow, kp, wt, st, group_pairs, bias, t * TILE_N, N,
                               y + m * ldy, ldy);
        if (m < M)
            micro_int8_avx2<1>(xf + m * xrow, kp, wt, st, group_pairs, bias, t * TILE_N, N,
                               y + m * ldy, ldy);
    }
}
#endif

// path 1: AVX512-BF16, 2: AVX2 + FMA, else the portable loop.
static inline void gemm_int8_tiles(int path, const uint16_t* xb, int M, int kp,
                                   const int8_t* wq, const float* scales, int group_pairs,
                                   int N, int tile_begin, int tile_end, const float* bias,
                                   float* y, long ldy) {
#if PAGEDRUN_X86
    if (path == 1 || path == 3) {  // (no AMX int8-weight kernel: int8 x bf16 is not a tile op)
        gemm_int8_tiles_avx512(xb, M, kp, wq, scales, group_pairs, N, tile_begin, tile_end,
                               bias, y, ldy);
        return;
    }
    if (path == 2) {
        gemm_int8_tiles_avx2(xb, M, kp, wq, scales, group_pairs, N, tile_begin, tile_end, bias,
                             y, ldy);
        return;
    }
#endif
    gemm_int8_tiles_scalar(xb, M, kp, wq, scales, group_pairs, N, tile_begin, tile_end, bias, y,
                           ldy);
}

}  // namespace pagedrun_gemm

// The GGUF GEMM on weights unpacked to bf16: this file's AVX512-BF16 micro-kernel on a panel.
#include "cpu_gguf_bf16_kernels.h"

namespace pagedrun_gemm {

// ------------------------------------------------------------------------- the two-way split
// The second GEMM thread without Python: the process's helper thread (cpu_thread_pool.h, shared
// with cpu_ops and cpu_decode_step) runs one half of the tiles while the caller runs the other;
// a half the helper has not claimed when the caller is done with its own, the caller runs too.
struct TileJob {
    int path;
    const uint16_t* xb;
    int M, kp;
    const uint16_t* wp;   // bf16 weights, or nullptr with wq (int8) and scales
    const int8_t* wq;
    const float* scales;
    int group_pairs;      // int8: pairs of K per scale group
    int N, tile_begin, tile_end;
    const float* bias;
    float* y;
    long ldy;
    const GgufJob* gguf;  // non-null: GGUF-block weights (cpu_quant_kernels.h), xb/wp unused
};

static inline void run_job(const TileJob& j) {
    if (j.gguf != nullptr && j.gguf->xb != nullptr)
        gguf_tiles_bf16(*j.gguf, j.gguf->xb, j.N, j.tile_begin, j.tile_end, j.bias, j.y, j.ldy);
    else if (j.gguf != nullptr)
        gguf_tiles(*j.gguf, j.N, j.tile_begin, j.tile_end, j.bias, j.y, j.ldy);
    else if (j.wq != nullptr)
        gemm_int8_tiles(j.path, j.xb, j.M, j.kp, j.wq, j.scales, j.group_pairs, j.N,
                        j.tile_begin, j.tile_end, j.bias, j.y, j.ldy);
    else
        gemm_tiles(j.path, j.xb, j.M, j.kp, j.wp, j.N, j.tile_begin, j.tile_end, j.bias, j.y,
                   j.ldy);
}

// The two halves of a run_split, for cpu_thread_pool.h's run_pair (part 0 here, 1 on the helper).
struct TileJobPair {
    TileJob half[2];
};

static void run_tile_job_part(const void* ctx, int part) {
    run_job(static_cast<const TileJobPair*>(ctx)->half[part]);
}

static inline void run_split(const TileJob& mine, const TileJob& theirs) {
    const TileJobPair pair{{mine, theirs}};
    pagedrun_threads::run_pair(run_tile_job_part, &pair);
}

// What pyx/cpu_decode_step.h calls, as one table that pagedrun.pyx.cpu_gemm exports
// (cpu_gemm.pxd) and cpu_decode_step binds at import. A `static inline` function is emitted
// only in a module that calls it, so through the table these kernels are compiled once, in
// cpu_gemm, where cpu_decode_step's own calls compiled every GEMM path a second time (its
// object took 68 of a wheel build's ~215 CPU-seconds). The decode loop runs cpu_gemm's
// machine code, so the same bits as cpu_gemm's own calls; one indirect call per GEMM.
struct GemmTable {
    void (*convert_rows)(const float* x, long stride_m, long stride_k, int M, int K,
                         uint16_t* xb, int kp2);
    void (*run_job)(const TileJob& job);
    void (*run_split)(const TileJob& mine, const TileJob& theirs);
    void (*gguf_quantize_rows)(int path, const float* x, long stride_m, long stride_k, int M,
                               int K, int offset, int residual, int8_t* xq, float* xd,
                               float* xs, int32_t* xcorr);
    int (*gguf_activations_for_rows)(int path, int activations, int M);
};

static inline const GemmTable* gemm_table() {
    static const GemmTable table = {convert_rows, run_job, run_split, gguf_quantize_rows,
                                    gguf_activations_for_rows};
    return &table;
}

}  // namespace pagedrun_gemm
