// moe.cu -- the fused mixture-of-experts path: routing, permutation of (token, k) pairs by
// expert, a grouped tensor-core GEMM over the experts' contiguous row segments (gate-up with
// SiLU-mul in its epilogue, then down), and the weighted un-permute reduce. The backend ops
// moe_route / moe_experts (contract: runtime/backends/base.py, numpy reference numpy_ops.py).
//
// Pairs: p = t * top_k + k for token t and choice k; num_pairs P = num_tokens * top_k.
// Slots: positions in expert-sorted order, stable: by expert, then by p (token, then k), so the
// order -- and every sum below -- is deterministic (no float atomics anywhere).
//
// moe_route_f32 -- per token row t (one warp per row):
//   p[e] = softmax(router_logits[t])[e] in fp32 (max-subtracted, expf, divided by the sum);
//   top_k experts by repeated warp argmax (ties: the lower id; order: decreasing p);
//   topk_weights[t, k] = p[id], divided by the sum of the chosen (in k order) when renormalize.
//   A NaN in a row gives weights 0 and in-range ids (the first top_k experts).
//   Pointers: topk_ids [num_tokens, top_k] int32, topk_weights [num_tokens, top_k] f32,
//   router_logits [num_tokens, num_experts] f32.
//   Launch: grid (ceil(num_tokens / 4)), block 128; dynamic smem 4 * num_experts * 4 bytes.
//
// moe_count_experts -- expert_counts[e] = #{p : topk_ids[p] == e}; grid (num_experts),
//   block 256, one __syncthreads_count per 256 pairs. topk_ids [P] int32 (in [0, E): moe_route
//   guarantees it, the wrapper checks host ids), expert_counts [E] int32.
// moe_scatter -- CTA e: offset = sum of lower experts' counts; stable compaction of its pairs
//   (ballot + popc within a warp, warp totals in shared memory) into
//   sorted_pair_ids [P] int32 (slot -> p) and pair_slots [P] int32 (p -> slot);
//   expert_offsets [E + 1] int32 (segment of expert e: [offsets[e], offsets[e + 1]));
//   the grouped GEMM's tile table: tile_experts / tile_rows [max_tiles] int32, one entry per
//   kGemmBM rows of each non-empty expert (its first slot), ordered by expert; CTA E - 1 marks
//   the rest -1 (max_tiles = ceil(P / 64) + min(E, P) bounds sum_e ceil(count_e / 64)).
//   grid (num_experts), block 256. Each CTA reads all P ids: E x P reads, L2-resident.
//
// moe_gate_up_DT -- grouped GEMM + SiLU-mul: for each slot s of expert e and column j < I,
//   act[s, j] = silu(g) * u,  g = x[t] . w_gate_up[e, j],  u = x[t] . w_gate_up[e, I + j],
//   t = sorted_pair_ids[s] / top_k (the gather is fused into the A-tile loads: x is never
//   permuted in memory). A CTA's 64 B-tile rows are 32 gate rows and the same 32 columns' up
//   rows, arranged so that one thread's accumulators hold both g and u of its outputs.
//   x [num_tokens, H] T; w_gate_up [E, 2I, H] T (HF [out, in] per expert: gate rows, then up);
//   act [P, I] T (sorted order). grid (ceil(I / 32), max_tiles).
// moe_down_DT -- grouped GEMM: down_out[s, h] = act[s] . w_down[e, h] (fp32 out, unrounded
//   before the weighted sum). act [P, I] T; w_down [E, H, I] T; down_out [P, H] f32.
//   grid (ceil(H / 64), max_tiles).
//   Both: CTA (n block, tile i) serves tile_experts[i] (-1: exits) rows tile_rows[i] ..
//   min(+64, expert_offsets[e + 1]). Tensor-core path (f16 / bf16): CTA tile 64 x 64 x 32,
//   4 warps as 2 x 2, each 32 x 32 = 2 x 4 mma.sync m16n8k16 tiles (32 fp32 accumulators); a
//   3-stage cp.async pipeline; gemm.cu's XOR swizzle of K-major tiles (chunk ^ ((row >> 1) & 3))
//   so every ldmatrix hits 8 distinct bank quads. Needs K % 8 == 0 (H and I) and 16-byte
//   aligned bases (the wrapper checks). Dynamic smem 3 * (64 + 64) * 32 * 2 = 24,576 bytes.
//   fp32 path (the test instantiation): same tiles and mapping, SIMT, bounds-checked loads,
//   static smem, each thread 4 rows x 8 B-tile columns.
//   The 64-row tile (gemm.cu uses 128) halves the padding of small experts' segments: at decode
//   an expert gets a handful of rows.
//
// moe_unpermute_reduce_DT -- y[t, h] = sum_k topk_weights[t, k] * down_out[pair_slots[t*K+k], h]
//   in k order, fp32, one rounding to T. y [num_tokens, H] T; grid (num_tokens, ceil(H / 256)),
//   block 256.
//
// Instantiations (extern "C"; DT in {f32, f16, bf16}): moe_route_f32, moe_count_experts,
// moe_scatter, moe_gate_up_DT, moe_down_DT, moe_unpermute_reduce_DT. Scalars int.
// Signatures: moe_route_f32(topk_ids, topk_weights, router_logits, num_tokens, num_experts,
// top_k, renormalize); moe_count_experts(expert_counts, topk_ids, num_pairs);
// moe_scatter(sorted_pair_ids, pair_slots, expert_offsets, tile_experts, tile_rows, topk_ids,
// expert_counts, num_pairs, num_experts, max_tiles); moe_gate_up_DT(act, x, w_gate_up,
// sorted_pair_ids, expert_offsets, tile_experts, tile_rows, top_k, intermediate, hidden);
// moe_down_DT(down_out, act, w_down, expert_offsets, tile_experts, tile_rows, hidden,
// intermediate); moe_unpermute_reduce_DT(y, down_out, topk_weights, pair_slots, top_k, hidden).
// Launched by runtime/kernels/moe.py: moe_route, moe_permute, moe_experts.
//
// Next (not done): a persistent grouped GEMM (tiles from a work counter, no empty CTAs),
// 128-row tiles for prefill-sized segments, paired stores in the epilogues, fusing the routing
// weight into the down epilogue, expert parallelism.
//
// Register budget: 128 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"
#include "reduce.cuh"
#include "ptx.cuh"

