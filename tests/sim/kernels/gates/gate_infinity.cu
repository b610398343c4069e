// gate_infinity.cu -- nvcc accepts INFINITY, NVRTC does not (no <cmath> macros there).
// Register budget: 32 per thread.
#include "common.cuh"
extern "C" __global__ void gate_infinity(float* y) { y[threadIdx.x] = -INFINITY; }
