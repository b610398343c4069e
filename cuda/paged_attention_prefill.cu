// paged_attention_prefill.cu -- causal attention of a ragged batch of query chunks over their
// requests' paged K/V (prefix-cache hits, earlier chunks of a chunked prefill, and the chunk
// itself), tiled with online softmax; tensor cores (mma.sync m16n8k16) for f16 / bf16.
//
// Computes, for request r with query rows query_start_loc[r] .. query_start_loc[r+1]
// (query_len = their count) and context_len = context_lens[r]: query row j sits at position
// context_len - query_len + j and attends to cached tokens 0 .. that position:
//   out[row, h, :] = softmax(scale * q[row, h, :] . K_r[0..pos]^T) V_r[0..pos]
// with kv head h / group_size, K_r/V_r gathered through block_tables[r] (token t in slot
// block_tables[r, t / block_size] * block_size + t % block_size). With sliding_window W > 0
// (Gemma 3's local layers) a row at position p sees keys p - W < j <= p only, and a CTA starts
// its key walk at its first row's window (earlier tiles are neither read nor indexed). This
// step's K/V are already
// in the cache (rotary_cache_write.cu runs first). Rows of a request with query_len 0 and
// rows past query_start_loc[num_reqs] are not written.
//
// Pointers (T = float | __half | __nv_bfloat16 per instantiation; CacheT = T, or uint8_t for an
// fp8 e4m3 cache, the _kv_fp8 instantiations; contiguous):
//   q                [num_tokens, num_heads, head_dim]                    T
//   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]     CacheT (NHD)
//   block_tables     [num_reqs, max_blocks_per_seq]                       int32
//   query_start_loc  [num_reqs + 1]                                       int32, cu_seqlens style
//   context_lens     [num_reqs]                                           int32, >= query_len
//   out              [num_tokens, num_heads, head_dim]                    T
//
// Tiling: a CTA owns kBlockM = 64 query rows of one (request, query head) and walks the keys
// in tiles of kBlockN = 32 up to its last row's position (tiles past the causal edge are never
// loaded). Key rows are fetched with cp.async (16 bytes, zero-filled past the context, so
// NaN in unused slots cannot enter) into padded shared rows, two stages deep up to d128: tile
// i + 1's K and V are in flight while tile i is computed. The second stage is the Q tile's
// space (Q is needed only until its fragments are in registers), so the pipeline costs no
// shared memory.
//   f16/bf16: each warp owns 16 query rows. Q lives in registers as mma A fragments
//     (ldmatrix_x4), K tiles are B fragments (ldmatrix_x4), V tiles B fragments through
//     ldmatrix_x4_trans; P is re-packed from the S accumulators into A fragments without a trip
//     through shared memory. Softmax state: 2 rows per thread, reductions over the quad.
//     d256: Q fragments (head_dim / 16 k-steps x 4 = 64 registers) next to the output
//     accumulators (head_dim / 8 n-tiles x 4 = 128) measured 253-255 registers with Q in
//     registers: one compiler change from spilling. So at d256 Q stays in shared memory and
//     each k-step reloads its A fragment (one ldmatrix_x4 more per two of K); the Q rows then
//     cannot be the second stage, and there is one K/V stage (tile i + 1 is issued once tile i
//     is consumed; the SM's other CTA covers the wait). Same shared memory formula as below.
//   f32 (the test instantiation, no fp32 mma): same CTA tile and key loop, one stage (each
//     K/V tile is waited for before it is used); two threads per query row up to d128, each
//     holding half of head_dim of q and of the output accumulator (64 + 64 registers at d128),
//     scoring 8 keys per online-softmax update. d256: four threads per row keep those 64 + 64,
//     so 128 threads cover 32 rows and the 64-row tile runs in two passes over its keys (the
//     second is skipped when the tile has <= 32 rows).
// Softmax in fp32, base 2, scores scaled by scale * log2 e.
// fp8 caches (CacheT uint8_t): the key tiles are widened exactly to T on their way into shared
// memory (every e4m3 value is an f16 / bf16 / f32), so both paths compute on the T tiles they
// would have loaded from a T cache: same shared memory, same math. The widening takes plain
// loads (8 codes per 16-byte shared chunk of 16-bit T, 4 of f32) instead of cp.async. On the
// tensor-core path tile i + 1's codes are loaded into registers before tile i's math and
// widened into their stage after it (Fp8KvTileRegs: 8 registers at d64, 16 at d128), so the
// loads overlap the math as the cp.async stage does. d256 (one stage, Q in shared memory) loads
// a tile after the previous one is consumed, synchronously: 32 registers of codes in flight
// took ptxas to 255 there. The f32 test path loads each tile synchronously.
//
// Launch geometry: grid (max over requests of ceil(query_len / 64), num_reqs, num_heads),
// block 128 (CTAs past their request's rows exit at once). Dynamic shared memory:
//   f16/bf16: (64 + 2 * 32) * (head_dim + 8) * sizeof(T)  (34,816 bytes at d128, 67,584 at d256)
//   f32:      2 * 32 * head_dim * 4                        (32,768 bytes at d128, 65,536 at d256)
// (prefill_smem_bytes in runtime/kernels/attention.py). Under the 48 KiB default up to d128;
// at d256 the wrapper sets the kernel's max_dynamic_shared_size_bytes first (opt_in_smem).
// Two d256 CTAs need 135 KB: they fit an SM on sm_80 (164 KB) and sm_90 (228 KB).
//
// Instantiations: paged_attention_prefill_{f32,f16,bf16}_d{64,128,256}, and the same with
// _kv_fp8 after the dtype (uint8_t e4m3 caches). block_size is a runtime
// power of two (16, 32, 64 accepted by the wrapper: attention.py's SUPPORTED_BLOCK_SIZES).
// Scalars: float scale; int num_heads, num_kv_heads, group_size, block_size_log2,
// max_blocks_per_seq, sliding_window (0: none).
// Signature: (out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
// num_heads, num_kv_heads, group_size, block_size_log2, max_blocks_per_seq, sliding_window).
// Launched by runtime/kernels/attention.py: paged_prefill_attention.
//
// Register budget: 240 per thread at 128 threads; the gate must show 0 spill bytes. Measured
// (nvcc 13.0, sm_80/sm_90): d64/d128 96-168 (d128 mma: 32 registers of Q fragments, 64 of
// output accumulators); d256 mma 227-229 (128 of accumulators, Q reloaded from smem), d256 f32
// 213-220; the _kv_fp8 instantiations 118-179 on sm_90 (d256 mma 168; d128 mma 168-178 with
// the next tile's codes in registers), f32_kv_fp8_d128 222 on sm_80.
// Anything <= 255 keeps two CTAs per SM at 128 threads, which is also what d256's
// shared memory allows on sm_80; 240 leaves the gate a margin to flag growth before a spill.
// Measured: no GPU numbers yet (benchmarks/kernels/bench_attention.py writes them).
#include "common.cuh"
#include "reduce.cuh"
#include "ptx.cuh"

