// cpu_quant_kernels.h: the cpu GEMM over GGUF-quantized weights kept quantized (Q4_0, Q4_1,
// Q8_0, Q4_K, Q6_K), wrapped by pagedrun.pyx.cpu_gemm's PackedGgufWeight / gemm_gguf.
// Included from cpu_gemm_kernels.h (its TileJob carries a GgufJob; the tile split and helper
// thread are the bf16 GEMM's).
//
//   y[M, N] (float32) = x[M, K] (float32) @ W[N, K]^T (+ bias[N]),  K % 32 == 0 (K-quants:
//   K % 256 == 0)
//
// The math (llama.cpp's q8 activations). x is quantized per row per 32-wide block b, once per
// call: dx = max |x_b| / 127 (float32 division), qx = round-half-even(x / dx) in [-127, 127]
// (dx == 0: qx = 0), sx = dx * (float)sum(qx). The weights are stored as
// unsigned bytes u with W = d * u + m per block (GGUF's fp16 d and, for Q4_1, m), so one
// vpdpbusd (u8 weights x s8 activations) gives the integer dot = sum_k u * qx exactly:
//   Q4_1: u = q (0..15)          y += (d * dx) * dot + m * sx
//   Q4_0: u = q (0..15), m = -8d y += (d * dx) * (dot + xcorr)   xcorr = -8 sum(qx)
//   Q8_0: u = q + 128 (0..255)   y += (d * dx) * (dot + xcorr)   xcorr = -128 sum(qx)
// (integers: exact; the kernel starts the block's dot at xcorr, a broadcast load, so the
// correction costs no vector ALU op).
// K-quants (256-weight super-blocks) map onto the same per-32 form with float32 scales that
// are EXACT products of the file's fp16 super-scale and small int scales (11 + 6 or 8 bits):
//   Q4_K: block j of a super-block: d = float(d_fp16) * sc_j, m = -(float(dmin_fp16) * m_j)
//         (sc_j, m_j the 6-bit pairs), u = q (0..15): y += (d * dx) * dot + m * sx as Q4_1.
//   Q6_K: scales per 16 weights: d_h = float(d_fp16) * sc (int8), h = the block's halves
//         k 0-15 / 16-31; u = q (0..63), W = d_h * (u - 32): y += (d_h * dx) * (dot_h + c_h),
//         c_h = -32 sum_h(qx): xcorr holds the two 16-sums (gguf_xcorr), two fmas per block.
//   Q5_K: as Q4_K (d = float(d_fp16) * sc_j, m = -(float(dmin_fp16) * m_j)) with u = q (0..31).
//   Q5_0 (W = d * (q - 16), q 0..31): repacked as Q8_0 (int8 q - 16, same d), the Q8_0 kernel.
//   I4Z (not a GGML type: AWQ / GPTQ int4, runtime/hf_quantized.py): W = s * (q - z) per group
//         of 32/64/128 k, s fp16, z an int 0..15: per 32-block d = float(s), m = -(d * z)
//         (fp16 x 4-bit int: exact in float32), u = q (0..15): y += (d * dx) * dot + m * sx as
//         Q4_1 / Q4_K. A group of 64 / 128 repeats its s, z in each of its 32-blocks.
// Per block and output, in this order, float32: dd = d * dx; acc = fma(float(int), dd, acc)
// (Q6_K: h 0 then h 1); Q4_1 / Q4_K then acc = fma(m, sx, acc); finally y = acc + bias.
// Both paths do exactly these float operations per output (the integer dot is exact whatever
// the order), so they agree bit for bit; tests allow float summation slack anyway.
//
// Packed weight layout (PackedGgufWeight builds it once from the file's blocks):
//   wq[num_tiles][nb][BLOCK] uint8, num_tiles = ceil(N / 16), nb = K / 32; a tile = 16 outputs,
//   each tile's panel is one contiguous, front-to-back stream over K (the bf16 kernel's
//   finding: one sequential stream per tile is what the hardware prefetcher keeps up with).
//   One tile-block (BLOCK bytes) = the quants of 16 outputs x 32 k, then the scales:
//   Q4_0 / Q4_1: quants[4 L][16 n][4 j] bytes (256): byte (L, n, j) = the file's qs[4 L + j] of
//       output n: low nibble = k 4L + j, high nibble = k 16 + 4L + j (GGUF's own pairing, so
//       the repack only moves whole bytes). One 64-byte load (one L) is two vpdpbusd operands:
//       AND 0x0F -> k 4L..4L+3, shift right 4 (or, at 1-3 rows, AND NOT 0x0F into a separate
//       accumulator shifted back per block) -> k 16+4L..+3; each 32-bit lane = 4 consecutive
//       k of one output, 16 outputs per zmm, against 4 bytes of qx broadcast.
//   Q8_0: quants[8 g][16 n][4 j] (512): byte (g, n, j) = qs[4 g + j] of output n, XOR 0x80
//       (int8 q -> u8 q + 128).
//   then d[16] fp16 (32 bytes), and for Q4_1 m[16] fp16 (32 bytes): kept fp16, as in the
//   file, so Q4_1 streams 0.625 bytes a weight (20 per 32), Q4_0 0.5625, Q8_0 1.0625.
//   I4Z: the Q4_1 quants, then s[16] fp16 and z[16] bytes: 0.59 bytes a weight (19 per 32).
//   BLOCK = 288 (Q4_0), 320 (Q4_1), 544 (Q8_0), 304 (I4Z). Outputs past N: zero quants and scales.
//   K-quants: the unit is a tile-super-block (8 blocks, 256 k; wq[num_tiles][K / 256][SBLOCK]):
//   Q4_K (SBLOCK 2368): quants[8 blocks] in the Q4_1 form above (the repack re-pairs ggml's
//       Q4_K nibbles, whose 32 bytes per 64 weights hold k 0-31 low and k 32-63 high), then
//       sc[8][16] and m[8][16] (the 6-bit ints, a byte each), d[16], dmin[16] fp16:
//       0.578 bytes a weight (the file: 0.5625). Chosen over float32 per-32 scales (same
//       float32 values, 0.75 bytes a weight: +30% streamed at decode) for ~6 vector ops per
//       tile-block (zero-extend, convert, multiply by d; the same for m).
//   Q6_K (SBLOCK 4384): quants[8 blocks] in the Q8_0 form with u = q (0..63, no XOR), then the
//       int8 scales [8 blocks][2 halves][16], d[16] fp16: 1.07 bytes a weight (the file: 0.82).
//       Measured against the file's 6 bits (nibbles + 2-bit planes, 0.82 bytes a weight,
//       unpacked by shift / and / vpternlogd, ~3 ops per vpdpbusd operand): decode (M 1) only
//       6-9% faster (the unpack eats most of the 23% fewer bytes) and M 4-8 30-40% slower
//       (unpacked per 4 rows in registers, or once per tile into a byte scratch), so bytes.
//   Q5_K (SBLOCK 4416): quants[8 blocks] in the Q8_0 form with u = q (0..31, no XOR), then
//       Q4_K's sc[8][16], m[8][16], d[16], dmin[16]: 1.08 bytes a weight (the file: 0.69; the
//       5th bit as a plane would need the Q6_K-style unpack measured above). Q5_0: Q8_0's
//       1.0625 (the file: 0.69). Both were dequantized to bf16 (2 bytes a weight) before.
// Quantized activations: xq[M][K] int8 (row m, k in file order), xd[M][nb] float32 (dx),
//   xs[M][nb] float32 (sx), xcorr[M][nb] int32 (-offset * sum(qx), the weight type's
//   offset: 8, 128, or 0 for Q4_1 / Q4_K; Q6_K (offset GGUF_XCORR_SPLIT16): its two 16-sums,
//   packed); the kernels broadcast 4 bytes of xq per vpdpbusd and one scalar of the others per
//   block. Callers pass gguf_offset(type) to gguf_quantize_rows.
//
// Paths: "amx" (AMX-INT8 TDPBSUD from GGUF_AMX_MIN_ROWS kernel rows, "avx512vnni" below;
// see the AMX-INT8 section), "avx512vnni" (AVX512F+BW+VL+VNNI, per-function target attribute:
// the module builds for any x86-64) and "portable" (plain C++ reading the same layout); and
// "amx-emulated" (not offered by "auto"): the AMX kernel with its tile ops in scalar C++, so
// the kernel's layout and epilogue are tested on CPUs without AMX.
//
// Measured (Sapphire Rapids, 2 threads, benchmarks/bench_gguf_gemm.py): decode (M 1) streams
// 45-65 GB/s of packed bytes on the default model's shapes, 1.9-2.5x faster than the bf16
// GEMM per call. From 4 rows the kernel is bound by the vector ports, not memory: vpdpbusd
// issues 2 a cycle here, but each 8 of them (one 32-k block, one row, one tile) carry ~7 more
// ops (nibble unpack shared by 4 rows x 2 tiles, cvt, d * dx, fma, Q4_1's m * sx fma): ~50%
// of vpdpbusd peak, 180-210 G multiply-adds a second a core; AMX's bf16 GEMM is faster there
// (an AMX-int8 kernel would be the next step). 8 rows x 1 tile measured no better than 4 x 2.
// K-quants, 3072 x 1536, best of 60 (shared 2-core box, 2 threads): M 1: Q4_K 63 us (43
// GB/s) ~ Q4_1 62 us, Q6_K 90 us (56 GB/s) vs Q8_0 104 us, bf16 171 us; M 8: Q4_K 151 us
// (Q4_1 131: the per-tile-block scale ops, ~+15%), Q6_K 173 us; M 64: Q4_K 1.09 ms, Q6_K
// 1.17 ms, Q4_1 0.97 ms, AMX bf16 0.65 ms.
// Zen 4 (AMD EPYC, no AMX; 2 threads on a busy shared box, medians of 3 runs, 2026-12-02): q8
// 1.1-2.3x faster than the avx512bf16 GEMM at M 1-64 on every shape (Q6_K 3072x1536 M 64:
// 0.98x); q8x2 0.4-0.95x of it from M 8. The AMX-INT8 path below is unmeasured (no AMX there).
// Hence activations "bf16" (cpu_gguf_bf16_kernels.h: weight tiles unpacked to bf16 for the bf16
// GEMM's micro-kernel), which "auto" takes from GGUF_BF16_MIN_ROWS (32) rows on such CPUs.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedrun_gemm {

