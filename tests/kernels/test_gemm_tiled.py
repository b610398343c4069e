"""cuda/gemm.cu's tiled tensor-core GEMM (through runtime/kernels/gemm.py) against a float64
reference on the same rounded inputs, at sizes that straddle every tile edge: M 1 .. 257 and
N 111 .. 200 against the 128 x 128 tile, K 8 .. 264 against the 64-deep k-tile (K = 8: one
partial tile; 72, 136, 264: a partial last tile), both weight layouts, f16 and bf16, the fused
bias / residual epilogue (residual aliasing out), split-K forced on and off and picked by the
plan, and a grid taller than one rasterization group. test_gemm.py keeps the shared contract
cases (fp32 SIMT, fp32 logits, unaligned K, misaligned views)."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import BACKEND, check_gemm, gemm_case, to_device
from pagedrun.runtime.kernels.gemm import gemm
from pagedrun.runtime.kernels.gemm_plan import (MAX_SPLITS, TC_BK, TC_MIN_TILES_PER_SPLIT,
                                                TENSOR_CORE, plan_gemm, tensor_core_plan)
from pagedrun.runtime.kernels.loader import load_module

# The rasterization groups this many m-tiles (cuda/gemm.cu kGroupM); a taller grid has a
# partial last group.
RASTER_GROUP_M = 8
TILE = 128

_MODULE = []


def module():
    if not _MODULE:
        _MODULE.append(load_module(["gemm.cu", "gemm_skinny.cu"], backend=BACKEND))
    return _MODULE[0]


def _run(rng, dt, layout, M, N, K, what, *, plan=None, num_sms=4, out_f32=False, alias=False,
         with_bias=True, with_residual=True):
    """One GEMM on fresh inputs, checked against the float64 reference."""
    case = gemm_case(rng, dt, M, N, K, with_bias=with_bias, with_residual=with_residual,
                     out_f32=out_f32)
    b = case.w if layout == "nk" else np.ascontiguousarray(case.w.T)
    out = case.residual if alias else None  # out = residual + a @ B in place (residual stream)
    result = gemm(module(), case.a, to_device(b), b_layout=layout, bias=case.bias,
                  residual=case.residual, out=out, out_dtype=np.float32 if out_f32 else None,
                  plan=plan, num_sms=num_sms)
    assert out is None or result is out
    check_gemm(result, case, K, what)


# (M, N, K): every M, N and K of the brief at least once, each against both layouts.
TILED_SHAPES = [(1, 136, 72), (17, 111, 264), (111, 200, 136), (130, 136, 8), (257, 200, 264),
                (130, 111, 72)]


@pytest.mark.parametrize("dt", ("f16", "bf16"))
@pytest.mark.parametrize("layout", ("nk", "kn"))
@pytest.mark.parametrize("M,N,K", TILED_SHAPES)
def test_tiled_gemm_unsplit(rng, dt, layout, M, N, K):
    plan = tensor_core_plan(M, N, K, dt, layout, num_splits=1)
    assert plan.num_splits == 1 and plan.k_split == K
    _run(rng, dt, layout, M, N, K, f"{dt} {layout} {M}x{N}x{K} aligned={plan.aligned}",
         plan=plan, alias=(M == 130))


@pytest.mark.parametrize("dt,layout,M,N,K,num_splits,alias,out_f32", [
    ("bf16", "nk", 17, 136, 264, 3, False, False),   # splits of 128, 128, 8
    ("f16", "kn", 130, 200, 136, 2, True, False),    # 128 + 8, residual aliasing out
    ("bf16", "kn", 257, 136, 264, 4, False, True),   # 4 asked, 3 of 2 tiles; fp32 logits
    ("f16", "nk", 1, 200, 72, 2, False, False),      # one full tile + 8
])
def test_tiled_gemm_split_k(rng, dt, layout, M, N, K, num_splits, alias, out_f32):
    plan = tensor_core_plan(M, N, K, dt, layout, num_splits=num_splits)
    assert plan.aligned and 1 < plan.num_splits <= num_splits
    assert plan.k_split % TC_BK == 0 and (plan.num_splits - 1) * plan.k_split < K
    _run(rng, dt, layout, M, N, K, f"split {dt} {layout} {M}x{N}x{K} {plan}", plan=plan,
         alias=alias, out_f32=out_f32, with_bias=not out_f32)


def test_planned_split_k_end_to_end(rng):
    """No forced plan: 2 tiles on 16 SMs with 8 k-tiles split in two (kn: never skinny)."""
    M, N, K, num_sms = 111, 136, 8 * TC_BK, 16
    plan = plan_gemm(M, N, K, dtype_name="bf16", b_layout="kn", num_sms=num_sms)
    assert plan.kind == TENSOR_CORE and plan.num_splits == 2
    _run(rng, "bf16", "kn", M, N, K, "planned split", num_sms=num_sms)


def test_rasterization_covers_a_grid_taller_than_one_group(rng):
    """10 x 2 tiles: one full group of 8 m-tiles and a partial one of 2."""
    M, N, K = (RASTER_GROUP_M + 1) * TILE + 1, 136, 8
    plan = tensor_core_plan(M, N, K, "f16", "nk", num_splits=1)
    _run(rng, "f16", "nk", M, N, K, f"raster {M}x{N}x{K}", plan=plan, with_residual=False)


def test_split_plan_follows_the_sm_count():
    # 4 tiles on 132 SMs, 64 k-tiles: as many splits as allowed.
    assert tensor_core_plan(130, 136, 4096, "bf16", "nk", num_sms=132).num_splits == MAX_SPLITS
    # A grid that fills half the SMs or more: unsplit.
    assert tensor_core_plan(1024, 4096, 4096, "bf16", "nk", num_sms=132).num_splits == 1
    assert tensor_core_plan(1024, 2048, 4096, "bf16", "nk", num_sms=132).num_splits == 1
    # 64 tiles, just under half the SMs: 2 splits make 128 CTAs.
    assert tensor_core_plan(1024, 1024, 4096, "bf16", "nk", num_sms=132).num_splits == 2
    # 32 tiles: 132 // 32 = 4 splits of 16 k-tiles.
    plan = tensor_core_plan(128, 4096, 4096, "bf16", "nk", num_sms=132)
    assert (plan.num_splits, plan.k_split) == (4, 1024)
    # Short K: each split keeps TC_MIN_TILES_PER_SPLIT k-tiles.
    short = tensor_core_plan(130, 136, 3 * TC_MIN_TILES_PER_SPLIT * TC_BK, "bf16", "kn",
                             num_sms=132)
    assert short.num_splits == 3
    # Unaligned shapes and the fp32 SIMT path never split; no num_sms: unsplit.
    assert tensor_core_plan(130, 136, 4100, "bf16", "nk", num_sms=132).num_splits == 1
    assert tensor_core_plan(130, 136, 4096, "f32", "nk", num_sms=132).num_splits == 1
    assert tensor_core_plan(130, 136, 4096, "bf16", "nk").num_splits == 1
