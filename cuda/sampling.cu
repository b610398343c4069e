// sampling.cu -- logits processing and sampling on the device, in vLLM's order (the order
// runtime/sampler.py's docstring fixes, steps 1-10): sparse logits processors (allowed-token
// mask, bad-word / min_tokens bans, logit bias, penalties), then per row greedy argmax or
// temperature / min-p / top-k / top-p and an inverse-CDF draw, without sorting the vocabulary.
// Reproduces the distribution of runtime/sampler.py, not its bits.
//
// process_logits_f32 -- steps 1-4, in place, per row r (one CTA):
//   1. allowed mask: when allowed_offsets[r] < allowed_offsets[r + 1], every token not in
//      allowed_tokens[allowed_offsets[r] .. allowed_offsets[r + 1]) gets -inf (each thread
//      binary-searches its strided tokens: vocab x log2(allowed) per row, no scratch). An
//      empty range means "no allowed list" (SamplingParams refuses an empty one).
//   __syncthreads(), then for each entry e of the row's sparse list (entry_offsets[r] ..
//   entry_offsets[r + 1]; tokens distinct within a row, so no two threads touch one logit):
//      t = entry_tokens[e], c = entry_counts[e] (times t occurs in the output), v = logits[r, t]
//   2-3. if flags & BANNED (a bad word's last token, or min_tokens not reached and t a stop /
//        eos id): v = -inf; then v += entry_bias[e] (logit_bias, 0 when none; finite, so a
//        -inf stays -inf: bans win over bias)
//   4. if flags & SEEN (t in prompt or output) and repetition[r] != 1:
//          v = v > 0 ? v / repetition[r] : v * repetition[r]
//      if c > 0: v -= frequency[r] * c, then v -= presence[r]   (numpy's order; the products
//      are __fmul_rn so no FMA contraction changes the rounding: bit-identical to numpy)
//   Pointers: logits [num_rows, vocab] f32; allowed_offsets [num_rows + 1] int32;
//   allowed_tokens [num_allowed] int32, ascending and distinct within a row, in [0, vocab);
//   entry_offsets [num_rows + 1] int32; entry_tokens, entry_counts, entry_flags [num_entries]
//   int32 (tokens ascending within a row, in [0, vocab)); entry_bias [num_entries] f32;
//   repetition, frequency, presence [num_rows] f32.
//   Launch: grid (num_rows), block 128. The wrapper skips the launch when no row has an entry
//   or an allowed list.
//
// sample_f32 -- steps 5-10, per row r (one CTA), reading logits row logits_rows[r] of logits
// [num_logits_rows, vocab] f32 (processed), out_tokens [num_rows] int32; logits_rows
// [num_rows] int32 in [0, num_logits_rows): the n sequences of an n > 1 request's first token
// read one processed row, each with its own uniform (runtime/logits_row_groups.py), so nothing
// is [n, vocab]; per-row parameters temperature, top_p, min_p, uniforms [num_rows] f32 and
// top_k [num_rows] int32 (<= 0 or >= vocab: off); uniforms in [0, 1) come from the host
// (per-request seeded generators, as in the numpy sampler); L = logits[logits_rows[r]]:
//   temperature <= 0: greedy, out = argmax(L) with ties to the lowest id.
//   else s = L / temperature (NaN -> -inf, +inf -> the largest float, as numpy);
//     M = max s; a row with M = -inf (every token masked) gets token 0
//     w = exp(s - M) (the largest w is exactly 1)
//     min-p: keep w >= min_p (p / p_max = w)
//     top-k: K = the k-th largest s over the whole row (radix select), keep s >= K (ties at
//       the boundary kept). Counting over the whole row rather than over min-p's survivors
//       gives the same set: both filters keep an upper set of the same order, so they commute.
//     top-p, over the min-p and top-k survivors (after them: vLLM's order, issue 22): T = the
//       largest weight such that the mass of kept weights >= T is >= top_p x their sum (radix
//       select on weight bits, mass-weighted); keep w >= T. Same set as the numpy rule "keep
//       while the mass before a token is < top_p", except that exact weight ties straddling
//       the boundary are all kept here.
//     out = the first token, in ascending id order, whose cumulative kept weight exceeds
//       u x (total kept weight) (rounding past the end: the last kept token).
// Radix select: keys are the float bits made order-preserving as uint32, settled 8 bits per
// pass (4 passes) with a 256-bin shared histogram of count (top-k) or weight (top-p); each
// pass reads only the logits row (L2-resident after the first pass). The inverse CDF gives
// each thread a contiguous id range: per-thread sums, a block scan, and one thread walks
// the range that holds the target.
// Launch: grid (num_rows), block 256, no dynamic shared memory (static 1 KiB histogram);
// __launch_bounds__(256, 4), so up to the 64-register budget.
//
// Instantiations: process_logits_f32, sample_f32 (logits are fp32: the LM head GEMM writes
// fp32 logits from bf16/fp16 activations). Scalars: int vocab.
// Signatures: process_logits_f32(logits, allowed_offsets, allowed_tokens, entry_offsets,
// entry_tokens, entry_counts, entry_flags, entry_bias, repetition, frequency, presence, vocab);
// sample_f32(out_tokens, logits, logits_rows, temperature, top_k, top_p, min_p, uniforms,
// vocab).
// Launched by runtime/kernels/sampling.py: process_logits, sample (which KernelSampler,
// runtime/backends/kernel_sampler.py, calls for the kernel backends).
//
// Register budget: 64 per thread; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"
#include "reduce.cuh"

