"""Sampler: logits of the rows that sample this step -> next token ids (+ logprobs when asked).

Order of processing, per row (vLLM's order):
  1. logprobs: log_softmax of the *raw* model logits (what vLLM returns by default), computed
     only for rows whose request asked for logprobs.
  2. penalties on a float32 copy: repetition (tokens in prompt + output: positive logits divided
     by the penalty, negative multiplied), then frequency (minus penalty x count in the output),
     then presence (minus penalty if the token occurs in the output).
  3. min_tokens: while fewer than min_tokens tokens were generated, the request's stop_token_ids
     and (unless ignore_eos) the model's eos ids get -inf.
  4. greedy rows (temperature < GREEDY_TEMPERATURE_EPS): argmax of the processed logits, ties to
     the lowest token id. No random draw is consumed.
  5. temperature: logits / temperature.
  6. top-k: keep tokens whose logit >= the k-th largest (ties at the boundary kept); found by a
     chunk-max filter and a partition of the survivors, never a sort of the vocabulary.
  7. top-p: over the renormalized top-k distribution, in order of decreasing probability
     (ties: lower id first), keep a token while the mass of the tokens before it is < top_p.
     Only a growing candidate set is sorted (TOP_P_FIRST_CANDIDATES, x4 until it covers top_p).
  8. min-p: keep tokens with prob >= min_p x (the largest prob).
  9. sample by inverse CDF with ONE uniform u in [0, 1) per row: over the kept tokens in
     ascending id order, pick the first whose cumulative mass exceeds u x (total mass). A CUDA
     sampling kernel must reproduce this distribution, not these bits.

Randomness: a request with a seed has its own generator (`make_request_generator`), drawn from
once per sampled (non-greedy) token, so the same seed yields the same tokens whatever else is in
the batch. Rows without one draw, in row order, from the sampler's own generator (engine seed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .outputs import Logprob
from .sampling_params import SamplingParams

# First candidate-set size for top-p; grows x TOP_P_GROWTH until it holds top_p of the mass.
# Chat-model distributions put top_p = 0.9..0.95 of the mass in well under 64 tokens, so one
# partition + a 64-element sort is the usual cost instead of a sort of the whole vocabulary.
TOP_P_FIRST_CANDIDATES = 64
TOP_P_GROWTH = 4
# Tokens per chunk whose maximum bounds the top-k / top-p candidate search (see _heaviest).
CANDIDATE_CHUNK = 64
# Tokens per chunk of the two-level inverse CDF (see _inverse_cdf).
CDF_CHUNK = 1024
# Rows sampled together: bounds the [rows, vocab] float32 temporaries
# (32 x 128k x 4 B = 16 MiB each).
SAMPLE_ROW_CHUNK = 32


@dataclass
class SamplerOutput:
    """token_ids: [num_rows] int32, the chosen token of each row.
    logprobs: per row, a Logprob (chosen token's raw logprob + top-n alternatives, n =
    params.logprobs) or None when the request did not ask for logprobs."""

    token_ids: np.ndarray
    logprobs: list[Logprob | None] = field(default_factory=list)


def make_request_generator(seed: int | None, sequence_index: int = 0) -> np.random.Generator | None:
    """The private generator of a seeded request (None: the request draws from the engine's).

    Sequence j of an n > 1 request gets the PCG64(seed) stream jumped j times (2^127 steps each):
    independent streams, and sequence 0 is exactly the n = 1 stream.
    """
    if seed is None:
        return None
    return np.random.Generator(np.random.PCG64(seed).jumped(sequence_index))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log_softmax in float32 (max subtracted, float64 sum). logits: [rows, vocab]."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    log_total = np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64))
    return (shifted - log_total).astype(np.float32)


def apply_penalties(logits: np.ndarray, params: Sequence[SamplingParams],
                    prompt_token_ids: Sequence[np.ndarray],
                    output_token_ids: Sequence[Sequence[int]]) -> None:
    """Repetition, then frequency, then presence penalties, in place. logits: [rows, vocab] f32.

    Works on the distinct token ids of each row (np.unique), never on a vocabulary-sized count.
    """
    for i, p in enumerate(params):
        has_rep = p.repetition_penalty != 1.0
        if not (has_rep or p.frequency_penalty or p.presence_penalty):
            continue
        row = logits[i]
        output_ids, output_counts = np.unique(np.asarray(output_token_ids[i], dtype=np.int64),
                                              return_counts=True)
        if has_rep:
            seen = np.union1d(output_ids, np.asarray(prompt_token_ids[i], dtype=np.int64))
            # A penalty below float32's smallest normal (valid: any value > 0) would divide by
            # zero; the smallest normal gives the same answer, +inf, which sampling handles.
            penalty = np.float32(max(p.repetition_penalty, np.finfo(np.float32).tiny))
            with np.errstate(over="ignore"):
                row[seen] = np.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        if p.frequency_penalty:
            row[output_ids] -= np.float32(p.frequency_penalty) * output_counts.astype(np.float32)
        if p.presence_penalty:
            row[output_ids] -= np.float32(p.presence_penalty)


def apply_min_tokens(logits: np.ndarray, params: Sequence[SamplingParams],
                     output_token_ids: Sequence[Sequence[int]],
                     eos_token_ids: Sequence[int]) -> None:
    """Mask stop tokens (-inf) of rows that have not generated min_tokens yet, in place."""
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids)
        if not p.ignore_eos:
            banned.extend(eos_token_ids)
        # The engine refuses stop ids outside the vocabulary at admission; never index past it.
        banned = [t for t in banned if 0 <= t < logits.shape[1]]
        if banned:
            logits[i, banned] = -np.inf


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


def _top_k_filter(scaled_row: np.ndarray, top_k: int) -> None:
    """Keep logits >= the k-th largest (ties kept), -inf elsewhere, in place.

    scaled_row: [vocab].
    """
    if top_k <= 0 or top_k >= scaled_row.shape[0]:
        return
    kth_largest = scaled_row[_heaviest(scaled_row, top_k)].min()
    scaled_row[scaled_row < kth_largest] = -np.inf


def _top_p_filter(weights_row: np.ndarray, top_p: float) -> None:
    """Zero the weights outside the top-p set, in place.

    weights_row: [vocab] f32 unnormalized (exp of shifted logits, 0 for masked tokens). In
    decreasing weight order (ties: lower id first) a token is kept while the mass before it is
    < top_p x total. Only the TOP_P_FIRST_CANDIDATES heaviest tokens are sorted; if they hold
    less than top_p of the mass, TOP_P_GROWTH times more are taken. (Exact weight ties that
    straddle the candidate boundary are broken arbitrarily.)
    """
    vocab_size = weights_row.shape[0]
    limit = top_p * float(weights_row.sum(dtype=np.float64))
    num_candidates = min(TOP_P_FIRST_CANDIDATES, vocab_size)
    while True:
        candidates = _heaviest(weights_row, num_candidates)
        cand_w = weights_row[candidates]
        ordered = candidates[np.lexsort((candidates, -cand_w))]
        ordered_w = weights_row[ordered].astype(np.float64)
        cumulative = np.cumsum(ordered_w)
        if cumulative[-1] >= limit or num_candidates >= vocab_size:
            break
        num_candidates = min(vocab_size, num_candidates * TOP_P_GROWTH)
    kept = ordered[(cumulative - ordered_w) < limit]
    kept_w = weights_row[kept]
    weights_row[:] = 0.0
    weights_row[kept] = kept_w


def _inverse_cdf(weights: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """First token whose cumulative weight exceeds u x total, per row, in ascending id order.

    weights: [rows, vocab] f32 >= 0, each row with some mass; uniforms: [rows] in [0, 1).
    Two levels, because a float64 cumsum over the whole vocabulary is the slowest numpy step
    here: sums of CDF_CHUNK-token chunks locate the chunk, a cumsum inside it the token.
    Returns [rows] int32.
    """
    num_rows, vocab_size = weights.shape
    num_chunks = -(-vocab_size // CDF_CHUNK)
    padded = weights
    if num_chunks * CDF_CHUNK != vocab_size:
        padded = np.zeros((num_rows, num_chunks * CDF_CHUNK), dtype=weights.dtype)
        padded[:, :vocab_size] = weights
    chunk_cdf = np.cumsum(
        padded.reshape(num_rows, num_chunks, CDF_CHUNK).sum(axis=2, dtype=np.float64), axis=1
    )
    targets = uniforms * chunk_cdf[:, -1]
    # The chosen chunk is the first whose cumulative mass exceeds the target.
    chunks = np.minimum((chunk_cdf <= targets[:, None]).sum(axis=1), num_chunks - 1)
    tokens = np.empty(num_rows, dtype=np.int32)
    for i in range(num_rows):
        c = int(chunks[i])
        before = chunk_cdf[i, c - 1] if c else 0.0
        inner = padded[i, c * CDF_CHUNK:(c + 1) * CDF_CHUNK]
        j = int(np.searchsorted(before + np.cumsum(inner, dtype=np.float64), targets[i],
                                side="right"))
        if j >= CDF_CHUNK:  # rounding between the two levels: take the chunk's last token with mass
            j = int(np.flatnonzero(inner)[-1])
        tokens[i] = c * CDF_CHUNK + j
    return tokens


def _sample_rows(logits: np.ndarray, params: Sequence[SamplingParams],
                 uniforms: np.ndarray) -> np.ndarray:
    """Steps 5-9 of the module docstring for a chunk of rows. logits: [rows, vocab] f32
    (processed); uniforms: [rows] in [0, 1). Returns [rows] int32 token ids."""
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    with np.errstate(over="ignore"):  # huge penalized logits: inf, made finite below
        scaled = logits / temperature[:, None]
    # Extreme but valid penalties (repetition_penalty near 0 divides positive logits into inf)
    # must not turn the row into NaNs: +inf becomes the largest float (those tokens share the
    # mass), NaN a masked token.
    np.nan_to_num(scaled, copy=False, nan=-np.inf, posinf=np.finfo(np.float32).max)
    for i, p in enumerate(params):
        _top_k_filter(scaled[i], p.top_k)
    # Unnormalized probabilities; the largest is exactly 1 (the max logit survives every filter).
    with np.errstate(over="ignore"):  # -huge minus the largest float: -inf, weight 0
        weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    for i, p in enumerate(params):
        if p.top_p < 1.0:
            _top_p_filter(weights[i], p.top_p)
    weights[weights < min_p[:, None]] = 0.0  # min-p relative to the max weight 1
    return _inverse_cdf(weights, uniforms)


class Sampler:
    """Samples the next token of every row; holds the engine's generator for unseeded rows."""

    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0) -> None:
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.generator = np.random.Generator(np.random.PCG64(seed))

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
        Returns SamplerOutput (token_ids [num_rows] int32, logprobs per row)."""
        logits = select_rows(np.asarray(logits, dtype=np.float32), row_index)
        num_rows = check_sample_args(logits, params, generators, prompt_token_ids,
                                     output_token_ids)
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = log_softmax(logits[want_logprobs]) if want_logprobs else None

        processed = logits.copy()
        apply_penalties(processed, params, prompt_token_ids, output_token_ids)
        apply_min_tokens(processed, params, output_token_ids, self.eos_token_ids)

        token_ids = np.empty(num_rows, dtype=np.int32)
        greedy = np.array([p.greedy for p in params], dtype=bool)
        if greedy.any():
            token_ids[greedy] = np.argmax(processed[greedy], axis=1)  # first max: lowest id
        sampled_rows = np.flatnonzero(~greedy)
        uniforms = draw_uniforms(self.generator, params, generators)
        for start in range(0, sampled_rows.size, SAMPLE_ROW_CHUNK):
            rows = sampled_rows[start:start + SAMPLE_ROW_CHUNK]
            token_ids[rows] = _sample_rows(processed[rows], [params[i] for i in rows],
                                           uniforms[rows])

        return SamplerOutput(token_ids, sampled_logprobs(raw_logprobs, want_logprobs,
                                                         token_ids, params))


def is_identity(row_index: Sequence[int] | None, num_rows: int) -> bool:
    """Whether row_index reads logits rows 0 .. num_rows - 1 in order (or is None)."""
    # Vectorized: this runs every step, and on large batches a Python loop would show.
    return row_index is None or (len(row_index) == num_rows and np.array_equal(
        np.asarray(row_index), np.arange(num_rows)))


def select_rows(logits: np.ndarray, row_index: Sequence[int] | None) -> np.ndarray:
    """logits[row_index] (None or the identity: logits itself). logits: host numpy array."""
    if is_identity(row_index, logits.shape[0]):
        return logits
    return logits[np.asarray(row_index, dtype=np.int64)]


def check_sample_args(logits, params, generators, prompt_token_ids, output_token_ids) -> int:
    """The number of sampling rows, after checking every per-row list has one entry per row."""
    num_rows = logits.shape[0]
    if not (len(params) == len(generators) == len(prompt_token_ids) == len(output_token_ids)
            == num_rows):
        raise ValueError(f"{num_rows} logits rows but {len(params)} params, "
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


def sampled_logprobs(raw_logprobs: np.ndarray | None, want_logprobs: Sequence[int],
                     token_ids: np.ndarray, params: Sequence[SamplingParams]
                     ) -> list[Logprob | None]:
    """Per row: the chosen token's raw logprob and the top params.logprobs alternatives, for
    the rows in want_logprobs (raw_logprobs[j] is row want_logprobs[j]); None elsewhere."""
    logprobs: list[Logprob | None] = [None] * len(token_ids)
    for j, i in enumerate(want_logprobs):
        row = raw_logprobs[j]
        t = int(token_ids[i])
        logprobs[i] = Logprob(token_id=t, logprob=float(row[t]),
                              top=_top_logprobs(row, params[i].logprobs))
    return logprobs


def _top_logprobs(row: np.ndarray, n: int) -> dict[int, float]:
    """The n largest logprobs of one row, best first (ties: lower id first). row: [vocab] f32."""
    if n <= 0:
        return {}
    n = min(n, row.shape[0])
    candidates = np.argpartition(-row, n - 1)[:n]
    ordered = candidates[np.lexsort((candidates, -row[candidates]))]
    return {int(t): float(row[t]) for t in ordered}
