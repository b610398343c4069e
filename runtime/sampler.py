"""Sampler: logits of the rows that sample this step -> next token ids (+ logprobs when asked).

Order of processing, per row: vLLM's (vllm/v1/sample/sampler.py Sampler.forward, the built-in
logits processors, vllm/v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p):
  0. values for logprobs, rows that asked only: logprobs_mode raw_logprobs (the default):
     log_softmax of the model's logits; raw_logits: the logits themselves.
  Logits processors, on a float32 copy:
  1. allowed_token_ids: every token not listed gets -inf.
  2. bad words (params.bad_words_token_ids, set by the engine): a word's last token gets -inf
     when the last L-1 output tokens equal its first L-1 (a one-token word: always).
  3. min_tokens: while fewer than min_tokens tokens were generated, the request's
     stop_token_ids and the model's eos ids get -inf (eos even with ignore_eos: vLLM counts eos
     among every request's stop tokens). Then logit_bias is added to its tokens.
  4. penalties: repetition (tokens in prompt + output: positive logits divided by the penalty,
     others multiplied), then frequency (minus penalty x count in the output), then presence
     (minus penalty if the token occurs in the output). A token banned in 1-3 stays -inf.
  5. greedy rows (temperature < GREEDY_TEMPERATURE_EPS): argmax, ties to the lowest token id.
     No random draw is consumed.
  Sampled rows:
  6. temperature: logits / temperature.
  7. min-p: drop tokens whose probability is < min_p x the largest probability.
  8. top-k: keep tokens whose logit is >= the k-th largest (ties at the boundary kept); found
     by a chunk-max filter and a partition of the survivors, never a sort of the vocabulary.
  9. top-p: over the renormalized survivors of 7-8, in order of decreasing probability (ties:
     lower id first), keep a token while the mass before it is < top_p (the most likely token
     always stays). Only a growing candidate set is sorted (TOP_P_FIRST_CANDIDATES, then x4).
     min-p and top-k commute (each keeps an upper set of the same order); top-p does not, so
     min-p's place before it changes the distribution (issue 22).
  10. draw by inverse CDF with ONE uniform u in [0, 1) per row: over the kept tokens in
     ascending id order, the first whose cumulative mass exceeds u x (total mass). vLLM draws
     by exponential races (argmax of probs / Exp(1) noise): the same distribution, other bits.
     A CUDA sampling kernel must reproduce this distribution, not these bits.
  11. processed values for logprobs: processed_logits are the logits after 1-9 with every
     filtered token at -inf (greedy rows: after 1-4, no temperature); processed_logprobs their
     log_softmax.
A row whose every token is masked (-inf everywhere) gets token 0, greedy or not: the argmax
of an all -inf row, and what the sampling kernel returns.

Logprobs of a row (`token_logprobs`): the chosen token's value and rank (1 + the number of
tokens with a strictly larger value) and the params.logprobs largest values, best first (ties:
lower id first; -1: the whole vocabulary).

Forks: the n sequences of an n > 1 request sample their first token from one logits row; rows
that read one row with the same params, prompt and output (runtime/logits_row_groups.py) are
processed once (steps 0-9) and each draws its own token from the shared row (step 10 with its
own uniform), so nothing is [n, vocab].

Randomness: a request with a seed has its own generator (`make_request_generator`), drawn from
once per sampled (non-greedy) token, so the same seed yields the same tokens whatever else is in
the batch. Rows without one draw, in row order, from the sampler's own generator (engine seed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .engine_config import LOGPROBS_MODES
from .logits_row_groups import group_rows
from .outputs import TokenLogprobs
from .sampling_params import SamplingParams

# First candidate-set size for top-p; grows x TOP_P_GROWTH until it holds top_p of the mass.
# Chat-model distributions put top_p = 0.9..0.95 of the mass in well under 64 tokens, so one
# partition + a 64-element sort is the usual cost instead of a sort of the whole vocabulary.
TOP_P_FIRST_CANDIDATES = 64
TOP_P_GROWTH = 4
# Tokens per chunk whose maximum bounds the top-k / top-p candidate search (see _heaviest).
CANDIDATE_CHUNK = 64
# Tokens per chunk of the two-level inverse CDF (see inverse_cdf).
CDF_CHUNK = 1024
# Rows sampled together: bounds the [rows, vocab] float32 temporaries
# (32 x 128k x 4 B = 16 MiB each).
SAMPLE_ROW_CHUNK = 32
# +inf logits (a huge bias or penalty overflowing float32) become the largest float, so the
# tokens that overflowed share the mass instead of turning the row into NaNs.
FLOAT32_MAX = np.finfo(np.float32).max


@dataclass
class SamplerOutput:
    """token_ids: [num_rows] int32, the chosen token of each row.
    logprobs: per row, TokenLogprobs of the chosen token (values per the sampler's
    logprobs_mode, top params.logprobs alternatives) or None when the request did not ask."""

    token_ids: np.ndarray
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


def make_request_generator(seed: int | None, sequence_index: int = 0) -> np.random.Generator | None:
    """The private generator of a seeded request (None: the request draws from the engine's).

    Sequence j of an n > 1 request draws from PCG64(seed + j), as vLLM seeds its children
    (vllm/v1/engine/parallel_sampling.py ParentRequest): sequence 0 is exactly the n = 1
    stream. PCG64 takes any non-negative integer, so seed + j past 2**64 - 1 is fine.
    """
    if seed is None:
        return None
    return np.random.Generator(np.random.PCG64(seed + sequence_index))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log_softmax in float32 (max subtracted, float64 sum). logits: [rows, vocab].

    -inf entries stay -inf; +inf counts as the largest float, NaN as -inf; a row that is -inf
    everywhere comes back -inf everywhere (no NaN).
    """
    x = np.nan_to_num(np.asarray(logits, dtype=np.float32), nan=-np.inf, posinf=FLOAT32_MAX,
                      neginf=-np.inf)
    row_max = x.max(axis=-1, keepdims=True)
    row_max[~np.isfinite(row_max)] = 0.0  # an all -inf row: every exp is 0
    with np.errstate(over="ignore", divide="ignore"):
        shifted = x - row_max
        log_total = np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64))
    out = (shifted - np.where(np.isfinite(log_total), log_total, 0.0)).astype(np.float32)
    return out


