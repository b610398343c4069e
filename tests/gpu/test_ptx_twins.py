"""Each host twin of cuda/ptx.cuh and cuda/hopper_groundwork.cuh against the real instruction: the
probe kernels of tests/sim/kernels/twin_probes.cu run on the GPU (CuPy, NVRTC) and on the CPU
harness with the same random inputs; ldmatrix and cp.async must agree bit for bit, mma to fp32
accumulation error. Runs the first time a GPU is available; skips with the reason otherwise."""

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


# ---- Hopper (sm_90a): mbarrier, TMA, wgmma -------------------------------------------------
# tests/sim/kernels/hopper_probes.cu compiled for sm_90a by NVRTC to a cubin (so the arch does
# not depend on CuPy's option handling), against the harness twins and numpy.
HOPPER_CODE = '#include "hopper_probes.cu"\n'
SWIZZLE_ALIGN = 1024
WGMMA_M = 64


def _nvrtc_cubin(code: str, arch: str) -> bytes:
    import ctypes
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "scripts" / "compile_gates.py"
    spec = importlib.util.spec_from_file_location("compile_gates", path)
    gates = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gates
    spec.loader.exec_module(gates)
    lib = ctypes.CDLL(gates.find_libnvrtc())
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"hopper_probes_tu.cu",
                                  0, None, None) == 0
    opts = ["--std=c++17", f"--gpu-architecture={arch}", f"-I{CUDA_DIR}", f"-I{PROBES}",
            *_toolkit_include()]
    copts = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode(errors="replace")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


@pytest.fixture(scope="module")
def hopper_modules(tmp_path_factory):
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("Hopper checks need a compute capability 9.0 GPU (sm_90a instructions)")
    cubin = tmp_path_factory.mktemp("hopper") / "hopper_probes.cubin"
    cubin.write_bytes(_nvrtc_cubin(HOPPER_CODE, "sm_90a"))
    return cupy.RawModule(path=str(cubin)), SimModule(HOPPER_CODE, include_dirs=(CUDA_DIR, PROBES))


def _hopper_both(hopper_modules, name, block, gpu_descs, sim_descs, args, shared_mem):
    """Runs kernel `name` (one block) with descriptors first, then args; returns the arrays
    in args after the run (gpu, sim)."""
    gpu, sim = hopper_modules
    dev = tuple(cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
    dev_descs = tuple(cupy.asarray(d) for d in gpu_descs)
    gpu.get_function(name)((1,), (block,), dev_descs + dev, shared_mem=shared_mem)
    cupy.cuda.runtime.deviceSynchronize()
    host = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    sim.get_function(name)(1, block, tuple(sim_descs) + host, shared_mem=shared_mem)
    return ([cupy.asnumpy(a) for a in dev if isinstance(a, cupy.ndarray)],
            [a for a in host if isinstance(a, np.ndarray)])


@pytest.mark.parametrize("swizzle, cols", [(0, 8), (0, 24), (128, 64)])
def test_tma_twin_matches_instruction(hopper_modules, swizzle, cols):
    from pagedrun.runtime.kernels.tma import cuda_descriptor, sim_descriptor

    rng = np.random.default_rng()
    matrix = rng.integers(1, 2**16, (45, 104), dtype=np.uint16)  # 208-byte rows: 16 | stride
    dev_matrix = cupy.asarray(matrix)
    rows = 19
    nbytes = rows * cols * 2
    for row0, col0 in [(0, 0), (13, 36), (-3, -5), (40, 90)]:
        out = np.zeros(nbytes, np.uint8)
        g, s = _hopper_both(hopper_modules, "tma_box_probe", 32,
                            [cuda_descriptor(dev_matrix, rows, cols, swizzle)],
                            [sim_descriptor(matrix, rows, cols, swizzle)],
                            (np.int32(col0), np.int32(row0), np.int32(nbytes), out),
                            nbytes + SWIZZLE_ALIGN)
        np.testing.assert_array_equal(g[0], s[0])


# n = 256: the Hopper GEMM's m64n256k16 (cuda/gemm_hopper.cu).
@pytest.mark.parametrize("n, is_bf16, swizzled", [(64, 1, 1), (128, 0, 1), (64, 0, 0),
                                                  (128, 1, 0), (256, 1, 1), (256, 0, 0)])
def test_wgmma_twin_matches_instruction(hopper_modules, n, is_bf16, swizzled):
    from pagedrun.runtime.kernels.tma import cuda_descriptor, sim_descriptor

    rng = np.random.default_rng()
    k_steps = 4 if swizzled else 3
    K = 16 * k_steps
    x = rng.standard_normal((WGMMA_M + n, K)).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16) if is_bf16 else \
        x.astype(np.float16).view(np.uint16)
    A, Bt = np.ascontiguousarray(bits[:WGMMA_M]), np.ascontiguousarray(bits[WGMMA_M:])
    box_cols, swz = (64, 128) if swizzled else (8, 0)
    dA, dB = cupy.asarray(A), cupy.asarray(Bt)
    D = np.zeros((WGMMA_M, n), np.float32)
    g, s = _hopper_both(
        hopper_modules, "tma_wgmma_gemm", 128,
        [cuda_descriptor(dA, WGMMA_M, box_cols, swz), cuda_descriptor(dB, n, box_cols, swz)],
        [sim_descriptor(A, WGMMA_M, box_cols, swz), sim_descriptor(Bt, n, box_cols, swz)],
        (D, np.int32(n), np.int32(swizzled), np.int32(is_bf16), np.int32(k_steps), np.int32(0)),
        (WGMMA_M + n) * K * 2 + SWIZZLE_ALIGN)
    if is_bf16:
        fa, fb = ((t.astype(np.uint32) << 16).view(np.float32) for t in (A, Bt))
    else:
        fa, fb = (t.view(np.float16).astype(np.float32) for t in (A, Bt))
    expect = fa.astype(np.float64) @ fb.astype(np.float64).T
    np.testing.assert_allclose(g[0], expect, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g[0], s[0], rtol=1e-4, atol=1e-4)


def test_mbarrier_twin_matches_instruction(hopper_modules):
    threads, rounds = 64, 6
    out = np.zeros(threads * rounds, np.int32)
    g, s = _hopper_both(hopper_modules, "mbarrier_phases_probe", threads, [], [],
                        (out, np.int32(rounds)), 0)
    np.testing.assert_array_equal(g[0], s[0])
