// fp16.cuh -- __half / __nv_bfloat16 (and their 2-wide forms) for the CPU harness: storage as
// the raw 16 bits, conversions from float rounded to nearest even (NaN stays NaN, overflow
// goes to infinity), arithmetic through float with one rounding per operation as on sm_80+.
// Covers the subset of cuda_fp16.h / cuda_bf16.h listed in docs/kernels.md.
#pragma once

namespace pagedrun_sim {

inline uint16_t f32_to_f16_bits(float f) {
    uint32_t x = std::bit_cast<uint32_t>(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return uint16_t(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (a < 0x38800000u) {                                   // below 2^-14: subnormal or 0
        int e = int(a >> 23);
        if (e < 102) return uint16_t(sign);
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        int s = 126 - e;
        uint32_t r = m >> s, rem = m & ((1u << s) - 1), half = 1u << (s - 1);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return uint16_t(sign | r);
    }
    uint32_t r = ((((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13));
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
    return uint16_t(sign | r);
}

inline float f16_bits_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        if (m == 0) return std::bit_cast<float>(sign);
        float v = std::ldexp(float(m), -24);
        return sign ? -v : v;
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    return std::bit_cast<float>(bits);
}

inline uint16_t f32_to_bf16_bits(float f) {
    uint32_t x = std::bit_cast<uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return uint16_t(x >> 16);
}

inline float bf16_bits_to_f32(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

}  // namespace pagedrun_sim

struct __attribute__((aligned(2))) __half {
    uint16_t __x;
    __half() = default;
    __half(float f) : __x(::pagedrun_sim::f32_to_f16_bits(f)) {}
    __half(double f) : __half(float(f)) {}
    __half(int i) : __half(float(i)) {}
    operator float() const { return ::pagedrun_sim::f16_bits_to_f32(__x); }
};
struct __attribute__((aligned(2))) __nv_bfloat16 {
    uint16_t __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(::pagedrun_sim::f32_to_bf16_bits(f)) {}
    __nv_bfloat16(double f) : __nv_bfloat16(float(f)) {}
    __nv_bfloat16(int i) : __nv_bfloat16(float(i)) {}
    operator float() const { return ::pagedrun_sim::bf16_bits_to_f32(__x); }
};
struct __attribute__((aligned(4))) __half2 { __half x, y; };
struct __attribute__((aligned(4))) __nv_bfloat162 { __nv_bfloat16 x, y; };
using half = __half;
using half2 = __half2;
using nv_bfloat16 = __nv_bfloat16;
using nv_bfloat162 = __nv_bfloat162;

#define PAGEDRUN_SIM_HALF_OPS(H)                                                           \
    inline H operator+(H a, H b) { return H(float(a) + float(b)); }                       \
    inline H operator-(H a, H b) { return H(float(a) - float(b)); }                       \
    inline H operator*(H a, H b) { return H(float(a) * float(b)); }                       \
    inline H operator/(H a, H b) { return H(float(a) / float(b)); }                       \
    inline H operator-(H a) { H r = a; r.__x ^= 0x8000u; return r; }                      \
    inline H& operator+=(H& a, H b) { return a = a + b; }                                 \
    inline H& operator-=(H& a, H b) { return a = a - b; }                                 \
    inline H& operator*=(H& a, H b) { return a = a * b; }                                 \
    inline bool operator==(H a, H b) { return float(a) == float(b); }                     \
    inline bool operator!=(H a, H b) { return float(a) != float(b); }                     \
    inline bool operator<(H a, H b) { return float(a) < float(b); }                       \
    inline bool operator>(H a, H b) { return float(a) > float(b); }                       \
    inline bool operator<=(H a, H b) { return float(a) <= float(b); }                     \
    inline bool operator>=(H a, H b) { return float(a) >= float(b); }
PAGEDRUN_SIM_HALF_OPS(__half)
PAGEDRUN_SIM_HALF_OPS(__nv_bfloat16)
#undef PAGEDRUN_SIM_HALF_OPS

// conversions
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __half2 __float22half2_rn(float2 v) { return {__half(v.x), __half(v.y)}; }
inline __half2 __float2half2_rn(float a) { return {__half(a), __half(a)}; }
inline float2 __half22float2(__half2 v) { return {float(v.x), float(v.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return {__nv_bfloat16(v.x), __nv_bfloat16(v.y)}; }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return {__nv_bfloat16(a), __nv_bfloat16(a)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline __half2 __half2half2(__half a) { return {a, a}; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return {a, a}; }
inline __half __low2half(__half2 v) { return v.x; }
inline __half __high2half(__half2 v) { return v.y; }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }
inline float __low2float(__half2 v) { return float(v.x); }
inline float __high2float(__half2 v) { return float(v.y); }
inline float __low2float(__nv_bfloat162 v) { return float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return float(v.y); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }

// arithmetic (one rounding per operation; fma rounds once)
#define PAGEDRUN_SIM_HALF_FNS(H, H2)                                                        \
    inline H __hadd(H a, H b) { return a + b; }                                            \
    inline H __hsub(H a, H b) { return a - b; }                                            \
    inline H __hmul(H a, H b) { return a * b; }                                            \
    inline H __hdiv(H a, H b) { return a / b; }                                            \
    inline H __hneg(H a) { return -a; }                                                    \
    inline H __habs(H a) { H r = a; r.__x &= 0x7fffu; return r; }                          \
    inline H __hfma(H a, H b, H c) { return H(std::fma(float(a), float(b), float(c))); }   \
    inline H __hmax(H a, H b) { return H(std::fmax(float(a), float(b))); }                 \
    inline H __hmin(H a, H b) { return H(std::fmin(float(a), float(b))); }                 \
    inline bool __hisnan(H a) { return std::isnan(float(a)); }                             \
    inline H2 __hadd2(H2 a, H2 b) { return {a.x + b.x, a.y + b.y}; }                       \
    inline H2 __hsub2(H2 a, H2 b) { return {a.x - b.x, a.y - b.y}; }                       \
    inline H2 __hmul2(H2 a, H2 b) { return {a.x * b.x, a.y * b.y}; }                       \
    inline H2 __hfma2(H2 a, H2 b, H2 c) { return {__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; } \
    inline H2 __hmax2(H2 a, H2 b) { return {__hmax(a.x, b.x), __hmax(a.y, b.y)}; }         \
    inline H2 __hmin2(H2 a, H2 b) { return {__hmin(a.x, b.x), __hmin(a.y, b.y)}; }         \
    inline H2 operator+(H2 a, H2 b) { return __hadd2(a, b); }                              \
    inline H2 operator-(H2 a, H2 b) { return __hsub2(a, b); }                              \
    inline H2 operator*(H2 a, H2 b) { return __hmul2(a, b); }                              \
    inline H hexp(H a) { return H(std::exp(float(a))); }                                   \
    inline H hsqrt(H a) { return H(std::sqrt(float(a))); }                                 \
    inline H __ldg(const H* p) { return *p; }                                              \
    inline H2 __ldg(const H2* p) { return *p; }
PAGEDRUN_SIM_HALF_FNS(__half, __half2)
PAGEDRUN_SIM_HALF_FNS(__nv_bfloat16, __nv_bfloat162)
#undef PAGEDRUN_SIM_HALF_FNS

#define CUDART_INF_F (std::numeric_limits<float>::infinity())
#define CUDART_NAN_F (std::numeric_limits<float>::quiet_NaN())