enum GgufType { GGUF_Q4_0 = 0, GGUF_Q4_1 = 1, GGUF_Q8_0 = 2, GGUF_Q4_K = 3, GGUF_Q6_K = 4,
               GGUF_I4Z = 5, GGUF_Q5_K = 6 };  // I4Z: not a GGML type (AWQ / GPTQ int4, see
                                                // above); Q5_0 is repacked as Q8_0 bytes
// GgufJob.path: the kernels a call runs (cpu_gemm's GGUF_PATHS names them). The AMX paths
// run the VNNI kernel below GGUF_AMX_MIN_ROWS rows, so every code >= GGUF_PATH_VNNI but AVX2
// needs AVX512-VNNI.
enum GgufPath { GGUF_PATH_PORTABLE = 0, GGUF_PATH_VNNI = 1, GGUF_PATH_AMX = 2,
                GGUF_PATH_AMX_EMULATED = 3, GGUF_PATH_AVX2 = 4 };
constexpr int GGUF_TILE_N = 16;  // outputs per tile (one zmm of int32 / float32 lanes)
constexpr int GGUF_QK = 32;      // weights per GGUF block
constexpr int GGUF_XCORR_SPLIT16 = -1;  // gguf_offset(Q6_K): xcorr packs the two 16-sums

static inline constexpr bool gguf_is_k(int type) {
    return type == GGUF_Q4_K || type == GGUF_Q6_K || type == GGUF_Q5_K;
}
// 32-blocks per packing unit: a K-quant super-block is 8 of them (256 weights).
static inline constexpr int gguf_super(int type) { return gguf_is_k(type) ? 8 : 1; }
// Quant bytes of one tile-block (16 outputs x 32 k): nibbles, or one byte a weight.
static inline constexpr long gguf_quant_bytes(int type) {
    return type == GGUF_Q8_0 || type == GGUF_Q6_K || type == GGUF_Q5_K ? 512 : 256;
}
// Bytes of one packing unit of a tile (a tile-block, or a K-quant tile-super-block).
static inline constexpr long gguf_block_bytes(int type) {
    return type == GGUF_Q4_K   ? 8 * 256 + 256 + 64
           : type == GGUF_Q6_K ? 8 * 512 + 256 + 32
           : type == GGUF_Q5_K ? 8 * 512 + 256 + 64
           : type == GGUF_I4Z  ? 256 + 32 + 16
                               : gguf_quant_bytes(type) + (type == GGUF_Q4_1 ? 64 : 32);
}
// The offset of the unsigned weight: W = d * (u - offset) (+ m for Q4_1 / Q4_K, offset 0);
// Q6_K's (32) is applied per 16-wide half block: GGUF_XCORR_SPLIT16 (see the activations).
static inline constexpr int gguf_offset(int type) {
    return type == GGUF_Q4_0   ? 8
           : type == GGUF_Q8_0 ? 128
           : type == GGUF_Q6_K ? GGUF_XCORR_SPLIT16
                               : 0;
}
static inline int gguf_block_bytes_of(int type) { return (int)gguf_block_bytes(type); }

// One gemm_gguf call: the packed weights and the quantized activations (shared by both
// threads; a TileJob points at it and names the tile range).
struct GgufJob {
    int type;  // GgufType
    int path;  // GgufPath
    const uint8_t* wq;
    int nb;  // blocks per row, K / 32
    int M;
    const int8_t* xq;
    const float* xd;
    const float* xs;
    const int32_t* xcorr;
    // activations "bf16" (cpu_gguf_bf16_kernels.h): x rounded to bf16 [M][K], the int8 arrays
    // above unused; nullptr for the int8 modes.
    const uint16_t* xb;
};

