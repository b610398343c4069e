"""Greedy outputs of the paged engine equal the dense reference's, request by request.

Random mixes (up to 32 requests, prompt lengths 1..300, random arrival steps) under every
condition that changes how a request's tokens are batched and where its KV lives: a small token
budget (chunked prefill), a tiny pool (preemption by recompute and by swap), prefix caching on
and off, block sizes 8, 16 and 32.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import (
    TINY_VOCAB,
    greedy,
    make_engine,
    random_prompts,
    reference_greedy,
    run_requests,
)

MAX_PROMPT_LEN = 300


def _mix(seed: int, num_requests: int, max_tokens_hi: int = 12):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, TINY_VOCAB, 40).tolist()
    prompts = random_prompts(rng, TINY_VOCAB, num_requests, MAX_PROMPT_LEN, shared_prefix=shared)
    prompts[0] = prompts[0][:1]  # always one 1-token prompt
    requests = []
    for i, prompt in enumerate(prompts):
        max_tokens = int(rng.integers(1, max_tokens_hi + 1))
        requests.append((int(rng.integers(0, 12)), f"req-{i}",
                         dict(prompt_token_ids=prompt, sampling_params=greedy(max_tokens))))
    return requests


def _check(tiny_model, engine, requests):
    outputs = run_requests(engine, requests)
    for _, request_id, kwargs in requests:
        prompt, params = kwargs["prompt_token_ids"], kwargs["sampling_params"]
        out = outputs[request_id]
        assert out.finished
        got = out.outputs[0].token_ids
        assert got == reference_greedy(tiny_model, prompt, params.max_tokens), request_id
        assert out.outputs[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == params.max_tokens
    stats = engine.get_stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return stats


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_random_mix_block_sizes(tiny_model, block_size):
    engine = make_engine(tiny_model, block_size=block_size, num_kv_blocks=4096 // block_size,
                         max_model_len=512)
    _check(tiny_model, engine, _mix(block_size, 32))


@pytest.mark.parametrize("budget", [7, 64])
def test_chunked_prefill_small_budget(tiny_model, budget):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=256, max_model_len=512,
                         max_num_batched_tokens=budget, max_num_seqs=8)
    _check(tiny_model, engine, _mix(100 + budget, 16))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tiny_pool_preempts(tiny_model, preemption_mode):
    # 24 blocks of 16 = 384 tokens for 20 requests of up to 300 + 24 tokens: constant preemption.
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    swap_bytes = 64 * kv_bytes_per_block(tiny_model[0], 16) if preemption_mode == "swap" else 0
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=24, max_model_len=384,
                         max_num_batched_tokens=96, preemption_mode=preemption_mode,
                         swap_space_bytes=swap_bytes)
    stats = _check(tiny_model, engine, _mix(7, 20, max_tokens_hi=24))
    assert stats["num_preemptions_total"] > 0


def test_prefix_caching_on_off_identical_and_hits_counted(tiny_model):
    requests = _mix(11, 24)
    results = {}
    for enabled in (False, True):
        engine = make_engine(tiny_model, block_size=16, num_kv_blocks=512, max_model_len=512,
                             enable_prefix_caching=enabled)
        outputs = run_requests(engine, requests)
        results[enabled] = {k: v.outputs[0].token_ids for k, v in outputs.items()}
        cached = sum(v.usage.cached_prompt_tokens for v in outputs.values())
        hits = engine.get_stats()["prefix_cache_hits"]
        if enabled:
            assert cached > 0 and hits > 0
        else:
            assert cached == 0 and hits == 0
    assert results[True] == results[False]
    for _, request_id, kwargs in requests:
        assert results[True][request_id] == reference_greedy(
            tiny_model, kwargs["prompt_token_ids"], kwargs["sampling_params"].max_tokens)
