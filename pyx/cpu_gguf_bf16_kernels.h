// cpu_gguf_bf16_kernels.h: the GGUF GEMM with bf16 activations (gemm_gguf activations "bf16"):
// each weight tile pair is unpacked from the packed GGUF layout (cpu_quant_kernels.h) to bf16
// into a small scratch panel in the bf16 GEMM's own layout (cpu_gemm_kernels.h: [kp][16 n][2]
// uint16 per tile), and the bf16 GEMM's micro-kernel (rows_avx512, vdpbf16ps) runs on it. The
// weights stay quantized in memory; the unpack is paid once per tile pair per pass of rows and
// shared by all of them, so from a few tens of rows the cost per row approaches the bf16
// GEMM's, where the q8x2 vpdpbusd kernel does two integer passes plus per-row block scales.
// Included by cpu_gemm_kernels.h after its AVX512-BF16 section (it reuses that micro-kernel).
//
//   y[M, N] (float32) = bf16(x)[M, K] @ bf16(W)[N, K]^T (+ bias[N]), K % 32 == 0
//
// W is the packed weight's own float32 dequantization (PackedGgufWeight.dequantize(), which is
// gguf's), rounded to bf16 (round to nearest even, as f32_to_bf16). Per 32-block (Q6_K: per
// 16-wide half) and output, W = fma(float(u), d, c) with u the stored unsigned quant and
// float32 d, c from the tile's scales (gguf_block_scales_vnni):
//   Q4_0: c = -8 d   Q8_0 / Q5_0: c = -128 d (u = q + 128)   Q4_1: c = m
//   Q4_K / Q5_K: d = d * sc, c = -(dmin * m)   Q6_K: d = d * sc, c = -32 d   I4Z: c = -(s * z)
// That is gguf's float32 arithmetic bit for bit: d * u is exact in float32 (d has at most 18
// significant bits -- an fp16 times a 6- or 8-bit int scale -- and u at most 8), so the fma's
// single rounding is that of gguf's add (Q4_1, Q4_K, Q5_K) or none at all (the others: the
// product d * (u - offset) is itself exact).
//
// Unpack (AVX512-VBMI vpermb): a 64-byte quant group holds 16 outputs x 4 consecutive k (a
// 32-bit lane per output; Q4 types: low nibbles k 4L + j, high nibbles 16 + 4L + j). The
// pair row (k, k + 1) of the bf16 panel has output n's pair in 32-bit lane n;
// vcvtne2ps2bf16(a, b) puts b's 16 floats in words 0-15 and a's in words 16-31, so b holds
// outputs 0-7 and a outputs 8-15, each output's k and k + 1 side by side: a zero-masked vpermb
// gathers those 16 bytes into the low bytes of 16 dwords, vcvtdq2ps, one fma with d and c
// permuted the same way (once per block), then vcvtne2ps2bf16 writes the pair row directly:
// ~9 vector ops per 32 bf16 weights (one zmm of the panel), shared by every row of the pass.
// Scratch: NR tiles x K x 16 outputs x 2 bytes per thread (96 KB at K 1536), thread-local,
// kept between calls (an mmap'ed malloc per call page-faults it in each time).
//
// Paths: AVX512-BF16 + VBMI + VNNI (the scales' helper; every AVX512-BF16 CPU but Cooper Lake
// has all three: gguf_bf16_available), and a portable scalar loop over the same math (the
// "portable" GGUF path; also any CPU without them).
// When "auto" picks it (gguf_activations_for_rows): see GGUF_BF16_MIN_ROWS.
#pragma once

#include <stdint.h>
#include <stdlib.h>