// IEEE half -> float, exact (subnormals, inf, NaN): the portable path's vcvtph2ps.
static inline float gguf_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int e = -1;
        do { man <<= 1; ++e; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// ------------------------------------------------------------------------- activations
// Residual mode ("q8x2", `residual` below): a second int8 pass over what the first one
// rounded away, r = fma(-dx, qx, x) (one rounding), with dx2 = dx / 256: qx2 =
// round-half-even(r / dx2) clamped to [-127, 127] (|r| <= dx / 2, so |r / dx2| <= 128). The
// second pass is M more rows [M, 2M) of the same arrays, run by the same kernels: y = y(rows
// of qx) + y(rows of qx2), each weight block against x ~= dx qx + dx2 qx2 (error <= dx / 256
// instead of dx / 2, at twice the multiply-adds and the same weight bytes).

// A block's xcorr: -offset * sum(qx), or (Q6_K: offset GGUF_XCORR_SPLIT16, whose weights
// carry a scale per 16) the sums of its two 16-wide halves packed as lo + 65536 * hi (each
// |sum| <= 16 * 127 fits int16; gguf_split16 decodes it exactly). Integers: both paths agree.
static inline int32_t gguf_xcorr(int offset, int32_t sum, int32_t sum_lo) {
    return offset == GGUF_XCORR_SPLIT16 ? sum_lo + 65536 * (sum - sum_lo) : -offset * sum;
}
static inline void gguf_split16(int32_t c, int32_t& lo, int32_t& hi) {
    lo = (int16_t)(uint16_t)(c & 0xFFFF);
    hi = (c - lo) / 65536;
}
static inline int32_t gguf_sum16(const int8_t* q) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += q[i];
    return s;
}

// v[32] against scale dx -> q (dx 0: zeros); returns sum(q).
static inline int32_t gguf_round_block_scalar(const float* v, float dx, int8_t* q) {
    int32_t sum = 0;
    for (int i = 0; i < GGUF_QK; ++i) {
        int qi = 0;
        if (dx != 0.0f) {
            const float r = nearbyintf(v[i] / dx);  // the default rounding mode: half-even
            qi = r > 127.0f ? 127 : (r < -127.0f ? -127 : (int)r);
        }
        q[i] = (int8_t)qi;
        sum += qi;
    }
    return sum;
}

// Rows of x (strides in elements) -> qx, dx, sx, xcorr (the definition above); residual:
// rows [M, 2M) of the arrays get the second pass.
static inline void gguf_quantize_rows_scalar(const float* x, long stride_m, long stride_k, int M,
                                             int K, int offset, int residual, int8_t* xq,
                                             float* xd, float* xs, int32_t* xcorr) {
    const int nb = K / GGUF_QK;
    const bool split = offset == GGUF_XCORR_SPLIT16;
    float v[GGUF_QK], r[GGUF_QK];
    for (int m = 0; m < M; ++m) {
        const float* row = x + (long)m * stride_m;
        for (int b = 0; b < nb; ++b) {
            float amax = 0.0f;
            for (int i = 0; i < GGUF_QK; ++i) {
                v[i] = row[(long)(b * GGUF_QK + i) * stride_k];
                const float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float dx = amax / 127.0f;
            long o = (long)m * nb + b;
            int8_t* q = xq + (long)m * K + b * GGUF_QK;
            int32_t sum = gguf_round_block_scalar(v, dx, q);
            xd[o] = dx;
            xcorr[o] = gguf_xcorr(offset, sum, split ? gguf_sum16(q) : 0);
            xs[o] = dx * (float)sum;
            if (!residual) continue;
            for (int i = 0; i < GGUF_QK; ++i) r[i] = fmaf(-dx, (float)q[i], v[i]);
            const float dx2 = dx / 256.0f;
            o += (long)M * nb;
            sum = gguf_round_block_scalar(r, dx2, q + (long)M * K);
            xd[o] = dx2;
            xcorr[o] = gguf_xcorr(offset, sum, split ? gguf_sum16(q + (long)M * K) : 0);
            xs[o] = dx2 * (float)sum;
        }
    }
}

// ------------------------------------------------------------------------- portable path
// Bytes of one tile's panel (nb 32-blocks).
static inline constexpr long gguf_tile_bytes(int type, int nb) {
    return (long)(nb / gguf_super(type)) * gguf_block_bytes(type);
}

// The per-output float32 scales of block b of a tile panel wt, the definitions above:
// ds[h][n] (h: Q6_K's 16-wide halves, else h 0 only) and, for Q4_1 / Q4_K, the min mn[n].
template <int TYPE>
static inline void gguf_block_scales_scalar(const uint8_t* wt, int b, float ds[2][GGUF_TILE_N],
                                            float mn[GGUF_TILE_N]) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    const uint8_t* ws = wt + (long)(b / SUP) * SB;
    const int j = b % SUP;
    const uint8_t* sc = ws + SUP * QB;  // the scales after the unit's quants
    for (int n = 0; n < GGUF_TILE_N; ++n) {
        uint16_t h;
        if (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K) {
            memcpy(&h, sc + 256 + 2 * n, 2);
            ds[0][n] = gguf_half_to_float(h) * (float)sc[16 * j + n];
            memcpy(&h, sc + 288 + 2 * n, 2);
            mn[n] = -(gguf_half_to_float(h) * (float)sc[128 + 16 * j + n]);
        } else if (TYPE == GGUF_Q6_K) {
            memcpy(&h, sc + 256 + 2 * n, 2);
            const float d = gguf_half_to_float(h);
            ds[0][n] = d * (float)(int8_t)sc[32 * j + n];
            ds[1][n] = d * (float)(int8_t)sc[32 * j + 16 + n];
        } else if (TYPE == GGUF_I4Z) {  // s * z: fp16 x 4-bit int, exact in float32
            memcpy(&h, sc + 2 * n, 2);
            ds[0][n] = gguf_half_to_float(h);
            mn[n] = -(ds[0][n] * (float)sc[32 + n]);
        } else {
            memcpy(&h, sc + 2 * n, 2);
            ds[0][n] = gguf_half_to_float(h);
            if (TYPE == GGUF_Q4_1) {
                memcpy(&h, sc + 32 + 2 * n, 2);
                mn[n] = gguf_half_to_float(h);
            }
        }
    }
}

