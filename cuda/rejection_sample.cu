// rejection_sample.cu -- the verification step of speculative decoding: which of each
// request's proposed tokens the target model accepts, and the one token drawn after them.
// The numpy reference and the rule's derivation: runtime/spec_decode/rejection_sampler.py.
//
// Per request b (one CTA) with k = num_draft[b] proposed tokens x_0 .. x_{k-1}, K = max k:
//   p_i = target_weights[b, i] / its sum   (the plain sampler's distribution at position i:
//         logits processors and filters already applied; greedy rows are one-hot)
//   q_i = draft_weights[b, i] / its sum    (has_draft_probs), else the point mass on x_i
//   greedy[b]: accept x_i while argmax p_i == x_i (ties: lowest id); then the argmax of the
//     first unaccepted position (the correction, or the bonus at i = k).
//   sampled:   accept x_i while u_i * q_i(x_i) < p_i(x_i) (u_i = uniforms[b, i]); at the
//     first rejection draw from the residual max(0, p_i - q_i) (p_i when it has no mass);
//     with all k accepted draw the bonus from target_weights[b, k]; the draw is the inverse
//     CDF at u_k = uniforms[b, k] (the uniform after the request's k acceptance tests, whatever
//     happened: a seed always consumes k + 1 uniforms).
//   out: token_ids[b, 0 .. a-1] = x_0 .. x_{a-1} (a accepted), token_ids[b, a] = the drawn token,
//     token_ids[b, a+1 ..] = -1; num_emitted[b] = a + 1.
// Sums, probabilities and the CDF are float64, as in the reference (the uniforms are float64
// draws): an acceptance or a draw differs from numpy only where u lands within rounding of a
// boundary. The inverse CDF picks the first id (ascending) whose cumulative weight exceeds
// u x total; rounding past the total picks the last id with weight.
//
// Pointers (all contiguous):
//   token_ids        [num_reqs, K + 1]            int32   out
//   num_emitted      [num_reqs]                   int32   out
//   target_weights   [num_reqs, K + 1, vocab]     f32 >= 0, every row of a position < k + 1
//                                                 with mass (verification_weights guarantees)
//   draft_weights    [num_reqs, K, vocab]         f32 >= 0 (has_draft_probs), else 1 element
//   draft_token_ids  [num_reqs, K]                int32 in [0, vocab) for i < num_draft[b]
//   num_draft        [num_reqs]                   int32 in [0, K]
//   greedy           [num_reqs]                   int32 (0 / 1)
//   uniforms         [num_reqs, K + 1]            f64 in [0, 1)
// Scalars: int max_draft (K), vocab, has_draft_probs.
// Launch: grid (num_reqs), block 256, no dynamic shared memory.
// Signature: rejection_sample(token_ids, num_emitted, target_weights, draft_weights,
// draft_token_ids, num_draft, greedy, uniforms, max_draft, vocab, has_draft_probs).
// Launched by runtime/kernels/rejection.py: rejection_sample.
//
// Cost: the acceptance tests read one or two vocab rows per tested position (a sum each; the
// greedy test an argmax), the draw one more pass (two with a residual): a few vocab-sized
// reads per request, against the k + 1 LM-head rows the target just wrote.
// Register budget: 64 per thread (__launch_bounds__(256, 4)); the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"
#include "reduce.cuh"

