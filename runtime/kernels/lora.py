"""Launch wrappers of cuda/lora.cu: multi-LoRA shrink and expand over tokens grouped by slot.

    module = load_module("lora.cu", backend="sim")                     # or "cuda"
    plan = lora_tile_plan(batch, xp)           # once per step (batch: runtime/lora/lora_ops.py)
    s = lora_shrink(module, x, lora_a, plan)   # [N, num_slices * rank] float32, sorted order
    lora_expand(module, y, s, lora_b, plan, slice_starts)              # y += LoRA, in place

Layouts and math: cuda/lora.cu's header; numpy reference: runtime/lora/lora_ops.py (same s in
the same sorted order). x, y, lora_a and lora_b share one dtype (float32, float16 or uint16 bf16
bits); s is float32. Arrays are numpy under the CPU harness and cupy on a GPU; the tile plan is
built on the host (the step's token -> slot table comes from the scheduler) and copied once per
step. Unsupported inputs raise UnsupportedKernelShape before anything runs.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pagedrun.runtime.lora.lora_ops import LoRABatch

from .kernel_args import (array_module, ceil_div, dtype_suffix, require, require_contiguous,
                          require_int32)

THREADS = 256
TILE_TOKENS = 16           # lora.cu kTileTokens: tokens of one slot per tile
SHRINK_COLS = THREADS // TILE_TOKENS
EXPAND_COLS = 64
MAX_SLICES = 3             # QKV


class LoRATilePlan(NamedTuple):
    """Device arrays of one step's token grouping (layouts: cuda/lora.cu's header)."""

    sorted_token_ids: object   # [N] int32
    tile_slots: object         # [num_tiles] int32
    tile_starts: object        # [num_tiles + 1] int32
    num_tiles: int
    num_tokens: int            # rows of x / y (tokens with and without an adapter)
    num_lora_tokens: int


def lora_tile_plan(batch: LoRABatch, xp=np) -> LoRATilePlan:
    """Cut every slot segment of `batch` into tiles of at most TILE_TOKENS tokens."""
    starts, slots = [], []
    for slot, start, end in batch.segments():
        tile_starts = range(start, end, TILE_TOKENS)
        starts.extend(tile_starts)
        slots.extend([slot] * len(tile_starts))
    starts.append(batch.num_lora_tokens)
    return LoRATilePlan(xp.asarray(batch.sorted_token_ids, np.int32),
                        xp.asarray(np.array(slots, np.int32)),
                        xp.asarray(np.array(starts, np.int32)), len(slots), batch.num_tokens,
                        batch.num_lora_tokens)


def _check_plan(plan: LoRATilePlan) -> None:
    require_int32("sorted_token_ids", plan.sorted_token_ids, 1)
    require_int32("tile_slots", plan.tile_slots, 1)
    require_int32("tile_starts", plan.tile_starts, 1)
    require(plan.tile_starts.shape[0] == plan.num_tiles + 1,
            lambda: f"tile_starts must have num_tiles + 1 = {plan.num_tiles + 1} entries")


def lora_shrink(module, x, lora_a, plan: LoRATilePlan, out=None):
    """s[p] = lora_a[slot(p)] @ x[sorted_token_ids[p]]: [num_lora_tokens, num_cols] float32.

    x [num_tokens, in_features]; lora_a [num_slots, num_cols, in_features], x's dtype."""
    suffix = dtype_suffix(x)
    require(x.ndim == 2 and x.shape[0] == plan.num_tokens,
            lambda: f"x must be [{plan.num_tokens}, in_features], got {x.shape}")
    in_features = x.shape[1]
    require(lora_a.ndim == 3 and lora_a.shape[2] == in_features,
            lambda: f"lora_a must be [num_slots, num_cols, {in_features}], got {lora_a.shape}")
    require(lora_a.dtype == x.dtype, lambda: f"lora_a ({lora_a.dtype}) and x ({x.dtype}) dtypes "
                                             f"differ")
    require_contiguous("x", x)
    require_contiguous("lora_a", lora_a)
    _check_plan(plan)
    num_cols = lora_a.shape[1]
    require(num_cols >= 1 and in_features >= 1, "empty LoRA A matrices")
    xp = array_module(x)
    s = xp.empty((plan.num_lora_tokens, num_cols), np.float32) if out is None else out
    require(s.shape == (plan.num_lora_tokens, num_cols) and np.dtype(s.dtype) == np.float32,
            lambda: f"out must be [{plan.num_lora_tokens}, {num_cols}] float32")
    require_contiguous("out", s)
    if plan.num_tiles:
        module.get_function(f"lora_shrink_{suffix}")(
            (ceil_div(num_cols, SHRINK_COLS), plan.num_tiles), (THREADS,),
            (s, x, lora_a, plan.sorted_token_ids, plan.tile_slots, plan.tile_starts,
             np.int32(in_features), np.int32(num_cols)))
    return s


