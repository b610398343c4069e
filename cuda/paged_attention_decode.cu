// paged_attention_decode.cu -- paged decode attention: one query token per request against
// that request's K/V, scattered over cache blocks through its block table.
//
// Computes, for every request s and query head h (kv head kvh = h / group_size):
//   out[s, h, :] = softmax(scale * q[s, h, :] . K_s^T) V_s
// where K_s, V_s are the first context_lens[s] tokens of request s, token t living in cache
// slot block_tables[s, t / block_size] * block_size + t % block_size. With sliding_window
// W > 0 (Gemma 3's local layers) only the last W of them: tokens context_lens[s] - W ..
// context_lens[s] - 1 (the query sits at context_lens[s] - 1 and sees keys j > pos - W). Blocks
// before the window are neither read nor indexed: the walk starts at the window.
//
// Pointers (T = float | __half | __nv_bfloat16, one T per instantiation; CacheT = T, or uint8_t
// for an fp8 e4m3 cache (the _kv_fp8 instantiations); all contiguous):
//   q             [num_seqs, num_heads, head_dim]                      T
//   k_cache       [num_blocks, block_size, num_kv_heads, head_dim]     CacheT (NHD, kernels.md)
//   v_cache       [num_blocks, block_size, num_kv_heads, head_dim]     CacheT
//   block_tables  [num_seqs, max_blocks_per_seq]                       int32
//   context_lens  [num_seqs]                                           int32 (0 allowed: out = 0)
//   out           [num_seqs, num_heads, head_dim]                      T   (num_splits == 1)
//   partial_out   [num_seqs, num_heads, num_splits, head_dim]          fp32 (num_splits > 1)
//   partial_lse   [num_seqs, num_heads, num_splits]                    fp32, log2 domain
//
// Algorithm (FlashDecoding-style: split-K over the context, a cp.async pipeline of K/V tiles
// through shared memory per split). One CTA owns one (kv head, request, split) and streams
// its tokens in tiles of TILE_TOKENS = kTileSteps x TOKENS_PER_STEP rows of K and of V:
//   * Copy: each tile is 16-byte cp.async chunks of raw cache bytes (thread c copies chunks
//     c, c + 128, ...; a warp's 32 chunks are contiguous row bytes), into stage t % STAGES of
//     a ring of STAGES stages [K tile | V tile], rows [TILE_TOKENS][head_dim] CacheT. Block
//     ids come from the block table one tile ahead of their copies (fetch_blocks), so no issue
//     waits on a table read. Tokens past the split are zero-filled with src_bytes 0 (the cache
//     is not read): an unused, NaN-poisoned slot never reaches shared memory.
//   * Loop over tiles t: wait until tile t's group has landed (cp.async.wait_group STAGES - 2),
//     __syncthreads, refill the stage freed by tile t - 1 with tile t + STAGES - 1, compute on
//     tile t. One barrier per tile; one commit group per tile slot (empty past the end).
//   * Compute: a lane vector covers VEC = 16 / sizeof(T) dims; a "token lane group" of
//     head_dim / VEC lanes (at most 32; f32 d256 gives a lane VECS = 2 vectors, 32 * VEC apart)
//     holds one row, so a warp scores TOKENS_PER_WARP = 32 / lanes rows per step and every
//     shared load of a warp reads whole contiguous rows (no bank conflicts). Each lane group
//     scores its kTileSteps rows of the tile for all GROUP query heads of the kv head (GQA:
//     one K/V read serves the whole group), reduces the dots by shuffles, then rescales its
//     online-softmax state (fp32, base 2, q pre-scaled by scale * log2 e) ONCE per tile and
//     accumulates p V over the same rows. At the end the lane groups merge by shuffles and the
//     warps through shared memory (aliasing the stages, after the last wait).
//   * fp8 caches (CacheT uint8_t) are copied as raw e4m3 bytes and widened after the shared-
//     memory stage, in the same lane layout as T's kernel (a lane reads VEC bytes: uint2 for
//     16-bit T, one word for f32). Why raw: cp.async cannot convert, and the copy and the
//     stage stay half (16-bit T) or a quarter (f32) the size, so the same bytes in flight
//     cover 2-4x the tokens. Widening is exact and cheap (fp8x4_to_f32_scaled: e4m3 bits
//     moved into f16 bits give value x 2^-8, the 2^8 folded into q and the accumulators; NaN
//     codes stay NaN, branch-free): bit-identical to the T cache of the same values (barring
//     fp32-subnormal intermediates, where the 2^8 scaling could round differently).
//
// Tensor-core scoring (paged_attention_decode_tc_*: 16-bit T, groups 4 and 8, T or fp8 cache).
// Why: the SIMT loop above costs 2 x GROUP x head_dim fp32 FMAs per K/V row pair; at group 8
// with a 1-byte cache that is more than the CUDA cores issue at HBM speed (model: 57-61% of
// HBM, issue-bound). FlashInfer's answer for GQA decode: the group's query heads are the M
// rows of mma.m16n8k16 (rows >= group_size and 8..15 zero), so a K/V row costs a few tensor
// instructions whatever the group. Same ring, cp.async copies, split-K, window, -inf for the
// zero-filled rows past the partition, and warp merge as above; what changes:
//   * Geometry (TcTiling): a warp owns WARP_TOKENS consecutive rows of each tile, 16 at d64
//     (two n8 tiles of S, one full k16 step of P V) and 8 at d128 / d256 (one n8 tile; P V's
//     k16 step has 8 zero tokens), so tiles are 64 / 32 / 32 tokens (d256: 32, not 16: every
//     warp needs 8 rows); STAGES by the same rule, (STAGES - 1) x stage >= 24 KiB in flight:
//       cache   head_dim  tile tokens  stage    STAGES  in flight  smem
//       T       64 / 128    64 / 32    16 KiB     3      32 KiB    48 KiB
//       T       256           32       32 KiB     2      32 KiB    64 KiB (opt-in)
//       fp8     64 / 128    64 / 32     8 KiB     4      24 KiB    32 KiB
//       fp8     256           32       16 KiB     3      32 KiB    48 KiB
//     attention.py decode_tc_tiling / decode_tc_smem_bytes (max(ring, merge scratch)).
//   * Stage rows are XOR-swizzled per 16-byte chunk (TcTiling::swizzle, applied by
//     issue_tile), so the fragment reads below are free of bank conflicts.
//   * S = Q K^T. A = Q in registers for the whole CTA (loaded once as raw T bits, unscaled;
//     scale x log2 e is applied to S in fp32). Dim order inside the k16 steps: lane quad
//     column t holds dims 64j + 16t + 4i + {0,1} (a[0] / b[0]) and + {2,3} (a[2] / b[1]) of
//     k-step 4j + i, so a lane's B operands for four k-steps are one contiguous 16-dim run
//     of its K row: two 16-byte loads (T) or one (fp8, widened in registers). B column n =
//     token warp_row0 + 8 nt + n; C c[0..1] = S[head g][tokens 2t, 2t + 1] (c[2..3]: rows
//     8..15, unused).
//   * Online softmax per row on the C fragments: row max over the quad (two shuffles), one
//     rescale per tile of the O fragments, l kept per lane and summed over the quad at the
//     end. P = 2^(s - m) is rounded to T and re-packed from S's C fragments into P V's A
//     fragment without shared memory (as in paged_attention_prefill.cu).
//   * O += P V. B = V by ldmatrix.x4.trans (rows = tokens): T cache, matrix = 8 tokens x 8
//     dims, C c[0..1] of dim tile dt = dims 8 dt + 2t, + 1. fp8 cache, matrix = 8 tokens x 16
//     codes: its b16 elements are code pairs, so a lane receives tokens (2t, 2t + 1) x dims
//     (2g, 2g + 1); widened as (token pair, even dim) and (token pair, odd dim) they are the
//     B fragments of two dim tiles ("even" 16c + 2n, "odd" 16c + 2n + 1), whose C columns
//     are dims 16c + 4t + {0, 2} and {1, 3}. Any column order gives the same per-element sums.
//   * fp8 widening is exact, to T itself (fp8x4_to_pairs): e4m3 bits moved into f16 bits (the
//     SIMT trick: value x 2^-8) or bf16 bits (value x 2^-120; e4m3 subnormals become bf16
//     subnormals), NaN codes forced to NaN, then one HMUL2 by 2^8 / 2^120, exact. Operand
//     type: the mma runs on T (f16 mma for f16 q, bf16 mma for bf16 q). Widening fp8 to f16
//     for a bf16 q would need q converted to f16 (range loss: bf16 goes to 3.4e38, f16 to
//     65504); every e4m3 value is exactly a bf16 (bf16 has e4m3's 3 mantissa bits and a wider
//     exponent), so the bf16 mma sees exactly the T cache's operands: the fp8 and T-cache
//     tensor-core kernels give the same bits (test_fp8_kv_kernels.py asserts it). GPU check
//     pending: the bf16 HMUL2 must keep its subnormal inputs (PTX: bf16 mul / fma support
//     subnormals); test_decode_tc_all_256_codes_exactly fails if it flushes them.
//   Numerics: fp32 accumulation; the one extra rounding against the SIMT kernel is P to T
//   before P V (prefill's, within ATTENTION_TOL of tests/kernels/paged_kernel_inputs.py).
//
// Bytes in flight (Little's law). H200: ~4.8 TB/s x ~700 ns HBM latency = 3.36 MB in flight,
// / 132 SMs = ~25 KB per SM (600 ns: 22 KB, 800 ns: 29 KB). Group 8 fits two CTAs per SM
// (registers), so a CTA must keep >= 12.5-14.5 KB in flight; it aims at kInFlightBytesPerCta
// = 24 KiB, about 2x, as loaded latency is well above idle latency and groups 1-4 fit more
// CTAs. A stage is 2 x TILE_TOKENS x row bytes; STAGES = 1 + ceil(24 KiB / stage bytes),
// clamped to 2..8, of which STAGES - 1 are in flight while one is computed on:
//   cache      T      head_dim  tile tokens  stage    STAGES  in flight  smem (stages)
//   T          16-bit 64/128/256  64/32/16   16 KiB     3      32 KiB     48 KiB
//   T          f32    64/128        32/16    16 KiB     3      32 KiB     48 KiB
//   T          f32    256             16     32 KiB     2      32 KiB     64 KiB (opt-in)
//   fp8        16-bit 64/128/256  64/32/16    8 KiB     4      24 KiB     32 KiB
//   fp8        f32    64/128        32/16     4 KiB     7      24 KiB     28 KiB
//   fp8        f32    256             16      8 KiB     4      24 KiB     32 KiB
// Two CTAs per SM then keep 48-64 KiB in flight per SM (~2-2.5x the 25 KB needed); the merge
// scratch (4 warps x group x (head_dim + 2) fp32, 33,024 bytes at g8 d256) reuses the stages.
// decode_smem_bytes in runtime/kernels/attention.py is max(stages, scratch), same arithmetic.
//
// Split-K: when the host plan (runtime/kernels/attention.py: plan_decode_split, a wave model
// over the SM count) picks num_splits > 1, split z covers tokens [w0 + z * partition_size,
// w0 + (z + 1) * partition_size), w0 the window's first token (0 without a window), and
// writes its normalised partial output and log2-sum-exp; paged_attention_decode_merge_* then
// combines the splits (reads num_splits x head_dim fp32 per head: small next to K/V). An empty
// split writes lse = -inf and zeros.
//
// Launch geometry:
//   paged_attention_decode_<dtype>_d<head_dim>_g<group>:
//     grid (num_kv_heads, num_seqs, num_splits), block 128, dynamic smem decode_smem_bytes
//     (table above; only f32 d256 exceeds the 48 KiB default and opts in).
//     Runs any group_size <= group (the wrapper picks the smallest instantiation that fits).
//   paged_attention_decode_tc_<dtype>_d<head_dim>_g<group> (dtype f16, bf16, f16_kv_fp8,
//     bf16_kv_fp8; group 4, 8): the same grid, block and arguments, dynamic smem
//     decode_tc_smem_bytes (16-bit d256: 64 KiB, opts in). The wrapper launches it instead of
//     the SIMT kernel for 16-bit q whenever the group instantiation is 4 or 8 (group_size
//     3..8); the SIMT 16-bit g4 / g8 instantiations stay built (the baseline for the
//     benchmark) but are not dispatched.
//   paged_attention_decode_merge_<dtype>: grid (num_heads, num_seqs), block 128, no smem.
//
// Instantiations: dtype in {f32, f16, bf16, f32_kv_fp8, f16_kv_fp8, bf16_kv_fp8} x head_dim in
// {64, 128, 256} x group in {1, 2, 4, 8} (dtype: q / out's T, then _kv_fp8 for a uint8_t e4m3
// cache); tc_: dtype in {f16, bf16, f16_kv_fp8, bf16_kv_fp8} x head_dim in {64, 128, 256} x
// group in {4, 8}; merge for f32, f16, bf16 (it reads only fp32 partials and writes T).
// block_size is a runtime power of two (16, 32, 64 accepted by the wrapper; head_dim and block
// size are attention.py's SUPPORTED_HEAD_DIMS and SUPPORTED_BLOCK_SIZES); tiles do not need to
// align with blocks (every chunk looks up its own token's block). Scalars: float scale; int
// num_heads, num_kv_heads, group_size, block_size_log2, max_blocks_per_seq, partition_size,
// num_splits, sliding_window (0: none).
// Signatures: paged_attention_decode_*(out, partial_out, partial_lse, q, k_cache, v_cache,
// block_tables, context_lens, scale, num_heads, num_kv_heads, group_size, block_size_log2,
// max_blocks_per_seq, partition_size, num_splits, sliding_window); with num_splits == 1
// partial_out and partial_lse are unused (the wrapper passes a 1-element array);
// paged_attention_decode_merge_*(out, partial_out, partial_lse, context_lens, num_heads,
// head_dim, partition_size, num_splits, sliding_window).
// Launched by runtime/kernels/attention.py: paged_decode_attention.
//
// Register budget: 255 per thread at 128 threads, 2 CTAs per SM (__launch_bounds__(128, 2)):
// group 8 holds 2 x 8 x ELEMS fp32 of q and accumulators (128 registers at ELEMS 8: 16-bit
// types, f32 d256; 64 at f32 d64/d128) plus the tile's kTileSteps x 8 scores (32); no K/V is
// held in registers between tiles (the stages are in shared memory). Measured with nvcc 13.0
// (compile_gates): g8 153-244 on sm_80 and 154-254 on sm_90 (the top: f16/bf16 d256 g8,
// 254 on sm_90); g4 92-166, g2 56-96, g1 44-96. 0 spill bytes in
// every instantiation. Anything <= 255 still fits two CTAs per SM. Tensor-core kernels hold
// Q fragments (head_dim / 8 registers), O fragments (head_dim / 2: half are the zero rows
// 8..15, the price of in-place mma accumulators) and S, whatever the group: sm_80 / sm_90,
// 16-bit cache d64 108 / 108, d128 140-141 / 144, d256 230-231 / 254; fp8 cache d64 95 /
// 96-97, d128 141-143 / 147-155, d256 243 / 235-237. 0 spills.
// Measured: no GPU numbers yet (benchmarks/kernels/bench_attention.py writes them).
#include "common.cuh"
#include "reduce.cuh"
#include "ptx.cuh"