def token_logprobs(values_row: np.ndarray, token_id: int, num_top: int) -> TokenLogprobs:
    """The logprobs entry of one position. values_row: [vocab] float32 (logprobs or logits);
    rank = 1 + the number of tokens with a strictly larger value; top: the num_top largest
    values, best first, ties to the lower id (num_top -1: the whole vocabulary)."""
    row = np.asarray(values_row, dtype=np.float32)
    vocab_size = row.shape[0]
    value = row[token_id]
    rank = 1 + int(np.count_nonzero(row > value))
    num_top = vocab_size if num_top < 0 else min(num_top, vocab_size)
    top_ids = _largest_ids(row, num_top)
    return TokenLogprobs(token_id=int(token_id), logprob=float(value), rank=rank,
                         top_token_ids=top_ids.tolist(), top_logprobs=row[top_ids].tolist())


def _largest_ids(row: np.ndarray, count: int) -> np.ndarray:
    """Ids of the `count` largest entries of row [vocab], best first, ties to the lower id."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    if count >= row.shape[0]:
        ids = np.arange(row.shape[0])
    else:
        # The count-th largest value; every larger entry is in, then the lowest ids equal to it.
        boundary = -np.partition(-row, count - 1)[count - 1]
        above = np.flatnonzero(row > boundary)
        at = np.flatnonzero(row == boundary)[:count - above.size]
        ids = np.concatenate([above, at])
    return ids[np.lexsort((ids, -row[ids]))]


# ---------------------------------------------------------------- logits processors (1-4)

def apply_allowed_token_ids(logits: np.ndarray, params: Sequence[SamplingParams]) -> None:
    """Step 1, in place: tokens outside a row's allowed_token_ids get -inf. logits [rows, vocab]."""
    vocab_size = logits.shape[1]
    for i, p in enumerate(params):
        if p.allowed_token_ids is None:
            continue
        allowed = _in_vocab(p.allowed_token_ids, vocab_size)
        kept = logits[i, allowed]
        logits[i] = -np.inf
        logits[i, allowed] = kept


def banned_token_ids(p: SamplingParams, output_token_ids: Sequence[int],
                     eos_token_ids: Sequence[int]) -> list[int]:
    """Steps 2-3's bans of one row: bad words' last tokens whose prefix ends the output, and
    (min_tokens not reached) the stop ids and eos ids. May repeat ids; not vocab-checked."""
    banned: list[int] = []
    num_output = len(output_token_ids)
    for word in p.bad_words_token_ids or ():
        prefix_len = len(word) - 1
        if prefix_len < 0 or prefix_len > num_output:
            continue
        if prefix_len == 0 or [int(t) for t in output_token_ids[num_output - prefix_len:]] \
                == [int(t) for t in word[:-1]]:
            banned.append(int(word[-1]))
    if num_output < p.min_tokens:
        banned.extend(int(t) for t in p.stop_token_ids)
        banned.extend(int(t) for t in eos_token_ids)
    return banned


