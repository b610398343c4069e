// cpu_ops_kernels.h: the non-GEMM ops of a decoder layer on the cpu bf16 backend, one pass each
// (pyx/cpu_ops.pyx wraps them; runtime/backends/numpy_ops.py is the reference and the contract).
//
// Everything is float32 in and out, strides in elements (float, uint16, uint8 or int32), the
// last dimension of every array contiguous. The KV cache alone may instead hold bf16 bits (uint16,
// the cpu backends' kv_cache_dtype "bfloat16") or fp8 e4m3 bits (uint8, kv_cache_dtype "fp8"):
// rotary_cache_write and paged_decode_attention are templates on the cache element (kv_load /
// kv_store below), instantiated for float, uint16_t and uint8_t.
// A bf16 store rounds to nearest even (NaN stays a quiet NaN: weights.to_bf16_bits' rules,
// restated as f32_to_bf16 in cpu_gemm_kernels.h too); a load widens exactly (bits << 16).
// An fp8 store (OCP e4m3: bias 7, 3 mantissa bits, subnormals, no infinities, 0x7F / 0xFF NaN)
// rounds to nearest even and saturates to +-448 (infinities too; NaN stays NaN with its sign):
// NVIDIA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3), what vLLM's fp8 cache does, with
// the per-tensor scale 1.0 vLLM uses when a checkpoint has no k_scale / v_scale (no scaling
// here at all); numpy_ops.to_fp8_e4m3_bits is the reference. A load widens exactly. Either way
// the math stays float32 and only the cache bytes shrink. The wrapper validates shapes, dtypes
// and index ranges before any kernel runs (check_rotary_indices / check_decode_tables below do
// the index checks in one pass), so the kernels themselves trust their inputs.
//
//   rms_norm_rows(x [rows, hidden] row stride ldx, weight [hidden], eps, out [rows, hidden] ldo)
//       out = x * (1 / sqrt(mean(x^2) + eps)) * weight, per row
//   fused_add_rms_norm_rows(x [rows, hidden] ldx, residual [rows, hidden] ldr, weight [hidden],
//                           eps, out [rows, hidden] ldo, new_residual [rows, hidden] ldn)
//       new_residual = x + residual; out = rms_norm(new_residual). One read of x and residual:
//       the sum of squares is taken as the sum is stored, the scaling pass reads the row back
//       from L1 (a row of 576 floats is 2.3 KB).
//   act_and_mul_rows(kind, gate_up [rows, 2 * inter] ldg, inter, out [rows, inter] ldo)
//       kind ACT_SILU: out = g / (1 + exp(-g)) * up
//       kind ACT_GELU_TANH: out = 0.5 g (1 + tanh(c0 (g + c1 g^3))) * up, computed as
//           g / (1 + exp(-2 c0 (g + c1 g^3))) * up (1 + tanh(y) = 2 sigmoid(2y): no cancellation,
//           and exp's overflow gives the right limits 0 and g)
//   rotary_cache_write(q [T, H, D] strides (sq0, sq1, 1), k [T, KV, D] (sk0, sk1, 1),
//                      v [T, KV, D] (sv0, sv1, 1), positions [T] int32, cos_sin [P, D] contiguous
//                      rows [cos(D/2) | sin(D/2)], k_cache, v_cache [NB, BS, KV, D] strides
//                      (sc0, sc1, sc2, 1), slot_mapping [T] int32, q_rot [T, H, D] contiguous,
//                      k_rot [T, KV, D] contiguous)
//       rotate_half rotation of q and k (pair i = dims i and i + D/2); k_rot and raw v written at
//       slot s (block s / BS, offset s % BS) unless s < 0 (padding). q/k/v may be strided views
//       of the fused qkv GEMM output: no copies.
//   paged_decode_attention(q [S, H, D] strides (sq0, sq1, 1), k_cache, v_cache [NB, BS, KV, D]
//                          strides (sc0, sc1, sc2, 1), block_tables [S, max_blocks] int32 row
//                          stride ldb, context_lens [S] int32 >= 1, scale, has_window,
//                          sliding_window, out [S, H, D] contiguous)
//       One query (position context_len - 1) per sequence; query head h reads kv head
//       h / (H / KV). Only tokens [first, context_len) are read, first = 0 without a window
//       (has_window 0), max(0, context_len - sliding_window) with one: cache slots past
//       context_len (and before the window) are never touched, so a NaN there cannot leak in.
//       A window <= 0 sees nothing: NaN, as numpy's masked softmax. Online softmax in runs of
//       up to 16 tokens (a run never crosses a cache block): the run's scores, a new running
//       max per head, accumulator and running sum rescaled by exp(old_max - new_max), then
//       p = exp(score - new_max) accumulated with the run's v rows. Every k and v row is loaded
//       once per kv head, serving all the group's query heads.
//       AVX512 for D = 32, 64, 128 (decode_seq_avx512): per sequence, runs in context order and
//       within a run every kv head, so each block is read front to back once; the group's
//       accumulators in zmm registers for the run (up to 8 / 6 / 3 heads per pass); the next
//       run's rows prefetched into L2. Other D (masked tails) and the portable path: per
//       (sequence, kv head), accumulators in a scratch row.
//       AVX2 for D = 32, 64, 128 (decode_seq_avx2): the same runs in the same order, but 16 ymm
//       cannot hold a group's accumulators (D = 64 alone is 8 of them), so each phase of a run
//       keeps its own working set in registers: the scores 8 tokens x 1 head at a time (8 FMA
//       chains, one hadd tree for the 8 sums), p.v a column block at a time for up to 8 heads
//       (every v vector loaded once for them all, accumulators to L1 once per run). bf16 / fp8
//       rows are widened once per run and kv head into a float buffer. Other D: scalar.
//
// Paths: AVX512F, AVX2 + FMA (Zen 1-3, Intel client parts: most x86-64 CPUs without AVX512)
// and a portable scalar one; the SIMD ones through per-function target attributes, chosen at
// run time (PATH_*, cpu_has_avx512f / cpu_has_ops_avx2), so the module builds for any x86-64.
// Both SIMD paths compute the same formulas, FMA and exp alike. exp: exp_avx512 (Cephes' expf
// range reduction and degree-6 polynomial, scaled with vscalefps; relative error < 2e-7 over
// the float range, NaN kept) and exp_avx2 (the same, 2^n applied as two exact power-of-two
// factors for want of vscalefps); the portable path calls expf. Summation orders differ from
// numpy's (8- or 16-lane partial sums, FMA): results agree to float32 rounding, not bit for
// bit. Cache stores are bit for bit on every path. Decode attention splits a large batch over
// two threads (paged_decode_attention); everything else is single-threaded.
//
// Measured (benchmarks/host/bench_cpu_ops.py: default model's shapes, one layer's non-GEMM
// calls, median us, numpy_ops -> AVX512 path; one core of a noisy 2-core Zen 4 VM, 2026-12-02):
//   context 64:  1 row 175 -> 35,  8 rows 689 -> 81,   32 rows 2818 -> 189
//   context 512: 1 row 250 -> 68,  8 rows 3141 -> 372, 32 rows 12731 -> 3939
// Decode attention dominates at 32 x 512 (3.9 ms of 25 MB of scattered k/v; a plain read of the
// same blocks takes 1.4-1.7 ms here, the compute alone ~1.1 ms). Engine, batch-1 decode
// (bench_engine.py concurrency, bf16, same build, numpy ops vs these, paired runs): 1.5-1.65x
// tok/s at 1 sequence, 1.2-1.4x at 8 and 32.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_thread_pool.h"  // run_pair: the process's one helper thread (decode attention)

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDRUN_OPS_X86 1
#else
#define PAGEDRUN_OPS_X86 0
#endif