namespace prefill_attn {

constexpr int kThreads = 128;
constexpr int kBlockM = 64;   // query rows per CTA: one 16-row mma tile per warp
constexpr int kBlockN = 32;   // keys per tile: 4 mma n-tiles of S, 2 k-steps of P V
constexpr int kPad = 8;       // 16 bytes per smem row: successive rows start 4 banks apart, so
                              // the 8 row addresses of one ldmatrix hit 8 distinct bank quads
constexpr int kChunk = 16;    // bytes per cp.async
constexpr int kSimtKeys = 8;  // f32 path: keys scored per online-softmax update
constexpr float kLog2e = 1.4426950408889634f;

// One 4-byte store of two adjacent outputs, through the pair type: legal aliasing in host
// C++ too (the pair is an aggregate of T), unlike a store through uint32_t*.
__device__ __forceinline__ void store2(__half* dst, float lo, float hi) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(lo, hi);
}
__device__ __forceinline__ void store2(__nv_bfloat16* dst, float lo, float hi) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(lo, hi);
}

// Per-CTA coordinates shared by both paths.
struct TileCoords {
    int q_row0;        // first q row (global token index) of the request
    int tile_row0;     // first query row of this tile, within the request
    int query_len;
    int first_q_pos;   // position of the request's first query row
    int kv_begin;      // keys [kv_begin, kv_end) are visible to some row of this tile
    int kv_end;
    int sliding_window;  // 0: none; else row at position p sees keys > p - sliding_window
    int kv_head;
    const int* block_table;
};

// Returns false when this CTA has no rows (ragged grid).
__device__ __forceinline__ bool tile_coords(TileCoords& c, const int* query_start_loc,
                                            const int* context_lens, const int* block_tables,
                                            int group_size, int max_blocks_per_seq,
                                            int sliding_window) {
    const int req = blockIdx.y;
    c.q_row0 = query_start_loc[req];
    c.query_len = query_start_loc[req + 1] - c.q_row0;
    c.tile_row0 = blockIdx.x * kBlockM;
    if (c.tile_row0 >= c.query_len) return false;
    const int context_len = context_lens[req];
    c.first_q_pos = context_len - c.query_len;
    const int last_row = min(c.tile_row0 + kBlockM, c.query_len) - 1;
    c.kv_end = c.first_q_pos + last_row + 1;
    c.sliding_window = sliding_window;
    c.kv_begin = sliding_window > 0 ? max(0, c.first_q_pos + c.tile_row0 - sliding_window + 1) : 0;
    c.kv_head = blockIdx.z / group_size;
    c.block_table = block_tables + static_cast<long long>(req) * max_blocks_per_seq;
    return true;
}