namespace decode_attn {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Two CTAs per SM is what group 8 fits (2 x 128 x <= 254 registers). Saying so also stops ptxas
// from squeezing small instantiations into 64 registers with spills.
constexpr int kMinCtasPerSm = 2;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kVecBytes = 16;    // one 128-bit shared load per lane, one 16-byte cp.async chunk
// A tile is kTileSteps token steps of the CTA: each token lane group scores kTileSteps tokens
// of it, then rescales its softmax state once (not once per token).
constexpr int kTileSteps = 4;
// Little's law (header): bytes of K/V a CTA keeps in flight, (stages - 1) x stage bytes.
constexpr int kInFlightBytesPerCta = 24 * 1024;
constexpr int kMaxStages = 8;

// The geometry of one instantiation, shared by the kernel and (as arithmetic) by
// runtime/kernels/attention.py decode_tiling.
template <typename T, typename CacheT, int HEAD_DIM>
struct Tiling {
    static constexpr int VEC = kVecBytes / static_cast<int>(sizeof(T));  // dims per lane vector
    static constexpr int ROW_VECS = HEAD_DIM / VEC;
    // A row of more than 32 vectors (f32 d256: 64) gives each lane several: vector j of a lane
    // sits VEC_STRIDE elements after vector j - 1. Up to 32 vectors, one per lane (VECS == 1).
    static constexpr int LANES_PER_TOKEN = ROW_VECS < 32 ? ROW_VECS : 32;
    static constexpr int VECS = ROW_VECS / LANES_PER_TOKEN;
    static constexpr int VEC_STRIDE = LANES_PER_TOKEN * VEC;
    static constexpr int ELEMS = VECS * VEC;  // dims of a row one lane holds
    static constexpr int TOKENS_PER_WARP = 32 / LANES_PER_TOKEN;
    static constexpr int TOKENS_PER_STEP = TOKENS_PER_WARP * kWarps;
    static constexpr int TILE_TOKENS = kTileSteps * TOKENS_PER_STEP;
    static constexpr int ROW_BYTES = HEAD_DIM * static_cast<int>(sizeof(CacheT));
    static constexpr int ROW_CHUNKS = ROW_BYTES / kVecBytes;   // 16-byte cp.async chunks per row
    static constexpr int TILE_BYTES = TILE_TOKENS * ROW_BYTES;  // one of K, V
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;
    static constexpr int STAGES_WANTED =
        1 + (kInFlightBytesPerCta + STAGE_BYTES - 1) / STAGE_BYTES;
    static constexpr int STAGES = STAGES_WANTED < 2 ? 2
                                  : (STAGES_WANTED > kMaxStages ? kMaxStages : STAGES_WANTED);
    static constexpr int CHUNKS_PER_THREAD = TILE_TOKENS * ROW_CHUNKS / kThreads;
    static constexpr int TOKEN_STRIDE = kThreads / ROW_CHUNKS;  // tokens between a thread's chunks
    static_assert(LANES_PER_TOKEN >= 1 && 32 % LANES_PER_TOKEN == 0 &&
                      VECS * LANES_PER_TOKEN * VEC == HEAD_DIM,
                  "head_dim must be a power-of-two multiple of one 16-byte vector");
    static_assert(ROW_CHUNKS >= 1 && kThreads % ROW_CHUNKS == 0 && CHUNKS_PER_THREAD >= 1 &&
                      CHUNKS_PER_THREAD * kThreads == TILE_TOKENS * ROW_CHUNKS,
                  "a tile must split into whole 16-byte chunks per thread");
    // Stage rows are stored as copied (the SIMT reads are whole contiguous rows).
    static __device__ __forceinline__ int swizzle(int) { return 0; }
};

// Widens the two 16-bit values of a 32-bit word (lower-indexed element in the low half).
__device__ __forceinline__ float2 unpack2(uint32_t w, __half) {
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))));
}
__device__ __forceinline__ float2 unpack2(uint32_t w, __nv_bfloat16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// Widens one 16-byte vector (VEC elements of T, as loaded) to fp32. Words are split with
// shifts, not by reading the uint4 through a T* (that type pun is undefined in host C++, and
// g++ -O2 under the CPU harness does optimise it away).
template <typename T, int VEC>
__device__ __forceinline__ void unpack_vec(const uint4& raw, float (&dst)[VEC]) {
    static_assert(VEC == 8, "16-bit types: eight per 16-byte vector");
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 pair = unpack2(words[i], T());
        dst[2 * i] = pair.x;
        dst[2 * i + 1] = pair.y;
    }
}
template <>
__device__ __forceinline__ void unpack_vec<float, 4>(const uint4& raw, float (&dst)[4]) {
    dst[0] = __uint_as_float(raw.x);
    dst[1] = __uint_as_float(raw.y);
    dst[2] = __uint_as_float(raw.z);
    dst[3] = __uint_as_float(raw.w);
}

