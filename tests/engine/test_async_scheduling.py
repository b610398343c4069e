"""Asynchronous scheduling (runtime/engine/async_stepper.py) == synchronous stepping, on the sim
backend (the cuda backend's code; its sampler leaves the token ids on the "device").

Step N+1 is scheduled and launched before N's tokens are read back, so a stop found at N (a
stop token id, EOS, a stop string) is known one step late: these mixes are built so that such
late stops happen (stop ids taken from the greedy continuations), next to length limits,
preemption by recompute and by swap, prefix hits, seeded sampling, aborts and requests that
force synchronous steps (penalties, n > 1). Every token, text and finish reason must be the
synchronous engine's, every block must come back, and placeholders must never reach the
prefix cache.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import (ENGINE_BACKENDS, TINY_VOCAB, EngineModel, PieceTokenizer,
                            make_engine, random_prompts, random_weights, reference_greedy,
                            run_requests, tiny_config)
from pagedrun.runtime.engine_config import EngineConfigError
from pagedrun.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def sim_model():
    spec = ENGINE_BACKENDS["sim"]
    config = tiny_config(**spec.model_overrides)
    return EngineModel(config, random_weights(config), spec)


def _mix(model, seed: int, num: int, *, stop_strings: bool = False):
    """Greedy requests whose stop id is a token of their own greedy continuation (so they stop
    early, found one step late), seeded sampled ones, and a few plain length-limited ones."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, TINY_VOCAB, 20).tolist()
    prompts = random_prompts(rng, TINY_VOCAB, num, 60, shared_prefix=shared)
    tokenizer = PieceTokenizer()
    requests = []
    for i, prompt in enumerate(prompts):
        max_tokens = int(rng.integers(6, 16))
        if i % 4 == 1:
            params = SamplingParams(temperature=0.9, top_k=40, seed=500 + i,
                                    max_tokens=max_tokens, ignore_eos=True)
        elif i % 4 == 3:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    logprobs=2)
        else:
            greedy = reference_greedy(model, prompt, max_tokens)
            at = int(rng.integers(1, max_tokens - 1))
            if stop_strings:
                text = tokenizer.decode(greedy[:at + 1])
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                        ignore_eos=True, stop=[text[-2:]])
            else:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                        ignore_eos=True, stop_token_ids=[greedy[at]])
        requests.append((int(rng.integers(0, 8)), f"r{i}",
                         dict(prompt_token_ids=prompt, sampling_params=params)))
    return requests, tokenizer


def _engine(model, asynchronous: bool, tokenizer=None, **kw):
    kw.setdefault("num_kv_blocks", 64)
    return make_engine(model, tokenizer, block_size=16, max_model_len=96, max_num_seqs=8,
                       max_num_batched_tokens=64, async_scheduling=asynchronous, **kw)


def _summary(outputs) -> dict:
    return {(rid, c.index): (c.token_ids, c.finish_reason, c.text,
                             None if c.logprobs is None else [list(lp) for lp in c.logprobs])
            for rid, out in outputs.items() for c in out.outputs}


def _assert_clean(engine) -> dict:
    stats = engine.get_stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return stats


@pytest.mark.parametrize("preemption_mode,graphs", [("recompute", False), ("swap", True)])
def test_async_equals_sync_with_late_stops(sim_model, preemption_mode, graphs):
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    requests, _ = _mix(sim_model, 4, 10)
    kw = dict(num_kv_blocks=8, preemption_mode=preemption_mode)
    if preemption_mode == "swap":
        kw["swap_space_bytes"] = 32 * kv_bytes_per_block(sim_model[0], 16)
    if graphs:
        kw["cuda_graph_sizes"] = (1, 2, 4, 8)
    want = _summary(run_requests(_engine(sim_model, False, **kw), requests))
    engine = _engine(sim_model, True, **kw)
    got = _summary(run_requests(engine, requests))
    assert got == want
    assert {reason for _, reason, _, _ in want.values()} >= {"stop", "length"}
    assert engine.stepper.steps > 0 and engine.stepper.late_stops > 0
    stats = _assert_clean(engine)
    assert stats["num_preemptions_total"] > 0 and stats["prefix_cache_hits"] > 0
    if graphs:
        assert sum(engine.runner.decode_graphs.replays.values()) > 0


def test_async_equals_sync_with_stop_strings(sim_model):
    requests, tokenizer = _mix(sim_model, 6, 10, stop_strings=True)
    want = _summary(run_requests(_engine(sim_model, False, tokenizer), requests))
    engine = _engine(sim_model, True, tokenizer)
    got = _summary(run_requests(engine, requests))
    assert got == want
    assert engine.stepper.late_stops > 0
    _assert_clean(engine)


def _run_with_aborts(engine, requests, abort_after: dict[str, int]) -> dict:
    """Drive the engine; abort a request once it has emitted `abort_after[id]` tokens (a point
    in its output, the same for both kinds of stepping)."""
    def abort_at_counts(engine, step, totals):
        assert step < 1000
        for rid, count in abort_after.items():
            out = totals.get(rid)
            if out is not None and not out.finished and len(out.outputs[0].token_ids) >= count:
                engine.abort_request(rid)

    return run_requests(engine, requests, before_step=abort_at_counts)