namespace moe_ops {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;
constexpr int kRouteThreads = 128;
constexpr int kRouteRowsPerCta = kRouteThreads / kWarpSize;  // one token row per warp
constexpr int kPermuteThreads = 256;
constexpr int kPermuteWarps = kPermuteThreads / kWarpSize;
constexpr int kReduceThreads = 256;

constexpr int kGemmThreads = 128;
constexpr int kBM = 64;                      // slots per tile (tile_rows step)
constexpr int kBN = 64;                      // B-tile rows
constexpr int kBK = 32;
constexpr int kStages = 3;
constexpr int kWarpsN = 2;                   // warp grid 2 x 2
constexpr int kWarpM = 32;
constexpr int kWarpN = 32;
constexpr int kMTiles = kWarpM / 16;
constexpr int kNTiles = kWarpN / 8;
constexpr int kHalfWarpN = kWarpN / 2;       // gate-up: a warp's gate (then up) columns
constexpr int kGateUpCols = kBN / 2;         // gate-up: output columns per CTA
constexpr int kChunkElems = 8;               // 16 bytes of 16-bit elements
constexpr int kChunkBytes = 16;
constexpr int kKChunks = kBK / kChunkElems;
constexpr int kStageElems = (kBM + kBN) * kBK;
constexpr int kLoadsPerThread = kBM * kKChunks / kGemmThreads;  // A (and B) chunks: 2
constexpr int kSimtRows = 4;                 // fp32 path: rows per thread
constexpr int kSimtColGroups = 8;            // fp32 path: threads along n (4 + 4 columns each)
constexpr int kSimtCols = 4;
constexpr int kSimtPad = 4;

enum Mode { kGateUp = 0, kDown = 1 };

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// ------------------------------------------------------------------ routing
__device__ __forceinline__ void route(int* topk_ids, float* topk_weights, const float* logits,
                                      int num_tokens, int num_experts, int top_k,
                                      int renormalize) {
    DYNAMIC_SMEM(float, smem);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int t = blockIdx.x * kRouteRowsPerCta + warp;
    if (t >= num_tokens) return;  // whole warps only; the kernel has no __syncthreads
    float* prob = smem + warp * num_experts;
    const float* row = logits + static_cast<long long>(t) * num_experts;
    float m = -CUDART_INF_F;
    for (int e = lane; e < num_experts; e += kWarpSize) m = fmaxf(m, row[e]);
    m = reduce::warp_max(m);
    float s = 0.f;
    for (int e = lane; e < num_experts; e += kWarpSize) {
        const float w = expf(row[e] - m);
        prob[e] = w;
        s += w;
    }
    s = reduce::warp_sum(s);
    // Normalised before selection, so ties are decided on the probabilities numpy compares.
    for (int e = lane; e < num_experts; e += kWarpSize) {
        const float p = prob[e] / s;
        prob[e] = p == p ? p : 0.f;  // NaN: never chosen over a number, ids stay in range
    }
    __syncwarp();
    int* ids = topk_ids + static_cast<long long>(t) * top_k;
    float* weights = topk_weights + static_cast<long long>(t) * top_k;
    float kept = 0.f;
    for (int k = 0; k < top_k; ++k) {
        float v = -1.f;  // chosen experts hold -1; probabilities are >= 0
        int id = num_experts;
        for (int e = lane; e < num_experts; e += kWarpSize)
            if (prob[e] > v) {  // strictly: the first (lowest id) maximum of the lane
                v = prob[e];
                id = e;
            }
        reduce::warp_argmax(v, id);
        __syncwarp();
        if (lane == 0) {
            prob[id] = -1.f;
            ids[k] = id;
            weights[k] = v;
        }
        kept += v;
        __syncwarp();
    }
    if (renormalize && lane == 0)
        for (int k = 0; k < top_k; ++k) weights[k] = weights[k] / kept;
}

// ------------------------------------------------------------------ permutation
__device__ __forceinline__ void count_experts(int* expert_counts, const int* topk_ids,
                                              int num_pairs) {
    const int e = blockIdx.x;
    int count = 0;
    for (int base = 0; base < num_pairs; base += kPermuteThreads) {
        const int p = base + threadIdx.x;
        count += __syncthreads_count(p < num_pairs && topk_ids[p] == e);
    }
    if (threadIdx.x == 0) expert_counts[e] = count;
}

__device__ __forceinline__ void scatter(int* sorted_pair_ids, int* pair_slots,
                                        int* expert_offsets, int* tile_experts, int* tile_rows,
                                        const int* topk_ids, const int* expert_counts,
                                        int num_pairs, int num_experts, int max_tiles) {
    __shared__ int s_warp[kPermuteWarps];
    const int e = blockIdx.x;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    int before = 0, tiles_before = 0;
    for (int j = threadIdx.x; j < e; j += kPermuteThreads) {
        const int c = expert_counts[j];
        before += c;
        tiles_before += (c + kBM - 1) / kBM;
    }
    before = reduce::block_sum<kPermuteThreads>(before, s_warp);
    tiles_before = reduce::block_sum<kPermuteThreads>(tiles_before, s_warp);
    __syncthreads();  // every thread has read the sums out of s_warp; the chunk loop rewrites it

    int count = 0;
    for (int base = 0; base < num_pairs; base += kPermuteThreads) {
        const int p = base + threadIdx.x;
        const bool mine = p < num_pairs && topk_ids[p] == e;
        const unsigned ballot = __ballot_sync(kFullMask, mine);
        if (lane == 0) s_warp[warp] = __popc(ballot);
        __syncthreads();
        int warp_prefix = 0, chunk_total = 0;
#pragma unroll
        for (int w = 0; w < kPermuteWarps; ++w) {
            const int c = s_warp[w];
            warp_prefix += w < warp ? c : 0;
            chunk_total += c;
        }
        if (mine) {
            const int slot = before + count + warp_prefix + __popc(ballot & ((1u << lane) - 1u));
            sorted_pair_ids[slot] = p;
            pair_slots[p] = slot;
        }
        count += chunk_total;
        __syncthreads();  // s_warp is rewritten by the next chunk
    }
    if (threadIdx.x == 0) {
        expert_offsets[e] = before;
        if (e == num_experts - 1) expert_offsets[num_experts] = before + count;
    }
    const int my_tiles = (count + kBM - 1) / kBM;
    for (int j = threadIdx.x; j < my_tiles; j += kPermuteThreads) {
        tile_experts[tiles_before + j] = e;
        tile_rows[tiles_before + j] = before + j * kBM;
    }
    if (e == num_experts - 1)
        for (int j = tiles_before + my_tiles + threadIdx.x; j < max_tiles; j += kPermuteThreads) {
            tile_experts[j] = -1;
            tile_rows[j] = 0;
        }
}

// ------------------------------------------------------------------ grouped GEMM
// B-tile row n_local (0..63) -> the row of the expert's weight it holds and the output column
// it feeds. Gate-up: within each warp's 32 rows, the first 16 are gate rows and the next 16 the
// up rows of the same 16 columns, so accumulator n-tiles nt and nt + 2 pair up in one thread.
template <int MODE>
__device__ __forceinline__ int out_col(int n_local) {
    if constexpr (MODE == kGateUp)
        return blockIdx.x * kGateUpCols + (n_local / kWarpN) * kHalfWarpN + n_local % kHalfWarpN;
    else
        return blockIdx.x * kBN + n_local;
}

template <int MODE>
__device__ __forceinline__ int weight_row(int n_local, int n_out) {
    const int col = out_col<MODE>(n_local);
    if (col >= n_out) return -1;
    if constexpr (MODE == kGateUp) return (n_local % kWarpN) >= kHalfWarpN ? n_out + col : col;
    else return col;
}

struct Tile {
    int expert;  // -1: nothing to do
    int m0;      // first slot
    int rows;    // slots in this tile (<= kBM)
};

__device__ __forceinline__ Tile load_tile_info(const int* expert_offsets, const int* tile_experts,
                                               const int* tile_rows) {
    Tile tile;
    tile.expert = tile_experts[blockIdx.y];
    tile.m0 = tile.expert < 0 ? 0 : tile_rows[blockIdx.y];
    tile.rows = tile.expert < 0 ? 0 : min(kBM, expert_offsets[tile.expert + 1] - tile.m0);
    return tile;
}

// Row of `a` that slot m0 + r reads (-1 past the tile): gate-up gathers the token's x row.
template <int MODE>
__device__ __forceinline__ int a_row(const Tile& tile, int r, const int* sorted_pair_ids,
                                     int top_k) {
    if (r >= tile.rows) return -1;
    if constexpr (MODE == kGateUp) return sorted_pair_ids[tile.m0 + r] / top_k;
    else return tile.m0 + r;
}

__device__ __forceinline__ int kmajor_offset(int row, int chunk) {
    return row * kBK + ((chunk ^ ((row >> 1) & 3)) * kChunkElems);
}

template <typename OutT>
__device__ __forceinline__ void store_out(OutT* out, const Tile& tile, int r, int col, int n_out,
                                          float v) {
    if (r < tile.rows && col < n_out)
        out[static_cast<long long>(tile.m0 + r) * n_out + col] = from_f32<OutT>(v);
}

// Tensor-core path. n_out: I (gate-up) or H (down); K: H (gate-up) or I (down).
template <typename T, typename OutT, int MODE>
__device__ __forceinline__ void grouped_mma(OutT* out, const T* __restrict__ a,
                                            const T* __restrict__ w,
                                            const int* __restrict__ sorted_pair_ids,
                                            const int* __restrict__ expert_offsets,
                                            const int* __restrict__ tile_experts,
                                            const int* __restrict__ tile_rows, int top_k,
                                            int n_out, int K) {
    const Tile tile = load_tile_info(expert_offsets, tile_experts, tile_rows);
    if (tile.expert < 0) return;
    DYNAMIC_SMEM(T, smem);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
    const long long w_rows = MODE == kGateUp ? 2LL * n_out : n_out;
    const T* b = w + static_cast<long long>(tile.expert) * w_rows * K;
    // This thread's chunks: the same (row, chunk) of every k-tile, so the gathered row
    // pointers are computed once.
    const T* a_src[kLoadsPerThread];
    const T* b_src[kLoadsPerThread];
    int s_row[kLoadsPerThread], s_chunk[kLoadsPerThread];
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
        const int idx = threadIdx.x + i * kGemmThreads;
        s_row[i] = idx / kKChunks;
        s_chunk[i] = idx % kKChunks;
        const int ar = a_row<MODE>(tile, s_row[i], sorted_pair_ids, top_k);
        const int br = weight_row<MODE>(s_row[i], n_out);
        a_src[i] = ar < 0 ? nullptr : a + static_cast<long long>(ar) * K;
        b_src[i] = br < 0 ? nullptr : b + static_cast<long long>(br) * K;
    }
    const int num_k_tiles = (K + kBK - 1) / kBK;
    auto load_stage = [&](int kt) {
        T* s_a = smem + (kt % kStages) * kStageElems;
        T* s_b = s_a + kBM * kBK;
#pragma unroll
        for (int i = 0; i < kLoadsPerThread; ++i) {
            const int k = kt * kBK + s_chunk[i] * kChunkElems;
            const bool a_ok = a_src[i] != nullptr && k < K;
            const bool b_ok = b_src[i] != nullptr && k < K;
            cp_async_16_zfill(s_a + kmajor_offset(s_row[i], s_chunk[i]),
                              a_ok ? a_src[i] + k : a, a_ok ? kChunkBytes : 0);
            cp_async_16_zfill(s_b + kmajor_offset(s_row[i], s_chunk[i]),
                              b_ok ? b_src[i] + k : b, b_ok ? kChunkBytes : 0);
        }
    };

