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
// Algorithm. One CTA owns one (kv head, request, split): it reads each K/V row once for all
// query heads of the kv head's group (GQA), so K/V traffic does not grow with the group.
// A 16-byte vector covers VEC = 16 / sizeof(T) elements of head_dim; a "token lane group" of
// head_dim / VEC lanes holds one token's row, so a warp reads 32 / (head_dim / VEC) tokens
// per step. A row of more than 32 vectors (f32 d256: 64) takes the whole warp, each lane
// holding VECS = head_dim / (32 * VEC) vectors of it, 32 * VEC elements apart (each load
// instruction of the warp still reads one contiguous 512-byte run); up to 32 vectors a lane
// holds one (VECS == 1, the d64/d128 code unchanged). Each token lane group runs its own
// online softmax (fp32, base 2, scores pre-scaled by scale * log2 e); at the end the groups
// merge inside the warp by shuffles and the warps merge through shared memory. Unused cache
// slots are never read (NaN there cannot leak).
// fp8 caches (CacheT uint8_t) keep this lane layout: a lane's VEC elements of a K/V row are VEC
// bytes (8 for 16-bit T, 4 for f32), loaded as one uint2 / uint32 and widened exactly to fp32
// (cuda/fp8.cuh), so registers and the q / accumulator layout are those of T's kernel and the
// cache traffic is halved (16-bit T) or quartered (f32).
// Each step issues the next step's K/V loads before computing on the current ones (one step of
// software prefetch: two steps of loads in flight per warp; by Little's law an SM needs ~25 KB
// in flight to stream HBM3e, and one step of 4 warps x 32 lanes x 32 bytes is 4 KB per CTA).
// Split-K: when the host plan (runtime/kernels/attention.py: plan_decode_split) picks
// num_splits > 1, split z covers tokens [w0 + z * partition_size, w0 + (z + 1) *
// partition_size), w0 the window's first token (0 without a window), and
// writes its normalised partial output and log2-sum-exp; paged_attention_decode_merge_* then
// combines the splits. An empty split writes lse = -inf and zeros.
//
// Launch geometry:
//   paged_attention_decode_<dtype>_d<head_dim>_g<group>:
//     grid (num_kv_heads, num_seqs, num_splits), block 128, dynamic smem
//     4 * group * (head_dim + 2) * 4 bytes (decode_smem_bytes in attention.py; the largest,
//     g8 d256, is 33,024 bytes: under the 48 KiB default, no opt-in).
//     Runs any group_size <= group (the wrapper picks the smallest instantiation that fits).
//   paged_attention_decode_merge_<dtype>: grid (num_heads, num_seqs), block 128, no smem.
//
// Instantiations: dtype in {f32, f16, bf16, f32_kv_fp8, f16_kv_fp8, bf16_kv_fp8} x head_dim in
// {64, 128, 256} x group in {1, 2, 4, 8} (dtype: q / out's T, then _kv_fp8 for a uint8_t e4m3
// cache), merge for f32, f16, bf16 (it reads only fp32 partials and writes T). block_size is
// a runtime power of two (16, 32, 64 accepted by the wrapper; head_dim and block size are
// attention.py's SUPPORTED_HEAD_DIMS and SUPPORTED_BLOCK_SIZES). Scalars: float scale; int
// num_heads, num_kv_heads, group_size, block_size_log2, max_blocks_per_seq, partition_size,
// num_splits, sliding_window (0: none).
// Signatures: paged_attention_decode_*(out, partial_out, partial_lse, q, k_cache, v_cache,
// block_tables, context_lens, scale, num_heads, num_kv_heads, group_size, block_size_log2,
// max_blocks_per_seq, partition_size, num_splits, sliding_window); with num_splits == 1
// partial_out and partial_lse are unused (the wrapper passes a 1-element array);
// paged_attention_decode_merge_*(out, partial_out, partial_lse, context_lens, num_heads,
// head_dim, partition_size, num_splits, sliding_window).
// Launched by runtime/kernels/attention.py: paged_decode_attention (its plan_decode_split picks
// num_splits, at most 64, and partition_size, a multiple of 256 tokens).
//
// Register budget: 255 per thread at 128 threads, 2 CTAs per SM (__launch_bounds__(128, 2)):
// group 8 holds 2 x 8 x (VECS * VEC) fp32 of q and accumulators (128 registers: VECS * VEC
// is 8 for 16-bit types and for f32 d256; 64 at f32 d64/d128, VEC 4) plus one
// step of prefetched K/V (8 x VECS registers of raw vectors each) and measures 233-244 at
// d64/d128 and 238-254 at d256 (f32 d256 246-250: its 16 registers of raw K/V in flight) on
// sm_80/sm_90 with nvcc 13.0 (anything <= 255 still fits two CTAs per SM); groups 1-4 use
// <= 144. 0 spill bytes. The _kv_fp8 instantiations (same q / accumulator layout, 4-8 byte raw
// K/V per vector) measure 46-240 on sm_90a (g8 d256: 238-240), 0 spill bytes.
// Measured: no GPU numbers yet (benchmarks/kernels/bench_attention.py writes them).
#include "common.cuh"