def apply_bans(logits: np.ndarray, params: Sequence[SamplingParams],
               output_token_ids: Sequence[Sequence[int]],
               eos_token_ids: Sequence[int]) -> None:
    """Steps 2-3's bans (bad words, min_tokens), in place: -inf. logits [rows, vocab]."""
    vocab_size = logits.shape[1]
    for i, p in enumerate(params):
        banned = banned_token_ids(p, output_token_ids[i], eos_token_ids)
        if banned:
            logits[i, _in_vocab(banned, vocab_size)] = -np.inf


def apply_logit_bias(logits: np.ndarray, params: Sequence[SamplingParams]) -> None:
    """Step 3's logit_bias, in place (a -inf token stays -inf: the bias is finite)."""
    vocab_size = logits.shape[1]
    for i, p in enumerate(params):
        if not p.logit_bias:
            continue
        ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
        bias = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
        inside = (ids >= 0) & (ids < vocab_size)  # the engine refuses others at admission
        with np.errstate(over="ignore"):
            logits[i, ids[inside]] += bias[inside]


def apply_penalties(logits: np.ndarray, params: Sequence[SamplingParams],
                    prompt_token_ids: Sequence[np.ndarray],
                    output_token_ids: Sequence[Sequence[int]]) -> None:
    """Step 4: repetition, then frequency, then presence penalties, in place.

    logits [rows, vocab] f32. Works on the distinct token ids of each row (np.unique), never on
    a vocabulary-sized count.
    """
    vocab_size = logits.shape[1]
    for i, p in enumerate(params):
        has_rep = p.repetition_penalty != 1.0
        if not (has_rep or p.frequency_penalty or p.presence_penalty):
            continue
        row = logits[i]
        output_ids, output_counts = np.unique(np.asarray(output_token_ids[i], dtype=np.int64),
                                              return_counts=True)
        inside = (output_ids >= 0) & (output_ids < vocab_size)
        output_ids, output_counts = output_ids[inside], output_counts[inside]
        with np.errstate(over="ignore"):
            if has_rep:
                seen = _in_vocab(np.union1d(output_ids, np.asarray(prompt_token_ids[i],
                                                                   dtype=np.int64)), vocab_size)
                # A penalty below float32's smallest normal would divide by zero; the smallest
                # normal gives the same answer, +inf, which sampling handles.
                penalty = np.float32(max(p.repetition_penalty, np.finfo(np.float32).tiny))
                row[seen] = np.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
            if p.frequency_penalty:
                row[output_ids] -= (np.float32(p.frequency_penalty)
                                    * output_counts.astype(np.float32))
            if p.presence_penalty:
                row[output_ids] -= np.float32(p.presence_penalty)


def may_process(p: SamplingParams) -> bool:
    """Whether steps 1-4 can change a row of these params (False: they leave it untouched; a
    superset, since e.g. a bad word may not complete this step)."""
    return bool(p.allowed_token_ids is not None or p.bad_words_token_ids or p.min_tokens
                or p.logit_bias or p.repetition_penalty != 1.0 or p.frequency_penalty
                or p.presence_penalty)


def apply_logits_processors(logits: np.ndarray, params: Sequence[SamplingParams],
                            prompt_token_ids: Sequence[np.ndarray],
                            output_token_ids: Sequence[Sequence[int]],
                            eos_token_ids: Sequence[int]) -> None:
    """Steps 1-4 in vLLM's order, in place. logits: [rows, vocab] float32."""
    apply_allowed_token_ids(logits, params)
    apply_bans(logits, params, output_token_ids, eos_token_ids)
    apply_logit_bias(logits, params)
    apply_penalties(logits, params, prompt_token_ids, output_token_ids)


