// smoke.cu -- small kernels exercising each harness feature once, for test_harness.py.
#include "common.cuh"

// Reverses each block's slice through static shared memory. x, y: [n] f32; blockDim <= 256.
extern "C" __global__ void block_reverse(const float* x, float* y, int n) {
    __shared__ float tile[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    int j = blockIdx.x * blockDim.x + (blockDim.x - 1 - threadIdx.x);
    if (j < n) y[j] = tile[threadIdx.x];
}

// Writes every built-in index. out: [grid threads, 12] i32, row = global linear thread id.
extern "C" __global__ void write_indices(int* out) {
    unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned per_block = blockDim.x * blockDim.y * blockDim.z;
    unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int* row = out + 12 * (block * per_block + t);
    row[0] = threadIdx.x; row[1] = threadIdx.y; row[2] = threadIdx.z;
    row[3] = blockIdx.x;  row[4] = blockIdx.y;  row[5] = blockIdx.z;
    row[6] = blockDim.x;  row[7] = blockDim.y;  row[8] = blockDim.z;
    row[9] = gridDim.x;   row[10] = gridDim.y;  row[11] = warpSize;
}

// Per thread: [idx(src), up(delta), down(delta), xor(lane_mask)] within `width`.
// x: [blockDim.x] f32; y: [blockDim.x, 4] f32. blockDim.x a multiple of 32.
extern "C" __global__ void shuffles(const float* x, float* y, int src, int delta, int lane_mask,
                                    int width) {
    int t = threadIdx.x;
    float v = x[t];
    y[4 * t + 0] = __shfl_sync(0xffffffffu, v, src, width);
    y[4 * t + 1] = __shfl_up_sync(0xffffffffu, v, delta, width);
    y[4 * t + 2] = __shfl_down_sync(0xffffffffu, v, delta, width);
    y[4 * t + 3] = __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
}

// Votes on pred[t] != 0. out: [blockDim.x, 5] u32: ballot, any, all, syncthreads_count, _or.
extern "C" __global__ void votes(const int* pred, unsigned* out) {
    int t = threadIdx.x, p = pred[t];
    out[5 * t + 0] = __ballot_sync(0xffffffffu, p);
    out[5 * t + 1] = __any_sync(0xffffffffu, p);
    out[5 * t + 2] = __all_sync(0xffffffffu, p);
    out[5 * t + 3] = __syncthreads_count(p);
    out[5 * t + 4] = __syncthreads_or(p);
}

// Half-warp shuffles with a partial mask (only lanes 0..15 of each warp take part).
// x: [blockDim.x] f32; y: [blockDim.x] f32 (lanes 16..31 write x unchanged).
extern "C" __global__ void half_warp_sum(const float* x, float* y) {
    int t = threadIdx.x;
    float v = x[t];
    if (t % 32 < 16) {
        for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
    }
    y[t] = v;
}

// Histogram with atomics. bins: [nbins] i32, sum: [1] f32, vmax: [1] i32.
extern "C" __global__ void histogram(const int* keys, int n, int* bins, float* sum, int* vmax) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        atomicAdd(&bins[keys[i]], 1);
        atomicAdd(sum, 0.5f);
        atomicMax(vmax, keys[i]);
    }
}

// f32 -> f16 / bf16 bits (round to nearest even) and back. x: [n] f32;
// h, b: [n] u16; hx, bx: [n] f32 (the rounded values widened back).
extern "C" __global__ void convert_halves(const float* x, unsigned short* h, unsigned short* b,
                                          float* hx, float* bx, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        __half hv = __float2half_rn(x[i]);
        __nv_bfloat16 bv = __float2bfloat16_rn(x[i]);
        h[i] = __half_as_ushort(hv);
        b[i] = __bfloat16_as_ushort(bv);
        hx[i] = __half2float(hv);
        bx[i] = __bfloat162float(bv);
    }
}

// Each thread records the sum of its warp (all threads in the mask) many times, to time
// barriers: y[t] = rounds * 32 * x, via `rounds` __syncthreads and shuffles.
extern "C" __global__ void barrier_rounds(float* y, int rounds) {
    float acc = 0.0f;
    for (int r = 0; r < rounds; ++r) {
        __syncthreads();
        acc += 1.0f;
    }
    y[threadIdx.x] = acc;
}

// Takes one of every scalar type, for argument marshalling tests; out: [6] f64.
extern "C" __global__ void scalar_args(double* out, int a, unsigned b, long long c, float d,
                                       double e, unsigned char f) {
    if (threadIdx.x == 0) {
        out[0] = a; out[1] = b; out[2] = double(c); out[3] = d; out[4] = e; out[5] = f;
    }
}

// Dynamic shared memory round trip: y[t] = x[t] through a DYNAMIC_SMEM buffer of blockDim
// floats placed after `offset` floats of padding.
extern "C" __global__ void dynamic_smem_roundtrip(const float* x, float* y, int offset) {
    DYNAMIC_SMEM(float, buf);
    buf[offset + threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    y[threadIdx.x] = buf[offset + (threadIdx.x + 1) % blockDim.x];
}

namespace smoke_bounds {
constexpr int kThreads = 64;
}
// Bounded to smoke_bounds::kThreads threads per block; y: [blockDim.x] i32 = threadIdx.x.
extern "C" __global__ void __launch_bounds__(smoke_bounds::kThreads, 2) bounded_iota(int* y) {
    y[threadIdx.x] = int(threadIdx.x);
}

// A planted race for the harness's schedule randomisation: each thread writes its slot and,
// with no barrier, reads its neighbour's (t ^ 1). Index order always runs the even thread
// first, so it reads 0 and the odd one reads the even's value; any order is legal on a GPU.
extern "C" __global__ void racy_neighbour_read(int* data, int* out) {
    const int t = threadIdx.x;
    data[t] = t + 1;
    out[t] = data[t ^ 1];
}

// Block execution order, as seen by an atomic ticket (thread 0 of each block).
extern "C" __global__ void block_order(int* counter, int* order) {
    if (threadIdx.x == 0) order[atomicAdd(counter, 1)] = blockIdx.x;
}

// Logs which thread passes which point, in the order the harness runs them: each thread
// appends 1000 * point + threadIdx.x to `log` through the counter `count[0]` (safe without
// atomics only because the harness runs one thread at a time). Points: 0 at entry, 1 after a
// __syncthreads, 2 after a full-warp shuffle, 3 after a __syncwarp of the even lanes (odd lanes
// skip it), then the exit. log: [4 * blockDim.x] i32; count: [1] i32, zero. blockDim.x a
// multiple of 32.
extern "C" __global__ void schedule_order(int* log, int* count) {
    const int t = threadIdx.x;
    log[count[0]++] = t;
    __syncthreads();
    log[count[0]++] = 1000 + t;
    const int v = __shfl_xor_sync(0xffffffffu, t, 1);
    log[count[0]++] = 2000 + t + 0 * v;
    if (t % 2 == 0) __syncwarp(0x55555555u);
    log[count[0]++] = 3000 + t;
}
