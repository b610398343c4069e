"""Abort at every phase of a request returns every block within the step, ends the request with
one final output (finish_reason "abort"), and leaves the other requests' outputs untouched."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import TINY_VOCAB, greedy, make_engine, random_prompts, reference_greedy
from pagedrun.runtime.model_runner import kv_bytes_per_block
from pagedrun.runtime.sampling_params import SamplingParams


def _all_free(engine) -> bool:
    stats = engine.get_stats()
    return stats["num_free_blocks"] == stats["num_total_blocks"]


def _abort_and_drain(engine, request_id):
    assert engine.abort_request(request_id)
    assert not engine.abort_request(request_id)  # already finished
    assert _all_free(engine)  # blocks come back at once, not at the next step
    finals = [o for o in engine.step() if o.request_id == request_id]
    assert len(finals) == 1 and finals[0].finished
    assert all(c.finish_reason == "abort" for c in finals[0].outputs)
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


@pytest.mark.parametrize("phase_steps", [0, 1, 3, 12])
def test_abort_at_each_phase(tiny_model, phase_steps):
    """0: waiting; 1: mid chunked prefill; 3: first tokens; 12: decoding."""
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64, max_model_len=512,
                         max_num_batched_tokens=40)
    prompt = np.random.default_rng(1).integers(3, TINY_VOCAB, 90).tolist()
    engine.add_request("a", prompt_token_ids=prompt, sampling_params=greedy(50))
    for _ in range(phase_steps):
        engine.step()
    _abort_and_drain(engine, "a")


def test_abort_parallel_sampling_after_fork(tiny_model):
    engine = make_engine(tiny_model, block_size=8, num_kv_blocks=64, max_model_len=512)
    prompt = np.random.default_rng(2).integers(3, TINY_VOCAB, 30).tolist()
    engine.add_request("p", prompt_token_ids=prompt,
                       sampling_params=SamplingParams(n=3, temperature=1.0, max_tokens=40,
                                                      ignore_eos=True))
    for _ in range(4):
        engine.step()
    _abort_and_drain(engine, "p")


def test_abort_unknown_or_finished(tiny_model):
    engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=512)
    assert not engine.abort_request("nope")
    engine.add_request("f", prompt_token_ids=[5, 6, 7], sampling_params=greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.abort_request("f")
    assert _all_free(engine)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_random_aborts_under_pressure(tiny_model, preemption_mode):
    """Aborts of random live requests while a tiny pool preempts; survivors stay exact."""
    rng = np.random.default_rng(17)
    swap_bytes = 48 * kv_bytes_per_block(tiny_model[0], 16) if preemption_mode == "swap" else 0
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=20, max_model_len=320,
                         max_num_batched_tokens=64, preemption_mode=preemption_mode,
                         swap_space_bytes=swap_bytes)
    prompts = random_prompts(rng, TINY_VOCAB, 16, 250)
    max_tokens = [int(rng.integers(1, 20)) for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=greedy(max_tokens[i]))
    live, aborted, tokens = {f"r{i}" for i in range(len(prompts))}, set(), {}
    while engine.has_unfinished_requests():
        if live and rng.random() < 0.3:
            victim = sorted(live)[int(rng.integers(len(live)))]
            assert engine.abort_request(victim)
            live.discard(victim)
            aborted.add(victim)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                live.discard(out.request_id)
                reason = out.outputs[0].finish_reason
                assert reason == ("abort" if out.request_id in aborted else "length")
    assert _all_free(engine)
    assert aborted and len(aborted) < len(prompts)
    for i, prompt in enumerate(prompts):
        if f"r{i}" not in aborted:
            assert tokens[f"r{i}"] == reference_greedy(tiny_model, prompt, max_tokens[i])
