"""The tensor-core skinny GEMM (gemm_skinny_tc_* in cuda/gemm_skinny.cu, through
runtime/kernels/gemm.py) against a float64 reference on the same rounded inputs: M across the
n8 / 16-row group edges (1, 7, 8, 9, 17, 33, 64, and 70: two m-tiles), N off the 128-row CTA
tile, K off the 32-element k-tile, split-K on and off, bias / residual / residual aliasing out,
fp32 logits; every output slot starts as NaN so an unwritten one fails. Then the plan: which
kernel plan_gemm picks, and that its split covers K and fills the GPU."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import BACKEND, check_gemm, gemm_case, nan_output, to_device
from pagedrun.runtime.kernels.gemm import gemm
from pagedrun.runtime.kernels.gemm_plan import (SKINNY, SKINNY_TC, SKINNY_TC_BK, SKINNY_TC_MIN_M,
                                                TENSOR_CORE, plan_gemm, skinny_tc_fill,
                                                skinny_tc_plan)
from pagedrun.runtime.kernels.loader import load_module

SIM_NUM_SMS = 4

_MODULE = []


def module():
    if not _MODULE:
        _MODULE.append(load_module(["gemm.cu", "gemm_skinny.cu"], backend=BACKEND))
    return _MODULE[0]


def _run(rng, dt, M, N, K, num_splits, *, bias=True, residual=True, alias=False,
         out_f32=False):
    case = gemm_case(rng, dt, M, N, K, with_bias=bias, with_residual=residual, out_f32=out_f32)
    out = case.residual if alias else nan_output((M, N), case.out_dt)
    plan = skinny_tc_plan(M, N, K, dt, SIM_NUM_SMS, num_splits=num_splits)
    result = gemm(module(), case.a, to_device(case.w), bias=case.bias, residual=case.residual,
                  out=out, out_dtype=np.float32 if out_f32 else None, plan=plan,
                  num_sms=SIM_NUM_SMS)
    assert result is out
    check_gemm(result, case, K,
               f"skinny_tc {dt} {M}x{N}x{K} {plan} bias={bias} residual={residual} alias={alias}")
    return plan


# (M, N, K, num_splits): K = 200 is 6.25 k-tiles, 40 is 1.25; splits forced to 1 and to 3.
@pytest.mark.parametrize("M,N,K,num_splits", [
    (8, 111, 200, 1), (9, 200, 200, 3), (17, 111, 264, None), (33, 200, 40, 1),
    (64, 111, 200, 3), (7, 130, 96, 2), (1, 17, 72, 1), (70, 40, 104, 2)])
@pytest.mark.parametrize("dt", ("f16", "bf16"))
def test_skinny_tc_matches_reference(rng, dt, M, N, K, num_splits):
    plan = _run(rng, dt, M, N, K, num_splits)
    assert plan.kind == SKINNY_TC
    if num_splits:
        assert plan.num_splits == min(num_splits, -(-K // SKINNY_TC_BK))


@pytest.mark.parametrize("num_splits", (1, 4))
def test_skinny_tc_epilogue_variants(rng, num_splits):
    """fp32 logits from bf16; no epilogue; residual only, aliasing out (read before write)."""
    _run(rng, "bf16", 33, 200, 264, num_splits, out_f32=True)
    _run(rng, "f16", 17, 111, 136, num_splits, bias=False, residual=False)
    _run(rng, "bf16", 64, 111, 200, num_splits, bias=False, alias=True)
    _run(rng, "bf16", 9, 40, 72, num_splits, alias=True, out_f32=True)


def test_plan_picks_tensor_cores_from_m8():
    kw = dict(b_layout="nk", num_sms=132)
    assert plan_gemm(SKINNY_TC_MIN_M - 1, 4096, 4096, dtype_name="bf16", **kw).kind == SKINNY
    for M in (SKINNY_TC_MIN_M, 17, 64):
        for dt in ("f16", "bf16"):
            assert plan_gemm(M, 4096, 4096, dtype_name=dt, **kw).kind == SKINNY_TC
    assert plan_gemm(64, 4096, 4096, dtype_name="f32", **kw).kind == SKINNY
    assert plan_gemm(65, 4096, 4096, dtype_name="bf16", **kw).kind == TENSOR_CORE
    assert plan_gemm(16, 4096, 4096, dtype_name="bf16", b_layout="kn",
                     num_sms=132).kind == TENSOR_CORE
    with pytest.raises(ValueError, match="f16 / bf16"):
        skinny_tc_plan(16, 64, 64, "f32", 132)


@pytest.mark.parametrize("M,N,K", [(8, 1024, 4096), (64, 4096, 4096), (16, 6144, 4096),
                                   (32, 4096, 14336), (64, 128256, 4096), (9, 24, 40)])
def test_skinny_tc_plan_covers_k_and_fills_the_gpu(M, N, K):
    num_sms = 132
    plan = skinny_tc_plan(M, N, K, "bf16", num_sms)
    assert plan.kind == SKINNY_TC and plan.k_split % SKINNY_TC_BK == 0
    assert (plan.num_splits - 1) * plan.k_split < K <= plan.num_splits * plan.k_split
    ctas = -(-N // 128) * -(-M // 64) * plan.num_splits
    if N >= 28672:
        assert plan.num_splits == 1  # the grid is already full: partial sums only cost
    elif K >= 4096:
        assert plan.num_splits > 1 and skinny_tc_fill(ctas, num_sms) > 0.9