namespace pagedrun_gemm {

// gemm_gguf's activation modes (cpu_gemm.GGUF_ACTIVATION_CODE): the int8 ones of
// cpu_quant_kernels.h, bf16 (this file), and auto: q8x2 below GGUF_BF16_MIN_ROWS rows of x
// (or on an AMX-INT8 path, or a CPU without gguf_bf16_available), bf16 from there.
enum { GGUF_ACT_Q8 = 0, GGUF_ACT_Q8X2 = 1, GGUF_ACT_BF16 = 2, GGUF_ACT_AUTO = 3 };
// Rows of x from which "auto" takes bf16 activations on the avx512vnni path. Measured on Zen 4
// (AMD EPYC, 2 vCPUs, 2 threads, benchmarks/bench_gguf_gemm.py --shapes default, medians,
// 2026-12-03; time as a fraction of the avx512bf16 GEMM's, q8x2 -> bf16): M 8 0.6-0.85 ->
// 0.45-0.65 (q8x2 wins: the unpack, ~9 vector ops per 32 weights, is shared by too few rows);
// M 16-24 layer shapes 0.75-0.83 -> 0.75-0.94, a wash, but the LM head (Q8_0 49152 x 576)
// 0.7-0.8 -> 0.55-0.6; M 32 layers 0.77-0.88 -> 0.87-0.90 (head 0.75 -> 0.71); M 64 layers
// 0.68-0.84 -> 0.89-0.95, head 0.66-0.75 -> 0.79-0.82. Per decode step of the default model
// (30 layers + head) bf16 is ahead from 32 rows; below, q8x2 (memory-bound at M 1) wins.
constexpr int GGUF_BF16_MIN_ROWS = 32;
// Rows per pass at least this many (the bf16 GEMM's pass, rows_per_pass, shrinks with K): each
// pass unpacks every tile again, so a pass must share the unpack among enough rows.
constexpr int GGUF_BF16_MIN_PASS_ROWS = 64;

#if PAGEDRUN_X86
static inline int gguf_bf16_available() {
    __builtin_cpu_init();
    static const int ok = cpu_has_avx512bf16() && cpu_has_avx512vnni() &&
                          __builtin_cpu_supports("avx512vbmi");
    return ok;
}
#else
static inline int gguf_bf16_available() { return 0; }
#endif

// The activation mode one call with M rows of x runs: `activations` itself unless it is auto.
// The per-op path (cpu_gemm.gemm_gguf) and the compiled decode loop (cpu_decode_step.h) both
// ask this, so they choose alike and stay bit-identical.
static inline int gguf_activations_for_rows(int path, int activations, int M) {
    if (activations != GGUF_ACT_AUTO) return activations;
    return path == GGUF_PATH_VNNI && M >= GGUF_BF16_MIN_ROWS && gguf_bf16_available() ? GGUF_ACT_BF16
                                                                         : GGUF_ACT_Q8X2;
}

// ------------------------------------------------------------------------- portable path
// Per tile and 32-block: the block's weights as float (bf16-rounded), then every row's
// products accumulated into y in float32, block by block; the bias last.
template <int TYPE>
static void gguf_tiles_bf16_portable_t(const GgufJob& g, const uint16_t* xb, int N,
                                       int tile_begin, int tile_end, const float* bias,
                                       float* y, long ldy) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    constexpr bool BYTES = TYPE == GGUF_Q8_0 || TYPE == GGUF_Q6_K || TYPE == GGUF_Q5_K;
    const int nb = g.nb, K = nb * GGUF_QK, M = g.M;
    const long tile_bytes = gguf_tile_bytes(TYPE, nb);
    float w[GGUF_TILE_N][GGUF_QK];
    for (int t = tile_begin; t < tile_end; ++t) {
        const uint8_t* wt = g.wq + t * tile_bytes;
        const int n0 = t * GGUF_TILE_N;
        const int width = N - n0 < GGUF_TILE_N ? N - n0 : GGUF_TILE_N;
        for (int r = 0; r < M; ++r)
            for (int n = 0; n < width; ++n) y[(long)r * ldy + n0 + n] = 0.0f;
        for (int b = 0; b < nb; ++b) {
            const uint8_t* wb = wt + (long)(b / SUP) * SB + (b % SUP) * QB;
            float ds[2][GGUF_TILE_N], mn[GGUF_TILE_N];
            gguf_block_scales_scalar<TYPE>(wt, b, ds, mn);
            for (int n = 0; n < GGUF_TILE_N; ++n)
                for (int kk = 0; kk < GGUF_QK; ++kk) {
                    int u;
                    if (BYTES) {
                        u = wb[64 * (kk / 4) + 4 * n + kk % 4];
                    } else {
                        const uint8_t byte = wb[64 * ((kk % 16) / 4) + 4 * n + kk % 4];
                        u = kk < 16 ? byte & 0x0F : byte >> 4;
                    }
                    const float d = ds[TYPE == GGUF_Q6_K ? kk / 16 : 0][n];
                    float c;  // the header's table (the scalar scales: Q4_K's mn is -dmin * m)
                    if (TYPE == GGUF_Q4_0) c = -8.0f * d;
                    else if (TYPE == GGUF_Q8_0) c = -128.0f * d;
                    else if (TYPE == GGUF_Q6_K) c = -32.0f * d;
                    else c = mn[n];
                    w[n][kk] = bf16_to_f32(f32_to_bf16(fmaf((float)u, d, c)));
                }
            for (int r = 0; r < M; ++r) {
                const uint16_t* xr = xb + (long)r * K + b * GGUF_QK;
                float* yr = y + (long)r * ldy + n0;
                for (int n = 0; n < width; ++n) {
                    float acc = yr[n];
                    for (int kk = 0; kk < GGUF_QK; ++kk)
                        acc = fmaf(bf16_to_f32(xr[kk]), w[n][kk], acc);
                    yr[n] = acc;
                }
            }
        }
        if (bias)
            for (int r = 0; r < M; ++r)
                for (int n = 0; n < width; ++n) y[(long)r * ldy + n0 + n] += bias[n0 + n];
    }
}

