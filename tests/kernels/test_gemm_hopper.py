"""cuda/gemm_hopper.cu (through runtime/kernels/gemm_hopper.py) against a float64 reference on
the same rounded inputs, under the CPU harness's TMA / mbarrier / wgmma twins: partial tiles in
M (1, 64, 65, 130 rows of a 128-row tile), N (128, 200 of a 256-column tile: TMA zero fill) and
K (72: a 64-wide k-tile plus 8), multi-stage k loops (K = 192, 576: the 4-stage ring wraps), the
fused bias / residual epilogue (residual aliasing out), fp32 output; then eligibility and the
refused shapes. Output buffers start as NaN, so an unwritten element fails."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import (BACKEND, as_kernel_dtype, check_gemm, gemm_case, nan_output,
                                 to_device)
from pagedrun.runtime.kernels.gemm_hopper import (HOPPER_LAUNCH_REGS, HOPPER_MIN_M,
                                                  HOPPER_SMEM_BYTES, gemm_hopper,
                                                  gemm_hopper_grid, hopper_eligible)
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.kernels.loader import load_module

_MODULE = []


def module():
    if BACKEND == "cuda":
        from pagedrun.runtime.kernels.loader import device_arch

        if device_arch() != 90:
            pytest.skip("the Hopper GEMM runs on sm_90 devices only")
    if not _MODULE:
        _MODULE.append(load_module("gemm_hopper.cu", backend=BACKEND))
    return _MODULE[0]


def _run(rng, dt, M, N, K, *, with_bias=True, with_residual=True, out_f32=False,
         alias=False):
    case = gemm_case(rng, dt, M, N, K, with_bias=with_bias, with_residual=with_residual,
                     out_f32=out_f32)
    out = case.residual if alias else nan_output((M, N), case.out_dt)
    got = gemm_hopper(module(), case.a, to_device(case.w), bias=case.bias,
                      residual=case.residual, out=out, out_dtype=np.float32 if out_f32 else None)
    assert got is out
    check_gemm(got, case, K, f"{dt}->{case.out_dt} {M}x{N}x{K}")


# Every M, N and K of the brief at least once, with both dtypes; each case one or two CTAs.
SHAPES = [("bf16", 1, 128, 64), ("f16", 64, 200, 72), ("bf16", 65, 256, 192),
          ("f16", 130, 200, 64), ("bf16", 130, 128, 72), ("f16", 1, 256, 192)]


@pytest.mark.parametrize("dt,M,N,K", SHAPES)
def test_gemm_hopper_matches_float64(rng, dt, M, N, K):
    _run(rng, dt, M, N, K)


def test_gemm_hopper_ring_wraps_and_no_epilogue(rng):
    # K = 576: 9 k-tiles through 4 stages (each stage reused twice, barrier parity flips).
    _run(rng, "bf16", 65, 136, 576, with_bias=False, with_residual=False)


@pytest.mark.parametrize("dt", ("f16", "bf16"))
def test_gemm_hopper_fp32_out_with_residual_aliasing_out(rng, dt):
    _run(rng, dt, 70, 200, 72, out_f32=True, alias=True)


def test_gemm_hopper_residual_aliasing_out_in_input_dtype(rng):
    _run(rng, "bf16", 130, 256, 64, with_bias=False, alias=True)


def test_hopper_eligible():
    assert hopper_eligible(4096, 4096, 4096, "bf16", "nk", 90)
    assert hopper_eligible(HOPPER_MIN_M, 200, 72, "f16", "nk", 90)
    assert not hopper_eligible(HOPPER_MIN_M - 1, 4096, 4096, "bf16", "nk", 90)  # skinny's
    assert not hopper_eligible(4096, 4096, 4100, "bf16", "nk", 90)  # 8200-byte rows: not x16
    assert not hopper_eligible(4096, 4096, 4096, "bf16", "kn", 90)
    assert not hopper_eligible(4096, 4096, 4096, "f32", "nk", 90)
    for arch in (80, 89, 100, None):  # sm_90a code runs on sm_90 only; None: the harness
        assert not hopper_eligible(4096, 4096, 4096, "bf16", "nk", arch)
    assert gemm_hopper_grid(130, 200) == 2 and gemm_hopper_grid(4096, 8192) == 32 * 32
    assert HOPPER_SMEM_BYTES == 4 * (128 + 256) * 64 * 2 + 1024 <= 227 * 1024


def test_gemm_hopper_refuses_what_tma_cannot_read(rng):
    mod = module()
    a, _ = as_kernel_dtype(rng.standard_normal((8, 65)), "bf16")
    w, _ = as_kernel_dtype(rng.standard_normal((16, 65)), "bf16")
    with pytest.raises(UnsupportedKernelShape, match="K % 8 == 0"):
        gemm_hopper(mod, to_device(a), to_device(w))
    with pytest.raises(UnsupportedKernelShape, match="f16 / bf16"):
        gemm_hopper(mod, to_device(np.zeros((8, 64), np.float32)),
                    to_device(np.zeros((16, 64), np.float32)))
    raw = np.zeros(8 * 64 + 8, np.uint16)  # an array starting 2 bytes past a 16-byte boundary
    start = (-raw.ctypes.data % 16) // 2 + 1
    shifted = raw[start:start + 8 * 64].reshape(8, 64)
    if BACKEND == "sim":
        with pytest.raises(UnsupportedKernelShape, match="16-byte aligned"):
            gemm_hopper(mod, shifted, np.zeros((16, 64), np.uint16))


class _Launches:
    """A module that records the names of the kernels launched through it."""

    def __init__(self, module):
        self.module, self.names = module, []

    def get_function(self, name):
        function = self.module.get_function(name)  # raises for a kernel it does not have
        names = self.names

        class Recorded:
            num_regs = HOPPER_LAUNCH_REGS  # as a GPU module's function reports it

            def __call__(self, *args, **kwargs):
                names.append(name)
                return function(*args, **kwargs)

            def __setattr__(self, attr, value):  # max_dynamic_shared_size_bytes
                setattr(function, attr, value)

        return Recorded()


@pytest.mark.skipif(BACKEND != "sim", reason="drives gemm()'s device checks with a stand-in")
@pytest.mark.parametrize("arch, capturing, with_hopper, expect_hopper", [
    (90, False, True, True), (80, False, True, False), (90, True, True, True),
    (90, False, False, False)])
def test_gemm_dispatches_to_hopper_only_where_it_runs(rng, monkeypatch, arch, capturing,
                                                      with_hopper, expect_hopper):
    """gemm() takes the Hopper GEMM on compute capability 9.0 when the module has it, inside a
    graph capture too (its descriptors are launch parameters, nothing is uploaded); otherwise
    the mma.sync kernel. A stand-in array module makes gemm() see a "device" (the arrays stay
    numpy, so the harness still runs the kernels)."""
    import types

    import pagedrun.runtime.kernels.gemm as gemm_module
    from pagedrun.runtime.kernels import kernel_args

    stream = types.SimpleNamespace(is_capturing=lambda: capturing)
    fake_xp = types.SimpleNamespace(
        empty=np.empty, cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0),
                                                   get_current_stream=lambda: stream))
    monkeypatch.setattr(gemm_module, "array_module", lambda x: fake_xp)
    monkeypatch.setattr(kernel_args, "_cuda_arch", lambda xp, device_id: arch)
    monkeypatch.setattr(kernel_args, "_cuda_num_sms", lambda xp, device_id: 4)
    sources = ["gemm.cu", "gemm_skinny.cu"] + (["gemm_hopper.cu"] if with_hopper else [])
    launches = _Launches(load_module(sources, backend="sim"))
    M, N, K = 70, 136, 72
    case = gemm_case(rng, "bf16", M, N, K)
    out = gemm_module.gemm(launches, case.a, to_device(case.w), bias=case.bias,
                           residual=case.residual)
    check_gemm(out, case, K, f"arch {arch} capturing {capturing} hopper {with_hopper}")
    assert (launches.names == ["gemm_hopper_bf16_nk_obf16"]) == expect_hopper, launches.names
    assert launches.names, "nothing launched"
