// rotary_cache_write.cu -- rotary position embedding of q and k, fused with the write of the
// rotated k and the raw v into the paged KV cache.
//
// Computes, for every token t (position p = positions[t]) and every head, with the HF
// rotate_half ("neox") pairing (i, i + head_dim / 2), c = cos_sin_cache[p, i],
// s = cos_sin_cache[p, head_dim / 2 + i]:
//   out[i]            = x[i] * c - x[i + half] * s
//   out[i + half]     = x[i + half] * c + x[i] * s
// for x = q (-> q_out) and x = k (-> k_out); then, if slot = slot_mapping[t] >= 0, writes
// k_out[t] and v[t] to cache slot `slot` (block slot / block_size, offset slot % block_size).
// A negative slot is padding: q/k are still rotated, nothing is written to the cache.
// Rope scaling (Llama 3, linear) lives entirely in the table: the kernel only reads cos/sin.
// The table is runtime/rope.py's build_cos_sin_cache(rope_inv_freq(...), max_position) (float64
// angles, rounded once to fp32): the model builds it in runtime/models/llama.py, the kernel
// tests through runtime/backends/numpy_ops.py, which re-exports the same functions.
//
// Pointers (T = float | __half | __nv_bfloat16 per instantiation):
//   q             [num_tokens, num_heads, head_dim]     T, token stride q_token_stride
//                 elements, heads and dims contiguous (q may be a slice of a fused qkv row)
//   k, v          [num_tokens, num_kv_heads, head_dim]  T, token strides k_/v_token_stride
//   positions     [num_tokens]                           int32, in [0, max_position)
//   cos_sin_cache [max_position, head_dim]               fp32 (first half cos, second half sin)
//   slot_mapping  [num_tokens]                           int32, negative = padding
//   q_out         [num_tokens, num_heads, head_dim]      T contiguous (may be q itself when
//                 q is contiguous: each element is read and written by the same thread)
//   k_out         [num_tokens, num_kv_heads, head_dim]   T contiguous (may be k itself)
//   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]  CacheT (NHD); a
//                 slot's num_kv_heads * head_dim elements are contiguous, so the write is one
//                 run. CacheT is T, or uint8_t for an fp8 cache (kv_cache_dtype "fp8"): the
//                 rotated k (already rounded to T, as k_out) and v are stored as fp8 e4m3 bits
//                 (cuda/fp8.cuh: RNE, saturated to +-448, scale 1.0).
//
// Launch geometry: grid (num_tokens), block 128, no shared memory. Math in fp32, one rounding
// to T at each store.
// Instantiations: rotary_cache_write_f32, rotary_cache_write_f16, rotary_cache_write_bf16
// (CacheT == T) and rotary_cache_write_{f32,f16,bf16}_kv_fp8 (uint8_t e4m3 caches); any even
// head_dim. Scalars: int num_heads, num_kv_heads, head_dim; long long
// q_token_stride, k_token_stride, v_token_stride. No block_size: a slot index already is
// block * block_size + offset, and NHD makes slot * num_kv_heads * head_dim its row.
// Signature: (q_out, k_out, k_cache, v_cache, q, k, v, positions, cos_sin_cache, slot_mapping,
// num_heads, num_kv_heads, head_dim, q_token_stride, k_token_stride, v_token_stride).
// Launched by runtime/kernels/cache_ops.py: rotary_embedding_and_cache_write.
//
// Register budget: 64 per thread at 128 threads; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace rotary {

constexpr int kThreads = 128;