    float acc[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_k_tiles) load_stage(s);
        cp_async_commit();
    }
    for (int kt = 0; kt < num_k_tiles; ++kt) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile kt visible to all; stage kt - 1 free for the next load
        if (kt + kStages - 1 < num_k_tiles) load_stage(kt + kStages - 1);
        cp_async_commit();
        const T* s_a = smem + (kt % kStages) * kStageElems;
        const T* s_b = s_a + kBM * kBK;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            uint32_t a_frag[kMTiles][4];
            uint32_t b_frag[kNTiles][2];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const int row = warp_m * kWarpM + mt * 16 + (lane & 15);
                ldmatrix_x4(a_frag[mt], s_a + kmajor_offset(row, kk * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int np = 0; np < kNTiles / 2; ++np) {
                uint32_t r[4];
                const int nrow = warp_n * kWarpN + np * 16 + (lane >> 4) * 8 + (lane & 7);
                ldmatrix_x4(r, s_b + kmajor_offset(nrow, kk * 2 + ((lane >> 3) & 1)));
                b_frag[2 * np][0] = r[0];
                b_frag[2 * np][1] = r[1];
                b_frag[2 * np + 1][0] = r[2];
                b_frag[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt)
                    mma_m16n8k16_acc<T>(acc[mt][nt], a_frag[mt], b_frag[nt]);
        }
    }
    cp_async_wait_all();

    // Accumulator j of n-tile nt: row (lane >> 2) + 8 (j >> 1), B-tile row nt * 8 + 2 (lane & 3)
    // + (j & 1) of the warp's 32.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = warp_m * kWarpM + mt * 16 + (lane >> 2) + 8 * (j >> 1);
            if constexpr (MODE == kGateUp) {
#pragma unroll
                for (int nt = 0; nt < kNTiles / 2; ++nt) {
                    const int n_local = warp_n * kWarpN + nt * 8 + 2 * (lane & 3) + (j & 1);
                    store_out(out, tile, r, out_col<MODE>(n_local), n_out,
                              silu(acc[mt][nt][j]) * acc[mt][nt + kNTiles / 2][j]);
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
                    const int n_local = warp_n * kWarpN + nt * 8 + 2 * (lane & 3) + (j & 1);
                    store_out(out, tile, r, out_col<MODE>(n_local), n_out, acc[mt][nt][j]);
                }
            }
        }
}

