// embedding.cu -- gather of embedding rows: out[t] = table[token_ids[t]].
//
// Pointers (T = float | __half | __nv_bfloat16; contiguous):
//   token_ids  [num_tokens]        int32, each in [0, vocab) (the wrapper checks host ids;
//                                  an id out of range here writes a NaN row, never reads OOB)
//   table      [vocab, hidden]     T
//   out        [num_tokens, hidden] T
//
// Launch geometry: grid (num_tokens), block 256; each thread copies a strided slice of the
// row (a pure copy: coalesced along hidden):
//   embedding_DT            in 16-byte units: needs hidden * sizeof(T) % 16 == 0 and table,
//                           out on 16-byte boundaries (then every row is; the wrapper checks).
//                           A row of a 4096-wide bf16 table is 2 units per thread, where one
//                           element per thread moved 2 bytes a load (8 KiB in flight per SM).
//   embedding_DT_unaligned  element by element: any width and address.
// Instantiations: embedding_{f32,f16,bf16}{,_unaligned}. Scalars: int hidden, int vocab.
// Signature: (out, token_ids, table, hidden, vocab). Launched by runtime/kernels/fused_ops.py:
// embedding.
//
// Register budget: 32 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace embedding_ops {

constexpr int kThreads = 256;

template <typename T> __device__ __forceinline__ T nan_value();
template <> __device__ __forceinline__ float nan_value<float>() { return __uint_as_float(0x7fc00000u); }
template <> __device__ __forceinline__ __half nan_value<__half>() { return __ushort_as_half(0x7e00); }
template <> __device__ __forceinline__ __nv_bfloat16 nan_value<__nv_bfloat16>() {
    return __ushort_as_bfloat16(0x7fc0);
}

// 16 bytes of T, copied as one unit (byte-wise under the harness: no punning of T).
struct alignas(16) Unit {
    unsigned char bytes[16];
};

template <typename T>
__device__ __forceinline__ void embedding_units(T* out, const int* token_ids, const T* table,
                                                int hidden, int vocab) {
    constexpr int kElems = sizeof(Unit) / sizeof(T);
    const int token = token_ids[blockIdx.x];
    T* dst = out + static_cast<long long>(blockIdx.x) * hidden;
    if (token < 0 || token >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += kThreads) dst[i] = nan_value<T>();
        return;
    }
    const Unit* src = reinterpret_cast<const Unit*>(table + static_cast<long long>(token) * hidden);
    Unit* dst_units = reinterpret_cast<Unit*>(dst);
    for (int i = threadIdx.x; i < hidden / kElems; i += kThreads) dst_units[i] = src[i];
}

template <typename T>
__device__ __forceinline__ void embedding(T* out, const int* token_ids, const T* table,
                                          int hidden, int vocab) {
    const int token = token_ids[blockIdx.x];
    T* dst = out + static_cast<long long>(blockIdx.x) * hidden;
    if (token < 0 || token >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += kThreads) dst[i] = nan_value<T>();
        return;
    }
    const T* src = table + static_cast<long long>(token) * hidden;
    for (int i = threadIdx.x; i < hidden; i += kThreads) dst[i] = src[i];
}

}  // namespace embedding_ops

#define PAGEDRUN_EMBEDDING(DT, T)                                                                \
    extern "C" __global__ void __launch_bounds__(embedding_ops::kThreads)                        \
        embedding_##DT(T* out, const int* token_ids, const T* table, int hidden, int vocab) {   \
        embedding_ops::embedding_units<T>(out, token_ids, table, hidden, vocab);                 \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(embedding_ops::kThreads)                        \
        embedding_##DT##_unaligned(T* out, const int* token_ids, const T* table, int hidden,    \
                                   int vocab) {                                                  \
        embedding_ops::embedding<T>(out, token_ids, table, hidden, vocab);                       \
    }

PAGEDRUN_EMBEDDING(f32, float)
PAGEDRUN_EMBEDDING(f16, __half)
PAGEDRUN_EMBEDDING(bf16, __nv_bfloat16)