namespace pagedrun_ops {

constexpr int PATH_PORTABLE = 0;
constexpr int PATH_AVX512 = 1;
constexpr int PATH_AVX2 = 2;  // AVX2 + FMA
constexpr int ACT_SILU = 0;
constexpr int ACT_GELU_TANH = 1;
// numpy_ops' GELU constants: sqrt(2 / pi) and the cubic coefficient.
constexpr float GELU_C0 = 0.7978845608028654f;
constexpr float GELU_C1 = 0.044715f;

static inline int cpu_has_avx512f() {
#if PAGEDRUN_OPS_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

// The AVX2 path's requirement: AVX2 and FMA (every CPU with one has the other in practice, but
// both are checked: the path's functions are compiled for both).
static inline int cpu_has_ops_avx2() {
#if PAGEDRUN_OPS_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

// ------------------------------------------------------------------------- index checks
// One pass each, before any write or read through the indices (numpy_ops raises before it
// writes, so these do too). Return 0 when all is well, else an error code the wrapper turns
// into numpy_ops' message.

constexpr int ERR_POSITION = 1;       // a position outside [0, max_position)
constexpr int ERR_SLOT_RANGE = 2;     // *value: the largest slot
constexpr int ERR_SLOT_DUPLICATE = 3;
constexpr int ERR_CONTEXT_LEN = 4;    // *seq, *value: context_len < 1
constexpr int ERR_CAPACITY = 5;       // *seq, *value: context_len > max_blocks * block_size
constexpr int ERR_BLOCK_ID = 6;       // *seq: a block id outside [0, num_blocks)

static inline int check_rotary_indices(const int32_t* positions, const int32_t* slots, int T,
                                       int max_position, long num_slots, long* value) {
    for (int t = 0; t < T; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return ERR_POSITION;
    long max_slot = -1;
    int num_valid = 0;
    for (int t = 0; t < T; ++t) {
        if (slots[t] >= 0) ++num_valid;
        if (slots[t] > max_slot) max_slot = slots[t];
    }
    if (max_slot >= num_slots) {
        *value = max_slot;
        return ERR_SLOT_RANGE;
    }
    if (num_valid > 1) {
        std::vector<int32_t> sorted;
        sorted.reserve(num_valid);
        for (int t = 0; t < T; ++t)
            if (slots[t] >= 0) sorted.push_back(slots[t]);
        std::sort(sorted.begin(), sorted.end());
        for (int i = 1; i < num_valid; ++i)
            if (sorted[i] == sorted[i - 1]) return ERR_SLOT_DUPLICATE;
    }
    return 0;
}

// numpy_ops.paged_decode_attention's order: sequence by sequence, context_len >= 1, then the
// table's capacity, then the ids of the blocks holding positions [0, context_len) -- all of
// them, those before a sliding window too, as numpy gathers the whole context.
static inline int check_decode_tables(const int32_t* block_tables, long ldb, int max_blocks,
                                      const int32_t* context_lens, int S, int num_blocks,
                                      int block_size, int* seq, long* value) {
    for (int s = 0; s < S; ++s) {
        const long context_len = context_lens[s];
        *seq = s;
        *value = context_len;
        if (context_len < 1) return ERR_CONTEXT_LEN;
        if (context_len > (long)max_blocks * block_size) return ERR_CAPACITY;
        const int used = (int)((context_len + block_size - 1) / block_size);
        const int32_t* row = block_tables + (long)s * ldb;
        for (int b = 0; b < used; ++b)
            if (row[b] < 0 || row[b] >= num_blocks) return ERR_BLOCK_ID;
    }
    return 0;
}

// ------------------------------------------------------------------------- KV cache elements

// float32 -> bf16 bits, round to nearest even; NaN -> its top half with the quiet bit set (the
// bias must not carry a NaN's payload into the exponent). weights.to_bf16_bits' rules.
static inline uint16_t kv_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// float32 -> fp8 e4m3 bits, integer only. |x| >= 2^-6 (float32 exponent >= 121) is an e4m3
// normal: the 23-bit mantissa rounds to 3 bits (RNE; a carry bumps the exponent), the exponent
// rebiases 127 -> 7 (- 120 << 3), and past the largest finite code 0x7E (448; inf included)
// it saturates. Below 2^-6: a multiple of the smallest subnormal 2^-9, the significand
// (implicit bit included) shifted right by 141 - exponent with RNE (a float32 subnormal, or
// anything under 2^-10, rounds to 0). NaN -> 0x7F; the sign bit is kept in every case (-0 too).
static inline uint8_t kv_f32_to_fp8(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = (bits >> 24) & 0x80u, a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);
    uint32_t code;
    if (a >= 0x3C800000u) {
        code = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
        code = code > 0x7Eu ? 0x7Eu : code;
    } else {
        const uint32_t shift = std::min(141u - (a >> 23), 25u);  // 25: rounds to 0 anyway
        const uint32_t s = (a & 0x7FFFFFu) | 0x800000u;
        code = (s + (1u << (shift - 1)) - 1u + ((s >> shift) & 1u)) >> shift;
    }
    return (uint8_t)(sign | code);
}

// The 256 e4m3 codes widened (exact): e = 0 is m * 2^-9, else (8 + m) * 2^(e - 10); 0x7F /
// 0xFF NaN. Built at compile time.
struct Fp8E4m3Table {
    float v[256];
    constexpr Fp8E4m3Table() : v() {
        for (int c = 0; c < 256; ++c) {
            const int e = (c >> 3) & 15, m = c & 7;
            float mag = e == 0 ? (float)m / 512.0f : (float)(8 + m) / 1024.0f;
            for (int i = 0; i < e; ++i) mag *= 2.0f;
            if ((c & 0x7F) == 0x7F) mag = __builtin_nanf("");
            v[c] = (c & 0x80) ? -mag : mag;
        }
    }
};
static constexpr Fp8E4m3Table FP8_E4M3{};

static inline float kv_load(const float* p) { return *p; }
static inline float kv_load(const uint16_t* p) {
    const uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float kv_load(const uint8_t* p) { return FP8_E4M3.v[*p]; }
static inline void kv_store(float* p, float x) { *p = x; }
static inline void kv_store(uint16_t* p, float x) { *p = kv_f32_to_bf16(x); }
static inline void kv_store(uint8_t* p, float x) { *p = kv_f32_to_fp8(x); }

// ------------------------------------------------------------------------- portable path

static inline float row_inv_rms(float sum_sq, int hidden, float eps) {
    // numpy: mean in float32, + eps, sqrt, 1 / (all float32).
    return 1.0f / sqrtf(sum_sq / (float)hidden + eps);
}

static inline void rms_norm_scalar(const float* x, long ldx, const float* w, int rows,
                                   int hidden, float eps, float* out, long ldo) {
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        float* o = out + r * ldo;
        float sum = 0.0f;
        for (int i = 0; i < hidden; ++i) sum += xr[i] * xr[i];
        const float inv = row_inv_rms(sum, hidden, eps);
        for (int i = 0; i < hidden; ++i) o[i] = xr[i] * inv * w[i];
    }
}

static inline void fused_add_rms_norm_scalar(const float* x, long ldx, const float* res,
                                             long ldr, const float* w, int rows, int hidden,
                                             float eps, float* out, long ldo, float* new_res,
                                             long ldn) {
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        const float* rr = res + r * ldr;
        float* nr = new_res + r * ldn;
        float* o = out + r * ldo;
        float sum = 0.0f;
        for (int i = 0; i < hidden; ++i) {
            const float h = xr[i] + rr[i];
            nr[i] = h;
            sum += h * h;
        }
        const float inv = row_inv_rms(sum, hidden, eps);
        for (int i = 0; i < hidden; ++i) o[i] = nr[i] * inv * w[i];
    }
}

static inline void act_and_mul_scalar(int kind, const float* gate_up, long ldg, int rows,
                                      int inter, float* out, long ldo) {
    for (int r = 0; r < rows; ++r) {
        const float* g = gate_up + r * ldg;
        const float* u = g + inter;
        float* o = out + r * ldo;
        if (kind == ACT_SILU) {
            for (int i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        } else {
            for (int i = 0; i < inter; ++i) {
                const float x = g[i];
                const float inner = GELU_C0 * (x + GELU_C1 * x * x * x);
                o[i] = x / (1.0f + expf(-2.0f * inner)) * u[i];
            }
        }
    }
}

// One head: out_lo = lo cos - hi sin, out_hi = hi cos + lo sin.
static inline void rotate_head_scalar(const float* x, const float* cos_row, const float* sin_row,
                                      int half, float* out) {
    for (int i = 0; i < half; ++i) {
        const float lo = x[i], hi = x[i + half];
        out[i] = lo * cos_row[i] - hi * sin_row[i];
        out[i + half] = hi * cos_row[i] + lo * sin_row[i];
    }
}

// ------------------------------------------------------------------------- AVX512F path
#if PAGEDRUN_OPS_X86
#define PAGEDRUN_AVX512_TARGET __attribute__((target("avx512f")))

static inline __mmask16 PAGEDRUN_AVX512_TARGET tail_mask(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

// 16 cache elements as float32: a float load, or 16 bf16 bits zero-extended and shifted into
// the high half (exact).
PAGEDRUN_AVX512_TARGET static inline __m512 kv_load16(const float* p) { return _mm512_loadu_ps(p); }
PAGEDRUN_AVX512_TARGET static inline __m512 kv_load16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 16 fp8 e4m3 codes as float32, with integer ops (no table gather): the 7 magnitude bits
// shifted into place (em << 20) are the float32 bits of a normal code once the exponent is
// rebiased (+ 120 << 23); a subnormal code (em < 8) is em * 2^-9 (exact in float32); em 0x7F
// is NaN; the sign bit moves to bit 31. The same values as FP8_E4M3 (tests check all 256).
PAGEDRUN_AVX512_TARGET static inline __m512 kv_load16(const uint8_t* p) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i em = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
    __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)),
                                 _mm512_castps_si512(sub));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F)),
                                 _mm512_set1_epi32(0x7FC00000));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}
// The first lanes of m (a tail_mask), the rest 0. A masked 16- or 8-bit load needs AVX512BW: a
// partial bf16 / fp8 row goes through a zeroed copy instead (only head sizes that are not a
// multiple of 16 have partial rows).
PAGEDRUN_AVX512_TARGET static inline __m512 kv_maskz_load16(__mmask16 m, const float* p) {
    return _mm512_maskz_loadu_ps(m, p);
}
template <typename C>
PAGEDRUN_AVX512_TARGET static inline __m512 kv_maskz_load16(__mmask16 m, const C* p) {
    if (m == (__mmask16)0xFFFF) return kv_load16(p);
    alignas(32) C buf[16] = {0};
    for (int i = 0; i < 16; ++i)
        if ((m >> i) & 1) buf[i] = p[i];
    return kv_load16(buf);
}

