"""The backends' two MoE ops (moe_route, moe_experts) against a naive per-token loop: random and
planted routings (every token on two experts, the others none; only the first and last expert),
awkward token counts, a token listing one expert twice, no tokens at all, refused inputs.

The MoE families through the engine: test_model_families.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.backends.cpu_bf16_backend import CpuBf16Backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.reference import moe_route_token, silu

def naive_moe(x, topk_ids, topk_weights, w_gate_up, w_down) -> np.ndarray:
    """moe_experts' contract, token by token, in float64."""
    inter = w_gate_up.shape[1] // 2
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for e, weight in zip(topk_ids[t], topk_weights[t]):
            gate_up = w_gate_up[e].astype(np.float64) @ x[t]
            act = silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weight * (w_down[e].astype(np.float64) @ act)
    return out


def _expert_weights(rng, num_experts: int, hidden: int, inter: int):
    w_gate_up = (rng.standard_normal((num_experts, 2 * inter, hidden)) / np.sqrt(hidden))
    w_down = (rng.standard_normal((num_experts, hidden, inter)) / np.sqrt(inter))
    return w_gate_up.astype(np.float32), w_down.astype(np.float32)


def _routing(kind: str, rng, num_tokens: int, num_experts: int, top_k: int):
    """Planted topk ids: random; every token on experts {1, 4} (the rest get none); only the
    last expert and expert 0."""
    if kind == "random":
        ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)])
    elif kind == "all_to_two":
        ids = np.tile([4, 1], (num_tokens, 1))
    else:
        ids = np.tile([num_experts - 1, 0], (num_tokens, 1))
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k))
    return ids.astype(np.int32), weights.astype(np.float32)


# bf16 rounds x, the weights and the activation between the two GEMMs (2^-9 relative each).
OP_TOLERANCE = {"cpu": (1e-5, 1e-5), "cpu-bf16": (2e-2, 2e-2)}


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-bf16"])
@pytest.mark.parametrize("kind", ["random", "all_to_two", "last_and_first"])
@pytest.mark.parametrize("num_tokens", [1, 17, 111])
def test_moe_experts_against_naive_loop(backend_name, kind, num_tokens):
    rng = np.random.default_rng(num_tokens)
    num_experts, hidden, inter, top_k = 6, 40, 24, 2
    w_gate_up, w_down = _expert_weights(rng, num_experts, hidden, inter)
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    ids, weights = _routing(kind, rng, num_tokens, num_experts, top_k)
    backend = NumpyBackend() if backend_name == "cpu" else CpuBf16Backend()
    got = backend.moe_experts(x, ids, weights, w_gate_up, w_down)
    assert got.shape == x.shape and got.dtype == np.float32
    rtol, atol = OP_TOLERANCE[backend_name]
    np.testing.assert_allclose(got, naive_moe(x, ids, weights, w_gate_up, w_down),
                               rtol=rtol, atol=atol)


def test_moe_experts_zero_tokens_and_repeated_expert():
    """No tokens at all: an empty result; a token listing one expert twice gets it twice."""
    rng = np.random.default_rng(0)
    w_gate_up, w_down = _expert_weights(rng, 4, 8, 6)
    empty = numpy_ops.moe_experts(np.zeros((0, 8), np.float32), np.zeros((0, 2), np.int32),
                                  np.zeros((0, 2), np.float32), w_gate_up, w_down)
    assert empty.shape == (0, 8)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    ids = np.array([[2, 2], [0, 3], [2, 2]], np.int32)
    weights = np.array([[0.25, 0.5]] * 3, np.float32)
    np.testing.assert_allclose(numpy_ops.moe_experts(x, ids, weights, w_gate_up, w_down),
                               naive_moe(x, ids, weights, w_gate_up, w_down), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("bad", ["id_range", "weights_shape", "down_shape"])
def test_moe_experts_refuses_bad_inputs(bad):
    rng = np.random.default_rng(1)
    w_gate_up, w_down = _expert_weights(rng, 4, 8, 6)
    x = np.ones((2, 8), np.float32)
    ids, weights = np.array([[0, 1], [2, 3]], np.int32), np.ones((2, 2), np.float32)
    if bad == "id_range":
        ids[1, 1] = 4
    elif bad == "weights_shape":
        weights = weights[:, :1]
    else:
        w_down = w_down[:, :, :5]
    with pytest.raises(ValueError):
        numpy_ops.moe_experts(x, ids, weights, w_gate_up, w_down)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 17, 111])
def test_moe_route_against_per_token_reference(num_tokens, renormalize):
    rng = np.random.default_rng(num_tokens)
    logits = (3 * rng.standard_normal((num_tokens, 8))).astype(np.float32)
    logits[0, [2, 5, 6]] = 9.0  # a three-way tie at the top: lower ids first, id 6 dropped
    ids, weights = numpy_ops.moe_route(logits, 2, renormalize)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    assert ids.shape == weights.shape == (num_tokens, 2)
    assert ids[0].tolist() == [2, 5]
    for t in range(num_tokens):
        want_ids, want_weights = moe_route_token(logits[t], 2, renormalize)
        assert ids[t].tolist() == want_ids
        np.testing.assert_allclose(weights[t], want_weights, rtol=1e-6)
    if renormalize:
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    else:
        assert (weights.sum(axis=1) < 1.0).all()


def test_moe_route_refuses_top_k_past_the_experts():
    with pytest.raises(ValueError):
        numpy_ops.moe_route(np.zeros((2, 3), np.float32), 4, True)