template <typename Raw, typename T>
__device__ __forceinline__ Raw load_raw(const T* src) {
    return *reinterpret_cast<const Raw*>(src);
}

// The raw bytes of one lane's VEC cache elements: a 16-byte vector when the cache holds T; VEC
// bytes (uint2 for 16-bit T, one word for f32) when it holds fp8 e4m3 codes.
template <int BYTES> struct RawBytes;
template <> struct RawBytes<16> { using type = uint4; };
template <> struct RawBytes<8> { using type = uint2; };
template <> struct RawBytes<4> { using type = uint32_t; };
template <typename CacheT, int VEC>
using KvRaw = typename RawBytes<VEC * static_cast<int>(sizeof(CacheT))>::type;

__device__ __forceinline__ uint32_t raw_word(const uint2& raw, int i) { return i ? raw.y : raw.x; }
__device__ __forceinline__ uint32_t raw_word(uint32_t raw, int) { return raw; }

// fp8 widening, scaled: an e4m3 code's 7 magnitude bits placed at bits 7..13 of an f16 (sign
// to bit 15) are the f16 whose value is the e4m3 value x 2^-8 (the exponent biases are 7 and 15;
// subnormals line up too), so a pair of codes is a byte permute, shifts, two 3-input logic ops
// and two exact f16 -> f32 conversions, against ~9 integer ops per code in fp8_e4m3_to_f32.
// NaN codes (magnitude 0x7F) stay NaN without a branch: (code & 0x7F) + 1 carries into bit 7
// exactly for them, and that flag sets f16 exponent bit 14 (0x3F80 | 0x4000: exponent 31,
// mantissa != 0). The kernel folds the 2^8 back exactly: q is scaled by it (scores) and so are
// the accumulators after the last tile (p V); power-of-two scaling commutes with rounding, so
// the result matches the T cache of the same values bit for bit.
constexpr float kFp8WidenScale = 256.f;
__device__ __forceinline__ void fp8x4_to_f32_scaled(uint32_t w, float (&dst)[4]) {
    const uint32_t nan_flags = (w & 0x7F7F7F7Fu) + 0x01010101u;  // bit 7 of a byte: NaN code
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
        // Bytes, high to low: code 2 * pair + 1, its flag byte, code 2 * pair, its flag byte.
        const uint32_t p = __byte_perm(w, nan_flags, pair ? 0x3726u : 0x1504u);
        const uint32_t h = (p & 0x80008000u) | ((p >> 1) & 0x3F803F80u) |
                           ((p << 7) & 0x40004000u);
        dst[2 * pair] = __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xffffu)));
        dst[2 * pair + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16)));
    }
}

// Widens one lane's raw K/V vector to fp32: T's unpacking, or four e4m3 codes per word
// (lower-indexed element in the low byte, the memory order), scaled by 1 / kFp8WidenScale.
template <typename T, typename CacheT, int VEC>
__device__ __forceinline__ void unpack_kv(const KvRaw<CacheT, VEC>& raw, float (&dst)[VEC]) {
    if constexpr (sizeof(CacheT) == 1) {
#pragma unroll
        for (int word = 0; word < VEC / 4; ++word) {
            float part[4];
            fp8x4_to_f32_scaled(raw_word(raw, word), part);
#pragma unroll
            for (int i = 0; i < 4; ++i) dst[4 * word + i] = part[i];
        }
    } else {
        unpack_vec<T, VEC>(raw, dst);
    }
}

// Reads and widens a lane's ELEMS dims of one staged K or V row (vector j at j * VEC_STRIDE).
template <typename T, typename CacheT, int HEAD_DIM>
__device__ __forceinline__ void read_row(const CacheT* row, int dim0,
                                         float (&dst)[Tiling<T, CacheT, HEAD_DIM>::ELEMS]) {
    using G = Tiling<T, CacheT, HEAD_DIM>;
    using Raw = KvRaw<CacheT, G::VEC>;
#pragma unroll
    for (int j = 0; j < G::VECS; ++j) {
        float part[G::VEC];
        unpack_kv<T, CacheT, G::VEC>(load_raw<Raw>(row + dim0 + j * G::VEC_STRIDE), part);
#pragma unroll
        for (int i = 0; i < G::VEC; ++i) dst[j * G::VEC + i] = part[i];
    }
}

// Block ids of the tokens this thread copies in tile `tile` (-1 past the partition): loaded one
// tile ahead of their cp.async, so the block-table read never stalls an issue.
template <typename G>
__device__ __forceinline__ void fetch_blocks(int (&blocks)[G::CHUNKS_PER_THREAD],
                                             const int* block_table, int tile_begin,
                                             int part_end, int block_size_log2) {
#pragma unroll
    for (int j = 0; j < G::CHUNKS_PER_THREAD; ++j) {
        const int token = tile_begin + threadIdx.x / G::ROW_CHUNKS + j * G::TOKEN_STRIDE;
        blocks[j] = token < part_end ? block_table[token >> block_size_log2] : -1;
    }
}

