// reduce.cuh -- the one copy of the warp and block reductions the kernels share.
//
// Include after "common.cuh" (this header includes it too, so it also stands alone). Everything
// is in namespace `reduce`, header-only and __forceinline__; the same text compiles under nvcc,
// NVRTC and the CPU harness (cuda/sim), which finds it on the include path like every .cuh.
//
// Orders are part of the contract: kernels' float results are checked bit for bit against
// their references in places, so each function states the exact order of its operations and a
// change to one is a numerics change to every caller. tests/sim/test_reduce.py checks each
// function bit for bit against a numpy model of its stated order.
//
// Warp level -- a full warp calls (all 32 lanes, same call site; a partial warp is an error:
// the shuffles use the full mask). No shared memory, no barrier. Every lane gets the result.
//   warp_sum(v)              sum over the 32 lanes: butterfly v += shfl_xor(v, o), o = 16, 8, 4,
//                            2, 1 (every lane computes the same tree, so all lanes agree bit
//                            for bit). T = float, double or int.
//   warp_max(v)              max over the 32 lanes, same butterfly with max_of (fmaxf for float:
//                            a NaN lane loses to any number; max for int).
//   warp_argmax(v, idx)      (v, idx) of the largest v, ties to the lower idx (argmax_better),
//                            same butterfly on the pair. v must not be NaN (a NaN lane would
//                            keep its NaN and the lanes disagree): callers fold their candidates
//                            with argmax_better from a non-NaN start, which never picks a NaN.
//   warp_inclusive_scan(v, lane)  Hillis-Steele inclusive prefix sum over lanes 0..lane
//                            (shfl_up, o = 1, 2, 4, 8, 16); lane 31 holds the warp's total.
//   group_sum<L>(v), group_max<L>(v)  over each aligned group of L lanes (L = 2, 4, ..., 32),
//                            butterfly in ASCENDING offsets o = 1, 2, ..., L / 2 -- the order
//                            the attention kernels use for the 4 lanes (a "quad") that share a
//                            row of an mma.sync m16n8 accumulator. group_sum<32> is therefore
//                            NOT warp_sum: same values, a different rounding tree.
//
// Block level -- template <int kThreads> (the block's thread count, compile time): every thread
// of the block calls at the same call site (rule 5 of docs/kernels.md: no thread may have
// returned), blockDim.x == kThreads, kThreads a multiple of 32 and <= 1024, one-dimensional
// block. Every thread gets the result.
//   Shared memory: the caller passes scratch of kThreads / 32 elements per array (static
//   __shared__ or carved from DYNAMIC_SMEM). Lane 0 of warp w writes element w.
//   Syncs: each call starts with __syncthreads() (so a previous reduction's readers of the
//   same scratch are done before it is overwritten: back-to-back reductions on one scratch are
//   safe without a barrier between them) and has one more between the writes and the reads.
//   On return other threads may still be READING the scratch: a caller that writes it for any
//   other purpose must __syncthreads() first.
//   block_sum<kThreads>(v, s_warp)     warp_sum, then every thread adds the warp totals in
//                                      warp order: (t0 + t1) + t2 + ... T = float, double or
//                                      int.
//   block_max<kThreads>(v, s_warp)     warp_max, then max_of over t0, t1, ... in warp order.
//   block_argmax<kThreads>(v, idx, s_val, s_idx)  warp_argmax, then the warp winners in warp
//                                      order; returns the idx (ties to the lower idx; v not
//                                      NaN, as for warp_argmax).
//
// Not here, on purpose: paged_attention_decode.cu's sums over a token's lane group (arrays of
// scores reduced together, offsets LANES_PER_TOKEN / 2 .. 1) and its online-softmax merge
// across lane groups (a (m, l, acc) state, not a value), and gemm_skinny.cu's
// warp_transpose_sum (32 sums in 31 shuffles); each is one kernel's layout, used once.
#pragma once

#include "common.cuh"

namespace reduce {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 1024;  // the CUDA limit on threads per block

// ---- combining operations -----------------------------------------------------------------
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ int max_of(int a, int b) { return max(a, b); }

// The operations the butterflies and block folds are written once over (one template each;
// warp_sum / group_max / block_max ... below name the pairings).
struct SumOp {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return max_of(a, b); }
};

