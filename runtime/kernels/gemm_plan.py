"""The host-side GEMM plan: which kernel runs a shape, and how it splits K (pure functions).

    plan = plan_gemm(M, N, K, dtype_name="bf16", b_layout="nk", num_sms=132)
    plan.kind                     # "skinny" (cuda/gemm_skinny.cu) or "tensor_core" (cuda/gemm.cu)

Decode steps multiply a few rows by whole weight matrices: memory-bound, so the skinny kernel
streams each weight byte once, split over K until the grid fills the GPU. Prefill steps have
enough rows to be compute-bound: the tensor-core tile kernel. The policy lives here only;
runtime/kernels/gemm.py executes a plan, tests and benchmarks may force one.
"""
from __future__ import annotations

from typing import NamedTuple

from .kernel_args import ceil_div

TENSOR_CORE = "tensor_core"
SKINNY = "skinny"
LAYOUTS = ("nk", "kn")

# Rows at or under which a GEMM counts as decode-sized (the skinny kernel's largest m-tile).
SKINNY_MAX_M = 64
# Skinny m-tiles (instantiations) and the weight rows each warp owns with them.
SKINNY_M_TILES = (8, 64)
SKINNY_ROWS_PER_WARP = {8: 4, 64: 1}
SKINNY_WARPS = 8
SKINNY_THREADS = 256
VEC_BYTES = 16
LANES = 32
# A memory-bound kernel needs many loads in flight: aim for this many CTAs per SM before
# splitting K stops paying.
SKINNY_TARGET_CTAS_PER_SM = 4
MAX_SPLITS = 16
# Each split streams at least this many k-tiles per weight row (else the partial sums and the
# reduce launch cost more than the parallelism buys).
MIN_TILES_PER_SPLIT = 2

# Tensor-core / SIMT tiles (cuda/gemm.cu kBM x kBN, and the fp32 test path's 64 x 64).
TC_THREADS = 256
TC_TILE = {"f16": (128, 128), "bf16": (128, 128), "f32": (64, 64)}
TC_STAGES = 3
TC_BK = 32
# 16-bit tiles move in 16-byte chunks: 8 elements.
TC_CHUNK_ELEMS = 8

ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


class GemmPlan(NamedTuple):
    kind: str             # TENSOR_CORE or SKINNY
    m_tile: int           # skinny m-tile (8 or 64); the tensor-core tile's rows otherwise
    num_splits: int       # skinny: grid.z (1: no reduce kernel); tensor core: 1
    k_split: int          # skinny: elements of K per split (a multiple of the k-tile); else K
    aligned: bool         # tensor core: 16-byte chunks never straddle the matrix edge


def skinny_tile_k(dtype_name: str) -> int:
    """K elements one warp consumes per step: 32 lanes x 16 bytes."""
    return LANES * VEC_BYTES // ELEM_BYTES[dtype_name]


def tc_aligned(N: int, K: int, b_layout: str) -> bool:
    return K % TC_CHUNK_ELEMS == 0 and (b_layout == "nk" or N % TC_CHUNK_ELEMS == 0)


def tensor_core_plan(M: int, N: int, K: int, dtype_name: str, b_layout: str) -> GemmPlan:
    return GemmPlan(TENSOR_CORE, TC_TILE[dtype_name][0], 1, K, tc_aligned(N, K, b_layout))


def skinny_plan(M: int, N: int, K: int, dtype_name: str, num_sms: int,
                num_splits: int | None = None) -> GemmPlan:
    """The skinny kernel's m-tile and K split for [M, K] x [N, K]^T (num_splits forces one)."""
    m_tile = SKINNY_M_TILES[0] if M <= SKINNY_M_TILES[0] else SKINNY_M_TILES[1]
    tile_k = skinny_tile_k(dtype_name)
    num_tiles = ceil_div(K, tile_k)
    if num_splits is None:
        rows_per_cta = SKINNY_WARPS * SKINNY_ROWS_PER_WARP[m_tile]
        num_ctas = ceil_div(N, rows_per_cta) * ceil_div(M, m_tile)
        wanted = ceil_div(SKINNY_TARGET_CTAS_PER_SM * num_sms, num_ctas)
        num_splits = max(1, min(wanted, MAX_SPLITS, num_tiles // MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(num_splits, num_tiles))
    k_split = ceil_div(num_tiles, num_splits) * tile_k
    return GemmPlan(SKINNY, m_tile, ceil_div(K, k_split), k_split, True)


def skinny_eligible(M: int, K: int, dtype_name: str, b_layout: str) -> bool:
    return (M <= SKINNY_MAX_M and b_layout == "nk"
            and K % (VEC_BYTES // ELEM_BYTES[dtype_name]) == 0)


def plan_gemm(M: int, N: int, K: int, *, dtype_name: str, b_layout: str,
              num_sms: int) -> GemmPlan:
    """Skinny for decode-sized M with a [N, K] weight and 16-byte-divisible K; tensor core
    (or its fp32 SIMT twin) otherwise."""
    if min(M, N, K) < 1 or num_sms < 1:
        raise ValueError(f"plan_gemm needs positive sizes, got M={M}, N={N}, K={K}, "
                         f"num_sms={num_sms}")
    if b_layout not in LAYOUTS:
        raise ValueError(f"b_layout must be one of {LAYOUTS}, got {b_layout!r}")
    if skinny_eligible(M, K, dtype_name, b_layout):
        return skinny_plan(M, N, K, dtype_name, num_sms)
    return tensor_core_plan(M, N, K, dtype_name, b_layout)