namespace sampling_ops {

constexpr int kThreads = 256;
// sample_f32's occupancy hint: 4 CTAs of 256 threads per SM allow up to 64 registers per
// thread, the budget. With the thread bound alone ptxas (13.0) kept sample_f32 at 32 registers
// and spilled 4 bytes on sm_90 once min-p moved before top-p (2026-12-01, issue 22).
constexpr int kMinCtasPerSm = 4;
constexpr int kWarps = kThreads / 32;
constexpr int kPenaltyThreads = 128;
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kFlagSeen = 1;
constexpr int kFlagBanned = 2;
constexpr unsigned kSignBit = 0x80000000u;
constexpr unsigned kFloatMaxBits = 0x7f7fffffu;

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// logit / temperature with numpy's nan_to_num: NaN -> -inf, +inf -> the largest float (a huge
// bias or penalty overflowing: those tokens share the mass instead of making the row NaN).
__device__ __forceinline__ float scaled_logit(float logit, float temp) {
    const float s = logit / temp;
    return s != s ? neg_inf() : fminf(s, __uint_as_float(kFloatMaxBits));
}

// Order-preserving uint32 of a float (larger float -> larger key; NaN is not expected).
__device__ __forceinline__ uint32_t ordered_key(float v) {
    const uint32_t bits = __float_as_uint(v);
    return (bits & kSignBit) ? ~bits : (bits | kSignBit);
}

// Whether token is in sorted[0 .. count) (ascending, distinct).
__device__ __forceinline__ bool contains_sorted(const int* sorted, int count, int token) {
    int lo = 0, hi = count;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (sorted[mid] < token) lo = mid + 1; else hi = mid;
    }
    return lo < count && sorted[lo] == token;
}

