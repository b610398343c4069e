"""cuda/activation.cu's gelu_tanh_and_mul (Gemma's GeGLU, through runtime/kernels/fused_ops.py)
against runtime/backends/numpy_ops.py on the same rounded inputs, and numpy_ops' GELU against a
float64 scalar formula: awkward widths, saturated tails, zero, negative cases."""
from __future__ import annotations

import math

import numpy as np
import pytest

from paged_kernel_inputs import DTYPES, as_kernel_dtype, assert_close, kernel_module, result_f32
from paged_kernel_inputs import to_device
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.fused_ops import gelu_tanh_and_mul
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

# fp32 math in both (tanhf vs numpy's tanh may differ by an ulp); 16-bit outputs rounded once.
# For negative g, 1 + tanh(.) cancels: an ulp of tanh is an absolute error of ~|g u| * 2^-24,
# up to ~5e-6 for these inputs (|g| ~ 4 sigma = 16, |u| ~ 16): hence the f32 atol.
GEGLU_TOL = {"f32": dict(atol=1e-5, rtol=1e-5),
             "f16": dict(atol=1e-5, rtol=1.5e-3),
             "bf16": dict(atol=1e-5, rtol=1.2e-2)}


def gelu_tanh_f64(g: float) -> float:
    """PyTorch's gelu(approximate='tanh') in float64, one scalar at a time."""
    return 0.5 * g * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


def test_numpy_reference_matches_the_formula(rng):
    gate_up = np.concatenate([4 * rng.standard_normal((3, 40)),
                              rng.standard_normal((3, 40))], axis=1).astype(np.float32)
    gate_up[0, :4] = (-60.0, 60.0, 0.0, -3.0)
    got = numpy_ops.gelu_tanh_and_mul(gate_up)
    expected = np.array([[gelu_tanh_f64(float(g)) * float(u)
                          for g, u in zip(row[:40], row[40:])] for row in gate_up])
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)  # the same cancellation
    assert got[0, 0] == 0 or abs(got[0, 0]) < 1e-30  # GELU(-60) underflows to -0 / 0
    assert not np.allclose(got, numpy_ops.silu_and_mul(gate_up), atol=1e-2)  # not SiLU


@pytest.mark.parametrize("dt", DTYPES)
# 264, 2056: 16-byte units (V = 8 / 4) with a partial last CTA; 700: units only for f32.
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 17), (17, 111), (4, 700), (3, 264),
                                                     (2, 2056)])
def test_gelu_tanh_and_mul(rng, dt, num_tokens, intermediate):
    gate_up = 4 * rng.standard_normal((num_tokens, 2 * intermediate))
    gate_up[0, :3] = (-200.0, 200.0, 0.0)  # saturated tanh at both ends, and zero
    g, g_ref = as_kernel_dtype(gate_up, dt)
    out = gelu_tanh_and_mul(kernel_module("activation.cu"), to_device(g))
    assert_close(result_f32(out, dt), numpy_ops.gelu_tanh_and_mul(g_ref), GEGLU_TOL[dt],
                 f"gelu_tanh {dt}")


def test_refuses_bad_inputs(rng):
    x = rng.standard_normal((2, 16)).astype(np.float32)
    with pytest.raises(UnsupportedKernelShape):
        gelu_tanh_and_mul(kernel_module("activation.cu"), x[:, :15].copy())
    with pytest.raises(UnsupportedKernelShape):
        gelu_tanh_and_mul(kernel_module("activation.cu"), x.astype(np.float64))
