// activation.cu -- gated products of the MLP: out = act(gate) * up, act = SiLU (Llama's SwiGLU)
// or tanh-approximated GELU (Gemma's GeGLU, PyTorch's gelu(approximate="tanh")).
//
// Computes, per token row t and column j < intermediate, g = gate_up[t, j],
// u = gate_up[t, intermediate + j]:
//   silu_and_mul:      out[t, j] = g / (1 + exp(-g)) * u
//   gelu_tanh_and_mul: out[t, j] = 0.5 g (1 + tanh(z / 2)) * u = g / (1 + exp(-z)) * u,
//                      z = 2 sqrt(2/pi) (g + 0.044715 g^3)
// Both are g * sigmoid(z): 0.5 (1 + tanh(z / 2)) = sigmoid(z) turns GELU's tanh into the same
// one exp and one divide as SiLU, without the cancellation of 1 + tanh for negative g. fp32
// math, fast intrinsics (__expf: ex2.approx, ~2 ulp plus |z| 2^-24 from scaling the argument;
// __fdividef: 2 ulp), one rounding to T. exp(-z) overflowing to inf (or past 2^126, where
// __fdividef returns 0) gives act = -0 / 0 for very negative g, as the exact value underflows.
//
// Pointers (T = float | __half | __nv_bfloat16; contiguous):
//   gate_up  [num_tokens, 2 * intermediate]  T   (first half gate, second half up: the fused
//                                                  gate/up GEMM's output)
//   out      [num_tokens, intermediate]      T
//
// Launch geometry: grid (num_tokens, ceil(intermediate / (256 * V))), block 256; each thread
// takes V consecutive columns:
//   NAME_DT            V = 16 / sizeof(T): one 16-byte load of gate, one of up, one 16-byte
//                      store. Needs intermediate % V == 0 and gate_up, out on 16-byte
//                      boundaries (then every row's halves are too); the wrapper checks.
//   NAME_DT_unaligned  V = 1: any width and address.
// Why V: a pure stream needs ~25 KiB in flight per SM on an H200 (docs/kernel_report.md's
// Little's law): 2 x 16 bytes per thread x 2048 resident threads = 64 KiB, where one element per
// thread kept 8 (bf16); and per-thread index math is paid once per V elements.
// Instantiations: {silu_and_mul, gelu_tanh_and_mul}_{f32,f16,bf16}{,_unaligned}.
// Scalars: int intermediate. Signature: (out, gate_up, intermediate). Launched by
// runtime/kernels/fused_ops.py: silu_and_mul, gelu_tanh_and_mul.
//
// Register budget: 32 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace activation_ops {

constexpr int kThreads = 256;
constexpr int kVecBytes = 16;
// 2 sqrt(2 / pi) and the cubic coefficient of the tanh approximation of GELU.
constexpr float kGeluTwoSqrt2OverPi = 1.5957691216057308f;
constexpr float kGeluCubic = 0.044715f;

struct Silu {
    __device__ __forceinline__ static float z(float g) { return g; }
};

struct GeluTanh {
    __device__ __forceinline__ static float z(float g) {
        return kGeluTwoSqrt2OverPi * (g + kGeluCubic * g * g * g);
    }
};

template <typename Act>
__device__ __forceinline__ float act_times(float g, float u) {
    return __fdividef(g, 1.f + __expf(-Act::z(g))) * u;
}

// V elements of T as one 16-byte unit (copied byte-wise under the harness: no punning of T).
template <typename T> struct alignas(kVecBytes) Pack {
    static constexpr int kElems = kVecBytes / sizeof(T);
    T v[kElems];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
#if defined(PAGEDRUN_SIM)
    Pack<T> r;
    memcpy(&r, p, kVecBytes);
    return r;
#else
    return *reinterpret_cast<const Pack<T>*>(p);
#endif
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& r) {
#if defined(PAGEDRUN_SIM)
    memcpy(p, &r, kVecBytes);
#else
    *reinterpret_cast<Pack<T>*>(p) = r;
#endif
}

template <typename T, typename Act>
__device__ __forceinline__ void act_and_mul(T* out, const T* gate_up, int intermediate) {
    constexpr int V = Pack<T>::kElems;
    const int j = (blockIdx.y * kThreads + threadIdx.x) * V;
    if (j >= intermediate) return;  // intermediate % V == 0: a thread has all V or none
    const T* gate = gate_up + static_cast<long long>(blockIdx.x) * 2 * intermediate + j;
    const Pack<T> g = load_pack(gate);
    const Pack<T> u = load_pack(gate + intermediate);
    Pack<T> r;
#pragma unroll
    for (int e = 0; e < V; ++e)
        r.v[e] = from_f32<T>(act_times<Act>(to_f32(g.v[e]), to_f32(u.v[e])));
    store_pack(out + static_cast<long long>(blockIdx.x) * intermediate + j, r);
}

template <typename T, typename Act>
__device__ __forceinline__ void act_and_mul_unaligned(T* out, const T* gate_up, int intermediate) {
    const int j = blockIdx.y * kThreads + threadIdx.x;
    if (j >= intermediate) return;
    const long long in_row = static_cast<long long>(blockIdx.x) * 2 * intermediate;
    const float g = to_f32(gate_up[in_row + j]);
    const float u = to_f32(gate_up[in_row + intermediate + j]);
    out[static_cast<long long>(blockIdx.x) * intermediate + j] = from_f32<T>(act_times<Act>(g, u));
}

}  // namespace activation_ops

#define PAGEDRUN_ACT_AND_MUL(NAME, ACT, DT, T)                                                   \
    extern "C" __global__ void __launch_bounds__(activation_ops::kThreads)                       \
        NAME##_##DT(T* out, const T* gate_up, int intermediate) {                               \
        activation_ops::act_and_mul<T, activation_ops::ACT>(out, gate_up, intermediate);        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(activation_ops::kThreads)                       \
        NAME##_##DT##_unaligned(T* out, const T* gate_up, int intermediate) {                   \
        activation_ops::act_and_mul_unaligned<T, activation_ops::ACT>(out, gate_up,             \
                                                                      intermediate);            \
    }

PAGEDRUN_ACT_AND_MUL(silu_and_mul, Silu, f32, float)
PAGEDRUN_ACT_AND_MUL(silu_and_mul, Silu, f16, __half)
PAGEDRUN_ACT_AND_MUL(silu_and_mul, Silu, bf16, __nv_bfloat16)
PAGEDRUN_ACT_AND_MUL(gelu_tanh_and_mul, GeluTanh, f32, float)
PAGEDRUN_ACT_AND_MUL(gelu_tanh_and_mul, GeluTanh, f16, __half)
PAGEDRUN_ACT_AND_MUL(gelu_tanh_and_mul, GeluTanh, bf16, __nv_bfloat16)
