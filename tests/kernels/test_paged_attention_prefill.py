"""cuda/paged_attention_prefill.cu (through runtime/kernels/attention.py) against
numpy_ops.paged_prefill_attention: ragged chunks over NaN-poisoned paged pools, fresh prefills,
chunked prefills behind a cached prefix, decode rows, and padding rows after the last request."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import (ATTENTION_TOL, DTYPES, PagedKV, as_kernel_dtype, assert_close,
                                 kernel_module, result_f32, to_device)
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.attention import paged_prefill_attention
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

# (query_len, context_len) per request: a one-token prompt, a fresh 17-token prompt, a 111-token
# chunk behind a 20-token cached prefix (two 64-row tiles, the second partial), a 5-token chunk
# continuing a chunked prefill, a decode row.
MIXED_BATCH = ((1, 1), (17, 17), (111, 131), (5, 70), (1, 40))
PADDING_ROWS = 3  # q rows past query_start_loc[-1], as a padded batch has


def run_prefill(rng, dt, requests, *, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                max_blocks_per_seq=None, padding_rows=PADDING_ROWS, sliding_window=None):
    query_lens = [qlen for qlen, _ in requests]
    pool = PagedKV(rng, [ctx for _, ctx in requests], num_kv_heads, head_dim, block_size,
                   max_blocks_per_seq)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_heads = num_kv_heads * group
    num_tokens = int(query_start_loc[-1]) + padding_rows
    q32 = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    q, q_ref = as_kernel_dtype(q32, dt)
    k, k_ref = as_kernel_dtype(pool.k, dt)
    v, v_ref = as_kernel_dtype(pool.v, dt)
    scale = head_dim ** -0.5
    tables = pool.block_tables
    if sliding_window is not None:  # before the first row's window: never indexed
        tables = pool.tables_hiding_before([ctx - qlen - sliding_window + 1
                                            for qlen, ctx in requests])
    out = paged_prefill_attention(kernel_module("paged_attention_prefill.cu"), to_device(q),
                                  to_device(k), to_device(v), to_device(tables),
                                  to_device(query_start_loc), to_device(pool.context_lens), scale,
                                  sliding_window=sliding_window)
    expected = numpy_ops.paged_prefill_attention(q_ref, k_ref, v_ref, pool.block_tables,
                                                 query_start_loc, pool.context_lens, scale,
                                                 sliding_window)
    assert_close(result_f32(out, dt), expected, ATTENTION_TOL[dt],
                 f"prefill {dt} group {group} head_dim {head_dim} block {block_size} "
                 f"requests {list(requests)} window {sliding_window}")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_prefill_matches_reference(rng, dt, group, head_dim):
    run_prefill(rng, dt, MIXED_BATCH, group=group, head_dim=head_dim,
                num_kv_heads=1 if group == 8 else 2)


@pytest.mark.parametrize("dt", ("f16", "bf16"))
def test_prefill_chunks_of_one_request(rng, dt):
    # The same 150-token prompt as three chunked-prefill steps: no prefix, then behind 64 and
    # behind 128 cached tokens (the tile edge and the key-tile edge fall in different places).
    for cached in (0, 64, 128):
        chunk = min(64, 150 - cached)
        run_prefill(rng, dt, ((chunk, cached + chunk),), num_kv_heads=1, group=2)


@pytest.mark.parametrize("block_size", (32, 64))
def test_prefill_block_sizes(rng, block_size):
    run_prefill(rng, "bf16", ((block_size + 3, block_size + 3), (7, 2 * block_size - 1)),
                block_size=block_size, head_dim=128)


def test_prefill_one_request_at_max_length(rng):
    max_blocks = 6
    run_prefill(rng, "f16", ((19, max_blocks * 16), (2, 2)), max_blocks_per_seq=max_blocks)


def test_prefill_empty_requests(rng):
    # A request with no query rows this step (query_start_loc repeats) writes nothing.
    run_prefill(rng, "f32", ((0, 5), (3, 3), (0, 9)))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("window", (1, 16, 33, 500))
def test_prefill_sliding_window(rng, dt, window):
    # The mixed batch under windows of one token, one block, a partial tile past a block, and
    # one wider than every context (plain causal). The 111-token chunk spans two row tiles, so
    # the second tile starts its key walk later than the first.
    run_prefill(rng, dt, MIXED_BATCH, sliding_window=window)


@pytest.mark.parametrize("dt", DTYPES)
def test_prefill_d256_sliding_window(rng, dt):
    # head_dim 256 (Gemma 3): f32 runs each 64-row tile in two 32-row passes, f16/bf16 reload Q
    # from shared memory with one K/V stage; a 33-token window over the mixed batch.
    run_prefill(rng, dt, MIXED_BATCH, group=2, head_dim=256, sliding_window=33)


def _call(dt=np.float16, head_dim=64, block_size=16, num_heads=4, num_kv_heads=2, **overrides):
    args = dict(q=np.zeros((4, num_heads, head_dim), dt),
                k_cache=np.zeros((4, block_size, num_kv_heads, head_dim), dt),
                v_cache=np.zeros((4, block_size, num_kv_heads, head_dim), dt),
                block_tables=np.zeros((1, 2), np.int32),
                query_start_loc=np.array([0, 4], np.int32),
                context_lens=np.array([4], np.int32))
    args.update(overrides)
    return paged_prefill_attention(kernel_module("paged_attention_prefill.cu"), args["q"],
                                   args["k_cache"], args["v_cache"], args["block_tables"],
                                   args["query_start_loc"], args["context_lens"], 0.125)


@pytest.mark.parametrize("case,overrides", [
    ("head_dim 80", dict(head_dim=80)),
    ("head_dim 512", dict(head_dim=512)),
    ("block_size 128", dict(block_size=128)),
    ("float64", dict(dt=np.float64)),
    ("heads not a multiple", dict(num_heads=3)),
    ("query_start_loc length", dict(query_start_loc=np.array([0, 2, 4], np.int32))),
    ("int64 context_lens", dict(context_lens=np.array([4], np.int64))),
])
def test_prefill_rejects_unsupported(case, overrides):
    with pytest.raises(UnsupportedKernelShape):
        _call(**overrides)
