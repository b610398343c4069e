"""cuda/reduce.cuh on the CPU harness against numpy references of the orders its header states:
the float results bit for bit (the same additions in the same tree, numpy float32/float64 IEEE
arithmetic), integers exactly, and every thread's copy of the result. Awkward block shapes (1,
3, 8 and 32 warps), ties for the argmax, -inf and NaN for the max."""

from __future__ import annotations

import numpy as np
import pytest

WARP = 32
BLOCK_SIZES = (32, 96, 256, 1024)  # the instantiations in reduce_probes.cu


@pytest.fixture(scope="module")
def probes(build_test_module):
    return build_test_module("reduce_probes.cu")


def butterfly(v: np.ndarray, offsets) -> np.ndarray:
    """Every lane: v = v + v[lane ^ o] for each offset in turn (rows of 32 lanes)."""
    lanes = np.arange(WARP)
    for o in offsets:
        v = v + v[..., lanes ^ o]
    return v


def butterfly_max(v: np.ndarray, offsets) -> np.ndarray:
    lanes = np.arange(WARP)
    for o in offsets:
        v = np.fmax(v, v[..., lanes ^ o])  # fmaxf: a NaN loses to a number
    return v


def scan(v: np.ndarray) -> np.ndarray:
    """Hillis-Steele inclusive scan over the lanes: offsets 1, 2, 4, 8, 16."""
    for o in (1, 2, 4, 8, 16):
        up = np.zeros_like(v)
        up[..., o:] = v[..., :-o]
        v = np.where(np.arange(WARP) >= o, v + up, v)
    return v


DOWN = (16, 8, 4, 2, 1)


@pytest.mark.parametrize("threads", BLOCK_SIZES)
def test_block_reductions(probes, rng, threads):
    blocks = 3
    warps = threads // WARP
    x = rng.standard_normal((blocks, threads)).astype(np.float32)
    # ties for the argmax: block 1 holds a repeated maximum, block 2 small integers
    x[1, rng.choice(threads, size=min(3, threads), replace=False)] = 7.0
    x[2] = rng.integers(-3, 4, threads).astype(np.float32)
    x[0, rng.integers(threads)] = -np.inf
    xi = rng.integers(-(1 << 20), 1 << 20, (blocks, threads)).astype(np.int32)
    sums = np.empty_like(x)
    maxes = np.empty_like(x)
    argmaxes = np.empty((blocks, threads), np.int32)
    isums = np.empty((blocks, threads), np.int32)
    probes.get_function(f"block_probe_{threads}")(blocks, threads,
                                                  (x, xi, sums, maxes, argmaxes, isums))

    warp_totals = butterfly(x.reshape(blocks, warps, WARP), DOWN)[..., 0]  # lane 0's copy
    expect_sum = warp_totals[:, 0].copy()
    for w in range(1, warps):  # (t0 + t1) + t2 + ... in float32
        expect_sum = expect_sum + warp_totals[:, w]
    np.testing.assert_array_equal(sums, np.repeat(expect_sum[:, None], threads, 1))
    # and it is the sum (blocks 1 and 2: block 0 holds -inf): error <= depth * ulp * sum |x|
    np.testing.assert_allclose(expect_sum[1:], x[1:].astype(np.float64).sum(1), rtol=0,
                               atol=threads * 2.0**-24 * np.abs(x[1:]).sum())
    np.testing.assert_array_equal(maxes, np.repeat(x.max(1)[:, None], threads, 1))
    np.testing.assert_array_equal(argmaxes, np.repeat(x.argmax(1)[:, None], threads, 1))
    np.testing.assert_array_equal(isums, np.repeat(xi.sum(1, dtype=np.int32)[:, None], threads, 1))


def test_warp_reductions(probes, rng):
    warps = 3
    n = warps * WARP
    x = rng.standard_normal(n).astype(np.float32)
    x[WARP + 5] = np.nan                               # warp 1: a NaN lane loses the max
    x[2 * WARP: 3 * WARP] = rng.integers(-2, 3, WARP)  # warp 2: ties for the argmax
    xd = rng.standard_normal(n)
    xi = rng.integers(-(1 << 24), 1 << 24, n).astype(np.int32)
    out = np.empty((n, 6), np.float32)
    outd = np.empty((n, 2), np.float64)
    outi = np.empty((n, 4), np.int32)
    probes.get_function("warp_probe")(1, n, (x, xd, xi, out, outd, outi))

    xw, xdw, xiw = x.reshape(warps, WARP), xd.reshape(warps, WARP), xi.reshape(warps, WARP)
    flat = lambda a: a.reshape(n)  # noqa: E731
    np.testing.assert_array_equal(flat(butterfly(xw, DOWN)), out[:, 0])
    np.testing.assert_array_equal(flat(butterfly_max(xw, DOWN)), out[:, 1])
    np.testing.assert_array_equal(out[:, 1].reshape(warps, WARP)[1], np.nanmax(xw[1]))
    np.testing.assert_array_equal(flat(scan(xw)), out[:, 2])
    np.testing.assert_array_equal(flat(butterfly(xw, (1, 2))), out[:, 3])
    np.testing.assert_array_equal(flat(butterfly_max(xw, (1, 2))), out[:, 4])
    np.testing.assert_array_equal(flat(butterfly(xw, (1,))), out[:, 5])
    # the quad sums are sums of their own 4 lanes, (a0 + a1) + (a2 + a3): warps 0 and 2
    quads = xw[[0, 2]].reshape(2, WARP // 4, 4)
    expect_quad = (quads[..., 0] + quads[..., 1]) + (quads[..., 2] + quads[..., 3])
    np.testing.assert_array_equal(out[:, 3].reshape(warps, WARP)[[0, 2]],
                                  np.repeat(expect_quad, 4, axis=-1))
    np.testing.assert_allclose(flat(np.cumsum(xw, 1))[:WARP], out[:WARP, 2], rtol=0,
                               atol=WARP * 2.0**-23 * np.abs(xw[0]).sum())
    np.testing.assert_array_equal(flat(butterfly(xdw, DOWN)), outd[:, 0])
    np.testing.assert_allclose(outd[:, 0].reshape(warps, WARP)[:, 0], xdw.sum(1), rtol=1e-14)
    np.testing.assert_array_equal(flat(scan(xdw)), outd[:, 1])
    np.testing.assert_allclose(outd[:, 1], flat(np.cumsum(xdw, 1)), rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.repeat(xiw.sum(1, dtype=np.int32), WARP), outi[:, 0])
    np.testing.assert_array_equal(np.repeat(xiw.max(1), WARP), outi[:, 1])
    # argmax (the probe passes NaN as -inf): ties to the lower lane
    ranked = np.where(np.isnan(xw), -np.inf, xw)
    expect_idx = ranked.argmax(1)
    np.testing.assert_array_equal(np.repeat(expect_idx, WARP), outi[:, 2])
    np.testing.assert_array_equal(
        np.repeat(ranked[np.arange(warps), expect_idx].astype(np.float32), WARP),
        outi[:, 3].view(np.float32))
