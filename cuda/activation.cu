// activation.cu -- gated products of the MLP: out = act(gate) * up, act = SiLU (Llama's SwiGLU)
// or tanh-approximated GELU (Gemma's GeGLU, PyTorch's gelu(approximate="tanh")).
//
// Computes, per token row t and column j < intermediate, g = gate_up[t, j],
// u = gate_up[t, intermediate + j]:
//   silu_and_mul:      out[t, j] = g / (1 + exp(-g)) * u
//   gelu_tanh_and_mul: out[t, j] = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u
// in fp32 (exp overflow for very negative g gives 0, as in numpy; tanh saturates to +-1), one
// rounding to T.
//
// Pointers (T = float | __half | __nv_bfloat16; contiguous):
//   gate_up  [num_tokens, 2 * intermediate]  T   (first half gate, second half up: the fused
//                                                  gate/up GEMM's output)
//   out      [num_tokens, intermediate]      T
//
// Launch geometry: grid (num_tokens, ceil(intermediate / 256)), block 256; one element per
// thread (the op is a pure stream; accesses are coalesced along j).
// Instantiations: silu_and_mul_{f32,f16,bf16}, gelu_tanh_and_mul_{f32,f16,bf16}.
// Scalars: int intermediate. Signature: (out, gate_up, intermediate). Launched by
// runtime/kernels/fused_ops.py: silu_and_mul, gelu_tanh_and_mul.
//
// Register budget: 32 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace activation_ops {

constexpr int kThreads = 256;
// The tanh approximation of GELU: sqrt(2 / pi) and the cubic coefficient.
constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

struct Silu {
    __device__ __forceinline__ float operator()(float g) const { return g / (1.f + expf(-g)); }
};

struct GeluTanh {
    __device__ __forceinline__ float operator()(float g) const {
        const float inner = kGeluSqrt2OverPi * (g + kGeluCubic * g * g * g);
        return 0.5f * g * (1.f + tanhf(inner));
    }
};

template <typename T, typename Act>
__device__ __forceinline__ void act_and_mul(T* out, const T* gate_up, int intermediate) {
    const int j = blockIdx.y * kThreads + threadIdx.x;
    if (j >= intermediate) return;
    const long long in_row = static_cast<long long>(blockIdx.x) * 2 * intermediate;
    const float g = to_f32(gate_up[in_row + j]);
    const float u = to_f32(gate_up[in_row + intermediate + j]);
    out[static_cast<long long>(blockIdx.x) * intermediate + j] = from_f32<T>(Act()(g) * u);
}

}  // namespace activation_ops

#define PAGEDRUN_ACT_AND_MUL(NAME, ACT, DT, T)                                                   \
    extern "C" __global__ void __launch_bounds__(activation_ops::kThreads)                       \
        NAME##_##DT(T* out, const T* gate_up, int intermediate) {                               \
        activation_ops::act_and_mul<T, activation_ops::ACT>(out, gate_up, intermediate);        \
    }

PAGEDRUN_ACT_AND_MUL(silu_and_mul, Silu, f32, float)
PAGEDRUN_ACT_AND_MUL(silu_and_mul, Silu, f16, __half)
PAGEDRUN_ACT_AND_MUL(silu_and_mul, Silu, bf16, __nv_bfloat16)
PAGEDRUN_ACT_AND_MUL(gelu_tanh_and_mul, GeluTanh, f32, float)
PAGEDRUN_ACT_AND_MUL(gelu_tanh_and_mul, GeluTanh, f16, __half)
PAGEDRUN_ACT_AND_MUL(gelu_tanh_and_mul, GeluTanh, bf16, __nv_bfloat16)
