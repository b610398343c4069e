// fp8.cuh -- OCP fp8 e4m3 (1 sign bit, 4 exponent bits biased by 7, 3 mantissa bits,
// subnormals, no infinities, S.1111.111 NaN, largest finite 448): the element type of an fp8
// KV cache (EngineConfig.kv_cache_dtype "fp8"), held as uint8_t bits. Included by dtype.cuh.
//
//   fp8_e4m3_from_f32(x): round to nearest, ties to even, saturating to +-448 (infinities too),
//     NaN -> 0x7F with its sign, the sign of -0 and of values that round to 0 kept: NVIDIA's
//     __NV_SATFINITE conversion, the one vLLM's fp8 cache writes with its default scale 1.0.
//     The same integer steps as runtime/backends/numpy_ops.py's to_fp8_e4m3_bits, so the two
//     agree bit for bit (tests/kernels/test_fp8_kv_kernels.py checks it on the harness).
//   fp8_e4m3_to_f32(bits): the exact value (every e4m3 value is a float32, and an f16 / bf16).
//
// Portable bit manipulation on every compiler (no cuda_fp8.h intrinsics): the same code runs
// under the CPU harness and on the GPU, so the harness proves what the GPU computes. No float
// denormals are formed on the way (safe under flush-to-zero).
//
// to_cache<CacheT>(x) / cache_to_f32(c): a KV cache element from / to an activation value, for
// kernels whose cache type CacheT is either the activation type T (stored as it is) or uint8_t
// (e4m3 bits of to_f32(x): an f16 / bf16 activation is rounded once to T first, then to e4m3,
// as vLLM writes a 16-bit k / v into its fp8 cache).
#pragma once

__device__ __forceinline__ uint8_t fp8_e4m3_from_f32(float x) {
    const uint32_t bits = __float_as_uint(x);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t mag = bits & 0x7FFFFFFFu;
    uint32_t code;
    if (mag > 0x7F800000u) {
        code = 0x7Fu;  // NaN
    } else if (mag >= 0x3C800000u) {
        // |x| >= 2^-6, an e4m3 normal: RNE of the 23-bit mantissa to 3 bits (a carry bumps the
        // exponent), exponent rebiased 127 -> 7 (120 << 3 off the 8-bit field), saturated at
        // 0x7E (448). mag <= 0x7F800000, so the sum cannot overflow.
        code = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
        code = min(code - (120u << 3), 0x7Eu);
    } else {
        // Below 2^-6: multiples of 2^-9. |x| * 512 is exact and __float2int_rn rounds half to
        // even (a float32 denormal input gives 0 either way).
        code = static_cast<uint32_t>(__float2int_rn(__uint_as_float(mag) * 512.0f));
    }
    return static_cast<uint8_t>(code | sign);
}

__device__ __forceinline__ float fp8_e4m3_to_f32(uint8_t bits) {
    const uint32_t mag = bits & 0x7Fu;
    // Exponent field >= 1: the fields move into float32's (mantissa << 20) and the exponent is
    // rebiased 7 -> 127. Field 0: m * 2^-9 (m < 8 is exact as a float).
    float v = (mag >= 8u) ? __uint_as_float((mag << 20) + (120u << 23))
                          : static_cast<float>(mag) * 0.001953125f;
    if (mag == 0x7Fu) v = CUDART_NAN_F;
    return __uint_as_float(__float_as_uint(v) | ((bits & 0x80u) << 24));
}

// Element i (0..3, memory order) of four e4m3 codes loaded as one little-endian word.
__device__ __forceinline__ float fp8_e4m3_word_to_f32(uint32_t word, int i) {
    return fp8_e4m3_to_f32(static_cast<uint8_t>(word >> (8 * i)));
}

// A cache element from an activation value: as it is (CacheT == T), or e4m3 bits.
template <typename CacheT, typename T>
__device__ __forceinline__ CacheT to_cache(T x) {
    if constexpr (sizeof(CacheT) == 1) {
        return fp8_e4m3_from_f32(to_f32(x));
    } else {
        return x;
    }
}

__device__ __forceinline__ float cache_to_f32(uint8_t c) { return fp8_e4m3_to_f32(c); }
__device__ __forceinline__ float cache_to_f32(float c) { return c; }
__device__ __forceinline__ float cache_to_f32(__half c) { return __half2float(c); }
__device__ __forceinline__ float cache_to_f32(__nv_bfloat16 c) { return __bfloat162float(c); }