template <int TYPE>
static void gguf_tiles_portable_t(const GgufJob& g, int N, int tile_begin, int tile_end,
                                  const float* bias, float* y, long ldy) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    constexpr bool BYTES = TYPE == GGUF_Q8_0 || TYPE == GGUF_Q6_K || TYPE == GGUF_Q5_K;
    constexpr bool HAS_MIN =
        TYPE == GGUF_Q4_1 || TYPE == GGUF_Q4_K || TYPE == GGUF_I4Z || TYPE == GGUF_Q5_K;
    const int nb = g.nb, K = nb * GGUF_QK;
    const long tile_bytes = gguf_tile_bytes(TYPE, nb);
    for (int t = tile_begin; t < tile_end; ++t) {
        const uint8_t* wt = g.wq + t * tile_bytes;
        const int n0 = t * GGUF_TILE_N;
        const int width = N - n0 < GGUF_TILE_N ? N - n0 : GGUF_TILE_N;
        for (int r = 0; r < g.M; ++r) {
            float acc[GGUF_TILE_N] = {0};
            for (int b = 0; b < nb; ++b) {
                const uint8_t* wb = wt + (long)(b / SUP) * SB + (b % SUP) * QB;
                const int8_t* xr = g.xq + (long)r * K + b * GGUF_QK;
                int32_t dot[2][GGUF_TILE_N] = {{0}};  // Q6_K: k 0-15, k 16-31
                for (int n = 0; n < GGUF_TILE_N; ++n) {
                    if (BYTES) {
                        for (int gq = 0; gq < 8; ++gq)
                            for (int j = 0; j < 4; ++j)
                                dot[TYPE == GGUF_Q6_K ? gq / 4 : 0][n] +=
                                    (int32_t)wb[64 * gq + 4 * n + j] * xr[4 * gq + j];
                    } else {
                        for (int L = 0; L < 4; ++L)
                            for (int j = 0; j < 4; ++j) {
                                const uint8_t byte = wb[64 * L + 4 * n + j];
                                dot[0][n] += (int32_t)(byte & 0x0F) * xr[4 * L + j] +
                                             (int32_t)(byte >> 4) * xr[16 + 4 * L + j];
                            }
                    }
                }
                const long o = (long)r * nb + b;
                const float dx = g.xd[o], sx = g.xs[o];
                int32_t corr[2] = {g.xcorr[o], 0};
                if (TYPE == GGUF_Q6_K) {
                    gguf_split16(g.xcorr[o], corr[0], corr[1]);
                    corr[0] *= -32;
                    corr[1] *= -32;
                }
                float ds[2][GGUF_TILE_N], mn[GGUF_TILE_N];
                gguf_block_scales_scalar<TYPE>(wt, b, ds, mn);
                for (int n = 0; n < GGUF_TILE_N; ++n) {
                    acc[n] = fmaf((float)(dot[0][n] + corr[0]), ds[0][n] * dx, acc[n]);
                    if (TYPE == GGUF_Q6_K)
                        acc[n] = fmaf((float)(dot[1][n] + corr[1]), ds[1][n] * dx, acc[n]);
                    if (HAS_MIN) acc[n] = fmaf(mn[n], sx, acc[n]);
                }
            }
            float* yr = y + (long)r * ldy + n0;
            for (int n = 0; n < width; ++n) yr[n] = acc[n] + (bias ? bias[n0 + n] : 0.0f);
        }
    }
}

// ------------------------------------------------------------------------- AVX512-VNNI path
#if PAGEDRUN_X86
#define PAGEDRUN_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static inline int cpu_has_avx512vnni() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

static inline int gguf_load_i32(const int8_t* p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

// v0, v1 (32 floats) against scale dx -> q (dx 0: zeros), q as int32 in q0, q1; returns sum.
PAGEDRUN_VNNI_TARGET static inline int32_t gguf_round_block_vnni(__m512 v0, __m512 v1, float dx,
                                                                 int8_t* q, __m512i& q0,
                                                                 __m512i& q1) {
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    if (dx == 0.0f) {
        memset(q, 0, GGUF_QK);
        q0 = q1 = _mm512_setzero_si512();
        return 0;
    }
    const __m512 vd = _mm512_set1_ps(dx);
    q0 = _mm512_cvtps_epi32(_mm512_div_ps(v0, vd));
    q1 = _mm512_cvtps_epi32(_mm512_div_ps(v1, vd));
    q0 = _mm512_max_epi32(_mm512_min_epi32(q0, lim), nlim);
    q1 = _mm512_max_epi32(_mm512_min_epi32(q1, lim), nlim);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

// Contiguous rows, 32 floats at a time: the same operations as the scalar quantizer (exact
// division, round-half-even conversion under the default MXCSR, the residual's single-rounding
// fma), so the same bytes.
PAGEDRUN_VNNI_TARGET static void gguf_quantize_rows_vnni(const float* x, long stride_m, int M,
                                                         int K, int offset, int residual,
                                                         int8_t* xq, float* xd, float* xs,
                                                         int32_t* xcorr) {
    const int nb = K / GGUF_QK;
    const bool split = offset == GGUF_XCORR_SPLIT16;
    for (int m = 0; m < M; ++m) {
        const float* row = x + (long)m * stride_m;
        for (int b = 0; b < nb; ++b) {
            const __m512 v0 = _mm512_loadu_ps(row + b * GGUF_QK);
            const __m512 v1 = _mm512_loadu_ps(row + b * GGUF_QK + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0),
                                                                  _mm512_abs_ps(v1)));
            const float dx = amax / 127.0f;
            long o = (long)m * nb + b;
            int8_t* q = xq + (long)m * K + b * GGUF_QK;
            __m512i q0, q1;
            int32_t sum = gguf_round_block_vnni(v0, v1, dx, q, q0, q1);
            xd[o] = dx;
            xcorr[o] = gguf_xcorr(offset, sum, split ? _mm512_reduce_add_epi32(q0) : 0);
            xs[o] = dx * (float)sum;
            if (!residual) continue;
            const __m512 nd = _mm512_set1_ps(-dx);
            const __m512 r0 = _mm512_fmadd_ps(nd, _mm512_cvtepi32_ps(q0), v0);
            const __m512 r1 = _mm512_fmadd_ps(nd, _mm512_cvtepi32_ps(q1), v1);
            const float dx2 = dx / 256.0f;
            o += (long)M * nb;
            sum = gguf_round_block_vnni(r0, r1, dx2, q + (long)M * K, q0, q1);
            xd[o] = dx2;
            xcorr[o] = gguf_xcorr(offset, sum, split ? _mm512_reduce_add_epi32(q0) : 0);
            xs[o] = dx2 * (float)sum;
        }
    }
}

// The per-output float32 scales of block b for NR_ tile panels (the scalar definitions of
// gguf_block_scales_scalar, the same float ops): ds[c][h], and mn[c] (Q4_1 / Q4_K; Q4_K's
// is +dmin * m, subtracted by fnmadd).
template <int TYPE, int NR_>
PAGEDRUN_VNNI_TARGET static inline void gguf_block_scales_vnni(const uint8_t* wt, long tile_bytes,
                                                               int b, __m512 ds[NR_][2],
                                                               __m512 mn[NR_]) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    const int j = b % SUP;
#pragma GCC unroll 16
    for (int c = 0; c < NR_; ++c) {
        const uint8_t* sc = wt + c * tile_bytes + (long)(b / SUP) * SB + SUP * QB;
        if constexpr (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K) {
            const __m512 d = _mm512_cvtph_ps(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 256)));
            const __m512 dmin = _mm512_cvtph_ps(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 288)));
            ds[c][0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                                sc + 16 * j)))));
            mn[c] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                                sc + 128 + 16 * j)))));
        } else if constexpr (TYPE == GGUF_Q6_K) {
            const __m512 d = _mm512_cvtph_ps(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 256)));
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h)
                ds[c][h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                                    sc + 32 * j + 16 * h)))));
        } else if constexpr (TYPE == GGUF_I4Z) {
            ds[c][0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
            mn[c] = _mm512_mul_ps(ds[c][0], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                                    sc + 32)))));
        } else {
            ds[c][0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
            if constexpr (TYPE == GGUF_Q4_1)
                mn[c] = _mm512_cvtph_ps(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
        }
    }
}

