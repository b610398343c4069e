// cpu_quant_avx2_kernels.h: the GGUF-block GEMM's AVX2 path ("avx2", GgufJob.path 4) for x86-64
// CPUs without AVX512-VNNI (Zen 2/3, Haswell .. Alder Lake's P cores with AVX-512 fused off).
// Included from cpu_quant_kernels.h after the portable path; it reads the same packed tile
// layout (see there) and the same quantized activations, and does the portable path's float
// operations per output in its order, so all paths agree bit for bit.
//
// The integer dot of a 32-block. AVX2 has no vpdpbusd; vpmaddubsw multiplies u8 weights by s8
// activations and adds adjacent pairs into SATURATING int16, then vpmaddwd by ones adds the
// int16 pairs into the int32 lane (4 consecutive k of one output: the layout's 32-bit lane).
// Exactness needs every int16 sum below 2^15. |qx| <= 127, so one vpmaddubsw lane is at most
// 2 * 127 * umax; this many of them may be added in int16 before widening
// (gguf_avx2_s16_sums below):
//   nibbles (Q4_0, Q4_1, Q4_K, I4Z), umax 15: 2 * 127 * 15 = 3810, 8 per block (30480): the
//     whole block (4 L x low / high) in one int16 accumulator, one vpmaddwd per block;
//   Q5_K, umax 31: 7874, 4 (31496);  Q6_K, umax 63: 16002, 2 (32004);
//   Q8_0 (and Q5_0, stored as Q8_0): u = q + 128 would reach 2 * 255 * 127 = 64770 and
//     saturate, so the kernel undoes the offset (u XOR 0x80 = q, int8) and multiplies |q| (u8,
//     <= 128) by sign(qx, q) (vpsignb): q * qx exactly, at most 2 * 128 * 127 = 32512, 1 sum.
//     That is the signed dot itself, sum(q qx) = sum(u qx) + xcorr: the block's xcorr is not
//     added again (the same integer as the other paths).
// Micro-kernel: MR_ rows x NH_ halves of a tile (8 outputs each, one ymm of int32 / float32
// lanes); per block the halves' 32-byte slices are loaded once and used by every row, each
// row's 4 bytes of qx broadcast once and used by every half. Decode (M <= 2 kernel rows: one
// token with q8x2's residual row) runs both halves at once (one pass over the tile's stream);
// from 3 rows, blocks of 4 rows x one half (4 float32 + 4 int16 accumulators, 2 weight and 2
// activation registers: no spills in 16 ymm; Q6_K's two dots per row spill a few).
#pragma once

#if PAGEDRUN_X86
namespace pagedrun_gemm {

#define PAGEDRUN_GGUF_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

// AVX2 + FMA + F16C (the scales are fp16): 1 if the path may run.
static inline int cpu_has_gguf_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

// vpmaddubsw results an int16 accumulator may sum exactly (the header's bounds).
template <int TYPE>
static inline constexpr int gguf_avx2_s16_sums() {
    return TYPE == GGUF_Q8_0 ? 1 : TYPE == GGUF_Q6_K ? 2 : TYPE == GGUF_Q5_K ? 4 : 8;
}

// ------------------------------------------------------------------------- activations
// v0, v1 (32 floats) against scale dx -> q (dx 0: zeros), q as int32 in q0, q1; returns sum.
// The scalar quantizer's operations: exact division, round-half-even conversion under the
// default MXCSR, clamp to [-127, 127].
PAGEDRUN_GGUF_AVX2_TARGET static inline int32_t gguf_round_block_avx2(const __m256 (&v)[4],
                                                                     float dx, int8_t* q,
                                                                     __m256i (&qi)[4]) {
    if (dx == 0.0f) {
        memset(q, 0, GGUF_QK);
        for (int i = 0; i < 4; ++i) qi[i] = _mm256_setzero_si256();
        return 0;
    }
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    const __m256 vd = _mm256_set1_ps(dx);
    for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_max_epi32(
            _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_div_ps(v[i], vd)), lim), nlim);
    // int32 -> int8 (values in range: the saturating packs are exact); packs interleave the
    // 128-bit lanes, the permute puts the 32 bytes back in k order.
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                       _mm256_add_epi32(qi[2], qi[3]));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    return _mm_cvtsi128_si32(s2) + _mm_extract_epi32(s2, 1);
}

