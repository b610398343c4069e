// hopper_unguarded.cu -- compile-gate probe: a Hopper-only call without the
// PAGEDRUN_HAS_HOPPER guard must stop an sm_80 build with the static_assert of
// cuda/hopper_groundwork.cuh and build for sm_90a. tests/sim/test_hopper_twins.py runs the
// gates on it.
// Register budget: 32
#include "common.cuh"
#include "hopper_groundwork.cuh"

extern "C" __global__ void unguarded_mbarrier(int* out) {
    __shared__ __align__(8) uint64_t bar;
    if (threadIdx.x == 0) mbarrier_init(&bar, 1);
    __syncthreads();
    mbarrier_arrive(&bar);
    mbarrier_wait_parity(&bar, 0);
    out[threadIdx.x] = 1;
}
