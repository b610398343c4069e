"""Hopper twins (cuda/sim/hopper.cuh) on the logical tile, against numpy: TMA boxes (plain and
128B-swizzled, out-of-bounds zero fill), mbarrier phases, TMA -> mbarrier -> wgmma
m64n{64,128,256}k16 (bf16, f16; no-swizzle and 128B-swizzle K-major descriptors) equal to a
float64 matmul; planted bugs: reading a TMA tile without waiting gives NaN, reading the
wgmma accumulators without wgmma_wait_group gives NaN (results land at the wait, not at issue),
and waits on phases that cannot complete are deadlock reports. cuda/gemm_hopper.cu is the one
shipped kernel on these blocks (tests/kernels/test_gemm_hopper.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedrun.runtime.kernels import SimKernelError
from pagedrun.runtime.kernels.tma import sim_descriptor

SWIZZLE_ALIGN = 1024
WGMMA_M = 64


@pytest.fixture(scope="module")
def hopper(build_test_module):
    return build_test_module("hopper_probes.cu")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bits_to_f64(bits: np.ndarray, is_bf16: bool) -> np.ndarray:
    if is_bf16:
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def random_bits(rng, shape, is_bf16):
    x = rng.standard_normal(shape).astype(np.float32)
    return bf16_bits(x) if is_bf16 else x.astype(np.float16).view(np.uint16)


def reference_box(matrix, row0, col0, rows, cols):
    """The box TMA must deliver: matrix[row0.., col0..], zero outside the matrix."""
    out = np.zeros((rows, cols), matrix.dtype)
    for j in range(rows):
        for i in range(cols):
            y, x = row0 + j, col0 + i
            if 0 <= y < matrix.shape[0] and 0 <= x < matrix.shape[1]:
                out[j, i] = matrix[y, x]
    return out


def unswizzle_128b(raw: np.ndarray, rows: int) -> np.ndarray:
    """Shared-memory bytes of a 1024-byte aligned 128B-swizzled box -> logical rows: row j's
    16-byte chunk c sits at chunk c ^ (j % 8) (address bits 4..6 XOR bits 7..9)."""
    chunks = raw.reshape(rows, 8, 16)
    out = np.empty_like(chunks)
    for j in range(rows):
        for c in range(8):
            out[j, c] = chunks[j, c ^ (j % 8)]
    return out.reshape(rows, 128)


def run_box(hopper, matrix, row0, col0, rows, cols, swizzle):
    desc = sim_descriptor(matrix, rows, cols, swizzle)
    nbytes = rows * cols * matrix.itemsize
    raw = np.full(nbytes, 0xAB, np.uint8)
    hopper.get_function("tma_box_probe")(1, 32, (desc, np.int32(col0), np.int32(row0),
                                                 np.int32(nbytes), raw),
                                         shared_mem=nbytes + SWIZZLE_ALIGN)
    return raw


def test_tma_box_plain_with_out_of_bounds_zero_fill(hopper, rng):
    # rows of 29 values in a stride of 40 (TMA wants 16-byte row strides); nothing zero inside
    matrix = rng.integers(1, 2**16, (37, 40), dtype=np.uint16)[:, :29]
    for row0, col0 in [(3, 5), (-4, -3), (30, 24), (36, -7)]:
        raw = run_box(hopper, matrix, row0, col0, 11, 8, 0)
        np.testing.assert_array_equal(raw.view(np.uint16).reshape(11, 8),
                                      reference_box(matrix, row0, col0, 11, 8))


def test_tma_box_128b_swizzle_round_trip(hopper, rng):
    matrix = rng.integers(1, 2**16, (45, 104), dtype=np.uint16)[:, :100]
    for row0, col0 in [(0, 0), (13, 36), (-2, 50)]:
        rows = 19
        raw = run_box(hopper, matrix, row0, col0, rows, 64, 128)
        expect = reference_box(matrix, row0, col0, rows, 64)
        logical = unswizzle_128b(raw, rows).view(np.uint16)
        np.testing.assert_array_equal(logical, expect)
        if rows > 1:  # really swizzled, not a plain copy
            assert not np.array_equal(raw.view(np.uint16).reshape(rows, 64), expect)


@pytest.mark.parametrize("n, is_bf16, swizzled", [(64, True, True), (128, False, True),
                                                  (64, False, False), (128, True, False),
                                                  (256, True, True), (256, False, False)])
def test_tma_mbarrier_wgmma_is_a_matmul(hopper, rng, n, is_bf16, swizzled):
    k_steps = 4 if swizzled else int(rng.integers(1, 5))  # swizzled rows hold 64 K values
    K = 16 * k_steps
    A = random_bits(rng, (WGMMA_M, K), is_bf16)
    Bt = random_bits(rng, (n, K), is_bf16)  # B as n rows of K (K-major)
    box_cols = 64 if swizzled else 8
    da = sim_descriptor(A, WGMMA_M, box_cols, 128 if swizzled else 0)
    db = sim_descriptor(Bt, n, box_cols, 128 if swizzled else 0)
    D = np.full((WGMMA_M, n), -7.0, np.float32)
    smem = (WGMMA_M + n) * K * 2 + SWIZZLE_ALIGN
    hopper.get_function("tma_wgmma_gemm")(1, 128, (da, db, D, np.int32(n), np.int32(swizzled),
                                                   np.int32(is_bf16), np.int32(k_steps),
                                                   np.int32(0)), shared_mem=smem)
    expect = bits_to_f64(A, is_bf16) @ bits_to_f64(Bt, is_bf16).T
    np.testing.assert_allclose(D, expect, rtol=1e-5, atol=1e-5)


def test_reading_tma_tile_before_the_wait_reads_nan(hopper, rng):
    A = random_bits(rng, (WGMMA_M, 64), True)
    Bt = random_bits(rng, (64, 64), True)
    D = np.zeros((WGMMA_M, 64), np.float32)
    hopper.get_function("tma_wgmma_gemm")(
        1, 128, (sim_descriptor(A, WGMMA_M, 64, 128), sim_descriptor(Bt, 64, 64, 128), D,
                 np.int32(64), np.int32(1), np.int32(1), np.int32(4), np.int32(1)),
        shared_mem=(WGMMA_M + 64) * 64 * 2 + SWIZZLE_ALIGN)
    assert np.isnan(D).all()


def test_reading_accumulators_before_wgmma_wait_group_reads_nan(hopper, rng):
    """The twin's wgmma lands its product at the wait_group that retires it (as the hardware
    may): without the wait the registers still hold the in-flight poison."""
    A = random_bits(rng, (WGMMA_M, 64), True)
    Bt = random_bits(rng, (64, 64), True)
    D = np.zeros((WGMMA_M, 64), np.float32)
    hopper.get_function("tma_wgmma_gemm")(
        1, 128, (sim_descriptor(A, WGMMA_M, 64, 128), sim_descriptor(Bt, 64, 64, 128), D,
                 np.int32(64), np.int32(1), np.int32(1), np.int32(4), np.int32(2)),
        shared_mem=(WGMMA_M + 64) * 64 * 2 + SWIZZLE_ALIGN)
    assert np.isnan(D).all()


def test_mbarrier_phases(hopper):
    threads, rounds = 45, 5
    out = np.full(rounds * threads, -1, np.int32)
    hopper.get_function("mbarrier_phases_probe")(1, threads, (out, np.int32(rounds)))
    t = np.arange(threads)
    expect = [1000 * ((t + 1) % threads) + p for p in range(rounds)]
    np.testing.assert_array_equal(out.reshape(rounds, threads), np.stack(expect))


@pytest.mark.parametrize("mode", [0, 1])
def test_wait_on_a_phase_that_cannot_complete_is_a_deadlock(hopper, mode):
    with pytest.raises(SimKernelError, match=r"deadlock.*\n.*wait at mbarrier_wait_parity "
                                             r"\(hopper_probes\.cu:\d+\)"):
        hopper.get_function("mbarrier_deadlock_probe")(1, 32, (np.int32(mode),))


def test_wgmma_needs_a_whole_warpgroup(hopper, rng):
    A = random_bits(rng, (WGMMA_M, 64), True)
    Bt = random_bits(rng, (64, 64), True)
    D = np.zeros((WGMMA_M, 64), np.float32)
    with pytest.raises(SimKernelError, match=r"warpgroup 0 is incomplete"):
        hopper.get_function("tma_wgmma_gemm")(
            1, 96, (sim_descriptor(A, WGMMA_M, 64, 128), sim_descriptor(Bt, 64, 64, 128), D,
                    np.int32(64), np.int32(1), np.int32(1), np.int32(4), np.int32(0)),
            shared_mem=(WGMMA_M + 64) * 64 * 2 + SWIZZLE_ALIGN)


# ---- compile gates (scripts/compile_gates.py) ---------------------------------------------
def _load_gates():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "compile_gates.py"
    spec = importlib.util.spec_from_file_location("compile_gates", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_hopper_kernels_pass_the_sm90a_gates_and_unguarded_calls_fail_elsewhere():
    from pathlib import Path

    from pagedrun.runtime.kernels.sim_module import sanitizer_mode

    gates = _load_gates()
    if sanitizer_mode() != "plain":
        pytest.skip("NVRTC does not run under a preloaded sanitizer; the plain job gates")
    if gates.toolkit_root() is None or gates.find_libnvrtc() is None:
        pytest.skip("needs nvcc and libnvrtc (scripts/install.sh installs nvidia-cuda-nvrtc)")
    import contextlib
    import io

    kernels = Path(__file__).resolve().parent / "kernels"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = gates.main([str(kernels / "hopper_probes.cu"), str(kernels / "hopper_unguarded.cu")])
    verdicts = {}
    for line in buf.getvalue().splitlines():
        if line.startswith(("PASS ", "FAIL ")):
            verdict, gate, name, arch = line.split()
            verdicts[(gate, name, arch)] = verdict
    assert rc == 1
    for gate in ("nvrtc", "nvcc"):
        assert verdicts[(gate, "hopper_probes.cu", "sm_90a")] == "PASS"
        assert verdicts[(gate, "hopper_probes.cu", "sm_80")] == "PASS"  # bodies guarded
        assert verdicts[(gate, "hopper_unguarded.cu", "sm_90a")] == "PASS"
        assert verdicts[(gate, "hopper_unguarded.cu", "sm_80")] == "FAIL"
    assert "Hopper-only instruction (wgmma / TMA / mbarrier): compile for sm_90a" in buf.getvalue()


def test_descriptors_the_gpu_would_refuse_are_refused(hopper, rng):
    with pytest.raises(ValueError, match="row stride multiple of 16"):
        sim_descriptor(np.zeros((8, 29), np.uint16), 8, 8)
    with pytest.raises(ValueError, match="equal to the 128-byte swizzle"):
        sim_descriptor(np.zeros((8, 64), np.uint16), 8, 32, 128)
    fake = np.zeros(16, np.uint64)  # e.g. a CUtensorMap handed to the harness
    raw = np.zeros(256, np.uint8)
    with pytest.raises(SimKernelError, match="was not built by pagedrun.runtime.kernels.tma"):
        hopper.get_function("tma_box_probe")(1, 32, (fake, np.int32(0), np.int32(0),
                                                     np.int32(256), raw), shared_mem=256 + 1024)


# The shipped kernels on the Hopper-only blocks; every other cuda/*.cu stays off them.
HOPPER_KERNELS = {"gemm_hopper.cu"}


def test_only_the_hopper_gemm_uses_the_hopper_target():
    """Only cuda/gemm_hopper.cu uses Hopper-only functions (its gates build sm_90a); the other
    cuda/*.cu keep compiling for sm_90 (not sm_90a), so their prebuilt cubins run on any sm_90
    part and a new Hopper user is a deliberate change to HOPPER_KERNELS."""
    from pathlib import Path

    gates = _load_gates()
    shipped = sorted((Path(__file__).resolve().parents[2] / "cuda").glob("*.cu"))
    assert HOPPER_KERNELS <= {p.name for p in shipped}
    for path in shipped:
        expect = ["sm_80", "sm_90a"] if path.name in HOPPER_KERNELS else ["sm_80", "sm_90"]
        assert gates.archs_for(path) == expect, path.name
    kernels = Path(__file__).resolve().parent / "kernels"
    assert gates.archs_for(kernels / "hopper_probes.cu") == ["sm_80", "sm_90a"]
