// hopper_probes.cu -- drives the Hopper-only functions of cuda/hopper_groundwork.cuh
// (mbarrier, TMA, wgmma) for tests/sim/test_hopper_twins.py (harness twins vs numpy) and
// tests/gpu/test_ptx_twins.py (twins vs the real instructions on a compute capability 9.0 GPU).
// Kernel bodies exist where PAGEDRUN_HAS_HOPPER (sm_90a, the harness); on other archs they
// trap, so the file passes the sm_80 compile gate too.
// Register budget: 168
#include "common.cuh"
#include "hopper_groundwork.cuh"

constexpr int kWgmmaM = 64;
constexpr int kWgmmaK = 16;
constexpr int kSwizzleAtomBytes = 1024; // 8 rows of 128 bytes: the swizzle pattern's period
constexpr int kCoreMatrixBytes = 128;   // 8 rows x 16 bytes (no-swizzle layout)
constexpr int kCoreRowBytes = 16;
constexpr int kCoreCols = 8;            // 16-bit values per core-matrix row

__device__ __forceinline__ unsigned char* align_up_1024(unsigned char* p) {
    return reinterpret_cast<unsigned char*>(
        (reinterpret_cast<size_t>(p) + kSwizzleAtomBytes - 1) & ~size_t(kSwizzleAtomBytes - 1));
}

// One TMA box into 1024-byte aligned shared memory; out[box_bytes] receives the raw shared
// memory bytes (swizzled as the descriptor says). blockDim = 32, dynamic smem box_bytes+1024.
extern "C" __global__ void tma_box_probe(const TmaDescriptor* desc, int coord_inner,
                                         int coord_outer, int box_bytes, unsigned char* out) {
#if PAGEDRUN_HAS_HOPPER
    DYNAMIC_SMEM(unsigned char, smem_raw);
    __shared__ __align__(8) uint64_t bar;
    unsigned char* tile = align_up_1024(smem_raw);
    if (threadIdx.x == 0) mbarrier_init(&bar, 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&bar, box_bytes);
        tma_load_2d(tile, desc, coord_inner, coord_outer, &bar);
    }
    mbarrier_wait_parity(&bar, 0);
    for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) out[i] = tile[i];
#else
    __trap();
#endif
}

#if PAGEDRUN_HAS_HOPPER
// Thread t of the warpgroup holds D[16w+g (+8)][8i+2q (+1)] (cuda/hopper_groundwork.cuh).
template <int N>
__device__ __forceinline__ void store_accumulators(const float* d, float* D) {
    int t = threadIdx.x % 128, w = t / 32, g = (t % 32) / 4, q = t % 4;
    for (int r = 0; r < N / 2; ++r) {
        int i = r / 4, j = r % 4;
        D[(16 * w + g + 8 * (j / 2)) * N + 8 * i + 2 * q + (j % 2)] = d[r];
    }
}

template <int N, bool BF16>
__device__ __forceinline__ void wgmma_step(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) {
    if constexpr (N == 64 && BF16) wgmma_m64n64k16_bf16(d, da, db, acc);
    else if constexpr (N == 64) wgmma_m64n64k16_f16(d, da, db, acc);
    else if constexpr (N == 128 && BF16) wgmma_m64n128k16_bf16(d, da, db, acc);
    else if constexpr (N == 128) wgmma_m64n128k16_f16(d, da, db, acc);
    else if constexpr (BF16) wgmma_m64n256k16_bf16(d, da, db, acc);
    else wgmma_m64n256k16_f16(d, da, db, acc);
}

template <int N, bool BF16>
__device__ void gemm_tile(const TmaDescriptor* desc_a, const TmaDescriptor* desc_b, float* D,
                          int swizzled, int k_steps, int skip_wait, unsigned char* smem,
                          uint64_t* bar) {
    const int K = kWgmmaK * k_steps;
    unsigned char* sa = smem;
    unsigned char* sb = smem + kWgmmaM * K * 2;  // a multiple of 1024 bytes
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(bar, (kWgmmaM + N) * K * 2);
        if (swizzled) {  // one box each: rows x 64 K values, 128B-swizzled
            tma_load_2d(sa, desc_a, 0, 0, bar);
            tma_load_2d(sb, desc_b, 0, 0, bar);
        } else {  // K/8 boxes of rows x 8 K values: slab c is core matrices along M/N
            for (int c = 0; c < K / kCoreCols; ++c) {
                tma_load_2d(sa + c * kWgmmaM * kCoreRowBytes, desc_a, c * kCoreCols, 0, bar);
                tma_load_2d(sb + c * N * kCoreRowBytes, desc_b, c * kCoreCols, 0, bar);
            }
        }
    }
    if (skip_wait != 1) mbarrier_wait_parity(bar, 0);
    float d[N / 2];
    for (int r = 0; r < N / 2; ++r) d[r] = CUDART_NAN_F;  // scale_d = 0 must ignore these
    wgmma_fence();
    for (int s = 0; s < k_steps; ++s) {
        uint64_t da, db;
        if (swizzled) {
            da = make_smem_desc(sa + s * kWgmmaK * 2, kSmemSwizzle128B, kCoreRowBytes,
                                kSwizzleAtomBytes);
            db = make_smem_desc(sb + s * kWgmmaK * 2, kSmemSwizzle128B, kCoreRowBytes,
                                kSwizzleAtomBytes);
        } else {
            da = make_smem_desc(sa + 2 * s * kWgmmaM * kCoreRowBytes, kSmemSwizzleNone,
                                kWgmmaM * kCoreRowBytes, kCoreMatrixBytes);
            db = make_smem_desc(sb + 2 * s * N * kCoreRowBytes, kSmemSwizzleNone,
                                N * kCoreRowBytes, kCoreMatrixBytes);
        }
        wgmma_step<N, BF16>(d, da, db, s > 0);
    }
    wgmma_commit_group();
    if (skip_wait != 2) wgmma_wait_group<0>();
    store_accumulators<N>(d, D);
}
#endif