// Whether key `key` is visible to the query row at position q_pos (causal, and the window).
__device__ __forceinline__ bool key_visible(int key, int q_pos, int sliding_window) {
    return key <= q_pos && (sliding_window <= 0 || key > q_pos - sliding_window);
}

// The row of key `key` in a cache: its kv head's head_dim elements, `col` of them skipped.
template <typename CacheT, int HEAD_DIM>
__device__ __forceinline__ const CacheT* key_row(const CacheT* cache, int key, int col,
                                                 const TileCoords& c, int num_kv_heads,
                                                 int block_size_log2) {
    const int block = c.block_table[key >> block_size_log2];
    const int slot = (block << block_size_log2) + (key & ((1 << block_size_log2) - 1));
    return cache + (static_cast<long long>(slot) * num_kv_heads + c.kv_head) * HEAD_DIM + col;
}

// One [kBlockN, HEAD_DIM] key tile (K or V) of an fp8 e4m3 cache into rows of `row_elems`
// elements of T, widened exactly: plain loads of the codes (a uint2 of 8 per 16-byte chunk of
// 16-bit T, one word of 4 per chunk of f32); keys at or past kv_end are zeros and read nothing.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void load_kv_tile_fp8(T* dst, int row_elems, const uint8_t* cache,
                                                 int kv0, const TileCoords& c, int num_kv_heads,
                                                 int block_size_log2) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(T) / kChunk;
    constexpr int ELEMS_PER_CHUNK = kChunk / sizeof(T);
    constexpr int WORDS = ELEMS_PER_CHUNK / 4;
    for (int chunk = threadIdx.x; chunk < kBlockN * CHUNKS_PER_ROW; chunk += kThreads) {
        const int row = chunk / CHUNKS_PER_ROW;
        const int col = (chunk % CHUNKS_PER_ROW) * ELEMS_PER_CHUNK;
        const int key = kv0 + row;
        uint32_t words[WORDS];
#pragma unroll
        for (int w = 0; w < WORDS; ++w) words[w] = 0u;  // past the context: +0 codes
        if (key < c.kv_end) {
            const uint8_t* src =
                key_row<uint8_t, HEAD_DIM>(cache, key, col, c, num_kv_heads, block_size_log2);
            if constexpr (WORDS == 2) {
                const uint2 raw = *reinterpret_cast<const uint2*>(src);
                words[0] = raw.x;
                words[1] = raw.y;
            } else {
                words[0] = *reinterpret_cast<const uint32_t*>(src);
            }
        }
        T* out = dst + row * row_elems + col;
#pragma unroll
        for (int i = 0; i < ELEMS_PER_CHUNK; ++i)
            out[i] = from_f32<T>(fp8_e4m3_word_to_f32(words[i / 4], i % 4));
    }
}

// The next K and V tiles of an fp8 cache held in registers between their loads and their
// widening into shared memory (the tensor-core path's pipeline for fp8 caches): fetch() issues
// the plain loads of tile i + 1 before tile i is computed, store() widens them into a stage
// afterwards, so the loads' latency hides behind tile i's math as a cp.async stage would. Same
// chunk -> thread map as load_kv_tile_fp8. Registers: 2 x PER_THREAD x WORDS per thread (8 at
// d64 and 16 at d128 for 16-bit T); used with two stages (up to d128) only.
template <typename T, int HEAD_DIM>
struct Fp8KvTileRegs {
    static constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(T) / kChunk;
    static constexpr int ELEMS_PER_CHUNK = kChunk / sizeof(T);
    static constexpr int WORDS = ELEMS_PER_CHUNK / 4;
    static constexpr int PER_THREAD = kBlockN * CHUNKS_PER_ROW / kThreads;
    static_assert(kBlockN * CHUNKS_PER_ROW % kThreads == 0, "a tile's chunks split evenly");
    uint32_t k[PER_THREAD][WORDS];
    uint32_t v[PER_THREAD][WORDS];

