"""The LoRA compute of one step on numpy: shrink (x @ A^T) and expand (s @ B^T, scaled, added to
the base output) over the step's tokens grouped by adapter slot.

    batch = LoRABatch.from_token_slots(token_slots, num_slots)     # once per step
    y = x @ W_qkv                                                   # the base GEMM
    add_lora(y, x, lora_a, lora_b, batch, slice_starts)             # y += LoRA, in place

Inputs (a weight stack per fused target, runtime/lora/weight_stack.py):
    x        [num_tokens, in_features] float32
    y        [num_tokens, out_features] float32, the base output, updated in place
    lora_a   [num_slots, num_slices * rank, in_features]   slice i's rows [i * rank, (i+1) * rank)
    lora_b   [num_slots, out_features, rank]               output columns of slice i:
                                                           [slice_starts[i], slice_starts[i + 1])
    token_slots [num_tokens] int: the device slot of each token's adapter, -1 for none
Result: y[t, o] += scale * sum_j (x[t] . lora_a[slot(t), i*rank + j]) * lora_b[slot(t), o, j]
for o in slice i, for every t with a slot; rows of tokens without an adapter are not touched.

Cost: one matmul pair per (adapter present in the step, slice): the loop runs over distinct
slots (at most max_loras), never over tokens, and a step without adapters does no work at all.
The shrink result is kept in sorted-token order, [num_lora_tokens, num_slices * rank] float32,
the same intermediate cuda/lora.cu produces (SGMV for prefill segments, one tile per decode
token of a slot: same math), so this file is also the kernels' reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_ADAPTER = -1


@dataclass(frozen=True)
class LoRABatch:
    """A step's tokens grouped by adapter slot: built once per step, shared by every layer."""

    num_tokens: int
    sorted_token_ids: np.ndarray   # [num_lora_tokens] int32, tokens with a slot, by slot (stable)
    segment_slots: np.ndarray      # [num_segments] int32, distinct slots present, ascending
    segment_starts: np.ndarray     # [num_segments + 1] int32, segments of sorted_token_ids
    # sorted_token_ids as a slice when they are a contiguous run (one adapter's prefill, or
    # requests already ordered by slot): the gather and scatter then become views.
    token_rows: slice | np.ndarray = None
    segment_list: tuple[tuple[int, int, int], ...] = ()   # (slot, start, end) per segment

    def __post_init__(self) -> None:
        ids = self.sorted_token_ids
        contiguous = ids.size > 0 and int(ids[-1]) - int(ids[0]) == ids.size - 1 and (
            ids.size == 1 or bool((np.diff(ids) == 1).all()))
        object.__setattr__(self, "token_rows",
                           slice(int(ids[0]), int(ids[-1]) + 1) if contiguous else ids)
        starts = self.segment_starts.tolist()
        object.__setattr__(self, "segment_list", tuple(
            (slot, starts[i], starts[i + 1]) for i, slot in enumerate(self.segment_slots.tolist())))

    @classmethod
    def from_token_slots(cls, token_slots, num_slots: int) -> LoRABatch:
        """token_slots [num_tokens] int, each in [-1, num_slots); -1 = no adapter."""
        slots = np.asarray(token_slots)
        if slots.ndim != 1 or (slots.size and not np.issubdtype(slots.dtype, np.integer)):
            raise ValueError(f"token_slots must be a 1-D int array, got {slots.dtype} "
                             f"{slots.shape}")
        slots = slots.astype(np.int64)
        if slots.size and (slots.min() < NO_ADAPTER or slots.max() >= num_slots):
            raise ValueError(f"token_slots must lie in [-1, {num_slots}), got "
                             f"[{slots.min()}, {slots.max()}]")
        with_slot = np.flatnonzero(slots != NO_ADAPTER)
        order = with_slot[np.argsort(slots[with_slot], kind="stable")]
        present, counts = np.unique(slots[order], return_counts=True)
        starts = np.concatenate([[0], np.cumsum(counts)])
        return cls(int(slots.size), order.astype(np.int32), present.astype(np.int32),
                   starts.astype(np.int32))

    @classmethod
    def from_request_slots(cls, request_slots, query_lens, num_slots: int) -> LoRABatch:
        """Per scheduled request its slot (-1: none) and its tokens this step, in batch order."""
        return cls.from_token_slots(np.repeat(np.asarray(request_slots, np.int64),
                                              np.asarray(query_lens, np.int64)), num_slots)

    @property
    def num_lora_tokens(self) -> int:
        return int(self.sorted_token_ids.size)

    @property
    def empty(self) -> bool:
        """No token of the step has an adapter: the LoRA ops do nothing."""
        return self.num_lora_tokens == 0

    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """(slot, start, end) per segment of sorted_token_ids."""
        return self.segment_list


