"""cuda/lora.cu (through runtime/kernels/lora.py) against a float64 loop over tokens written
here and against runtime/lora/lora_ops.py (the numpy path): 1, 17, 111 tokens; ranks 8 / 16
(and 40: two rank chunks, one partial); one to three output slices of uneven widths; several
adapters in one batch, some rows without one (bit-identical afterwards); the unused slots of
both weight stacks NaN-poisoned (never read); s and y checked for finiteness; the tile plan;
the refused shapes."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import as_kernel_dtype, kernel_module, result_f32, to_device, to_host
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape, array_module
from pagedrun.runtime.kernels.lora import (TILE_TOKENS, add_lora, lora_expand, lora_shrink,
                                           lora_tile_plan)
from pagedrun.runtime.lora import lora_ops
from pagedrun.runtime.lora.lora_ops import LoRABatch

# fp32 sums in a different order than the reference; f16 / bf16: the same rounded inputs, one
# rounding of y on store. |kernel - reference| <= atol + rtol * max|reference|.
LORA_TOL = {"f32": dict(atol=1e-5, rtol=1e-5), "f16": dict(atol=2e-3, rtol=2e-3),
            "bf16": dict(atol=1.6e-2, rtol=1.6e-2)}
NUM_SLOTS = 6
USED_SLOTS = (0, 2, 5)      # 1, 3, 4: NaN
SLICES = {1: (0, 72), 2: (0, 100, 200), 3: (0, 72, 96, 120)}   # o/down, gate-up, QKV
IN_FEATURES = 72 + 5        # not a multiple of the 64-wide K chunk


def module():
    return kernel_module("lora.cu")


def inputs(rng, num_tokens, rank, starts, dt):
    num_slices = len(starts) - 1
    a = np.full((NUM_SLOTS, num_slices * rank, IN_FEATURES), np.nan, np.float32)
    b = np.full((NUM_SLOTS, starts[-1], rank), np.nan, np.float32)
    for slot in USED_SLOTS:
        a[slot] = rng.standard_normal(a.shape[1:]) / np.sqrt(IN_FEATURES)
        b[slot] = rng.standard_normal(b.shape[1:]) / np.sqrt(rank)
    slots = rng.choice(USED_SLOTS, num_tokens).astype(np.int32)
    slots[rng.random(num_tokens) < 0.25] = -1
    slots[0] = USED_SLOTS[1]
    x = rng.standard_normal((num_tokens, IN_FEATURES))
    y = rng.standard_normal((num_tokens, starts[-1]))
    (xk, xr), (ak, ar), (bk, br), (yk, yr) = (as_kernel_dtype(v, dt) for v in (x, a, b, y))
    # References compute in float32 / float64 on exactly the values the kernel reads.
    refs = tuple(r.astype(np.float32) for r in (xr, ar, br, yr))
    return (xk, ak, bk, yk), refs, slots


def reference(y, x, a, b, slots, starts, scale):
    out = y.astype(np.float64)
    rank = b.shape[2]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        s = a[slot].astype(np.float64) @ x[t].astype(np.float64)
        for i in range(len(starts) - 1):
            cols = slice(starts[i], starts[i + 1])
            out[t, cols] += scale * b[slot, cols].astype(np.float64) @ s[i * rank:(i + 1) * rank]
    return out


def _close(actual, expected, tol, what):
    bound = tol["atol"] + tol["rtol"] * np.abs(expected).max()
    err = np.abs(actual - expected).max()
    assert err <= bound, f"{what}: max error {err} > {bound}"


@pytest.mark.parametrize("dt", ("f32", "f16", "bf16"))
@pytest.mark.parametrize("num_slices", (1, 2, 3))
@pytest.mark.parametrize("rank", (8, 16))
@pytest.mark.parametrize("num_tokens", (1, 17, 111))
def test_add_lora_matches_reference(rng, dt, num_slices, rank, num_tokens):
    starts = SLICES[num_slices]
    (xk, ak, bk, yk), (xr, ar, br, yr), slots = inputs(rng, num_tokens, rank, starts, dt)
    batch = LoRABatch.from_token_slots(slots, NUM_SLOTS)
    plan = lora_tile_plan(batch, array_module(to_device(xk)))
    scale = 0.75
    s = lora_shrink(module(), to_device(xk), to_device(ak), plan,
                    out=to_device(np.full((batch.num_lora_tokens, ak.shape[1]), np.nan,
                                          np.float32)))
    s_host = to_host(s)
    assert np.isfinite(s_host).all()
    s_numpy = lora_ops.shrink(xr, ar, batch)
    _close(s_host, s_numpy, LORA_TOL["f32"], "shrink vs numpy")
    y = lora_expand(module(), to_device(yk.copy()), s, to_device(bk), plan, starts, scale)
    got = result_f32(y, dt)
    assert np.isfinite(got).all()
    _close(got, reference(yr, xr, ar, br, slots, starts, scale), LORA_TOL[dt], "add_lora")
    numpy_path = lora_ops.add_lora(yr.copy(), xr, ar, br, batch, starts, scale)
    _close(got, numpy_path, LORA_TOL[dt], "kernel vs numpy path")
    untouched = slots < 0
    np.testing.assert_array_equal(to_host(y)[untouched], yk[untouched])


def test_rank_past_one_chunk(rng):
    """Rank 40: the expand's rank loop runs a full 32-chunk and a partial one."""
    starts = SLICES[3]
    (xk, ak, bk, yk), (xr, ar, br, yr), slots = inputs(rng, 23, 40, starts, "f32")
    batch = LoRABatch.from_token_slots(slots, NUM_SLOTS)
    plan = lora_tile_plan(batch, array_module(to_device(xk)))
    y = add_lora(module(), to_device(yk.copy()), to_device(xk), to_device(ak), to_device(bk),
                 plan, starts)
    _close(to_host(y), reference(yr, xr, ar, br, slots, starts, 1.0), LORA_TOL["f32"], "rank 40")


