// gate_spills.cu -- 1024 threads x 2 blocks caps registers at 32, but 96 values stay live:
// ptxas must spill. Register budget: 255 per thread.
#include "common.cuh"
extern "C" __global__ void __launch_bounds__(1024, 2) gate_spills(const float* x, float* y) {
    float v[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) v[i] = x[i * blockDim.x + threadIdx.x];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 96; ++i) s += v[i] * v[95 - i];
#pragma unroll
    for (int i = 0; i < 96; ++i) y[i * blockDim.x + threadIdx.x] = v[i] * s;
}
