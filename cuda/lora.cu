// lora.cu -- multi-LoRA shrink and expand over a step's tokens grouped by adapter slot (Punica's
// SGMV: a prefill segment of one adapter is a small GEMM; a decode token is a one-row tile, the
// BGMV case, same kernels). The numpy reference and the cpu path: runtime/lora/lora_ops.py.
//
// Token grouping (built on the host once per step, runtime/kernels/lora.py: lora_tile_plan):
//   sorted_token_ids [N] int32 -- tokens that have an adapter, sorted by slot (stable); tokens
//                                 without one (slot -1) are not listed and cost nothing.
//   tile_slots       [num_tiles] int32 -- the slot of each tile (every slot a tile names holds a
//                                 loaded adapter; other slots are never read).
//   tile_starts      [num_tiles + 1] int32 -- tile i covers sorted positions
//                                 [tile_starts[i], tile_starts[i + 1]): 1..16 tokens of one slot.
//
// lora_shrink_DT -- s[p, c] = sum_k x[sorted_token_ids[p], k] * lora_a[slot, c, k], fp32.
//   x       [num_tokens, in_features] T (the layer input; gathered, never permuted in memory)
//   lora_a  [num_slots, num_cols, in_features] T (num_cols = num_slices * rank; slice i's A in
//           rows [i * rank, (i + 1) * rank), zero-padded past the adapter's own rank)
//   s       [N, num_cols] f32 (sorted order, unrounded: the expand reads it)
//   Launch: grid (ceil(num_cols / 16), num_tiles), block 256; thread (m = tid / 16, c = tid % 16)
//   owns one output; K in chunks of 64 through padded shared tiles (x 16 x 65, A 16 x 65 f32:
//   8.3 KB static), zero-filled past the tile's rows, num_cols and in_features.
//
// lora_expand_DT -- y[t, o] = round_T(y[t, o] + scale * sum_j s[p, i * rank + j] *
//   lora_b[slot, o, j]) for t = sorted_token_ids[p] and o in slice i (i = (o >= slice_start1) +
//   (o >= slice_start2)); j < rank.
//   y       [num_tokens, out_features] T, the base output, updated in place (rows of tokens
//           without an adapter are not touched; each (t, o) is written by exactly one thread)
//   s       [N, num_cols] f32 from lora_shrink; num_cols = num_slices * rank, num_slices <= 3
//   lora_b  [num_slots, out_features, rank] T (row o of slice i multiplies slice i's rank
//           columns of s; the adapter's scale is usually folded in, `scale` multiplies on top)
//   slice_start1, slice_start2: output column where slice 1 / slice 2 start (out_features when
//           the target has fewer slices: QKV [q | k | v], gate-up [gate | up], o / down one).
//   Launch: grid (ceil(out_features / 64), num_tiles), block 256; thread (r0 = tid / 64,
//   o = tid % 64) owns column o of tokens r0, r0 + 4, r0 + 8, r0 + 12. rank in chunks of 32:
//   s chunk [16][3][32] and B chunk [64][33] f32 in static shared memory (14.6 KB), so any rank
//   works; B rows are read once per tile, not once per token.
//
// Instantiations (extern "C"; DT in {f32, f16, bf16}, T float / __half / __nv_bfloat16):
//   lora_shrink_DT(s, x, lora_a, sorted_token_ids, tile_slots, tile_starts, in_features,
//                  num_cols)
//   lora_expand_DT(y, s, lora_b, sorted_token_ids, tile_slots, tile_starts, out_features, rank,
//                  num_cols, slice_start1, slice_start2, scale)
// Scalars int, scale float. Launched by runtime/kernels/lora.py: lora_shrink, lora_expand.
//
// Next (not done): tensor-core shrink for long prefill segments (a 16-row mma tile), split-K
// shrink for decode-only steps at large hidden sizes (one tile per token leaves the A loads on
// few CTAs), fusing shrink and expand for the one-slice targets.
//
// Register budget: 96 per thread (expand: 80 on sm_80, 62 on sm_90, 3 CTAs of 256 per SM at
// 80); the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace lora_ops {

constexpr int kThreads = 256;
constexpr int kTileTokens = 16;                  // tokens per tile (lora_tile_plan's step)
constexpr int kShrinkCols = kThreads / kTileTokens;  // rank columns per shrink CTA
constexpr int kShrinkK = 64;                     // in_features per shared chunk
constexpr int kExpandCols = 64;                  // output columns per expand CTA
constexpr int kExpandRowGroups = kThreads / kExpandCols;              // 4
constexpr int kTokensPerThread = kTileTokens / kExpandRowGroups;      // 4
constexpr int kRankChunk = 32;
constexpr int kMaxSlices = 3;                    // QKV
constexpr int kPad = 1;                          // odd row pitch: conflict-free column reads