def _in_vocab(token_ids, vocab_size: int) -> np.ndarray:
    """token_ids as int64, those outside [0, vocab_size) dropped (never index past the vocab)."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    return ids[(ids >= 0) & (ids < vocab_size)]


# ---------------------------------------------------------------- filters and draw (6-10)

def _heaviest(row: np.ndarray, count: int) -> np.ndarray:
    """Ids of the `count` largest entries of row [vocab] (any order), without partitioning it all.

    The `count` largest chunk maxima are `count` distinct entries >= their minimum, so every one
    of the `count` largest entries is >= that minimum: a cheap filter, then a partition of the
    few survivors.
    """
    vocab_size = row.shape[0]
    if count >= vocab_size:
        return np.arange(vocab_size)
    num_chunks = vocab_size // CANDIDATE_CHUNK
    if num_chunks >= count:
        chunk_max = (
            row[:num_chunks * CANDIDATE_CHUNK].reshape(num_chunks, CANDIDATE_CHUNK).max(axis=1)
        )
        bound = np.partition(chunk_max, num_chunks - count)[num_chunks - count]
        pool = np.flatnonzero(row >= bound)
    else:
        pool = np.arange(vocab_size)
    if pool.size > count:
        pool = pool[np.argpartition(-row[pool], count - 1)[:count]]
    return pool


def _top_p_kept(weights_row: np.ndarray, top_p: float) -> np.ndarray:
    """Ids of the top-p set of one row (step 9).

    weights_row: [vocab] f32 unnormalized (0 for filtered tokens). In decreasing weight order
    (ties: lower id first) a token is kept while the mass before it is < top_p x total. Only the
    TOP_P_FIRST_CANDIDATES heaviest tokens are sorted; if they hold less than top_p of the
    mass, TOP_P_GROWTH times more are taken. (Exact weight ties that straddle the candidate
    boundary are broken arbitrarily.)
    """
    vocab_size = weights_row.shape[0]
    limit = top_p * float(weights_row.sum(dtype=np.float64))
    num_candidates = min(TOP_P_FIRST_CANDIDATES, vocab_size)
    while True:
        candidates = _heaviest(weights_row, num_candidates)
        ordered = candidates[np.lexsort((candidates, -weights_row[candidates]))]
        ordered_w = weights_row[ordered].astype(np.float64)
        cumulative = np.cumsum(ordered_w)
        if cumulative[-1] >= limit or num_candidates >= vocab_size:
            break
        num_candidates = min(vocab_size, num_candidates * TOP_P_GROWTH)
    return ordered[((cumulative - ordered_w) < limit) & (ordered_w > 0)]


def filter_rows(logits: np.ndarray, params: Sequence[SamplingParams]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Steps 6-9 for sampled rows. logits: [rows, vocab] f32 after steps 1-4 (not modified).

    Returns (final [rows, vocab] f32: logits / temperature with every filtered token at -inf,
    the processed logits; weights [rows, vocab] f32: exp(final - row max), 0 where filtered,
    the largest exactly 1 unless the row is all -inf, then all 0).
    """
    vocab_size = logits.shape[1]
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        final = logits / temperature[:, None]
    np.nan_to_num(final, copy=False, nan=-np.inf, posinf=FLOAT32_MAX, neginf=-np.inf)
    row_max = final.max(axis=1, keepdims=True)
    row_max[~np.isfinite(row_max)] = 0.0  # every token masked: every weight 0
    with np.errstate(over="ignore"):  # -huge minus the largest float: -inf, weight 0
        weights = np.exp(final - row_max)
    if min_p.any():
        # p / p_max = exp(logit - max logit): min-p relative to the largest weight, 1.
        dropped = weights < min_p[:, None]
        weights[dropped] = 0.0
        final[dropped] = -np.inf
    for i, p in enumerate(params):
        if 0 < p.top_k < vocab_size:
            kth_largest = final[i, _heaviest(final[i], p.top_k)].min()
            dropped = final[i] < kth_largest
            weights[i, dropped] = 0.0
            final[i, dropped] = -np.inf
        if p.top_p < 1.0 and weights[i].any():
            kept = _top_p_kept(weights[i], p.top_p)
            kept_w, kept_final = weights[i, kept], final[i, kept]
            weights[i] = 0.0
            final[i] = -np.inf
            weights[i, kept] = kept_w
            final[i, kept] = kept_final
    return final, weights