// Issues the cp.async copies of one K and one V tile into a stage: chunk c = threadIdx.x + j *
// kThreads is 16 bytes of token c / ROW_CHUNKS, so the stage holds rows [TILE_TOKENS][head_dim]
// of CacheT back to back (K, then V) and each warp's copies read contiguous row bytes. Tokens
// past the partition are zero-filled without reading the cache (src_bytes 0): an unused slot,
// NaN or not, never reaches shared memory. G is the geometry (Tiling, or TcTiling whose
// stage rows are swizzled: chunk c of row r lands at chunk c ^ G::swizzle(r) of that row).
template <typename G, typename CacheT, int HEAD_DIM>
__device__ __forceinline__ void issue_tile(unsigned char* stage,
                                           const int (&blocks)[G::CHUNKS_PER_THREAD],
                                           const CacheT* k_cache, const CacheT* v_cache,
                                           int tile_begin, int block_size_log2,
                                           int num_kv_heads, int kv_head) {
    const int chunk_in_row = threadIdx.x % G::ROW_CHUNKS;
#pragma unroll
    for (int j = 0; j < G::CHUNKS_PER_THREAD; ++j) {
        const int row = threadIdx.x / G::ROW_CHUNKS + j * G::TOKEN_STRIDE;
        const int offset = row * G::ROW_BYTES + (chunk_in_row ^ G::swizzle(row)) * kVecBytes;
        unsigned char* k_dst = stage + offset;
        unsigned char* v_dst = stage + G::TILE_BYTES + offset;
        if (blocks[j] >= 0) {
            const int token = tile_begin + row;
            // A slot index fits in int (< 2^31 cached tokens); the byte offset does not.
            const int slot = (blocks[j] << block_size_log2) +
                             (token & ((1 << block_size_log2) - 1));
            const long long elem =
                (static_cast<long long>(slot) * num_kv_heads + kv_head) * HEAD_DIM +
                chunk_in_row * (kVecBytes / static_cast<int>(sizeof(CacheT)));
            cp_async_16(k_dst, k_cache + elem);
            cp_async_16(v_dst, v_cache + elem);
        } else {
            cp_async_16_zfill(k_dst, k_cache, 0);
            cp_async_16_zfill(v_dst, v_cache, 0);
        }
    }
}

// First token a decode query at context_len - 1 sees: keys j > pos - window (0: all of them).
__device__ __forceinline__ int window_start(int context_len, int sliding_window) {
    return sliding_window > 0 ? max(0, context_len - sliding_window) : 0;
}

// The tokens split `split` of a request covers: [begin, end) of its window, in num_tiles tiles of
// TILE_TOKENS rows (0 for an empty split).
struct Partition {
    int begin, end, num_tiles;
};

template <typename G>
__device__ __forceinline__ Partition partition_of(int context_len, int sliding_window, int split,
                                                  int partition_size) {
    Partition p;
    p.begin = window_start(context_len, sliding_window) + split * partition_size;
    p.end = min(context_len, p.begin + partition_size);
    p.num_tiles = p.end > p.begin ? (p.end - p.begin + G::TILE_TOKENS - 1) / G::TILE_TOKENS : 0;
    return p;
}

// Issues tile `tile` of the partition into its ring stage, when it exists, and reads the block
// ids of the next one; then closes one commit group (empty past the partition, so the wait
// counts stay fixed). The prologue calls it for tiles 0 .. STAGES - 2, the main loop for tile
// t + STAGES - 1 once tile t - 1's stage is free.
template <typename G, typename CacheT, int HEAD_DIM>
__device__ __forceinline__ void refill_stage(unsigned char* stages,
                                             int (&blocks)[G::CHUNKS_PER_THREAD],
                                             const Partition& p, int tile, const int* block_table,
                                             const CacheT* k_cache, const CacheT* v_cache,
                                             int block_size_log2, int num_kv_heads, int kv_head) {
    if (tile < p.num_tiles) {
        issue_tile<G, CacheT, HEAD_DIM>(stages + (tile % G::STAGES) * G::STAGE_BYTES, blocks,
                                        k_cache, v_cache, p.begin + tile * G::TILE_TOKENS,
                                        block_size_log2, num_kv_heads, kv_head);
        fetch_blocks<G>(blocks, block_table, p.begin + (tile + 1) * G::TILE_TOKENS, p.end,
                        block_size_log2);
    }
    cp_async_commit();
}

// Folds the softmax state (m_o, l_o, acc_o) into (m, l, acc); -inf maxima are empty states.
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float (&acc)[N], float m_o,
                                            float l_o, const float (&acc_o)[N]) {
    const float m_new = fmaxf(m, m_o);
    const float m_base = (m_new == -CUDART_INF_F) ? 0.f : m_new;  // both empty: keep zeros
    const float a = exp2f(m - m_base);
    const float b = exp2f(m_o - m_base);
    l = l * a + l_o * b;
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = acc[i] * a + acc_o[i] * b;
    m = m_new;
}

// Merges the kWarps softmax states (smem_ml: [kWarps][GROUP][m, l], smem_acc: [kWarps][GROUP]
// [HEAD_DIM] unnormalised accumulators) of each query head and writes the result: a thread per
// (query head, dim) output element; out in T (one split) or the fp32 partial plus its lse.
template <typename T, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void merge_warps_and_store(
    const float* smem_acc, const float* smem_ml, T* __restrict__ out,
    float* __restrict__ partial_out, float* __restrict__ partial_lse, int seq, int head0,
    int group_size, int num_heads, int num_splits, int split) {
    for (int idx = threadIdx.x; idx < group_size * HEAD_DIM; idx += kThreads) {
        const int g = idx / HEAD_DIM;
        const int d = idx % HEAD_DIM;
        float m_max = -CUDART_INF_F;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m_max = fmaxf(m_max, smem_ml[(w * GROUP + g) * 2]);
        const float m_base = (m_max == -CUDART_INF_F) ? 0.f : m_max;
        float l_sum = 0.f, o_sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float weight = exp2f(smem_ml[(w * GROUP + g) * 2] - m_base);
            l_sum += smem_ml[(w * GROUP + g) * 2 + 1] * weight;
            o_sum += smem_acc[(w * GROUP + g) * HEAD_DIM + d] * weight;
        }
        const float o = (l_sum > 0.f) ? o_sum / l_sum : 0.f;
        const long long row = static_cast<long long>(seq) * num_heads + head0 + g;
        if (num_splits == 1) {
            out[row * HEAD_DIM + d] = from_f32<T>(o);
        } else {
            partial_out[(row * num_splits + split) * HEAD_DIM + d] = o;
            if (d == 0) partial_lse[row * num_splits + split] = (l_sum > 0.f) ? m_max + log2f(l_sum) : -CUDART_INF_F;
        }
    }
}

