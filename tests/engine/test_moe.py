"""Mixture of experts (Mixtral, Qwen3-MoE) through the paged engine against transformers, and the
backends' two MoE ops against a naive per-token loop.

Fixtures (tests/fixtures/make_fixtures.py): tiny/mixtral_moe (8 experts, top-2, renormalized,
every layer sparse) and tiny/qwen3_moe (QK-norm, 6 experts, top-2, not renormalized, layer 1 a
dense MLP through mlp_only_layers). expected.npz holds transformers' greedy tokens and logits
for four prompts, and min_router_margin_<p>: the smallest gap between a token's k-th and
(k+1)-th router logit, so float32 rounding cannot flip an expert choice on the exact backend.

As in test_qwen3.py, the transformers prompts ride in mixes with chunked prefill, preemption and
prefix hits, next to random prompts whose oracle is the dense reference (runtime/reference.py:
its MoE is a per-token loop, independent of the grouped op); on cpu-bf16 tokens are compared
with the same backend serving each request alone, logprobs within the backend's tolerance.
The sim backend runs when its backend has the MoE ops (cuda/moe.cu, another change).
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from engine_helpers import (
    ENGINE_BACKENDS,
    EngineModel,
    greedy,
    make_engine,
    random_prompts,
    reference_greedy,
    run_requests,
)
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.backends.cpu_bf16_backend import CpuBf16Backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.reference import moe_route_token, silu
from pagedrun.runtime.weights import load_model_weights

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
MOE_FIXTURES = ("mixtral_moe", "qwen3_moe")
HF_PROMPT_LENGTHS = (1, 5, 13, 21)
MAX_MODEL_LEN = 128  # the fixtures' max_position_embeddings
# The fixtures' routing must stand clear of float32 noise (~1e-6 on router logits).
MIN_ROUTER_MARGIN = 1e-3


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _backend_class(name: str):
    if name == "sim":  # the sim device's backend class (over the harness runtime)
        from pagedrun.runtime.backends.kernel_backend import KernelBackend
        return KernelBackend
    return {"cpu": NumpyBackend, "cpu-bf16": CpuBf16Backend}[name]


@pytest.fixture(scope="module", params=MOE_FIXTURES)
def fixture_name(request):
    return request.param


@pytest.fixture(scope="module", params=list(ENGINE_BACKENDS))
def tiny_model(request, fixture_name):
    """A MoE fixture on each engine backend (named like conftest's fixture so that
    --engine-backends deselects the other backends here too); head_dim 64, which the sim
    attention kernels serve."""
    if not hasattr(_backend_class(request.param), "moe_experts"):
        pytest.skip(f"backend {request.param} has no moe_route / moe_experts ops yet")
    model_dir = TINY_DIR / fixture_name
    config = ModelConfig.from_model_dir(model_dir)
    assert config.num_experts and config.head_dim == 64
    model = EngineModel(config, load_model_weights(model_dir, config),
                        ENGINE_BACKENDS[request.param])
    model.fixture_name = fixture_name
    return model


def hf_cases(name: str) -> list[tuple[list[int], list[int], np.ndarray]]:
    """(prompt, transformers' greedy tokens, its logits [P + N - 1, vocab]) per fixture prompt."""
    data = np.load(TINY_DIR / name / "expected.npz")
    return [(data[f"prompt_{n}"].tolist(), data[f"generated_{n}"].tolist(), data[f"logits_{n}"])
            for n in HF_PROMPT_LENGTHS]


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_fixture_routing_is_not_near_tied(name):
    data = np.load(TINY_DIR / name / "expected.npz")
    margins = [float(data[f"min_router_margin_{n}"]) for n in HF_PROMPT_LENGTHS]
    assert min(margins) > MIN_ROUTER_MARGIN


def _mix(model, seed: int, num_random: int, max_tokens_hi: int = 10):
    """The transformers prompts and random prompts sharing a 24-token prefix, at random steps."""
    rng = np.random.default_rng(seed)
    vocab = model[0].vocab_size
    shared = rng.integers(3, vocab, 24).tolist()
    requests = [(int(rng.integers(0, 6)), f"hf-{i}",
                 dict(prompt_token_ids=prompt, sampling_params=greedy(len(generated))))
                for i, (prompt, generated, _) in enumerate(hf_cases(model.fixture_name))]
    for i, prompt in enumerate(random_prompts(rng, vocab, num_random, 90, shared_prefix=shared)):
        requests.append((int(rng.integers(0, 12)), f"rand-{i}",
                         dict(prompt_token_ids=prompt,
                              sampling_params=greedy(int(rng.integers(1, max_tokens_hi + 1))))))
    return requests


def _check(model, engine, requests):
    outputs = run_requests(engine, requests)
    hf = hf_cases(model.fixture_name)
    for _, request_id, kwargs in requests:
        prompt, params = kwargs["prompt_token_ids"], kwargs["sampling_params"]
        got = outputs[request_id].outputs[0].token_ids
        assert got == reference_greedy(model, prompt, params.max_tokens), request_id
        if request_id.startswith("hf-") and model.backend.exact_reference:
            assert got == hf[int(request_id[3:].split("-")[0])][1], request_id
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return outputs, stats


def test_tokens_and_logprobs_match_transformers(tiny_model):
    """Greedy tokens, their logprobs and the prompts' logprobs against transformers' logits,
    the prompts chunked by a 7-token budget and batched with each other's decodes."""
    backend = tiny_model.backend
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7)
    cases = hf_cases(tiny_model.fixture_name)
    requests = [(i, f"hf-{i}", dict(prompt_token_ids=prompt, sampling_params=greedy(
        len(generated), logprobs=3, prompt_logprobs=2)))
        for i, (prompt, generated, _) in enumerate(cases)]
    outputs = run_requests(engine, requests)
    for i, (prompt, generated, hf_logits) in enumerate(cases):
        completion = outputs[f"hf-{i}"].outputs[0]
        if backend.exact_reference:
            assert completion.token_ids == generated
        else:
            assert completion.token_ids == reference_greedy(tiny_model, prompt, len(generated))
        full = prompt + generated
        lp = log_softmax(hf_logits)  # row j predicts token j + 1 of `full`
        # Compare while our tokens agree with transformers' (always on exact backends).
        same_context = next((k for k, (a, b) in enumerate(zip(completion.token_ids, generated))
                             if a != b), len(generated)) + 1
        for k, (position, token) in enumerate(zip(completion.logprobs[:same_context],
                                                  completion.token_ids)):
            row = lp[len(prompt) - 1 + k]
            assert abs(position[token].logprob - row[token]) < backend.logprob_atol
            top = np.argsort(-row, kind="stable")[:3]
            if backend.exact_reference:
                assert list(position)[:3] == top.tolist()
        prompt_lp = outputs[f"hf-{i}"].prompt_logprobs
        assert len(prompt_lp) == len(prompt) and prompt_lp[0] is None
        for j in range(1, len(prompt)):
            entry = prompt_lp[j][full[j]]
            assert abs(entry.logprob - lp[j - 1][full[j]]) < backend.logprob_atol


