// rms_norm.cu -- RMSNorm of each token row, and RMSNorm with the residual add fused in front.
//
// Computes, per row t (hidden = H):
//   rms_norm:           out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight
//   fused_add_rms_norm: r = x[t] + residual_in[t]                  (fp32)
//                       residual_out[t] = r
//                       out[t] = r * rsqrt(mean(r^2) + eps) * weight
// all math in fp32 (the residual stream is carried in fp32 whatever the activation dtype,
// matching runtime/backends/numpy_ops.py), one rounding to T at the store.
//
// Pointers (T = float | __half | __nv_bfloat16; contiguous):
//   x         [num_tokens, H]  T
//   residual_in, residual_out  [num_tokens, H]  float  (fused_add_rms_norm only; may alias:
//                              each element is read, then written, by the same thread)
//   weight    [H]              T
//   out       [num_tokens, H]  T       (may alias x)
//
// Algorithm: one CTA per row; each thread sums squares over a strided slice of the row,
// the CTA reduces (reduce::block_sum of cuda/reduce.cuh: warp shuffles, then one value per warp
// through shared memory, summed in warp order), then every thread scales its slice. The row is
// read twice (second time from L1/L2: x for rms_norm, the fp32 residual_out just written for
// fused_add_rms_norm); rows are at most a few tens of KiB.
//
// Launch geometry: grid (num_tokens), block 256, no dynamic shared memory (static: one float
// per warp for the reduction).
// Instantiations: rms_norm_{f32,f16,bf16}, fused_add_rms_norm_{f32,f16,bf16}.
// Scalars: int hidden, float eps.
// Signatures: rms_norm_*(out, x, weight, hidden, eps);
// fused_add_rms_norm_*(out, residual_out, residual_in, x, weight, hidden, eps).
// Launched by runtime/kernels/fused_ops.py: rms_norm, fused_add_rms_norm.
//
// Register budget: 64 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"
#include "reduce.cuh"

namespace rms_norm_ops {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void rms_norm(T* out, const T* x, const T* weight, int hidden,
                                         float eps) {
    __shared__ float s_warp[kThreads / reduce::kWarpSize];
    const long long row = static_cast<long long>(blockIdx.x) * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < hidden; i += kThreads) {
        const float v = to_f32(x[row + i]);
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(reduce::block_sum<kThreads>(sum_sq, s_warp) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += kThreads)
        out[row + i] = from_f32<T>(to_f32(x[row + i]) * inv_rms * to_f32(weight[i]));
}

template <typename T>
__device__ __forceinline__ void fused_add_rms_norm(T* out, float* residual_out,
                                                   const float* residual_in, const T* x,
                                                   const T* weight, int hidden, float eps) {
    __shared__ float s_warp[kThreads / reduce::kWarpSize];
    const long long row = static_cast<long long>(blockIdx.x) * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < hidden; i += kThreads) {
        const float v = to_f32(x[row + i]) + residual_in[row + i];
        residual_out[row + i] = v;
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(reduce::block_sum<kThreads>(sum_sq, s_warp) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += kThreads)
        out[row + i] = from_f32<T>(residual_out[row + i] * inv_rms * to_f32(weight[i]));
}

}  // namespace rms_norm_ops

#define PAGEDRUN_RMS_NORM(DT, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(rms_norm_ops::kThreads)                         \
        rms_norm_##DT(T* out, const T* x, const T* weight, int hidden, float eps) {             \
        rms_norm_ops::rms_norm<T>(out, x, weight, hidden, eps);                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(rms_norm_ops::kThreads)                         \
        fused_add_rms_norm_##DT(T* out, float* residual_out, const float* residual_in,          \
                                const T* x, const T* weight, int hidden, float eps) {            \
        rms_norm_ops::fused_add_rms_norm<T>(out, residual_out, residual_in, x, weight, hidden,   \
                                            eps);                                                \
    }

PAGEDRUN_RMS_NORM(f32, float)
PAGEDRUN_RMS_NORM(f16, __half)
PAGEDRUN_RMS_NORM(bf16, __nv_bfloat16)