template <typename T, typename CacheT, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void decode_partition(
    T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
    const T* __restrict__ q, const CacheT* __restrict__ k_cache,
    const CacheT* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, float scale,
    int num_heads, int num_kv_heads, int group_size, int block_size_log2, int max_blocks_per_seq,
    int partition_size, int num_splits, int sliding_window) {
    using G = Tiling<T, CacheT, HEAD_DIM>;
    constexpr int VEC = G::VEC;
    constexpr int VECS = G::VECS;
    constexpr int ELEMS = G::ELEMS;
    constexpr int LANES_PER_TOKEN = G::LANES_PER_TOKEN;
    constexpr int VEC_STRIDE = G::VEC_STRIDE;
    constexpr int STAGES = G::STAGES;

    DYNAMIC_SMEM(float, smem);
    // The K/V stages while streaming; after the last tile the same bytes hold the warps'
    // softmax states for the merge (decode_smem_bytes: the larger of the two).
    unsigned char* stages = reinterpret_cast<unsigned char*>(smem);
    float* smem_acc = smem;                                   // [kWarps][GROUP][HEAD_DIM]
    float* smem_ml = smem + kWarps * GROUP * HEAD_DIM;        // [kWarps][GROUP][2]

    const int kv_head = blockIdx.x;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int token_slot = lane / LANES_PER_TOKEN;
    const int dim0 = (lane % LANES_PER_TOKEN) * VEC;
    const int head0 = kv_head * group_size;

    const Partition part = partition_of<G>(context_lens[seq], sliding_window, split,
                                           partition_size);
    const int part_begin = part.begin, part_end = part.end, num_tiles = part.num_tiles;
    const int* block_table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;

    // Prologue: block ids of tile 0, then STAGES - 1 tiles in flight before any compute.
    int blocks[G::CHUNKS_PER_THREAD];
    fetch_blocks<G>(blocks, block_table, part_begin, part_end, block_size_log2);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        refill_stage<G, CacheT, HEAD_DIM>(stages, blocks, part, s, block_table, k_cache, v_cache,
                                          block_size_log2, num_kv_heads, kv_head);

    // q rows of the group, pre-scaled so the softmax runs in base 2 (exp2f is one MUFU op).
    // Loaded after the prologue's copies are on their way.
    // fp8 caches widen to value / kFp8WidenScale: q carries the factor back into the scores.
    const float q_scale = scale * kLog2e * (sizeof(CacheT) == 1 ? kFp8WidenScale : 1.f);
    float q_reg[GROUP][ELEMS];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        if (g < group_size) {
            const T* q_row = q + (static_cast<long long>(seq) * num_heads + head0 + g) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < VECS; ++j) {
                float part[VEC];
                unpack_vec<T, VEC>(load_raw<uint4>(q_row + dim0 + j * G::VEC_STRIDE), part);
#pragma unroll
                for (int i = 0; i < VEC; ++i) q_reg[g][j * VEC + i] = part[i] * q_scale;
            }
        } else {
#pragma unroll
            for (int i = 0; i < ELEMS; ++i) q_reg[g][i] = 0.f;
        }
    }

    float m[GROUP], l[GROUP], acc[GROUP][ELEMS];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = -CUDART_INF_F;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) acc[g][i] = 0.f;
    }

    // Main loop: wait for tile t (at most STAGES - 2 younger groups pending), barrier (tile t
    // visible to all; every thread is done with tile t - 1, whose stage the refill reuses),
    // refill that stage with tile t + STAGES - 1, then compute on tile t.
    for (int t = 0; t < num_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        refill_stage<G, CacheT, HEAD_DIM>(stages, blocks, part, t + STAGES - 1, block_table,
                                          k_cache, v_cache, block_size_log2, num_kv_heads,
                                          kv_head);

        const CacheT* k_tile =
            reinterpret_cast<const CacheT*>(stages + (t % STAGES) * G::STAGE_BYTES);
        const CacheT* v_tile = k_tile + G::TILE_TOKENS * HEAD_DIM;
        const int tile_begin = part_begin + t * G::TILE_TOKENS;
        // Scores of this lane group's kTileSteps tokens (row k * TOKENS_PER_STEP + warp *
        // TOKENS_PER_WARP + token_slot: each warp load reads whole contiguous rows).
        float s[kTileSteps][GROUP];
#pragma unroll
        for (int k = 0; k < kTileSteps; ++k) {
            const int row = k * G::TOKENS_PER_STEP + warp * G::TOKENS_PER_WARP + token_slot;
            float kf[ELEMS];
            read_row<T, CacheT, HEAD_DIM>(k_tile + row * HEAD_DIM, dim0, kf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < ELEMS; ++i) dot = fmaf(q_reg[g][i], kf[i], dot);
                s[k][g] = dot;
            }
        }
#pragma unroll
        for (int offset = LANES_PER_TOKEN / 2; offset > 0; offset /= 2) {
#pragma unroll
            for (int k = 0; k < kTileSteps; ++k)
#pragma unroll
                for (int g = 0; g < GROUP; ++g) s[k][g] += __shfl_xor_sync(kFullMask, s[k][g], offset);
        }
        // Tokens past the partition (zero-filled rows) score -inf: weight 0.
#pragma unroll
        for (int k = 0; k < kTileSteps; ++k) {
            const int row = k * G::TOKENS_PER_STEP + warp * G::TOKENS_PER_WARP + token_slot;
            if (tile_begin + row >= part_end) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) s[k][g] = -CUDART_INF_F;
            }
        }
        // One rescale per tile: the new running max covers all kTileSteps tokens at once.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float m_new = m[g];
#pragma unroll
            for (int k = 0; k < kTileSteps; ++k) m_new = fmaxf(m_new, s[k][g]);
            const float m_base = (m_new == -CUDART_INF_F) ? 0.f : m_new;  // all empty so far
            const float correction = exp2f(m[g] - m_base);
            float p_sum = 0.f;
#pragma unroll
            for (int k = 0; k < kTileSteps; ++k) {
                s[k][g] = exp2f(s[k][g] - m_base);  // s now holds p
                p_sum += s[k][g];
            }
            l[g] = l[g] * correction + p_sum;
#pragma unroll
            for (int i = 0; i < ELEMS; ++i) acc[g][i] *= correction;
            m[g] = m_new;
        }
#pragma unroll
        for (int k = 0; k < kTileSteps; ++k) {
            const int row = k * G::TOKENS_PER_STEP + warp * G::TOKENS_PER_WARP + token_slot;
            float vf[ELEMS];
            read_row<T, CacheT, HEAD_DIM>(v_tile + row * HEAD_DIM, dim0, vf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g)
#pragma unroll
                for (int i = 0; i < ELEMS; ++i) acc[g][i] = fmaf(s[k][g], vf[i], acc[g][i]);
        }
    }
    if constexpr (sizeof(CacheT) == 1) {  // p V summed value / kFp8WidenScale: undo, exactly
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int i = 0; i < ELEMS; ++i) acc[g][i] *= kFp8WidenScale;
    }
    // Every copy has landed and every thread is done reading the stages before they are
    // reused as the merge scratch.
    cp_async_wait_all();
    __syncthreads();
    // Merge the token lane groups of this warp (xor partners hold the same dims).
#pragma unroll
    for (int offset = LANES_PER_TOKEN; offset < 32; offset *= 2) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float m_o = __shfl_xor_sync(kFullMask, m[g], offset);
            const float l_o = __shfl_xor_sync(kFullMask, l[g], offset);
            float acc_o[ELEMS];
#pragma unroll
            for (int i = 0; i < ELEMS; ++i)
                acc_o[i] = __shfl_xor_sync(kFullMask, acc[g][i], offset);
            merge_state<ELEMS>(m[g], l[g], acc[g], m_o, l_o, acc_o);
        }
    }

    if (token_slot == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int j = 0; j < VECS; ++j)
#pragma unroll
                for (int i = 0; i < VEC; ++i)
                    smem_acc[(warp * GROUP + g) * HEAD_DIM + dim0 + j * VEC_STRIDE + i] =
                        acc[g][j * VEC + i];
            if (dim0 == 0) {
                smem_ml[(warp * GROUP + g) * 2 + 0] = m[g];
                smem_ml[(warp * GROUP + g) * 2 + 1] = l[g];
            }
        }
    }
    __syncthreads();

    merge_warps_and_store<T, HEAD_DIM, GROUP>(smem_acc, smem_ml, out, partial_out, partial_lse,
                                              seq, head0, group_size, num_heads, num_splits,
                                              split);
}

// ------------------------------------------------------------------ tensor-core path (g4, g8)
// Geometry of the tensor-core instantiations (16-bit T only). A warp owns WARP_TOKENS rows of
// every tile (16 at d64: two n8 tiles of S and one full k16 step of P V; 8 at d128 / d256:
// one n8 tile, and P V's k16 step carries 8 zero tokens), so a tile is 64 / 32 / 32 tokens;
// the ring is sized by the same Little's-law rule as Tiling. attention.py decode_tc_tiling
// mirrors it.
template <typename T, typename CacheT, int HEAD_DIM>
struct TcTiling {
    static_assert(sizeof(T) == 2, "tensor-core decode: 16-bit activations only");
    static constexpr int WARP_TOKENS = HEAD_DIM == 64 ? 16 : 8;
    static constexpr int N_TILES = WARP_TOKENS / 8;     // n8 tiles of S per warp and tile
    static constexpr int TILE_TOKENS = WARP_TOKENS * kWarps;
    static constexpr int K_STEPS = HEAD_DIM / 16;       // k16 steps of Q K^T
    static constexpr int D_TILES = HEAD_DIM / 8;        // n8 tiles of O
    static constexpr int ROW_BYTES = HEAD_DIM * static_cast<int>(sizeof(CacheT));
    static constexpr int ROW_CHUNKS = ROW_BYTES / kVecBytes;
    static constexpr int TILE_BYTES = TILE_TOKENS * ROW_BYTES;
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;
    static constexpr int STAGES_WANTED =
        1 + (kInFlightBytesPerCta + STAGE_BYTES - 1) / STAGE_BYTES;
    static constexpr int STAGES = STAGES_WANTED < 2 ? 2
                                  : (STAGES_WANTED > kMaxStages ? kMaxStages : STAGES_WANTED);
    static constexpr int CHUNKS_PER_THREAD = TILE_TOKENS * ROW_CHUNKS / kThreads;
    static constexpr int TOKEN_STRIDE = kThreads / ROW_CHUNKS;
    static_assert(CHUNKS_PER_THREAD * kThreads == TILE_TOKENS * ROW_CHUNKS &&
                      kThreads % ROW_CHUNKS == 0 && HEAD_DIM % 64 == 0,
                  "a tile must split into whole 16-byte chunks per thread");
    // Chunk c of stage row r sits at chunk c ^ swizzle(r), so both shared reads of a tile are
    // conflict-free: the K fragment loads (16 bytes a lane; a quarter warp reads two rows, the
    // same logical chunks) and the V ldmatrix.trans (8 consecutive rows, one logical chunk).
    // 16-bit rows (>= 128 B): r & 7. fp8 rows of 64 B (two rows per 128 B): (r >> 1) & 3;
    // fp8 rows >= 128 B: bit 2 from r's parity (K: the quarter's two rows in different 64 B
    // halves), bits 0-1 from r >> 1 (V: a bijection of r & 7).
    static __device__ __forceinline__ int swizzle(int row) {
        if constexpr (sizeof(CacheT) == 2) {
            return row & 7;
        } else if constexpr (ROW_CHUNKS == 4) {
            return (row >> 1) & 3;
        } else {
            return ((row & 1) << 2) | ((row >> 1) & 3);
        }
    }
};

