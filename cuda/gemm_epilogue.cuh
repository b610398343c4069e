// gemm_epilogue.cuh -- the GEMM kernels' shared epilogue (gemm.cu, gemm_hopper.cu, gemm_wq.cu):
// two horizontally adjacent fp32 accumulators at (row, col), (row, col + 1) of out [M, N]
// (row-major, contiguous), plus bias[col] (T, may be null) and residual[row, col] (OutT, may be
// null, may alias out: each element is read before it is written), one rounding to OutT.
// Elements past M or N are skipped; when N is even the pair goes out as one 2-element store
// (col is even, so the pair is aligned), else element by element.
#pragma once
#include "common.cuh"

namespace gemm_epilogue {

// Two adjacent outputs in one store, through the pair type (legal aliasing in host C++ too).
__device__ __forceinline__ void store2(float* dst, float lo, float hi) {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
}
__device__ __forceinline__ void store2(__half* dst, float lo, float hi) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(lo, hi);
}
__device__ __forceinline__ void store2(__nv_bfloat16* dst, float lo, float hi) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(lo, hi);
}

template <typename T, typename OutT>
__device__ __forceinline__ void epilogue_pair(OutT* out, const T* bias, const OutT* residual,
                                              int row, int col, float v0, float v1, int M, int N) {
    if (row >= M || col >= N) return;
    const bool has_second = col + 1 < N;
    if (bias != nullptr) {
        v0 += to_f32(bias[col]);
        if (has_second) v1 += to_f32(bias[col + 1]);
    }
    const long long idx = static_cast<long long>(row) * N + col;
    if (residual != nullptr) {
        v0 += to_f32(residual[idx]);
        if (has_second) v1 += to_f32(residual[idx + 1]);
    }
    if (has_second && N % 2 == 0) {
        store2(out + idx, v0, v1);
    } else {
        out[idx] = from_f32<OutT>(v0);
        if (has_second) out[idx + 1] = from_f32<OutT>(v1);
    }
}

}  // namespace gemm_epilogue
