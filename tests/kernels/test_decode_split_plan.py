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
    # 8 kv heads x 16 splits = 128 CTAs on 132 SMs (the next whole-granule plan, 256 CTAs of
    # half the length, models no faster); never more than two waves' worth.
    plan = plan_decode_split(1, 8, 32768, H100_SMS)
    assert plan.num_splits * 8 >= 0.95 * H100_SMS
    assert plan.num_splits * 8 <= 2 * TARGET_CTAS_PER_SM * H100_SMS


def modelled_steps(num_seqs, num_kv_heads, plan, num_sms):
    """The step time of a plan (tokens of one CTA's streaming) in the plan's own two terms,
    without its fixed costs: bandwidth (every SM its share) and latency (resident waves)."""
    ctas = num_seqs * num_kv_heads * plan.num_splits
    slots = TARGET_CTAS_PER_SM * num_sms
    return max(ctas * plan.partition_size / num_sms,
               -(-ctas // slots) * plan.partition_size)


@pytest.mark.parametrize("num_sms", (16, H100_SMS))
@pytest.mark.parametrize("max_context_len", (2048, 3000, 32768))
def test_plan_keeps_every_sm_busy_for_any_batch(num_sms, max_context_len):
    # Batches 1-256, GQA layouts of 1-8 kv heads, contexts >= 2k: the plan's modelled time is
    # within 15% of the ideal (all work spread evenly over the SMs, no CTA under the minimum
    # partition, at most MAX_SPLITS): no nearly empty last wave, no idle SMs the work could
    # have filled.
    for num_seqs in range(1, 257):
        for num_kv_heads in (1, 2, 4, 8):
            plan = plan_decode_split(num_seqs, num_kv_heads, max_context_len, num_sms)
            shortest = max(MIN_PARTITION_TOKENS, -(-max_context_len // MAX_SPLITS))
            ideal = max(num_seqs * num_kv_heads * max_context_len / num_sms,
                        min(max_context_len, shortest))
            steps = modelled_steps(num_seqs, num_kv_heads, plan, num_sms)
            assert ideal >= 0.85 * steps, (num_seqs, num_kv_heads, max_context_len, plan,
                                           ideal / steps)


def test_batch_just_over_a_wave_is_rebalanced():
    # 133 requests x 1 kv head on 132 SMs, 3000 tokens: unsplit is one CTA per SM plus one
    # straggler; the plan must do no worse than that in its model, and every SM gets work.
    plan = plan_decode_split(133, 1, 3000, H100_SMS)
    assert 133 * plan.num_splits >= H100_SMS
    assert modelled_steps(133, 1, plan, H100_SMS) <= modelled_steps(
        133, 1, type(plan)(1, 3072), H100_SMS)


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