namespace decode_attn {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Two CTAs per SM is what group 8 fits (2 x 128 x ~236 registers). Saying so also stops ptxas
// from squeezing small instantiations into 64 registers with spills (f32_d128_g4 spilled 12
// bytes on sm_80 with a bare __launch_bounds__(128)).
constexpr int kMinCtasPerSm = 2;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kVecBytes = 16;  // one 128-bit load per lane: the widest global load there is

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

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* src, float (&dst)[VEC]) {
    unpack_vec<T, VEC>(load_raw<uint4>(src), dst);
}

// The raw load of one lane's VEC cache elements: a 16-byte vector when the cache holds T; VEC
// bytes (uint2 for 16-bit T, one word for f32) when it holds fp8 e4m3 codes.
template <int BYTES> struct RawBytes;
template <> struct RawBytes<16> { using type = uint4; };
template <> struct RawBytes<8> { using type = uint2; };
template <> struct RawBytes<4> { using type = uint32_t; };
template <typename CacheT, int VEC>
using KvRaw = typename RawBytes<VEC * static_cast<int>(sizeof(CacheT))>::type;

__device__ __forceinline__ uint32_t raw_word(const uint2& raw, int i) { return i ? raw.y : raw.x; }
__device__ __forceinline__ uint32_t raw_word(uint32_t raw, int) { return raw; }

// Widens one lane's raw K/V vector to fp32: T's unpacking, or four e4m3 codes per word
// (lower-indexed element in the low byte, the memory order).
template <typename T, typename CacheT, int VEC>
__device__ __forceinline__ void unpack_kv(const KvRaw<CacheT, VEC>& raw, float (&dst)[VEC]) {
    if constexpr (sizeof(CacheT) == 1) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
            dst[i] = fp8_e4m3_word_to_f32(raw_word(raw, i / 4), i % 4);
    } else {
        unpack_vec<T, VEC>(raw, dst);
    }
}

// Issues the K and V loads of one token (zeros when it is past the partition): raw 16-byte
// vectors, so a load in flight costs 8 registers per vector whatever T is. Vector j of the
// lane covers dims dim0 + j * VEC_STRIDE .. + VEC (VEC_STRIDE = LANES_PER_TOKEN * VEC, so each
// load instruction of a warp reads whole contiguous rows).
template <typename CacheT, typename Raw, int HEAD_DIM, int VECS, int VEC_STRIDE>
__device__ __forceinline__ void fetch_token(Raw (&k_raw)[VECS], Raw (&v_raw)[VECS],
                                            const CacheT* k_cache, const CacheT* v_cache,
                                            const int* block_table, int token, int part_end,
                                            int block_size_log2, int num_kv_heads, int kv_head,
                                            int dim0) {
    if (token < part_end) {
        const int block = block_table[token >> block_size_log2];
        // A slot index fits in int (< 2^31 cached tokens); the element offset does not.
        const int slot = (block << block_size_log2) + (token & ((1 << block_size_log2) - 1));
        const long long elem =
            (static_cast<long long>(slot) * num_kv_heads + kv_head) * HEAD_DIM + dim0;
#pragma unroll
        for (int j = 0; j < VECS; ++j) {
            k_raw[j] = load_raw<Raw>(k_cache + elem + j * VEC_STRIDE);
            v_raw[j] = load_raw<Raw>(v_cache + elem + j * VEC_STRIDE);
        }
    } else {
#pragma unroll
        for (int j = 0; j < VECS; ++j) k_raw[j] = v_raw[j] = Raw{};  // zeros (fp8 0x00 is +0)
    }
}