namespace rejection {

constexpr int kThreads = 256;
constexpr int kMinCtasPerSm = 4;
constexpr int kWarps = kThreads / 32;
constexpr int kPlaceholder = -1;  // PLACEHOLDER_TOKEN_ID of rejection_sampler.py

struct Shared {
    double red[kWarps];
    float val[kWarps];
    int idx[kWarps];
    int token;
};

__device__ __forceinline__ double row_sum(const float* row, int vocab, Shared& sh) {
    double s = 0.0;
    for (int t = threadIdx.x; t < vocab; t += kThreads) s += row[t];
    return reduce::block_sum<kThreads>(s, sh.red);
}

// Argmax of a row, ties to the lowest id; every thread gets it.
__device__ __forceinline__ int row_argmax(const float* row, int vocab, Shared& sh) {
    float v = -CUDART_INF_F;
    int idx = vocab;
    for (int t = threadIdx.x; t < vocab; t += kThreads)
        if (reduce::argmax_better(row[t], t, v, idx)) { v = row[t]; idx = t; }
    return reduce::block_argmax<kThreads>(v, idx, sh.val, sh.idx);
}

// First id whose cumulative weight(id) exceeds u x total (weight >= 0, float64), ascending ids;
// rounding past the total: the last id with weight. Thread t owns ids [t * span, (t+1) * span).
template <typename Weight>
__device__ __forceinline__ int inverse_cdf(Weight weight, int vocab, double u, Shared& sh) {
    const int span = (vocab + kThreads - 1) / kThreads;
    const int begin = min(vocab, static_cast<int>(threadIdx.x) * span);
    const int end = min(vocab, begin + span);
    double mine = 0.0;
    int last = -1;
    for (int t = begin; t < end; ++t) {
        const double w = weight(t);
        mine += w;
        if (w > 0.0) last = t;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const double incl = reduce::warp_inclusive_scan(mine, lane);
    __syncthreads();
    if (lane == 31) sh.red[warp] = incl;
    if (threadIdx.x == 0) sh.token = -1;
    __syncthreads();
    double warp_prefix = 0.0, total = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        if (w < warp) warp_prefix += sh.red[w];
        total += sh.red[w];
    }
    const double before = warp_prefix + incl - mine;
    const double target = u * total;
    if (mine > 0.0 && before <= target && target < before + mine) {
        double cum = before;
        int chosen = last;  // rounding inside the range: its last id with weight
        for (int t = begin; t < end; ++t) {
            cum += weight(t);
            if (cum > target) { chosen = t; break; }
        }
        atomicMax(&sh.token, chosen);  // one thread in exact arithmetic
    }
    __syncthreads();
    const int token = sh.token;
    // Rounding past the total: the last id with weight (the largest `last` of the block).
    const int last_any = reduce::block_max<kThreads>(last, sh.idx);
    return token >= 0 ? token : max(last_any, 0);
}

__device__ __forceinline__ void verify(int* __restrict__ token_ids, int* __restrict__ num_emitted,
                                       const float* __restrict__ target_weights,
                                       const float* __restrict__ draft_weights,
                                       const int* __restrict__ draft_token_ids,
                                       const int* __restrict__ num_draft,
                                       const int* __restrict__ greedy,
                                       const double* __restrict__ uniforms, int max_draft,
                                       int vocab, int has_draft_probs) {
    __shared__ Shared sh;
    const int b = blockIdx.x;
    const int k = num_draft[b];
    const bool is_greedy = greedy[b] != 0;
    const long long positions = max_draft + 1;
    const int* draft = draft_token_ids + static_cast<long long>(b) * max_draft;
    const double* u = uniforms + b * positions;
    auto target_row = [&](int i) { return target_weights + (b * positions + i) * vocab; };
    auto draft_row = [&](int i) {
        return draft_weights + (static_cast<long long>(b) * max_draft + i) * vocab;
    };

    // Acceptance tests, position after position; every branch is block-uniform (reductions).
    int accepted = 0;
    for (; accepted < k; ++accepted) {
        const int x = draft[accepted];
        const float* p_row = target_row(accepted);
        bool ok;
        if (is_greedy) {
            ok = row_argmax(p_row, vocab, sh) == x;
        } else {
            const double p_x = p_row[x] / row_sum(p_row, vocab, sh);
            double q_x = 1.0;
            if (has_draft_probs) {
                const float* q_row = draft_row(accepted);
                const double q_sum = row_sum(q_row, vocab, sh);
                q_x = q_sum > 0.0 ? q_row[x] / q_sum : 0.0;
            }
            ok = u[accepted] * q_x < p_x;
        }
        if (!ok) break;
    }

    // The token after the accepted ones.
    const float* p_row = target_row(accepted);
    int token;
    if (is_greedy) {
        token = row_argmax(p_row, vocab, sh);
    } else if (accepted == k) {  // bonus: the plain sampler's draw over the target's weights
        token = inverse_cdf([&](int t) { return static_cast<double>(p_row[t]); }, vocab, u[k],
                            sh);
    } else {  // correction: the residual max(0, p - q), or p when it has no mass
        const double p_inv = 1.0 / row_sum(p_row, vocab, sh);
        const int x = draft[accepted];
        const float* q_row = has_draft_probs ? draft_row(accepted) : nullptr;
        double q_inv = 0.0;
        if (has_draft_probs) {
            const double q_sum = row_sum(q_row, vocab, sh);
            q_inv = q_sum > 0.0 ? 1.0 / q_sum : 0.0;
        }
        auto residual = [&](int t) {
            const double q = has_draft_probs ? q_row[t] * q_inv : (t == x ? 1.0 : 0.0);
            return fmax(p_row[t] * p_inv - q, 0.0);
        };
        double mass = 0.0;
        for (int t = threadIdx.x; t < vocab; t += kThreads) mass += residual(t);
        if (reduce::block_sum<kThreads>(mass, sh.red) > 0.0) {
            token = inverse_cdf(residual, vocab, u[k], sh);
        } else {
            token = inverse_cdf([&](int t) { return static_cast<double>(p_row[t]); }, vocab,
                                u[k], sh);
        }
    }

    int* out = token_ids + b * positions;
    for (int i = threadIdx.x; i < positions; i += kThreads)
        out[i] = i < accepted ? draft[i] : (i == accepted ? token : kPlaceholder);
    if (threadIdx.x == 0) num_emitted[b] = accepted + 1;
}

}  // namespace rejection

extern "C" __global__ void __launch_bounds__(rejection::kThreads, rejection::kMinCtasPerSm)
rejection_sample(int* token_ids, int* num_emitted, const float* target_weights,
                 const float* draft_weights, const int* draft_token_ids, const int* num_draft,
                 const int* greedy, const double* uniforms, int max_draft, int vocab,
                 int has_draft_probs) {
    rejection::verify(token_ids, num_emitted, target_weights, draft_weights, draft_token_ids,
                      num_draft, greedy, uniforms, max_draft, vocab, has_draft_probs);
}