// Rotates the (i, i + half) pairs of `num_heads` rows of one token; writes them to `dst` and,
// when `cache_row` is not null, to the cache row as well (the value stored to dst, converted
// to the cache's element type).
template <typename T, typename CacheT>
__device__ __forceinline__ void rotate_heads(T* dst, CacheT* cache_row, const T* src, int num_heads,
                                             int head_dim, const float* cos_row) {
    const int half = head_dim / 2;
    const float* sin_row = cos_row + half;
    for (int item = threadIdx.x; item < num_heads * half; item += kThreads) {
        const int head = item / half;
        const int i = item % half;
        const int lo = head * head_dim + i;
        const int hi = lo + half;
        const float x1 = to_f32(src[lo]);
        const float x2 = to_f32(src[hi]);
        const float c = cos_row[i];
        const float s = sin_row[i];
        const T out_lo = from_f32<T>(x1 * c - x2 * s);
        const T out_hi = from_f32<T>(x2 * c + x1 * s);
        dst[lo] = out_lo;
        dst[hi] = out_hi;
        if (cache_row != nullptr) {
            cache_row[lo] = to_cache<CacheT>(out_lo);
            cache_row[hi] = to_cache<CacheT>(out_hi);
        }
    }
}

template <typename T, typename CacheT>
__device__ __forceinline__ void rotary_cache_write(
    T* q_out, T* k_out, CacheT* k_cache, CacheT* v_cache, const T* q, const T* k, const T* v,
    const int* __restrict__ positions, const float* __restrict__ cos_sin_cache,
    const int* __restrict__ slot_mapping, int num_heads, int num_kv_heads, int head_dim,
    long long q_token_stride, long long k_token_stride, long long v_token_stride) {
    const int token = blockIdx.x;
    const float* cos_row = cos_sin_cache + static_cast<long long>(positions[token]) * head_dim;
    const int slot = slot_mapping[token];
    const long long kv_row_elems = static_cast<long long>(num_kv_heads) * head_dim;
    CacheT* k_cache_row = (slot >= 0) ? k_cache + slot * kv_row_elems : nullptr;

    rotate_heads<T, CacheT>(q_out + token * static_cast<long long>(num_heads) * head_dim,
                            static_cast<CacheT*>(nullptr), q + token * q_token_stride,
                            num_heads, head_dim, cos_row);
    rotate_heads<T, CacheT>(k_out + token * kv_row_elems, k_cache_row,
                            k + token * k_token_stride, num_kv_heads, head_dim, cos_row);
    if (slot >= 0) {
        CacheT* v_cache_row = v_cache + slot * kv_row_elems;
        const T* v_row = v + token * v_token_stride;
        for (int e = threadIdx.x; e < kv_row_elems; e += kThreads)
            v_cache_row[e] = to_cache<CacheT>(v_row[e]);
    }
}

}  // namespace rotary

#define PAGEDRUN_ROTARY_KERNEL(DT, T, CacheT)                                                   \
    extern "C" __global__ void __launch_bounds__(rotary::kThreads) rotary_cache_write_##DT(     \
        T* q_out, T* k_out, CacheT* k_cache, CacheT* v_cache, const T* q, const T* k,           \
        const T* v, const int* positions, const float* cos_sin_cache, const int* slot_mapping,  \
        int num_heads, int num_kv_heads, int head_dim, long long q_token_stride,                \
        long long k_token_stride, long long v_token_stride) {                                   \
        rotary::rotary_cache_write<T, CacheT>(q_out, k_out, k_cache, v_cache, q, k, v,          \
                                              positions, cos_sin_cache, slot_mapping, num_heads, \
                                              num_kv_heads, head_dim, q_token_stride,           \
                                              k_token_stride, v_token_stride);                  \
    }

PAGEDRUN_ROTARY_KERNEL(f32, float, float)
PAGEDRUN_ROTARY_KERNEL(f16, __half, __half)
PAGEDRUN_ROTARY_KERNEL(bf16, __nv_bfloat16, __nv_bfloat16)
PAGEDRUN_ROTARY_KERNEL(f32_kv_fp8, float, uint8_t)
PAGEDRUN_ROTARY_KERNEL(f16_kv_fp8, __half, uint8_t)
PAGEDRUN_ROTARY_KERNEL(bf16_kv_fp8, __nv_bfloat16, uint8_t)