// ------------------------------------------------------------------------- AVX512 path
#if PAGEDRUN_X86
#define PAGEDRUN_GGUF_BF16_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,avx512vnni")))

// This thread's unpack panel of at least `elems` uint16 (64-byte aligned), grown as needed and
// kept (freed at thread exit); nullptr if it cannot be had.
static inline uint16_t* gguf_bf16_scratch(size_t elems) {
    struct Scratch {
        uint16_t* p = nullptr;
        size_t n = 0;
        ~Scratch() { free(p); }
    };
    static thread_local Scratch s;
    if (s.n < elems) {
        free(s.p);
        s.p = static_cast<uint16_t*>(aligned_alloc(64, (elems * 2 + 63) / 64 * 64));
        s.n = s.p ? elems : 0;
    }
    return s.p;
}

// The 16 bytes of pair row s (k 2s, 2s + 1 of each output's 4-byte lane) of one half of the
// outputs (hi: 8-15) in the low bytes of 16 dwords: the vpermb index (the mask zeroes the rest).
PAGEDRUN_GGUF_BF16_TARGET static inline __m512i gguf_bf16_pair_index(int s, int hi) {
    alignas(64) uint8_t idx[64] = {0};
    for (int i = 0; i < 16; ++i) idx[4 * i] = (uint8_t)(4 * (8 * hi + i / 2) + 2 * s + i % 2);
    __m512i v;
    memcpy(&v, idx, 64);
    return v;
}

// One pair row of the panel (32 bf16 at `out`) from the 4-byte lanes of v: sel, the vpermb
// indices of outputs 0-7 and 8-15 (gguf_bf16_pair_index); d, c in the same pair order.
PAGEDRUN_GGUF_BF16_TARGET __attribute__((always_inline)) static inline void gguf_bf16_pair_row(
        __m512i v, const __m512i (&sel)[2], const __m512 (&d)[2], const __m512 (&c)[2],
        uint16_t* out) {
    constexpr __mmask64 LOW_BYTES = 0x1111111111111111ull;  // byte 0 of each dword
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(LOW_BYTES, sel[0], v));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(LOW_BYTES, sel[1], v));
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d[1], c[1]),
                                           _mm512_fmadd_ps(lo, d[0], c[0]));
    _mm512_store_si512(out, (__m512i)w);
}