template <typename T>
__device__ __forceinline__ void shrink(float* s, const T* x, const T* lora_a,
                                       const int* sorted_token_ids, const int* tile_slots,
                                       const int* tile_starts, int in_features, int num_cols) {
    __shared__ float s_x[kTileTokens][kShrinkK + kPad];
    __shared__ float s_a[kShrinkCols][kShrinkK + kPad];
    const int tile = blockIdx.y;
    const int row0 = tile_starts[tile];
    const int rows = tile_starts[tile + 1] - row0;
    const int col0 = blockIdx.x * kShrinkCols;
    const T* a_slot = lora_a + static_cast<long long>(tile_slots[tile]) * num_cols * in_features;
    const int m = threadIdx.x / kShrinkCols, c = threadIdx.x % kShrinkCols;
    float acc = 0.f;
    for (int k0 = 0; k0 < in_features; k0 += kShrinkK) {
        for (int i = threadIdx.x; i < kTileTokens * kShrinkK; i += kThreads) {
            const int r = i / kShrinkK, kk = i % kShrinkK, k = k0 + kk;
            float v = 0.f;
            if (r < rows && k < in_features)
                v = to_f32(x[static_cast<long long>(sorted_token_ids[row0 + r]) * in_features + k]);
            s_x[r][kk] = v;
        }
        for (int i = threadIdx.x; i < kShrinkCols * kShrinkK; i += kThreads) {
            const int r = i / kShrinkK, kk = i % kShrinkK, k = k0 + kk;
            float v = 0.f;
            if (col0 + r < num_cols && k < in_features)
                v = to_f32(a_slot[static_cast<long long>(col0 + r) * in_features + k]);
            s_a[r][kk] = v;
        }
        __syncthreads();
#pragma unroll 16
        for (int kk = 0; kk < kShrinkK; ++kk) acc += s_x[m][kk] * s_a[c][kk];
        __syncthreads();
    }
    if (m < rows && col0 + c < num_cols)
        s[static_cast<long long>(row0 + m) * num_cols + col0 + c] = acc;
}

template <typename T>
__device__ __forceinline__ void expand(T* y, const float* s, const T* lora_b,
                                       const int* sorted_token_ids, const int* tile_slots,
                                       const int* tile_starts, int out_features, int rank,
                                       int num_cols, int slice_start1, int slice_start2,
                                       float scale) {
    __shared__ float s_s[kTileTokens][kMaxSlices][kRankChunk];
    __shared__ float s_b[kExpandCols][kRankChunk + kPad];
    const int tile = blockIdx.y;
    const int row0 = tile_starts[tile];
    const int rows = tile_starts[tile + 1] - row0;
    const int col0 = blockIdx.x * kExpandCols;
    const int num_slices = num_cols / rank;
    const T* b_slot = lora_b + static_cast<long long>(tile_slots[tile]) * out_features * rank;
    const int oc = threadIdx.x % kExpandCols, r0 = threadIdx.x / kExpandCols;
    const int o = col0 + oc;
    const int slice = (o >= slice_start1) + (o >= slice_start2);  // in [0, kMaxSlices)
    float acc[kTokensPerThread];
#pragma unroll
    for (int t = 0; t < kTokensPerThread; ++t) acc[t] = 0.f;
    for (int j0 = 0; j0 < rank; j0 += kRankChunk) {
        for (int i = threadIdx.x; i < kTileTokens * kMaxSlices * kRankChunk; i += kThreads) {
            const int r = i / (kMaxSlices * kRankChunk);
            const int sl = (i / kRankChunk) % kMaxSlices;
            const int jj = i % kRankChunk, j = j0 + jj;
            float v = 0.f;
            if (r < rows && sl < num_slices && j < rank)
                v = s[static_cast<long long>(row0 + r) * num_cols + sl * rank + j];
            s_s[r][sl][jj] = v;
        }
        for (int i = threadIdx.x; i < kExpandCols * kRankChunk; i += kThreads) {
            const int cc = i / kRankChunk, jj = i % kRankChunk, j = j0 + jj;
            float v = 0.f;
            if (col0 + cc < out_features && j < rank)
                v = to_f32(b_slot[static_cast<long long>(col0 + cc) * rank + j]);
            s_b[cc][jj] = v;
        }
        __syncthreads();
        for (int jj = 0; jj < kRankChunk; ++jj) {
            const float b = s_b[oc][jj];
#pragma unroll
            for (int t = 0; t < kTokensPerThread; ++t)
                acc[t] += s_s[r0 + t * kExpandRowGroups][slice][jj] * b;
        }
        __syncthreads();
    }
    if (o >= out_features) return;  // after the last barrier
#pragma unroll
    for (int t = 0; t < kTokensPerThread; ++t) {
        const int r = r0 + t * kExpandRowGroups;
        if (r < rows) {
            const long long at =
                static_cast<long long>(sorted_token_ids[row0 + r]) * out_features + o;
            y[at] = from_f32<T>(to_f32(y[at]) + scale * acc[t]);
        }
    }
}

}  // namespace lora_ops

#define PAGEDRUN_LORA(DT, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(lora_ops::kThreads)                             \
        lora_shrink_##DT(float* s, const T* x, const T* lora_a, const int* sorted_token_ids,    \
                         const int* tile_slots, const int* tile_starts, int in_features,        \
                         int num_cols) {                                                         \
        lora_ops::shrink<T>(s, x, lora_a, sorted_token_ids, tile_slots, tile_starts,            \
                            in_features, num_cols);                                              \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(lora_ops::kThreads)                             \
        lora_expand_##DT(T* y, const float* s, const T* lora_b, const int* sorted_token_ids,    \
                         const int* tile_slots, const int* tile_starts, int out_features,       \
                         int rank, int num_cols, int slice_start1, int slice_start2,            \
                         float scale) {                                                          \
        lora_ops::expand<T>(y, s, lora_b, sorted_token_ids, tile_slots, tile_starts,            \
                            out_features, rank, num_cols, slice_start1, slice_start2, scale);   \
    }

PAGEDRUN_LORA(f32, float)
PAGEDRUN_LORA(f16, __half)
PAGEDRUN_LORA(bf16, __nv_bfloat16)