// The sum of the first 16 q (Q6_K's low half): qi[0], qi[1].
PAGEDRUN_GGUF_AVX2_TARGET static inline int32_t gguf_sum16_avx2(const __m256i (&qi)[4]) {
    const __m256i s = _mm256_add_epi32(qi[0], qi[1]);
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    return _mm_cvtsi128_si32(s2) + _mm_extract_epi32(s2, 1);
}

// Contiguous rows: gguf_quantize_rows_scalar's definition, 8 floats at a time (same bytes).
PAGEDRUN_GGUF_AVX2_TARGET static void gguf_quantize_rows_avx2(const float* x, long stride_m,
                                                              int M, int K, int offset,
                                                              int residual, int8_t* xq,
                                                              float* xd, float* xs,
                                                              int32_t* xcorr) {
    const int nb = K / GGUF_QK;
    const bool split = offset == GGUF_XCORR_SPLIT16;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int m = 0; m < M; ++m) {
        const float* row = x + (long)m * stride_m;
        for (int b = 0; b < nb; ++b) {
            __m256 v[4];
            for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(row + b * GGUF_QK + 8 * i);
            __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask),
                                                   _mm256_and_ps(v[1], abs_mask)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], abs_mask),
                                                   _mm256_and_ps(v[3], abs_mask)));
            __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
            a4 = _mm_max_ss(a4, _mm_shuffle_ps(a4, a4, 1));
            const float dx = _mm_cvtss_f32(a4) / 127.0f;
            long o = (long)m * nb + b;
            int8_t* q = xq + (long)m * K + b * GGUF_QK;
            __m256i qi[4];
            int32_t sum = gguf_round_block_avx2(v, dx, q, qi);
            xd[o] = dx;
            xcorr[o] = gguf_xcorr(offset, sum, split ? gguf_sum16_avx2(qi) : 0);
            xs[o] = dx * (float)sum;
            if (!residual) continue;
            const __m256 vdx = _mm256_set1_ps(dx);
            __m256 r[4];
            for (int i = 0; i < 4; ++i)  // fma(-dx, q, v): one rounding, as the scalar path
                r[i] = _mm256_fnmadd_ps(vdx, _mm256_cvtepi32_ps(qi[i]), v[i]);
            const float dx2 = dx / 256.0f;
            o += (long)M * nb;
            sum = gguf_round_block_avx2(r, dx2, q + (long)M * K, qi);
            xd[o] = dx2;
            xcorr[o] = gguf_xcorr(offset, sum, split ? gguf_sum16_avx2(qi) : 0);
            xs[o] = dx2 * (float)sum;
        }
    }
}

