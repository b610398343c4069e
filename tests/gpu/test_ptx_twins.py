"""Each host twin of cuda/ptx.cuh against the real instruction: the probe kernels of
tests/sim/kernels/twin_probes.cu run on the GPU (CuPy, NVRTC) and on the CPU harness with the
same random inputs; ldmatrix and cp.async must agree bit for bit, mma to fp32 accumulation
error. Runs the first time a GPU is available; skips with the reason otherwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedrun.runtime.kernels.loader import _toolkit_include
from pagedrun.runtime.kernels.sim_module import CUDA_DIR, SimModule

cupy = pytest.importorskip("cupy", reason="needs CuPy and a GPU")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no GPU visible to CuPy", allow_module_level=True)
except cupy.cuda.runtime.CUDARuntimeError as exc:  # driver present, no device
    pytest.skip(f"no usable GPU: {exc}", allow_module_level=True)

PROBES = Path(__file__).resolve().parents[1] / "sim" / "kernels"
CODE = '#include "twin_probes.cu"\n'
PROBE_ROWS = 64


@pytest.fixture(scope="module")
def modules():
    gpu = cupy.RawModule(code=CODE, options=("--std=c++17", f"-I{CUDA_DIR}", f"-I{PROBES}",
                                             *_toolkit_include()))
    sim = SimModule(CODE, include_dirs=(CUDA_DIR, PROBES))
    return gpu, sim


def run_both(modules, name, grid, block, args, shared_mem=0):
    """Runs kernel `name` on GPU and harness; returns (gpu arrays, sim arrays) after."""
    gpu, sim = modules
    dev_args = tuple(cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
    gpu.get_function(name)(grid, block, dev_args, shared_mem=shared_mem)
    cupy.cuda.runtime.deviceSynchronize()
    host_args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    sim.get_function(name)(grid, block, host_args, shared_mem=shared_mem)
    return ([cupy.asnumpy(a) for a in dev_args if isinstance(a, cupy.ndarray)],
            [a for a in host_args if isinstance(a, np.ndarray)])


@pytest.mark.parametrize("is_bf16", [1, 0])
def test_mma_twin_matches_instruction(modules, is_bf16):
    rng = np.random.default_rng()
    warps = 4
    if is_bf16:
        f = rng.standard_normal((warps * 32, 8)).astype(np.float32).view(np.uint32)
        halves = (f >> 16).astype(np.uint16)
    else:
        halves = rng.standard_normal((warps * 32, 8)).astype(np.float16).view(np.uint16)
    packed = halves[:, 0::2].astype(np.uint32) | (halves[:, 1::2].astype(np.uint32) << 16)
    a = np.ascontiguousarray(packed[:, :4])
    b = np.ascontiguousarray(packed[:, 4:6])
    c = rng.standard_normal((warps * 32, 4)).astype(np.float32)
    d = np.zeros((warps * 32, 4), np.float32)
    g, s = run_both(modules, "mma_fragments", (1,), (32 * warps,), (a, b, c, d, np.int32(is_bf16)))
    np.testing.assert_allclose(g[3], s[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", range(6))
def test_ldmatrix_twin_matches_instruction(modules, variant):
    rng = np.random.default_rng()
    src = rng.integers(0, 2**16, (PROBE_ROWS, 8), dtype=np.uint16)
    rows = rng.permutation(PROBE_ROWS)[:32].astype(np.int32)
    out = np.zeros((32, 4), np.uint32)
    g, s = run_both(modules, "ldmatrix_probe", (1,), (32,), (src, rows, out, np.int32(variant)))
    count = (1, 2, 4)[variant % 3]
    np.testing.assert_array_equal(g[2][:, :count], s[2][:, :count])


def test_cp_async_zfill_twin_matches_instruction(modules):
    rng = np.random.default_rng()
    threads = 64
    x = rng.standard_normal(4 * threads).astype(np.float32)
    src_bytes = (4 * rng.integers(0, 5, threads)).astype(np.int32)
    y = np.zeros_like(x)
    g, s = run_both(modules, "cp_async_zfill_probe", (1,), (threads,), (x, src_bytes, y))
    np.testing.assert_array_equal(g[2], s[2])


def test_tiled_gemm_matches(modules):
    rng = np.random.default_rng()
    M, N, K = 128, 128, 64
    A = (rng.standard_normal((M, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    B = (rng.standard_normal((K, N)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    C = np.zeros((M, N), np.float32)
    g, s = run_both(modules, "tiled_gemm_bf16", (N // 64, M // 64), (128,),
                    (A, B, C, np.int32(M), np.int32(N), np.int32(K)))
    np.testing.assert_allclose(g[2], s[2], rtol=1e-4, atol=1e-4)
