"""runtime/lora/lora_ops.py (the cpu path and the kernels' reference) against a float64 loop
over tokens written here: awkward token counts, ranks 8 / 16, one to three output slices with
uneven widths, several adapters in one batch with some rows having none, unused slots of the
weight stacks NaN-poisoned (never read), and a step without adapters doing nothing."""
from __future__ import annotations

import numpy as np
import pytest

from pagedrun.runtime.lora import lora_ops
from pagedrun.runtime.lora.lora_ops import LoRABatch, add_lora, expand, shrink

NUM_SLOTS = 5
USED_SLOTS = (0, 2, 3)     # 1 and 4 hold NaN
SLICES = {1: (0, 40), 2: (0, 33, 66), 3: (0, 48, 64, 80)}   # o/down, gate-up, QKV (GQA)


def reference(y, x, lora_a, lora_b, token_slots, starts, scale):
    """Token by token, output column by column, float64."""
    out = y.astype(np.float64)
    rank = lora_b.shape[2]
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        s = lora_a[slot].astype(np.float64) @ x[t]
        for i in range(len(starts) - 1):
            for o in range(starts[i], starts[i + 1]):
                out[t, o] += scale * s[i * rank:(i + 1) * rank] @ lora_b[slot, o]
    return out


def make_inputs(rng, num_tokens, rank, starts, in_features=37, none_fraction=0.3):
    num_slices = len(starts) - 1
    lora_a = np.full((NUM_SLOTS, num_slices * rank, in_features), np.nan, np.float32)
    lora_b = np.full((NUM_SLOTS, starts[-1], rank), np.nan, np.float32)
    for slot in USED_SLOTS:
        lora_a[slot] = rng.standard_normal(lora_a.shape[1:])
        lora_b[slot] = rng.standard_normal(lora_b.shape[1:])
    token_slots = rng.choice(USED_SLOTS, num_tokens).astype(np.int32)
    token_slots[rng.random(num_tokens) < none_fraction] = -1
    x = rng.standard_normal((num_tokens, in_features)).astype(np.float32)
    y = rng.standard_normal((num_tokens, starts[-1])).astype(np.float32)
    return x, y, lora_a, lora_b, token_slots


@pytest.mark.parametrize("num_tokens", (1, 17, 111))
@pytest.mark.parametrize("rank", (8, 16))
@pytest.mark.parametrize("num_slices", (1, 2, 3))
def test_add_lora_matches_the_token_loop(num_tokens, rank, num_slices):
    rng = np.random.default_rng(num_tokens * 100 + rank + num_slices)
    starts = SLICES[num_slices]
    x, y, lora_a, lora_b, token_slots = make_inputs(rng, num_tokens, rank, starts)
    if num_tokens == 1:
        token_slots[0] = 2
    batch = LoRABatch.from_token_slots(token_slots, NUM_SLOTS)
    scale = 0.5
    expected = reference(y, x, lora_a, lora_b, token_slots, starts, scale)
    out = add_lora(y.copy(), x, lora_a, lora_b, batch, starts, scale)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    untouched = token_slots < 0
    np.testing.assert_array_equal(out[untouched], y[untouched])


def test_shrink_rows_are_in_sorted_token_order():
    rng = np.random.default_rng(1)
    x, _, lora_a, _, _ = make_inputs(rng, 6, 8, SLICES[1])
    token_slots = np.array([3, -1, 0, 3, 0, 2], np.int32)
    batch = LoRABatch.from_token_slots(token_slots, NUM_SLOTS)
    np.testing.assert_array_equal(batch.sorted_token_ids, [2, 4, 5, 0, 3])
    np.testing.assert_array_equal(batch.segment_slots, [0, 2, 3])
    np.testing.assert_array_equal(batch.segment_starts, [0, 2, 3, 5])
    s = shrink(x, lora_a, batch)
    for p, t in enumerate(batch.sorted_token_ids):
        np.testing.assert_allclose(s[p], lora_a[token_slots[t]] @ x[t], rtol=1e-5, atol=1e-5)


def test_no_adapter_in_the_step_does_no_work(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("shrink ran for a step without adapters")

    monkeypatch.setattr(lora_ops, "shrink", boom)
    rng = np.random.default_rng(2)
    x, y, lora_a, lora_b, _ = make_inputs(rng, 9, 8, SLICES[3])
    batch = LoRABatch.from_token_slots(np.full(9, -1, np.int32), NUM_SLOTS)
    assert batch.empty
    before = y.copy()
    assert add_lora(y, x, lora_a, lora_b, batch, SLICES[3]) is y
    np.testing.assert_array_equal(y, before)


def test_request_slots_expand_to_token_slots():
    batch = LoRABatch.from_request_slots([2, -1, 0], [1, 3, 2], NUM_SLOTS)
    expected = LoRABatch.from_token_slots([2, -1, -1, -1, 0, 0], NUM_SLOTS)
    np.testing.assert_array_equal(batch.sorted_token_ids, expected.sorted_token_ids)
    np.testing.assert_array_equal(batch.sorted_token_ids, [4, 5, 0])
    assert batch.num_tokens == 6


@pytest.mark.parametrize("token_slots, message", [
    ([0, 5], r"token_slots must lie in \[-1, 5\)"),
    ([-2, 0], r"token_slots must lie in \[-1, 5\)"),
    ([[0, 1]], "token_slots must be a 1-D int array"),
    ([0.5], "token_slots must be a 1-D int array"),
])
def test_bad_token_slots(token_slots, message):
    with pytest.raises(ValueError, match=message):
        LoRABatch.from_token_slots(np.array(token_slots), NUM_SLOTS)


def test_shape_checks():
    rng = np.random.default_rng(3)
    x, y, lora_a, lora_b, token_slots = make_inputs(rng, 4, 8, SLICES[2], none_fraction=0)
    batch = LoRABatch.from_token_slots(token_slots, NUM_SLOTS)
    with pytest.raises(ValueError, match="x must be"):
        shrink(x[:3], lora_a, batch)
    with pytest.raises(ValueError, match="lora_a must be"):
        shrink(x, lora_a[:, :, :5], batch)
    s = shrink(x, lora_a, batch)
    with pytest.raises(ValueError, match="y must be"):
        expand(y, s, lora_b, batch, (0, 30, 60))
    with pytest.raises(ValueError, match="s must be"):
        expand(y, s[:, :8], lora_b, batch, SLICES[2])


@pytest.mark.parametrize("token_slots", ([-1, 0, 0, 2, 2, 2, -1], [3] * 19, [-1, 4]))
def test_slot_ordered_tokens_take_the_contiguous_path(token_slots):
    """Tokens already grouped by slot (a single request's prefill, requests ordered by
    adapter): gather and scatter are slices, same result as the loop."""
    rng = np.random.default_rng(len(token_slots))
    starts = SLICES[3]
    x, y, lora_a, lora_b, _ = make_inputs(rng, len(token_slots), 8, starts)
    lora_a[4] = rng.standard_normal(lora_a.shape[1:])
    lora_b[4] = rng.standard_normal(lora_b.shape[1:])
    batch = LoRABatch.from_token_slots(np.array(token_slots), NUM_SLOTS)
    assert isinstance(batch.token_rows, slice)
    expected = reference(y, x, lora_a, lora_b, token_slots, starts, 1.0)
    np.testing.assert_allclose(add_lora(y.copy(), x, lora_a, lora_b, batch, starts), expected,
                               rtol=1e-5, atol=1e-4)