// MR_ rows x NR_ tiles over all of K. S = 2 keeps two integer accumulators per (row, tile)
// (low / high nibbles, or even / odd groups): at 1-3 rows there are too few independent
// vpdpbusd chains to hide its latency otherwise. Q6_K always keeps two: its 16-wide halves
// (k 0-15, k 16-31: groups 0-3 and 4-7) carry their own scales.
template <int TYPE, int MR_, int NR_, int S>
PAGEDRUN_VNNI_TARGET static inline void gguf_micro_vnni(const GgufJob& g, int m0,
                                                        const uint8_t* wt, long tile_bytes,
                                                        int n0, int N, const float* bias,
                                                        float* y, long ldy) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    constexpr bool BYTES = TYPE == GGUF_Q8_0 || TYPE == GGUF_Q6_K || TYPE == GGUF_Q5_K;
    constexpr bool HAS_MIN =
        TYPE == GGUF_Q4_1 || TYPE == GGUF_Q4_K || TYPE == GGUF_I4Z || TYPE == GGUF_Q5_K;
    constexpr int SA = TYPE == GGUF_Q6_K ? 2 : S;  // integer accumulators per (row, tile)
    const int nb = g.nb, K = nb * GGUF_QK;
    const int8_t* xq = g.xq + (long)m0 * K;
    const long xo = (long)m0 * nb;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[MR_][NR_];
#pragma GCC unroll 16
    for (int r = 0; r < MR_; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < NR_; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* wb = wt + (long)(b / SUP) * SB + (b % SUP) * QB;
        __m512i dot[MR_][NR_][SA];
#pragma GCC unroll 16
        for (int r = 0; r < MR_; ++r) {
            const int32_t xc = g.xcorr[xo + (long)r * nb + b];
            __m512i corr0, corr1 = _mm512_setzero_si512();
            if constexpr (TYPE == GGUF_Q6_K) {
                int32_t lo, hi;
                gguf_split16(xc, lo, hi);
                corr0 = _mm512_set1_epi32(-32 * lo);
                corr1 = _mm512_set1_epi32(-32 * hi);
            } else {
                corr0 = HAS_MIN ? _mm512_setzero_si512() : _mm512_set1_epi32(xc);
            }
#pragma GCC unroll 16
            for (int c = 0; c < NR_; ++c) {
                dot[r][c][0] = corr0;
                if constexpr (SA == 2) dot[r][c][1] = corr1;
            }
        }
        if constexpr (BYTES) {
#pragma GCC unroll 8
            for (int gq = 0; gq < 8; ++gq) {
                const int a = TYPE == GGUF_Q6_K ? gq / 4 : gq % SA;
                __m512i w[NR_];
#pragma GCC unroll 16
                for (int c = 0; c < NR_; ++c)
                    w[c] = _mm512_loadu_si512(wb + c * tile_bytes + 64 * gq);
#pragma GCC unroll 16
                for (int r = 0; r < MR_; ++r) {
                    const __m512i xv =
                        _mm512_set1_epi32(gguf_load_i32(xq + (long)r * K + b * GGUF_QK + 4 * gq));
#pragma GCC unroll 16
                    for (int c = 0; c < NR_; ++c)
                        dot[r][c][a] = _mm512_dpbusd_epi32(dot[r][c][a], w[c], xv);
                }
            }
        } else {
#pragma GCC unroll 4
            for (int L = 0; L < 4; ++L) {
                __m512i lo[NR_], hi[NR_];
#pragma GCC unroll 16
                for (int c = 0; c < NR_; ++c) {
                    const __m512i v = _mm512_loadu_si512(wb + c * tile_bytes + 64 * L);
                    lo[c] = _mm512_and_si512(v, low4);
                    // S = 2: the high nibbles in place (16 q, one op), their own accumulator
                    // shifted back once per block (exact: it holds 16 * the dot).
                    hi[c] = S == 2 ? _mm512_andnot_si512(low4, v)
                                   : _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
#pragma GCC unroll 16
                for (int r = 0; r < MR_; ++r) {
                    const int8_t* xr = xq + (long)r * K + b * GGUF_QK;
                    const __m512i xl = _mm512_set1_epi32(gguf_load_i32(xr + 4 * L));
                    const __m512i xh = _mm512_set1_epi32(gguf_load_i32(xr + 16 + 4 * L));
#pragma GCC unroll 16
                    for (int c = 0; c < NR_; ++c) {
                        dot[r][c][0] = _mm512_dpbusd_epi32(dot[r][c][0], lo[c], xl);
                        dot[r][c][S - 1] = _mm512_dpbusd_epi32(dot[r][c][S - 1], hi[c], xh);
                    }
                }
            }
        }
        __m512 ds[NR_][2], mn[NR_];
        gguf_block_scales_vnni<TYPE, NR_>(wt, tile_bytes, b, ds, mn);
#pragma GCC unroll 16
        for (int r = 0; r < MR_; ++r) {
            const long o = xo + (long)r * nb + b;
            const __m512 dxv = _mm512_set1_ps(g.xd[o]);
#pragma GCC unroll 16
            for (int c = 0; c < NR_; ++c) {
                __m512i s = dot[r][c][0];
                if constexpr (S == 2 && BYTES && TYPE != GGUF_Q6_K)
                    s = _mm512_add_epi32(s, dot[r][c][1]);
                if constexpr (S == 2 && !BYTES)
                    s = _mm512_add_epi32(s, _mm512_srai_epi32(dot[r][c][1], 4));
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ds[c][0], dxv),
                                            acc[r][c]);
                if constexpr (TYPE == GGUF_Q6_K)
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c][1]),
                                                _mm512_mul_ps(ds[c][1], dxv), acc[r][c]);
                if constexpr (TYPE == GGUF_Q4_1)
                    acc[r][c] = _mm512_fmadd_ps(mn[c], _mm512_set1_ps(g.xs[o]), acc[r][c]);
                if constexpr (TYPE == GGUF_Q4_K || TYPE == GGUF_I4Z || TYPE == GGUF_Q5_K)
                    // - dmin * m * sx (I4Z:
                    // - s * z * sx), one rounding as fma(-dm, sx)
                    acc[r][c] = _mm512_fnmadd_ps(mn[c], _mm512_set1_ps(g.xs[o]), acc[r][c]);
            }
        }
    }
#pragma GCC unroll 16
    for (int c = 0; c < NR_; ++c) {
        const int nc = n0 + c * GGUF_TILE_N;
        const int width = N - nc < GGUF_TILE_N ? N - nc : GGUF_TILE_N;
        const __mmask16 mask = (__mmask16)((1u << width) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + nc) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < MR_; ++r)
            _mm512_mask_storeu_ps(y + (long)(m0 + r) * ldy + nc, mask,
                                  _mm512_add_ps(acc[r][c], bv));
    }
}

// Rows of a pass [m0, m0 + rows) against NR_ tiles from wt: blocks of 4 rows, then the rest.
template <int TYPE, int NR_>
PAGEDRUN_VNNI_TARGET static inline void gguf_rows_vnni(const GgufJob& g, int m0, int rows,
                                                       const uint8_t* wt, long tile_bytes,
                                                       int n0, int N, const float* bias,
                                                       float* y, long ldy) {
    int m = m0;
    const int end = m0 + rows;
    for (; m + 4 <= end; m += 4)
        gguf_micro_vnni<TYPE, 4, NR_, 1>(g, m, wt, tile_bytes, n0, N, bias, y, ldy);
    switch (end - m) {
        case 3: gguf_micro_vnni<TYPE, 3, NR_, 1>(g, m, wt, tile_bytes, n0, N, bias, y, ldy); break;
        case 2: gguf_micro_vnni<TYPE, 2, NR_, 1>(g, m, wt, tile_bytes, n0, N, bias, y, ldy); break;
        case 1: gguf_micro_vnni<TYPE, 1, NR_, 1>(g, m, wt, tile_bytes, n0, N, bias, y, ldy); break;
        default: break;
    }
}