def lora_expand(module, y, s, lora_b, plan: LoRATilePlan, slice_starts, scale: float = 1.0):
    """y[t, o] += scale * s[p, slice(o) * rank:(slice(o) + 1) * rank] . lora_b[slot, o], in place,
    for t = sorted_token_ids[p]; other rows untouched. Returns y.

    y [num_tokens, out_features]; s [num_lora_tokens, num_slices * rank] float32;
    lora_b [num_slots, out_features, rank] in y's dtype; slice_starts: num_slices + 1 output
    column boundaries (0, ..., out_features), num_slices <= 3."""
    suffix = dtype_suffix(y)
    require(y.ndim == 2 and y.shape[0] == plan.num_tokens,
            lambda: f"y must be [{plan.num_tokens}, out_features], got {y.shape}")
    out_features = y.shape[1]
    starts = [int(v) for v in slice_starts]
    num_slices = len(starts) - 1
    require(1 <= num_slices <= MAX_SLICES and starts[0] == 0 and starts[-1] == out_features
            and all(a < b for a, b in zip(starts, starts[1:])),
            lambda: f"slice_starts must rise from 0 to {out_features} in 1..{MAX_SLICES} "
                    f"slices, got "
            f"{starts}")
    require(lora_b.ndim == 3 and lora_b.shape[1] == out_features and lora_b.shape[2] >= 1,
            lambda: f"lora_b must be [num_slots, {out_features}, rank], got {lora_b.shape}")
    rank = lora_b.shape[2]
    require(lora_b.dtype == y.dtype, lambda: f"lora_b ({lora_b.dtype}) and y ({y.dtype}) dtypes "
                                             f"differ")
    require(s.shape == (plan.num_lora_tokens, num_slices * rank)
            and np.dtype(s.dtype) == np.float32,
            lambda: f"s must be [{plan.num_lora_tokens}, {num_slices * rank}] float32, got "
                    f"{s.shape} "
            f"{s.dtype}")
    for name, arr in (("y", y), ("s", s), ("lora_b", lora_b)):
        require_contiguous(name, arr)
    _check_plan(plan)
    padded = starts[1:-1] + [out_features] * (MAX_SLICES - num_slices)
    if plan.num_tiles:
        module.get_function(f"lora_expand_{suffix}")(
            (ceil_div(out_features, EXPAND_COLS), plan.num_tiles), (THREADS,),
            (y, s, lora_b, plan.sorted_token_ids, plan.tile_slots, plan.tile_starts,
             np.int32(out_features), np.int32(rank), np.int32(num_slices * rank),
             np.int32(padded[0]), np.int32(padded[1]), np.float32(scale)))
    return y


def add_lora(module, y, x, lora_a, lora_b, plan: LoRATilePlan, slice_starts,
             scale: float = 1.0):
    """Shrink then expand (lora_ops.add_lora on the kernels); nothing runs without tiles."""
    if plan.num_tiles == 0:
        return y
    return lora_expand(module, y, lora_shrink(module, x, lora_a, plan), lora_b, plan,
                       slice_starts, scale)


__all__ = ["LoRATilePlan", "add_lora", "lora_expand", "lora_shrink", "lora_tile_plan"]
