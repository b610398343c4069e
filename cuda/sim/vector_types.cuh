// vector_types.cuh -- CUDA's built-in vector types for the CPU harness, with the device
// alignments (float4/int4/uint4 16 bytes, the 2-wide ones 8), so UBSan reports a misaligned
// vector load exactly as the hardware would fault on it.
#pragma once

#define PAGEDRUN_SIM_VEC2(T, N, A)                                      \
    struct __attribute__((aligned(A))) N { T x, y; };                   \
    inline N make_##N(T x, T y) { return N{x, y}; }
#define PAGEDRUN_SIM_VEC3(T, N)                                         \
    struct N { T x, y, z; };                                            \
    inline N make_##N(T x, T y, T z) { return N{x, y, z}; }
#define PAGEDRUN_SIM_VEC4(T, N, A)                                      \
    struct __attribute__((aligned(A))) N { T x, y, z, w; };             \
    inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }

PAGEDRUN_SIM_VEC2(float, float2, 8)
PAGEDRUN_SIM_VEC3(float, float3)
PAGEDRUN_SIM_VEC4(float, float4, 16)
PAGEDRUN_SIM_VEC2(int, int2, 8)
PAGEDRUN_SIM_VEC3(int, int3)
PAGEDRUN_SIM_VEC4(int, int4, 16)
PAGEDRUN_SIM_VEC2(unsigned int, uint2, 8)
PAGEDRUN_SIM_VEC4(unsigned int, uint4, 16)
PAGEDRUN_SIM_VEC2(double, double2, 16)
PAGEDRUN_SIM_VEC2(short, short2, 4)
PAGEDRUN_SIM_VEC2(unsigned short, ushort2, 4)
PAGEDRUN_SIM_VEC4(signed char, char4, 4)
PAGEDRUN_SIM_VEC4(unsigned char, uchar4, 4)
PAGEDRUN_SIM_VEC2(long long, longlong2, 16)
PAGEDRUN_SIM_VEC2(unsigned long long, ulonglong2, 16)

inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }

#undef PAGEDRUN_SIM_VEC2
#undef PAGEDRUN_SIM_VEC3
#undef PAGEDRUN_SIM_VEC4