// Widens a lane's VECS raw vectors into ELEMS = VECS * VEC floats (vector j at j * VEC).
template <typename T, typename CacheT, int VEC, int VECS>
__device__ __forceinline__ void unpack_vecs(const KvRaw<CacheT, VEC> (&raw)[VECS],
                                            float (&dst)[VECS * VEC]) {
#pragma unroll
    for (int j = 0; j < VECS; ++j) {
        float part[VEC];
        unpack_kv<T, CacheT, VEC>(raw[j], part);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dst[j * VEC + i] = part[i];
    }
}

// First token a decode query at context_len - 1 sees: keys j > pos - window (0: all of them).
__device__ __forceinline__ int window_start(int context_len, int sliding_window) {
    return sliding_window > 0 ? max(0, context_len - sliding_window) : 0;
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

template <typename T, typename CacheT, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void decode_partition(
    T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
    const T* __restrict__ q, const CacheT* __restrict__ k_cache,
    const CacheT* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, float scale,
    int num_heads, int num_kv_heads, int group_size, int block_size_log2, int max_blocks_per_seq,
    int partition_size, int num_splits, int sliding_window) {
    constexpr int VEC = kVecBytes / sizeof(T);
    // A row of more than 32 vectors (f32 d256: 64) gives each lane several: vector j of a lane
    // sits VEC_STRIDE elements after vector j - 1. Up to 32 vectors, one per lane (VECS == 1).
    constexpr int ROW_VECS = HEAD_DIM / VEC;
    constexpr int LANES_PER_TOKEN = ROW_VECS < 32 ? ROW_VECS : 32;
    constexpr int VECS = ROW_VECS / LANES_PER_TOKEN;
    constexpr int VEC_STRIDE = LANES_PER_TOKEN * VEC;
    constexpr int ELEMS = VECS * VEC;  // dims of a row one lane holds
    static_assert(LANES_PER_TOKEN >= 1 && 32 % LANES_PER_TOKEN == 0 &&
                      VECS * LANES_PER_TOKEN * VEC == HEAD_DIM,
                  "head_dim must be a power-of-two multiple of one 16-byte vector");
    constexpr int TOKENS_PER_WARP = 32 / LANES_PER_TOKEN;
    constexpr int TOKENS_PER_STEP = TOKENS_PER_WARP * kWarps;

    DYNAMIC_SMEM(float, smem);
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

    const int context_len = context_lens[seq];
    const int window_begin = window_start(context_len, sliding_window);
    const int part_begin = window_begin + split * partition_size;
    const int part_end = min(context_len, part_begin + partition_size);
    const int* block_table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;

    // q rows of the group, pre-scaled so the softmax runs in base 2 (exp2f is one MUFU op).
    const float q_scale = scale * kLog2e;
    float q_reg[GROUP][ELEMS];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        if (g < group_size) {
            const T* q_row = q + (static_cast<long long>(seq) * num_heads + head0 + g) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < VECS; ++j) {
                float part[VEC];
                load_vec<T, VEC>(q_row + dim0 + j * VEC_STRIDE, part);
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

    // The loop bound is warp-uniform so every lane reaches the shuffles; a token lane group
    // past the end computes on zeros and skips the update. Each step issues the next step's
    // K/V loads before computing on the current ones (one step of software prefetch), so a
    // warp keeps two steps of loads in flight.
    const int first = part_begin + warp * TOKENS_PER_WARP;
    using Raw = KvRaw<CacheT, VEC>;
    Raw k_next[VECS], v_next[VECS];
    fetch_token<CacheT, Raw, HEAD_DIM, VECS, VEC_STRIDE>(k_next, v_next, k_cache, v_cache,
                                                         block_table, first + token_slot,
                                                         part_end, block_size_log2,
                                                         num_kv_heads, kv_head, dim0);
    for (int base = first; base < part_end; base += TOKENS_PER_STEP) {
        const bool valid = base + token_slot < part_end;
        float k[ELEMS], v[ELEMS];
        unpack_vecs<T, CacheT, VEC, VECS>(k_next, k);
        unpack_vecs<T, CacheT, VEC, VECS>(v_next, v);
        fetch_token<CacheT, Raw, HEAD_DIM, VECS, VEC_STRIDE>(
            k_next, v_next, k_cache, v_cache, block_table, base + TOKENS_PER_STEP + token_slot,
            part_end, block_size_log2, num_kv_heads, kv_head, dim0);
        float s[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < ELEMS; ++i) dot = fmaf(q_reg[g][i], k[i], dot);
            s[g] = dot;
        }
#pragma unroll
        for (int offset = LANES_PER_TOKEN / 2; offset > 0; offset /= 2) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) s[g] += __shfl_xor_sync(kFullMask, s[g], offset);
        }
        if (valid) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float m_new = fmaxf(m[g], s[g]);
                const float correction = exp2f(m[g] - m_new);
                const float p = exp2f(s[g] - m_new);
                l[g] = l[g] * correction + p;
#pragma unroll
                for (int i = 0; i < ELEMS; ++i) acc[g][i] = fmaf(acc[g][i], correction, p * v[i]);
                m[g] = m_new;
            }
        }
    }

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

    // Merge the warps: thread per (query head, dim) output element.
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