def inverse_cdf(weights: np.ndarray, uniforms: np.ndarray,
                weight_rows: np.ndarray | None = None) -> np.ndarray:
    """First token whose cumulative weight exceeds u x total, per draw, in ascending id order.

    weights: [rows, vocab] f32 >= 0; uniforms: [draws] in [0, 1); weight_rows: [draws], the
    weights row each draw reads (the members of a group share one), or None (draw i reads
    row i). A row without mass gives token 0. Two levels, because a float64 cumsum over the
    whole vocabulary is the slowest numpy step here: sums of CDF_CHUNK-token chunks locate the
    chunk, a cumsum inside it the token; nothing per draw is [vocab]. Returns [draws] int32.
    """
    num_weight_rows, vocab_size = weights.shape
    if weight_rows is None:
        weight_rows = np.arange(num_weight_rows)
    weight_rows = np.asarray(weight_rows, dtype=np.int64)
    num_rows = weight_rows.size
    num_chunks = -(-vocab_size // CDF_CHUNK)
    padded = weights
    if num_chunks * CDF_CHUNK != vocab_size:
        padded = np.zeros((num_weight_rows, num_chunks * CDF_CHUNK), dtype=weights.dtype)
        padded[:, :vocab_size] = weights
    chunk_cdf = np.cumsum(
        padded.reshape(num_weight_rows, num_chunks, CDF_CHUNK).sum(axis=2, dtype=np.float64),
        axis=1)[weight_rows]  # [draws, num_chunks]
    targets = uniforms * chunk_cdf[:, -1]
    # The chosen chunk is the first whose cumulative mass exceeds the target.
    chunks = np.minimum((chunk_cdf <= targets[:, None]).sum(axis=1), num_chunks - 1)
    tokens = np.zeros(num_rows, dtype=np.int32)
    rows = np.flatnonzero(chunk_cdf[:, -1] > 0)
    if rows.size == 0:
        return tokens
    # Every row at once (a Python loop per row cost ~27 us a row at large batches): the chosen
    # chunk's cumulative weights, then the count of entries <= the target, which is
    # searchsorted(side="right") on a nondecreasing array.
    c = chunks[rows]
    before = np.where(c > 0, chunk_cdf[rows, np.maximum(c - 1, 0)], 0.0)
    inner = padded.reshape(num_weight_rows, num_chunks, CDF_CHUNK)[weight_rows[rows], c]
    cumulative = before[:, None] + np.cumsum(inner, axis=1, dtype=np.float64)
    j = (cumulative <= targets[rows, None]).sum(axis=1)
    for r in np.flatnonzero(j >= CDF_CHUNK):  # rounding between the levels (rare): the last
        i = rows[r]                           # token with mass so far
        last = np.flatnonzero(padded[weight_rows[i], :(c[r] + 1) * CDF_CHUNK])[-1]
        j[r] = int(last) - c[r] * CDF_CHUNK
    tokens[rows] = c * CDF_CHUNK + j
    return tokens


# ---------------------------------------------------------------- the sampler

class Sampler:
    """Samples the next token of every row; holds the engine's generator for unseeded rows."""

    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0,
                 logprobs_mode: str = "raw_logprobs") -> None:
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.generator = np.random.Generator(np.random.PCG64(seed))
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def sample(self, logits: np.ndarray, params: Sequence[SamplingParams],
               generators: Sequence[np.random.Generator | None],
               prompt_token_ids: Sequence[np.ndarray],
               output_token_ids: Sequence[Sequence[int]],
               row_index: Sequence[int] | None = None) -> SamplerOutput:
        """logits: [num_logits_rows, vocab] float32. params / generators / prompt_token_ids /
        output_token_ids: one entry per sampling row (the generator from
        `make_request_generator`, or None for the engine's). row_index: [num_rows], the logits
        row each sampling row reads (the n sequences of an n > 1 request's first token read
        one row); None: row i reads logits row i.
        Rows that read one logits row with the same inputs (runtime/logits_row_groups.py: the
        n siblings) are processed once, as one group; each member draws with its own uniform.
        Returns SamplerOutput (token_ids [num_rows] int32, logprobs per row)."""
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim != 2:
            raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
        check_sample_args(len(params), params, generators, prompt_token_ids, output_token_ids)
        groups = group_rows(row_index, logits.shape[0], params, prompt_token_ids,
                            output_token_ids)
        base = logits if groups.identity else logits[groups.logits_rows]  # [groups, vocab]
        group_params = groups.pick(params)
        group_of = groups.group_of
        want = logprob_rows(params)
        want_groups = groups.groups_of(want)
        raw_mode = self.logprobs_mode.startswith("raw")
        group_values = raw_values(base[want_groups] if raw_mode and want else None,
                                  want_groups, self.logprobs_mode)  # fancy indexing: a copy

        # Steps 1-4 work on a copy, made only when some row has a processor: at large batches
        # the [rows, vocab] copy was most of a greedy step's sampling time.
        processed = base
        if any(may_process(p) for p in group_params):
            processed = base.copy()
            apply_logits_processors(processed, group_params, groups.pick(prompt_token_ids),
                                    groups.pick(output_token_ids), self.eos_token_ids)

        group_tokens = np.zeros(groups.num_groups, dtype=np.int32)
        greedy = np.array([p.greedy for p in group_params], dtype=bool)
        if greedy.all():  # no fancy-index copy of the whole batch
            group_tokens[:] = np.argmax(processed, axis=1)  # first max: lowest id
        elif greedy.any():
            group_tokens[greedy] = np.argmax(processed[greedy], axis=1)
        if not raw_mode:
            group_values.update((g, processed[g]) for g in want_groups if greedy[g])
        token_ids = group_tokens[group_of]  # greedy rows; sampled rows are drawn below
        uniforms = draw_uniforms(self.generator, params, generators)
        members = groups.members()
        sampled_groups = np.flatnonzero(~greedy)
        for start in range(0, sampled_groups.size, SAMPLE_ROW_CHUNK):
            chunk = sampled_groups[start:start + SAMPLE_ROW_CHUNK]
            final, weights = filter_rows(processed[chunk], [group_params[g] for g in chunk])
            rows = [row for g in chunk.tolist() for row in members[g]]
            local = np.repeat(np.arange(chunk.size), [len(members[g]) for g in chunk.tolist()])
            token_ids[rows] = inverse_cdf(weights, uniforms[rows], local)
            if not raw_mode:
                group_values.update((int(g), final[j]) for j, g in enumerate(chunk)
                                    if int(g) in group_values)
        values = groups.per_row(group_values, want)
        return SamplerOutput(token_ids, gather_logprobs(values, token_ids, params,
                                                        self.logprobs_mode))


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode: must be one of {LOGPROBS_MODES}, got {mode!r}")
    return mode