// fp32 SIMT path (tests and the float32 backends): same tiles, mapping and epilogue.
template <int MODE>
__device__ __forceinline__ void grouped_simt(float* out, const float* __restrict__ a,
                                             const float* __restrict__ w,
                                             const int* __restrict__ sorted_pair_ids,
                                             const int* __restrict__ expert_offsets,
                                             const int* __restrict__ tile_experts,
                                             const int* __restrict__ tile_rows, int top_k,
                                             int n_out, int K) {
    __shared__ float s_a[kBK][kBM + kSimtPad];  // [k][row]
    __shared__ float s_b[kBK][kBN + kSimtPad];  // [k][B-tile row]
    __shared__ int s_a_row[kBM];
    __shared__ int s_b_row[kBN];
    const Tile tile = load_tile_info(expert_offsets, tile_experts, tile_rows);
    if (tile.expert < 0) return;
    const long long w_rows = MODE == kGateUp ? 2LL * n_out : n_out;
    const float* b = w + static_cast<long long>(tile.expert) * w_rows * K;
    for (int i = threadIdx.x; i < kBM; i += kGemmThreads) {
        s_a_row[i] = a_row<MODE>(tile, i, sorted_pair_ids, top_k);
        s_b_row[i] = weight_row<MODE>(i, n_out);
    }
    __syncthreads();
    // Thread (tr, tc): rows 4 tr .. 4 tr + 3; B-tile rows base .. base + 3 and base + 16 ..
    // base + 19, base = (tc / 4) * 32 + (tc % 4) * 4: the mma path's gate / up pairing.
    const int tr = threadIdx.x / kSimtColGroups, tc = threadIdx.x % kSimtColGroups;
    const int base = (tc / 4) * kWarpN + (tc % 4) * kSimtCols;
    float acc[kSimtRows][2 * kSimtCols] = {};
    for (int k0 = 0; k0 < K; k0 += kBK) {
        for (int idx = threadIdx.x; idx < kBK * kBM; idx += kGemmThreads) {
            const int kk = idx % kBK, r = idx / kBK, k = k0 + kk;
            const int ar = s_a_row[r], br = s_b_row[r];
            s_a[kk][r] = (ar >= 0 && k < K) ? a[static_cast<long long>(ar) * K + k] : 0.f;
            s_b[kk][r] = (br >= 0 && k < K) ? b[static_cast<long long>(br) * K + k] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int kk = 0; kk < kBK; ++kk)
#pragma unroll
            for (int i = 0; i < kSimtRows; ++i)
#pragma unroll
                for (int j = 0; j < 2 * kSimtCols; ++j) {
                    const int n_local = base + (j < kSimtCols ? j : kHalfWarpN + j - kSimtCols);
                    acc[i][j] += s_a[kk][tr * kSimtRows + i] * s_b[kk][n_local];
                }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kSimtRows; ++i) {
        const int r = tr * kSimtRows + i;
#pragma unroll
        for (int j = 0; j < kSimtCols; ++j) {
            if constexpr (MODE == kGateUp) {
                store_out(out, tile, r, out_col<MODE>(base + j), n_out,
                          silu(acc[i][j]) * acc[i][j + kSimtCols]);
            } else {
                store_out(out, tile, r, out_col<MODE>(base + j), n_out, acc[i][j]);
                store_out(out, tile, r, out_col<MODE>(base + kHalfWarpN + j), n_out,
                          acc[i][j + kSimtCols]);
            }
        }
    }
}

