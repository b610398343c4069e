"""cuda/gemm.cu and cuda/gemm_skinny.cu (through runtime/kernels/gemm.py) against a float64
reference on the same rounded inputs: both kernels of the plan forced at awkward shapes (1, 17,
111, one 4096 K), both weight layouts the model uses, the fused bias / residual epilogue, fp32
logits from bf16 inputs, split-K; then the plan's own properties and the negative cases."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import (BACKEND, GEMM_ATOL_PER_K, OUT_NP, as_kernel_dtype, assert_close,
                                 gemm_case, gemm_tol, result_f32, to_device)
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.gemm import gemm, linear
from pagedrun.runtime.kernels.gemm_plan import (SKINNY, SKINNY_MAX_M, SKINNY_TC, TENSOR_CORE,
                                                plan_gemm, skinny_plan, skinny_tile_k,
                                                tensor_core_plan)
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.kernels.loader import load_module

DTYPES = ("f32", "f16", "bf16")
# Tolerance: paged_kernel_inputs.gemm_tol (atol grows with K, one rounding to the output).
SIM_NUM_SMS = 4

_MODULE = []


def module():
    if not _MODULE:
        _MODULE.append(load_module(["gemm.cu", "gemm_skinny.cu"], backend=BACKEND))
    return _MODULE[0]


def _run(dt, M, N, K, layout, plan, rng, with_bias=True, with_residual=True, out_f32=False,
         scale=1.0):
    """One GEMM on fresh inputs: (result as f32, float64 reference)."""
    case = gemm_case(rng, dt, M, N, K, with_bias=with_bias, with_residual=with_residual,
                     out_f32=out_f32, scale=scale)
    b = case.w if layout == "nk" else np.ascontiguousarray(case.w.T)
    out = gemm(module(), case.a, to_device(b), b_layout=layout, bias=case.bias,
               residual=case.residual, out_dtype=np.float32 if out_f32 else None, plan=plan,
               num_sms=SIM_NUM_SMS)
    assert out.dtype == OUT_NP[case.out_dt]
    return result_f32(out, case.out_dt), case.expected


TC_SHAPES = [(1, 17, 111), (17, 111, 64), (111, 17, 40), (130, 136, 96), (1, 24, 4096)]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("layout", ("nk", "kn"))
@pytest.mark.parametrize("M,N,K", TC_SHAPES)
def test_tensor_core_gemm(rng, dt, layout, M, N, K):
    plan = tensor_core_plan(M, N, K, dt, layout)
    actual, expected = _run(dt, M, N, K, layout, plan, rng)
    assert_close(actual, expected, gemm_tol(dt, K),
                 f"{dt} {layout} {M}x{N}x{K} aligned={plan.aligned}")


@pytest.mark.parametrize("dt", ("f16", "bf16"))
@pytest.mark.parametrize("layout", ("nk", "kn"))
def test_tensor_core_fp32_logits_no_epilogue(rng, dt, layout):
    M, N, K = 19, 200, 64
    actual, expected = _run(dt, M, N, K, layout, tensor_core_plan(M, N, K, dt, layout), rng,
                            with_bias=False, with_residual=False, out_f32=True)
    assert_close(actual, expected, gemm_tol("f32", K), f"{dt} -> f32 logits")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("M,N,K,num_splits", [(1, 17, 64, 1), (17, 111, 512, 3), (64, 17, 256, 1),
                                              (9, 40, 256, None), (1, 33, 4096, None)])
def test_skinny_gemm(rng, dt, M, N, K, num_splits):
    plan = skinny_plan(M, N, K, dt, SIM_NUM_SMS, num_splits=num_splits)
    if num_splits:  # whole k-tiles per split: 4 tiles in 3 splits become 2 of 2 tiles
        assert 1 <= plan.num_splits <= num_splits and (num_splits == 1) == (plan.num_splits == 1)
    actual, expected = _run(dt, M, N, K, "nk", plan, rng)
    assert_close(actual, expected, gemm_tol(dt, K), f"skinny {dt} {M}x{N}x{K} {plan}")


@pytest.mark.parametrize("dt", ("bf16",))
def test_skinny_fp32_out_split_and_large_magnitudes(rng, dt):
    M, N, K = 5, 48, 1024
    plan = skinny_plan(M, N, K, dt, SIM_NUM_SMS, num_splits=4)
    assert plan.num_splits == 4
    actual, expected = _run(dt, M, N, K, "nk", plan, rng, out_f32=True, scale=1e4)
    assert_close(actual, expected, dict(atol=1e4 * GEMM_ATOL_PER_K * K, rtol=2e-6), "skinny 1e4")


@pytest.mark.parametrize("dt", ("f32", "bf16"))
def test_linear_takes_the_models_transposed_weights(rng, dt):
    """llama.py passes `w_t.T` (a view of a contiguous [in, out] array): that runs as "kn";
    a contiguous HF [out, in] weight runs as "nk". Both equal numpy_ops.linear."""
    M, N, K = 17, 40, 64
    x, x_ref = as_kernel_dtype(rng.standard_normal((M, K)), dt)
    w, w_ref = as_kernel_dtype(rng.standard_normal((N, K)), dt)
    bias, bias_ref = as_kernel_dtype(rng.standard_normal(N), dt)
    expected = numpy_ops.linear(x_ref, w_ref, bias_ref)
    w_t = np.ascontiguousarray(w.T)
    for weight in (w, w_t.T):
        out = linear(module(), to_device(x), to_device(weight) if weight.flags.c_contiguous
                     else to_device(w_t).T, to_device(bias), num_sms=SIM_NUM_SMS)
        assert_close(result_f32(out, dt), expected, gemm_tol(dt, K), f"linear {dt}")


@pytest.mark.parametrize("dt", ("f32", "bf16"))
def test_row_views_off_a_16_byte_boundary(rng, dt):
    """a = rows 1.. of a matrix whose rows are 8 bytes long: not 16-byte aligned. The planned
    call falls back to element-wise loads; a forced skinny plan is refused, never misread."""
    M, N, K = 5, 24, 64
    full, full_ref = as_kernel_dtype(rng.standard_normal((M + 1, K)), dt)
    w, w_ref = as_kernel_dtype(rng.standard_normal((N, K)), dt)
    flat = np.concatenate([np.zeros(4 // full.itemsize, full.dtype), full.ravel()])
    # Views of a device copy (a host view sent to a GPU would be copied to aligned memory).
    a = to_device(flat)[4 // full.itemsize:].reshape(M + 1, K)[1:]  # 4 bytes past a row start
    w = to_device(w)
    address = a.data.ptr if BACKEND == "cuda" else a.ctypes.data
    assert a.flags.c_contiguous and address % 16 != 0
    out = gemm(module(), a, w, num_sms=SIM_NUM_SMS)
    expected = full_ref[1:].astype(np.float64) @ w_ref.astype(np.float64).T
    assert_close(result_f32(out, dt), expected, gemm_tol(dt, K), f"misaligned {dt}")
    with pytest.raises(UnsupportedKernelShape, match="16-byte boundary"):  # 16-byte loads
        gemm(module(), a, w, plan=skinny_plan(M, N, K, dt, SIM_NUM_SMS), num_sms=SIM_NUM_SMS)


def test_plan_picks_kernels():
    assert plan_gemm(1, 4096, 4096, dtype_name="bf16", b_layout="nk", num_sms=132).kind == SKINNY
    assert plan_gemm(SKINNY_MAX_M, 4096, 4096, dtype_name="bf16", b_layout="nk",
                     num_sms=132).kind == SKINNY_TC  # tensor cores from M = 8
    assert plan_gemm(SKINNY_MAX_M, 4096, 4096, dtype_name="f32", b_layout="nk",
                     num_sms=132).kind == SKINNY
    assert plan_gemm(SKINNY_MAX_M + 1, 4096, 4096, dtype_name="bf16", b_layout="nk",
                     num_sms=132).kind == TENSOR_CORE
    assert plan_gemm(1, 4096, 4096, dtype_name="bf16", b_layout="kn",
                     num_sms=132).kind == TENSOR_CORE
    unaligned = plan_gemm(1, 17, 111, dtype_name="bf16", b_layout="nk", num_sms=132)
    assert unaligned.kind == TENSOR_CORE and not unaligned.aligned
    assert not plan_gemm(100, 17, 64, dtype_name="bf16", b_layout="kn", num_sms=132).aligned


@pytest.mark.parametrize("M,N,K", [(1, 1024, 4096), (1, 128256, 4096), (32, 4096, 14336),
                                   (64, 17, 128), (1, 8, 7 * 256 + 8)])
@pytest.mark.parametrize("dt", DTYPES)
def test_skinny_plan_covers_k_and_fills_the_gpu(M, N, K, dt):
    num_sms = 132
    plan = skinny_plan(M, N, K, dt, num_sms)
    tile = skinny_tile_k(dt)
    assert plan.k_split % tile == 0 and plan.num_splits >= 1
    assert (plan.num_splits - 1) * plan.k_split < K <= plan.num_splits * plan.k_split
    if N >= 65536:
        assert plan.num_splits == 1  # the grid is already full
    if N == 1024:
        assert plan.num_splits > 1   # 16 CTAs alone would idle most of the GPU


def test_negative_cases(rng):
    a, _ = as_kernel_dtype(rng.standard_normal((4, 64)), "bf16")
    w, _ = as_kernel_dtype(rng.standard_normal((16, 64)), "bf16")
    mod = module()
    with pytest.raises(UnsupportedKernelShape, match="dtypes differ"):
        gemm(mod, a, w.astype(np.float16), num_sms=SIM_NUM_SMS)
    with pytest.raises(UnsupportedKernelShape, match="disagree on K"):
        gemm(mod, a, w[:, :32].copy(), num_sms=SIM_NUM_SMS)
    with pytest.raises(UnsupportedKernelShape, match="out_dtype"):
        gemm(mod, a, w, out_dtype=np.float16, num_sms=SIM_NUM_SMS)
    with pytest.raises(UnsupportedKernelShape, match="'nk' layout only"):
        gemm(mod, a, np.ascontiguousarray(w.T), b_layout="kn",
             plan=skinny_plan(4, 16, 64, "bf16", SIM_NUM_SMS), num_sms=SIM_NUM_SMS)
    with pytest.raises(UnsupportedKernelShape, match="dtype"):
        gemm(mod, a.astype(np.int32), w.astype(np.int32), num_sms=SIM_NUM_SMS)
    with pytest.raises(UnsupportedKernelShape, match="bias"):
        gemm(mod, a, w, bias=np.zeros(15, np.uint16), num_sms=SIM_NUM_SMS)
    with pytest.raises(UnsupportedKernelShape, match="contiguous"):
        gemm(mod, a[:, ::2], w[:, ::2], num_sms=SIM_NUM_SMS)
    with pytest.raises(UnsupportedKernelShape, match="no fp32-output"):
        b111 = as_kernel_dtype(rng.standard_normal((16, 111)), "bf16")[0]
        a111 = as_kernel_dtype(rng.standard_normal((4, 111)), "bf16")[0]
        gemm(mod, a111, b111, out_dtype=np.float32, num_sms=SIM_NUM_SMS)
