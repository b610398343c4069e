"""Launch wrappers of cuda/moe.cu: routing, permutation by expert, the grouped expert GEMMs.

    module = load_module("moe.cu", backend="sim")                    # or "cuda"
    topk_ids, topk_weights = moe_route(module, router_logits, top_k, renormalize)
    perm = moe_permute(module, topk_ids, num_experts)                # MoePermutation
    y = moe_experts(module, x, topk_ids, topk_weights, w_gate_up, w_down)

The backend-op contract (shapes, tie rule, renormalisation) is the Backend protocol's
(runtime/backends/base.py); numpy_ops holds the reference. Pairs p = t * top_k + k are sorted
stably by expert (then p), so every result is deterministic. x, w_gate_up [E, 2I, H] and
w_down [E, H, I] share one dtype (float32, float16 or uint16 bf16 bits); y comes back in it.
Arrays are numpy under the CPU harness and cupy on a GPU; unsupported inputs raise
UnsupportedKernelShape before anything runs.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .kernel_args import (VEC16_BYTES, array_module, ceil_div, dtype_suffix, require,
                          require_aligned, require_contiguous, require_int32)

ROUTE_THREADS = 128
ROUTE_ROWS_PER_CTA = ROUTE_THREADS // 32   # one token row per warp
PERMUTE_THREADS = 256
GEMM_THREADS = 128
GEMM_TILE_ROWS = 64       # slots per grouped-GEMM tile (moe.cu kBM)
GEMM_TILE_COLS = 64       # B-tile rows (moe.cu kBN): down output columns per CTA
GATE_UP_COLS = GEMM_TILE_COLS // 2   # gate-up: intermediate columns per CTA (gate + up rows)
GEMM_BK = 32
GEMM_STAGES = 3
REDUCE_THREADS = 256
VEC16_ELEMS = 8           # 16-bit elements per 16-byte cp.async chunk


class MoePermutation(NamedTuple):
    """Device arrays of moe_scatter (layouts: cuda/moe.cu's header)."""

    sorted_pair_ids: object  # [P] int32, slot -> pair
    pair_slots: object       # [P] int32, pair -> slot
    expert_offsets: object   # [E + 1] int32
    tile_experts: object     # [max_tiles] int32, -1 past the last tile
    tile_rows: object        # [max_tiles] int32, first slot of each tile
    max_tiles: int


def max_gemm_tiles(num_pairs: int, num_experts: int) -> int:
    """Upper bound of sum_e ceil(count_e / 64): every expert's partial tile at most once."""
    return ceil_div(num_pairs, GEMM_TILE_ROWS) + min(num_experts, num_pairs)


def grouped_gemm_smem_bytes(dtype_name: str) -> int:
    """Dynamic shared memory of a grouped-GEMM CTA (the fp32 path uses static memory)."""
    if dtype_name == "f32":
        return 0
    return GEMM_STAGES * (GEMM_TILE_ROWS + GEMM_TILE_COLS) * GEMM_BK * 2


def moe_route(module, router_logits, top_k: int, renormalize: bool, *, out_ids=None,
              out_weights=None):
    """router_logits [T, E] float32 -> (topk_ids [T, top_k] int32, topk_weights [T, top_k]
    float32): softmax, top_k by decreasing probability (ties: lower id), renormalised to sum 1
    when asked."""
    require(router_logits.ndim == 2 and np.dtype(router_logits.dtype) == np.float32,
            lambda: f"router_logits must be [num_tokens, num_experts] float32, got "
            f"{router_logits.shape} {router_logits.dtype}")
    require_contiguous("router_logits", router_logits)
    num_tokens, num_experts = router_logits.shape
    require(1 <= top_k <= num_experts, lambda: f"top_k {top_k} must be in [1, {num_experts}]")
    xp = array_module(router_logits)
    ids = xp.empty((num_tokens, top_k), np.int32) if out_ids is None else out_ids
    weights = xp.empty((num_tokens, top_k), np.float32) if out_weights is None else out_weights
    require(ids.shape == (num_tokens, top_k) and np.dtype(ids.dtype) == np.int32,
            "out_ids must be [num_tokens, top_k] int32")
    require(weights.shape == (num_tokens, top_k) and np.dtype(weights.dtype) == np.float32,
            "out_weights must be [num_tokens, top_k] float32")
    if num_tokens:
        module.get_function("moe_route_f32")(
            (ceil_div(num_tokens, ROUTE_ROWS_PER_CTA),), (ROUTE_THREADS,),
            (ids, weights, router_logits, np.int32(num_tokens), np.int32(num_experts),
             np.int32(top_k), np.int32(bool(renormalize))),
            shared_mem=ROUTE_ROWS_PER_CTA * num_experts * 4)
    return ids, weights


def moe_permute(module, topk_ids, num_experts: int) -> MoePermutation:
    """Pairs sorted by expert (stable), their inverse, the expert offsets and the tile table."""
    require_int32("topk_ids", topk_ids, 2)
    require(num_experts >= 1, lambda: f"num_experts must be >= 1, got {num_experts}")
    if isinstance(topk_ids, np.ndarray) and topk_ids.size:
        # A device array is trusted (moe_route writes ids in range); host ids are checked.
        require(int(topk_ids.min()) >= 0 and int(topk_ids.max()) < num_experts,
                lambda: f"topk_ids must be in [0, {num_experts})")
    xp = array_module(topk_ids)
    num_pairs = int(topk_ids.size)
    max_tiles = max_gemm_tiles(num_pairs, num_experts)
    counts = xp.empty(num_experts, np.int32)
    sorted_pair_ids = xp.empty(max(num_pairs, 1), np.int32)
    pair_slots = xp.empty(max(num_pairs, 1), np.int32)
    offsets = xp.empty(num_experts + 1, np.int32)
    tile_experts = xp.empty(max(max_tiles, 1), np.int32)
    tile_rows = xp.empty(max(max_tiles, 1), np.int32)
    module.get_function("moe_count_experts")((num_experts,), (PERMUTE_THREADS,),
                                             (counts, topk_ids, np.int32(num_pairs)))
    module.get_function("moe_scatter")(
        (num_experts,), (PERMUTE_THREADS,),
        (sorted_pair_ids, pair_slots, offsets, tile_experts, tile_rows, topk_ids, counts,
         np.int32(num_pairs), np.int32(num_experts), np.int32(max_tiles)))
    return MoePermutation(sorted_pair_ids[:num_pairs], pair_slots[:num_pairs], offsets,
                          tile_experts[:max_tiles], tile_rows[:max_tiles], max_tiles)


def moe_experts(module, x, topk_ids, topk_weights, w_gate_up, w_down, out=None):
    """y[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = topk_ids[t, k].

    x [T, H]; topk_ids [T, K] int32; topk_weights [T, K] float32; w_gate_up [E, 2I, H];
    w_down [E, H, I]. Returns y [T, H] in x's dtype."""
    suffix = dtype_suffix(x)
    require(x.ndim == 2, lambda: f"x must be [num_tokens, hidden], got {x.shape}")
    num_tokens, hidden = x.shape
    require(w_gate_up.ndim == 3 and w_gate_up.shape[1] % 2 == 0 and w_gate_up.shape[2] == hidden,
            lambda: f"w_gate_up must be [E, 2I, {hidden}], got {w_gate_up.shape}")
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    require(w_down.shape == (num_experts, hidden, inter),
            lambda: f"w_down must be [{num_experts}, {hidden}, {inter}], got {w_down.shape}")
    for name, arr in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        require(arr.dtype == x.dtype, lambda: f"{name} ({arr.dtype}) and x ({x.dtype}) dtypes "
                                              f"differ")
        require_contiguous(name, arr)
    require_contiguous("x", x)
    require_int32("topk_ids", topk_ids, 2)
    require(topk_ids.shape[0] == num_tokens, lambda: f"topk_ids {topk_ids.shape} vs x {x.shape}")
    top_k = topk_ids.shape[1]
    require(topk_weights.shape == topk_ids.shape and np.dtype(topk_weights.dtype) == np.float32,
            lambda: f"topk_weights must be {topk_ids.shape} float32, got {topk_weights.shape} "
            f"{topk_weights.dtype}")
    require_contiguous("topk_weights", topk_weights)
    require(inter >= 1 and hidden >= 1, "empty expert matrices")
    if suffix != "f32":
        require(hidden % VEC16_ELEMS == 0 and inter % VEC16_ELEMS == 0,
                lambda: f"the tensor-core grouped GEMM needs hidden and intermediate % "
                        f"{VEC16_ELEMS} "
                f"== 0, got {hidden} and {inter}")
        require_aligned(VEC16_BYTES, "the tensor-core grouped GEMM reads them by 16-byte "
                        "cp.async", x=x, w_gate_up=w_gate_up, w_down=w_down)
    xp = array_module(x)
    out = xp.empty((num_tokens, hidden), x.dtype) if out is None else out
    require(out.shape == (num_tokens, hidden) and out.dtype == x.dtype,
            "out must be [num_tokens, hidden] in x's dtype")
    require_contiguous("out", out)
    if num_tokens == 0 or top_k == 0:
        if num_tokens:
            out[...] = 0
        return out
    perm = moe_permute(module, topk_ids, num_experts)
    num_pairs = num_tokens * top_k
    smem = grouped_gemm_smem_bytes(suffix)
    tables = (perm.expert_offsets, perm.tile_experts, perm.tile_rows)
    act = xp.empty((num_pairs, inter), x.dtype)
    module.get_function(f"moe_gate_up_{suffix}")(
        (ceil_div(inter, GATE_UP_COLS), perm.max_tiles), (GEMM_THREADS,),
        (act, x, w_gate_up, perm.sorted_pair_ids, *tables, np.int32(top_k), np.int32(inter),
         np.int32(hidden)), shared_mem=smem)
    down_out = xp.empty((num_pairs, hidden), np.float32)
    module.get_function(f"moe_down_{suffix}")(
        (ceil_div(hidden, GEMM_TILE_COLS), perm.max_tiles), (GEMM_THREADS,),
        (down_out, act, w_down, *tables, np.int32(hidden), np.int32(inter)), shared_mem=smem)
    module.get_function(f"moe_unpermute_reduce_{suffix}")(
        (num_tokens, ceil_div(hidden, REDUCE_THREADS)), (REDUCE_THREADS,),
        (out, down_out, topk_weights, perm.pair_slots, np.int32(top_k), np.int32(hidden)))
    return out


__all__ = ["MoePermutation", "grouped_gemm_smem_bytes", "max_gemm_tiles", "moe_experts",
           "moe_permute", "moe_route"]
