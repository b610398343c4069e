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
  6. top-k: keep tokens whose logit >= the k-th largest (ties at the boundary kept);
     argpartition, never a full sort.
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
    """Repetition, then frequency, then presence penalties, in place. logits: [rows, vocab] f32."""
    vocab_size = logits.shape[1]
    for i, p in enumerate(params):
        has_rep = p.repetition_penalty != 1.0
        if not (has_rep or p.frequency_penalty or p.presence_penalty):
            continue
        row = logits[i]
        output_ids = np.asarray(output_token_ids[i], dtype=np.int64)
        output_counts = np.bincount(output_ids, minlength=vocab_size)[:vocab_size]
        if has_rep:
            seen = output_counts > 0
            seen[np.asarray(prompt_token_ids[i], dtype=np.int64)] = True
            penalty = np.float32(p.repetition_penalty)
            row[seen] = np.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        if p.frequency_penalty:
            row -= np.float32(p.frequency_penalty) * output_counts.astype(np.float32)
        if p.presence_penalty:
            row -= np.float32(p.presence_penalty) * (output_counts > 0).astype(np.float32)


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
        if banned:
            logits[i, banned] = -np.inf


def _top_k_mask(scaled: np.ndarray, top_k: int) -> np.ndarray:
    """Keep logits >= the k-th largest. scaled: [vocab] f32; returns the row with -inf elsewhere."""
    if top_k <= 0 or top_k >= scaled.shape[0]:
        return scaled
    kth_largest = np.partition(scaled, scaled.shape[0] - top_k)[scaled.shape[0] - top_k]
    return np.where(scaled >= kth_largest, scaled, np.float32(-np.inf))


def _top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Token ids kept by top-p. probs: [vocab] float64, normalized, zeros for masked tokens."""
    num_nonzero = int(np.count_nonzero(probs))
    num_candidates = min(TOP_P_FIRST_CANDIDATES, num_nonzero)
    while True:
        if num_candidates >= num_nonzero:
            candidates = np.flatnonzero(probs)
        else:
            candidates = np.argpartition(-probs, num_candidates - 1)[:num_candidates]
        # Decreasing probability, ties by ascending id.
        ordered = candidates[np.lexsort((candidates, -probs[candidates]))]
        cumulative = np.cumsum(probs[ordered])
        if cumulative[-1] >= top_p or num_candidates >= num_nonzero:
            break
        num_candidates = min(num_nonzero, num_candidates * TOP_P_GROWTH)
    mass_before = cumulative - probs[ordered]
    return ordered[mass_before < top_p]


def _sample_row(logits_row: np.ndarray, p: SamplingParams, uniform: float) -> int:
    """Steps 5-9 of the module docstring for one row. logits_row: [vocab] f32 (processed)."""
    scaled = logits_row / np.float32(p.temperature)
    scaled = _top_k_mask(scaled, p.top_k)
    weights = np.exp((scaled - scaled.max()).astype(np.float64))  # -inf -> 0
    if p.top_p < 1.0:
        kept = _top_p_keep(weights / weights.sum(), p.top_p)
        restricted = np.zeros_like(weights)
        restricted[kept] = weights[kept]
        weights = restricted
    if p.min_p > 0.0:
        # max weight is exactly 1 (the max logit survives every filter).
        weights[weights < p.min_p] = 0.0
    cdf = np.cumsum(weights)
    token = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    # u * total can round up to total: fall back to the last token with mass.
    return token if token < weights.shape[0] else int(np.flatnonzero(weights)[-1])


class Sampler:
    """Samples the next token of every row; holds the engine's generator for unseeded rows."""

    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0) -> None:
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.generator = np.random.Generator(np.random.PCG64(seed))

    def sample(self, logits: np.ndarray, params: Sequence[SamplingParams],
               generators: Sequence[np.random.Generator | None],
               prompt_token_ids: Sequence[np.ndarray],
               output_token_ids: Sequence[Sequence[int]]) -> SamplerOutput:
        """logits: [num_rows, vocab] float32, one row per sampling sequence, in batch order.
        params / generators / prompt_token_ids / output_token_ids: one entry per row (the
        generator from `make_request_generator`, or None for the engine's).
        Returns SamplerOutput (token_ids [num_rows] int32, logprobs per row)."""
        logits = np.asarray(logits, dtype=np.float32)
        num_rows = logits.shape[0]
        if not (len(params) == len(generators) == len(prompt_token_ids) == len(output_token_ids)
                == num_rows):
            raise ValueError(f"{num_rows} logits rows but {len(params)} params, "
                             f"{len(generators)} generators, {len(prompt_token_ids)} prompts, "
                             f"{len(output_token_ids)} outputs")
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
        engine_rows = [i for i in sampled_rows if generators[i] is None]
        uniforms = np.empty(num_rows)
        uniforms[engine_rows] = self.generator.random(len(engine_rows))
        for i in sampled_rows:
            if generators[i] is not None:
                uniforms[i] = generators[i].random()
            token_ids[i] = _sample_row(processed[i], params[i], float(uniforms[i]))

        logprobs: list[Logprob | None] = [None] * num_rows
        for j, i in enumerate(want_logprobs):
            row = raw_logprobs[j]
            logprobs[i] = Logprob(token_id=int(token_ids[i]), logprob=float(row[token_ids[i]]),
                                  top=_top_logprobs(row, params[i].logprobs))
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _top_logprobs(row: np.ndarray, n: int) -> dict[int, float]:
    """The n largest logprobs of one row, best first (ties: lower id first). row: [vocab] f32."""
    if n <= 0:
        return {}
    n = min(n, row.shape[0])
    candidates = np.argpartition(-row, n - 1)[:n]
    ordered = candidates[np.lexsort((candidates, -row[candidates]))]
    return {int(t): float(row[t]) for t in ordered}
