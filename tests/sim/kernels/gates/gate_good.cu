// gate_good.cu -- passes every compile gate. y[i] = 2 * x[i].
// Register budget: 32 per thread.
#include "common.cuh"
extern "C" __global__ void gate_good(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + (x[i] == CUDART_INF_F ? 1.0f : 0.0f);
}
