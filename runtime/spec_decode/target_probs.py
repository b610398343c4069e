"""Processed logits -> the distribution the plain sampler draws from, for verification.

The rejection sampler keeps the target's distribution only if p (target) and q (draft) are
exactly what runtime/sampler.py would sample from: the logits processors (allowed ids, bad
words, min_tokens, logit bias, penalties: `apply_logits_processors`) and then, for sampled rows,
temperature, min-p, top-k, top-p (`filter_rows`). Both are reused here, never re-ordered.

Position i of a request's verification (0 <= i <= k) scores the token after
output + draft[:i]: its processors see that history (a bad word completed by draft tokens, the
min_tokens count, penalties over draft tokens), exactly as the plain sampler would on the step
where those draft tokens had already been sampled.

Weights (the `*_weights` results): [rows, vocab] float32, >= 0, per row proportional to the
probabilities; greedy rows are 1.0 at the argmax (ties: lowest id) and 0 elsewhere; a row
whose every token is masked is 1.0 at token 0 (the plain sampler's choice for such a row), so
every row has mass. Sampled rows are `filter_rows`' weights as they are, so a draw over them is
the plain sampler's draw bit for bit.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..sampler import SAMPLE_ROW_CHUNK, apply_logits_processors, filter_rows
from ..sampling_params import SamplingParams


def processed_weights(logits: np.ndarray, params: Sequence[SamplingParams],
                      prompt_token_ids: Sequence[np.ndarray],
                      output_token_ids: Sequence[Sequence[int]],
                      eos_token_ids: Sequence[int]) -> np.ndarray:
    """logits: [rows, vocab] raw model logits (not modified); one params / prompt / output
    history per row. Returns [rows, vocab] float32 weights (see the module docstring)."""
    processed = np.array(logits, dtype=np.float32, copy=True)
    if processed.ndim != 2 or processed.shape[0] != len(params):
        raise ValueError(f"logits {processed.shape} for {len(params)} rows")
    apply_logits_processors(processed, params, prompt_token_ids, output_token_ids,
                            eos_token_ids)
    num_rows, vocab_size = processed.shape
    weights = np.zeros((num_rows, vocab_size), dtype=np.float32)
    greedy = np.array([p.greedy for p in params], dtype=bool)
    greedy_rows = np.flatnonzero(greedy)
    weights[greedy_rows, np.argmax(processed[greedy_rows], axis=1)] = 1.0
    sampled_rows = np.flatnonzero(~greedy)
    for start in range(0, sampled_rows.size, SAMPLE_ROW_CHUNK):
        rows = sampled_rows[start:start + SAMPLE_ROW_CHUNK]
        _, weights[rows] = filter_rows(processed[rows], [params[i] for i in rows])
    massless = ~weights.any(axis=1)
    weights[massless, 0] = 1.0
    return weights


def normalize(weights: np.ndarray) -> np.ndarray:
    """Weights [..., vocab] -> probabilities, float64; a row without mass stays all zero."""
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum(axis=-1, keepdims=True)
    return w / np.where(total > 0, total, 1.0)


def verification_weights(logits: np.ndarray, params: Sequence[SamplingParams],
                         prompt_token_ids: Sequence[np.ndarray],
                         output_token_ids: Sequence[Sequence[int]],
                         draft_token_ids: Sequence[Sequence[int]],
                         eos_token_ids: Sequence[int], with_bonus: bool = True) -> np.ndarray:
    """Per-position weights of a batch, padded to [batch, max_k + 1, vocab] float32 (zeros past
    a request's own k_b + 1 positions); with_bonus=False: [batch, max_k, vocab], the draft's
    k_b positions (a draft model's distributions q).

    logits: [sum_b (k_b + 1), vocab] (with_bonus) or [sum_b k_b, vocab], request after
    request, position after position: what a forward over each request's k_b + 1 (or k_b)
    query tokens returns. params / prompt_token_ids / output_token_ids / draft_token_ids:
    per request; position i of request b is processed with history output_b + draft_b[:i].
    """
    extra = 1 if with_bonus else 0
    counts = [len(d) + extra for d in draft_token_ids]
    if len(logits) != sum(counts):
        raise ValueError(f"{len(logits)} logits rows for {sum(counts)} positions")
    row_params, row_prompts, row_outputs = [], [], []
    for b, count in enumerate(counts):
        output = [int(t) for t in output_token_ids[b]]
        draft = [int(t) for t in draft_token_ids[b]]
        for i in range(count):
            row_params.append(params[b])
            row_prompts.append(prompt_token_ids[b])
            row_outputs.append(output + draft[:i])
    flat = processed_weights(logits, row_params, row_prompts, row_outputs, eos_token_ids)
    max_positions = max(counts, default=0)
    padded = np.zeros((len(counts), max_positions, flat.shape[1]), dtype=np.float32)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    for b, count in enumerate(counts):
        padded[b, :count] = flat[starts[b]:starts[b] + count]
    return padded