def test_async_aborts_keep_what_was_emitted(sim_model):
    requests, _ = _mix(sim_model, 8, 8)
    requests = [(t, rid, dict(kw, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=14, ignore_eos=True))) for t, rid, kw in requests]
    aborts = {"r0": 3, "r5": 1, "r6": 6}
    want = _summary(_run_with_aborts(_engine(sim_model, False), requests, aborts))
    engine = _engine(sim_model, True)
    got = _summary(_run_with_aborts(engine, requests, aborts))
    assert got == want
    assert [want[(rid, 0)][1] for rid in sorted(aborts)] == ["abort"] * len(aborts)
    _assert_clean(engine)


def test_requests_that_need_their_last_token_step_synchronously(sim_model):
    """A penalty, min_tokens or n > 1 among the running requests: the step in flight is
    collected and the engine steps synchronously while they run; the rest of the time it is
    asynchronous. Outputs equal the synchronous engine's throughout."""
    requests, _ = _mix(sim_model, 10, 8)
    requests[2] = (6, "pen", dict(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=5, repetition_penalty=1.3, ignore_eos=True)))
    requests[4] = (12, "fork", dict(prompt_token_ids=[9, 8, 7, 6], sampling_params=SamplingParams(
        temperature=0.7, n=2, seed=3, max_tokens=4, ignore_eos=True)))
    requests[6] = (3, "min", dict(prompt_token_ids=[11] * 5, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=6, min_tokens=4)))
    want = _summary(run_requests(_engine(sim_model, False), requests))
    engine = _engine(sim_model, True)
    steps = {"sync": 0}
    real_sync_step = engine.stepper.sync.step

    def counted():
        steps["sync"] += 1
        return real_sync_step()

    engine.stepper.sync.step = counted
    got = _summary(run_requests(engine, requests))
    assert got == want
    assert steps["sync"] > 0 and engine.stepper.steps > 0
    _assert_clean(engine)


def test_placeholders_never_reach_the_prefix_cache(sim_model):
    """A request whose prompt is another's prompt + output, after that one finished, hits the
    prefix cache on the blocks holding the first one's sampled tokens, as it does after
    synchronous stepping: the tokens were written over the placeholders before any block
    holding them was hashed."""
    prompt = list(range(10, 30))
    hits = {}
    for asynchronous in (False, True):
        engine = _engine(sim_model, asynchronous)
        first = run_requests(engine, [(0, "a", dict(prompt_token_ids=prompt, sampling_params=(
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))))])
        generated = first["a"].outputs[0].token_ids
        before = engine.get_stats()["prefix_cache_hits"]
        second = run_requests(engine, [(0, "b", dict(prompt_token_ids=prompt + generated,
                                                     sampling_params=SamplingParams(
                                                         temperature=0.0, max_tokens=2,
                                                         ignore_eos=True)))])
        hits[asynchronous] = (engine.get_stats()["prefix_cache_hits"] - before,
                              second["b"].usage.cached_prompt_tokens)
    assert hits[True] == hits[False]
    assert hits[True][1] >= 48  # 60 prompt tokens: three full blocks, most of them generated


def test_patch_sampled_tokens_overwrites_placeholders():
    from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=4, max_num_seqs=4,
                                          max_num_batched_tokens=64, max_model_len=64))
    scheduler.add_request(1, np.array([5, 6, 7], np.int32), 10)
    scheduler.add_request(2, np.array([8, 9], np.int32), 10)
    out = scheduler.schedule()
    scheduler.update_from_output(out, np.full(out.num_reqs, -1, np.int32), None)
    assert scheduler.get_token_ids(1).tolist() == [5, 6, 7, -1]
    scheduler.abort_request(2)  # freed since: its row is skipped
    assert scheduler.patch_sampled_tokens(out, np.array([40, 41], np.int32)) == 1
    assert scheduler.get_token_ids(1).tolist() == [5, 6, 7, 40]
    with pytest.raises(ValueError):
        scheduler.patch_sampled_tokens(out, np.zeros(5, np.int32))


def test_refusals(sim_model, tiny_cpu_model):
    with pytest.raises(EngineConfigError, match="async_scheduling: the cpu backend"):
        make_engine(tiny_cpu_model, block_size=16, num_kv_blocks=8, async_scheduling=True)
    with pytest.raises(EngineConfigError, match="async_scheduling: not with speculative"):
        _engine(sim_model, True, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 2})


def test_a_failed_read_back_fails_its_step_only(sim_model):
    """The device fails while a step is in flight (its tokens cannot be read): the requests of
    that step end with an error and their blocks return; the engine goes on serving."""
    engine = _engine(sim_model, True)
    sample = engine.sampler.sample
    calls = {"n": 0}

    class Broken:
        device = None

        def read(self):
            raise RuntimeError("device lost")

    def flaky(*args, **kwargs):
        calls["n"] += 1
        result = sample(*args, **kwargs)
        if calls["n"] == 3 and kwargs.get("defer_read"):
            broken = Broken()
            broken.device = result.device
            return broken
        return result

    engine.sampler.sample = flaky
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = run_requests(engine, [(0, "a", dict(prompt_token_ids=[5, 6, 7],
                                                  sampling_params=params))])
    assert outputs["a"].outputs[0].finish_reason == "error"
    assert "device lost" in outputs["a"].error
    _assert_clean(engine)
    later = run_requests(engine, [(0, "b", dict(prompt_token_ids=[5, 6, 7],
                                                sampling_params=params))])
    assert later["b"].outputs[0].finish_reason == "length"
    _assert_clean(engine)
