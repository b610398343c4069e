// twin_probes.cu -- drives each cuda/ptx.cuh function with fragments from global memory, so
// tests/sim/test_twins.py can check the host twins against scalar references, and
// tests/gpu/test_ptx_twins.py can run the very same kernels on a GPU.
#include "common.cuh"
#include "ptx.cuh"

// One m16n8k16 per warp. a: [warps*32, 4] u32, b: [warps*32, 2] u32, c, d: [warps*32, 4] f32.
// is_bf16: 1 for bf16 inputs, 0 for f16.
extern "C" __global__ void mma_fragments(const uint32_t* a, const uint32_t* b, const float* c,
                                         float* d, int is_bf16) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t ra[4] = {a[4 * t], a[4 * t + 1], a[4 * t + 2], a[4 * t + 3]};
    uint32_t rb[2] = {b[2 * t], b[2 * t + 1]};
    float rc[4] = {c[4 * t], c[4 * t + 1], c[4 * t + 2], c[4 * t + 3]};
    float rd[4];
    if (is_bf16)
        mma_m16n8k16_bf16(rd, ra, rb, rc);
    else
        mma_m16n8k16_f16(rd, ra, rb, rc);
    for (int i = 0; i < 4; ++i) d[4 * t + i] = rd[i];
}

constexpr int kProbeRows = 64;  // rows of 8 b16 values (16 bytes) staged in shared memory

// Stages src ([kProbeRows, 8] u16) in shared memory; lane l passes the address of row
// rows[l]; out: [32, 4] u32 receives the registers of ldmatrix `variant`:
// 0 x1, 1 x2, 2 x4, 3 x1.trans, 4 x2.trans, 5 x4.trans. blockDim = 32.
extern "C" __global__ void ldmatrix_probe(const uint16_t* src, const int* rows, uint32_t* out,
                                          int variant) {
    __shared__ __align__(16) uint16_t tile[kProbeRows * 8];
    int l = threadIdx.x;
    for (int i = l; i < kProbeRows * 8; i += 32) tile[i] = src[i];
    __syncthreads();
    const uint16_t* p = tile + 8 * rows[l];
    uint32_t r[4] = {0, 0, 0, 0};
    switch (variant) {
        case 0: { uint32_t x[1]; ldmatrix_x1(x, p); r[0] = x[0]; break; }
        case 1: { uint32_t x[2]; ldmatrix_x2(x, p); r[0] = x[0]; r[1] = x[1]; break; }
        case 2: { uint32_t x[4]; ldmatrix_x4(x, p); for (int i = 0; i < 4; ++i) r[i] = x[i]; break; }
        case 3: { uint32_t x[1]; ldmatrix_x1_trans(x, p); r[0] = x[0]; break; }
        case 4: { uint32_t x[2]; ldmatrix_x2_trans(x, p); r[0] = x[0]; r[1] = x[1]; break; }
        default: { uint32_t x[4]; ldmatrix_x4_trans(x, p); for (int i = 0; i < 4; ++i) r[i] = x[i]; break; }
    }
    for (int i = 0; i < 4; ++i) out[4 * l + i] = r[i];
}

// D[16,8] f32 = A[16,16] bf16 (row-major) @ B[16,8] bf16 (row-major, k by n), through the
// usual fragment path: A by ldmatrix.x4, B by ldmatrix.x2.trans, one mma. blockDim = 32.
extern "C" __global__ void mma_tile_bf16(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                         float* D) {
    __shared__ __align__(16) __nv_bfloat16 sa[16 * 16];
    __shared__ __align__(16) __nv_bfloat16 sb[16 * 8];
    int l = threadIdx.x;
    for (int i = l; i < 256; i += 32) sa[i] = A[i];
    for (int i = l; i < 128; i += 32) sb[i] = B[i];
    __syncthreads();
    uint32_t a[4], b[2];
    ldmatrix_x4(a, sa + 16 * (l % 16) + 8 * (l / 16));
    ldmatrix_x2_trans(b, sb + 8 * (l % 16));
    float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
    mma_m16n8k16_bf16(d, a, b, c);
    int g = l / 4, t = l % 4;
    D[8 * g + 2 * t] = d[0];
    D[8 * g + 2 * t + 1] = d[1];
    D[8 * (g + 8) + 2 * t] = d[2];
    D[8 * (g + 8) + 2 * t + 1] = d[3];
}