// ------------------------------------------------------------------------- the GEMM
// 8 fp16 / unsigned bytes / signed bytes -> float32 (the scales' conversions).
PAGEDRUN_GGUF_AVX2_TARGET __attribute__((always_inline)) static inline __m256 half8(
        const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
PAGEDRUN_GGUF_AVX2_TARGET __attribute__((always_inline)) static inline __m256 u8x8(
        const uint8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
PAGEDRUN_GGUF_AVX2_TARGET __attribute__((always_inline)) static inline __m256 s8x8(
        const uint8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The per-output float32 scales of block b, tile half h (outputs 8 h .. 8 h + 7):
// gguf_block_scales_scalar's values and float ops. ds[0] (Q6_K: ds[1], its second 16-wide
// half block); mn: Q4_1's m, or (Q4_K, Q5_K, I4Z) the positive dmin * m / s * z, subtracted by
// fnmadd.
template <int TYPE>
PAGEDRUN_GGUF_AVX2_TARGET __attribute__((always_inline)) static inline void
gguf_half_scales_avx2(const uint8_t* wt, int b, int h, __m256 (&ds)[2], __m256& mn) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    const int j = b % SUP;
    const uint8_t* sc = wt + (long)(b / SUP) * SB + SUP * QB;  // the unit's scales
    if constexpr (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K) {
        ds[0] = _mm256_mul_ps(half8(sc + 256 + 16 * h), u8x8(sc + 16 * j + 8 * h));
        mn = _mm256_mul_ps(half8(sc + 288 + 16 * h), u8x8(sc + 128 + 16 * j + 8 * h));
    } else if constexpr (TYPE == GGUF_Q6_K) {
        const __m256 d = half8(sc + 256 + 16 * h);
        ds[0] = _mm256_mul_ps(d, s8x8(sc + 32 * j + 8 * h));
        ds[1] = _mm256_mul_ps(d, s8x8(sc + 32 * j + 16 + 8 * h));
    } else if constexpr (TYPE == GGUF_I4Z) {
        ds[0] = half8(sc + 16 * h);
        mn = _mm256_mul_ps(ds[0], u8x8(sc + 32 + 8 * h));
    } else {
        ds[0] = half8(sc + 16 * h);
        if constexpr (TYPE == GGUF_Q4_1) mn = half8(sc + 32 + 16 * h);
    }
}

// int32 accumulators of MR_ rows x NH_ halves, zeroed.
template <int MR_, int NH_>
PAGEDRUN_GGUF_AVX2_TARGET __attribute__((always_inline)) static inline void gguf_zero_avx2(
        __m256i (&a)[MR_][NH_]) {
#pragma GCC unroll 8
    for (int r = 0; r < MR_; ++r)
#pragma GCC unroll 2
        for (int c = 0; c < NH_; ++c) a[r][c] = _mm256_setzero_si256();
}

// MR_ rows x NH_ tile halves (h0, h0 + 1, ...) over all of K, then y (+ bias).
template <int TYPE, int MR_, int NH_>
PAGEDRUN_GGUF_AVX2_TARGET static inline void gguf_micro_avx2(const GgufJob& g, int m0,
                                                             const uint8_t* wt, int n0, int h0,
                                                             int N, const float* bias, float* y,
                                                             long ldy) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    constexpr bool BYTES = TYPE == GGUF_Q8_0 || TYPE == GGUF_Q6_K || TYPE == GGUF_Q5_K;
    constexpr int SUMS = gguf_avx2_s16_sums<TYPE>();
    constexpr int SA = TYPE == GGUF_Q6_K ? 2 : 1;  // int32 dots per (row, half)
    const int nb = g.nb, K = nb * GGUF_QK;
    const int8_t* xq = g.xq + (long)m0 * K;
    const long xo = (long)m0 * nb;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones16 = _mm256_set1_epi16(1);
    __m256 acc[MR_][NH_];
#pragma GCC unroll 8
    for (int r = 0; r < MR_; ++r)
#pragma GCC unroll 2
        for (int c = 0; c < NH_; ++c) acc[r][c] = _mm256_setzero_ps();
    // Per block: the integer dots (SA of them per (row, half): Q6_K's two 16-wide halves),
    // each folded into the float accumulators as soon as it is complete, in the portable
    // path's order (Q6_K: h 0, then h 1; then Q4_1 / Q4_K / Q5_K / I4Z's min term), so that at
    // most one set of dots is live. The loops over a block's pieces are not unrolled: fully
    // unrolled, GCC hoists every product ahead of its sums and spills them from the 16 ymm.
    for (int b = 0; b < nb; ++b) {
        const uint8_t* wb = wt + (long)(b / SUP) * SB + (b % SUP) * QB + 32 * h0;
        __m256 ds[NH_][2], mn[NH_];
#pragma GCC unroll 2
        for (int c = 0; c < NH_; ++c) gguf_half_scales_avx2<TYPE>(wt, b, h0 + c, ds[c], mn[c]);
#pragma GCC unroll 2
        for (int a = 0; a < SA; ++a) {
            __m256i dot[MR_][NH_];
            if constexpr (!BYTES) {  // nibbles: the whole block in one int16 sum
                __m256i s16[MR_][NH_];
                gguf_zero_avx2<MR_, NH_>(s16);
#pragma GCC unroll 1
                for (int L = 0; L < 4; ++L) {
                    __m256i lo[NH_], hi[NH_];
#pragma GCC unroll 2
                    for (int c = 0; c < NH_; ++c) {
                        const __m256i v = _mm256_loadu_si256(
                            reinterpret_cast<const __m256i*>(wb + 64 * L + 32 * c));
                        lo[c] = _mm256_and_si256(v, low4);
                        hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < MR_; ++r) {
                        const int8_t* xr = xq + (long)r * K + b * GGUF_QK;
                        const __m256i xl = _mm256_set1_epi32(gguf_load_i32(xr + 4 * L));
                        const __m256i xh =
                            _mm256_set1_epi32(gguf_load_i32(xr + 16 + 4 * L));
#pragma GCC unroll 2
                        for (int c = 0; c < NH_; ++c)
                            s16[r][c] = _mm256_add_epi16(
                                _mm256_add_epi16(s16[r][c], _mm256_maddubs_epi16(lo[c], xl)),
                                _mm256_maddubs_epi16(hi[c], xh));
                    }
                }
#pragma GCC unroll 8
                for (int r = 0; r < MR_; ++r)
#pragma GCC unroll 2
                    for (int c = 0; c < NH_; ++c) dot[r][c] = _mm256_madd_epi16(s16[r][c], ones16);
            } else {  // a byte a weight: this dot's groups gq of 4 k, SUMS per int16 sum
                constexpr int GROUPS = 8 / SA, CHUNKS = GROUPS / SUMS;
                gguf_zero_avx2<MR_, NH_>(dot);
#pragma GCC unroll 1
                for (int ch = 0; ch < CHUNKS; ++ch) {
                    __m256i s16[MR_][NH_];
                    gguf_zero_avx2<MR_, NH_>(s16);
#pragma GCC unroll 1
                    for (int i = 0; i < SUMS; ++i) {
                        const int gq = a * GROUPS + ch * SUMS + i;
                        __m256i w[NH_], wabs[NH_];
#pragma GCC unroll 2
                        for (int c = 0; c < NH_; ++c) {
                            w[c] = _mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(wb + 64 * gq + 32 * c));
                            if constexpr (TYPE == GGUF_Q8_0) {  // u XOR 0x80 = q; |q| as u8
                                w[c] = _mm256_xor_si256(w[c], _mm256_set1_epi8((char)0x80));
                                wabs[c] = _mm256_abs_epi8(w[c]);
                            }
                        }
#pragma GCC unroll 8
                        for (int r = 0; r < MR_; ++r) {
                            const __m256i xv = _mm256_set1_epi32(
                                gguf_load_i32(xq + (long)r * K + b * GGUF_QK + 4 * gq));
#pragma GCC unroll 2
                            for (int c = 0; c < NH_; ++c)
                                s16[r][c] = _mm256_add_epi16(
                                    s16[r][c],
                                    TYPE == GGUF_Q8_0
                                        ? _mm256_maddubs_epi16(wabs[c], _mm256_sign_epi8(xv, w[c]))
                                        : _mm256_maddubs_epi16(w[c], xv));
                        }
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < MR_; ++r)
#pragma GCC unroll 2
                        for (int c = 0; c < NH_; ++c)
                            dot[r][c] = _mm256_add_epi32(dot[r][c],
                                                         _mm256_madd_epi16(s16[r][c], ones16));
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < MR_; ++r) {
                const long o = xo + (long)r * nb + b;
                const __m256 dxv = _mm256_set1_ps(g.xd[o]);
                int32_t corr = 0;  // Q4_0: xcorr; Q6_K: -32 * this half's 16-sum
                if constexpr (TYPE == GGUF_Q6_K) {
                    int32_t lo, hi;
                    gguf_split16(g.xcorr[o], lo, hi);
                    corr = -32 * (a == 0 ? lo : hi);
                } else if constexpr (TYPE == GGUF_Q4_0) {
                    corr = g.xcorr[o];
                }
#pragma GCC unroll 2
                for (int c = 0; c < NH_; ++c) {
                    __m256i s = dot[r][c];
                    if constexpr (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q6_K)
                        s = _mm256_add_epi32(s, _mm256_set1_epi32(corr));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                                _mm256_mul_ps(ds[c][a], dxv), acc[r][c]);
                    if constexpr (TYPE == GGUF_Q4_1)
                        acc[r][c] = _mm256_fmadd_ps(mn[c], _mm256_set1_ps(g.xs[o]), acc[r][c]);
                    if constexpr (TYPE == GGUF_Q4_K || TYPE == GGUF_I4Z || TYPE == GGUF_Q5_K)
                        acc[r][c] = _mm256_fnmadd_ps(mn[c], _mm256_set1_ps(g.xs[o]), acc[r][c]);
                }
            }
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 2
    for (int c = 0; c < NH_; ++c) {
        const int nc = n0 + 8 * (h0 + c);
        const int width = N - nc < 8 ? N - nc : 8;
        if (width <= 0) continue;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), lane);
        const __m256 bv = bias ? _mm256_maskload_ps(bias + nc, mask) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < MR_; ++r)
            _mm256_maskstore_ps(y + (long)(m0 + r) * ldy + nc, mask, _mm256_add_ps(acc[r][c], bv));
    }
}

