// race_planted.cu -- planted races that the harness's index-order schedule hides and its
// random schedule exposes (tests/sim/test_random_schedule.py; cuda/sim/runtime.cpp,
// "Schedules"). Each racy kernel has a fixed twin that must pass under every schedule, so the
// random schedule's failures are the race and not the harness. Index order hides each race
// because the thread (or warp, or block) whose write is read happens to run first there.
//
// Geometry for all: blockDim = kThreads (2 warps), any gridDim.x; x, y: [gridDim.x * kThreads]
// f32 unless noted. Shared memory starts each block as NaN (the harness poisons it), so a
// read that wins the race against its writer shows as NaN.
#include "common.cuh"
#include "ptx.cuh"

namespace race_planted {
constexpr int kThreads = 64;
constexpr int kWarp = 32;
constexpr int kFloatsPerCopy = 4;  // one 16-byte cp.async
}  // namespace race_planted

// Warp 1 reads what warp 0 wrote to shared memory: y[i] = x[i - 32] for warp 1, x[i] for
// warp 0. BUG: no __syncthreads between the write and the other warp's read.
extern "C" __global__ void race_cross_warp_read(const float* x, float* y) {
    using namespace race_planted;
    __shared__ float tile[kThreads];
    const int t = threadIdx.x, i = blockIdx.x * kThreads + t;
    tile[t] = x[i];
    y[i] = t >= kWarp ? tile[t - kWarp] : tile[t];
}
extern "C" __global__ void race_cross_warp_read_synced(const float* x, float* y) {
    using namespace race_planted;
    __shared__ float tile[kThreads];
    const int t = threadIdx.x, i = blockIdx.x * kThreads + t;
    tile[t] = x[i];
    __syncthreads();
    y[i] = t >= kWarp ? tile[t - kWarp] : tile[t];
}

// Warp 0 reduces its x over the warp (five shuffles), then adds warp 1's x staged in shared
// memory: y[i] = sum(x of warp 0) + x[i + 32] for warp 0 lanes; warp 1 writes y = 0. BUG: no
// __syncthreads between warp 1's store and warp 0's read; warp 0's shuffles "surely" give
// warp 1 time. Index order (and any schedule that shuffles threads round by round) runs warp
// 1 before warp 0 leaves its first shuffle; only a schedule letting one warp run ahead
// through several rendezvous -- the random schedule's priority policy -- exposes it.
extern "C" __global__ void race_warp_runs_ahead(const float* x, float* y) {
    using namespace race_planted;
    __shared__ float staged[kWarp];
    const int t = threadIdx.x, i = blockIdx.x * kThreads + t;
    if (t >= kWarp) {
        staged[t - kWarp] = x[i];
        y[i] = 0.f;
        return;
    }
    float sum = x[i];
    for (int offset = kWarp / 2; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    y[i] = sum + staged[t];
}
extern "C" __global__ void race_warp_runs_ahead_synced(const float* x, float* y) {
    using namespace race_planted;
    __shared__ float staged[kWarp];
    const int t = threadIdx.x, i = blockIdx.x * kThreads + t;
    if (t >= kWarp) staged[t - kWarp] = x[i];
    __syncthreads();
    if (t >= kWarp) {
        y[i] = 0.f;
        return;
    }
    float sum = x[i];
    for (int offset = kWarp / 2; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    y[i] = sum + staged[t];
}

// Each thread cp.asyncs its 4 floats of x into shared memory and waits for its own copy, then
// reads the 4 floats thread t - 1 copied (thread 0 its own): y[4t..4t+3] = x[4(t-1)..]. x, y:
// [gridDim.x * kThreads * 4] f32. BUG: cp_async_wait covers only the calling thread's copies;
// another thread's need a __syncthreads after every thread's wait.
extern "C" __global__ void race_cp_async_other_thread(const float* x, float* y) {
    using namespace race_planted;
    __shared__ __align__(16) float stage[kThreads * kFloatsPerCopy];
    const int t = threadIdx.x;
    const std::size_t base = std::size_t(blockIdx.x) * kThreads * kFloatsPerCopy;
    cp_async_16(stage + kFloatsPerCopy * t, x + base + kFloatsPerCopy * t);
    cp_async_commit();
    cp_async_wait_all();
    const int src = t > 0 ? t - 1 : 0;
    for (int k = 0; k < kFloatsPerCopy; ++k)
        y[base + kFloatsPerCopy * t + k] = stage[kFloatsPerCopy * src + k];
}
extern "C" __global__ void race_cp_async_other_thread_synced(const float* x, float* y) {
    using namespace race_planted;
    __shared__ __align__(16) float stage[kThreads * kFloatsPerCopy];
    const int t = threadIdx.x;
    const std::size_t base = std::size_t(blockIdx.x) * kThreads * kFloatsPerCopy;
    cp_async_16(stage + kFloatsPerCopy * t, x + base + kFloatsPerCopy * t);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    const int src = t > 0 ? t - 1 : 0;
    for (int k = 0; k < kFloatsPerCopy; ++k)
        y[base + kFloatsPerCopy * t + k] = stage[kFloatsPerCopy * src + k];
}

// Reads its own cp.async destination before the wait. Not a schedule race: the harness
// poisons the destination at issue and lands the copy at the wait, so this fails under every
// schedule (shown next to the races for contrast). Same layout as race_cp_async_other_thread.
extern "C" __global__ void cp_async_read_before_wait(const float* x, float* y) {
    using namespace race_planted;
    __shared__ __align__(16) float stage[kThreads * kFloatsPerCopy];
    const int t = threadIdx.x;
    const std::size_t base = std::size_t(blockIdx.x) * kThreads * kFloatsPerCopy;
    cp_async_16(stage + kFloatsPerCopy * t, x + base + kFloatsPerCopy * t);
    cp_async_commit();
    float v[kFloatsPerCopy];
    for (int k = 0; k < kFloatsPerCopy; ++k) v[k] = stage[kFloatsPerCopy * t + k];  // BUG
    cp_async_wait_all();
    for (int k = 0; k < kFloatsPerCopy; ++k) y[base + kFloatsPerCopy * t + k] = v[k];
}

// Block 0 publishes a scale through global memory and every block uses it: y[i] = x[i] *
// scale[0] where block 0 first sets scale[0] = x[0] * 2. scale: [1] f32, NaN from the host.
// BUG: blocks run in any order (and concurrently); nothing makes block 0 go first.
extern "C" __global__ void race_block_zero_first(const float* x, float* y, float* scale) {
    using namespace race_planted;
    const int i = blockIdx.x * kThreads + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) scale[0] = x[0] * 2.f;
    __syncthreads();
    y[i] = x[i] * scale[0];
}
