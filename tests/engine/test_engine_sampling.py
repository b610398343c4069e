"""Sampling through the engine: seeds, n > 1 on shared blocks, logprobs, stop ids, EOS,
min_tokens."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine_helpers import (TINY_VOCAB, assert_top_logprobs, backend_of, greedy, make_engine,
                            random_prompts, reference_greedy, run_requests)
from pagedrun.runtime.llm import _merge
from pagedrun.runtime.reference import ReferenceModel
from pagedrun.runtime.sampler import log_softmax
from pagedrun.runtime.sampling_params import SamplingParams



def _random_params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=seed,
                          max_tokens=10, ignore_eos=True, repetition_penalty=1.1)


def test_seeded_sampling_reproducible_across_batch_compositions(tiny_model):
    rng = np.random.default_rng(3)
    target = rng.integers(3, TINY_VOCAB, 57).tolist()
    target_params = [_random_params(1234), SamplingParams(n=3, temperature=1.0, seed=99,
                                                          max_tokens=8, ignore_eos=True)]

    def run(others: int, budget: int, arrival: int):
        engine = make_engine(tiny_model, block_size=16, num_kv_blocks=256, max_model_len=512,
                             max_num_batched_tokens=budget, seed=others)
        requests = [(arrival, f"t{i}", dict(prompt_token_ids=target, sampling_params=p))
                    for i, p in enumerate(target_params)]
        for i, prompt in enumerate(random_prompts(rng, TINY_VOCAB, others, 200)):
            params = SamplingParams(temperature=1.0, max_tokens=int(rng.integers(1, 12)),
                                    ignore_eos=True, seed=None if i % 2 else i)
            requests.append((int(rng.integers(0, 6)), f"o{i}", dict(prompt_token_ids=prompt,
                                                                    sampling_params=params)))
        out = run_requests(engine, requests)
        return [[c.token_ids for c in out[f"t{i}"].outputs] for i in range(len(target_params))]

    alone = run(0, 2048, 0)
    assert run(9, 48, 3) == alone
    assert run(5, 13, 1) == alone
    assert len(set(map(tuple, alone[1]))) > 1  # the n = 3 siblings diverge


def test_parallel_sampling_shares_prompt_blocks(tiny_model):
    block_size, prompt_len, n = 16, 100, 4
    engine = make_engine(tiny_model, block_size=block_size, num_kv_blocks=64, max_model_len=512,
                         enable_prefix_caching=False)
    prompt = np.random.default_rng(5).integers(3, TINY_VOCAB, prompt_len).tolist()
    engine.add_request("par", prompt_token_ids=prompt,
                       sampling_params=SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=20,
                                                      ignore_eos=True))
    # Step until the first tokens exist (the fork happens in that step), then once more: every
    # sibling has written its first token's KV, copying the shared partial block on write.
    totals = None
    while totals is None or not totals.outputs[0].token_ids:
        for delta in engine.step():
            totals = _merge(totals, delta)
    for delta in engine.step():
        totals = _merge(totals, delta)
    stats = engine.get_stats()
    used = stats["num_total_blocks"] - stats["num_free_blocks"]
    unshared = n * math.ceil((prompt_len + 2) / block_size)
    shared = math.ceil((prompt_len + 2) / block_size) + (n - 1)  # full blocks shared, tails own
    assert used == shared < unshared
    while engine.has_unfinished_requests():
        for delta in engine.step():
            totals = _merge(totals, delta)
    outs = totals.outputs
    assert [c.index for c in outs] == list(range(n))
    assert all(len(c.token_ids) == 20 and c.finish_reason == "length" for c in outs)
    assert len({tuple(c.token_ids) for c in outs}) == n  # they diverge
    assert engine.get_stats()["num_free_blocks"] == stats["num_total_blocks"]


def _top_entries(position: dict, k: int) -> dict:
    """The top-k part of one position's {token_id: Logprob}: token -> logprob in rank order."""
    ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank <= k))
    return {t: logprob for _, t, logprob in ranked[:k]}