// D[64, n] f32 = A[64, K] @ B[n, K]^T (both row-major bf16/f16 bits), K = 16 * k_steps:
// TMA loads A and B into shared memory (swizzled: 128B swizzle, K = 64; else the no-swizzle
// core-matrix layout), one mbarrier, k_steps wgmma m64n{n}k16. Planted bugs (harness only):
// skip_wait = 1 reads the tiles without waiting on the barrier, skip_wait = 2 reads the
// accumulators without wgmma_wait_group. n in {64, 128, 256}; blockDim = 128;
// dynamic smem (64 + n) * K * 2 + 1024.
extern "C" __global__ void __launch_bounds__(128) tma_wgmma_gemm(
    const TmaDescriptor* desc_a, const TmaDescriptor* desc_b, float* D, int n, int swizzled,
    int is_bf16, int k_steps, int skip_wait) {
#if PAGEDRUN_HAS_HOPPER
    DYNAMIC_SMEM(unsigned char, smem_raw);
    __shared__ __align__(8) uint64_t bar;
    unsigned char* smem = align_up_1024(smem_raw);
    if (threadIdx.x == 0) mbarrier_init(&bar, 1);
    __syncthreads();
    if (n == 64 && is_bf16) gemm_tile<64, true>(desc_a, desc_b, D, swizzled, k_steps, skip_wait, smem, &bar);
    else if (n == 64) gemm_tile<64, false>(desc_a, desc_b, D, swizzled, k_steps, skip_wait, smem, &bar);
    else if (n == 128 && is_bf16) gemm_tile<128, true>(desc_a, desc_b, D, swizzled, k_steps, skip_wait, smem, &bar);
    else if (n == 128) gemm_tile<128, false>(desc_a, desc_b, D, swizzled, k_steps, skip_wait, smem, &bar);
    else if (is_bf16) gemm_tile<256, true>(desc_a, desc_b, D, swizzled, k_steps, skip_wait, smem, &bar);
    else gemm_tile<256, false>(desc_a, desc_b, D, swizzled, k_steps, skip_wait, smem, &bar);
#else
    __trap();
#endif
}

// `rounds` phases of one barrier counting every thread: each round a thread writes a value,
// arrives, waits for the round's phase (try_wait loop on odd rounds) and reads its neighbour's
// value into out[round * blockDim + t]. blockDim <= 64.
extern "C" __global__ void mbarrier_phases_probe(int* out, int rounds) {
#if PAGEDRUN_HAS_HOPPER
    __shared__ __align__(8) uint64_t bar;
    __shared__ int vals[64];
    int t = threadIdx.x, nt = blockDim.x;
    if (t == 0) mbarrier_init(&bar, nt);
    __syncthreads();
    for (int p = 0; p < rounds; ++p) {
        vals[t] = 1000 * t + p;
        mbarrier_arrive(&bar);
        if (p % 2) {
            while (!mbarrier_try_wait_parity(&bar, p & 1)) {
            }
        } else {
            mbarrier_wait_parity(&bar, p & 1);
        }
        out[p * nt + t] = vals[(t + 1) % nt];
        __syncthreads();  // everyone has read before the next round overwrites
    }
#else
    __trap();
#endif
}

// Planted deadlocks (harness only; they would hang a GPU). mode 0: a barrier counting 2
// arrivals gets 1; mode 1: waits on the phase after the last completed one. blockDim = 32.
extern "C" __global__ void mbarrier_deadlock_probe(int mode) {
#if PAGEDRUN_HAS_HOPPER
    __shared__ __align__(8) uint64_t bar;
    if (threadIdx.x == 0) mbarrier_init(&bar, mode == 0 ? 2 : blockDim.x);
    __syncthreads();
    if (mode == 0) {
        if (threadIdx.x == 0) mbarrier_arrive(&bar);
    } else {
        mbarrier_arrive(&bar);
        mbarrier_wait_parity(&bar, 0);
    }
    mbarrier_wait_parity(&bar, mode == 0 ? 0 : 1);
#else
    __trap();
#endif
}