// dst[0, n) = src[0, n) as cache elements: a copy, or kv_f32_to_bf16 16 lanes at a time
// (integer RNE, NaN lanes blended in, narrowed by vpmovdw: all AVX512F).
PAGEDRUN_AVX512_TARGET static inline void kv_store_row_avx512(const float* src, int n,
                                                              float* dst) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(dst + i, m, _mm512_maskz_loadu_ps(m, src + i));
    }
}
PAGEDRUN_AVX512_TARGET static inline void kv_store_row_avx512(const float* src, int n,
                                                              uint16_t* dst) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i quiet = _mm512_set1_epi32(0x40);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + i));
        const __m512i upper = _mm512_srli_epi32(bits, 16);
        const __m512i rounded = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(bits, bias), _mm512_and_si512(upper, one)), 16);
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, abs_mask), inf);
        const __m512i out = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(upper, quiet));
        _mm512_mask_cvtepi32_storeu_epi16(dst + i, m, out);
    }
}
// kv_f32_to_fp8 16 lanes at a time (variable shifts for the subnormal lanes, narrowed by
// vpmovdb: all AVX512F).
PAGEDRUN_AVX512_TARGET static inline void kv_store_row_avx512(const float* src, int n,
                                                              uint8_t* dst) {
    const __m512i one = _mm512_set1_epi32(1), abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + i));
        const __m512i a = _mm512_and_si512(bits, abs_mask);
        const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24),
                                              _mm512_set1_epi32(0x80));
        // normal: RNE to 3 mantissa bits, rebias, saturate at 0x7E
        __m512i normal = _mm512_add_epi32(
            _mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)),
            _mm512_and_si512(_mm512_srli_epi32(a, 20), one));
        normal = _mm512_sub_epi32(_mm512_srli_epi32(normal, 20), _mm512_set1_epi32(120 << 3));
        normal = _mm512_min_epi32(normal, _mm512_set1_epi32(0x7E));
        // subnormal: the significand >> min(141 - exponent, 25), RNE
        const __m512i shift = _mm512_min_epi32(
            _mm512_sub_epi32(_mm512_set1_epi32(141), _mm512_srli_epi32(a, 23)),
            _mm512_set1_epi32(25));
        const __m512i s = _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF)),
                                          _mm512_set1_epi32(0x800000));
        const __m512i half = _mm512_sub_epi32(
            _mm512_sllv_epi32(one, _mm512_sub_epi32(shift, one)), one);
        const __m512i sub = _mm512_srlv_epi32(
            _mm512_add_epi32(_mm512_add_epi32(s, half),
                             _mm512_and_si512(_mm512_srlv_epi32(s, shift), one)),
            shift);
        __m512i code = _mm512_mask_mov_epi32(
            sub, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x3C800000)), normal);
        code = _mm512_mask_mov_epi32(
            code, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)),
            _mm512_set1_epi32(0x7F));
        _mm512_mask_cvtepi32_storeu_epi8(dst + i, m, _mm512_or_si512(code, sign));
    }
}

// e^x: x = n ln2 + r, |r| <= ln2 / 2 (ln2 split in two for an exact n ln2), e^r by Cephes'
// polynomial, then 2^n by vscalefps (which overflows to inf and underflows to 0 by itself).
// The clamp to [-104, 89] keeps r small for huge |x| (e^-104 and e^89 are already 0 / inf in
// float32); max/min take x as their second operand so a NaN passes through.
PAGEDRUN_AVX512_TARGET static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

// The sum of squares of n floats, 16 lanes (a shorter chain than numpy's pairwise sum, as good).
PAGEDRUN_AVX512_TARGET static inline float sum_sq_avx512(const float* x, int n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
        acc1 = _mm512_fmadd_ps(b, b, acc1);
    }
    for (; i < n; i += 16) {
        const __m512 a = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// o = x * inv * w over n floats.
PAGEDRUN_AVX512_TARGET static inline void scale_row_avx512(const float* x, float inv,
                                                           const float* w, int n, float* o) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s);
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

PAGEDRUN_AVX512_TARGET static void rms_norm_avx512(const float* x, long ldx, const float* w,
                                                   int rows, int hidden, float eps, float* out,
                                                   long ldo) {
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        scale_row_avx512(xr, row_inv_rms(sum_sq_avx512(xr, hidden), hidden, eps), w, hidden,
                         out + r * ldo);
    }
}

PAGEDRUN_AVX512_TARGET static void fused_add_rms_norm_avx512(const float* x, long ldx,
                                                             const float* res, long ldr,
                                                             const float* w, int rows, int hidden,
                                                             float eps, float* out, long ldo,
                                                             float* new_res, long ldn) {
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        const float* rr = res + r * ldr;
        float* nr = new_res + r * ldn;
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < hidden; i += 16) {
            const __mmask16 m = tail_mask(hidden - i);
            const __m512 h = _mm512_add_ps(_mm512_maskz_loadu_ps(m, xr + i),
                                           _mm512_maskz_loadu_ps(m, rr + i));
            _mm512_mask_storeu_ps(nr + i, m, h);
            acc = _mm512_fmadd_ps(h, h, acc);
        }
        scale_row_avx512(nr, row_inv_rms(_mm512_reduce_add_ps(acc), hidden, eps), w, hidden,
                         out + r * ldo);
    }
}

PAGEDRUN_AVX512_TARGET static void act_and_mul_avx512(int kind, const float* gate_up, long ldg,
                                                      int rows, int inter, float* out,
                                                      long ldo) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 c0x2 = _mm512_set1_ps(-2.0f * GELU_C0), c1 = _mm512_set1_ps(GELU_C1);
    for (int r = 0; r < rows; ++r) {
        const float* g = gate_up + r * ldg;
        const float* u = g + inter;
        float* o = out + r * ldo;
        for (int i = 0; i < inter; i += 16) {
            const __mmask16 m = tail_mask(inter - i);
            const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
            __m512 arg;  // the exponent of the sigmoid's denominator
            if (kind == ACT_SILU) {
                arg = _mm512_sub_ps(_mm512_setzero_ps(), x);
            } else {
                const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
                arg = _mm512_mul_ps(c0x2, _mm512_fmadd_ps(c1, x3, x));
            }
            const __m512 act = _mm512_div_ps(x, _mm512_add_ps(one, exp_avx512(arg)));
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(act, _mm512_maskz_loadu_ps(m, u + i)));
        }
    }
}

PAGEDRUN_AVX512_TARGET static inline void rotate_head_avx512(const float* x, const float* cos_row,
                                                             const float* sin_row, int half,
                                                             float* out) {
    for (int i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 lo = _mm512_maskz_loadu_ps(m, x + i);
        const __m512 hi = _mm512_maskz_loadu_ps(m, x + half + i);
        const __m512 c = _mm512_maskz_loadu_ps(m, cos_row + i);
        const __m512 s = _mm512_maskz_loadu_ps(m, sin_row + i);
        _mm512_mask_storeu_ps(out + i, m,
                              _mm512_sub_ps(_mm512_mul_ps(lo, c), _mm512_mul_ps(hi, s)));
        _mm512_mask_storeu_ps(out + half + i, m,
                              _mm512_add_ps(_mm512_mul_ps(hi, c), _mm512_mul_ps(lo, s)));
    }
}
#endif

// ------------------------------------------------------------------------- AVX2 + FMA path
// For x86-64 CPUs without AVX512F (Zen 1-3, Intel client parts): 8 lanes, 16 ymm registers, no
// mask registers. Partial vectors of float rows use vmaskmovps (masked-off lanes never fault);
// partial bf16 / fp8 rows go element by element through kv_store. The target attribute is
// per function (chosen at run time), so nothing here needs -mavx2; helpers are static inline
// functions of the same target, which GCC inlines (a lambda would not inherit the target).
#if PAGEDRUN_OPS_X86
#define PAGEDRUN_OPS_AVX2_TARGET __attribute__((target("avx2,fma")))
// The hot helpers: GCC's -O2 heuristics left exp_avx2 and dot8_avx2 out of line, spilling every
// live ymm around each call (the SysV ABI preserves none), so they are forced inline.
#define PAGEDRUN_OPS_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline))

// Lanes [0, n) set, n <= 8 (vmaskmovps reads each lane's top bit).
PAGEDRUN_OPS_AVX2_INLINE static inline __m256i tail_mask8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
PAGEDRUN_OPS_AVX2_INLINE static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
PAGEDRUN_OPS_AVX2_INLINE static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// 8 cache elements as float32, exactly as kv_load: a float load; bf16 bits zero-extended and
// shifted into the high half; fp8 e4m3 with kv_load16's integer steps (normal: em << 20
// rebiased by 120 << 23; subnormal em < 8: em * 2^-9; em 0x7F: NaN; sign to bit 31) -- about a
// dozen single-uop ops, no slower than an 8-lane table gather on Zen 3 and no table in cache.
PAGEDRUN_OPS_AVX2_INLINE static inline __m256 kv_load8(const float* p) {
    return _mm256_loadu_ps(p);
}
PAGEDRUN_OPS_AVX2_INLINE static inline __m256 kv_load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PAGEDRUN_OPS_AVX2_INLINE static inline __m256 kv_load8(const uint8_t* p) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i em = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
    __m256 v = _mm256_blendv_ps(
        normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
    v = _mm256_blendv_ps(
        v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F))));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

