// sampling.cu -- logits processing and sampling on the device: sparse penalties (+ min_tokens
// bans), then per row greedy argmax or temperature / top-k / top-p / min-p and an inverse-CDF
// draw, without sorting the vocabulary. Reproduces the distribution of runtime/sampler.py
// (its docstring fixes the order), not its bits.
//
// apply_penalties_f32 -- in place, per row r, for each entry e of its sparse list
// (entry_offsets[r] .. entry_offsets[r+1]; tokens distinct within a row):
//   t = entry_tokens[e], flags = entry_flags[e], c = entry_counts[e] (times t occurs in the output)
//   if flags & SEEN (t in prompt or output) and repetition[r] != 1:
//       logits[r, t] = logits > 0 ? logits / repetition[r] : logits * repetition[r]
//   if c > 0: logits[r, t] -= frequency[r] * c + presence[r]   (frequency first, as numpy)
//   if flags & BANNED (min_tokens not reached, t a stop / eos id): logits[r, t] = -inf
// Pointers: logits [num_rows, vocab] f32; entry_offsets [num_rows + 1] int32; entry_tokens,
// entry_counts, entry_flags [num_entries] int32; repetition, frequency, presence [num_rows] f32.
// Launch: grid (num_rows), block 128.
//
// sample_f32 -- per row r (one CTA), logits [num_rows, vocab] f32 (penalised), out_tokens
// [num_rows] int32; per-row parameters temperature, top_p, min_p, uniforms [num_rows] f32 and
// top_k [num_rows] int32 (<= 0 or >= vocab: off); uniforms in [0, 1) come from the host
// (per-request seeded generators, as in the numpy sampler):
//   temperature <= 0: greedy, out = argmax(logits[r]) with ties to the lowest id.
//   else s = logits / temperature; M = max s
//     top-k: K = the k-th largest s (radix select), keep s >= K (ties at the boundary kept)
//     w = exp(s - M) for kept tokens, else 0 (the largest w is exactly 1)
//     top-p: T = the largest weight such that the mass of weights >= T is >= top_p x sum(w)
//       (radix select on weight bits, mass-weighted); keep w >= T. Same set as the numpy
//       rule "keep while the mass before a token is < top_p", except that exact weight ties
//       straddling the boundary are all kept here.
//     min-p: keep w >= min_p
//     out = the first token, in ascending id order, whose cumulative kept weight exceeds
//       u x (total kept weight) (rounding past the end: the last kept token).
// Radix select: keys are the float bits made order-preserving as uint32, settled 8 bits per
// pass (4 passes) with a 256-bin shared histogram of count (top-k) or weight (top-p); each
// pass reads only the logits row (L2-resident after the first pass). The inverse CDF gives
// each thread a contiguous id range: per-thread sums, a block scan, and one thread walks
// the range that holds the target.
// Launch: grid (num_rows), block 256, no dynamic shared memory (static 1 KiB histogram).
//
// Instantiations: apply_penalties_f32, sample_f32 (logits are fp32: the LM head GEMM writes
// fp32 logits from bf16/fp16 activations). Scalars: int vocab.
// Signatures: apply_penalties_f32(logits, entry_offsets, entry_tokens, entry_counts,
// entry_flags, repetition, frequency, presence, vocab); sample_f32(out_tokens, logits,
// temperature, top_k, top_p, min_p, uniforms, vocab).
// Launched by runtime/kernels/sampling.py: apply_penalties, sample (which KernelSampler,
// runtime/backends/kernel_sampler.py, calls for the kernel backends).
//
// Register budget: 64 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace sampling_ops {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPenaltyThreads = 128;
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kFlagSeen = 1;
constexpr int kFlagBanned = 2;
constexpr unsigned kSignBit = 0x80000000u;

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// Order-preserving uint32 of a float (larger float -> larger key; NaN is not expected).
__device__ __forceinline__ uint32_t ordered_key(float v) {
    const uint32_t bits = __float_as_uint(v);
    return (bits & kSignBit) ? ~bits : (bits | kSignBit);
}

