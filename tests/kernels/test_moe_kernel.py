"""cuda/moe.cu (through runtime/kernels/moe.py and the KernelBackend ops) against references
written here: routing exactly (ids) and to 1e-6 (weights), the permutation and tile table
exactly, the fused experts against a per-token float64 loop on the same rounded inputs. Awkward
sizes (1, 17, 111 tokens; E 4 / 8; top-k 1 / 2; hidden and intermediate not multiples of the
tiles), experts with no token (their weights NaN-poisoned: never read) and all tokens on one
expert, outputs prefilled with NaN, and the refused shapes."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import as_kernel_dtype, kernel_module, result_f32, to_device, to_host
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.backends.kernel_devices import sim_backend
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.kernels.moe import (GEMM_TILE_ROWS, max_gemm_tiles, moe_experts,
                                          moe_permute, moe_route)

# The kernel rounds the SiLU-mul activation to the input dtype (the reference does too) and y
# once; left: fp32 summation order, and an activation within rounding of a tie flipping by
# one 16-bit ulp. |kernel - reference| <= atol + rtol * max|reference|.
MOE_TOL = {"f32": dict(atol=1e-5, rtol=1e-5), "f16": dict(atol=2e-3, rtol=2e-3),
           "bf16": dict(atol=1.6e-2, rtol=1.6e-2)}
ROUTE_WEIGHT_ATOL = 1e-6
SIZES = [(1, 4, 1), (17, 8, 2), (111, 8, 2), (17, 4, 1)]  # (num_tokens, num_experts, top_k)


def module():
    return kernel_module("moe.cu")


def reference_route(logits: np.ndarray, top_k: int, renormalize: bool):
    """Written independently of numpy_ops: per row, a Python sort on (-p, id)."""
    ids = np.zeros((len(logits), top_k), np.int32)
    weights = np.zeros((len(logits), top_k), np.float64)
    for t, row in enumerate(logits.astype(np.float64)):
        p = np.exp(row - row.max())
        p /= p.sum()
        chosen = sorted(range(len(p)), key=lambda e: (-np.float32(p[e]), e))[:top_k]
        ids[t] = chosen
        weights[t] = p[chosen]
        if renormalize:
            weights[t] /= weights[t].sum()
    return ids, weights


@pytest.mark.parametrize("num_tokens,num_experts,top_k", SIZES)
@pytest.mark.parametrize("renormalize", (True, False))
def test_route(rng, num_tokens, num_experts, top_k, renormalize):
    logits = (3 * rng.standard_normal((num_tokens, num_experts))).astype(np.float32)
    logits[0, :2] = logits[0, 2:4] if num_experts >= 4 else logits[0, :2]  # exact ties
    out_ids = to_device(np.full((num_tokens, top_k), -7, np.int32))
    out_w = to_device(np.full((num_tokens, top_k), np.nan, np.float32))
    ids, weights = moe_route(module(), to_device(logits), top_k, renormalize, out_ids=out_ids,
                             out_weights=out_w)
    exp_ids, exp_w = reference_route(logits, top_k, renormalize)
    np.testing.assert_array_equal(to_host(ids), exp_ids)
    np.testing.assert_allclose(to_host(weights), exp_w, atol=ROUTE_WEIGHT_ATOL, rtol=0)
    np_ids, _ = numpy_ops.moe_route(logits, top_k, renormalize)
    np.testing.assert_array_equal(to_host(ids), np_ids)  # the backends agree on ties


def test_route_ties_go_to_the_lower_id():
    logits = np.zeros((3, 8), np.float32)
    logits[1, [2, 5, 6]] = 1.0
    ids, weights = moe_route(module(), to_device(logits), 3, False)
    np.testing.assert_array_equal(to_host(ids), [[0, 1, 2], [2, 5, 6], [0, 1, 2]])
    np.testing.assert_allclose(to_host(weights)[0], 1 / 8, atol=ROUTE_WEIGHT_ATOL)


def _ids(rng, num_tokens, num_experts, top_k, pattern):
    """Distinct experts per token: random, every token on expert 0 (top-1), or experts
    1 and 3 never chosen."""
    if pattern == "one_expert":
        base = np.zeros((num_tokens, 1), np.int64)
        return (base + np.arange(top_k)).astype(np.int32)
    pool = np.arange(num_experts)
    if pattern == "gaps":
        pool = np.setdiff1d(pool, [1, 3])
    return np.stack([rng.choice(pool, top_k, replace=False) for _ in range(num_tokens)]
                    ).astype(np.int32)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", SIZES)
@pytest.mark.parametrize("pattern", ("random", "one_expert", "gaps"))
def test_permute(rng, num_tokens, num_experts, top_k, pattern):
    ids = _ids(rng, num_tokens, num_experts, top_k, pattern)
    perm = moe_permute(module(), to_device(ids), num_experts)
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(to_host(perm.sorted_pair_ids), order)
    slots = np.empty_like(order)
    slots[order] = np.arange(order.size)
    np.testing.assert_array_equal(to_host(perm.pair_slots), slots)
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    np.testing.assert_array_equal(to_host(perm.expert_offsets), offsets)
    tiles = [(e, offsets[e] + j * GEMM_TILE_ROWS) for e in range(num_experts)
             for j in range(-(-counts[e] // GEMM_TILE_ROWS))]
    assert perm.max_tiles == max_gemm_tiles(flat.size, num_experts) >= len(tiles)
    tile_experts = to_host(perm.tile_experts)
    np.testing.assert_array_equal(tile_experts[:len(tiles)], [e for e, _ in tiles])
    np.testing.assert_array_equal(to_host(perm.tile_rows)[:len(tiles)], [r for _, r in tiles])
    assert (tile_experts[len(tiles):] == -1).all()


def reference_experts(x, ids, weights, w_gate_up, w_down, dt):
    """Per token, per choice, in float64; the SiLU-mul activation rounded to dt as the
    kernel stores it."""
    inter = w_down.shape[2]
    y = np.zeros((x.shape[0], x.shape[1]), np.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gu = w_gate_up[e].astype(np.float64) @ x[t]
            g, u = gu[:inter], gu[inter:]
            act = as_kernel_dtype(g / (1 + np.exp(-g)) * u, dt)[1]
            y[t] += weights[t, k] * (w_down[e].astype(np.float64) @ act)
    return y


def _assert_moe_close(got, expected, dt, what):
    tol = MOE_TOL[dt]
    bound = tol["atol"] + tol["rtol"] * np.abs(expected).max()
    err = np.abs(got - expected)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    assert err.max() <= bound, f"{what}: max error {err.max():.3g} > {bound:.3g}"


@pytest.mark.parametrize("dt", ("f32", "f16", "bf16"))
@pytest.mark.parametrize("num_tokens,num_experts,top_k", SIZES)
@pytest.mark.parametrize("pattern", ("random", "one_expert", "gaps"))
def test_experts(rng, dt, num_tokens, num_experts, top_k, pattern):
    hidden, inter = (72, 40) if dt != "f32" else (37, 19)  # partial tiles on every axis
    ids = _ids(rng, num_tokens, num_experts, top_k, pattern)
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    x, x_ref = as_kernel_dtype(rng.standard_normal((num_tokens, hidden)), dt)
    w_gu, w_gu_ref = as_kernel_dtype(
        rng.standard_normal((num_experts, 2 * inter, hidden)) / np.sqrt(hidden), dt)
    w_d, w_d_ref = as_kernel_dtype(
        rng.standard_normal((num_experts, hidden, inter)) / np.sqrt(inter), dt)
    unused = np.setdiff1d(np.arange(num_experts), ids)
    poison = {"f32": np.float32(np.nan), "f16": np.float16(np.nan), "bf16": np.uint16(0x7FC0)}
    w_gu[unused] = poison[dt]  # an expert without tokens must cost (and read) nothing
    w_d[unused] = poison[dt]
    out = to_device(np.full_like(x, poison[dt]))
    y = moe_experts(module(), to_device(x), to_device(ids), to_device(weights), to_device(w_gu),
                    to_device(w_d), out=out)
    assert y is out
    expected = reference_experts(x_ref, ids, weights, w_gu_ref, w_d_ref, dt)
    _assert_moe_close(result_f32(y, dt), expected, dt, f"moe_experts {dt} {pattern}")


@pytest.mark.parametrize("dtype_name,dt", [("float32", "f32"), ("bfloat16", "bf16")])
def test_backend_ops_match_numpy(rng, dtype_name, dt):
    """the sim backend's moe_route / moe_experts on the model's float32 host weights, against
    numpy_ops (the cpu backend) on the same rounded values."""
    backend = sim_backend(dtype_name)
    num_tokens, num_experts, top_k, hidden, inter = 19, 8, 2, 64, 48
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    ids, weights = backend.moe_route(backend.to_device(logits), top_k, True)
    np_ids, np_weights = numpy_ops.moe_route(logits, top_k, True)
    np.testing.assert_array_equal(to_host(ids), np_ids)
    np.testing.assert_allclose(to_host(weights), np_weights, atol=ROUTE_WEIGHT_ATOL)
    w_gu = as_kernel_dtype(rng.standard_normal((num_experts, 2 * inter, hidden)) / 8, dt)[1]
    w_d = as_kernel_dtype(rng.standard_normal((num_experts, hidden, inter)) / 7, dt)[1]
    x, x_ref = as_kernel_dtype(rng.standard_normal((num_tokens, hidden)), dt)
    y = backend.moe_experts(backend.to_device(x), ids, weights, w_gu, w_d)
    assert backend.moe_experts(backend.to_device(x), ids, weights, w_gu, w_d).dtype == y.dtype
    assert len(backend._weights) == 2  # placed once, reused by the second call
    expected = numpy_ops.moe_experts(x_ref, np_ids, np_weights, w_gu, w_d)
    _assert_moe_close(backend.to_host(y), expected, dt, f"backend {dtype_name}")


def test_refused_shapes(rng):
    ids = np.zeros((3, 2), np.int32)
    ids[:, 1] = 1
    w = np.ones((3, 2), np.float32)
    x, _ = as_kernel_dtype(rng.standard_normal((3, 36)), "bf16")
    w_gu, _ = as_kernel_dtype(np.ones((4, 16, 36)), "bf16")
    w_d, _ = as_kernel_dtype(np.ones((4, 36, 8)), "bf16")
    with pytest.raises(UnsupportedKernelShape, match="% 8"):  # 16-byte chunks need H % 8
        moe_experts(module(), x, ids, w, w_gu, w_d)
    with pytest.raises(UnsupportedKernelShape, match="in \\[0, 4\\)"):
        moe_permute(module(), np.full((3, 2), 4, np.int32), 4)
    with pytest.raises(UnsupportedKernelShape, match="top_k"):
        moe_route(module(), np.zeros((3, 4), np.float32), 5, True)
    with pytest.raises(UnsupportedKernelShape, match="w_down"):
        moe_experts(module(), x, ids, w, w_gu, w_d[:, :, :4])