// dst[0, n) = src[0, n) as cache elements, 8 at a time: a copy (masked tail); kv_f32_to_bf16
// (integer RNE, NaN lanes blended in) or kv_f32_to_fp8 (variable shifts for the subnormal
// lanes) narrowed with packus (every lane is already in [0, 0xFFFF] / [0, 0xFF], so the
// saturation never bites), a tail of n % 8 through kv_store. Bit for bit the scalar stores.
PAGEDRUN_OPS_AVX2_TARGET static inline void kv_store_row_avx2(const float* src, int n,
                                                              float* dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
    if (i < n) {
        const __m256i m = tail_mask8(n - i);
        _mm256_maskstore_ps(dst + i, m, _mm256_maskload_ps(src + i, m));
    }
}
PAGEDRUN_OPS_AVX2_TARGET static inline void kv_store_row_avx2(const float* src, int n,
                                                              uint16_t* dst) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        const __m256i upper = _mm256_srli_epi32(bits, 16);
        const __m256i rounded = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(bits, bias), _mm256_and_si256(upper, one)), 16);
        // |bits| and inf are both non-negative as int32: a signed compare is the unsigned one.
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf);
        const __m256i out = _mm256_blendv_epi8(rounded, _mm256_or_si256(upper, quiet), nan);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(out),
                                          _mm256_extracti128_si256(out, 1)));
    }
    for (; i < n; ++i) kv_store(dst + i, src[i]);
}
PAGEDRUN_OPS_AVX2_TARGET static inline void kv_store_row_avx2(const float* src, int n,
                                                              uint8_t* dst) {
    const __m256i one = _mm256_set1_epi32(1), abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        const __m256i a = _mm256_and_si256(bits, abs_mask);  // non-negative: signed compares
        const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24),
                                              _mm256_set1_epi32(0x80));
        // normal: RNE to 3 mantissa bits, rebias, saturate at 0x7E
        __m256i normal = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)),
                                          _mm256_and_si256(_mm256_srli_epi32(a, 20), one));
        normal = _mm256_sub_epi32(_mm256_srli_epi32(normal, 20), _mm256_set1_epi32(120 << 3));
        normal = _mm256_min_epi32(normal, _mm256_set1_epi32(0x7E));
        // subnormal: the significand >> min(141 - exponent, 25), RNE (for normal lanes the
        // shift is out of range, vpsllvd / vpsrlvd give 0, and the blend drops them)
        const __m256i shift = _mm256_min_epi32(
            _mm256_sub_epi32(_mm256_set1_epi32(141), _mm256_srli_epi32(a, 23)),
            _mm256_set1_epi32(25));
        const __m256i s = _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7FFFFF)),
                                          _mm256_set1_epi32(0x800000));
        const __m256i half = _mm256_sub_epi32(
            _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one)), one);
        const __m256i sub = _mm256_srlv_epi32(
            _mm256_add_epi32(_mm256_add_epi32(s, half),
                             _mm256_and_si256(_mm256_srlv_epi32(s, shift), one)),
            shift);
        __m256i code = _mm256_blendv_epi8(
            sub, normal, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x3C800000 - 1)));
        code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F),
                                  _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
        code = _mm256_or_si256(code, sign);
        const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code),
                                           _mm256_extracti128_si256(code, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packus_epi16(w, w));
    }
    for (; i < n; ++i) kv_store(dst + i, src[i]);
}

// e^x with exp_avx512's contract: the same clamp, Cephes range reduction and degree-6
// polynomial (relative error < 2e-7, NaN kept, e^-104 -> 0, e^89 -> inf). AVX2 has no
// vscalefps: 2^n is applied as two factors 2^(n >> 1) and 2^(n - (n >> 1)), each built by
// putting its biased exponent into the float bits. n is in [-150, 128] after the clamp, so each
// factor's exponent is in [-75, 64] (a normal float): p * 2^n1 is exact and the second product
// rounds once, overflowing to inf or rounding into subnormals / 0 exactly as vscalefps does. A
// NaN x converts to an integer garbage n, but p is NaN already and NaN * anything stays NaN.
PAGEDRUN_OPS_AVX2_INLINE static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

// The sum of squares of n floats: four 8-lane partial sums (four FMA chains in flight).
PAGEDRUN_OPS_AVX2_TARGET static inline float sum_sq_avx2(const float* x, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        const __m256 v = _mm256_maskload_ps(x + i, tail_mask8(n - i));
        a1 = _mm256_fmadd_ps(v, v, a1);
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// o = x * inv * w over n floats.
PAGEDRUN_OPS_AVX2_TARGET static inline void scale_row_avx2(const float* x, float inv,
                                                           const float* w, int n, float* o) {
    const __m256 s = _mm256_set1_ps(inv);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(v, _mm256_loadu_ps(w + i)));
    }
    if (i < n) {
        const __m256i m = tail_mask8(n - i);
        const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(x + i, m), s);
        _mm256_maskstore_ps(o + i, m, _mm256_mul_ps(v, _mm256_maskload_ps(w + i, m)));
    }
}

PAGEDRUN_OPS_AVX2_TARGET static void rms_norm_avx2(const float* x, long ldx, const float* w,
                                                   int rows, int hidden, float eps, float* out,
                                                   long ldo) {
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        scale_row_avx2(xr, row_inv_rms(sum_sq_avx2(xr, hidden), hidden, eps), w, hidden,
                       out + r * ldo);
    }
}

PAGEDRUN_OPS_AVX2_TARGET static void fused_add_rms_norm_avx2(const float* x, long ldx,
                                                             const float* res, long ldr,
                                                             const float* w, int rows, int hidden,
                                                             float eps, float* out, long ldo,
                                                             float* new_res, long ldn) {
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        const float* rr = res + r * ldr;
        float* nr = new_res + r * ldn;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        int i = 0;
        for (; i + 16 <= hidden; i += 16) {
            const __m256 h0 = _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i));
            const __m256 h1 = _mm256_add_ps(_mm256_loadu_ps(xr + i + 8),
                                            _mm256_loadu_ps(rr + i + 8));
            _mm256_storeu_ps(nr + i, h0);
            _mm256_storeu_ps(nr + i + 8, h1);
            acc0 = _mm256_fmadd_ps(h0, h0, acc0);
            acc1 = _mm256_fmadd_ps(h1, h1, acc1);
        }
        for (; i < hidden; i += 8) {
            const __m256i m = tail_mask8(hidden - i);
            const __m256 h = _mm256_add_ps(_mm256_maskload_ps(xr + i, m),
                                           _mm256_maskload_ps(rr + i, m));
            _mm256_maskstore_ps(nr + i, m, h);
            acc0 = _mm256_fmadd_ps(h, h, acc0);
        }
        scale_row_avx2(nr, row_inv_rms(hsum8(_mm256_add_ps(acc0, acc1)), hidden, eps), w,
                       hidden, out + r * ldo);
    }
}

// act_and_mul_avx512's formulas, 8 lanes; a masked tail (masked-off lanes load 0: exp(0)).
PAGEDRUN_OPS_AVX2_INLINE static inline __m256 act_avx2(int kind, __m256 x) {
    __m256 arg;  // the exponent of the sigmoid's denominator
    if (kind == ACT_SILU) {
        arg = _mm256_sub_ps(_mm256_setzero_ps(), x);
    } else {
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        arg = _mm256_mul_ps(_mm256_set1_ps(-2.0f * GELU_C0),
                            _mm256_fmadd_ps(_mm256_set1_ps(GELU_C1), x3, x));
    }
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_avx2(arg)));
}

PAGEDRUN_OPS_AVX2_TARGET static void act_and_mul_avx2(int kind, const float* gate_up, long ldg,
                                                      int rows, int inter, float* out,
                                                      long ldo) {
    for (int r = 0; r < rows; ++r) {
        const float* g = gate_up + r * ldg;
        const float* u = g + inter;
        float* o = out + r * ldo;
        int i = 0;
        for (; i + 8 <= inter; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(act_avx2(kind, _mm256_loadu_ps(g + i)),
                                                  _mm256_loadu_ps(u + i)));
        if (i < inter) {
            const __m256i m = tail_mask8(inter - i);
            const __m256 act = act_avx2(kind, _mm256_maskload_ps(g + i, m));
            _mm256_maskstore_ps(o + i, m, _mm256_mul_ps(act, _mm256_maskload_ps(u + i, m)));
        }
    }
}

// One head 8 pairs at a time (rotate_head_scalar's formulas); a masked tail for half % 8.
PAGEDRUN_OPS_AVX2_INLINE static inline void rotate_pairs_avx2(__m256 lo, __m256 hi, __m256 c,
                                                              __m256 s, __m256* o_lo,
                                                              __m256* o_hi) {
    *o_lo = _mm256_sub_ps(_mm256_mul_ps(lo, c), _mm256_mul_ps(hi, s));
    *o_hi = _mm256_add_ps(_mm256_mul_ps(hi, c), _mm256_mul_ps(lo, s));
}
PAGEDRUN_OPS_AVX2_TARGET static inline void rotate_head_avx2(const float* x, const float* cos_row,
                                                             const float* sin_row, int half,
                                                             float* out) {
    __m256 o_lo, o_hi;
    int i = 0;
    for (; i + 8 <= half; i += 8) {
        rotate_pairs_avx2(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + half + i),
                          _mm256_loadu_ps(cos_row + i), _mm256_loadu_ps(sin_row + i), &o_lo,
                          &o_hi);
        _mm256_storeu_ps(out + i, o_lo);
        _mm256_storeu_ps(out + half + i, o_hi);
    }
    if (i < half) {
        const __m256i m = tail_mask8(half - i);
        rotate_pairs_avx2(_mm256_maskload_ps(x + i, m), _mm256_maskload_ps(x + half + i, m),
                          _mm256_maskload_ps(cos_row + i, m), _mm256_maskload_ps(sin_row + i, m),
                          &o_lo, &o_hi);
        _mm256_maskstore_ps(out + i, m, o_lo);
        _mm256_maskstore_ps(out + half + i, m, o_hi);
    }
}
#endif