// ------------------------------------------------------------------ un-permute reduce
template <typename T>
__device__ __forceinline__ void unpermute_reduce(T* y, const float* down_out,
                                                 const float* topk_weights,
                                                 const int* pair_slots, int top_k, int hidden) {
    const int t = blockIdx.x;
    const int h = blockIdx.y * kReduceThreads + threadIdx.x;
    if (h >= hidden) return;
    float sum = 0.f;
    for (int k = 0; k < top_k; ++k) {
        const long long p = static_cast<long long>(t) * top_k + k;
        sum += topk_weights[p] * down_out[static_cast<long long>(pair_slots[p]) * hidden + h];
    }
    y[static_cast<long long>(t) * hidden + h] = from_f32<T>(sum);
}

}  // namespace moe_ops

extern "C" __global__ void __launch_bounds__(moe_ops::kRouteThreads)
    moe_route_f32(int* topk_ids, float* topk_weights, const float* router_logits, int num_tokens,
                  int num_experts, int top_k, int renormalize) {
    moe_ops::route(topk_ids, topk_weights, router_logits, num_tokens, num_experts, top_k,
                   renormalize);
}

extern "C" __global__ void __launch_bounds__(moe_ops::kPermuteThreads)
    moe_count_experts(int* expert_counts, const int* topk_ids, int num_pairs) {
    moe_ops::count_experts(expert_counts, topk_ids, num_pairs);
}