#define PAGEDRUN_DECODE_KERNEL(NAME, T, CacheT, HEAD_DIM, GROUP)                                \
    extern "C" __global__ void __launch_bounds__(decode_attn::kThreads, decode_attn::kMinCtasPerSm) \
        NAME(T* out, float* partial_out, float* partial_lse, const T* q, const CacheT* k_cache, \
             const CacheT* v_cache, const int* block_tables, const int* context_lens,           \
             float scale,                                                                       \
             int num_heads, int num_kv_heads, int group_size, int block_size_log2,              \
             int max_blocks_per_seq, int partition_size, int num_splits, int sliding_window) {  \
        decode_attn::decode_partition<T, CacheT, HEAD_DIM, GROUP>(                              \
            out, partial_out, partial_lse, q, k_cache, v_cache, block_tables, context_lens,     \
            scale, num_heads, num_kv_heads, group_size, block_size_log2, max_blocks_per_seq,    \
            partition_size, num_splits, sliding_window);                                        \
    }

#define PAGEDRUN_DECODE_GROUPS(DT, T, CacheT, HEAD_DIM)                                        \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g1, T, CacheT, HEAD_DIM, 1) \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g2, T, CacheT, HEAD_DIM, 2) \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g4, T, CacheT, HEAD_DIM, 4) \
    PAGEDRUN_DECODE_KERNEL(paged_attention_decode_##DT##_d##HEAD_DIM##_g8, T, CacheT, HEAD_DIM, 8)

PAGEDRUN_DECODE_GROUPS(f32, float, float, 64)
PAGEDRUN_DECODE_GROUPS(f32, float, float, 128)
PAGEDRUN_DECODE_GROUPS(f32, float, float, 256)
PAGEDRUN_DECODE_GROUPS(f16, __half, __half, 64)
PAGEDRUN_DECODE_GROUPS(f16, __half, __half, 128)
PAGEDRUN_DECODE_GROUPS(f16, __half, __half, 256)
PAGEDRUN_DECODE_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 64)
PAGEDRUN_DECODE_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 128)
PAGEDRUN_DECODE_GROUPS(bf16, __nv_bfloat16, __nv_bfloat16, 256)
// fp8 e4m3 caches (kv_cache_dtype "fp8"): q and out in T, K/V as uint8_t codes.
PAGEDRUN_DECODE_GROUPS(f32_kv_fp8, float, uint8_t, 64)
PAGEDRUN_DECODE_GROUPS(f32_kv_fp8, float, uint8_t, 128)
PAGEDRUN_DECODE_GROUPS(f32_kv_fp8, float, uint8_t, 256)
PAGEDRUN_DECODE_GROUPS(f16_kv_fp8, __half, uint8_t, 64)
PAGEDRUN_DECODE_GROUPS(f16_kv_fp8, __half, uint8_t, 128)
PAGEDRUN_DECODE_GROUPS(f16_kv_fp8, __half, uint8_t, 256)
PAGEDRUN_DECODE_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 64)
PAGEDRUN_DECODE_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 128)
PAGEDRUN_DECODE_GROUPS(bf16_kv_fp8, __nv_bfloat16, uint8_t, 256)

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