def _check(x, lora_a, batch: LoRABatch) -> None:
    if x.ndim != 2 or x.shape[0] != batch.num_tokens:
        raise ValueError(f"x must be [{batch.num_tokens}, in_features], got {x.shape}")
    if lora_a.ndim != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a must be [num_slots, cols, {x.shape[1]}], got {lora_a.shape}")


def shrink(x: np.ndarray, lora_a: np.ndarray, batch: LoRABatch) -> np.ndarray:
    """s [num_lora_tokens, num_slices * rank] float32, row p for token sorted_token_ids[p]:
    s[p] = lora_a[slot] @ x[token]."""
    _check(x, lora_a, batch)
    s = np.empty((batch.num_lora_tokens, lora_a.shape[1]), np.float32)
    if batch.empty:
        return s
    rows = x[batch.token_rows]   # one gather per call (a view when contiguous)
    for slot, start, end in batch.segments():
        np.matmul(rows[start:end], lora_a[slot].T, out=s[start:end])
    return s


def expand(y: np.ndarray, s: np.ndarray, lora_b: np.ndarray, batch: LoRABatch,
           slice_starts, scale: float = 1.0) -> np.ndarray:
    """y[token] += scale * (slice i of s[p]) @ lora_b[slot, slice i rows].T per slice; in place."""
    num_slices = len(slice_starts) - 1
    rank = lora_b.shape[2]
    if y.ndim != 2 or y.shape[0] != batch.num_tokens or slice_starts[-1] != y.shape[1]:
        raise ValueError(f"y must be [{batch.num_tokens}, {slice_starts[-1]}], got {y.shape}")
    if lora_b.ndim != 3 or lora_b.shape[1] != y.shape[1]:
        raise ValueError(f"lora_b must be [num_slots, {y.shape[1]}, rank], got {lora_b.shape}")
    if s.shape != (batch.num_lora_tokens, num_slices * rank):
        raise ValueError(f"s must be [{batch.num_lora_tokens}, {num_slices * rank}], got "
                         f"{s.shape}")
    if batch.empty:
        return y
    # One delta per slice over all segments, then one scatter-add per slice: the loop body is
    # a single BLAS call writing in place.
    for i in range(num_slices):
        cols = slice(slice_starts[i], slice_starts[i + 1])
        delta = np.empty((batch.num_lora_tokens, cols.stop - cols.start), np.float32)
        for slot, start, end in batch.segments():
            np.matmul(s[start:end, i * rank:(i + 1) * rank], lora_b[slot, cols].T,
                      out=delta[start:end])
        if scale != 1.0:
            delta *= np.float32(scale)
        if num_slices == 1:
            y[batch.token_rows] += delta
        else:
            y[batch.token_rows, cols] += delta
    return y


def add_lora(y: np.ndarray, x: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray,
             batch: LoRABatch, slice_starts, scale: float = 1.0) -> np.ndarray:
    """Shrink then expand: y += LoRA(x) for every token with an adapter; returns y."""
    if batch.empty:
        return y
    return expand(y, shrink(x, lora_a, batch), lora_b, batch, slice_starts, scale)
