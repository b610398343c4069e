// planted_bugs.cu -- kernels with one deliberate bug each (and, where useful, the fixed
// twin), used by tests/sim/test_planted_bugs.py to show the harness catches every class of
// silent CUDA bug it promises to: races, out-of-bounds and misaligned global access, shared
// memory overflow and unwritten reads, divergent barriers, partial-warp full-mask shuffles,
// and a cp.async pipeline that waits one group too few.
#include "common.cuh"
#include "ptx.cuh"

constexpr int kTile = 64;

// Neighbour exchange through shared memory. x, y: [gridDim.x * kTile] f32, blockDim = kTile.
extern "C" __global__ void neighbour_missing_sync(const float* x, float* y) {
    __shared__ float tile[kTile];
    int t = threadIdx.x, i = blockIdx.x * kTile + t;
    tile[t] = x[i];
    // BUG: no __syncthreads() -- thread t reads its neighbour's slot before it is written.
    y[i] = tile[(t + 1) % kTile];
}
extern "C" __global__ void neighbour_synced(const float* x, float* y) {
    __shared__ float tile[kTile];
    int t = threadIdx.x, i = blockIdx.x * kTile + t;
    tile[t] = x[i];
    __syncthreads();
    y[i] = tile[(t + 1) % kTile];
}

// y[i] = x[i + 1] for i < n. x: [n] f32. BUG: the last thread reads x[n].
extern "C" __global__ void shift_out_of_bounds(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i + 1];
}

// Stages blockDim.x floats in dynamic shared memory; the host passes one float too few.
extern "C" __global__ void stage_dynamic_smem(const float* x, float* y) {
    DYNAMIC_SMEM(float, stage);
    int t = threadIdx.x;
    stage[t] = x[t];
    __syncthreads();
    y[t] = stage[blockDim.x - 1 - t];
}

// Loads float4 from x + offset. x: [4 * blockDim.x + 4] f32. BUG when offset % 4 != 0.
extern "C" __global__ void load_float4_at(const float* x, float* y, int offset) {
    int t = threadIdx.x;
    float4 v = *reinterpret_cast<const float4*>(x + offset + 4 * t);
    y[t] = v.x + v.y + v.z + v.w;
}

// BUG: only the first warp reaches the barrier.
extern "C" __global__ void divergent_barrier(float* y) {
    if (threadIdx.x < 32) __syncthreads();
    y[threadIdx.x] = 1.0f;
}

// Warp sum with a full mask; BUG when blockDim.x is not a multiple of 32.
extern "C" __global__ void warp_sum_full_mask(const float* x, float* y) {
    float v = x[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) y[threadIdx.x / 32] = v;
}

// Two cp.async groups of 16 floats each (x: [32] f32, blockDim = 4: 4 floats per copy).
// waits = pending groups allowed before reading: 0 is right; 1 is one group short.
template <int kPendingAllowed>
__device__ void two_group_pipeline(const float* x, float* y) {
    __shared__ __align__(16) float buf[32];
    int t = threadIdx.x;
    cp_async_16(buf + 4 * t, x + 4 * t);
    cp_async_commit();
    cp_async_16(buf + 16 + 4 * t, x + 16 + 4 * t);
    cp_async_commit();
    cp_async_wait<kPendingAllowed>();
    __syncthreads();
    for (int k = 0; k < 8; ++k) y[8 * t + k] = buf[8 * t + k];
}
extern "C" __global__ void cp_async_wait_one_short(const float* x, float* y) {
    two_group_pipeline<1>(x, y);
}
extern "C" __global__ void cp_async_wait_right(const float* x, float* y) {
    two_group_pipeline<0>(x, y);
}

// BUG: only the first half of the tile is written before everyone reads all of it.
extern "C" __global__ void read_unwritten_smem(const float* x, float* y) {
    __shared__ float tile[kTile];
    int t = threadIdx.x;
    if (t < kTile / 2) tile[t] = x[t];
    __syncthreads();
    y[t] = tile[t];
}

// BUG: the two halves of the block wait at different __syncthreads call sites.
extern "C" __global__ void barrier_two_sites(float* y) {
    if (threadIdx.x < 32) {
        y[threadIdx.x] = 1.0f;
        __syncthreads();
    } else {
        __syncthreads();
        y[threadIdx.x] = 2.0f;
    }
}

// BUG: lanes of one warp shuffle with different, overlapping masks.
extern "C" __global__ void mismatched_masks(const float* x, float* y) {
    unsigned mask = threadIdx.x < 16 ? 0xffffffffu : 0xffff0000u;
    y[threadIdx.x] = __shfl_down_sync(mask, x[threadIdx.x], 1);
}

// BUG: thread 5 of block 1 dereferences an address the host never gave it.
extern "C" __global__ void wild_pointer(float* y, long long address) {
    bool wild = blockIdx.x == 1 && threadIdx.x == 5;
    y[threadIdx.x] = wild ? *reinterpret_cast<const float*>(address) : 0.0f;
}

// BUG: half of the warp shuffles with a full mask, the other half skips the shuffle.
extern "C" __global__ void divergent_shuffle(const float* x, float* y) {
    float v = x[threadIdx.x];
    if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    y[threadIdx.x] = v;
}