// Tile wt's panel (nb blocks) -> out [nb * 16 pairs][16 n][2] bf16 (the bf16 GEMM's tile).
template <int TYPE>
PAGEDRUN_GGUF_BF16_TARGET static inline void gguf_unpack_tile_bf16(const uint8_t* wt,
                                                                   long tile_bytes, int nb,
                                                                   uint16_t* out) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    constexpr bool BYTES = TYPE == GGUF_Q8_0 || TYPE == GGUF_Q6_K || TYPE == GGUF_Q5_K;
    constexpr int H = TYPE == GGUF_Q6_K ? 2 : 1;  // scale sets per block
    const __m512i sel[2][2] = {{gguf_bf16_pair_index(0, 0), gguf_bf16_pair_index(0, 1)},
                               {gguf_bf16_pair_index(1, 0), gguf_bf16_pair_index(1, 1)}};
    const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dup_hi =
        _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; ++b) {
        __m512 ds[1][2], mn[1];
        gguf_block_scales_vnni<TYPE, 1>(wt, tile_bytes, b, ds, mn);
        // d and c per output, then duplicated into the pair order of b (lo) and a (hi).
        __m512 dd[H][2], cc[H][2];
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
            const __m512 d = ds[0][h];
            __m512 c;
            if constexpr (TYPE == GGUF_Q4_0) c = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
            else if constexpr (TYPE == GGUF_Q8_0) c = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
            else if constexpr (TYPE == GGUF_Q6_K) c = _mm512_mul_ps(d, _mm512_set1_ps(-32.0f));
            else if constexpr (TYPE == GGUF_Q4_1) c = mn[0];
            else c = _mm512_sub_ps(_mm512_setzero_ps(), mn[0]);  // Q4_K, Q5_K, I4Z: -mn
            dd[h][0] = _mm512_permutexvar_ps(dup_lo, d);
            dd[h][1] = _mm512_permutexvar_ps(dup_hi, d);
            cc[h][0] = _mm512_permutexvar_ps(dup_lo, c);
            cc[h][1] = _mm512_permutexvar_ps(dup_hi, c);
        }
        const uint8_t* wb = wt + (long)(b / SUP) * SB + (b % SUP) * QB;
        uint16_t* ob = out + (long)b * 16 * GGUF_TILE_N * 2;  // 16 pair rows per block
        if constexpr (BYTES) {
#pragma GCC unroll 8
            for (int gq = 0; gq < 8; ++gq) {  // k 4 gq .. 4 gq + 3
                const __m512i v = _mm512_loadu_si512(wb + 64 * gq);
                const int h = TYPE == GGUF_Q6_K ? gq / 4 : 0;
                gguf_bf16_pair_row(v, sel[0], dd[h], cc[h], ob + 64L * gq);
                gguf_bf16_pair_row(v, sel[1], dd[h], cc[h], ob + 64L * gq + 32);
            }
        } else {
#pragma GCC unroll 4
            for (int L = 0; L < 4; ++L) {  // low nibbles k 4 L .., high 16 + 4 L ..
                const __m512i v = _mm512_loadu_si512(wb + 64 * L);
                const __m512i lo = _mm512_and_si512(v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                gguf_bf16_pair_row(lo, sel[0], dd[0], cc[0], ob + 64L * L);
                gguf_bf16_pair_row(lo, sel[1], dd[0], cc[0], ob + 64L * L + 32);
                gguf_bf16_pair_row(hi, sel[0], dd[0], cc[0], ob + 64L * (L + 4));
                gguf_bf16_pair_row(hi, sel[1], dd[0], cc[0], ob + 64L * (L + 4) + 32);
            }
        }
    }
}

