"""Qwen3 (QK-norm, head_dim 64 != hidden / heads, tied) through the paged engine on every engine
backend, against transformers: tests/fixtures/tiny/qwen3_tied/expected.npz holds transformers'
greedy tokens and logits for four prompts (tests/fixtures/make_fixtures.py).

The four transformers prompts ride in every mix -- chunked prefill under a 7-token budget,
preemption in a tiny pool, prefix-cache hits on a shared prefix -- next to random prompts whose
oracle is the dense reference (runtime/reference.py, itself checked against transformers on
this fixture in tests/foundation/test_reference.py). On cpu-bf16 the GEMM inputs are rounded,
so there tokens are compared with the same backend serving each request alone and logprobs
within the backend's tolerance (engine_helpers.EngineBackend).
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
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import load_model_weights

QWEN3_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3_tied"
HF_PROMPT_LENGTHS = (1, 5, 13, 21)
MAX_MODEL_LEN = 128  # the fixture's max_position_embeddings


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=list(ENGINE_BACKENDS))
def tiny_model(request):
    """The Qwen3 fixture on each engine backend. Named like conftest's fixture so that
    --engine-backends deselects the other backends' cases here too. No backend overrides:
    head_dim 64 is one the sim attention kernels serve."""
    config = ModelConfig.from_model_dir(QWEN3_DIR)
    assert config.qk_norm and config.head_dim == 64
    return EngineModel(config, load_model_weights(QWEN3_DIR, config),
                       ENGINE_BACKENDS[request.param])


def hf_cases() -> list[tuple[list[int], list[int], np.ndarray]]:
    """(prompt, transformers' greedy tokens, its logits [P + N - 1, vocab]) per fixture prompt."""
    data = np.load(QWEN3_DIR / "expected.npz")
    return [(data[f"prompt_{n}"].tolist(), data[f"generated_{n}"].tolist(), data[f"logits_{n}"])
            for n in HF_PROMPT_LENGTHS]


def _mix(model, seed: int, num_random: int, max_tokens_hi: int = 10):
    """The transformers prompts (10 tokens each) and random prompts sharing a 24-token prefix,
    arriving at random steps."""
    rng = np.random.default_rng(seed)
    vocab = model[0].vocab_size
    shared = rng.integers(3, vocab, 24).tolist()
    requests = [(int(rng.integers(0, 6)), f"hf-{i}",
                 dict(prompt_token_ids=prompt, sampling_params=greedy(len(generated))))
                for i, (prompt, generated, _) in enumerate(hf_cases())]
    for i, prompt in enumerate(random_prompts(rng, vocab, num_random, 90, shared_prefix=shared)):
        requests.append((int(rng.integers(0, 12)), f"rand-{i}",
                         dict(prompt_token_ids=prompt,
                              sampling_params=greedy(int(rng.integers(1, max_tokens_hi + 1))))))
    return requests


def _check(model, engine, requests):
    outputs = run_requests(engine, requests)
    hf = hf_cases()
    for _, request_id, kwargs in requests:
        prompt, params = kwargs["prompt_token_ids"], kwargs["sampling_params"]
        got = outputs[request_id].outputs[0].token_ids
        assert got == reference_greedy(model, prompt, params.max_tokens), request_id
        if request_id.startswith("hf-") and model.backend.exact_reference:
            assert got == hf[int(request_id[3:])][1], request_id
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return stats


def test_tokens_and_logprobs_match_transformers(tiny_model):
    """Greedy tokens, their logprobs and the prompts' logprobs against transformers' logits,
    the prompts chunked by a 7-token budget and batched with each other's decodes."""
    backend = tiny_model.backend
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7)
    requests = [(i, f"hf-{i}", dict(prompt_token_ids=prompt, sampling_params=greedy(
        len(generated), logprobs=3, prompt_logprobs=2)))
        for i, (prompt, generated, _) in enumerate(hf_cases())]
    outputs = run_requests(engine, requests)
    for i, (prompt, generated, hf_logits) in enumerate(hf_cases()):
        completion = outputs[f"hf-{i}"].outputs[0]
        if backend.exact_reference:
            assert completion.token_ids == generated
        else:
            assert completion.token_ids == reference_greedy(tiny_model, prompt, len(generated))
        full = prompt + generated
        lp = log_softmax(hf_logits)  # row j predicts token j + 1 of `full`
        # Row k of transformers' logits has context prompt + generated[:k]: compare while our
        # tokens agree with its (always on exact backends; bf16 may take a near-tie otherwise).
        same_context = next((k for k, (a, b) in enumerate(zip(completion.token_ids, generated))
                             if a != b), len(generated)) + 1
        for k, (position, token) in enumerate(zip(completion.logprobs[:same_context],
                                                  completion.token_ids)):
            row = lp[len(prompt) - 1 + k]
            assert abs(position[token].logprob - row[token]) < backend.logprob_atol
            # The top 3 of transformers, in its order, at its values.
            top = np.argsort(-row, kind="stable")[:3]
            if backend.exact_reference:
                assert list(position)[:3] == top.tolist()
            assert np.allclose([position[t].logprob for t in position if t in top],
                               row[[t for t in position if t in top]],
                               atol=backend.logprob_atol)
        prompt_lp = outputs[f"hf-{i}"].prompt_logprobs
        assert len(prompt_lp) == len(prompt) and prompt_lp[0] is None
        for j in range(1, len(prompt)):
            entry = prompt_lp[j][full[j]]
            assert abs(entry.logprob - lp[j - 1][full[j]]) < backend.logprob_atol


def test_mix_with_chunked_prefill(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=128,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7, max_num_seqs=6)
    _check(tiny_model, engine, _mix(tiny_model, 1, 10))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tiny_pool_preempts(tiny_model, preemption_mode):
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    swap_bytes = 64 * kv_bytes_per_block(tiny_model[0], 16) if preemption_mode == "swap" else 0
    # 10 blocks of 16 = 160 tokens for 14 requests of up to 90 + 12 tokens: constant preemption.
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=10,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=48,
                         preemption_mode=preemption_mode, swap_space_bytes=swap_bytes)
    stats = _check(tiny_model, engine, _mix(tiny_model, 2, 10, max_tokens_hi=12))
    assert stats["num_preemptions_total"] > 0


def test_prefix_hits(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=128,
                         max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
    requests = _mix(tiny_model, 3, 12)
    # The transformers prompts again, later: their cached blocks are hit.
    requests += [(40, f"{request_id}-again", kwargs) for _, request_id, kwargs in requests[:4]]
    outputs = run_requests(engine, requests)
    hf = hf_cases()
    for _, request_id, kwargs in requests:
        got = outputs[request_id].outputs[0].token_ids
        prompt, params = kwargs["prompt_token_ids"], kwargs["sampling_params"]
        assert got == reference_greedy(tiny_model, prompt, params.max_tokens), request_id
        if request_id.startswith("hf-") and tiny_model.backend.exact_reference:
            assert got == hf[int(request_id[3:].split("-")[0])][1], request_id
    assert engine.get_stats()["prefix_cache_hits"] > 0
    again = outputs["hf-3-again"]  # 21-token prompt: one full block of 16 cached
    assert again.usage.cached_prompt_tokens >= 16