    __device__ __forceinline__ void fetch(const uint8_t* k_cache, const uint8_t* v_cache, int kv0,
                                          const TileCoords& c, int num_kv_heads,
                                          int block_size_log2) {
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) {
            const int chunk = threadIdx.x + j * kThreads;
            const int key = kv0 + chunk / CHUNKS_PER_ROW;
            const int col = (chunk % CHUNKS_PER_ROW) * ELEMS_PER_CHUNK;
#pragma unroll
            for (int w = 0; w < WORDS; ++w) k[j][w] = v[j][w] = 0u;  // past the context: +0
            if (key < c.kv_end) {
                const uint8_t* ks =
                    key_row<uint8_t, HEAD_DIM>(k_cache, key, col, c, num_kv_heads, block_size_log2);
                const uint8_t* vs =
                    key_row<uint8_t, HEAD_DIM>(v_cache, key, col, c, num_kv_heads, block_size_log2);
                if constexpr (WORDS == 2) {
                    const uint2 kr = *reinterpret_cast<const uint2*>(ks);
                    const uint2 vr = *reinterpret_cast<const uint2*>(vs);
                    k[j][0] = kr.x;
                    k[j][1] = kr.y;
                    v[j][0] = vr.x;
                    v[j][1] = vr.y;
                } else {
                    k[j][0] = *reinterpret_cast<const uint32_t*>(ks);
                    v[j][0] = *reinterpret_cast<const uint32_t*>(vs);
                }
            }
        }
    }

    // Widens into a stage: kBlockN K rows at stage_k, the V rows v_offset elements after.
    __device__ __forceinline__ void store(T* stage_k, int row_elems, int v_offset) const {
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) {
            const int chunk = threadIdx.x + j * kThreads;
            T* kd = stage_k + (chunk / CHUNKS_PER_ROW) * row_elems +
                    (chunk % CHUNKS_PER_ROW) * ELEMS_PER_CHUNK;
#pragma unroll
            for (int i = 0; i < ELEMS_PER_CHUNK; ++i) {
                kd[i] = from_f32<T>(fp8_e4m3_word_to_f32(k[j][i / 4], i % 4));
                kd[v_offset + i] = from_f32<T>(fp8_e4m3_word_to_f32(v[j][i / 4], i % 4));
            }
        }
    }
};

// Issues the cp.asyncs of one [kBlockN, HEAD_DIM] key tile (K or V) into rows of
// `row_elems` elements; keys at or past kv_end are zero-filled and read nothing. An fp8 cache
// (CacheT uint8_t) goes through load_kv_tile_fp8 instead (no cp.async: nothing to commit).
template <typename T, typename CacheT, int HEAD_DIM>
__device__ __forceinline__ void load_kv_tile(T* dst, int row_elems, const CacheT* cache, int kv0,
                                             const TileCoords& c, int num_kv_heads,
                                             int block_size_log2) {
    if constexpr (sizeof(CacheT) == 1) {
        load_kv_tile_fp8<T, HEAD_DIM>(dst, row_elems, cache, kv0, c, num_kv_heads,
                                      block_size_log2);
    } else {
        constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(T) / kChunk;
        constexpr int ELEMS_PER_CHUNK = kChunk / sizeof(T);
        for (int chunk = threadIdx.x; chunk < kBlockN * CHUNKS_PER_ROW; chunk += kThreads) {
            const int row = chunk / CHUNKS_PER_ROW;
            const int col = (chunk % CHUNKS_PER_ROW) * ELEMS_PER_CHUNK;
            const int key = kv0 + row;
            const T* src = cache;  // a valid address even when nothing is read
            int src_bytes = 0;
            if (key < c.kv_end) {
                src = key_row<T, HEAD_DIM>(cache, key, col, c, num_kv_heads, block_size_log2);
                src_bytes = kChunk;
            }
            cp_async_16_zfill(dst + row * row_elems + col, src, src_bytes);
        }
    }
}

