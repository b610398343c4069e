"""Inputs and checks shared by the kernel tests (this folder is on sys.path via conftest.py).

Backend: the kernel tests run on the CPU harness ("sim") by default; tests/gpu/run_all.sh runs
the same files with PAGEDRUN_TEST_BACKEND=cuda (the only switch, and it lives in tests).
Dtypes: "f32", "f16", "bf16"; bf16 kernel arrays are uint16 bf16 bits, and their reference is
the float32 array of the same bf16 values (what numpy_ops computes on).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from pagedrun.runtime.kernels.kernel_args import from_bf16_bits, to_bf16_bits
from pagedrun.runtime.kernels.loader import load_module

BACKEND = os.environ.get("PAGEDRUN_TEST_BACKEND", "sim")
DTYPES = ("f32", "f16", "bf16")

# One tolerance table per dtype (|kernel - reference| <= atol + rtol * |reference|). The
# reference computes in float32 on the same (already rounded) inputs, so the budget is the
# kernel's own roundings: f32 -- exp2 vs exp and summation order; f16 / bf16 -- the tensor-core
# path rounds P to the input type before P V, and every output is rounded once on store
# (bf16 keeps 8 bits of mantissa: 2^-8 ~ 4e-3 relative). Measured under the harness over 6
# seeds x GQA 1/4/8 x d128: worst error 13% (f32), 33% (f16), 20% (bf16) of these bounds; the
# rest is headroom for the GPU's approximate exp2 and contracted FMAs.
ATTENTION_TOL = {"f32": dict(atol=1e-5, rtol=1e-5),
                 "f16": dict(atol=2e-3, rtol=2e-3),
                 "bf16": dict(atol=1.6e-2, rtol=1.6e-2)}
# Rotary: fp32 math and one rounding per store; a contracted fma on the GPU may flip the last
# bit of a stored 16-bit value.
ROTARY_TOL = {"f32": dict(atol=1e-5, rtol=1e-5),
              "f16": dict(atol=2e-3, rtol=2e-3),
              "bf16": dict(atol=1.6e-2, rtol=1.6e-2)}

_MODULES: dict[str, object] = {}


def kernel_module(source: str):
    """The module of cuda/<source> on BACKEND, built once per test session."""
    if source not in _MODULES:
        _MODULES[source] = load_module(source, backend=BACKEND)
    return _MODULES[source]


def as_kernel_dtype(x: np.ndarray, dt: str) -> tuple[np.ndarray, np.ndarray]:
    """(host array for the kernel, reference array with exactly the values the kernel sees)."""
    if dt == "f32":
        a = np.ascontiguousarray(x, dtype=np.float32)
        return a, a
    if dt == "f16":
        a = np.ascontiguousarray(x, dtype=np.float16)
        return a, a
    if dt == "bf16":
        bits = to_bf16_bits(x)
        return bits, from_bf16_bits(bits)
    raise ValueError(dt)


def to_device(x: np.ndarray):
    if BACKEND == "cuda":
        import cupy

        return cupy.asarray(x)
    return x


def to_host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def result_f32(x, dt: str) -> np.ndarray:
    host = to_host(x)
    return from_bf16_bits(host) if dt == "bf16" else host.astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: dict, what: str) -> None:
    expected = np.asarray(expected, dtype=np.float32)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values in the kernel output"
    if actual.size == 0:
        return
    err = np.abs(actual - expected)
    bound = tol["atol"] + tol["rtol"] * np.abs(expected)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (f"{what}: max error {err.max():.3g} (at {worst}: kernel "
                                  f"{actual[worst]:.6g}, reference {expected[worst]:.6g}), "
                                  f"tolerance {tol}")


class PagedKV:
    """A NaN-poisoned paged KV pool holding random contexts behind shuffled block tables.

    Every slot no request owns is NaN, and so are the spare blocks the block-table padding
    points at: a kernel that reads past a context produces NaN. Values are float32 (the
    caller converts); k/v: [num_blocks, block_size, num_kv_heads, head_dim].
    """

    SPARE_BLOCKS = 3

    def __init__(self, rng, context_lens, num_kv_heads: int, head_dim: int, block_size: int,
                 max_blocks_per_seq: int | None = None):
        context_lens = [int(c) for c in context_lens]
        blocks_needed = [-(-c // block_size) for c in context_lens]
        self.max_blocks = max_blocks_per_seq or max(max(blocks_needed), 1) + 1
        num_blocks = sum(blocks_needed) + self.SPARE_BLOCKS
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = np.full(shape, np.nan, dtype=np.float32)
        self.v = np.full(shape, np.nan, dtype=np.float32)
        order = rng.permutation(num_blocks)  # random, non-contiguous physical blocks
        spare = self.spare_blocks = order[:self.SPARE_BLOCKS]
        self.block_tables = rng.choice(spare, size=(len(context_lens), self.max_blocks)).astype(
            np.int32)
        next_block = self.SPARE_BLOCKS
        for i, (ctx, nblk) in enumerate(zip(context_lens, blocks_needed)):
            assert nblk <= self.max_blocks
            ids = order[next_block:next_block + nblk]
            next_block += nblk
            self.block_tables[i, :nblk] = ids
            for t in range(ctx):
                blk, off = ids[t // block_size], t % block_size
                self.k[blk, off] = rng.standard_normal((num_kv_heads, head_dim))
                self.v[blk, off] = rng.standard_normal((num_kv_heads, head_dim))
        self.context_lens = np.asarray(context_lens, dtype=np.int32)

    def tables_hiding_before(self, first_visible) -> np.ndarray:
        """A copy of block_tables where every block wholly before first_visible[i] (a request's
        first key any query of it may see) points at a NaN spare block: a windowed kernel
        that reads (or even indexes) a block before the window returns NaN."""
        tables = self.block_tables.copy()
        block_size = self.k.shape[1]
        spare = int(self.spare_blocks[0])
        for i, first in enumerate(first_visible):
            tables[i, :max(int(first), 0) // block_size] = spare
        return tables


# ---- GEMM cases (test_gemm*.py) --------------------------------------------------------------
OUT_NP = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}  # kernel arrays per dtype
# |kernel - reference| <= atol * K + rtol * |reference|. A serial fp32 sum of K unit-normal
# products drifts like a random walk whose partial sums grow as sqrt(k): its rounding error has
# a standard deviation of about 0.35 eps K (eps = 2^-23), so 2.5 eps K covers the largest of a
# few hundred outputs; every output is then rounded once (half an ulp: 2^-24, 2^-11, 2^-8
# relative). A wrong kernel is off by O(1).
GEMM_ATOL_PER_K = 3e-7
GEMM_RTOL = {"f32": 2e-6, "f16": 1.2e-3, "bf16": 8e-3}


class GemmCase(NamedTuple):
    """Fresh inputs of one GEMM, out = a @ w.T (+ bias) (+ residual), and its reference."""
    a: object            # [M, K] kernel dtype, on the device
    w: np.ndarray        # [N, K] kernel dtype, host (the "nk" weight; tests lay it out)
    bias: object         # [N] kernel dtype on the device, or None
    residual: object     # [M, N] in out_dt on the device, or None
    expected: np.ndarray  # float64 [M, N] on the same rounded values
    out_dt: str          # the output dtype: dt, or "f32"


def gemm_case(rng, dt: str, M: int, N: int, K: int, *, with_bias: bool = True,
              with_residual: bool = True, out_f32: bool = False, scale: float = 1.0) -> GemmCase:
    a, a_ref = as_kernel_dtype(scale * rng.standard_normal((M, K)), dt)
    w, w_ref = as_kernel_dtype(rng.standard_normal((N, K)), dt)
    out_dt = "f32" if out_f32 else dt
    expected = a_ref.astype(np.float64) @ w_ref.astype(np.float64).T
    bias = residual = None
    if with_bias:
        bias, bias_ref = as_kernel_dtype(rng.standard_normal(N), dt)
        expected += bias_ref
        bias = to_device(bias)
    if with_residual:
        residual, res_ref = as_kernel_dtype(rng.standard_normal((M, N)), out_dt)
        expected += res_ref
        residual = to_device(residual)
    return GemmCase(to_device(a), w, bias, residual, expected, out_dt)


def gemm_tol(out_dt: str, K: int) -> dict:
    return dict(atol=GEMM_ATOL_PER_K * K, rtol=GEMM_RTOL[out_dt])


def check_gemm(result, case: GemmCase, K: int, what: str) -> None:
    """result (a device array in case.out_dt) against case.expected within gemm_tol."""
    assert result.dtype == OUT_NP[case.out_dt], f"{what}: out dtype {result.dtype}"
    assert_close(result_f32(result, case.out_dt), case.expected, gemm_tol(case.out_dt, K), what)


def nan_output(shape, out_dt: str):
    """A device output array full of NaN (bf16: its NaN bits), so unwritten elements show."""
    nan, _ = as_kernel_dtype(np.full(shape, np.nan), out_dt)
    return to_device(nan)
