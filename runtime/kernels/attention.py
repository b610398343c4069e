"""Launch wrappers of the attention kernels, and the host-side split-K plan of decode.

    module = load_module("paged_attention_decode.cu", backend="sim")   # or "cuda"
    out = paged_decode_attention(module, q, k_cache, v_cache, block_tables, context_lens, scale)

    module = load_module("paged_attention_prefill.cu", backend="sim")
    out = paged_prefill_attention(module, q, k_cache, v_cache, block_tables, query_start_loc,
                                  context_lens, scale)

Both take sliding_window= (None: full causal; W: a query at position p sees keys p - W < j <= p,
Gemma 3's local layers); the kernels then never read the blocks before the window.

Arguments are the numpy backend's (runtime/backends/numpy_ops.py), so the numpy ops are the
reference: KV caches [num_blocks, block_size, num_kv_heads, head_dim] (NHD) in q's dtype, or
uint8 fp8 e4m3 codes (kv_cache_dtype "fp8": the _kv_fp8 kernels widen them exactly on load),
block_tables [num_seqs, max_blocks] int32, context_lens [num_seqs] int32. Arrays are numpy
under the CPU harness and cupy on a GPU; the wrappers only check, plan and launch. Every shape
the kernels do not serve raises UnsupportedKernelShape before launching.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .kernel_args import (VEC16_BYTES, UnsupportedKernelShape, array_module, cache_suffix,
                          ceil_div, device_num_sms, log2_exact, opt_in_smem, require,
                          require_aligned, require_contiguous, require_int32)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
# Decode instantiations per kv-head group; a group runs on the smallest one that holds it.
DECODE_GROUPS = (1, 2, 4, 8)
DECODE_THREADS = 128
DECODE_WARPS = DECODE_THREADS // 32
MERGE_THREADS = 128
PREFILL_THREADS = 128
PREFILL_BLOCK_M = 64    # query rows per CTA (cuda/paged_attention_prefill.cu kBlockM)
PREFILL_BLOCK_N = 32    # keys per tile (kBlockN)
PREFILL_SMEM_PAD = 8    # elements of padding per shared row on the mma path (kPad)
FLOAT32_BYTES = 4

# Decode pipeline geometry (cuda/paged_attention_decode.cu Tiling; the kernel header shows the
# bytes-in-flight arithmetic). A tile is DECODE_TILE_STEPS token steps of the CTA; stages
# are sized so (stages - 1) x stage bytes >= DECODE_IN_FLIGHT_BYTES.
DECODE_VEC_BYTES = 16
DECODE_TILE_STEPS = 4
DECODE_IN_FLIGHT_BYTES = 24 * 1024
DECODE_MAX_STAGES = 8

# Split-K plan. Partitions are whole multiples of 256 tokens, so of every block size and tile.
PARTITION_GRANULE_TOKENS = 256
# Under this many tokens a partition's fixed cost (q load, merge traffic) outweighs its reads.
MIN_PARTITION_TOKENS = 256
# A CTA streaming more than this alone becomes the tail of the step: split even a full batch
# (the wave model below assumes equal contexts; a long request among short ones is not).
LONG_CONTEXT_TOKENS = 8192
# Resident decode CTAs per SM the plan counts on: group 8 fits two (registers); smaller groups
# fit more, so the plan's latency term is conservative for them.
TARGET_CTAS_PER_SM = 2
# Plan model costs, in tokens of one CTA's streaming time: a CTA's fixed cost (pipeline fill:
# one HBM latency before its first tile lands, q load, final merge), and what each extra split
# adds (a partial row written and read back by the merge kernel: head_dim fp32, ~1% of a
# token-row pair per query head, plus the merge kernel's launch, shared by all heads).
CTA_FIXED_COST_TOKENS = 64
SPLIT_COST_TOKENS = 2
MAX_SPLITS = 128


class DecodeSplitPlan(NamedTuple):
    num_splits: int       # grid.z of the decode kernel; 1 means no merge kernel
    partition_size: int   # tokens per split, a multiple of PARTITION_GRANULE_TOKENS


def plan_decode_split(num_seqs: int, num_kv_heads: int, max_context_len: int,
                      num_sms: int) -> DecodeSplitPlan:
    """How to split decode attention over the context (pure; the policy lives here only).

    A two-term model of the step, in tokens of one CTA's streaming time. With n splits of
    P tokens there are C = num_seqs * num_kv_heads * n CTAs; the step takes at least
      bandwidth: C * (P + fixed) / num_sms  (each SM draws its share of HBM: one CTA's bytes in
                 flight cover that share, cuda/paged_attention_decode.cu header), and
      latency:   ceil(C / (TARGET_CTAS_PER_SM * num_sms)) * (P + fixed)  (waves of resident
                 CTAs, each no faster than one CTA streams),
    plus SPLIT_COST_TOKENS per extra split. The plan takes the n with the least modelled
    time (ties: fewer splits): a small batch is split until every SM has work, a batch just
    over a wave is not left with an almost empty last wave, a full batch stays unsplit.
    Partitions are whole PARTITION_GRANULE_TOKENS, never below MIN_PARTITION_TOKENS (so at
    most ceil(max_context_len / 256) splits: below ~num_sms * 256 tokens of work some SMs
    idle whatever the plan); a context past LONG_CONTEXT_TOKENS is split regardless (the model
    assumes equal contexts; one long request among short ones must not serialise the step).
    """
    if num_seqs < 1 or num_kv_heads < 1 or max_context_len < 1 or num_sms < 1:
        raise ValueError(f"plan_decode_split needs positive sizes, got num_seqs={num_seqs}, "
                         f"num_kv_heads={num_kv_heads}, max_context_len={max_context_len}, "
                         f"num_sms={num_sms}")
    slots = TARGET_CTAS_PER_SM * num_sms
    most = min(ceil_div(max_context_len, MIN_PARTITION_TOKENS), MAX_SPLITS)
    least = min(ceil_div(max_context_len, LONG_CONTEXT_TOKENS), most)
    best = None
    for wanted in range(least, most + 1):
        partition_size = ceil_div(ceil_div(max_context_len, wanted),
                                  PARTITION_GRANULE_TOKENS) * PARTITION_GRANULE_TOKENS
        num_splits = ceil_div(max_context_len, partition_size)
        num_ctas = num_seqs * num_kv_heads * num_splits
        cta_cost = partition_size + CTA_FIXED_COST_TOKENS
        cost = (max(num_ctas * cta_cost / num_sms, ceil_div(num_ctas, slots) * cta_cost)
                + (num_splits - 1) * SPLIT_COST_TOKENS)
        if best is None or cost < best[0]:
            best = (cost, DecodeSplitPlan(num_splits, partition_size))
    return best[1]


def decode_group_instantiation(group_size: int) -> int:
    for group in DECODE_GROUPS:
        if group_size <= group:
            return group
    raise UnsupportedKernelShape(f"GQA group of {group_size} query heads per kv head exceeds "
                                 f"the largest decode instantiation ({DECODE_GROUPS[-1]})")


class DecodeTiling(NamedTuple):
    tile_tokens: int   # K (and V) rows per pipeline tile
    stage_bytes: int   # one K tile plus one V tile
    num_stages: int    # cp.async ring depth; num_stages - 1 tiles in flight


def decode_tiling(dtype_name: str, head_dim: int) -> DecodeTiling:
    """The decode kernel's pipeline geometry (cuda/paged_attention_decode.cu Tiling).
    dtype_name is a kernel's dtype part ("bf16", "f32_kv_fp8", ...)."""
    act, _, cache = dtype_name.partition("_kv_")
    act_bytes = FLOAT32_BYTES if act == "f32" else 2
    cache_bytes = 1 if cache == "fp8" else act_bytes
    vec = DECODE_VEC_BYTES // act_bytes
    lanes_per_token = min(head_dim // vec, 32)
    tile_tokens = DECODE_TILE_STEPS * (32 // lanes_per_token) * DECODE_WARPS
    stage_bytes = 2 * tile_tokens * head_dim * cache_bytes
    num_stages = 1 + ceil_div(DECODE_IN_FLIGHT_BYTES, stage_bytes)
    return DecodeTiling(tile_tokens, stage_bytes, max(2, min(DECODE_MAX_STAGES, num_stages)))


def decode_smem_bytes(group: int, head_dim: int, dtype_name: str = "bf16") -> int:
    """Dynamic shared memory of a decode CTA: the cp.async stages, which the end of the kernel
    reuses for the per-warp accumulators plus (max, sum) pairs: the larger of the two."""
    tiling = decode_tiling(dtype_name, head_dim)
    merge_scratch = DECODE_WARPS * group * (head_dim + 2) * FLOAT32_BYTES
    return max(tiling.num_stages * tiling.stage_bytes, merge_scratch)


# Tensor-core decode (paged_attention_decode_tc_*): 16-bit q with a kv-head group instantiated
# at 4 or 8 scores on mma.m16n8k16 (the group's query heads as M rows) instead of fp32 FMAs;
# f32 q and groups 1-2 keep the CUDA-core kernels. Rows of K/V a warp owns per tile: 16 at
# head_dim 64, 8 above (the kernel's TcTiling WARP_TOKENS).
DECODE_TC_GROUPS = (4, 8)
DECODE_TC_ACTIVATIONS = ("f16", "bf16")


def decode_uses_tensor_cores(dtype_name: str, group: int) -> bool:
    """Whether paged_decode_attention launches the tensor-core kernel for this kernel dtype
    part ("bf16", "f16_kv_fp8", ...) and group instantiation."""
    return dtype_name.split("_kv_")[0] in DECODE_TC_ACTIVATIONS and group in DECODE_TC_GROUPS


def decode_tc_tiling(dtype_name: str, head_dim: int) -> DecodeTiling:
    """The tensor-core decode kernel's pipeline geometry (cuda/paged_attention_decode.cu
    TcTiling): kDecodeWarps x (16 rows at d64, 8 above) per tile, ring sized as decode_tiling."""
    act, _, cache = dtype_name.partition("_kv_")
    require(act in DECODE_TC_ACTIVATIONS,
            lambda: f"tensor-core decode has no {act} instantiation (16-bit q only)")
    cache_bytes = 1 if cache == "fp8" else 2
    tile_tokens = (16 if head_dim == 64 else 8) * DECODE_WARPS
    stage_bytes = 2 * tile_tokens * head_dim * cache_bytes
    num_stages = 1 + ceil_div(DECODE_IN_FLIGHT_BYTES, stage_bytes)
    return DecodeTiling(tile_tokens, stage_bytes, max(2, min(DECODE_MAX_STAGES, num_stages)))


def decode_tc_smem_bytes(group: int, head_dim: int, dtype_name: str = "bf16") -> int:
    """Dynamic shared memory of a tensor-core decode CTA: its stage ring, or the same merge
    scratch as decode_smem_bytes (the end of the kernel reuses the stages), the larger."""
    tiling = decode_tc_tiling(dtype_name, head_dim)
    merge_scratch = DECODE_WARPS * group * (head_dim + 2) * FLOAT32_BYTES
    return max(tiling.num_stages * tiling.stage_bytes, merge_scratch)


def prefill_smem_bytes(dtype_name: str, head_dim: int) -> int:
    """Dynamic shared memory of a prefill CTA: f32, one K and one V tile; f16/bf16, the Q tile
    plus one K/V stage (padded rows; below d256 the Q rows double as the second stage).
    Over DEFAULT_DYNAMIC_SMEM_LIMIT at d256: 65,536 (f32), 67,584 (f16/bf16) bytes. dtype_name
    is a kernel's dtype part ("bf16", "f32_kv_fp8", ...): an fp8 cache's tiles are widened to
    the activation dtype in shared memory, so they take the same bytes."""
    if dtype_name.split("_kv_")[0] == "f32":
        return 2 * PREFILL_BLOCK_N * head_dim * FLOAT32_BYTES
    return (PREFILL_BLOCK_M + 2 * PREFILL_BLOCK_N) * (head_dim + PREFILL_SMEM_PAD) * 2


def window_arg(sliding_window: int | None) -> np.int32:
    """The kernels' sliding_window scalar: 0 means none."""
    if sliding_window is None:
        return np.int32(0)
    require(isinstance(sliding_window, (int, np.integer)) and 0 < sliding_window < 2 ** 31,
            lambda: f"sliding_window must be a positive int32 or None, got {sliding_window!r}")
    return np.int32(sliding_window)


def _check_attention(q, k_cache, v_cache, block_tables) -> tuple[str, int, int, int]:
    """Returns (kernel dtype suffix, group_size, block_size_log2, head_dim); the suffix is q's
    dtype, plus "_kv_fp8" for uint8 fp8 e4m3 caches."""
    require(q.ndim == 3, lambda: f"q must be [tokens, num_heads, head_dim], got shape {q.shape}")
    require(k_cache.ndim == 4 and k_cache.shape == v_cache.shape,
            lambda: f"k_cache {k_cache.shape} / v_cache {v_cache.shape}: expected equal "
            "[num_blocks, block_size, num_kv_heads, head_dim]")
    suffix = cache_suffix(q, k_cache, v_cache)
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    require(head_dim in SUPPORTED_HEAD_DIMS,
            lambda: f"head_dim {head_dim} not supported (instantiated: {SUPPORTED_HEAD_DIMS})")
    require(cache_head_dim == head_dim, lambda: f"cache head_dim {cache_head_dim} != q head_dim "
                                                f"{head_dim}")
    require(block_size in SUPPORTED_BLOCK_SIZES,
            lambda: f"block_size {block_size} not supported (supported: {SUPPORTED_BLOCK_SIZES})")
    require(num_heads % num_kv_heads == 0,
            lambda: f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_contiguous(name, x)
    require_aligned(VEC16_BYTES, "the attention kernels read q and K/V rows by 16-byte loads "
                    "and cp.async", q=q, k_cache=k_cache, v_cache=v_cache)
    require_int32("block_tables", block_tables, 2)
    return suffix, num_heads // num_kv_heads, log2_exact(block_size, "block_size"), head_dim


def paged_decode_attention(module, q, k_cache, v_cache, block_tables, context_lens, scale: float,
                           out=None, *, max_context_len: int | None = None,
                           num_sms: int | None = None, split: DecodeSplitPlan | None = None,
                           sliding_window: int | None = None):
    """Decode attention of one query token per request; returns out [num_seqs, num_heads, head_dim].

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], q's dtype or uint8 fp8 e4m3 codes; block_tables: [num_seqs,
    max_blocks] int32; context_lens: [num_seqs] int32, each in [1, max_blocks * block_size].
    max_context_len: the largest context_lens entry, if the caller knows it (saves a device
    sync on GPU). split: force a plan (tests, benchmarks); default plan_decode_split, over at
    most sliding_window tokens per request (the splits walk the window only). f16 / bf16 q
    with 3-8 query heads per kv head runs the tensor-core kernel (decode_uses_tensor_cores).
    """
    suffix, group_size, block_size_log2, head_dim = _check_attention(q, k_cache, v_cache,
                                                                     block_tables)
    xp = array_module(q)
    num_seqs, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    require_int32("context_lens", context_lens, 1)
    require(context_lens.shape[0] == num_seqs and block_tables.shape[0] == num_seqs,
            lambda: f"context_lens {context_lens.shape} / block_tables {block_tables.shape} "
                    f"rows must "
            f"match q's {num_seqs} sequences")
    if out is None:
        out = xp.empty_like(q)
    require(out.shape == q.shape and out.dtype == q.dtype, "out must match q's shape and dtype")
    require_contiguous("out", out)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    require(max_context_len <= block_tables.shape[1] << block_size_log2,
            lambda: f"context of {max_context_len} tokens exceeds the block table's "
            f"{block_tables.shape[1]} blocks")
    window = window_arg(sliding_window)
    # Keys a query sees: the whole context, or its last sliding_window tokens.
    max_visible = min(max_context_len, int(window)) if window else max_context_len
    if split is None:
        split = plan_decode_split(num_seqs, num_kv_heads, max(max_visible, 1),
                                  num_sms or device_num_sms(xp))
    require(split.num_splits >= 1 and split.partition_size >= 1 and
            split.num_splits * split.partition_size >= max_visible,
            lambda: f"split {split} does not cover {max_visible} visible tokens")

    group = decode_group_instantiation(group_size)
    if decode_uses_tensor_cores(suffix, group):
        kernel = module.get_function(f"paged_attention_decode_tc_{suffix}_d{head_dim}_g{group}")
        smem = decode_tc_smem_bytes(group, head_dim, suffix)
    else:
        kernel = module.get_function(f"paged_attention_decode_{suffix}_d{head_dim}_g{group}")
        smem = decode_smem_bytes(group, head_dim, suffix)
    if split.num_splits > 1:
        partial_out = xp.empty((num_seqs, num_heads, split.num_splits, head_dim), dtype=np.float32)
        partial_lse = xp.empty((num_seqs, num_heads, split.num_splits), dtype=np.float32)
    else:
        # Unused by the kernel when num_splits == 1; an array, not None, because CuPy's
        # launcher takes arrays and numpy scalars only.
        partial_out = partial_lse = xp.empty((1,), dtype=np.float32)
    opt_in_smem(kernel, smem)
    kernel((num_kv_heads, num_seqs, split.num_splits), (DECODE_THREADS,),
           (out, partial_out, partial_lse, q, k_cache, v_cache, block_tables, context_lens,
            np.float32(scale), np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(group_size), np.int32(block_size_log2), np.int32(block_tables.shape[1]),
            np.int32(split.partition_size), np.int32(split.num_splits), window),
           shared_mem=smem)
    if split.num_splits > 1:
        # The merge reads fp32 partials and writes q's dtype: no cache type in its name.
        merge = module.get_function(f"paged_attention_decode_merge_{suffix.split('_kv_')[0]}")
        merge((num_heads, num_seqs), (MERGE_THREADS,),
              (out, partial_out, partial_lse, context_lens, np.int32(num_heads),
               np.int32(head_dim), np.int32(split.partition_size), np.int32(split.num_splits),
               window))
    return out


def paged_prefill_attention(module, q, k_cache, v_cache, block_tables, query_start_loc,
                            context_lens, scale: float, out=None, *,
                            max_query_len: int | None = None,
                            sliding_window: int | None = None):
    """Causal attention of a ragged batch of query chunks over paged K/V; returns out.

    q: [num_tokens, num_heads, head_dim]; query_start_loc: [num_reqs + 1] int32 (request r owns
    q rows query_start_loc[r]:query_start_loc[r + 1]); context_lens: [num_reqs] int32, KV length
    after this step's cache writes (>= the request's query length); block_tables:
    [num_reqs, max_blocks] int32. Rows past query_start_loc[num_reqs] come back zero (when out is
    allocated here) or untouched (a caller's out). max_query_len saves a device sync on GPU.
    sliding_window: a row at position p sees keys p - sliding_window < j <= p (None: 0 <= j).
    """
    suffix, group_size, block_size_log2, head_dim = _check_attention(q, k_cache, v_cache,
                                                                     block_tables)
    window = window_arg(sliding_window)
    xp = array_module(q)
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    require_int32("query_start_loc", query_start_loc, 1)
    require_int32("context_lens", context_lens, 1)
    num_reqs = context_lens.shape[0]
    require(query_start_loc.shape[0] == num_reqs + 1 and block_tables.shape[0] == num_reqs,
            lambda: f"query_start_loc {query_start_loc.shape} must be [num_reqs + 1] and "
                    f"block_tables "
            f"{block_tables.shape} [num_reqs, max_blocks] for {num_reqs} requests")
    if out is None:
        out = xp.zeros_like(q)
    require(out.shape == q.shape and out.dtype == q.dtype, "out must match q's shape and dtype")
    require_contiguous("out", out)
    if np.dtype(out.dtype) != np.float32:  # the tensor-core path stores __half2 / bf16 pairs
        require_aligned(2 * out.itemsize, "the prefill kernel stores output pairs", out=out)
    if num_reqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    kernel = module.get_function(f"paged_attention_prefill_{suffix}_d{head_dim}")
    smem = prefill_smem_bytes(suffix, head_dim)
    opt_in_smem(kernel, smem)
    num_row_tiles = ceil_div(max_query_len, PREFILL_BLOCK_M)
    kernel((num_row_tiles, num_reqs, num_heads), (PREFILL_THREADS,),
           (out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
            np.float32(scale), np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(group_size), np.int32(block_size_log2), np.int32(block_tables.shape[1]),
            window),
           shared_mem=smem)
    return out