// ------------------------------------------------------------------ tensor-core path (f16/bf16)
template <typename T, typename CacheT, int HEAD_DIM>
__device__ __forceinline__ void prefill_mma(T* __restrict__ out, const T* __restrict__ q,
                                            const CacheT* __restrict__ k_cache,
                                            const CacheT* __restrict__ v_cache, const TileCoords& c,
                                            float scale, int num_heads, int num_kv_heads,
                                            int block_size_log2) {
    constexpr int ROW = HEAD_DIM + kPad;          // smem row, elements
    constexpr int K_STEPS = HEAD_DIM / 16;        // mma k-steps over head_dim for S
    constexpr int D_TILES = HEAD_DIM / 8;         // mma n-tiles of the output
    constexpr int S_TILES = kBlockN / 8;          // mma n-tiles of S
    constexpr int CHUNKS_PER_ROW = HEAD_DIM * sizeof(T) / kChunk;
    constexpr int ELEMS_PER_CHUNK = kChunk / sizeof(T);
    // Up to d128, Q's A fragments live in registers (K_STEPS x 4) next to the output
    // accumulators (D_TILES x 4): 32 + 64 at d128. At d256 that would be 64 + 128 and leave
    // ptxas at 253-255 registers, one compiler version from spilling; there Q stays in shared
    // memory and each k-step reloads its A fragment (one more ldmatrix_x4 per two of K).
    constexpr bool Q_IN_SMEM = HEAD_DIM > 128;
    constexpr int STAGES = Q_IN_SMEM ? 1 : 2;  // K/V stages in flight
    DYNAMIC_SMEM(T, smem);
    // Q's rows are needed only until its fragments are in registers; then the same space is
    // the second K/V stage (kBlockM == 2 * kBlockN rows: exactly one K tile plus one V tile).
    // With Q_IN_SMEM the Q rows stay, and one stage is all there is (same smem size).
    static_assert(kBlockM == 2 * kBlockN, "the Q tile doubles as the second K/V stage");
    // Stage z holds kBlockN K rows then kBlockN V rows at stage_k(z); stage 0 sits after Q,
    // stage 1 on top of Q. (Arithmetic, not a pointer table: a table indexed by the runtime
    // stage went to local memory.)
    T* s_q = smem;                     // [kBlockM][ROW]
    auto stage_k = [&](int z) { return s_q + (1 - z) * kBlockM * ROW; };
    constexpr int V_OFFSET = kBlockN * ROW;  // V rows follow the K rows of a stage

    const int head = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int quad_row = lane / 4;          // fragment row g
    const int quad_col = (lane % 4) * 2;    // fragment column 2t

    // Q tile -> smem -> A fragments in registers (rows past the chunk are zeros).
    for (int chunk = threadIdx.x; chunk < kBlockM * CHUNKS_PER_ROW; chunk += kThreads) {
        const int row = chunk / CHUNKS_PER_ROW;
        const int col = (chunk % CHUNKS_PER_ROW) * ELEMS_PER_CHUNK;
        const bool valid = c.tile_row0 + row < c.query_len;
        const T* src = valid ? q + (static_cast<long long>(c.q_row0 + c.tile_row0 + row) *
                                        num_heads + head) * HEAD_DIM + col
                             : q;
        cp_async_16_zfill(s_q + row * ROW + col, src, valid ? kChunk : 0);
    }
    cp_async_commit();
    // Key tile 0 into stage 0 while Q lands.
    load_kv_tile<T, CacheT, HEAD_DIM>(stage_k(0), ROW, k_cache, c.kv_begin, c, num_kv_heads,
                                      block_size_log2);
    load_kv_tile<T, CacheT, HEAD_DIM>(stage_k(0) + V_OFFSET, ROW, v_cache, c.kv_begin, c,
                                      num_kv_heads, block_size_log2);
    cp_async_commit();
    // A fragment of k-step kk from the warp's 16 Q rows.
    const T* q_frag_src = s_q + (warp * 16 + lane % 16) * ROW + (lane / 16) * 8;
    uint32_t q_frag[Q_IN_SMEM ? 1 : K_STEPS][4];
    if constexpr (!Q_IN_SMEM) {
        cp_async_wait<1>();  // Q landed
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) ldmatrix_x4(q_frag[kk], q_frag_src + kk * 16);
        __syncthreads();  // every warp has its Q fragments: the Q rows become stage 1
    }

    float o[D_TILES][4];
#pragma unroll
    for (int dn = 0; dn < D_TILES; ++dn)