// Rows of a pass [m0, m0 + rows) against one tile: blocks of 4 rows per half, then the rest.
template <int TYPE>
PAGEDRUN_GGUF_AVX2_TARGET static inline void gguf_rows_avx2(const GgufJob& g, int m0, int rows,
                                                            const uint8_t* wt, int n0, int N,
                                                            const float* bias, float* y,
                                                            long ldy) {
    for (int h = 0; h < 2; ++h) {
        if (n0 + 8 * h >= N) break;  // a partial last tile's empty half
        int m = m0;
        const int end = m0 + rows;
        for (; m + 4 <= end; m += 4) gguf_micro_avx2<TYPE, 4, 1>(g, m, wt, n0, h, N, bias, y, ldy);
        switch (end - m) {
            case 3: gguf_micro_avx2<TYPE, 3, 1>(g, m, wt, n0, h, N, bias, y, ldy); break;
            case 2: gguf_micro_avx2<TYPE, 2, 1>(g, m, wt, n0, h, N, bias, y, ldy); break;
            case 1: gguf_micro_avx2<TYPE, 1, 1>(g, m, wt, n0, h, N, bias, y, ldy); break;
            default: break;
        }
    }
}

template <int TYPE>
PAGEDRUN_GGUF_AVX2_TARGET static void gguf_tiles_avx2_t(const GgufJob& g, int N, int tile_begin,
                                                        int tile_end, const float* bias,
                                                        float* y, long ldy) {
    const long tile_bytes = gguf_tile_bytes(TYPE, g.nb);
    const int M = g.M;
    if (M <= 2) {  // decode: both halves in one pass over each tile's stream
        for (int t = tile_begin; t < tile_end; ++t) {
            const uint8_t* wt = g.wq + t * tile_bytes;
            const int n0 = t * GGUF_TILE_N;
            if (M == 1) gguf_micro_avx2<TYPE, 1, 2>(g, 0, wt, n0, 0, N, bias, y, ldy);
            else gguf_micro_avx2<TYPE, 2, 2>(g, 0, wt, n0, 0, N, bias, y, ldy);
        }
        return;
    }
    // Passes of rows whose qx stays in L2 while every tile streams past (the VNNI path's).
    long pass = GGUF_X_BLOCK_BYTES / ((long)g.nb * GGUF_QK) / 4 * 4;
    const int pass_rows = pass < 4 ? 4 : (int)pass;
    for (int m0 = 0; m0 < M; m0 += pass_rows) {
        const int rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        for (int t = tile_begin; t < tile_end; ++t)
            gguf_rows_avx2<TYPE>(g, m0, rows, g.wq + t * tile_bytes, t * GGUF_TILE_N, N, bias,
                                 y, ldy);
    }
}

}  // namespace pagedrun_gemm
#endif  // PAGEDRUN_X86
