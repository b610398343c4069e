"""plan_decode_split (runtime/kernels/attention.py): the host-side split-K policy of decode."""
from __future__ import annotations

import pytest

from pagedrun.runtime.kernels.attention import (LONG_CONTEXT_TOKENS, MAX_SPLITS,
                                                MIN_PARTITION_TOKENS, PARTITION_GRANULE_TOKENS,
                                                SUPPORTED_BLOCK_SIZES, TARGET_CTAS_PER_SM,
                                                plan_decode_split)

H100_SMS = 132


@pytest.mark.parametrize("num_seqs", (1, 3, 64, 256))
@pytest.mark.parametrize("num_kv_heads", (1, 8))
@pytest.mark.parametrize("max_context_len", (1, 255, 256, 257, 4000, 32768, 131072))
@pytest.mark.parametrize("num_sms", (1, 4, H100_SMS))
def test_plan_invariants(num_seqs, num_kv_heads, max_context_len, num_sms):
    plan = plan_decode_split(num_seqs, num_kv_heads, max_context_len, num_sms)
    assert 1 <= plan.num_splits <= MAX_SPLITS
    # Covers the context, with no split empty for the longest request.
    assert plan.num_splits * plan.partition_size >= max_context_len
    assert (plan.num_splits - 1) * plan.partition_size < max_context_len
    # Whole blocks of every block size, never below the minimum partition.
    assert plan.partition_size % PARTITION_GRANULE_TOKENS == 0
    assert all(plan.partition_size % bs == 0 for bs in SUPPORTED_BLOCK_SIZES)
    assert plan.partition_size >= MIN_PARTITION_TOKENS


def test_full_batch_short_context_is_not_split():
    plan = plan_decode_split(256, 8, 2048, H100_SMS)
    assert plan.num_splits == 1 and plan.partition_size >= 2048


def test_small_batch_long_context_fills_the_gpu():
    # Rounding partitions up to whole granules may cost a few CTAs of the target, never a wave.
    plan = plan_decode_split(1, 8, 32768, H100_SMS)
    assert plan.num_splits * 8 >= H100_SMS
    assert plan.num_splits * 8 <= 2 * TARGET_CTAS_PER_SM * H100_SMS


def test_long_context_is_split_even_in_a_full_batch():
    plan = plan_decode_split(256, 8, 4 * LONG_CONTEXT_TOKENS, H100_SMS)
    assert plan.num_splits >= 4


def test_short_context_is_never_split_below_minimum():
    assert plan_decode_split(1, 1, MIN_PARTITION_TOKENS, H100_SMS).num_splits == 1


@pytest.mark.parametrize("bad", [(0, 8, 100, 132), (1, 0, 100, 132), (1, 8, 0, 132),
                                 (1, 8, 100, 0)])
def test_plan_rejects_nonpositive_sizes(bad):
    with pytest.raises(ValueError):
        plan_decode_split(*bad)