// Tiles [tile_begin, tile_end) of y: per pass of rows, per tile pair, unpack then the bf16
// GEMM's rows_avx512 (8-row blocks by NR tiles, bias in its epilogue).
template <int TYPE>
PAGEDRUN_GGUF_BF16_TARGET static void gguf_tiles_bf16_t(const GgufJob& g, const uint16_t* xb,
                                                        int N, int tile_begin, int tile_end,
                                                        const float* bias, float* y,
                                                        long ldy) {
    const int nb = g.nb, kp = nb * GGUF_QK / 2, M = g.M;
    const long tile_bytes = gguf_tile_bytes(TYPE, nb);
    const long tile_elems = (long)kp * TILE_N * 2;
    uint16_t* panel = gguf_bf16_scratch((size_t)NR * tile_elems);
    if (!panel) {
        gguf_tiles_bf16_portable_t<TYPE>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        return;
    }
    static_assert(TILE_N == GGUF_TILE_N, "one tile of outputs in both layouts");
    int pass_rows = rows_per_pass(kp);
    if (pass_rows < GGUF_BF16_MIN_PASS_ROWS) pass_rows = GGUF_BF16_MIN_PASS_ROWS;
    for (int m0 = 0; m0 < M; m0 += pass_rows) {
        const int rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        const uint16_t* xp = xb + (long)m0 * kp * 2;
        float* yp = y + (long)m0 * ldy;
        for (int t = tile_begin; t < tile_end; t += NR) {
            const int nt = tile_end - t < NR ? tile_end - t : NR;
            for (int c = 0; c < nt; ++c)
                gguf_unpack_tile_bf16<TYPE>(g.wq + (t + c) * tile_bytes, tile_bytes, nb,
                                            panel + c * tile_elems);
            if (nt == NR)
                rows_avx512<NR>(xp, rows, kp, panel, tile_elems, bias, t * TILE_N, N, yp, ldy);
            else
                rows_avx512<1>(xp, rows, kp, panel, tile_elems, bias, t * TILE_N, N, yp, ldy);
        }
    }
}
#endif

template <int TYPE>
static inline void gguf_tiles_bf16_type(const GgufJob& g, const uint16_t* xb, int N,
                                        int tile_begin, int tile_end, const float* bias,
                                        float* y, long ldy) {
#if PAGEDRUN_X86
    // The AVX-512 kernel on the AVX-512 paths only: a path capped at avx2 stays below it.
    if (g.path != GGUF_PATH_PORTABLE && g.path != GGUF_PATH_AVX2 && gguf_bf16_available()) {
        gguf_tiles_bf16_t<TYPE>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        return;
    }
#endif
    gguf_tiles_bf16_portable_t<TYPE>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
}

// Tiles [tile_begin, tile_end) of y from bf16 activations xb [g.M][K] (K = 32 g.nb).
static inline void gguf_tiles_bf16(const GgufJob& g, const uint16_t* xb, int N,
                                   int tile_begin, int tile_end, const float* bias, float* y,
                                   long ldy) {
    switch (g.type) {
        case GGUF_Q4_0:
            return gguf_tiles_bf16_type<GGUF_Q4_0>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        case GGUF_Q4_1:
            return gguf_tiles_bf16_type<GGUF_Q4_1>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        case GGUF_Q4_K:
            return gguf_tiles_bf16_type<GGUF_Q4_K>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        case GGUF_Q6_K:
            return gguf_tiles_bf16_type<GGUF_Q6_K>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        case GGUF_I4Z:
            return gguf_tiles_bf16_type<GGUF_I4Z>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        case GGUF_Q5_K:
            return gguf_tiles_bf16_type<GGUF_Q5_K>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
        default:
            return gguf_tiles_bf16_type<GGUF_Q8_0>(g, xb, N, tile_begin, tile_end, bias, y, ldy);
    }
}

}  // namespace pagedrun_gemm