def test_logprobs_equal_reference_log_softmax(tiny_model):
    """vLLM's shape: per position {token_id: Logprob(logprob, rank, decoded_token)}, the
    sampled (or prompt) token first, then the top-k with ranks 1..k; cumulative_logprob the
    sum of the sampled tokens' logprobs."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, TINY_VOCAB, n).tolist() for n in (1, 37, 120)]
    # The shared prefix makes the third prompt a prefix-cache hit candidate: prompt logprobs
    # must still cover every position.
    prompts.append(prompts[2][:100] + prompts[1])
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=256, max_model_len=512,
                         max_num_batched_tokens=50)
    params = greedy(6, logprobs=5, prompt_logprobs=3)
    out = run_requests(engine, [(i, f"r{i}", dict(prompt_token_ids=p, sampling_params=params))
                                for i, p in enumerate(prompts)])
    ref = ReferenceModel(*tiny_model)
    backend = backend_of(tiny_model)
    for i, prompt in enumerate(prompts):
        completion = out[f"r{i}"].outputs[0]
        assert completion.token_ids == reference_greedy(tiny_model, prompt, 6)
        full = prompt + completion.token_ids
        lp = log_softmax(ref.forward(np.array(full[:-1])))  # row j predicts token j + 1
        assert len(completion.logprobs) == 6
        for k, position in enumerate(completion.logprobs):
            row = lp[len(prompt) - 1 + k]
            token = full[len(prompt) + k]
            assert next(iter(position)) == token  # the sampled token first
            assert abs(position[token].logprob - row[token]) < backend.logprob_atol
            assert position[token].decoded_token is None  # no tokenizer
            # Greedy: the sampled token is the top one, so the dict holds exactly the top 5.
            assert len(position) == 5
            assert [lp_.rank for lp_ in position.values()] == [1, 2, 3, 4, 5]
            assert_top_logprobs(_top_entries(position, 5), row, backend)
        assert completion.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids)))
        prompt_lp = out[f"r{i}"].prompt_logprobs
        assert len(prompt_lp) == len(prompt) and prompt_lp[0] is None
        for j in range(1, len(prompt)):
            position = prompt_lp[j]
            assert next(iter(position)) == prompt[j]
            entry = position[prompt[j]]
            assert abs(entry.logprob - lp[j - 1][prompt[j]]) < backend.logprob_atol
            if backend.exact_reference:
                assert entry.rank == 1 + int((lp[j - 1] > lp[j - 1][prompt[j]]).sum())
            assert len(position) == (3 if entry.rank <= 3 else 4)
            assert_top_logprobs(_top_entries(position, 3), lp[j - 1], backend)


def test_stop_token_ids_eos_and_min_tokens(tiny_model):
    config, weights = tiny_model
    prompt = np.random.default_rng(9).integers(3, TINY_VOCAB, 30).tolist()
    expected = reference_greedy(tiny_model, prompt, 16)
    stop_at = 5
    stop_id = expected[stop_at]
    first = expected.index(stop_id)
    engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=512)
    out = run_requests(engine, [(0, "s", dict(
        prompt_token_ids=prompt, sampling_params=greedy(16, stop_token_ids=[stop_id])))])
    c = out["s"].outputs[0]
    assert c.token_ids == expected[:first + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)

    # The same token as the model's EOS: stops unless ignore_eos; min_tokens holds it back.
    eos_model = tiny_model.with_config(eos_token_id=stop_id)
    engine = make_engine(eos_model, num_kv_blocks=64, max_model_len=512)
    out = run_requests(engine, [
        (0, "eos", dict(prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=16))),
        (0, "ign", dict(prompt_token_ids=prompt, sampling_params=greedy(16))),
        (0, "min", dict(prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=16, min_tokens=first + 3))),
    ])
    assert out["eos"].outputs[0].token_ids == expected[:first + 1]
    assert (
        (out["eos"].outputs[0].finish_reason, out["eos"].outputs[0].stop_reason) == ("stop", None)
    )
    assert out["ign"].outputs[0].token_ids == expected
    min_out = out["min"].outputs[0].token_ids
    assert len(min_out) >= first + 3 and stop_id not in min_out[:first + 3]


def test_max_model_len_ends_with_length(tiny_model):
    prompt = list(range(3, 3 + 60))
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64, max_model_len=64)
    out = run_requests(engine, [(0, "m", dict(prompt_token_ids=prompt,
                                              sampling_params=SamplingParams(temperature=0.0,
                                                                             max_tokens=None,
                                                                             ignore_eos=True)))])
    c = out["m"].outputs[0]
    assert c.finish_reason == "length"
    assert len(prompt) + len(c.token_ids) == 64
    assert c.token_ids == reference_greedy(tiny_model, prompt, 4)


def test_prompt_logprobs_survive_recompute_preemption(tiny_model):
    """A pool too small for all prompts at once preempts mid-prompt; recomputed chunks do not
    line up with the first pass, yet every prompt position gets exactly one logprob."""
    rng = np.random.default_rng(12)
    prompts = [rng.integers(3, TINY_VOCAB, n).tolist() for n in (150, 170, 90, 200)]
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=20, max_model_len=320,
                         max_num_batched_tokens=37)
    params = greedy(8, prompt_logprobs=1)
    out = run_requests(engine, [(0, f"r{i}", dict(prompt_token_ids=p, sampling_params=params))
                                for i, p in enumerate(prompts)])
    assert engine.get_stats()["num_preemptions_total"] > 0
    ref = ReferenceModel(*tiny_model)
    for i, prompt in enumerate(prompts):
        lp = log_softmax(ref.forward(np.array(prompt)))
        got = out[f"r{i}"].prompt_logprobs
        assert len(got) == len(prompt)
        assert np.allclose([g[prompt[j]].logprob for j, g in enumerate(got) if j],
                           [lp[j - 1][prompt[j]] for j in range(1, len(prompt))],
                           atol=backend_of(tiny_model).logprob_atol)
        assert out[f"r{i}"].outputs[0].token_ids == reference_greedy(tiny_model, prompt, 8)