#pragma unroll
        for (int j = 0; j < 4; ++j) o[dn][j] = 0.f;
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float l[2] = {0.f, 0.f};  // per-thread partial row sums; reduced over the quad at the end
    const float scale_log2 = scale * kLog2e;
    // Positions of this thread's two rows (g and g + 8 of the warp's 16).
    int q_pos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
        q_pos[h] = c.first_q_pos + c.tile_row0 + warp * 16 + quad_row + 8 * h;

    // Two-stage pipeline: tile i + 1 is in flight while tile i is computed. Every iteration
    // commits one group (empty past the last tile) so wait<STAGES - 1> always means "tile i
    // landed". One stage (Q_IN_SMEM): tile i + 1 is issued after tile i is consumed, and the
    // other CTA on the SM hides the wait.
    // An fp8 cache's next tile waits in registers (Fp8KvTileRegs) instead of a cp.async group:
    // loaded before tile i's math, widened into its stage after it.
    constexpr bool kFp8 = sizeof(CacheT) == 1;
    for (int kv0 = c.kv_begin, stage = 0; kv0 < c.kv_end;
         kv0 += kBlockN, stage ^= (STAGES - 1)) {
        const T* s_k = stage_k(stage);
        const T* s_v = s_k + V_OFFSET;
        const bool has_next = kv0 + kBlockN < c.kv_end;
        [[maybe_unused]] Fp8KvTileRegs<T, HEAD_DIM> next_fp8;
        if constexpr (kFp8) {
            if (STAGES == 2 && has_next)
                next_fp8.fetch(reinterpret_cast<const uint8_t*>(k_cache),
                               reinterpret_cast<const uint8_t*>(v_cache), kv0 + kBlockN, c,
                               num_kv_heads, block_size_log2);
        } else if (STAGES == 2 && has_next) {
            T* next_k = stage_k(stage ^ 1);
            load_kv_tile<T, CacheT, HEAD_DIM>(next_k, ROW, k_cache, kv0 + kBlockN, c,
                                              num_kv_heads, block_size_log2);
            load_kv_tile<T, CacheT, HEAD_DIM>(next_k + V_OFFSET, ROW, v_cache, kv0 + kBlockN, c,
                                              num_kv_heads, block_size_log2);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();  // tile i (and with Q_IN_SMEM, Q) landed
        __syncthreads();

        float s[S_TILES][4];
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[n][j] = 0.f;
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) {
            uint32_t a[4];
            if constexpr (Q_IN_SMEM) {
                ldmatrix_x4(a, q_frag_src + kk * 16);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) a[j] = q_frag[kk][j];
            }
#pragma unroll
            for (int np = 0; np < S_TILES / 2; ++np) {
                uint32_t b[4];
                ldmatrix_x4(b, s_k + (np * 16 + lane % 8 + (lane / 16) * 8) * ROW + kk * 16 +
                                   ((lane / 8) % 2) * 8);
                const uint32_t b0[2] = {b[0], b[1]};
                const uint32_t b1[2] = {b[2], b[3]};
                mma_m16n8k16_acc<T>(s[2 * np], a, b0);
                mma_m16n8k16_acc<T>(s[2 * np + 1], a, b1);
            }
        }

        // Causal mask, online softmax (rows h = 0, 1 of this thread).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float row_max = -CUDART_INF_F;
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int key = kv0 + n * 8 + quad_col + j;
                    float& x = s[n][2 * h + j];
                    x = key_visible(key, q_pos[h], c.sliding_window) ? x * scale_log2
                                                                     : -CUDART_INF_F;
                    row_max = fmaxf(row_max, x);
                }
            row_max = reduce::group_max<4>(row_max);  // the quad sharing the accumulator row
            const float m_new = fmaxf(m[h], row_max);
            const float m_base = (m_new == -CUDART_INF_F) ? 0.f : m_new;  // row fully masked so far
            const float correction = exp2f(m[h] - m_base);
            float row_sum = 0.f;
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    float& x = s[n][2 * h + j];
                    x = exp2f(x - m_base);
                    row_sum += x;
                }
            l[h] = l[h] * correction + row_sum;
            m[h] = m_new;
#pragma unroll
            for (int dn = 0; dn < D_TILES; ++dn) {
                o[dn][2 * h] *= correction;
                o[dn][2 * h + 1] *= correction;
            }
        }

#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            // S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
            const uint32_t p_frag[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                                        pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                        pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D_TILES / 2; ++dp) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, s_v + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * ROW +
                                         dp * 16 + (lane / 16) * 8);
                const uint32_t b0[2] = {b[0], b[1]};
                const uint32_t b1[2] = {b[2], b[3]};
                mma_m16n8k16_acc<T>(o[2 * dp], p_frag, b0);
                mma_m16n8k16_acc<T>(o[2 * dp + 1], p_frag, b1);
            }
        }
        if constexpr (kFp8) {
            // The other stage was last read in iteration i - 1, before its closing barrier.
            if (STAGES == 2 && has_next) next_fp8.store(stage_k(stage ^ 1), ROW, V_OFFSET);
        }
        __syncthreads();  // the next iteration's cp.async overwrites this stage
        if (STAGES == 1 && has_next) {  // committed at the loop's top
            load_kv_tile<T, CacheT, HEAD_DIM>(stage_k(0), ROW, k_cache, kv0 + kBlockN, c,
                                              num_kv_heads, block_size_log2);
            load_kv_tile<T, CacheT, HEAD_DIM>(stage_k(0) + V_OFFSET, ROW, v_cache, kv0 + kBlockN,
                                              c, num_kv_heads, block_size_log2);
        }
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] = reduce::group_sum<4>(l[h]);
        const int row = c.tile_row0 + warp * 16 + quad_row + 8 * h;
        if (row >= c.query_len) continue;
        const float inv_l = (l[h] > 0.f) ? 1.f / l[h] : 0.f;
        T* out_row = out + (static_cast<long long>(c.q_row0 + row) * num_heads + head) * HEAD_DIM;
#pragma unroll
        for (int dn = 0; dn < D_TILES; ++dn)
            store2(out_row + dn * 8 + quad_col, o[dn][2 * h] * inv_l, o[dn][2 * h + 1] * inv_l);
    }
}