// ------------------------------------------------------------------------- dispatch: norms, MLP

static inline void rms_norm_rows(int path, const float* x, long ldx, const float* w, int rows,
                                 int hidden, float eps, float* out, long ldo) {
#if PAGEDRUN_OPS_X86
    if (path == PATH_AVX512) return rms_norm_avx512(x, ldx, w, rows, hidden, eps, out, ldo);
    if (path == PATH_AVX2) return rms_norm_avx2(x, ldx, w, rows, hidden, eps, out, ldo);
#endif
    rms_norm_scalar(x, ldx, w, rows, hidden, eps, out, ldo);
}

static inline void fused_add_rms_norm_rows(int path, const float* x, long ldx, const float* res,
                                           long ldr, const float* w, int rows, int hidden,
                                           float eps, float* out, long ldo, float* new_res,
                                           long ldn) {
#if PAGEDRUN_OPS_X86
    if (path == PATH_AVX512)
        return fused_add_rms_norm_avx512(x, ldx, res, ldr, w, rows, hidden, eps, out, ldo,
                                         new_res, ldn);
    if (path == PATH_AVX2)
        return fused_add_rms_norm_avx2(x, ldx, res, ldr, w, rows, hidden, eps, out, ldo, new_res,
                                       ldn);
#endif
    fused_add_rms_norm_scalar(x, ldx, res, ldr, w, rows, hidden, eps, out, ldo, new_res, ldn);
}

static inline void act_and_mul_rows(int path, int kind, const float* gate_up, long ldg, int rows,
                                    int inter, float* out, long ldo) {
#if PAGEDRUN_OPS_X86
    if (path == PATH_AVX512) return act_and_mul_avx512(kind, gate_up, ldg, rows, inter, out, ldo);
    if (path == PATH_AVX2) return act_and_mul_avx2(kind, gate_up, ldg, rows, inter, out, ldo);
#endif
    act_and_mul_scalar(kind, gate_up, ldg, rows, inter, out, ldo);
}

// ------------------------------------------------------------------------- rotary + cache write

// dst[0, n) = src[0, n) as cache elements (kv_store).
template <typename C>
static inline void kv_store_row(int path, const float* src, int n, C* dst) {
#if PAGEDRUN_OPS_X86
    if (path == PATH_AVX512) return kv_store_row_avx512(src, n, dst);
    if (path == PATH_AVX2) return kv_store_row_avx2(src, n, dst);
#endif
    for (int i = 0; i < n; ++i) kv_store(dst + i, src[i]);
}

// C: the cache element, float, uint16_t (bf16 bits) or uint8_t (fp8 e4m3 bits).
template <typename C>
static inline void rotary_cache_write(int path, const float* q, long sq0, long sq1,
                                      const float* k, long sk0, long sk1, const float* v,
                                      long sv0, long sv1, const int32_t* positions,
                                      const float* cos_sin, const int32_t* slots, int T, int H,
                                      int KV, int D, C* k_cache, C* v_cache, long sc0,
                                      long sc1, long sc2, int block_size, float* q_rot,
                                      float* k_rot) {
    const int half = D / 2;
    for (int t = 0; t < T; ++t) {
        const float* cos_row = cos_sin + (long)positions[t] * D;
        const float* sin_row = cos_row + half;
        for (int h = 0; h < H + KV; ++h) {
            const bool is_q = h < H;
            const float* src = is_q ? q + t * sq0 + h * sq1 : k + t * sk0 + (h - H) * sk1;
            float* dst = is_q ? q_rot + ((long)t * H + h) * D : k_rot + ((long)t * KV + h - H) * D;
#if PAGEDRUN_OPS_X86
            if (path == PATH_AVX512) {
                rotate_head_avx512(src, cos_row, sin_row, half, dst);
                continue;
            }
            if (path == PATH_AVX2) {
                rotate_head_avx2(src, cos_row, sin_row, half, dst);
                continue;
            }
#endif
            rotate_head_scalar(src, cos_row, sin_row, half, dst);
        }
        const long slot = slots[t];
        if (slot < 0) continue;
        const long base = slot / block_size * sc0 + slot % block_size * sc1;
        for (int h = 0; h < KV; ++h) {
            kv_store_row(path, k_rot + ((long)t * KV + h) * D, D, k_cache + base + h * sc2);
            kv_store_row(path, v + t * sv0 + h * sv1, D, v_cache + base + h * sc2);
        }
    }
}

// ------------------------------------------------------------------------- decode attention
// Per (sequence, kv head): the group's query heads, an accumulator [group][D], a running max
// and sum per head, and the scores of one block [group][block_size] (the caller's scratch).

struct DecodeGroup {
    const float* q;     // first query head of the group; heads sq1 apart
    long sq1;
    int group, D;
    float scale;
    float* acc;         // [group][D]
    float* m;           // [group] running max
    float* l;           // [group] running sum
    float* scores;      // [group][block_size]
};

// One block's tokens [t0, t1): k rows at k_rows + (t - t0) * sc1, v likewise.
template <typename C>
static inline void decode_block_scalar(DecodeGroup& g, const C* k_rows, const C* v_rows,
                                       long sc1, int n) {
    const int D = g.D;
    for (int j = 0; j < g.group; ++j) {
        const float* qj = g.q + j * g.sq1;
        float* sj = g.scores + (long)j * n;
        float block_max = -INFINITY;
        for (int t = 0; t < n; ++t) {
            const C* kt = k_rows + t * sc1;
            float dot = 0.0f;
            for (int d = 0; d < D; ++d) dot += qj[d] * kv_load(kt + d);
            sj[t] = dot * g.scale;
            block_max = sj[t] > block_max ? sj[t] : block_max;
        }
        const float m_new = block_max > g.m[j] ? block_max : g.m[j];
        const float correction = g.m[j] == -INFINITY ? 0.0f : expf(g.m[j] - m_new);
        g.m[j] = m_new;
        float* aj = g.acc + (long)j * D;
        for (int d = 0; d < D; ++d) aj[d] *= correction;
        float sum = 0.0f;
        for (int t = 0; t < n; ++t) {
            const float p = expf(sj[t] - m_new);
            sum += p;
            const C* vt = v_rows + t * sc1;
            for (int d = 0; d < D; ++d) aj[d] += p * kv_load(vt + d);
        }
        g.l[j] = g.l[j] * correction + sum;
    }
}

#if PAGEDRUN_OPS_X86
// The AVX512 block for any D (masked tails): each k row is loaded once for all the group's
// heads, each v row once; exp runs on 16 scores at a time. Accumulators live in memory (L1):
// the fallback for head sizes without a register-resident instantiation below.
template <typename C>
PAGEDRUN_AVX512_TARGET static void decode_block_avx512(DecodeGroup& g, const C* k_rows,
                                                       const C* v_rows, long sc1, int n) {
    const int D = g.D, group = g.group;
    float* scores = g.scores;
    const float scale = g.scale;
    for (int t = 0; t < n; ++t) {
        const C* kt = k_rows + t * sc1;
        for (int j = 0; j < group; ++j) {
            const float* qj = g.q + j * g.sq1;
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 16) {
                const __mmask16 m = tail_mask(D - d);
                acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qj + d),
                                      kv_maskz_load16(m, kt + d), acc);
            }
            scores[(long)j * n + t] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int j = 0; j < group; ++j) {
        float* sj = scores + (long)j * n;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < n; t += 16)
            vmax = _mm512_mask_max_ps(vmax, tail_mask(n - t), vmax,
                                      _mm512_maskz_loadu_ps(tail_mask(n - t), sj + t));
        const float block_max = _mm512_reduce_max_ps(vmax);
        const float m_new = block_max > g.m[j] ? block_max : g.m[j];
        const float correction = g.m[j] == -INFINITY ? 0.0f : expf(g.m[j] - m_new);
        g.m[j] = m_new;
        const __m512 vm = _mm512_set1_ps(m_new);
        __m512 vsum = _mm512_setzero_ps();
        for (int t = 0; t < n; t += 16) {
            const __mmask16 m = tail_mask(n - t);
            const __m512 p = _mm512_maskz_mov_ps(
                m, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sj + t), vm)));
            _mm512_mask_storeu_ps(sj + t, m, p);
            vsum = _mm512_add_ps(vsum, p);
        }
        g.l[j] = g.l[j] * correction + _mm512_reduce_add_ps(vsum);
        if (correction != 1.0f) {
            float* aj = g.acc + (long)j * D;
            const __m512 c = _mm512_set1_ps(correction);
            for (int d = 0; d < D; d += 16) {
                const __mmask16 m = tail_mask(D - d);
                _mm512_mask_storeu_ps(aj + d, m,
                                      _mm512_mul_ps(_mm512_maskz_loadu_ps(m, aj + d), c));
            }
        }
    }
    for (int t = 0; t < n; ++t) {
        const C* vt = v_rows + t * sc1;
        for (int d = 0; d < D; d += 16) {
            const __mmask16 m = tail_mask(D - d);
            const __m512 vv = kv_maskz_load16(m, vt + d);
            for (int j = 0; j < group; ++j) {
                float* aj = g.acc + (long)j * D + d;
                const __m512 p = _mm512_set1_ps(scores[(long)j * n + t]);
                _mm512_mask_storeu_ps(aj, m, _mm512_fmadd_ps(p, vv, _mm512_maskz_loadu_ps(m, aj)));
            }
        }
    }
}

