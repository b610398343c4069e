"""cuda/rms_norm.cu, cuda/activation.cu, cuda/embedding.cu (through runtime/kernels/fused_ops.py)
against runtime/backends/numpy_ops.py on the same rounded inputs: awkward row counts and widths,
large magnitudes, the float32 residual stream updated in place, negative cases."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import (DTYPES, as_kernel_dtype, assert_close, kernel_module, result_f32,
                                 to_device, to_host)
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.fused_ops import (embedding, fused_add_rms_norm, rms_norm,
                                                silu_and_mul)
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

# fp32 math in both; the kernel's sum order differs from numpy's pairwise mean, and every
# 16-bit output is rounded once (half an ulp relative, plus a flipped last bit).
FUSED_TOL = {"f32": dict(atol=1e-6, rtol=1e-5),
             "f16": dict(atol=1e-5, rtol=1.5e-3),
             "bf16": dict(atol=1e-5, rtol=1.2e-2)}
EPS = 1e-5


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 17), (17, 111), (3, 4096), (111, 64)])
@pytest.mark.parametrize("scale", (1.0, 3e3))
def test_rms_norm(rng, dt, num_tokens, hidden, scale):
    x, x_ref = as_kernel_dtype(scale * rng.standard_normal((num_tokens, hidden)), dt)
    w, w_ref = as_kernel_dtype(1 + 0.2 * rng.standard_normal(hidden), dt)
    out = rms_norm(kernel_module("rms_norm.cu"), to_device(x), to_device(w), EPS)
    assert_close(result_f32(out, dt), numpy_ops.rms_norm(x_ref, w_ref, EPS), FUSED_TOL[dt],
                 f"rms_norm {dt}")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 17), (17, 111), (2, 4096)])
@pytest.mark.parametrize("scale", (1.0, 3e3))
def test_fused_add_rms_norm_updates_residual_in_place(rng, dt, num_tokens, hidden, scale):
    x, x_ref = as_kernel_dtype(scale * rng.standard_normal((num_tokens, hidden)), dt)
    residual = (scale * rng.standard_normal((num_tokens, hidden))).astype(np.float32)
    w, w_ref = as_kernel_dtype(1 + 0.2 * rng.standard_normal(hidden), dt)
    exp_out, exp_res = numpy_ops.fused_add_rms_norm(x_ref, residual, w_ref, EPS)
    res_dev = to_device(residual.copy())
    out, new_res = fused_add_rms_norm(kernel_module("rms_norm.cu"), to_device(x), res_dev,
                                      to_device(w), EPS)
    assert new_res is res_dev  # float32 residual: updated in place, no copy
    assert_close(to_host(new_res), exp_res, FUSED_TOL["f32"], "new residual")
    assert_close(result_f32(out, dt), exp_out, FUSED_TOL[dt], f"fused_add_rms_norm {dt}")
    # Out of place: the input residual is left alone, the sum goes to residual_out.
    res_in = to_device(residual.copy())
    res_out = to_device(np.full_like(residual, np.nan))
    out2, new_res2 = fused_add_rms_norm(kernel_module("rms_norm.cu"), to_device(x), res_in,
                                        to_device(w), EPS, residual_out=res_out)
    assert new_res2 is res_out
    np.testing.assert_array_equal(to_host(res_in), residual)
    np.testing.assert_array_equal(to_host(new_res2), to_host(new_res))
    np.testing.assert_array_equal(result_f32(out2, dt), result_f32(out, dt))


@pytest.mark.parametrize("dt", ("f32", "bf16"))
def test_fused_add_rms_norm_converts_an_activation_residual(rng, dt):
    """Layer 0's residual is the embedding output, in the activation dtype."""
    x, x_ref = as_kernel_dtype(rng.standard_normal((5, 64)), dt)
    r, r_ref = as_kernel_dtype(rng.standard_normal((5, 64)), dt)
    w, w_ref = as_kernel_dtype(np.ones(64), dt)
    exp_out, exp_res = numpy_ops.fused_add_rms_norm(x_ref, r_ref, w_ref, EPS)
    r_before = r.copy()
    out, new_res = fused_add_rms_norm(kernel_module("rms_norm.cu"), to_device(x), to_device(r),
                                      to_device(w), EPS)
    assert new_res.dtype == np.float32
    assert_close(to_host(new_res), exp_res, FUSED_TOL["f32"], "residual")
    assert_close(result_f32(out, dt), exp_out, FUSED_TOL[dt], "out")
    if dt == "bf16":
        np.testing.assert_array_equal(r, r_before)  # the caller's bf16 array is left alone