template <typename T> constexpr bool kIsBf16 = false;
template <> constexpr bool kIsBf16<__nv_bfloat16> = true;

// Exact power-of-two rescale of a b32 pair of T (one HMUL2): the last step of fp8 widening.
__device__ __forceinline__ uint32_t scale_pair(uint32_t h, __half) {
    const __half2 pair = __halves2half2(__ushort_as_half(static_cast<unsigned short>(h)),
                                        __ushort_as_half(static_cast<unsigned short>(h >> 16)));
    const __half2 x = __hmul2(pair, __float2half2_rn(kFp8WidenScale));
    return static_cast<uint32_t>(__half_as_ushort(__low2half(x))) |
           (static_cast<uint32_t>(__half_as_ushort(__high2half(x))) << 16);
}
constexpr unsigned short kBf16TwoPow120 = 0x7B80;  // 2^120: exponent 247, mantissa 0
__device__ __forceinline__ uint32_t scale_pair(uint32_t h, __nv_bfloat16) {
    const __nv_bfloat16 s = __ushort_as_bfloat16(kBf16TwoPow120);
    const __nv_bfloat162 x =
        __hmul2(__halves2bfloat162(__ushort_as_bfloat16(static_cast<unsigned short>(h)),
                                   __ushort_as_bfloat16(static_cast<unsigned short>(h >> 16))),
                __halves2bfloat162(s, s));
    return static_cast<uint32_t>(__bfloat16_as_ushort(__low2bfloat16(x))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__high2bfloat16(x))) << 16);
}

// Four e4m3 codes (one word, memory order) -> two b32 pairs of T holding their exact values:
// pairs (code 0, code 1), (2, 3), or with TRANSPOSED (0, 2), (1, 3) (the byte order of an
// ldmatrix.trans of fp8 rows, see decode_partition_tc). Branch-free, as fp8x4_to_f32_scaled:
//   f16:  the 7 magnitude bits at f16 bits 7..13 (sign to 15) are value x 2^-8 (subnormals
//         too); a NaN code (magnitude 0x7F: +1 carries into bit 7) sets bit 14 (exponent 31).
//   bf16: the magnitude at bf16 bits 4..10 is value x 2^-120 (e4m3 subnormals become bf16
//         subnormals); a NaN code sets bits 11..14 (exponent 255).
// Then one HMUL2 by 2^8 / 2^120, exact (the result is representable; NaN stays NaN). Every
// e4m3 value is an f16 and a bf16, so the mma sees exactly the values of a T cache.
template <typename T, bool TRANSPOSED>
__device__ __forceinline__ void fp8x4_to_pairs(uint32_t w, uint32_t (&dst)[2]) {
    const uint32_t nan_flags = (w & 0x7F7F7F7Fu) + 0x01010101u;  // bit 7 of a byte: NaN code
    if constexpr (!kIsBf16<T>) {
        // Halves [flag byte | code byte]: selectors 0x1504 / 0x3726 (0x2604 / 0x3715).
        constexpr uint32_t sel[2] = {TRANSPOSED ? 0x2604u : 0x1504u,
                                     TRANSPOSED ? 0x3715u : 0x3726u};
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
            const uint32_t p = __byte_perm(w, nan_flags, sel[pair]);
            const uint32_t h = (p & 0x80008000u) | ((p >> 1) & 0x3F803F80u) |
                               ((p << 7) & 0x40004000u);
            dst[pair] = scale_pair(h, T());
        }
    } else {
        // Halves [code byte | 0x78 if NaN]: selectors 0x5140 / 0x7362 (0x6240 / 0x7351).
        const uint32_t nan_bytes = ((nan_flags >> 7) & 0x01010101u) * 0x78u;
        constexpr uint32_t sel[2] = {TRANSPOSED ? 0x6240u : 0x5140u,
                                     TRANSPOSED ? 0x7351u : 0x7362u};
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
            const uint32_t p = __byte_perm(w, nan_bytes, sel[pair]);
            const uint32_t h = ((p << 8) & 0x80008000u) | ((p << 4) & 0x07F007F0u) |
                               (p & 0x78007800u);
            dst[pair] = scale_pair(h, T());
        }
    }
}

__device__ __forceinline__ uint4 load_u4(const unsigned char* p) {
    return *reinterpret_cast<const uint4*>(p);
}

