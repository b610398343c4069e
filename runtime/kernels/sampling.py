"""Launch wrappers of cuda/sampling.cu (the sampler built on them, KernelSampler, lives with
the backends that own it: runtime/backends/kernel_sampler.py).

    module = load_module("sampling.cu", backend="sim")                  # or "cuda"
    process_logits(module, logits, params, prompt_token_ids, output_token_ids, eos_token_ids)
    token_ids = sample(module, logits, params, uniforms)                 # [rows] int32

logits: [num_rows, vocab] float32, contiguous (numpy under the harness, cupy on a GPU).
`process_logits` is runtime/sampler.py's steps 1-4 (allowed-token mask, bad-word and
min_tokens bans, logit bias, penalties); the host sends per row only sparse lists, never a
vocabulary-sized array: the sorted allowed ids, and one entry per token that a ban, a bias or a
penalty touches (its output count, flags, bias). `sample` is steps 5-10. Uniforms are drawn on
the host exactly as the numpy Sampler draws them (one per sampled row: the engine's generator
in row order, or the request's seeded generator), so a seed gives the same stream on every
backend and the kernel reproduces the numpy sampler's distribution.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from pagedrun.runtime.sampler import banned_token_ids
from pagedrun.runtime.sampling_params import SamplingParams

from .kernel_args import array_module, require, require_contiguous

SAMPLE_THREADS = 256
PROCESS_THREADS = 128
FLAG_SEEN = 1     # token in prompt or output: repetition penalty applies
FLAG_BANNED = 2   # a bad word's last token, or min_tokens not reached and a stop / eos id: -inf


class ProcessLists(NamedTuple):
    """Host arguments of process_logits_f32 (shapes and layouts: the header of sampling.cu)."""

    allowed_offsets: np.ndarray  # [rows + 1] int32
    allowed_tokens: np.ndarray   # [num_allowed] int32, ascending within a row
    entry_offsets: np.ndarray    # [rows + 1] int32
    entry_tokens: np.ndarray     # [num_entries] int32, ascending within a row
    entry_counts: np.ndarray     # [num_entries] int32, occurrences in the output
    entry_flags: np.ndarray      # [num_entries] int32, FLAG_SEEN | FLAG_BANNED
    entry_bias: np.ndarray       # [num_entries] float32, logit_bias (0: none)
    repetition: np.ndarray       # [rows] float32
    frequency: np.ndarray        # [rows] float32
    presence: np.ndarray         # [rows] float32


def _check_logits(logits) -> tuple[int, int]:
    require(logits.ndim == 2 and np.dtype(logits.dtype) == np.float32,
            lambda: f"logits must be [num_rows, vocab] float32, got {logits.shape} {logits.dtype}")
    require_contiguous("logits", logits)
    return logits.shape


def _row_entries(p: SamplingParams, prompt_ids, output_ids, eos_token_ids) -> dict:
    """token -> [count, flags, bias] of one row."""
    entries: dict[int, list] = {}
    has_rep = p.repetition_penalty != 1.0
    if has_rep or p.frequency_penalty or p.presence_penalty:
        out_ids, out_counts = np.unique(np.asarray(output_ids, dtype=np.int64),
                                        return_counts=True)
        for t, c in zip(out_ids.tolist(), out_counts.tolist()):
            entries[t] = [c, FLAG_SEEN, 0.0]
        if has_rep:
            for t in np.unique(np.asarray(prompt_ids, dtype=np.int64)).tolist():
                entries.setdefault(t, [0, FLAG_SEEN, 0.0])
    for t in banned_token_ids(p, output_ids, eos_token_ids):
        entries.setdefault(t, [0, 0, 0.0])[1] |= FLAG_BANNED
    for t, bias in (p.logit_bias or {}).items():
        entries.setdefault(int(t), [0, 0, 0.0])[2] = float(bias)
    return entries


def process_lists(params: Sequence[SamplingParams], prompt_token_ids, output_token_ids,
                  eos_token_ids: Sequence[int], vocab: int) -> ProcessLists | None:
    """The sparse lists of process_logits_f32, or None when no row has anything to do.

    Ids outside [0, vocab) are refused (ValueError): the engine refuses them at admission, and
    a kernel must never index past the vocabulary.
    """
    rows = len(params)
    allowed_offsets = np.zeros(rows + 1, dtype=np.int32)
    entry_offsets = np.zeros(rows + 1, dtype=np.int32)
    allowed: list[np.ndarray] = []
    tokens, counts, flags, biases = [], [], [], []
    for i, p in enumerate(params):
        num_allowed = 0
        if p.allowed_token_ids is not None:
            ids = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))  # sorted, distinct
            if ids.size == 0 or ids[0] < 0 or ids[-1] >= vocab:
                raise ValueError(f"allowed_token_ids must be non-empty ids in [0, {vocab})")
            allowed.append(ids)
            num_allowed = ids.size
        allowed_offsets[i + 1] = allowed_offsets[i] + num_allowed
        entries = _row_entries(p, prompt_token_ids[i], output_token_ids[i], eos_token_ids)
        for t in sorted(entries):
            count, flag, bias = entries[t]
            tokens.append(t)
            counts.append(count)
            flags.append(flag)
            biases.append(bias)
        entry_offsets[i + 1] = len(tokens)
    if not tokens and not allowed:
        return None
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        raise ValueError(f"penalty, ban or bias token id out of range [0, {vocab})")

    def per_row(name: str) -> np.ndarray:
        return np.array([getattr(p, name) for p in params], dtype=np.float32)

    return ProcessLists(
        allowed_offsets,
        np.concatenate(allowed).astype(np.int32) if allowed else np.zeros(1, np.int32),
        entry_offsets, np.array(tokens or [0], np.int32), np.array(counts or [0], np.int32),
        np.array(flags or [0], np.int32), np.array(biases or [0.0], np.float32),
        per_row("repetition_penalty"), per_row("frequency_penalty"),
        per_row("presence_penalty"))


def process_logits(module, logits, params, prompt_token_ids, output_token_ids,
                   eos_token_ids: Sequence[int] = (), lists: ProcessLists | None = None):
    """Steps 1-4 of runtime/sampler.py (allowed mask, bans, logit bias, penalties), in place;
    returns logits. lists: process_lists(...) of the same arguments, if the caller made it."""
    num_rows, vocab = _check_logits(logits)
    require(len(params) == num_rows, lambda: f"{num_rows} logits rows but {len(params)} params")
    if lists is None:
        lists = process_lists(params, prompt_token_ids, output_token_ids, eos_token_ids, vocab)
    if lists is None:
        return logits
    xp = array_module(logits)
    dev = [xp.asarray(a) for a in lists]  # empty lists are sent as one unused element
    module.get_function("process_logits_f32")((num_rows,), (PROCESS_THREADS,),
                                              (logits, *dev, np.int32(vocab)))
    return logits


def sample(module, logits, params: Sequence[SamplingParams], uniforms, out=None,
           logits_rows=None):
    """One token per sampling row: greedy rows argmax (ties: lowest id), others temperature,
    min-p, top-k, top-p and the inverse CDF at uniforms[row] in [0, 1). logits: [num_logits_rows,
    vocab] f32; logits_rows: [rows] ints, the logits row each sampling row reads (the members of
    a runtime/logits_row_groups.py group share one), or None (row i reads row i; then rows ==
    num_logits_rows). params, uniforms: one per sampling row. Returns out [rows] int32."""
    num_logits_rows, vocab = _check_logits(logits)
    num_rows = len(params)
    if logits_rows is None:
        require(num_rows == num_logits_rows,
                lambda: f"{num_logits_rows} logits rows but {num_rows} params")
        rows = np.arange(num_rows, dtype=np.int32)
    else:
        rows = np.ascontiguousarray(logits_rows, dtype=np.int32).reshape(-1)
        require(rows.size == num_rows,
                lambda: f"{rows.size} logits_rows entries for {num_rows} params")
        require(num_rows == 0 or (0 <= int(rows.min()) and int(rows.max()) < num_logits_rows),
                lambda: f"logits_rows outside the {num_logits_rows} logits rows")
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
        (out, logits, *(xp.asarray(a) for a in (rows, temperature, top_k, top_p, min_p, u)),
         np.int32(vocab)))
    return out


__all__ = ["ProcessLists", "process_lists", "process_logits", "sample"]