// (v, i) beats (best_v, best_i): larger value, ties to the lower index. NaN never beats.
__device__ __forceinline__ bool argmax_better(float v, int i, float best_v, int best_i) {
    return v > best_v || (v == best_v && i < best_i);
}

// ---- warp level ---------------------------------------------------------------------------
// v = op(v, lane ^ offset's v) for offset = kFirst, then halved (kDescending) or doubled, while
// 0 < offset < kLanes: the one butterfly behind warp_* (descending from 16) and group_*
// (ascending from 1).
template <int kLanes, bool kDescending, typename T, typename Op>
__device__ __forceinline__ T butterfly(T v, Op op) {
    static_assert(kLanes >= 1 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0,
                  "butterfly: kLanes is a power of two, at most a warp");
#pragma unroll
    for (int offset = kDescending ? kLanes / 2 : 1; offset > 0 && offset < kLanes;
         offset = kDescending ? offset >> 1 : offset << 1)
        v = op(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) { return butterfly<kWarpSize, true>(v, SumOp{}); }

template <typename T>
__device__ __forceinline__ T warp_max(T v) { return butterfly<kWarpSize, true>(v, MaxOp{}); }

__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
        const float other_v = __shfl_xor_sync(kFullMask, v, offset);
        const int other_idx = __shfl_xor_sync(kFullMask, idx, offset);
        if (argmax_better(other_v, other_idx, v, idx)) {
            v = other_v;
            idx = other_idx;
        }
    }
}

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v, int lane) {
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
        const T up = __shfl_up_sync(kFullMask, v, offset);
        if (lane >= offset) v += up;
    }
    return v;
}

template <int kLanes, typename T>
__device__ __forceinline__ T group_sum(T v) { return butterfly<kLanes, false>(v, SumOp{}); }

template <int kLanes, typename T>
__device__ __forceinline__ T group_max(T v) { return butterfly<kLanes, false>(v, MaxOp{}); }

// ---- block level --------------------------------------------------------------------------
template <int kThreads>
struct BlockShape {
    static_assert(kThreads % kWarpSize == 0, "block reductions: whole warps only");
    static_assert(kThreads > 0 && kThreads <= kMaxThreads, "block reductions: 1..1024 threads");
    static constexpr int kWarps = kThreads / kWarpSize;
};

// The warp butterfly, then every thread folds the warp results in warp order from t0:
// op(op(t0, t1), t2) ... -- the one body of block_sum and block_max.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* s_warp, Op op) {
    constexpr int kWarps = BlockShape<kThreads>::kWarps;
    v = butterfly<kWarpSize, true>(v, op);
    __syncthreads();  // s_warp may still be read by a previous reduction
    if (threadIdx.x % kWarpSize == 0) s_warp[threadIdx.x / kWarpSize] = v;
    __syncthreads();
    T result = s_warp[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) result = op(result, s_warp[w]);
    return result;
}

template <int kThreads, typename T>
__device__ __forceinline__ T block_sum(T v, T* s_warp) {
    return block_reduce<kThreads>(v, s_warp, SumOp{});
}

template <int kThreads, typename T>
__device__ __forceinline__ T block_max(T v, T* s_warp) {
    return block_reduce<kThreads>(v, s_warp, MaxOp{});
}

template <int kThreads>
__device__ __forceinline__ int block_argmax(float v, int idx, float* s_val, int* s_idx) {
    constexpr int kWarps = BlockShape<kThreads>::kWarps;
    warp_argmax(v, idx);
    __syncthreads();  // s_val / s_idx may still be read by a previous reduction
    if (threadIdx.x % kWarpSize == 0) {
        s_val[threadIdx.x / kWarpSize] = v;
        s_idx[threadIdx.x / kWarpSize] = idx;
    }
    __syncthreads();
    float best_v = s_val[0];
    int best_idx = s_idx[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
        if (argmax_better(s_val[w], s_idx[w], best_v, best_idx)) {
            best_v = s_val[w];
            best_idx = s_idx[w];
        }
    return best_idx;
}

}  // namespace reduce