__device__ __forceinline__ void apply_penalties(float* logits, const int* entry_offsets,
                                                const int* entry_tokens, const int* entry_counts,
                                                const int* entry_flags, const float* repetition,
                                                const float* frequency, const float* presence,
                                                int vocab) {
    const int row = blockIdx.x;
    float* row_logits = logits + static_cast<long long>(row) * vocab;
    const float rep = repetition[row], freq = frequency[row], pres = presence[row];
    for (int e = entry_offsets[row] + threadIdx.x; e < entry_offsets[row + 1];
         e += kPenaltyThreads) {
        const int token = entry_tokens[e];
        if (token < 0 || token >= vocab) continue;  // the wrapper never sends one
        const int flags = entry_flags[e];
        const int count = entry_counts[e];
        float v = row_logits[token];
        if ((flags & kFlagSeen) && rep != 1.f) v = v > 0.f ? v / rep : v * rep;
        if (count > 0) {
            v -= freq * static_cast<float>(count);
            v -= pres;
        }
        if (flags & kFlagBanned) v = neg_inf();
        row_logits[token] = v;
    }
}

// ---- block reductions (every thread gets the result) ------------------------------------
__device__ __forceinline__ float block_max(float v, float* s_red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    __syncthreads();  // s_red may still be read by a previous reduction
    if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = v;
    __syncthreads();
    float r = s_red[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) r = fmaxf(r, s_red[w]);
    return r;
}

__device__ __forceinline__ float block_sum(float v, float* s_red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = v;
    __syncthreads();
    float r = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) r += s_red[w];
    return r;
}