// Decode with tensor-core scoring, for 16-bit T and groups 4 / 8 (FlashInfer's "tensor cores
// for GQA decode"): per warp and tile, S = Q_g K^T and O += P V on mma.m16n8k16 (fp32
// accumulators), the group's query heads as the M rows (rows >= group_size and 8..15 zero).
// Same pipeline, split-K, window and warp merge as decode_partition; see the header.
template <typename T, typename CacheT, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void decode_partition_tc(
    T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
    const T* __restrict__ q, const CacheT* __restrict__ k_cache,
    const CacheT* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, float scale,
    int num_heads, int num_kv_heads, int group_size, int block_size_log2, int max_blocks_per_seq,
    int partition_size, int num_splits, int sliding_window) {
    using G = TcTiling<T, CacheT, HEAD_DIM>;
    constexpr int STAGES = G::STAGES;
    constexpr int N_TILES = G::N_TILES;
    constexpr int K_STEPS = G::K_STEPS;
    constexpr int D_TILES = G::D_TILES;
    constexpr bool kFp8 = sizeof(CacheT) == 1;
    static_assert(GROUP <= 8, "the group's query heads are M rows 0..7 of the mma");

    DYNAMIC_SMEM(float, smem);
    unsigned char* stages = reinterpret_cast<unsigned char*>(smem);
    float* smem_acc = smem;                                   // [kWarps][GROUP][HEAD_DIM]
    float* smem_ml = smem + kWarps * GROUP * HEAD_DIM;        // [kWarps][GROUP][2]

    const int kv_head = blockIdx.x;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int row_g = lane / 4;   // fragment row: query head of S / O, token column of K
    const int quad_t = lane % 4;  // fragment column pair
    const int head0 = kv_head * group_size;

    const Partition part = partition_of<G>(context_lens[seq], sliding_window, split,
                                           partition_size);
    const int part_begin = part.begin, part_end = part.end, num_tiles = part.num_tiles;
    const int* block_table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;

    // Prologue: block ids of tile 0, then STAGES - 1 tiles in flight before any compute.
    int blocks[G::CHUNKS_PER_THREAD];
    fetch_blocks<G>(blocks, block_table, part_begin, part_end, block_size_log2);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        refill_stage<G, CacheT, HEAD_DIM>(stages, blocks, part, s, block_table, k_cache, v_cache,
                                          block_size_log2, num_kv_heads, kv_head);

    // Q as A fragments, row g = query head g (zero for g >= group_size; rows 8..15 are the
    // constant zero registers a[1], a[3]). Dim order: k-step 4j + i, fragment column pair t
    // holds dims 64j + 16t + 4i + {0,1} (a[0]) and + {2,3} (a[2]): a lane's 16 dims of each 64
    // are contiguous, one 32-byte q load, and the K fragments below use the same order (any
    // order of the dims gives the same dot product; the same order in the T and fp8 kernels
    // gives the same bits). Scaling stays in fp32 on S (q in T is not rounded again).
    uint32_t q_frag[K_STEPS][2];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 64; ++j) {
        uint4 w0 = make_uint4(0u, 0u, 0u, 0u), w1 = w0;
        if (row_g < group_size && row_g < GROUP) {
            const T* q_row =
                q + (static_cast<long long>(seq) * num_heads + head0 + row_g) * HEAD_DIM +
                64 * j + 16 * quad_t;
            w0 = load_raw<uint4>(q_row);
            w1 = load_raw<uint4>(q_row + 8);
        }
        q_frag[4 * j + 0][0] = w0.x; q_frag[4 * j + 0][1] = w0.y;
        q_frag[4 * j + 1][0] = w0.z; q_frag[4 * j + 1][1] = w0.w;
        q_frag[4 * j + 2][0] = w1.x; q_frag[4 * j + 2][1] = w1.y;
        q_frag[4 * j + 3][0] = w1.z; q_frag[4 * j + 3][1] = w1.w;
    }
    const float q_scale = scale * kLog2e;

    // Online softmax state of row g (query head g), identical in the 4 lanes of a quad; l is
    // this lane's partial sum (its columns), summed over the quad at the end. o[dt]: the O
    // accumulator fragment of dim tile dt (c[0..1] row g; c[2..3] rows 8..15, zero inputs).
    float m_run = -CUDART_INF_F, l_run = 0.f;
    float o[D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[dt][i] = 0.f;

    const int warp_row0 = warp * G::WARP_TOKENS;
    for (int t = 0; t < num_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        refill_stage<G, CacheT, HEAD_DIM>(stages, blocks, part, t + STAGES - 1, block_table,
                                          k_cache, v_cache, block_size_log2, num_kv_heads,
                                          kv_head);

        const unsigned char* k_tile = stages + (t % STAGES) * G::STAGE_BYTES;
        const unsigned char* v_tile = k_tile + G::TILE_BYTES;
        const int tile_begin = part_begin + t * G::TILE_TOKENS;

        // S = Q K^T: B column n = token warp_row0 + 8 nt + n, read as 16 bytes a lane.
        float s[N_TILES][4];
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
            const int row = warp_row0 + 8 * nt + row_g;
            const unsigned char* k_row = k_tile + row * G::ROW_BYTES;
            const int swz = G::swizzle(row);
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 64; ++j) {
                uint32_t b[4][2];  // k-steps 4j .. 4j + 3
                if constexpr (kFp8) {
                    const uint4 c = load_u4(k_row + ((4 * j + quad_t) ^ swz) * kVecBytes);
                    fp8x4_to_pairs<T, false>(c.x, b[0]);
                    fp8x4_to_pairs<T, false>(c.y, b[1]);
                    fp8x4_to_pairs<T, false>(c.z, b[2]);
                    fp8x4_to_pairs<T, false>(c.w, b[3]);
                } else {
                    const uint4 lo = load_u4(k_row + ((8 * j + 2 * quad_t) ^ swz) * kVecBytes);
                    const uint4 hi =
                        load_u4(k_row + ((8 * j + 2 * quad_t + 1) ^ swz) * kVecBytes);
                    b[0][0] = lo.x; b[0][1] = lo.y; b[1][0] = lo.z; b[1][1] = lo.w;
                    b[2][0] = hi.x; b[2][1] = hi.y; b[3][0] = hi.z; b[3][1] = hi.w;
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint32_t a[4] = {q_frag[4 * j + i][0], 0u, q_frag[4 * j + i][1], 0u};
                    mma_m16n8k16_acc<T>(s[nt], a, b[i]);
                }
            }
        }
        // Scale to base 2; tokens past the partition (zero-filled rows) score -inf.
        float row_max = m_run;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int token = tile_begin + warp_row0 + 8 * nt + 2 * quad_t + i;
                s[nt][i] = token < part_end ? s[nt][i] * q_scale : -CUDART_INF_F;
                row_max = fmaxf(row_max, s[nt][i]);
            }
        row_max = reduce::group_max<4>(row_max);  // the quad sharing the accumulator row
        // One rescale per tile, as in decode_partition.
        const float m_base = (row_max == -CUDART_INF_F) ? 0.f : row_max;
        const float correction = exp2f(m_run - m_base);
        m_run = row_max;
        float p_sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                s[nt][i] = exp2f(s[nt][i] - m_base);  // s now holds p
                p_sum += s[nt][i];
            }
        l_run = l_run * correction + p_sum;
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
            o[dt][0] *= correction;
            o[dt][1] *= correction;
        }
        // O += P V: P (rounded to T, as prefill) re-packed from S's accumulators as the A
        // fragment (tokens 0..7 of the warp: n-tile 0; 8..15: n-tile 1, or zero at 8 tokens).
        const uint32_t p_frag[4] = {pack2<T>(s[0][0], s[0][1]), 0u,
                                    N_TILES == 2 ? pack2<T>(s[N_TILES - 1][0], s[N_TILES - 1][1])
                                                 : 0u,
                                    0u};
        // V B fragments by ldmatrix.trans: lane l addresses row l % 8 of matrix l / 8. With 16
        // tokens, matrices (tokens 0-7, chunk c), (8-15, c), (0-7, c + 1), (8-15, c + 1); with 8,
        // (0-7, c .. c + 3) and b[1] = 0 (its P columns are zero).
        constexpr int CHUNK_DIMS = kFp8 ? 16 : 8;   // dims in a 16-byte chunk of a row
        constexpr int CHUNKS_PER_LOAD = 4 / N_TILES;
        const int ld_row = warp_row0 + (N_TILES == 2 ? ((lane / 8) & 1) * 8 : 0) + lane % 8;
        const int ld_chunk = N_TILES == 2 ? (lane / 16) : (lane / 8);
        const unsigned char* v_row = v_tile + ld_row * G::ROW_BYTES;
        const int v_swz = G::swizzle(ld_row);
#pragma unroll
        for (int c0 = 0; c0 < HEAD_DIM / CHUNK_DIMS; c0 += CHUNKS_PER_LOAD) {
            uint32_t r[4];
            ldmatrix_x4_trans(r, v_row + ((c0 + ld_chunk) ^ v_swz) * kVecBytes);
#pragma unroll
            for (int cc = 0; cc < CHUNKS_PER_LOAD; ++cc) {
                // Registers of chunk c0 + cc: tokens 0-7, then (16 tokens) 8-15.
                const uint32_t r_lo = r[N_TILES * cc];
                const uint32_t r_hi = N_TILES == 2 ? r[N_TILES * cc + 1] : 0u;
                if constexpr (kFp8) {
                    // b16 elements are code pairs (dims 2g, 2g + 1 of the chunk): a register
                    // holds tokens (2t, 2t + 1) x dims (2g, 2g + 1); even dims form dim tile
                    // 2c ("dim 16c + 2g"), odd dims tile 2c + 1.
                    uint32_t lo[2], hi[2] = {0u, 0u};
                    fp8x4_to_pairs<T, true>(r_lo, lo);
                    if (N_TILES == 2) fp8x4_to_pairs<T, true>(r_hi, hi);
                    const int dt = 2 * (c0 + cc);
                    const uint32_t b_even[2] = {lo[0], hi[0]};
                    const uint32_t b_odd[2] = {lo[1], hi[1]};
                    mma_m16n8k16_acc<T>(o[dt], p_frag, b_even);
                    mma_m16n8k16_acc<T>(o[dt + 1], p_frag, b_odd);
                } else {
                    const uint32_t b[2] = {r_lo, r_hi};
                    mma_m16n8k16_acc<T>(o[c0 + cc], p_frag, b);
                }
            }
        }
    }

    // Row sums over the quad; m_run is already quad-uniform.
    l_run = reduce::group_sum<4>(l_run);
    cp_async_wait_all();
    __syncthreads();
    if (row_g < GROUP) {
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                // Column 2t + i of dim tile dt: T cache 8 dt + 2t + i; fp8 (even / odd tiles of
                // chunk dt / 2) 16 (dt / 2) + 4t + 2i + dt % 2.
                const int d = kFp8 ? 16 * (dt / 2) + 4 * quad_t + 2 * i + dt % 2
                                   : 8 * dt + 2 * quad_t + i;
                smem_acc[(warp * GROUP + row_g) * HEAD_DIM + d] = o[dt][i];
            }
        if (quad_t == 0) {
            smem_ml[(warp * GROUP + row_g) * 2 + 0] = m_run;
            smem_ml[(warp * GROUP + row_g) * 2 + 1] = l_run;
        }
    }
    __syncthreads();
    merge_warps_and_store<T, HEAD_DIM, GROUP>(smem_acc, smem_ml, out, partial_out, partial_lse,
                                              seq, head0, group_size, num_heads, num_splits,
                                              split);
}

