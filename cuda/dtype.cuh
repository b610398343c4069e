// dtype.cuh -- the element-type conversions every kernel shares: widen a stored element
// (float, __half, __nv_bfloat16) to float for arithmetic, and narrow a float result back to
// the stored type with round-to-nearest-even (one value, or a pair packed into a b32: pack2). fp8.cuh (included at the end) adds the fp8 e4m3
// KV cache element and the to_cache / cache_to_f32 pair of cache-typed kernels. Included by
// common.cuh after the half/bfloat16 types exist (toolkit headers under nvcc/NVRTC,
// cuda/sim/fp16.cuh under the CPU harness), so a kernel file never includes it itself.
//
// Global namespace on purpose: kernel files call `to_f32(x)` / `from_f32<T>(v)` unqualified
// from inside their own namespaces, and several kernel files share one translation unit (the
// loader #includes them together), which #pragma once keeps to a single definition.
#pragma once

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename O> __device__ __forceinline__ O from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Two floats -> one b32 of two 16-bit T (round to nearest even), the lower-indexed element in
// the low half: the mma fragment order and the memory order of a 2-element store.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
           (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

#include "fp8.cuh"