extern "C" __global__ void __launch_bounds__(moe_ops::kPermuteThreads)
    moe_scatter(int* sorted_pair_ids, int* pair_slots, int* expert_offsets, int* tile_experts,
                int* tile_rows, const int* topk_ids, const int* expert_counts, int num_pairs,
                int num_experts, int max_tiles) {
    moe_ops::scatter(sorted_pair_ids, pair_slots, expert_offsets, tile_experts, tile_rows,
                     topk_ids, expert_counts, num_pairs, num_experts, max_tiles);
}

#define PAGEDRUN_MOE_GEMM_16BIT(DT, T)                                                           \
    extern "C" __global__ void __launch_bounds__(moe_ops::kGemmThreads)                          \
        moe_gate_up_##DT(T* act, const T* x, const T* w_gate_up, const int* sorted_pair_ids,    \
                         const int* expert_offsets, const int* tile_experts,                     \
                         const int* tile_rows, int top_k, int intermediate, int hidden) {        \
        moe_ops::grouped_mma<T, T, moe_ops::kGateUp>(act, x, w_gate_up, sorted_pair_ids,         \
                                                     expert_offsets, tile_experts, tile_rows,    \
                                                     top_k, intermediate, hidden);               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(moe_ops::kGemmThreads)                          \
        moe_down_##DT(float* down_out, const T* act, const T* w_down, const int* expert_offsets, \
                      const int* tile_experts, const int* tile_rows, int hidden,                 \
                      int intermediate) {                                                        \
        moe_ops::grouped_mma<T, float, moe_ops::kDown>(down_out, act, w_down, nullptr,           \
                                                       expert_offsets, tile_experts, tile_rows,  \
                                                       1, hidden, intermediate);                 \
    }

