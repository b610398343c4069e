// reduce_probes.cu -- drives every function of cuda/reduce.cuh from global memory, so
// tests/sim/test_reduce.py can check each against a numpy reference of its stated order.
// Every thread writes the result it got (the contract: every thread / lane gets it).
#include "common.cuh"
#include "reduce.cuh"

// Block level, kThreads per block, one block per row of x: [blocks, kThreads].
// Two reductions back to back on the same scratch (the leading barrier's case), then argmax.
// sums / maxes / argmaxes / isums: [blocks, kThreads].
template <int kThreads>
__device__ __forceinline__ void block_probe(const float* x, const int* xi, float* sums,
                                            float* maxes, int* argmaxes, int* isums) {
    __shared__ float s_val[kThreads / reduce::kWarpSize];
    __shared__ int s_idx[kThreads / reduce::kWarpSize];
    const long long at = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
    const float v = x[at];
    const float sum = reduce::block_sum<kThreads>(v, s_val);
    const float mx = reduce::block_max<kThreads>(v, s_val);
    const int arg = reduce::block_argmax<kThreads>(v, static_cast<int>(threadIdx.x), s_val, s_idx);
    const int isum = reduce::block_sum<kThreads>(xi[at], s_idx);
    sums[at] = sum;
    maxes[at] = mx;
    argmaxes[at] = arg;
    isums[at] = isum;
}

#define PAGEDRUN_BLOCK_PROBE(N)                                                              \
    extern "C" __global__ void __launch_bounds__(N)                                          \
        block_probe_##N(const float* x, const int* xi, float* sums, float* maxes,            \
                        int* argmaxes, int* isums) {                                         \
        block_probe<N>(x, xi, sums, maxes, argmaxes, isums);                                 \
    }
PAGEDRUN_BLOCK_PROBE(32)
PAGEDRUN_BLOCK_PROBE(96)
PAGEDRUN_BLOCK_PROBE(256)
PAGEDRUN_BLOCK_PROBE(1024)

// Warp level, any number of whole warps; x, xd: [threads] float / double, xi: [threads] int.
// out: [threads, 6] float: warp_sum, warp_max, warp_inclusive_scan, group_sum<4>,
// group_max<4>, group_sum<2>; outd: [threads, 2] double: warp_sum, warp_inclusive_scan;
// outi: [threads, 4] int: warp_sum, warp_max, warp_argmax's idx, warp_argmax's value bits
// (over x with NaN as -inf).
extern "C" __global__ void warp_probe(const float* x, const double* xd, const int* xi,
                                      float* out, double* outd, int* outi) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % reduce::kWarpSize;
    const float v = x[t];
    out[6 * t + 0] = reduce::warp_sum(v);
    out[6 * t + 1] = reduce::warp_max(v);
    out[6 * t + 2] = reduce::warp_inclusive_scan(v, lane);
    out[6 * t + 3] = reduce::group_sum<4>(v);
    out[6 * t + 4] = reduce::group_max<4>(v);
    out[6 * t + 5] = reduce::group_sum<2>(v);
    outd[2 * t + 0] = reduce::warp_sum(xd[t]);
    outd[2 * t + 1] = reduce::warp_inclusive_scan(xd[t], lane);
    outi[4 * t + 0] = reduce::warp_sum(xi[t]);
    outi[4 * t + 1] = reduce::warp_max(xi[t]);
    float best = v == v ? v : -CUDART_INF_F;  // warp_argmax's inputs are never NaN
    int best_idx = lane;
    reduce::warp_argmax(best, best_idx);
    outi[4 * t + 2] = best_idx;
    outi[4 * t + 3] = __float_as_int(best);
}