// ------------------------------------------------------------------ SIMT path (f32)
// One pass of the SIMT path: this thread's HALF dims of query row `row` over every key tile.
template <typename CacheT, int HEAD_DIM, int ROW_THREADS>
__device__ __forceinline__ void prefill_simt_rows(float* __restrict__ out,
                                                  const float* __restrict__ q,
                                                  const CacheT* __restrict__ k_cache,
                                                  const CacheT* __restrict__ v_cache,
                                                  float* s_k, float* s_v, const TileCoords& c,
                                                  int row, int dim0, float scale_log2,
                                                  int num_heads, int num_kv_heads,
                                                  int block_size_log2) {
    constexpr int HALF = HEAD_DIM / ROW_THREADS;
    const int head = blockIdx.z;
    const bool row_valid = row < c.query_len;
    const int q_pos = c.first_q_pos + row;

    float q_reg[HALF], acc[HALF];
    const float* q_row =
        q + (static_cast<long long>(c.q_row0 + row) * num_heads + head) * HEAD_DIM + dim0;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        q_reg[i] = row_valid ? q_row[i] * scale_log2 : 0.f;
        acc[i] = 0.f;
    }
    float m = -CUDART_INF_F, l = 0.f;

    for (int kv0 = c.kv_begin; kv0 < c.kv_end; kv0 += kBlockN) {
        load_kv_tile<float, CacheT, HEAD_DIM>(s_k, HEAD_DIM, k_cache, kv0, c, num_kv_heads,
                                              block_size_log2);
        cp_async_commit();
        load_kv_tile<float, CacheT, HEAD_DIM>(s_v, HEAD_DIM, v_cache, kv0, c, num_kv_heads,
                                              block_size_log2);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        // Sub-tiles of kSimtKeys keys keep the score array small enough for head_dim 128
        // (a whole 32-key score array pushed f32_d128 to 255 registers and a spill on sm_80).
#pragma unroll 1
        for (int j0 = 0; j0 < kBlockN; j0 += kSimtKeys) {
            float s[kSimtKeys];
            float sub_max = -CUDART_INF_F;
#pragma unroll
            for (int j = 0; j < kSimtKeys; ++j) {
                const float* k_row = s_k + (j0 + j) * HEAD_DIM + dim0;
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < HALF; ++i) dot = fmaf(q_reg[i], k_row[i], dot);
                dot = reduce::group_sum<ROW_THREADS>(dot);
                s[j] = key_visible(kv0 + j0 + j, q_pos, c.sliding_window) ? dot : -CUDART_INF_F;
                sub_max = fmaxf(sub_max, s[j]);
            }
            const float m_new = fmaxf(m, sub_max);
            const float m_base = (m_new == -CUDART_INF_F) ? 0.f : m_new;
            const float correction = exp2f(m - m_base);
            l *= correction;
#pragma unroll
            for (int i = 0; i < HALF; ++i) acc[i] *= correction;
            m = m_new;
#pragma unroll
            for (int j = 0; j < kSimtKeys; ++j) {
                const float p = exp2f(s[j] - m_base);
                const float* v_row = s_v + (j0 + j) * HEAD_DIM + dim0;
                l += p;
#pragma unroll
                for (int i = 0; i < HALF; ++i) acc[i] = fmaf(p, v_row[i], acc[i]);
            }
        }
        __syncthreads();
    }
    if (!row_valid) return;
    const float inv_l = (l > 0.f) ? 1.f / l : 0.f;
    float* out_row =
        out + (static_cast<long long>(c.q_row0 + row) * num_heads + head) * HEAD_DIM + dim0;
#pragma unroll
    for (int i = 0; i < HALF; ++i) out_row[i] = acc[i] * inv_l;
}

template <typename CacheT, int HEAD_DIM>
__device__ __forceinline__ void prefill_simt(float* __restrict__ out, const float* __restrict__ q,
                                             const CacheT* __restrict__ k_cache,
                                             const CacheT* __restrict__ v_cache,
                                             const TileCoords& c, float scale, int num_heads,
                                             int num_kv_heads, int block_size_log2) {
    // Threads sharing a query row, each holding HALF dims of q and of the accumulator: two up
    // to d128 (64 + 64 registers at d128); four at d256, which keeps the same 64 + 64 but
    // covers only 32 of the tile's rows at once, so the tile runs in two passes over its keys.
    constexpr int ROW_THREADS = HEAD_DIM > 128 ? 4 : 2;
    constexpr int HALF = HEAD_DIM / ROW_THREADS;  // dims per thread
    constexpr int PASS_ROWS = kThreads / ROW_THREADS;
    static_assert(kBlockM % PASS_ROWS == 0, "whole passes per row tile");
    DYNAMIC_SMEM(float, smem);
    float* s_k = smem;                       // [kBlockN][HEAD_DIM]
    float* s_v = s_k + kBlockN * HEAD_DIM;   // [kBlockN][HEAD_DIM]

    const int dim0 = (threadIdx.x % ROW_THREADS) * HALF;
    const int thread_row = c.tile_row0 + static_cast<int>(threadIdx.x) / ROW_THREADS;
    const float scale_log2 = scale * kLog2e;
    if constexpr (PASS_ROWS == kBlockM) {
        prefill_simt_rows<CacheT, HEAD_DIM, ROW_THREADS>(out, q, k_cache, v_cache, s_k, s_v, c,
                                                         thread_row, dim0, scale_log2, num_heads,
                                                         num_kv_heads, block_size_log2);
    } else {
#pragma unroll 1
        for (int pass_row0 = 0; pass_row0 < kBlockM; pass_row0 += PASS_ROWS) {
            if (c.tile_row0 + pass_row0 >= c.query_len) break;  // CTA-uniform: no rows left
            prefill_simt_rows<CacheT, HEAD_DIM, ROW_THREADS>(
                out, q, k_cache, v_cache, s_k, s_v, c, thread_row + pass_row0, dim0, scale_log2,
                num_heads, num_kv_heads, block_size_log2);
        }
    }
}