// Combines the split partials of one (request, query head): out = sum_z w_z o_z with
// w_z = 2^(lse_z - M) / sum 2^(lse - M). Splits past the context were never non-empty.
template <typename T>
__device__ __forceinline__ void decode_merge(T* __restrict__ out,
                                             const float* __restrict__ partial_out,
                                             const float* __restrict__ partial_lse,
                                             const int* __restrict__ context_lens, int num_heads,
                                             int head_dim, int partition_size, int num_splits,
                                             int sliding_window) {
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const long long row = static_cast<long long>(seq) * num_heads + head;
    const int context_len = context_lens[seq];
    const int visible = context_len - window_start(context_len, sliding_window);
    const int used_splits = min(num_splits, (visible + partition_size - 1) / partition_size);
    const float* lse = partial_lse + row * num_splits;
    float m_max = -CUDART_INF_F;
    for (int z = 0; z < used_splits; ++z) m_max = fmaxf(m_max, lse[z]);
    const float m_base = (m_max == -CUDART_INF_F) ? 0.f : m_max;
    float weight_sum = 0.f;
    for (int z = 0; z < used_splits; ++z) weight_sum += exp2f(lse[z] - m_base);
    const float inv_sum = (weight_sum > 0.f) ? 1.f / weight_sum : 0.f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.f;
        for (int z = 0; z < used_splits; ++z)
            o += exp2f(lse[z] - m_base) * partial_out[(row * num_splits + z) * head_dim + d];
        out[row * head_dim + d] = from_f32<T>(o * inv_sum);
    }
}

}  // namespace decode_attn

// One launchable decode kernel NAME running the device function FN (decode_partition: CUDA
// cores; decode_partition_tc: tensor cores) for one (T, CacheT, HEAD_DIM, GROUP).
#define PAGEDRUN_DECODE_ENTRY(NAME, FN, T, CacheT, HEAD_DIM, GROUP)                             \
    extern "C" __global__ void __launch_bounds__(decode_attn::kThreads, decode_attn::kMinCtasPerSm) \
        NAME(T* out, float* partial_out, float* partial_lse, const T* q, const CacheT* k_cache, \
             const CacheT* v_cache, const int* block_tables, const int* context_lens,           \
             float scale,                                                                       \
             int num_heads, int num_kv_heads, int group_size, int block_size_log2,              \
             int max_blocks_per_seq, int partition_size, int num_splits, int sliding_window) {  \
        decode_attn::FN<T, CacheT, HEAD_DIM, GROUP>(                                            \
            out, partial_out, partial_lse, q, k_cache, v_cache, block_tables, context_lens,     \
            scale, num_heads, num_kv_heads, group_size, block_size_log2, max_blocks_per_seq,    \
            partition_size, num_splits, sliding_window);                                        \
    }
#define PAGEDRUN_DECODE_KERNEL(NAME, T, CacheT, HEAD_DIM, GROUP)                                \
    PAGEDRUN_DECODE_ENTRY(NAME, decode_partition, T, CacheT, HEAD_DIM, GROUP)

// CUDA-core scoring: groups 1 and 2 for every T; groups 4 and 8 only for f32 q (16-bit q
// takes the tensor-core kernels below there: runtime/kernels/attention.py
// decode_uses_tensor_cores).
#define PAGEDRUN_DECODE_SMALL_GROUPS(DT, T, CacheT, HEAD_DIM)                                  \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g1, T, CacheT, HEAD_DIM, 1) \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g2, T, CacheT, HEAD_DIM, 2)
#define PAGEDRUN_DECODE_GROUPS(DT, T, CacheT, HEAD_DIM)                                        \
    PAGEDRUN_DECODE_SMALL_GROUPS(DT, T, CacheT, HEAD_DIM)                                      \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g4, T, CacheT, HEAD_DIM, 4) \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g8, T, CacheT, HEAD_DIM, 8)

PAGEDRUN_DECODE_GROUPS(f32, float, float, 64)
PAGEDRUN_DECODE_GROUPS(f32, float, float, 128)
PAGEDRUN_DECODE_GROUPS(f32, float, float, 256)
PAGEDRUN_DECODE_SMALL_GROUPS(f16, __half, __half, 64)
PAGEDRUN_DECODE_SMALL_GROUPS(f16, __half, __half, 128)
PAGEDRUN_DECODE_SMALL_GROUPS(f16, __half, __half, 256)
PAGEDRUN_DECODE_SMALL_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 64)
PAGEDRUN_DECODE_SMALL_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 128)
PAGEDRUN_DECODE_SMALL_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 256)
// fp8 e4m3 caches (kv_cache_dtype "fp8"): q and out in T, K/V as uint8_t codes.
PAGEDRUN_DECODE_GROUPS(f32_kv_fp8, float, uint8_t, 64)
PAGEDRUN_DECODE_GROUPS(f32_kv_fp8, float, uint8_t, 128)
PAGEDRUN_DECODE_GROUPS(f32_kv_fp8, float, uint8_t, 256)
PAGEDRUN_DECODE_SMALL_GROUPS(f16_kv_fp8, __half, uint8_t, 64)
PAGEDRUN_DECODE_SMALL_GROUPS(f16_kv_fp8, __half, uint8_t, 128)
PAGEDRUN_DECODE_SMALL_GROUPS(f16_kv_fp8, __half, uint8_t, 256)
PAGEDRUN_DECODE_SMALL_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 64)
PAGEDRUN_DECODE_SMALL_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 128)
PAGEDRUN_DECODE_SMALL_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 256)

#define PAGEDRUN_DECODE_TC_KERNEL(NAME, T, CacheT, HEAD_DIM, GROUP)                             \
    PAGEDRUN_DECODE_ENTRY(NAME, decode_partition_tc, T, CacheT, HEAD_DIM, GROUP)

#define PAGEDRUN_DECODE_TC_GROUPS(DT, T, CacheT, HEAD_DIM)                                      \
    PAGEDRUN_DECODE_TC_KERNEL(paged_attention_decode_tc_##DT##_d##HEAD_DIM##_g4, T, CacheT,     \
                              HEAD_DIM, 4)                                                      \
    PAGEDRUN_DECODE_TC_KERNEL(paged_attention_decode_tc_##DT##_d##HEAD_DIM##_g8, T, CacheT,     \
                              HEAD_DIM, 8)

// Tensor-core scoring (16-bit q, groups 4 and 8; the wrapper's choice for those).
PAGEDRUN_DECODE_TC_GROUPS(f16, __half, __half, 64)
PAGEDRUN_DECODE_TC_GROUPS(f16, __half, __half, 128)
PAGEDRUN_DECODE_TC_GROUPS(f16, __half, __half, 256)
PAGEDRUN_DECODE_TC_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 64)
PAGEDRUN_DECODE_TC_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 128)
PAGEDRUN_DECODE_TC_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 256)
PAGEDRUN_DECODE_TC_GROUPS(f16_kv_fp8, __half, uint8_t, 64)
PAGEDRUN_DECODE_TC_GROUPS(f16_kv_fp8, __half, uint8_t, 128)
PAGEDRUN_DECODE_TC_GROUPS(f16_kv_fp8, __half, uint8_t, 256)
PAGEDRUN_DECODE_TC_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 64)
PAGEDRUN_DECODE_TC_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 128)
PAGEDRUN_DECODE_TC_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 256)

#define PAGEDRUN_DECODE_MERGE(DT, T)                                                            \
    extern "C" __global__ void __launch_bounds__(decode_attn::kThreads)                         \
        paged_attention_decode_merge_##DT(T* out, const float* partial_out,                     \
                                          const float* partial_lse, const int* context_lens,    \
                                          int num_heads, int head_dim, int partition_size,      \
                                          int num_splits, int sliding_window) {                 \
        decode_attn::decode_merge<T>(out, partial_out, partial_lse, context_lens, num_heads,    \
                                     head_dim, partition_size, num_splits, sliding_window);     \
    }

PAGEDRUN_DECODE_MERGE(f32, float)
PAGEDRUN_DECODE_MERGE(f16, __half)
PAGEDRUN_DECODE_MERGE(bf16, __nv_bfloat16)