// One run of n <= 16 tokens (inside one cache block) for G query heads of one kv head, D =
// 16 NC: the heads' state (accumulators [G][D], running max m and sum l) is loaded into
// registers, updated and stored back. G x n scores (one k row load serves all G heads), one
// online-softmax step per head (new running max, rescale by exp(old - new)), then the run's v
// rows (one load serves all G heads).
template <int NC, int G, typename C>
PAGEDRUN_AVX512_TARGET static inline void decode_run_avx512(const float* q, long sq1,
                                                            const C* k_rows,
                                                            const C* v_rows, long sc1, int n,
                                                            float scale, float* acc_mem,
                                                            float* m, float* l) {
    constexpr int D = 16 * NC;
    __m512 acc[G][NC];
    alignas(64) float s[G][16];
    for (int t = 0; t < n; ++t) {
        const C* kt = k_rows + t * sc1;
        __m512 kv[NC];
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) kv[c] = kv_load16(kt + 16 * c);
#pragma GCC unroll 16
        for (int j = 0; j < G; ++j) {
            const float* qj = q + j * sq1;
            __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
#pragma GCC unroll 16
            for (int c = 1; c < NC; ++c)
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), kv[c], dot);
            s[j][t] = _mm512_reduce_add_ps(dot);
        }
    }
    const __mmask16 valid = tail_mask(n);
    const __m512 vscale = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (int j = 0; j < G; ++j) {
        const __m512 sj = _mm512_maskz_mul_ps(valid, _mm512_load_ps(s[j]), vscale);
        const float run_max = _mm512_mask_reduce_max_ps(valid, sj);
        const float m_new = run_max > m[j] ? run_max : m[j];
        const float correction = m[j] == -INFINITY ? 0.0f : expf(m[j] - m_new);
        m[j] = m_new;
        const __m512 p = _mm512_maskz_mov_ps(
            valid, exp_avx512(_mm512_sub_ps(sj, _mm512_set1_ps(m_new))));
        _mm512_store_ps(s[j], p);
        l[j] = l[j] * correction + _mm512_reduce_add_ps(p);
        const __m512 vc = _mm512_set1_ps(correction);
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c)
            acc[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc_mem + j * D + 16 * c), vc);
    }
    for (int t = 0; t < n; ++t) {
        const C* vt = v_rows + t * sc1;
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
            const __m512 vv = kv_load16(vt + 16 * c);
#pragma GCC unroll 16
            for (int j = 0; j < G; ++j)
                acc[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[j][t]), vv, acc[j][c]);
        }
    }
#pragma GCC unroll 16
    for (int j = 0; j < G; ++j)
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_mem + j * D + 16 * c, acc[j][c]);
}

// How far ahead decode_seq_avx512 prefetches k/v rows (into L2), in tokens: the next run.
// Measured at 32 sequences x 512 tokens (default model shapes, 25 MB of context, one core of a
// 2-core Zen 4 VM, noisy +-15%): no prefetch 4.2 ms; next run into L1 4.4 ms; next run into L2
// 3.1-3.9 ms; 32 or 64 tokens ahead into L2 no better. A plain read of the same blocks takes
// 1.4-1.7 ms (15-18 GB/s), the compute alone ~1.1 ms (32 x the 1-sequence time).
constexpr long PREFETCH_TOKENS = 16;

// Heads per register-resident run: G x NC accumulators + G broadcasts + one v vector fit in
// the 32 zmm registers.
template <int NC>
constexpr int max_heads_per_run() { return NC >= 8 ? 3 : NC >= 4 ? 6 : 8; }

// One sequence, D = 16 NC: runs of up to 16 tokens in context order, and in each run every kv
// head and query head, so a block's rows ([block_size][KV][D], contiguous) are read front to
// back once; the next run's rows are prefetched while this one computes (PREFETCH_TOKENS).
// state: acc [H][D], m [H], l [H] scratch.
template <int NC, typename C>
PAGEDRUN_AVX512_TARGET static void decode_seq_avx512(const float* q, long sq1,
                                                     const C* k_cache, const C* v_cache,
                                                     long sc0, long sc1, long sc2,
                                                     int block_size, const int32_t* table,
                                                     long first, long context_len, int H,
                                                     int KV, float scale, float* acc,
                                                     float* m, float* l, float* out) {
    constexpr int D = 16 * NC;
    constexpr int G_MAX = max_heads_per_run<NC>();
    const int group = H / KV;
    std::fill(acc, acc + (long)H * D, 0.0f);
    std::fill(m, m + H, -INFINITY);
    std::fill(l, l + H, 0.0f);
    for (long t0 = first; t0 < context_len;) {
        const long b = t0 / block_size;
        const int n = (int)std::min(16L, std::min(context_len, (b + 1) * block_size) - t0);
        const long row = (long)table[b] * sc0 + (t0 - b * block_size) * sc1;
        const long t_next = t0 + n;
        // Prefetch into L2 the run PREFETCH_TOKENS ahead (see PREFETCH_TOKENS).
        const long t_pf = t0 + PREFETCH_TOKENS;
        if (t_pf < context_len) {
            const long b_pf = t_pf / block_size;
            const long n_pf = std::min(16L, std::min(context_len, (b_pf + 1) * block_size) - t_pf);
            const long row_pf = (long)table[b_pf] * sc0 + (t_pf - b_pf * block_size) * sc1;
            const long span = (n_pf - 1) * sc1 + (KV - 1) * sc2 + D;  // cache elements
            for (long f = 0; f < span; f += 64 / (long)sizeof(C)) {  // one line apart
                _mm_prefetch(reinterpret_cast<const char*>(k_cache + row_pf + f), _MM_HINT_T2);
                _mm_prefetch(reinterpret_cast<const char*>(v_cache + row_pf + f), _MM_HINT_T2);
            }
        }
        for (int kvh = 0; kvh < KV; ++kvh) {
            const C* k_rows = k_cache + row + kvh * sc2;
            const C* v_rows = v_cache + row + kvh * sc2;
            for (int j0 = 0; j0 < group; j0 += G_MAX) {
                const int h = kvh * group + j0;
                const float* qh = q + h * sq1;
                float* ah = acc + (long)h * D;
#define PAGEDRUN_HEADS_CASE(G_)                                                              \
    case G_:                                                                                 \
        if constexpr (G_ <= G_MAX)                                                           \
            decode_run_avx512<NC, G_, C>(qh, sq1, k_rows, v_rows, sc1, n, scale, ah, m + h,     \
                                      l + h);                                                \
        break;
                switch (std::min(G_MAX, group - j0)) {
                    PAGEDRUN_HEADS_CASE(1)
                    PAGEDRUN_HEADS_CASE(2)
                    PAGEDRUN_HEADS_CASE(3)
                    PAGEDRUN_HEADS_CASE(4)
                    PAGEDRUN_HEADS_CASE(5)
                    PAGEDRUN_HEADS_CASE(6)
                    PAGEDRUN_HEADS_CASE(7)
                    PAGEDRUN_HEADS_CASE(8)
                    default: break;
                }
#undef PAGEDRUN_HEADS_CASE
            }
        }
        t0 = t_next;
    }
    // An empty window (sliding_window <= 0): 0 / 0 = NaN, as numpy's softmax.
    for (int h = 0; h < H; ++h) {
        const float inv = first < context_len ? 1.0f / l[h] : NAN;
        for (int d = 0; d < D; ++d) out[(long)h * D + d] = acc[(long)h * D + d] * inv;
    }
}
#endif

#if PAGEDRUN_OPS_X86
// ------------------------------------------------------------------------- decode, AVX2
// The AVX512 kernel's algorithm for D = 32, 64, 128 in 8-lane vectors, rearranged for 16 ymm
// registers: a 64-wide accumulator row is already 8 of them, so the group's accumulators [G][D]
// cannot all stay in registers for a run as they do in zmm. Instead each phase of a run keeps
// what it needs in registers:
//   scores: one query head, 8 tokens at a time -- 8 dot-product chains (one per token) with q
//       loaded once per column and the k rows read from L1 as FMA memory operands, then the 8
//       dot products reduced together by a hadd tree (9 shuffles and adds, not 8 separate
//       horizontal sums);
//   p.v: column block by column block -- the G heads' accumulators for CB columns in registers
//       across all the run's tokens, each v vector loaded once for all G heads, so every v
//       element is still read once per kv head and the accumulators go to memory (L1) once
//       per run, not once per token.
// A bf16 or fp8 cache is widened once per run and kv head into a float buffer (16 rows), which
// the group's heads then read as float32; a float cache is read in place.