def logprob_rows(params: Sequence[SamplingParams]) -> list[int]:
    """The rows whose request asked for logprobs."""
    return [i for i, p in enumerate(params) if p.logprobs is not None]


def raw_values(wanted_logits: np.ndarray | None, want: Sequence[int], mode: str
               ) -> dict[int, np.ndarray | None]:
    """Step 0: row -> its [vocab] values for logprobs in the raw modes, or None (to be filled
    with the processed values) in the processed modes. wanted_logits: host [len(want), vocab]
    float32, the logits of the rows in want before step 1 (unused, may be None, when the mode
    is processed)."""
    if not mode.startswith("raw") or not want:
        return {i: None for i in want}
    rows = log_softmax(wanted_logits) if mode == "raw_logprobs" else wanted_logits
    return {i: rows[j] for j, i in enumerate(want)}


def gather_logprobs(values: dict[int, np.ndarray], token_ids: np.ndarray,
                    params: Sequence[SamplingParams], mode: str) -> list[TokenLogprobs | None]:
    """Per row: TokenLogprobs of the chosen token from values[row] (raw or processed values;
    log_softmax taken here for processed_logprobs); None for the rows not in values."""
    out: list[TokenLogprobs | None] = [None] * len(token_ids)
    for i, row in values.items():
        if mode == "processed_logprobs":
            row = log_softmax(row[None])[0]
        out[i] = token_logprobs(row, int(token_ids[i]), params[i].logprobs)
    return out


def check_sample_args(num_rows: int, params, generators, prompt_token_ids,
                      output_token_ids) -> int:
    """num_rows, after checking every per-row list has one entry per sampling row."""
    if not (len(params) == len(generators) == len(prompt_token_ids) == len(output_token_ids)
            == num_rows):
        raise ValueError(f"{num_rows} sampling rows but {len(params)} params, "
                         f"{len(generators)} generators, {len(prompt_token_ids)} prompts, "
                         f"{len(output_token_ids)} outputs")
    return num_rows


def draw_uniforms(engine_generator: np.random.Generator, params: Sequence[SamplingParams],
                  generators: Sequence[np.random.Generator | None]) -> np.ndarray:
    """[rows] float64, one uniform per sampled (non-greedy) row: the engine's generator in row
    order for unseeded rows first, then each seeded row's own generator. Every sampler draws
    exactly these, so a seed gives the same tokens on every backend."""
    uniforms = np.zeros(len(params))
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    engine_rows = [i for i in sampled if generators[i] is None]
    uniforms[engine_rows] = engine_generator.random(len(engine_rows))
    for i in sampled:
        if generators[i] is not None:
            uniforms[i] = generators[i].random()
    return uniforms