// Each thread copies 16 bytes of x (f32 [4*blockDim]) with cp.async zfill of src_bytes[t]
// bytes into shared memory, waits for all, and writes the staged values to y.
extern "C" __global__ void cp_async_zfill_probe(const float* x, const int* src_bytes, float* y) {
    __shared__ __align__(16) float stage[4 * 128];
    int t = threadIdx.x;
    cp_async_16_zfill(stage + 4 * t, x + 4 * t, src_bytes[t]);
    cp_async_wait_all();
    __syncthreads();
    for (int i = 0; i < 4; ++i) y[4 * t + i] = stage[4 * t + i];
}

// C[M,N] f32 = A[M,K] bf16 @ B[K,N] bf16 (both row-major), 64x64 block tiles, 4 warps each
// owning a 32x32 sub-tile, K in steps of 16 with a two-stage cp.async pipeline.
// M, N multiples of 64; K a multiple of 16. blockDim = 128, grid = (N/64, M/64).
constexpr int kBM = 64, kBN = 64, kBK = 16;
extern "C" __global__ void tiled_gemm_bf16(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                           float* C, int M, int N, int K) {
    __shared__ __align__(16) __nv_bfloat16 sa[2][kBM * kBK];
    __shared__ __align__(16) __nv_bfloat16 sb[2][kBK * kBN];
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int row0 = blockIdx.y * kBM, col0 = blockIdx.x * kBN;
    int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
    float acc[2][4][4] = {};
    auto load = [&](int stage, int k0) {
        // A tile: 64 rows x 16 cols = 128 chunks of 8; B tile: 16 rows x 64 cols = 128 chunks.
        int ar = tid / 2, ac = (tid % 2) * 8;
        cp_async_16(&sa[stage][ar * kBK + ac], A + (row0 + ar) * K + k0 + ac);
        int br = tid / 8, bc = (tid % 8) * 8;
        cp_async_16(&sb[stage][br * kBN + bc], B + (k0 + br) * N + col0 + bc);
        cp_async_commit();
    };
    load(0, 0);
    for (int k0 = 0, it = 0; k0 < K; k0 += kBK, ++it) {
        int stage = it % 2;
        if (k0 + kBK < K) {
            load(stage ^ 1, k0 + kBK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        uint32_t a[2][4], b[4][2];
        for (int mi = 0; mi < 2; ++mi)
            ldmatrix_x4(a[mi], &sa[stage][(wm + 16 * mi + lane % 16) * kBK + 8 * (lane / 16)]);
        for (int ni = 0; ni < 4; ++ni)
            ldmatrix_x2_trans(b[ni], &sb[stage][(lane % 16) * kBN + wn + 8 * ni]);
        for (int mi = 0; mi < 2; ++mi)
            for (int ni = 0; ni < 4; ++ni) mma_m16n8k16_bf16(acc[mi][ni], a[mi], b[ni], acc[mi][ni]);
        __syncthreads();
    }
    int g = lane / 4, t = lane % 4;
    for (int mi = 0; mi < 2; ++mi)
        for (int ni = 0; ni < 4; ++ni) {
            int r = row0 + wm + 16 * mi + g, c = col0 + wn + 8 * ni + 2 * t;
            C[r * N + c] = acc[mi][ni][0];
            C[r * N + c + 1] = acc[mi][ni][1];
            C[(r + 8) * N + c] = acc[mi][ni][2];
            C[(r + 8) * N + c + 1] = acc[mi][ni][3];
        }
}