// Scores of query head q against the 8 tokens t0 .. t0 + 7 of a run of n: rows
// K + t * ks, D = 8 NC. Tokens past n read row n - 1 instead (finite values in the run: the
// caller drops those lanes), so nothing outside the run is touched.
template <int NC>
PAGEDRUN_OPS_AVX2_INLINE static inline __m256 dot8_avx2(const float* q, const float* K, long ks,
                                                        int t0, int n) {
    const float* r[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = K + (long)std::min(t0 + i, n - 1) * ks;
    __m256 d[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) d[i] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) d[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(r[i] + 8 * c), d[i]);
    }
    // hadd tree: h0123's lane half k holds the half-k partial sums of d0..d3; the two halves'
    // sum is the 8 dot products in token order.
    const __m256 h01 = _mm256_hadd_ps(d[0], d[1]), h23 = _mm256_hadd_ps(d[2], d[3]);
    const __m256 h45 = _mm256_hadd_ps(d[4], d[5]), h67 = _mm256_hadd_ps(d[6], d[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                         _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// Columns per p.v block for G heads: G x CB accumulators, G broadcast weights and the v vector
// within 16 ymm, and G x CB >= 6 independent FMA chains where that fits (Zen 3: 2 FMA pipes x
// 4-cycle latency want 8).
template <int G, int NC>
constexpr int avx2_col_block() {
    const int cb = G == 1 ? 8 : G == 2 ? 4 : G <= 4 ? 2 : 1;
    return cb < NC ? cb : NC;
}

// One run of n <= 16 tokens (inside one cache block) for G query heads of one kv head, D =
// 8 NC, k rows at K + t * ks and v rows at V + t * vs (float32). decode_run_avx512's steps:
// the run's scores, a new running max per head, accumulator and sum rescaled by
// exp(old - new), then p = exp(score - new max) times the run's v rows.
template <int NC, int G>
PAGEDRUN_OPS_AVX2_TARGET static inline void decode_run_avx2(const float* q, long sq1,
                                                            const float* K, long ks,
                                                            const float* V, long vs, int n,
                                                            float scale, float* acc_mem,
                                                            float* m, float* l) {
    constexpr int D = 8 * NC;
    constexpr int CB = avx2_col_block<G, NC>();
    alignas(32) float p[G][16];
    float correction[G];
    const __m256 vscale = _mm256_set1_ps(scale), neg_inf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    const __m256 valid1 =
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane));
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
        const float* qj = q + j * sq1;
        const __m256 s0 = _mm256_mul_ps(dot8_avx2<NC>(qj, K, ks, 0, n), vscale);
        __m256 s1 = s0, vmax = _mm256_blendv_ps(neg_inf, s0, valid0);
        if (n > 8) {
            s1 = _mm256_mul_ps(dot8_avx2<NC>(qj, K, ks, 8, n), vscale);
            vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(neg_inf, s1, valid1));
        }
        const float run_max = hmax8(vmax);
        const float m_new = run_max > m[j] ? run_max : m[j];
        correction[j] = m[j] == -INFINITY ? 0.0f : expf(m[j] - m_new);
        m[j] = m_new;
        const __m256 vm = _mm256_set1_ps(m_new);
        __m256 psum = _mm256_and_ps(exp_avx2(_mm256_sub_ps(s0, vm)), valid0);
        _mm256_store_ps(p[j], psum);
        if (n > 8) {
            const __m256 p1 = _mm256_and_ps(exp_avx2(_mm256_sub_ps(s1, vm)), valid1);
            _mm256_store_ps(p[j] + 8, p1);
            psum = _mm256_add_ps(psum, p1);
        }
        l[j] = l[j] * correction[j] + hsum8(psum);
    }
    for (int c0 = 0; c0 < NC; c0 += CB) {
        __m256 a[G][CB];
#pragma GCC unroll 8
        for (int j = 0; j < G; ++j) {
            const __m256 cj = _mm256_set1_ps(correction[j]);
#pragma GCC unroll 8
            for (int cb = 0; cb < CB; ++cb)
                a[j][cb] = _mm256_mul_ps(_mm256_loadu_ps(acc_mem + j * D + 8 * (c0 + cb)), cj);
        }
        for (int t = 0; t < n; ++t) {
            const float* vt = V + t * vs + 8 * c0;
            __m256 pt[G];
#pragma GCC unroll 8
            for (int j = 0; j < G; ++j) pt[j] = _mm256_broadcast_ss(&p[j][t]);
#pragma GCC unroll 8
            for (int cb = 0; cb < CB; ++cb) {
                const __m256 vv = _mm256_loadu_ps(vt + 8 * cb);
#pragma GCC unroll 8
                for (int j = 0; j < G; ++j) a[j][cb] = _mm256_fmadd_ps(pt[j], vv, a[j][cb]);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
            for (int cb = 0; cb < CB; ++cb)
                _mm256_storeu_ps(acc_mem + j * D + 8 * (c0 + cb), a[j][cb]);
    }
}

// n rows of a bf16 / fp8 cache (stride in elements) widened into buf [n][8 NC] (exact).
template <int NC, typename C>
PAGEDRUN_OPS_AVX2_INLINE static inline void widen_rows_avx2(const C* rows, long stride, int n,
                                                            float* buf) {
    for (int t = 0; t < n; ++t)
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c)
            _mm256_store_ps(buf + t * 8 * NC + 8 * c, kv_load8(rows + t * stride + 8 * c));
}

// Query heads per pass of decode_run_avx2: its registers do not limit G (see above), but more
// heads per pass mean fewer passes over a run's rows; 8 covers the common groups in one pass.
constexpr int AVX2_HEADS_PER_RUN = 8;

// One sequence, D = 8 NC: decode_seq_avx512's order (runs of up to 16 tokens in context order,
// every kv head within a run, the next run prefetched into L2). state: acc [H][D], m [H], l [H].
template <int NC, typename C>
PAGEDRUN_OPS_AVX2_TARGET static void decode_seq_avx2(const float* q, long sq1,
                                                     const C* k_cache, const C* v_cache,
                                                     long sc0, long sc1, long sc2,
                                                     int block_size, const int32_t* table,
                                                     long first, long context_len, int H,
                                                     int KV, float scale, float* acc,
                                                     float* m, float* l, float* out) {
    constexpr int D = 8 * NC;
    constexpr bool WIDEN = !std::is_same<C, float>::value;
    alignas(32) float kbuf[WIDEN ? 16 * D : 1], vbuf[WIDEN ? 16 * D : 1];
    const int group = H / KV;
    std::fill(acc, acc + (long)H * D, 0.0f);
    std::fill(m, m + H, -INFINITY);
    std::fill(l, l + H, 0.0f);
    for (long t0 = first; t0 < context_len;) {
        const long b = t0 / block_size;
        const int n = (int)std::min(16L, std::min(context_len, (b + 1) * block_size) - t0);
        const long row = (long)table[b] * sc0 + (t0 - b * block_size) * sc1;
        const long t_pf = t0 + PREFETCH_TOKENS;  // see PREFETCH_TOKENS
        if (t_pf < context_len) {
            const long b_pf = t_pf / block_size;
            const long n_pf = std::min(16L, std::min(context_len, (b_pf + 1) * block_size) - t_pf);
            const long row_pf = (long)table[b_pf] * sc0 + (t_pf - b_pf * block_size) * sc1;
            const long span = (n_pf - 1) * sc1 + (KV - 1) * sc2 + D;  // cache elements
            for (long f = 0; f < span; f += 64 / (long)sizeof(C)) {  // one line apart
                _mm_prefetch(reinterpret_cast<const char*>(k_cache + row_pf + f), _MM_HINT_T2);
                _mm_prefetch(reinterpret_cast<const char*>(v_cache + row_pf + f), _MM_HINT_T2);
            }
        }
        for (int kvh = 0; kvh < KV; ++kvh) {
            const C* k_rows = k_cache + row + kvh * sc2;
            const C* v_rows = v_cache + row + kvh * sc2;
            const float* K;
            const float* V;
            long stride;
            if constexpr (WIDEN) {
                widen_rows_avx2<NC>(k_rows, sc1, n, kbuf);
                widen_rows_avx2<NC>(v_rows, sc1, n, vbuf);
                K = kbuf;
                V = vbuf;
                stride = D;
            } else {
                K = k_rows;
                V = v_rows;
                stride = sc1;
            }
            for (int j0 = 0; j0 < group; j0 += AVX2_HEADS_PER_RUN) {
                const int h = kvh * group + j0;
                const float* qh = q + h * sq1;
                float* ah = acc + (long)h * D;
#define PAGEDRUN_HEADS_CASE(G_)                                                              \
    case G_:                                                                                 \
        decode_run_avx2<NC, G_>(qh, sq1, K, stride, V, stride, n, scale, ah, m + h, l + h);  \
        break;
                switch (std::min(AVX2_HEADS_PER_RUN, group - j0)) {
                    PAGEDRUN_HEADS_CASE(1)
                    PAGEDRUN_HEADS_CASE(2)
                    PAGEDRUN_HEADS_CASE(3)
                    PAGEDRUN_HEADS_CASE(4)
                    PAGEDRUN_HEADS_CASE(5)
                    PAGEDRUN_HEADS_CASE(6)
                    PAGEDRUN_HEADS_CASE(7)
                    PAGEDRUN_HEADS_CASE(8)
                    default: break;
                }
#undef PAGEDRUN_HEADS_CASE
            }
        }
        t0 += n;
    }
    // An empty window (sliding_window <= 0): 0 / 0 = NaN, as numpy's softmax.
    for (int h = 0; h < H; ++h) {
        const float inv = first < context_len ? 1.0f / l[h] : NAN;
        for (int d = 0; d < D; ++d) out[(long)h * D + d] = acc[(long)h * D + d] * inv;
    }
}
#endif

