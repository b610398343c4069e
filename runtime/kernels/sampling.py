"""Launch wrappers of cuda/sampling.cu (the sampler built on them, KernelSampler, lives with
the backends that own it: runtime/backends/kernel_sampler.py).

    module = load_module("sampling.cu", backend="sim")                  # or "cuda"
    apply_penalties(module, logits, params, prompt_token_ids, output_token_ids, eos_token_ids)
    token_ids = sample(module, logits, params, uniforms)                 # [rows] int32

logits: [num_rows, vocab] float32, contiguous (numpy under the harness, cupy on a GPU).
Penalties are sparse: the host sends, per row, the distinct tokens of prompt and output with
their output counts (and the min_tokens bans), never a vocabulary-sized array. Uniforms are
drawn on the host exactly as the numpy Sampler draws them (one per sampled row: the engine's
generator in row order, or the request's seeded generator), so a seed gives the same stream on
every backend and the kernel reproduces the numpy sampler's distribution.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pagedrun.runtime.sampling_params import SamplingParams

from .kernel_args import array_module, require, require_contiguous

SAMPLE_THREADS = 256
PENALTY_THREADS = 128
FLAG_SEEN = 1     # token in prompt or output: repetition penalty applies
FLAG_BANNED = 2   # min_tokens not reached and the token stops the request: -inf


def _check_logits(logits) -> tuple[int, int]:
    require(logits.ndim == 2 and np.dtype(logits.dtype) == np.float32,
            f"logits must be [num_rows, vocab] float32, got {logits.shape} {logits.dtype}")
    require_contiguous("logits", logits)
    return logits.shape


def penalty_entries(params: Sequence[SamplingParams], prompt_token_ids, output_token_ids,
                    eos_token_ids: Sequence[int]):
    """Host CSR lists of the penalty kernel, or None when no row has a penalty or a ban.

    Returns (offsets [rows + 1], tokens, counts, flags [entries] int32; repetition, frequency,
    presence [rows] float32).
    """
    rows = len(params)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    tokens, counts, flags = [], [], []
    for i, p in enumerate(params):
        entries: dict[int, list[int]] = {}  # token -> [count, flags]
        has_rep = p.repetition_penalty != 1.0
        if has_rep or p.frequency_penalty or p.presence_penalty:
            out_ids, out_counts = np.unique(np.asarray(output_token_ids[i], dtype=np.int64),
                                            return_counts=True)
            for t, c in zip(out_ids.tolist(), out_counts.tolist()):
                entries[t] = [c, FLAG_SEEN]
            if has_rep:
                for t in np.unique(np.asarray(prompt_token_ids[i], dtype=np.int64)).tolist():
                    entries.setdefault(t, [0, FLAG_SEEN])
        if len(output_token_ids[i]) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            for t in banned:
                entries.setdefault(int(t), [0, 0])[1] |= FLAG_BANNED
        for t in sorted(entries):
            tokens.append(t)
            counts.append(entries[t][0])
            flags.append(entries[t][1])
        offsets[i + 1] = len(tokens)
    if not tokens:
        return None
    as_f32 = lambda name: np.array([getattr(p, name) for p in params], dtype=np.float32)  # noqa: E731
    return (offsets, np.array(tokens, np.int32), np.array(counts, np.int32),
            np.array(flags, np.int32), as_f32("repetition_penalty"),
            as_f32("frequency_penalty"), as_f32("presence_penalty"))


def apply_penalties(module, logits, params, prompt_token_ids, output_token_ids,
                    eos_token_ids: Sequence[int] = ()):
    """Repetition, frequency, presence penalties and min_tokens bans, in place; returns logits."""
    num_rows, vocab = _check_logits(logits)
    require(len(params) == num_rows, f"{num_rows} logits rows but {len(params)} params")
    lists = penalty_entries(params, prompt_token_ids, output_token_ids, eos_token_ids)
    if lists is None:
        return logits
    tokens = lists[1]
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"penalty token id out of range [0, {vocab})")
    xp = array_module(logits)
    dev = [xp.asarray(a) for a in lists]
    module.get_function("apply_penalties_f32")((num_rows,), (PENALTY_THREADS,),
                                               (logits, *dev, np.int32(vocab)))
    return logits


def sample(module, logits, params: Sequence[SamplingParams], uniforms, out=None):
    """One token per row: greedy rows argmax (ties: lowest id), others temperature, top-k,
    top-p, min-p and the inverse CDF at uniforms[row] in [0, 1). Returns out [rows] int32."""
    num_rows, vocab = _check_logits(logits)
    require(len(params) == num_rows, f"{num_rows} logits rows but {len(params)} params")
    xp = array_module(logits)
    out = xp.empty(num_rows, dtype=np.int32) if out is None else out
    if num_rows == 0:
        return out
    temperature = np.array([0.0 if p.greedy else p.temperature for p in params], np.float32)
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params], np.int32)
    top_p = np.array([p.top_p for p in params], np.float32)
    min_p = np.array([p.min_p for p in params], np.float32)
    u = np.ascontiguousarray(uniforms, dtype=np.float32).reshape(num_rows)
    # float32 rounding may turn u just below 1 into 1.0: keep the draw inside [0, 1).
    u = np.minimum(u, np.float32(1.0) - np.finfo(np.float32).epsneg)
    module.get_function("sample_f32")(
        (num_rows,), (SAMPLE_THREADS,),
        (out, logits, *(xp.asarray(a) for a in (temperature, top_k, top_p, min_p, u)),
         np.int32(vocab)))
    return out


__all__ = ["apply_penalties", "penalty_entries", "sample"]
