// gate_over_budget.cu -- keeps 48 values live; the promised budget is too small.
// Register budget: 16 per thread.
#include "common.cuh"
extern "C" __global__ void gate_over_budget(const float* x, float* y) {
    float v[48];
#pragma unroll
    for (int i = 0; i < 48; ++i) v[i] = x[i * blockDim.x + threadIdx.x];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 48; ++i) s += v[i] * v[47 - i];
#pragma unroll
    for (int i = 0; i < 48; ++i) y[i * blockDim.x + threadIdx.x] = v[i] * s;
}