@pytest.mark.parametrize("dt", DTYPES)
# 264, 2056: 16-byte units (V = 8 / 4) with a partial last CTA; 700: units only for f32.
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 17), (17, 111), (4, 700), (3, 264),
                                                     (2, 2056)])
def test_silu_and_mul(rng, dt, num_tokens, intermediate):
    gate_up = 4 * rng.standard_normal((num_tokens, 2 * intermediate))
    gate_up[0, :3] = (-200.0, 200.0, 0.0)  # saturated sigmoid at both ends, and zero
    g, g_ref = as_kernel_dtype(gate_up, dt)
    out = silu_and_mul(kernel_module("activation.cu"), to_device(g))
    assert_close(result_f32(out, dt), numpy_ops.silu_and_mul(g_ref), FUSED_TOL[dt], f"silu {dt}")
    # The same values 2 elements past a 16-byte boundary: the element-wise kernel, same result.
    flat = to_device(np.concatenate([g.reshape(-1)[:2], g.reshape(-1)]))
    shifted = silu_and_mul(kernel_module("activation.cu"), flat[2:].reshape(g.shape))
    np.testing.assert_array_equal(result_f32(shifted, dt), result_f32(out, dt))


@pytest.mark.parametrize("dt", DTYPES)
# hidden 64, 2056: 16-byte units for every dtype (2056: a partial last pass of the CTA); 17:
# element-wise; 36: units for f32 only.
@pytest.mark.parametrize("num_tokens,vocab,hidden", [(1, 17, 64), (111, 389, 17), (5, 33, 2056),
                                                     (3, 9, 36)])
def test_embedding_is_an_exact_gather(rng, dt, num_tokens, vocab, hidden):
    table, table_ref = as_kernel_dtype(1e3 * rng.standard_normal((vocab, hidden)), dt)
    ids = rng.integers(0, vocab, num_tokens).astype(np.int32)
    ids[0] = vocab - 1
    out = embedding(kernel_module("embedding.cu"), to_device(ids), to_device(table))
    np.testing.assert_array_equal(result_f32(out, dt), numpy_ops.embedding(ids, table_ref))
    # The same table 1 element past a 16-byte boundary: the element-wise kernel, same rows.
    flat = to_device(np.concatenate([table.reshape(-1)[:1], table.reshape(-1)]))
    shifted = embedding(kernel_module("embedding.cu"), to_device(ids),
                        flat[1:].reshape(table.shape))
    np.testing.assert_array_equal(result_f32(shifted, dt), result_f32(out, dt))


def test_negative_cases(rng):
    x = rng.standard_normal((3, 16)).astype(np.float32)
    with pytest.raises(UnsupportedKernelShape, match="weight"):
        rms_norm(kernel_module("rms_norm.cu"), x, np.ones(15, np.float32), EPS)
    with pytest.raises(UnsupportedKernelShape, match="weight"):
        rms_norm(kernel_module("rms_norm.cu"), x, np.ones(16, np.float16), EPS)
    with pytest.raises(UnsupportedKernelShape, match="contiguous"):
        rms_norm(kernel_module("rms_norm.cu"), x[:, ::2], np.ones(8, np.float32), EPS)
    with pytest.raises(UnsupportedKernelShape, match="odd"):
        silu_and_mul(kernel_module("activation.cu"), x[:, :15].copy())
    with pytest.raises(UnsupportedKernelShape, match="dtype"):
        silu_and_mul(kernel_module("activation.cu"), x.astype(np.float64))
    with pytest.raises(ValueError, match="out of range"):
        embedding(kernel_module("embedding.cu"), np.array([0, 16], np.int32), x.T.copy())
    with pytest.raises(UnsupportedKernelShape, match="int32"):
        embedding(kernel_module("embedding.cu"), np.array([0, 1], np.int64), x)
