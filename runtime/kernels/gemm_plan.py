"""The host-side GEMM plan: which kernel runs a shape, and how it splits K (pure functions).

    plan = plan_gemm(M, N, K, dtype_name="bf16", b_layout="nk", num_sms=132)
    plan.kind                     # "skinny" / "skinny_tc" (cuda/gemm_skinny.cu) or
                                  # "tensor_core" (cuda/gemm.cu)

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
SKINNY_TC = "skinny_tc"
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

# The tensor-core skinny kernel (gemm_skinny_tc_*): M from SKINNY_TC_MIN_M (one whole n8 tile)
# to SKINNY_MAX_M in 16-bit types; a CTA of 4 warps owns SKINNY_TC_BN weight rows and up to
# SKINNY_TC_BM activation rows, and streams k-tiles of SKINNY_TC_BK through SKINNY_TC_STAGES
# shared-memory stages (SKINNY_TC_STAGES - 1 in flight).
SKINNY_TC_MIN_M = 8
SKINNY_TC_THREADS = 128
SKINNY_TC_BN = 128
SKINNY_TC_BM = 64
SKINNY_TC_BK = 32
SKINNY_TC_STAGES = 4
# 4 x 48 KiB shared memory per SM (228 KiB, 1 KiB reserved per CTA); __launch_bounds__ keeps
# registers at <= 128 so 4 CTAs also fit the register file.
SKINNY_TC_CTAS_PER_SM = 4
SKINNY_TC_MAX_SPLITS = 32
# Each split streams at least this many k-tiles (a pipeline of 3 in flight needs a few to run).
SKINNY_TC_MIN_TILES_PER_SPLIT = 4
# Little's law on H200: 4.8 TB/s x ~700 ns / 132 SMs ~ 25 KiB an SM keeps in flight to draw
# its share of HBM bandwidth (scripts/kernel_report.py assumes the same).
IN_FLIGHT_BYTES_PER_SM = 25 * 1024
# fp32 partial sums of a split: written by the GEMM, read back by the reduce. A few MiB stay in
# the 50 MB L2 between the two, so the dirty lines reach HBM about once (assumed).
PARTIAL_HBM_PASSES = 1
F32_BYTES = 4

# Tensor-core / SIMT tiles (cuda/gemm.cu kBM x kBN, and the fp32 test path's 64 x 64).
TC_THREADS = 256
TC_TILE = {"f16": (128, 128), "bf16": (128, 128), "f32": (64, 64)}
TC_STAGES = 3
TC_BK = 64
# Split K only when the tile grid fills at most this fraction of the SMs: a grid nearly as
# large as the GPU gains less from more CTAs than the fp32 partials and the reduce cost.
TC_SPLIT_MAX_FILL = 0.5
# Each tensor-core split runs at least this many k-tiles (the 3-stage pipeline's prologue and
# the accumulators' epilogue are amortized over them).
TC_MIN_TILES_PER_SPLIT = 4
# 16-bit tiles move in 16-byte chunks: 8 elements.
TC_CHUNK_ELEMS = 8

ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


class GemmPlan(NamedTuple):
    kind: str             # TENSOR_CORE or SKINNY
    m_tile: int           # skinny m-tile (8 or 64); the tensor-core tile's rows otherwise
    num_splits: int       # grid.z (1: no reduce kernel; always 1 on the fp32 SIMT path)
    k_split: int          # elements of K per split (a multiple of the k-tile); K unsplit
    aligned: bool         # tensor core: 16-byte chunks never straddle the matrix edge


def skinny_tile_k(dtype_name: str) -> int:
    """K elements one warp consumes per step: 32 lanes x 16 bytes."""
    return LANES * VEC_BYTES // ELEM_BYTES[dtype_name]


def tc_aligned(N: int, K: int, b_layout: str) -> bool:
    return K % TC_CHUNK_ELEMS == 0 and (b_layout == "nk" or N % TC_CHUNK_ELEMS == 0)


def tensor_core_splits(M: int, N: int, K: int, num_sms: int) -> int:
    """Splits of K for the 128 x 128 tile grid: enough CTAs to reach ~num_sms when the tile
    grid alone fills at most TC_SPLIT_MAX_FILL of them, each split >= TC_MIN_TILES_PER_SPLIT
    k-tiles; 1 otherwise."""
    tile_m, tile_n = TC_TILE["bf16"]
    num_tiles = ceil_div(M, tile_m) * ceil_div(N, tile_n)
    if num_tiles > TC_SPLIT_MAX_FILL * num_sms:
        return 1
    return max(1, min(num_sms // num_tiles, MAX_SPLITS,
                      ceil_div(K, TC_BK) // TC_MIN_TILES_PER_SPLIT))


def tensor_core_plan(M: int, N: int, K: int, dtype_name: str, b_layout: str,
                     num_sms: int | None = None, num_splits: int | None = None) -> GemmPlan:
    """The tile kernel for [M, K] x B: aligned or element-wise loads, and a split of K (from
    num_sms, or forced by num_splits; no num_sms: unsplit). Splits exist for aligned 16-bit
    shapes only and cover whole k-tiles."""
    aligned = tc_aligned(N, K, b_layout)
    if num_splits is None:
        num_splits = 1 if num_sms is None else tensor_core_splits(M, N, K, num_sms)
    if dtype_name == "f32" or not aligned:
        num_splits = 1
    num_k_tiles = ceil_div(K, TC_BK)
    num_splits = max(1, min(num_splits, num_k_tiles))
    k_split = ceil_div(num_k_tiles, num_splits) * TC_BK if num_splits > 1 else K
    return GemmPlan(TENSOR_CORE, TC_TILE[dtype_name][0], ceil_div(K, k_split), k_split, aligned)


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


def skinny_tc_fill(num_ctas: int, num_sms: int, elem_bytes: int = 2) -> float:
    """Fraction of HBM bandwidth a grid of num_ctas tensor-core skinny CTAs can draw: the busy
    SMs' share times each busy SM's bytes in flight against Little's law's need."""
    busy_sms = min(num_ctas, num_sms)
    ctas_per_sm = min(SKINNY_TC_CTAS_PER_SM, num_ctas / busy_sms)
    in_flight = ctas_per_sm * (SKINNY_TC_STAGES - 1) * SKINNY_TC_BN * SKINNY_TC_BK * elem_bytes
    return busy_sms / num_sms * min(1.0, in_flight / IN_FLIGHT_BYTES_PER_SM)


def skinny_tc_plan(M: int, N: int, K: int, dtype_name: str, num_sms: int,
                   num_splits: int | None = None) -> GemmPlan:
    """The tensor-core skinny kernel's K split for [M, K] x [N, K]^T (num_splits forces one):
    the split count that minimises (weight bytes + partial-sum bytes) / bandwidth fill."""
    if dtype_name not in ("f16", "bf16"):
        raise ValueError(f"the tensor-core skinny kernel takes f16 / bf16, got {dtype_name}")
    elem_bytes = ELEM_BYTES[dtype_name]
    num_tiles = ceil_div(K, SKINNY_TC_BK)
    if num_splits is None:
        base_ctas = ceil_div(N, SKINNY_TC_BN) * ceil_div(M, SKINNY_TC_BM)
        weight_bytes = N * K * elem_bytes
        most = max(1, min(SKINNY_TC_MAX_SPLITS, num_tiles // SKINNY_TC_MIN_TILES_PER_SPLIT))

        def cost(splits: int) -> float:
            partial_bytes = 0 if splits == 1 else PARTIAL_HBM_PASSES * splits * M * N * F32_BYTES
            return (weight_bytes + partial_bytes) / skinny_tc_fill(base_ctas * splits, num_sms,
                                                                   elem_bytes)

        num_splits = min(range(1, most + 1), key=cost)  # ties: the fewest splits
    num_splits = max(1, min(num_splits, num_tiles))
    k_split = ceil_div(num_tiles, num_splits) * SKINNY_TC_BK
    return GemmPlan(SKINNY_TC, SKINNY_TC_BM, ceil_div(K, k_split), k_split, True)


def skinny_eligible(M: int, K: int, dtype_name: str, b_layout: str) -> bool:
    return (M <= SKINNY_MAX_M and b_layout == "nk"
            and K % (VEC_BYTES // ELEM_BYTES[dtype_name]) == 0)


def plan_gemm(M: int, N: int, K: int, *, dtype_name: str, b_layout: str,
              num_sms: int) -> GemmPlan:
    """Skinny for decode-sized M with a [N, K] weight and 16-byte-divisible K (on tensor cores
    from M = 8 in 16-bit types, CUDA cores below and for fp32); tensor core (or its fp32 SIMT
    twin) otherwise."""
    if min(M, N, K) < 1 or num_sms < 1:
        raise ValueError(f"plan_gemm needs positive sizes, got M={M}, N={N}, K={K}, "
                         f"num_sms={num_sms}")
    if b_layout not in LAYOUTS:
        raise ValueError(f"b_layout must be one of {LAYOUTS}, got {b_layout!r}")
    if skinny_eligible(M, K, dtype_name, b_layout):
        if M >= SKINNY_TC_MIN_M and dtype_name != "f32":
            return skinny_tc_plan(M, N, K, dtype_name, num_sms)
        return skinny_plan(M, N, K, dtype_name, num_sms)
    return tensor_core_plan(M, N, K, dtype_name, b_layout, num_sms=num_sms)