// (value, index) argmax with ties to the lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ int block_argmax(float v, int idx, float* s_val, int* s_idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, v, o);
        const int oi = __shfl_xor_sync(kFullMask, idx, o);
        if (better(ov, oi, v, idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) { s_val[threadIdx.x / 32] = v; s_idx[threadIdx.x / 32] = idx; }
    __syncthreads();
    float bv = s_val[0];
    int bi = s_idx[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
        if (better(s_val[w], s_idx[w], bv, bi)) { bv = s_val[w]; bi = s_idx[w]; }
    return bi;
}

// Largest key K such that measure(tokens with key >= K) >= target, 8 bits per pass.
// `entry(i, key, measure)` returns false for tokens that take no part.
template <typename Entry>
__device__ __forceinline__ uint32_t radix_select(int vocab, float target, Entry entry,
                                                 float* s_hist, uint32_t* s_choice,
                                                 float* s_above) {
    uint32_t prefix = 0;
    float above = 0.f;  // measure of tokens whose settled bits are greater than prefix's
    for (int shift = 32 - kRadixBits; shift >= 0; shift -= kRadixBits) {
        for (int b = threadIdx.x; b < kRadixBins; b += kThreads) s_hist[b] = 0.f;
        __syncthreads();
        const uint32_t settled_mask = shift + kRadixBits >= 32 ? 0u : ~0u << (shift + kRadixBits);
        for (int i = threadIdx.x; i < vocab; i += kThreads) {
            uint32_t key;
            float measure;
            if (entry(i, key, measure) && (key & settled_mask) == prefix)
                atomicAdd(&s_hist[(key >> shift) & (kRadixBins - 1)], measure);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float cum = above;
            int choice = -1, lowest_nonempty = 0;
            for (int b = kRadixBins - 1; b >= 0; --b) {
                if (s_hist[b] > 0.f) lowest_nonempty = b;
                if (cum + s_hist[b] >= target) { choice = b; break; }
                cum += s_hist[b];
            }
            if (choice < 0) {  // rounding left the target above the total: keep the whole bin set
                choice = lowest_nonempty;
                cum = above;
                for (int b = kRadixBins - 1; b > choice; --b) cum += s_hist[b];
            }
            *s_choice = static_cast<uint32_t>(choice);
            *s_above = cum;
        }
        __syncthreads();
        prefix |= *s_choice << shift;
        above = *s_above;
        __syncthreads();  // s_hist / s_choice are rewritten by the next pass
    }
    return prefix;
}

__device__ __forceinline__ void sample(int* out_tokens, const float* logits,
                                       const float* temperature, const int* top_k,
                                       const float* top_p, const float* min_p,
                                       const float* uniforms, int vocab) {
    __shared__ float s_red[kWarps];
    __shared__ int s_red_idx[kWarps];
    __shared__ float s_hist[kRadixBins];
    __shared__ uint32_t s_choice;
    __shared__ float s_above;
    __shared__ float s_scan[kWarps];
    __shared__ int s_token;
    const int row = blockIdx.x;
    const float* row_logits = logits + static_cast<long long>(row) * vocab;
    const float temp = temperature[row];

    if (temp <= 0.f) {  // greedy
        float best = neg_inf();
        int best_idx = vocab;  // any real token beats it on ties
        for (int i = threadIdx.x; i < vocab; i += kThreads)
            if (better(row_logits[i], i, best, best_idx)) { best = row_logits[i]; best_idx = i; }
        const int token = block_argmax(best, best_idx, s_red, s_red_idx);
        if (threadIdx.x == 0) out_tokens[row] = token < vocab ? token : 0;
        return;
    }

    float local_max = neg_inf();
    for (int i = threadIdx.x; i < vocab; i += kThreads)
        local_max = fmaxf(local_max, row_logits[i] / temp);
    const float max_scaled = block_max(local_max, s_red);

    // top-k threshold on the scaled logits (count measure)
    const int k = top_k[row];
    uint32_t k_key = 0;  // every key >= 0: keep all
    if (k > 0 && k < vocab) {
        k_key = radix_select(vocab, static_cast<float>(k),
                             [&](int i, uint32_t& key, float& measure) {
                                 key = ordered_key(row_logits[i] / temp);
                                 measure = 1.f;
                                 return true;
                             },
                             s_hist, &s_choice, &s_above);
    }
    auto weight_of = [&](int i) {
        const float s = row_logits[i] / temp;
        return ordered_key(s) >= k_key ? expf(s - max_scaled) : 0.f;
    };

    // top-p threshold on the weights (mass measure)
    const float p = top_p[row];
    uint32_t p_key = 0;
    if (p < 1.f) {
        float local_sum = 0.f;
        for (int i = threadIdx.x; i < vocab; i += kThreads) local_sum += weight_of(i);
        const float total = block_sum(local_sum, s_red);
        p_key = radix_select(vocab, p * total,
                             [&](int i, uint32_t& key, float& measure) {
                                 measure = weight_of(i);
                                 key = __float_as_uint(measure);  // w >= 0: bits are ordered
                                 return measure > 0.f;
                             },
                             s_hist, &s_choice, &s_above);
    }
    const float min_weight = min_p[row];
    auto kept_weight = [&](int i) {
        const float w = weight_of(i);
        return (w > 0.f && __float_as_uint(w) >= p_key && w >= min_weight) ? w : 0.f;
    };

    // Inverse CDF over ascending ids: thread t owns ids [t * span, (t + 1) * span).
    const int span = (vocab + kThreads - 1) / kThreads;
    const int begin = min(vocab, static_cast<int>(threadIdx.x) * span);
    const int end = min(vocab, begin + span);
    float mine = 0.f;
    int last_kept = -1;
    for (int i = begin; i < end; ++i) {
        const float w = kept_weight(i);
        mine += w;
        if (w > 0.f) last_kept = i;
    }
    // inclusive scan of `mine` over the block: warp scan, then warp totals
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float up = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += up;
    }
    if (lane == 31) s_scan[warp] = incl;
    if (threadIdx.x == 0) s_token = -1;
    __syncthreads();
    float warp_prefix = 0.f, total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        if (w < warp) warp_prefix += s_scan[w];
        total += s_scan[w];
    }
    const float before = warp_prefix + incl - mine;
    const float target = uniforms[row] * total;
    if (mine > 0.f && before <= target && target < before + mine) {
        float cum = before;
        int chosen = last_kept;  // rounding inside the range: its last kept token
        for (int i = begin; i < end; ++i) {
            cum += kept_weight(i);
            if (cum > target) { chosen = i; break; }
        }
        atomicMax(&s_token, chosen);  // at most one thread in exact arithmetic
    }
    __syncthreads();
    // Rounding past the total: the last kept token of the row.
    const int last = block_argmax(static_cast<float>(last_kept), last_kept, s_red, s_red_idx);
    if (threadIdx.x == 0) out_tokens[row] = s_token >= 0 ? s_token : max(last, 0);
}

}  // namespace sampling_ops

extern "C" __global__ void __launch_bounds__(sampling_ops::kPenaltyThreads)
    apply_penalties_f32(float* logits, const int* entry_offsets, const int* entry_tokens,
                        const int* entry_counts, const int* entry_flags, const float* repetition,
                        const float* frequency, const float* presence, int vocab) {
    sampling_ops::apply_penalties(logits, entry_offsets, entry_tokens, entry_counts, entry_flags,
                                  repetition, frequency, presence, vocab);
}

extern "C" __global__ void __launch_bounds__(sampling_ops::kThreads)
    sample_f32(int* out_tokens, const float* logits, const float* temperature, const int* top_k,
               const float* top_p, const float* min_p, const float* uniforms, int vocab) {
    sampling_ops::sample(out_tokens, logits, temperature, top_k, top_p, min_p, uniforms, vocab);
}
