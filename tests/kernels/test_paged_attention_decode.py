"""cuda/paged_attention_decode.cu (through runtime/kernels/attention.py) against
numpy_ops.paged_decode_attention, on NaN-poisoned paged pools with shuffled block tables."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import (ATTENTION_TOL, DTYPES, PagedKV, as_kernel_dtype, assert_close,
                                 kernel_module, result_f32, to_device)
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.attention import (DECODE_GROUPS, DECODE_IN_FLIGHT_BYTES,
                                                DECODE_MAX_STAGES, DECODE_TC_GROUPS,
                                                DECODE_WARPS, SUPPORTED_HEAD_DIMS,
                                                DecodeSplitPlan, decode_smem_bytes,
                                                decode_tc_smem_bytes, decode_tc_tiling,
                                                decode_tiling, decode_uses_tensor_cores,
                                                paged_decode_attention, plan_decode_split)
from pagedrun.runtime.kernels.kernel_args import DEFAULT_DYNAMIC_SMEM_LIMIT, UnsupportedKernelShape

NUM_KV_HEADS = 2
AWKWARD_CONTEXTS = (1, 17, 111, 64)  # one token, partial blocks, an exact block boundary


def run_decode(rng, dt, context_lens, *, num_kv_heads=NUM_KV_HEADS, group=4, head_dim=64,
               block_size=16, max_blocks_per_seq=None, split=None, num_sms=None,
               sliding_window=None):
    pool = PagedKV(rng, context_lens, num_kv_heads, head_dim, block_size, max_blocks_per_seq)
    num_heads = num_kv_heads * group
    q32 = rng.standard_normal((len(context_lens), num_heads, head_dim)).astype(np.float32)
    q, q_ref = as_kernel_dtype(q32, dt)
    k, k_ref = as_kernel_dtype(pool.k, dt)
    v, v_ref = as_kernel_dtype(pool.v, dt)
    scale = head_dim ** -0.5
    tables = pool.block_tables
    if sliding_window is not None:  # blocks before the window must not even be indexed
        tables = pool.tables_hiding_before([c - sliding_window for c in context_lens])
    out = paged_decode_attention(kernel_module("paged_attention_decode.cu"), to_device(q),
                                 to_device(k), to_device(v), to_device(tables),
                                 to_device(pool.context_lens), scale, split=split,
                                 num_sms=num_sms, sliding_window=sliding_window)
    expected = numpy_ops.paged_decode_attention(q_ref, k_ref, v_ref, pool.block_tables,
                                                pool.context_lens, scale, sliding_window)
    assert_close(result_f32(out, dt), expected, ATTENTION_TOL[dt],
                 f"decode {dt} group {group} head_dim {head_dim} block {block_size} "
                 f"contexts {list(context_lens)} split {split} window {sliding_window}")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_decode_matches_reference(rng, dt, group, head_dim):
    run_decode(rng, dt, AWKWARD_CONTEXTS, group=group, head_dim=head_dim,
               num_kv_heads=1 if group == 8 else NUM_KV_HEADS)


@pytest.mark.parametrize("block_size", (32, 64))
def test_decode_block_sizes(rng, block_size):
    run_decode(rng, "f16", (1, block_size - 1, block_size + 1, 100), block_size=block_size)


@pytest.mark.parametrize("group", (2, 3, 6))
def test_decode_groups_between_instantiations(rng, group):
    # 3 runs on the group-4 kernel, 6 on group 8: the unused query-head lanes must not leak.
    run_decode(rng, "f32", (5, 40), group=group)


def test_decode_one_request_at_max_length(rng):
    max_blocks = 8
    run_decode(rng, "bf16", (max_blocks * 16, 3, 77), max_blocks_per_seq=max_blocks)


@pytest.mark.parametrize("dt", DTYPES)
def test_decode_split_partitions(rng, dt):
    # 32-token partitions: 1 and 17 stay inside the first, 64 ends exactly on a partition
    # boundary, 111 crosses three, and the short requests leave trailing splits empty.
    run_decode(rng, dt, AWKWARD_CONTEXTS, head_dim=128, split=DecodeSplitPlan(4, 32))


def test_decode_split_from_plan(rng):
    # A lone request on a (pretend) large GPU: the plan splits a 600-token context in 256s.
    plan = plan_decode_split(1, 1, 600, 64)
    assert plan.num_splits > 1
    run_decode(rng, "f16", (600,), num_kv_heads=1, group=8, num_sms=64)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("window,split", [(1, None), (17, None), (40, DecodeSplitPlan(2, 32)),
                                          (200, DecodeSplitPlan(4, 32))])
def test_decode_sliding_window(rng, dt, window, split):
    # Contexts shorter than, equal to and longer than the window (by a partial block and by
    # several blocks); with splits, the partitions walk the window only and the merge counts
    # the window's splits. Window 200 covers every context: plain causal decode.
    run_decode(rng, dt, (1, 17, 40, 111, 64), sliding_window=window, split=split)


@pytest.mark.parametrize("dt", DTYPES)
def test_decode_d256_split_and_window(rng, dt):
    # Gemma 3's shape (head_dim 256, 2 query heads per kv head: the g2 instantiation; f32 gives
    # each lane two 16-byte vectors of a row), split over 32-token partitions, then a sliding
    # window walked by two splits.
    run_decode(rng, dt, AWKWARD_CONTEXTS, group=2, head_dim=256, split=DecodeSplitPlan(4, 32))
    run_decode(rng, dt, (1, 17, 40, 111), group=2, head_dim=256, sliding_window=40,
               split=DecodeSplitPlan(2, 32))


def _inputs(dt="f16", num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, num_seqs=2):
    np_dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dt]
    q = np.zeros((num_seqs, num_heads, head_dim), np_dt)
    cache = np.zeros((6, block_size, num_kv_heads, head_dim), np_dt)
    return dict(q=q, k_cache=cache, v_cache=cache.copy(),
                block_tables=np.zeros((num_seqs, 3), np.int32),
                context_lens=np.ones(num_seqs, np.int32))


def _call(**overrides):
    args = _inputs()
    args.update(overrides)
    return paged_decode_attention(kernel_module("paged_attention_decode.cu"), args["q"],
                                  args["k_cache"], args["v_cache"], args["block_tables"],
                                  args["context_lens"], 0.125)


@pytest.mark.parametrize("case,overrides", [
    ("head_dim 96", _inputs(head_dim=96)),
    ("head_dim 512", _inputs(head_dim=512)),
    ("block_size 8", _inputs(block_size=8)),
    ("block_size 24", _inputs(block_size=24)),
    ("group 16", _inputs(num_heads=16, num_kv_heads=1)),
    ("heads not a multiple", _inputs(num_heads=6, num_kv_heads=4)),
    ("float64", {k: (v.astype(np.float64) if v.dtype == np.float16 else v)
                 for k, v in _inputs().items()}),
    ("dtype mismatch", {"q": np.zeros((2, 8, 64), np.float32)}),
    ("int64 block table", {"block_tables": np.zeros((2, 3), np.int64)}),
    ("non-contiguous q", {"q": np.zeros((2, 8, 128), np.float16)[:, :, ::2]}),
    ("context past table", {"context_lens": np.array([1, 3 * 16 + 1], np.int32)}),
])
def test_decode_rejects_unsupported(case, overrides):
    with pytest.raises(UnsupportedKernelShape):
        _call(**overrides)


# ------------------------------------------------------------------ cp.async pipeline edges
# The kernel streams K/V in tiles of decode_tiling(...).tile_tokens rows through a ring of
# num_stages shared-memory stages. Contexts around the tile size and past the ring's length
# hit every edge: one token, a partial tile, exactly one tile, one tile and one token, a ring
# that wraps (more tiles than stages) ending in a partial block. PagedKV's pool is NaN where
# no request owns a slot, so a copy that reads past a context (instead of zero-filling) or a
# stage read before its copy landed (the harness twin poisons it with NaN until the wait)
# shows up as a non-finite output.
def pipeline_contexts(dt: str, head_dim: int, block_size: int = 16) -> tuple[int, ...]:
    tiling = decode_tiling(dt, head_dim)
    tile = tiling.tile_tokens
    wrap = (tiling.num_stages + 1) * tile + block_size // 2 + 1  # partial last block
    return (1, 17, tile, tile + 1, wrap)


@pytest.mark.parametrize("dt,head_dim", [("f32", 64), ("f16", 128), ("bf16", 256),
                                         ("f32", 256)])
def test_decode_pipeline_tile_edges(rng, dt, head_dim):
    run_decode(rng, dt, pipeline_contexts(dt, head_dim), group=2, head_dim=head_dim,
               num_kv_heads=1)


@pytest.mark.parametrize("dt", DTYPES)
def test_decode_many_splits_off_tile_boundaries(rng, dt):
    # Partitions of 24 tokens: not a multiple of any tile or block, so split starts land
    # mid-tile and mid-block; 13 splits, most requests leaving trailing ones empty.
    run_decode(rng, dt, (1, 23, 25, 111, 300), head_dim=64, split=DecodeSplitPlan(13, 24))


def test_decode_window_starts_mid_tile(rng):
    # The window's first token (context - 45) sits mid-tile and mid-block; the ring wraps.
    contexts = pipeline_contexts("f16", 64)
    run_decode(rng, "f16", contexts, head_dim=64, sliding_window=45)
    run_decode(rng, "f16", contexts, head_dim=64, sliding_window=45,
               split=DecodeSplitPlan(3, 16))


def test_decode_smem_covers_stages_and_merge_scratch():
    # The launch's dynamic shared memory is the larger of the stage ring and the merge scratch;
    # only f32 d256 (two 16 KiB tiles per stage) goes past the 48 KiB default.
    for dt in ("f32", "f16", "bf16", "f32_kv_fp8", "f16_kv_fp8", "bf16_kv_fp8"):
        for head_dim in SUPPORTED_HEAD_DIMS:
            tiling = decode_tiling(dt, head_dim)
            assert (tiling.num_stages - 1) * tiling.stage_bytes >= DECODE_IN_FLIGHT_BYTES or (
                tiling.num_stages == DECODE_MAX_STAGES)
            for group in DECODE_GROUPS:
                smem = decode_smem_bytes(group, head_dim, dt)
                assert smem >= tiling.num_stages * tiling.stage_bytes
                assert smem >= DECODE_WARPS * group * (head_dim + 2) * 4
                assert (smem > DEFAULT_DYNAMIC_SMEM_LIMIT) == (dt == "f32" and head_dim == 256)


# ------------------------------------------------------------------ tensor-core path (g4, g8)
# f16 / bf16 q with a group instantiated at 4 or 8 runs paged_attention_decode_tc_* (mma
# scoring, the query heads as M rows, P rounded to T before P V: ATTENTION_TOL's 16-bit rows
# already budget that rounding, as for prefill). Most tests above reach it through group 4 / 8
# (test_decode_matches_reference, splits, windows, off-tile splits); these cover its own tile
# geometry (16 rows a warp at d64, 8 above; 64 / 32 / 32-token tiles) and the dispatch.
class LaunchSpy:
    """A module stand-in that records the kernels a wrapper asks for."""

    def __init__(self, module):
        self.module, self.names = module, []

    def get_function(self, name):
        self.names.append(name)
        return self.module.get_function(name)


@pytest.mark.parametrize("dt,group,want_tc", [("f16", 4, True), ("bf16", 8, True),
                                              ("bf16", 3, True), ("f16", 6, True),
                                              ("f32", 8, False), ("bf16", 2, False),
                                              ("f16", 1, False)])
def test_decode_dispatch_tensor_cores(dt, group, want_tc):
    # 16-bit q with a group instantiated at 4 or 8: the tensor-core kernel; else CUDA cores.
    args = _inputs(dt=dt, num_heads=2 * group, num_kv_heads=2)
    spy = LaunchSpy(kernel_module("paged_attention_decode.cu"))
    paged_decode_attention(spy, args["q"], args["k_cache"], args["v_cache"],
                           args["block_tables"], args["context_lens"], 0.125)
    instantiated = 4 if group in (3, 4) else (8 if group > 4 else group)
    stem = "paged_attention_decode_tc_" if want_tc else "paged_attention_decode_"
    assert spy.names == [f"{stem}{dt}_d64_g{instantiated}"]
    assert decode_uses_tensor_cores(dt, instantiated) == want_tc


def tc_pipeline_contexts(dt: str, head_dim: int, block_size: int = 16) -> tuple[int, ...]:
    tiling = decode_tc_tiling(dt, head_dim)
    tile = tiling.tile_tokens
    wrap = (tiling.num_stages + 1) * tile + block_size // 2 + 1  # partial last block
    return (1, 17, tile - 1, tile, tile + 1, wrap)


@pytest.mark.parametrize("dt,head_dim,group", [("f16", 64, 8), ("bf16", 64, 4),
                                               ("bf16", 128, 8), ("f16", 128, 4),
                                               ("f16", 256, 8), ("bf16", 256, 4)])
def test_decode_tc_pipeline_tile_edges(rng, dt, head_dim, group):
    run_decode(rng, dt, tc_pipeline_contexts(dt, head_dim), group=group, head_dim=head_dim,
               num_kv_heads=1 if group == 8 else NUM_KV_HEADS)


@pytest.mark.parametrize("dt", ("f16", "bf16"))
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_decode_tc_long_split_and_window(rng, dt, head_dim):
    # A long context the plan splits (a pretend 64-SM GPU), then split starts off every tile
    # (21-token partitions), then a sliding window walked by two splits, at group 8.
    run_decode(rng, dt, (1, 17, 111, 700), group=8, head_dim=head_dim, num_kv_heads=1,
               num_sms=64)
    run_decode(rng, dt, (1, 17, 111, 130), group=8, head_dim=head_dim, num_kv_heads=1,
               split=DecodeSplitPlan(7, 21))
    run_decode(rng, dt, (1, 17, 40, 111), group=8, head_dim=head_dim, num_kv_heads=1,
               sliding_window=40, split=DecodeSplitPlan(2, 32))


@pytest.mark.parametrize("block_size", (32, 64))
def test_decode_tc_block_sizes(rng, block_size):
    run_decode(rng, "bf16", (1, block_size - 1, block_size + 1, 150), group=8,
               block_size=block_size, num_kv_heads=1)


def test_decode_tc_smem_covers_stages_and_merge_scratch():
    # Same rule as the CUDA-core kernel: ring or merge scratch, the larger; only the 16-bit
    # d256 ring (two 32-row stages of 32 KiB) goes past the 48 KiB default.
    for dt in ("f16", "bf16", "f16_kv_fp8", "bf16_kv_fp8"):
        for head_dim in SUPPORTED_HEAD_DIMS:
            tiling = decode_tc_tiling(dt, head_dim)
            assert tiling.tile_tokens == DECODE_WARPS * (16 if head_dim == 64 else 8)
            assert (tiling.num_stages - 1) * tiling.stage_bytes >= DECODE_IN_FLIGHT_BYTES
            for group in DECODE_TC_GROUPS:
                smem = decode_tc_smem_bytes(group, head_dim, dt)
                assert smem >= tiling.num_stages * tiling.stage_bytes
                assert smem >= DECODE_WARPS * group * (head_dim + 2) * 4
                assert (smem > DEFAULT_DYNAMIC_SMEM_LIMIT) == (dt in ("f16", "bf16") and
                                                                head_dim == 256)
    with pytest.raises(UnsupportedKernelShape):
        decode_tc_tiling("f32", 64)