// Sequences [s_begin, s_end) of paged_decode_attention (below), on the calling thread.
template <typename C>
static inline void decode_seq_range(int path, const float* q, long sq0, long sq1,
                                    const C* k_cache, const C* v_cache, long sc0,
                                    long sc1, long sc2, int block_size,
                                    const int32_t* block_tables, long ldb,
                                    const int32_t* context_lens, int s_begin, int s_end, int H,
                                    int KV, int D, float scale, int has_window,
                                    long sliding_window, float* out) {
    const int group = H / KV;
    std::vector<float> scratch((size_t)group * (D + 2 + block_size));
    DecodeGroup g;
    g.sq1 = sq1;
    g.group = group;
    g.D = D;
    g.scale = scale;
    g.acc = scratch.data();
    g.m = g.acc + (long)group * D;
    g.l = g.m + group;
    g.scores = g.l + group;
    std::vector<float> acc_all((size_t)H * (D + 2));  // the AVX512 runs' state: acc, m, l
    for (int s = s_begin; s < s_end; ++s) {
        const long context_len = context_lens[s];
        const long first = has_window ? std::max(0L, context_len - sliding_window) : 0;
        const int32_t* table = block_tables + (long)s * ldb;
#if PAGEDRUN_OPS_X86
        if (path == PATH_AVX512 && (D == 32 || D == 64 || D == 128)) {
            const float* qs = q + s * sq0;
            float* os = out + (long)s * H * D;
            float* m = acc_all.data() + (long)H * D;
            float* l = m + H;
            if (D == 32)
                decode_seq_avx512<2, C>(qs, sq1, k_cache, v_cache, sc0, sc1, sc2, block_size, table,
                                        first, context_len, H, KV, scale, acc_all.data(), m, l,
                                        os);
            else if (D == 64)
                decode_seq_avx512<4, C>(qs, sq1, k_cache, v_cache, sc0, sc1, sc2, block_size, table,
                                        first, context_len, H, KV, scale, acc_all.data(), m, l,
                                        os);
            else
                decode_seq_avx512<8, C>(qs, sq1, k_cache, v_cache, sc0, sc1, sc2, block_size, table,
                                        first, context_len, H, KV, scale, acc_all.data(), m, l,
                                        os);
            continue;
        }
        if (path == PATH_AVX2 && (D == 32 || D == 64 || D == 128)) {
            const float* qs = q + s * sq0;
            float* os = out + (long)s * H * D;
            float* m = acc_all.data() + (long)H * D;
            float* l = m + H;
            if (D == 32)
                decode_seq_avx2<4, C>(qs, sq1, k_cache, v_cache, sc0, sc1, sc2, block_size, table,
                                      first, context_len, H, KV, scale, acc_all.data(), m, l, os);
            else if (D == 64)
                decode_seq_avx2<8, C>(qs, sq1, k_cache, v_cache, sc0, sc1, sc2, block_size, table,
                                      first, context_len, H, KV, scale, acc_all.data(), m, l, os);
            else
                decode_seq_avx2<16, C>(qs, sq1, k_cache, v_cache, sc0, sc1, sc2, block_size,
                                       table, first, context_len, H, KV, scale, acc_all.data(),
                                       m, l, os);
            continue;
        }
#endif
        // Other D: per (sequence, kv head), AVX512 blocks with masked tails or scalar ones (the
        // AVX2 path too: head sizes other than 32 / 64 / 128 are rare on the cpu backends).
        for (int kvh = 0; kvh < KV; ++kvh) {
            g.q = q + s * sq0 + (long)kvh * group * sq1;
            std::fill(g.acc, g.acc + (long)group * D, 0.0f);
            std::fill(g.m, g.m + group, -INFINITY);
            std::fill(g.l, g.l + group, 0.0f);
            for (long t0 = first; t0 < context_len;) {
                const long b = t0 / block_size;
                const long t1 = std::min(context_len, (b + 1) * block_size);
                const long row = (long)table[b] * sc0 + (t0 - b * block_size) * sc1 + kvh * sc2;
#if PAGEDRUN_OPS_X86
                if (path == PATH_AVX512)
                    decode_block_avx512(g, k_cache + row, v_cache + row, sc1, (int)(t1 - t0));
                else
#endif
                    decode_block_scalar(g, k_cache + row, v_cache + row, sc1, (int)(t1 - t0));
                t0 = t1;
            }
            for (int j = 0; j < group; ++j) {
                // An empty window (sliding_window <= 0): 0 / 0 = NaN, as numpy's softmax.
                const float inv = first < context_len ? 1.0f / g.l[j] : NAN;
                float* o = out + ((long)s * H + (long)kvh * group + j) * D;
                const float* aj = g.acc + (long)j * D;
                for (int d = 0; d < D; ++d) o[d] = aj[d] * inv;
            }
        }
    }
}

// Below this many multiply-adds (q.k and p.v over every visible position and head) one
// thread does it all. Chosen when the second thread was a spawn per call (~30-50 us; a batch of
// short contexts is a few hundred microseconds: 32 sequences x 64 positions x 9 heads x 64 x 2,
// 2.4 M); the shared helper's polled hand-off costs ~1 us, so a lower threshold may pay now
// (not measured yet: kept as it was, 2026-12-07). Long contexts are bound by reading the KV
// blocks, which two cores do faster than one.
constexpr long DECODE_SPLIT_MIN_MACS = 8L << 20;

// paged_decode_attention's two halves for cpu_thread_pool.h's run_pair: sequences [0, split)
// (part 0, the caller) and [split, S) (part 1, the helper).
template <typename C>
struct DecodeAttentionSplit {
    int path;
    const float* q;
    long sq0, sq1;
    const C* k_cache;
    const C* v_cache;
    long sc0, sc1, sc2;
    int block_size;
    const int32_t* block_tables;
    long ldb;
    const int32_t* context_lens;
    int split, S, H, KV, D;
    float scale;
    int has_window;
    long sliding_window;
    float* out;

    static void part(const void* ctx, int which) {
        const DecodeAttentionSplit& a = *static_cast<const DecodeAttentionSplit*>(ctx);
        const int begin = which == 0 ? 0 : a.split, end = which == 0 ? a.split : a.S;
        decode_seq_range(a.path, a.q, a.sq0, a.sq1, a.k_cache, a.v_cache, a.sc0, a.sc1, a.sc2,
                         a.block_size, a.block_tables, a.ldb, a.context_lens, begin, end, a.H,
                         a.KV, a.D, a.scale, a.has_window, a.sliding_window, a.out);
    }
};

// has_window 0: every position [0, context_len) is visible. Sequences are split over two
// threads (the caller and the process's helper, cpu_thread_pool.h) at the half of the total
// visible context when the work is large enough; each thread writes only its sequences' rows
// of out.
template <typename C>
static inline void paged_decode_attention(int path, const float* q, long sq0, long sq1,
                                          const C* k_cache, const C* v_cache, long sc0,
                                          long sc1, long sc2, int block_size,
                                          const int32_t* block_tables, long ldb,
                                          const int32_t* context_lens, int S, int H, int KV,
                                          int D, float scale, int has_window,
                                          long sliding_window, float* out) {
    long total = 0;
    for (int s = 0; s < S; ++s) {
        const long len = context_lens[s];
        total += has_window ? std::min(len, std::max(0L, sliding_window)) : len;
    }
    int split = S;
    if (S >= 2 && total * H * D * 2 >= DECODE_SPLIT_MIN_MACS) {
        long running = 0;
        for (split = 0; split < S - 1 && running * 2 < total; ++split) {
            const long len = context_lens[split];
            running += has_window ? std::min(len, std::max(0L, sliding_window)) : len;
        }
    }
    if (split >= S || split <= 0) {
        decode_seq_range(path, q, sq0, sq1, k_cache, v_cache, sc0, sc1, sc2, block_size,
                         block_tables, ldb, context_lens, 0, S, H, KV, D, scale, has_window,
                         sliding_window, out);
        return;
    }
    const DecodeAttentionSplit<C> job{path, q, sq0, sq1, k_cache, v_cache, sc0, sc1, sc2,
                                      block_size, block_tables, ldb, context_lens, split, S, H,
                                      KV, D, scale, has_window, sliding_window, out};
    pagedrun_threads::run_pair(DecodeAttentionSplit<C>::part, &job);
}

// What pyx/cpu_decode_step.h calls, as one table that pagedrun.pyx.cpu_ops exports (cpu_ops.pxd)
// and cpu_decode_step binds at import: these kernels are compiled once, in cpu_ops (see
// cpu_gemm_kernels.h's GemmTable: the same reason, the same bits).
template <typename C>
struct CacheKernels {  // the kernels templated on the KV cache element C
    decltype(&rotary_cache_write<C>) rotary;   // rotary_cache_write<C>
    decltype(&decode_seq_range<C>) attention;  // decode_seq_range<C>
};

struct OpsTable {
    void (*rms_norm_rows)(int path, const float* x, long ldx, const float* w, int rows,
                          int hidden, float eps, float* out, long ldo);
    void (*fused_add_rms_norm_rows)(int path, const float* x, long ldx, const float* res,
                                    long ldr, const float* w, int rows, int hidden, float eps,
                                    float* out, long ldo, float* new_res, long ldn);
    void (*act_and_mul_rows)(int path, int kind, const float* gate_up, long ldg, int rows,
                             int inter, float* out, long ldo);
    CacheKernels<float> f32;
    CacheKernels<uint16_t> bf16;  // bf16 bits
    CacheKernels<uint8_t> fp8;    // fp8 e4m3 bits

    template <typename C>
    const CacheKernels<C>& for_cache() const {
        if constexpr (std::is_same_v<C, float>) return f32;
        else if constexpr (std::is_same_v<C, uint16_t>) return bf16;
        else return fp8;
    }
};

static inline const OpsTable* ops_table() {
    static const OpsTable table = {
        rms_norm_rows, fused_add_rms_norm_rows, act_and_mul_rows,
        {rotary_cache_write<float>, decode_seq_range<float>},
        {rotary_cache_write<uint16_t>, decode_seq_range<uint16_t>},
        {rotary_cache_write<uint8_t>, decode_seq_range<uint8_t>},
    };
    return &table;
}

}  // namespace pagedrun_ops