PAGEDRUN_MOE_GEMM_16BIT(f16, __half)
PAGEDRUN_MOE_GEMM_16BIT(bf16, __nv_bfloat16)

extern "C" __global__ void __launch_bounds__(moe_ops::kGemmThreads)
    moe_gate_up_f32(float* act, const float* x, const float* w_gate_up,
                    const int* sorted_pair_ids, const int* expert_offsets,
                    const int* tile_experts, const int* tile_rows, int top_k, int intermediate,
                    int hidden) {
    moe_ops::grouped_simt<moe_ops::kGateUp>(act, x, w_gate_up, sorted_pair_ids, expert_offsets,
                                            tile_experts, tile_rows, top_k, intermediate, hidden);
}

extern "C" __global__ void __launch_bounds__(moe_ops::kGemmThreads)
    moe_down_f32(float* down_out, const float* act, const float* w_down,
                 const int* expert_offsets, const int* tile_experts, const int* tile_rows,
                 int hidden, int intermediate) {
    moe_ops::grouped_simt<moe_ops::kDown>(down_out, act, w_down, nullptr, expert_offsets,
                                          tile_experts, tile_rows, 1, hidden, intermediate);
}

#define PAGEDRUN_MOE_REDUCE(DT, T)                                                               \
    extern "C" __global__ void __launch_bounds__(moe_ops::kReduceThreads)                        \
        moe_unpermute_reduce_##DT(T* y, const float* down_out, const float* topk_weights,       \
                                  const int* pair_slots, int top_k, int hidden) {               \
        moe_ops::unpermute_reduce<T>(y, down_out, topk_weights, pair_slots, top_k, hidden);      \
    }

PAGEDRUN_MOE_REDUCE(f32, float)
PAGEDRUN_MOE_REDUCE(f16, __half)
PAGEDRUN_MOE_REDUCE(bf16, __nv_bfloat16)