// Rows of qx per pass over the weights: a pass's qx (rows * K bytes) stays in L2 while every
// tile streams past it; decode batches take one pass.
constexpr long GGUF_X_BLOCK_BYTES = 256 * 1024;

template <int TYPE>
PAGEDRUN_VNNI_TARGET static void gguf_tiles_vnni_t(const GgufJob& g, int N, int tile_begin,
                                                   int tile_end, const float* bias, float* y,
                                                   long ldy) {
    const long tile_bytes = gguf_tile_bytes(TYPE, g.nb);
    const int M = g.M;
    if (M <= 3) {  // decode: one tile's stream at a time, two accumulator chains per row
        for (int t = tile_begin; t < tile_end; ++t) {
            const uint8_t* wt = g.wq + t * tile_bytes;
            const int n0 = t * GGUF_TILE_N;
            if (M == 1) gguf_micro_vnni<TYPE, 1, 1, 2>(g, 0, wt, tile_bytes, n0, N, bias, y, ldy);
            else if (M == 2)
                gguf_micro_vnni<TYPE, 2, 1, 2>(g, 0, wt, tile_bytes, n0, N, bias, y, ldy);
            else gguf_micro_vnni<TYPE, 3, 1, 2>(g, 0, wt, tile_bytes, n0, N, bias, y, ldy);
        }
        return;
    }
    long pass = GGUF_X_BLOCK_BYTES / ((long)g.nb * GGUF_QK) / 4 * 4;
    const int pass_rows = pass < 4 ? 4 : (int)pass;
    for (int m0 = 0; m0 < M; m0 += pass_rows) {
        const int rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        int t = tile_begin;
        for (; t + 2 <= tile_end; t += 2)
            gguf_rows_vnni<TYPE, 2>(g, m0, rows, g.wq + t * tile_bytes, tile_bytes,
                                    t * GGUF_TILE_N, N, bias, y, ldy);
        if (t < tile_end)
            gguf_rows_vnni<TYPE, 1>(g, m0, rows, g.wq + t * tile_bytes, tile_bytes,
                                    t * GGUF_TILE_N, N, bias, y, ldy);
    }
}

// ------------------------------------------------------------------------- AMX-INT8 path
// From GGUF_AMX_MIN_ROWS kernel rows, the integer dots of 16 rows x 16 outputs x one 32-block
// run on one TDPBSUD (A: 16 rows of qx, signed; B: the block's 8 rows of 4 k x 16 outputs,
// unsigned: the tile-block layout above IS the VNNI-ordered B tile, byte (g, n, j) = k 4 g + j
// of output n; Q4 nibbles are unpacked to that form once per weight tile into a scratch panel,
// low nibbles -> B rows 0-3, high -> rows 4-7, and reused by every row block). A's tile is 32
// bytes deep (colsb 32; B 8 rows), so each C tile holds exactly one block's per-32 dots: the
// int32 tile is stored, and the epilogue does the portable path's float ops per row and output
// in its order (dot + xcorr, cvt, fma with d * dx, then Q4_1 / Q4_K / I4Z's m * sx): bit for
// bit the portable result. Q6_K's two 16-wide halves are two 16-deep products (colsb 16, B 4
// rows). Two products per step (two blocks, or Q6_K's halves) on C tiles 0 / 1, A 2 / 3, B 4 /
// 5, stored into a 2 KB buffer the epilogue reads. Loop: weight tile outer (unpack + scales
// per tile), row blocks of 16 inner, blocks innermost with 16 float32 accumulators in zmm.
// The last row block (M % 16 rows) reads A from a zero-padded copy (the activation buffers
// hold exactly M rows). Scales per tile: gguf_block_scales_vnni's float32 values into scratch.
// EMU = true: the same kernel with the four tile operations done in scalar C++ (the "amx-
// emulated" path, for tests on CPUs without AMX: it checks the layouts, the unpack, the scratch
// and the epilogue; only the tile instructions themselves go unexecuted there).
// NOT MEASURED: written on a Zen 4 box (no AMX); the threshold is the bf16 AMX kernel's.
constexpr int GGUF_AMX_MIN_ROWS = 8;  // kernel rows (2 M with the residual pass)
constexpr int GGUF_AMX_ROWS = 16;     // rows of an A / C tile

#define PAGEDRUN_AMXI8_TARGET \
    __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))

struct alignas(64) GgufAmxConfig {  // the LDTILECFG memory operand, palette 1
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// c[0:256] = A0 . B0, c[256:512] = A1 . B1 (int32 [16 rows][16 outputs]); A: 16 rows lda bytes
// apart, KB bytes deep (signed); B: KB / 4 rows of 64 bytes (unsigned, [k / 4][n][k % 4]).
template <int KB, bool EMU>
PAGEDRUN_AMXI8_TARGET __attribute__((always_inline)) static inline void gguf_amx_pair(const int8_t* a0, const int8_t* a1,
                                                       long lda, const uint8_t* b0,
                                                       const uint8_t* b1, int32_t* c) {
    if constexpr (EMU) {
        const int8_t* as[2] = {a0, a1};
        const uint8_t* bs[2] = {b0, b1};
        for (int p = 0; p < 2; ++p)
            for (int m = 0; m < GGUF_AMX_ROWS; ++m)
                for (int n = 0; n < GGUF_TILE_N; ++n) {
                    int32_t s = 0;
                    for (int k = 0; k < KB; ++k)
                        s += (int32_t)as[p][(long)m * lda + k] * bs[p][(k / 4) * 64 + 4 * n + k % 4];
                    c[256 * p + 16 * m + n] = s;
                }
    } else {
        // GCC's tileloadd asm names no memory operand: a compiler barrier so the unpacked
        // panel and padded rows written above are in memory before the tiles read them.
        __asm__ volatile("" ::: "memory");
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, a0, lda);
        _tile_loadd(4, b0, 64);
        _tile_loadd(3, a1, lda);
        _tile_loadd(5, b1, 64);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 5);
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
    }
}

// Block b of the row block's epilogue: acc[r] (rows < `rows`) += the block's scaled dots, the
// portable path's float ops. c: the block's C (Q6_K: its two halves, 256 apart).
template <int TYPE>
PAGEDRUN_AMXI8_TARGET __attribute__((always_inline)) static inline void gguf_amx_epilogue(const GgufJob& g, int m0, int rows,
                                                           int b, const int32_t* c,
                                                           const float* ds, const float* mn,
                                                           __m512 acc[GGUF_AMX_ROWS]) {
    constexpr bool HAS_MIN =
        TYPE == GGUF_Q4_1 || TYPE == GGUF_Q4_K || TYPE == GGUF_I4Z || TYPE == GGUF_Q5_K;
    const __m512 d0 = _mm512_load_ps(ds);
    const __m512 d1 = TYPE == GGUF_Q6_K ? _mm512_load_ps(ds + 16) : d0;
    const __m512 mv = HAS_MIN ? _mm512_load_ps(mn) : d0;
#pragma GCC unroll 16
    for (int r = 0; r < GGUF_AMX_ROWS; ++r) {
        if (r >= rows) break;
        const long o = (long)(m0 + r) * g.nb + b;
        const __m512 dxv = _mm512_set1_ps(g.xd[o]);
        __m512i s = _mm512_load_si512(c + 16 * r);
        if constexpr (TYPE == GGUF_Q6_K) {
            int32_t lo, hi;
            gguf_split16(g.xcorr[o], lo, hi);
            s = _mm512_add_epi32(s, _mm512_set1_epi32(-32 * lo));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d0, dxv), acc[r]);
            const __m512i s1 = _mm512_add_epi32(_mm512_load_si512(c + 256 + 16 * r),
                                                _mm512_set1_epi32(-32 * hi));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, dxv), acc[r]);
        } else {
            if constexpr (!HAS_MIN) s = _mm512_add_epi32(s, _mm512_set1_epi32(g.xcorr[o]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d0, dxv), acc[r]);
            if constexpr (TYPE == GGUF_Q4_1)
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(g.xs[o]), acc[r]);
            if constexpr (TYPE == GGUF_Q4_K || TYPE == GGUF_I4Z || TYPE == GGUF_Q5_K)
                acc[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(g.xs[o]), acc[r]);
        }
    }
}