def test_mix_with_chunked_prefill(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=128,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7, max_num_seqs=6)
    _check(tiny_model, engine, _mix(tiny_model, 1, 8))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tiny_pool_preempts(tiny_model, preemption_mode):
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    swap_bytes = 64 * kv_bytes_per_block(tiny_model[0], 16) if preemption_mode == "swap" else 0
    # 10 blocks of 16 = 160 tokens for 12 requests of up to 90 + 12 tokens: constant preemption.
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=10,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=48,
                         preemption_mode=preemption_mode, swap_space_bytes=swap_bytes)
    _, stats = _check(tiny_model, engine, _mix(tiny_model, 2, 8, max_tokens_hi=12))
    assert stats["num_preemptions_total"] > 0


def test_prefix_hits(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=128,
                         max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
    requests = _mix(tiny_model, 3, 10)
    # The transformers prompts again, later: their cached blocks are hit.
    requests += [(40, f"{request_id}-again", kwargs) for _, request_id, kwargs in requests[:4]]
    outputs, _ = _check(tiny_model, engine, requests)
    assert engine.get_stats()["prefix_cache_hits"] > 0
    assert outputs["hf-3-again"].usage.cached_prompt_tokens >= 16


def test_steps_where_experts_get_no_tokens_and_all_tokens(tiny_model):
    """A prompt of one repeated token, prefilled alone: layer 0's attention output is the same
    for every position (identical values), so every token routes to the same experts there --
    those get all the step's tokens, the others none. Then a mix; every request still equals
    its oracle, and the recorded routing shows both extremes happened."""
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)
    ops = engine.runner.ops
    counts_per_call = []
    route = ops.moe_route

    def recording_route(router_logits, top_k, renormalize):
        ids, weights = route(router_logits, top_k, renormalize)
        counts_per_call.append(np.bincount(np.asarray(ids).reshape(-1),
                                           minlength=tiny_model[0].num_experts))
        return ids, weights

    ops.moe_route = recording_route
    try:
        requests = [(0, "repeat", dict(prompt_token_ids=[17] * 12, sampling_params=greedy(4)))]
        requests += [(3 + step, request_id, kwargs)
                     for step, request_id, kwargs in _mix(tiny_model, 4, 4)]
        _check(tiny_model, engine, requests)
    finally:
        del ops.moe_route
    num_tokens = [int(c.sum()) // tiny_model[0].num_experts_per_tok for c in counts_per_call]
    assert any(n >= 12 and (c == n).any() for c, n in zip(counts_per_call, num_tokens))
    assert any(n >= 12 and (c == 0).any() for c, n in zip(counts_per_call, num_tokens))


# ------------------------------------------------------------------------- the ops themselves

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