def test_tile_plan_cuts_segments_into_tiles_of_one_slot():
    slots = np.array([5] * 35 + [-1] * 3 + [0] * 16 + [2], np.int32)
    np.random.default_rng(4).shuffle(slots)
    batch = LoRABatch.from_token_slots(slots, NUM_SLOTS)
    plan = lora_tile_plan(batch)
    np.testing.assert_array_equal(plan.tile_slots, [0, 2, 5, 5, 5])
    np.testing.assert_array_equal(plan.tile_starts, [0, 16, 17, 33, 49, 52])
    assert plan.num_tiles == 5 and plan.num_lora_tokens == 52 and plan.num_tokens == 55
    sizes = np.diff(plan.tile_starts)
    assert (sizes >= 1).all() and (sizes <= TILE_TOKENS).all()
    for tile, slot in enumerate(plan.tile_slots):
        rows = plan.sorted_token_ids[plan.tile_starts[tile]:plan.tile_starts[tile + 1]]
        assert (slots[rows] == slot).all()


def test_no_adapter_launches_nothing():
    class NoLaunch:
        def get_function(self, name):
            raise AssertionError(f"{name} launched for a step without adapters")

    x = np.ones((3, IN_FEATURES), np.float32)
    y = np.ones((3, 72), np.float32)
    plan = lora_tile_plan(LoRABatch.from_token_slots(np.full(3, -1), NUM_SLOTS))
    a = np.zeros((NUM_SLOTS, 8, IN_FEATURES), np.float32)
    b = np.zeros((NUM_SLOTS, 72, 8), np.float32)
    assert add_lora(NoLaunch(), y, x, a, b, plan, SLICES[1]) is y
    assert lora_shrink(NoLaunch(), x, a, plan).shape == (0, 8)


def test_refused_shapes():
    x = np.zeros((4, IN_FEATURES), np.float32)
    a = np.zeros((NUM_SLOTS, 8, IN_FEATURES), np.float32)
    plan = lora_tile_plan(LoRABatch.from_token_slots(np.array([0, 0, -1, 2]), NUM_SLOTS))
    with pytest.raises(UnsupportedKernelShape, match="dtypes differ"):
        lora_shrink(module(), x, a.astype(np.float16), plan)
    with pytest.raises(UnsupportedKernelShape, match="dtype float64 has no kernel"):
        lora_shrink(module(), x.astype(np.float64), a, plan)
    with pytest.raises(UnsupportedKernelShape, match="C-contiguous"):
        lora_shrink(module(), np.zeros((IN_FEATURES, 4), np.float32).T, a, plan)
    with pytest.raises(UnsupportedKernelShape, match="x must be"):
        lora_shrink(module(), x[:3], a, plan)
    s = np.zeros((3, 8), np.float32)
    y = np.zeros((4, 80), np.float32)
    b4 = np.zeros((NUM_SLOTS, 80, 2), np.float32)
    with pytest.raises(UnsupportedKernelShape, match="in 1..3 slices"):
        lora_expand(module(), y, s, b4, plan, (0, 20, 40, 60, 80))
    with pytest.raises(UnsupportedKernelShape, match="slice_starts must rise"):
        lora_expand(module(), y, s, np.zeros((NUM_SLOTS, 80, 4), np.float32), plan, (0, 50, 40))
    with pytest.raises(UnsupportedKernelShape, match="s must be"):
        lora_expand(module(), y, s, np.zeros((NUM_SLOTS, 80, 4), np.float32), plan, (0, 80))