template <int TYPE, bool EMU>
PAGEDRUN_AMXI8_TARGET static void gguf_tiles_amx_t(const GgufJob& g, int N, int tile_begin,
                                                   int tile_end, const float* bias, float* y,
                                                   long ldy) {
    constexpr long SB = gguf_block_bytes(TYPE), QB = gguf_quant_bytes(TYPE);
    constexpr int SUP = gguf_super(TYPE);
    constexpr bool BYTES =
        TYPE == GGUF_Q8_0 || TYPE == GGUF_Q6_K || TYPE == GGUF_Q5_K;  // B tiles in place
    constexpr bool Q6 = TYPE == GGUF_Q6_K;
    constexpr int KB = Q6 ? 16 : 32;  // A depth (bytes) of one product
    const int nb = g.nb, K = nb * GGUF_QK, M = g.M;
    const long tile_bytes = gguf_tile_bytes(TYPE, nb);
    // Scratch: C pair (2 KB), scales ds[nb][2][16] + mn[nb][16], the unpacked panel
    // (nibble types: nb x 512 bytes), the zero-padded last row block (16 x K bytes).
    const long c_bytes = 2048, sc_bytes = (long)nb * 48 * 4;
    const long panel_bytes = BYTES ? 0 : (long)nb * 512;
    const int tail = M % GGUF_AMX_ROWS;
    const long pad_bytes = tail ? (long)GGUF_AMX_ROWS * K : 0;
    const long total = (c_bytes + sc_bytes + panel_bytes + pad_bytes + 63) / 64 * 64;
    uint8_t* work = static_cast<uint8_t*>(aligned_alloc(64, total));
    if (!work) {  // no scratch: the VNNI kernel needs none
        gguf_tiles_vnni_t<TYPE>(g, N, tile_begin, tile_end, bias, y, ldy);
        return;
    }
    int32_t* cbuf = reinterpret_cast<int32_t*>(work);
    float* ds = reinterpret_cast<float*>(work + c_bytes);  // [nb][2][16]
    float* mn = ds + (long)nb * 32;                         // [nb][16]
    uint8_t* panel = work + c_bytes + sc_bytes;
    int8_t* xpad = reinterpret_cast<int8_t*>(panel + panel_bytes);
    if (tail) {
        memset(xpad, 0, pad_bytes);
        memcpy(xpad, g.xq + (long)(M - tail) * K, (long)tail * K);
    }
    if constexpr (!EMU) {
        GgufAmxConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int i = 0; i < 2; ++i) {
            cfg.rows[i] = GGUF_AMX_ROWS;  // C
            cfg.colsb[i] = 64;
            cfg.rows[2 + i] = GGUF_AMX_ROWS;  // A
            cfg.colsb[2 + i] = KB;
            cfg.rows[4 + i] = KB / 4;  // B
            cfg.colsb[4 + i] = 64;
        }
        _tile_loadconfig(&cfg);
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int t = tile_begin; t < tile_end; ++t) {
        const uint8_t* wt = g.wq + t * tile_bytes;
        for (int b = 0; b < nb; ++b) {
            __m512 dsv[1][2], mnv[1];
            gguf_block_scales_vnni<TYPE, 1>(wt, tile_bytes, b, dsv, mnv);
            _mm512_store_ps(ds + 32 * b, dsv[0][0]);
            if constexpr (Q6) _mm512_store_ps(ds + 32 * b + 16, dsv[0][1]);
            if constexpr (TYPE == GGUF_Q4_1 || TYPE == GGUF_Q4_K || TYPE == GGUF_I4Z ||
                          TYPE == GGUF_Q5_K)
                _mm512_store_ps(mn + 16 * b, mnv[0]);
            if constexpr (!BYTES) {
                const uint8_t* wb = wt + (long)(b / SUP) * SB + (b % SUP) * QB;
#pragma GCC unroll 4
                for (int L = 0; L < 4; ++L) {
                    const __m512i v = _mm512_loadu_si512(wb + 64 * L);
                    _mm512_store_si512(panel + 512L * b + 64 * L, _mm512_and_si512(v, low4));
                    _mm512_store_si512(panel + 512L * b + 256 + 64 * L,
                                       _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
                }
            }
        }
        auto wblock = [&](int b) -> const uint8_t* {
            return BYTES ? wt + (long)(b / SUP) * SB + (b % SUP) * QB : panel + 512L * b;
        };
        const int n0 = t * GGUF_TILE_N;
        const int width = N - n0 < GGUF_TILE_N ? N - n0 : GGUF_TILE_N;
        const __mmask16 mask = (__mmask16)((1u << width) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int m0 = 0; m0 < M; m0 += GGUF_AMX_ROWS) {
            const int rows = M - m0 < GGUF_AMX_ROWS ? M - m0 : GGUF_AMX_ROWS;
            const int8_t* xa = rows == GGUF_AMX_ROWS ? g.xq + (long)m0 * K : xpad;
            __m512 acc[GGUF_AMX_ROWS];
#pragma GCC unroll 16
            for (int r = 0; r < GGUF_AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
            if constexpr (Q6) {
                for (int b = 0; b < nb; ++b) {
                    const int8_t* a = xa + b * GGUF_QK;
                    gguf_amx_pair<KB, EMU>(a, a + 16, K, wblock(b), wblock(b) + 256, cbuf);
                    gguf_amx_epilogue<TYPE>(g, m0, rows, b, cbuf, ds + 32 * b, mn, acc);
                }
            } else {
                for (int b = 0; b < nb; b += 2) {
                    const int b1 = b + 1 < nb ? b + 1 : b;  // odd nb: the last pair repeats b
                    gguf_amx_pair<KB, EMU>(xa + b * GGUF_QK, xa + b1 * GGUF_QK, K, wblock(b),
                                           wblock(b1), cbuf);
                    gguf_amx_epilogue<TYPE>(g, m0, rows, b, cbuf, ds + 32 * b, mn + 16 * b, acc);
                    if (b1 != b)
                        gguf_amx_epilogue<TYPE>(g, m0, rows, b1, cbuf + 256, ds + 32 * b1,
                                                mn + 16 * b1, acc);
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < GGUF_AMX_ROWS; ++r) {
                if (r >= rows) break;
                _mm512_mask_storeu_ps(y + (long)(m0 + r) * ldy + n0, mask,
                                      _mm512_add_ps(acc[r], bv));
            }
        }
    }
    if constexpr (!EMU) _tile_release();
    free(work);
}

// CPUID leaf 7 EDX: the AMX feature bits (AMX-BF16 22, AMX-TILE 24, AMX-INT8 25).
constexpr int CPUID7_EDX_AMX_BF16 = 22, CPUID7_EDX_AMX_TILE = 24, CPUID7_EDX_AMX_INT8 = 25;

static inline unsigned cpuid7_edx() {
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    return edx;
}

// AMX-TILE plus the AMX `feature_bit` in CPUID, and the kernel's permission for this process to
// use the tile data state (Linux arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; asked at
// most once per process, whichever AMX path asks first).
static inline bool amx_usable(int feature_bit) {
#if defined(__linux__)
    const unsigned edx = cpuid7_edx();
    if (!((edx >> CPUID7_EDX_AMX_TILE) & 1u) || !((edx >> feature_bit) & 1u)) return false;
    static const bool permitted = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return permitted;
#else
    (void)feature_bit;
    return false;
#endif
}

// AMX-INT8 usable (amx_usable) and AVX512-VNNI (the epilogue and the small-M kernel): 1 if the
// path may run.
static inline int gguf_amx_int8_available() {
    static const int ok = amx_usable(CPUID7_EDX_AMX_INT8) && cpu_has_avx512vnni();
    return ok;
}
#else
static inline int cpu_has_avx512vnni() { return 0; }
static inline int gguf_amx_int8_available() { return 0; }
#endif

}  // namespace pagedrun_gemm

#include "cpu_quant_avx2_kernels.h"  // the "avx2" path (GgufJob.path GGUF_PATH_AVX2)

namespace pagedrun_gemm {

// ------------------------------------------------------------------------- dispatch
// x [M, K] float32 (strides in elements) -> the quantized activations (layout above): M rows,
// or with residual 2M (the second pass in rows [M, 2M)).
static inline void gguf_quantize_rows(int path, const float* x, long stride_m, long stride_k,
                                      int M, int K, int offset, int residual, int8_t* xq,
                                      float* xd, float* xs, int32_t* xcorr) {
#if PAGEDRUN_X86
    if (path == GGUF_PATH_AVX2 && stride_k == 1) {
        gguf_quantize_rows_avx2(x, stride_m, M, K, offset, residual, xq, xd, xs, xcorr);
        return;
    }
    if (path >= GGUF_PATH_VNNI && stride_k == 1) {  // the AMX paths' CPUs have VNNI (checked)
        gguf_quantize_rows_vnni(x, stride_m, M, K, offset, residual, xq, xd, xs, xcorr);
        return;
    }
#endif
    gguf_quantize_rows_scalar(x, stride_m, stride_k, M, K, offset, residual, xq, xd, xs, xcorr);
}

// Tiles [tile_begin, tile_end) of y.
static inline void gguf_tiles(const GgufJob& g, int N, int tile_begin, int tile_end,
                              const float* bias, float* y, long ldy) {
#if PAGEDRUN_X86
    if (g.path == GGUF_PATH_AVX2) {
        switch (g.type) {
            case GGUF_Q4_0: gguf_tiles_avx2_t<GGUF_Q4_0>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q4_1: gguf_tiles_avx2_t<GGUF_Q4_1>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q4_K: gguf_tiles_avx2_t<GGUF_Q4_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q6_K: gguf_tiles_avx2_t<GGUF_Q6_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_I4Z: gguf_tiles_avx2_t<GGUF_I4Z>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q5_K: gguf_tiles_avx2_t<GGUF_Q5_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            default: gguf_tiles_avx2_t<GGUF_Q8_0>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        }
    }
    if ((g.path == GGUF_PATH_AMX || g.path == GGUF_PATH_AMX_EMULATED) && g.M >= GGUF_AMX_MIN_ROWS) {
        if (g.path == GGUF_PATH_AMX) {
            switch (g.type) {
                case GGUF_Q4_0: gguf_tiles_amx_t<GGUF_Q4_0, false>(g, N, tile_begin, tile_end, bias, y, ldy); return;
                case GGUF_Q4_1: gguf_tiles_amx_t<GGUF_Q4_1, false>(g, N, tile_begin, tile_end, bias, y, ldy); return;
                case GGUF_Q4_K: gguf_tiles_amx_t<GGUF_Q4_K, false>(g, N, tile_begin, tile_end, bias, y, ldy); return;
                case GGUF_Q6_K: gguf_tiles_amx_t<GGUF_Q6_K, false>(g, N, tile_begin, tile_end, bias, y, ldy); return;
                case GGUF_I4Z: gguf_tiles_amx_t<GGUF_I4Z, false>(g, N, tile_begin, tile_end, bias, y, ldy); return;
                case GGUF_Q5_K: gguf_tiles_amx_t<GGUF_Q5_K, false>(g, N, tile_begin, tile_end, bias, y, ldy); return;
                default: gguf_tiles_amx_t<GGUF_Q8_0, false>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            }
        }
        switch (g.type) {
            case GGUF_Q4_0: gguf_tiles_amx_t<GGUF_Q4_0, true>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q4_1: gguf_tiles_amx_t<GGUF_Q4_1, true>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q4_K: gguf_tiles_amx_t<GGUF_Q4_K, true>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q6_K: gguf_tiles_amx_t<GGUF_Q6_K, true>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_I4Z: gguf_tiles_amx_t<GGUF_I4Z, true>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q5_K: gguf_tiles_amx_t<GGUF_Q5_K, true>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            default: gguf_tiles_amx_t<GGUF_Q8_0, true>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        }
    }
    if (g.path >= GGUF_PATH_VNNI) {  // avx512vnni, and the AMX paths below GGUF_AMX_MIN_ROWS rows
        switch (g.type) {
            case GGUF_Q4_0: gguf_tiles_vnni_t<GGUF_Q4_0>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q4_1: gguf_tiles_vnni_t<GGUF_Q4_1>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q4_K: gguf_tiles_vnni_t<GGUF_Q4_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q6_K: gguf_tiles_vnni_t<GGUF_Q6_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_I4Z: gguf_tiles_vnni_t<GGUF_I4Z>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            case GGUF_Q5_K: gguf_tiles_vnni_t<GGUF_Q5_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
            default: gguf_tiles_vnni_t<GGUF_Q8_0>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        }
    }
#endif
    switch (g.type) {
        case GGUF_Q4_0: gguf_tiles_portable_t<GGUF_Q4_0>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        case GGUF_Q4_1: gguf_tiles_portable_t<GGUF_Q4_1>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        case GGUF_Q4_K: gguf_tiles_portable_t<GGUF_Q4_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        case GGUF_Q6_K: gguf_tiles_portable_t<GGUF_Q6_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        case GGUF_I4Z: gguf_tiles_portable_t<GGUF_I4Z>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        case GGUF_Q5_K: gguf_tiles_portable_t<GGUF_Q5_K>(g, N, tile_begin, tile_end, bias, y, ldy); return;
        default: gguf_tiles_portable_t<GGUF_Q8_0>(g, N, tile_begin, tile_end, bias, y, ldy); return;
    }
}

}  // namespace pagedrun_gemm
