// activation.cu -- SiLU-gated product of the Llama MLP: out = silu(gate) * up.
//
// Computes, per token row t and column j < intermediate:
//   out[t, j] = g / (1 + exp(-g)) * u,   g = gate_up[t, j], u = gate_up[t, intermediate + j]
// in fp32 (exp overflow for very negative g gives 0, as in numpy), one rounding to T.
//
// Pointers (T = float | __half | __nv_bfloat16; contiguous):
//   gate_up  [num_tokens, 2 * intermediate]  T   (first half gate, second half up: the fused
//                                                  gate/up GEMM's output)
//   out      [num_tokens, intermediate]      T
//
// Launch geometry: grid (num_tokens, ceil(intermediate / 256)), block 256; one element per
// thread (the op is a pure stream; accesses are coalesced along j).
// Instantiations: silu_and_mul_{f32,f16,bf16}. Scalars: int intermediate.
// Signature: (out, gate_up, intermediate). Launched by runtime/kernels/fused_ops.py:
// silu_and_mul.
//
// Register budget: 32 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace activation_ops {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void silu_and_mul(T* out, const T* gate_up, int intermediate) {
    const int j = blockIdx.y * kThreads + threadIdx.x;
    if (j >= intermediate) return;
    const long long in_row = static_cast<long long>(blockIdx.x) * 2 * intermediate;
    const float g = to_f32(gate_up[in_row + j]);
    const float u = to_f32(gate_up[in_row + intermediate + j]);
    const float silu = g / (1.f + expf(-g));
    out[static_cast<long long>(blockIdx.x) * intermediate + j] = from_f32<T>(silu * u);
}

}  // namespace activation_ops

#define PAGEDRUN_SILU_AND_MUL(DT, T)                                                             \
    extern "C" __global__ void __launch_bounds__(activation_ops::kThreads)                       \
        silu_and_mul_##DT(T* out, const T* gate_up, int intermediate) {                         \
        activation_ops::silu_and_mul<T>(out, gate_up, intermediate);                             \
    }

PAGEDRUN_SILU_AND_MUL(f32, float)
PAGEDRUN_SILU_AND_MUL(f16, __half)
PAGEDRUN_SILU_AND_MUL(bf16, __nv_bfloat16)