template <typename T, typename CacheT, int HEAD_DIM>
__device__ __forceinline__ void prefill(T* out, const T* q, const CacheT* k_cache,
                                        const CacheT* v_cache,
                                        const int* block_tables, const int* query_start_loc,
                                        const int* context_lens, float scale, int num_heads,
                                        int num_kv_heads, int group_size, int block_size_log2,
                                        int max_blocks_per_seq, int sliding_window) {
    TileCoords c;
    if (!tile_coords(c, query_start_loc, context_lens, block_tables, group_size,
                     max_blocks_per_seq, sliding_window))
        return;  // whole CTA leaves together, before any barrier
    if constexpr (sizeof(T) == 4) {
        prefill_simt<CacheT, HEAD_DIM>(out, q, k_cache, v_cache, c, scale, num_heads,
                                       num_kv_heads, block_size_log2);
    } else {
        prefill_mma<T, CacheT, HEAD_DIM>(out, q, k_cache, v_cache, c, scale, num_heads,
                                         num_kv_heads, block_size_log2);
    }
}

}  // namespace prefill_attn

#define PAGEDRUN_PREFILL_KERNEL(DT, T, CacheT, HEAD_DIM)                                        \
    extern "C" __global__ void __launch_bounds__(prefill_attn::kThreads)                        \
        paged_attention_prefill_##DT##_d##HEAD_DIM(                                             \
            T* out, const T* q, const CacheT* k_cache, const CacheT* v_cache,                   \
            const int* block_tables, const int* query_start_loc, const int* context_lens,       \
            float scale, int num_heads, int num_kv_heads, int group_size, int block_size_log2,  \
            int max_blocks_per_seq, int sliding_window) {                                       \
        prefill_attn::prefill<T, CacheT, HEAD_DIM>(out, q, k_cache, v_cache, block_tables,      \
                                                   query_start_loc, context_lens, scale,        \
                                                   num_heads, num_kv_heads, group_size,         \
                                                   block_size_log2, max_blocks_per_seq,         \
                                                   sliding_window);                             \
    }

PAGEDRUN_PREFILL_KERNEL(f32, float, float, 64)
PAGEDRUN_PREFILL_KERNEL(f32, float, float, 128)
PAGEDRUN_PREFILL_KERNEL(f16, __half, __half, 64)
PAGEDRUN_PREFILL_KERNEL(f16, __half, __half, 128)
PAGEDRUN_PREFILL_KERNEL(bf16, __nv_bfloat16, __nv_bfloat16, 64)
PAGEDRUN_PREFILL_KERNEL(bf16, __nv_bfloat16, __nv_bfloat16, 128)
PAGEDRUN_PREFILL_KERNEL(f32, float, float, 256)
PAGEDRUN_PREFILL_KERNEL(f16, __half, __half, 256)
PAGEDRUN_PREFILL_KERNEL(bf16, __nv_bfloat16, __nv_bfloat16, 256)
// fp8 e4m3 caches (kv_cache_dtype "fp8"): q and out in T, K/V as uint8_t codes.
PAGEDRUN_PREFILL_KERNEL(f32_kv_fp8, float, uint8_t, 64)
PAGEDRUN_PREFILL_KERNEL(f32_kv_fp8, float, uint8_t, 128)
PAGEDRUN_PREFILL_KERNEL(f32_kv_fp8, float, uint8_t, 256)
PAGEDRUN_PREFILL_KERNEL(f16_kv_fp8, __half, uint8_t, 64)
PAGEDRUN_PREFILL_KERNEL(f16_kv_fp8, __half, uint8_t, 128)
PAGEDRUN_PREFILL_KERNEL(f16_kv_fp8, __half, uint8_t, 256)
PAGEDRUN_PREFILL_KERNEL(bf16_kv_fp8, __nv_bfloat16, uint8_t, 64)
PAGEDRUN_PREFILL_KERNEL(bf16_kv_fp8, __nv_bfloat16, uint8_t, 128)
PAGEDRUN_PREFILL_KERNEL(bf16_kv_fp8, __nv_bfloat16, uint8_t, 256)