__device__ __forceinline__ void process_logits(float* logits, const int* allowed_offsets,
                                               const int* allowed_tokens,
                                               const int* entry_offsets, const int* entry_tokens,
                                               const int* entry_counts, const int* entry_flags,
                                               const float* entry_bias, const float* repetition,
                                               const float* frequency, const float* presence,
                                               int vocab) {
    const int row = blockIdx.x;
    float* row_logits = logits + static_cast<long long>(row) * vocab;
    const int allowed_begin = allowed_offsets[row];
    const int num_allowed = allowed_offsets[row + 1] - allowed_begin;
    if (num_allowed > 0) {  // step 1, before any entry reads a logit
        for (int i = threadIdx.x; i < vocab; i += kPenaltyThreads)
            if (!contains_sorted(allowed_tokens + allowed_begin, num_allowed, i))
                row_logits[i] = neg_inf();
    }
    __syncthreads();
    const float rep = repetition[row], freq = frequency[row], pres = presence[row];
    for (int e = entry_offsets[row] + threadIdx.x; e < entry_offsets[row + 1];
         e += kPenaltyThreads) {
        const int token = entry_tokens[e];
        if (token < 0 || token >= vocab) continue;  // the wrapper never sends one
        const int flags = entry_flags[e];
        const int count = entry_counts[e];
        float v = row_logits[token];
        if (flags & kFlagBanned) v = neg_inf();                            // steps 2-3: bans
        v += entry_bias[e];                                               // step 3: bias
        if ((flags & kFlagSeen) && rep != 1.f) v = v > 0.f ? v / rep : __fmul_rn(v, rep);
        if (count > 0) {                                                   // step 4
            v -= __fmul_rn(freq, static_cast<float>(count));
            v -= pres;
        }
        row_logits[token] = v;
    }
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
                                       const int* logits_rows,
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
    const float* row_logits = logits + static_cast<long long>(logits_rows[row]) * vocab;
    const float temp = temperature[row];

    if (temp <= 0.f) {  // greedy
        float best = neg_inf();
        int best_idx = vocab;  // any real token beats it on ties
        for (int i = threadIdx.x; i < vocab; i += kThreads)
            if (reduce::argmax_better(row_logits[i], i, best, best_idx)) {
                best = row_logits[i];
                best_idx = i;
            }
        const int token = reduce::block_argmax<kThreads>(best, best_idx, s_red, s_red_idx);
        if (threadIdx.x == 0) out_tokens[row] = token < vocab ? token : 0;
        return;
    }

    float local_max = neg_inf();
    for (int i = threadIdx.x; i < vocab; i += kThreads)
        local_max = fmaxf(local_max, scaled_logit(row_logits[i], temp));
    const float max_scaled = reduce::block_max<kThreads>(local_max, s_red);
    if (max_scaled == neg_inf()) {  // every token masked: token 0, as numpy (uniform branch)
        if (threadIdx.x == 0) out_tokens[row] = 0;
        return;
    }

    // top-k threshold on the scaled logits (count measure; see the header for why over the
    // whole row)
    const int k = top_k[row];
    uint32_t k_key = 0;  // every key >= 0: keep all
    if (k > 0 && k < vocab) {
        k_key = radix_select(vocab, static_cast<float>(k),
                             [&](int i, uint32_t& key, float& measure) {
                                 key = ordered_key(scaled_logit(row_logits[i], temp));
                                 measure = 1.f;
                                 return true;
                             },
                             s_hist, &s_choice, &s_above);
    }
    const float min_weight = min_p[row];
    // The weight of a min-p and top-k survivor, 0 for the others.
    auto weight_of = [&](int i) {
        const float s = scaled_logit(row_logits[i], temp);
        const float w = expf(s - max_scaled);
        return (w >= min_weight && ordered_key(s) >= k_key) ? w : 0.f;
    };

    // top-p threshold on the surviving weights (mass measure)
    const float p = top_p[row];
    uint32_t p_key = 0;
    if (p < 1.f) {
        float local_sum = 0.f;
        for (int i = threadIdx.x; i < vocab; i += kThreads) local_sum += weight_of(i);
        const float total = reduce::block_sum<kThreads>(local_sum, s_red);
        p_key = radix_select(vocab, p * total,
                             [&](int i, uint32_t& key, float& measure) {
                                 measure = weight_of(i);
                                 key = __float_as_uint(measure);  // w >= 0: bits are ordered
                                 return measure > 0.f;
                             },
                             s_hist, &s_choice, &s_above);
    }
    auto kept_weight = [&](int i) {
        const float w = weight_of(i);
        return (w > 0.f && __float_as_uint(w) >= p_key) ? w : 0.f;
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
    const float incl = reduce::warp_inclusive_scan(mine, lane);
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
    const int last = reduce::block_argmax<kThreads>(static_cast<float>(last_kept), last_kept, s_red,
                                                    s_red_idx);
    if (threadIdx.x == 0) out_tokens[row] = s_token >= 0 ? s_token : max(last, 0);
}

}  // namespace sampling_ops

extern "C" __global__ void __launch_bounds__(sampling_ops::kPenaltyThreads)
    process_logits_f32(float* logits, const int* allowed_offsets, const int* allowed_tokens,
                       const int* entry_offsets, const int* entry_tokens, const int* entry_counts,
                       const int* entry_flags, const float* entry_bias, const float* repetition,
                       const float* frequency, const float* presence, int vocab) {
    sampling_ops::process_logits(logits, allowed_offsets, allowed_tokens, entry_offsets,
                                 entry_tokens, entry_counts, entry_flags, entry_bias, repetition,
                                 frequency, presence, vocab);
}

extern "C" __global__ void
    __launch_bounds__(sampling_ops::kThreads, sampling_ops::kMinCtasPerSm)
    sample_f32(int* out_tokens, const float* logits, const int* logits_rows,
               const float* temperature, const int* top_k, const float* top_p,
               const float* min_p, const float* uniforms, int vocab) {
    sampling_ops::sample(out_tokens, logits, logits_rows, temperature, top_k, top_p, min_p,
                         uniforms, vocab);
}
