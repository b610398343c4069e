"""Fault isolation in the engine: one request's failure never hurts the others in its batch,
a step that fails as a whole leaves the engine serving, every block comes back, and an abort
is never lost (issue 12, item 2).

Faults are injected by wrapping the engine's own collaborators in the test (monkeypatch or a
proxy), never through product configuration. Each test runs a batch of several greedy requests
with one victim and checks: the victim ends with finish_reason "error" and a message naming
the phase; every other request's tokens equal the dense reference's; the pool is whole again;
and a fresh request afterwards gives the reference's tokens (the engine is not poisoned).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import (TINY_VOCAB, greedy, make_engine, random_prompts, reference_greedy,
                            run_requests)
from pagedrun.runtime.engine import MAX_CONSECUTIVE_STEP_FAILURES, EngineDeadError, RequestError
from pagedrun.runtime.sampling_params import SamplingParams

VICTIM = "victim"
NUM_TOKENS = 6


class InjectedFault(RuntimeError):
    """The exception the tests plant."""


def _requests(victim_params: SamplingParams | None = None, num_others: int = 5):
    rng = np.random.default_rng(21)
    prompts = random_prompts(rng, TINY_VOCAB, num_others + 1, 60)
    reqs = [(i % 3, f"r{i}", dict(prompt_token_ids=p, sampling_params=greedy(NUM_TOKENS)))
            for i, p in enumerate(prompts[1:])]
    reqs.insert(2, (1, VICTIM, dict(prompt_token_ids=prompts[0],
                                    sampling_params=victim_params or greedy(NUM_TOKENS))))
    return reqs


def _engine(model, **kw):
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_batched_tokens", 48)  # chunked prefill: faults mid-prompt too
    return make_engine(model, **kw)


def _check(model, engine, requests, outs, phase: str) -> None:
    victim = outs[VICTIM]
    assert victim.finished and victim.error is not None and phase in victim.error, victim.error
    assert all(c.finish_reason == "error" for c in victim.outputs)
    for _, rid, kwargs in requests:
        if rid == VICTIM:
            continue
        prompt = kwargs["prompt_token_ids"]
        assert outs[rid].error is None
        assert outs[rid].outputs[0].token_ids == reference_greedy(model, prompt, NUM_TOKENS), rid
    _assert_clean(model, engine)


def _assert_clean(model, engine) -> None:
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert not engine.has_unfinished_requests()
    # Not poisoned: a new request runs and is right.
    prompt = [7, 8, 9, 10, 11]
    after = run_requests(engine, [(0, "after", dict(prompt_token_ids=prompt,
                                                    sampling_params=greedy(4)))])
    assert after["after"].outputs[0].token_ids == reference_greedy(model, prompt, 4)


def _victim_rows(params_list) -> bool:
    return any(p.seed == 4242 for p in params_list)


VICTIM_SAMPLED = SamplingParams(temperature=0.5, seed=4242, max_tokens=NUM_TOKENS,
                                ignore_eos=True)


def test_sampling_fault_fails_only_its_request(tiny_cpu_model, monkeypatch):
    engine = _engine(tiny_cpu_model)
    sample = engine.sampler.sample

    def faulty(logits, params, *args, **kwargs):
        if _victim_rows(params):
            raise InjectedFault("sampler exploded")
        return sample(logits, params, *args, **kwargs)

    monkeypatch.setattr(engine.sampler, "sample", faulty)
    requests = _requests(VICTIM_SAMPLED)
    outs = run_requests(engine, requests)
    _check(tiny_cpu_model, engine, requests, outs, "sampling failed: InjectedFault")


@pytest.mark.parametrize("phase,method,failing_call", [
    ("postprocessing a token", "append_token", 2),   # after it has streamed a token
    ("prompt logprobs", "add_prompt_logprobs", 1),
])
def test_postprocess_fault_fails_only_its_request(tiny_cpu_model, monkeypatch, phase, method,
                                                  failing_call):
    engine = _engine(tiny_cpu_model)
    processor = engine.output_processor
    if method == "append_token":
        # Every victim token through append_token (a plain request's token that cannot stop
        # skips it: test_append_only_token_fault_fails_only_its_request covers that path).
        token_stops = processor.token_stops
        monkeypatch.setattr(processor, "token_stops",
                            lambda r: False if r.request_id == VICTIM else token_stops(r))
    original = getattr(processor, method)
    calls = {"n": 0}

    def faulty(*args, **kwargs):
        target = args[0]
        request = target if hasattr(target, "request_id") else engine.table.seqs[target][0]
        if request.request_id == VICTIM:
            calls["n"] += 1
            if calls["n"] == failing_call:
                raise InjectedFault(f"{method} exploded")
        return original(*args, **kwargs)

    monkeypatch.setattr(processor, method, faulty)
    victim_params = greedy(NUM_TOKENS, prompt_logprobs=2) if method == "add_prompt_logprobs" \
        else None
    requests = _requests(victim_params)
    outs = run_requests(engine, requests)
    assert calls["n"] >= failing_call
    _check(tiny_cpu_model, engine, requests, outs, phase)


def test_append_only_token_fault_fails_only_its_request(tiny_cpu_model, monkeypatch):
    """A token that can stop nothing is appended without append_token; a fault there (here
    its logprob entry's text, at the victim's second token) fails its request alone too."""
    engine = _engine(tiny_cpu_model)
    processor = engine.output_processor
    append_token = processor.append_token
    victim_full_path = []

    def counting_append_token(request, seq, token):
        if request.request_id == VICTIM:
            victim_full_path.append(token)
        return append_token(request, seq, token)

    calls = {"n": 0}

    def faulty_text(token_id):
        calls["n"] += 1  # only the victim asks for logprobs: one entry per token
        if calls["n"] == 2:
            raise InjectedFault("token text exploded")
        return None

    monkeypatch.setattr(processor, "append_token", counting_append_token)
    monkeypatch.setattr(processor, "token_texts", faulty_text)
    requests = _requests(greedy(NUM_TOKENS, logprobs=0))
    outs = run_requests(engine, requests)
    assert calls["n"] == 2 and not victim_full_path  # it failed on the append-only path
    _check(tiny_cpu_model, engine, requests, outs, "postprocessing a token")


def test_n_expansion_fault_fails_only_its_request(tiny_cpu_model, monkeypatch):
    engine = _engine(tiny_cpu_model)
    original = engine.table.new_sequence

    def faulty(request, index):
        if request.request_id == VICTIM and index > 0:
            raise InjectedFault("no sibling for you")
        return original(request, index)

    monkeypatch.setattr(engine.table, "new_sequence", faulty)
    requests = _requests(SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=NUM_TOKENS,
                                        ignore_eos=True))
    outs = run_requests(engine, requests)
    _check(tiny_cpu_model, engine, requests, outs, "expanding n > 1 failed")


class _SchedulerProxy:
    """The engine's scheduler with faults planted in chosen methods (a Cython object cannot
    be monkeypatched in place)."""

    def __init__(self, scheduler, faults: dict):
        self._scheduler = scheduler
        self._faults = faults  # method name -> callable(*args) -> bool (raise if True)

    def __getattr__(self, name):
        attr = getattr(self._scheduler, name)
        check = self._faults.get(name)
        if check is None:
            return attr

        def wrapped(*args, **kwargs):
            if check(*args):
                raise InjectedFault(f"{name} exploded")
            return attr(*args, **kwargs)
        return wrapped


def test_fork_fault_fails_only_its_request(tiny_cpu_model):
    engine = _engine(tiny_cpu_model)
    victim_seq_ids = set()
    engine.schedulers[0] = _SchedulerProxy(engine.schedulers[0], {
        "fork_request": lambda parent, child, *rest: parent in victim_seq_ids})
    requests = _requests(SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=NUM_TOKENS,
                                        ignore_eos=True))
    original_add = engine.add_request

    def add(request_id, **kwargs):
        original_add(request_id, **kwargs)
        if request_id == VICTIM:
            victim_seq_ids.add(engine.table.requests[VICTIM].seqs[0].seq_id)

    engine.add_request = add
    outs = run_requests(engine, requests)
    _check(tiny_cpu_model, engine, requests, outs, "forking failed")


def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(tiny_cpu_model,
                                                                     monkeypatch):
    """The forward raises once: every request of that step fails (the fault belongs to none),
    requests that were not in it go on, and the engine serves afterwards."""
    engine = _engine(tiny_cpu_model, max_num_seqs=2)  # some requests wait outside the step
    execute = engine.runner.execute
    calls = {"n": 0}

    def faulty(out, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise InjectedFault("kernel launch failed")
        return execute(out, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", faulty)
    requests = _requests()
    outs = run_requests(engine, requests)
    failed = {rid for rid, o in outs.items() if o.error is not None}
    assert 1 <= len(failed) <= 2, failed
    for rid in failed:
        assert "step failed: InjectedFault: kernel launch failed" in outs[rid].error
    for _, rid, kwargs in requests:
        if rid not in failed:
            assert outs[rid].outputs[0].token_ids == reference_greedy(
                tiny_cpu_model, kwargs["prompt_token_ids"], NUM_TOKENS), rid
    _assert_clean(tiny_cpu_model, engine)


def test_scheduler_fault_resets_and_the_engine_keeps_serving(tiny_cpu_model):
    engine = _engine(tiny_cpu_model)
    calls = {"n": 0}

    def third_schedule(*args):
        calls["n"] += 1
        return calls["n"] == 3

    engine.schedulers[0] = _SchedulerProxy(engine.schedulers[0], {"schedule": third_schedule})
    requests = _requests()
    outs = run_requests(engine, requests)
    in_flight = [rid for rid, o in outs.items() if o.error is not None]
    assert in_flight and all("scheduler failed" in outs[r].error for r in in_flight)
    assert all(o.finished for o in outs.values())
    _assert_clean(tiny_cpu_model, engine)  # the reset scheduler: whole pool, serving


def test_abort_between_failing_steps_is_not_lost(tiny_cpu_model, monkeypatch):
    engine = _engine(tiny_cpu_model)
    for i, prompt in enumerate(([5, 6, 7], [8, 9, 10, 11])):
        engine.add_request(f"a{i}", prompt_token_ids=prompt, sampling_params=greedy(8))
    engine.step()
    monkeypatch.setattr(engine.runner, "execute",
                        lambda *a, **k: (_ for _ in ()).throw(InjectedFault("down")))
    assert engine.abort_request("a0")
    outs = {o.request_id: o for o in engine.step()}  # this step fails
    assert outs["a0"].finished and outs["a0"].outputs[0].finish_reason == "abort"
    assert outs["a1"].finished and outs["a1"].outputs[0].finish_reason == "error"
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_repeated_step_failures_declare_the_engine_dead(tiny_cpu_model, monkeypatch):
    engine = _engine(tiny_cpu_model)
    monkeypatch.setattr(engine.runner, "execute",
                        lambda *a, **k: (_ for _ in ()).throw(InjectedFault("device lost")))
    for attempt in range(MAX_CONSECUTIVE_STEP_FAILURES):
        engine.add_request(f"d{attempt}", prompt_token_ids=[5, 6, 7], sampling_params=greedy(2))
        if attempt < MAX_CONSECUTIVE_STEP_FAILURES - 1:
            (out,) = engine.step()
            assert out.outputs[0].finish_reason == "error"
    with pytest.raises(EngineDeadError, match="steps in a row failed"):
        engine.step()
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


def test_out_of_vocab_stop_token_refused_at_admission(tiny_model):
    engine = _engine(tiny_model)
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.add_request("x", prompt_token_ids=[5, 6],
                           sampling_params=SamplingParams(stop_token_ids=[TINY_VOCAB + 5],
                                                          min_tokens=2, max_tokens=4))


def test_near_zero_repetition_penalty_refused(tiny_cpu_model):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300)


EXTREME_PARAMS = [
    SamplingParams(repetition_penalty=0.01, top_p=0.5, temperature=1.0, max_tokens=5),
    SamplingParams(repetition_penalty=10.0, top_p=1e-300, temperature=1.0, max_tokens=5),
    SamplingParams(temperature=2.0, top_k=10**30, min_p=1.0, max_tokens=5),
    # Raised to 0.01 (vLLM): sampled, not greedy.
    SamplingParams(temperature=1e-300, top_p=0.5, max_tokens=5),
    SamplingParams(repetition_penalty=1e6, temperature=1.0, max_tokens=5),  # no upper bound
    SamplingParams(logit_bias={3: 100.0, 4: -100.0}, allowed_token_ids=[3, 4, 5],
                   temperature=1.0, max_tokens=5),
    SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=0.01,
                   temperature=0.5, max_tokens=5, min_tokens=5),
    SamplingParams(logprobs=20, prompt_logprobs=20, top_k=1, n=8, max_tokens=3,
                   seed=2**63 - 1, temperature=1.0),
    SamplingParams(stop_token_ids=[TINY_VOCAB - 1], min_tokens=4, max_tokens=5,
                   temperature=0.7, seed=3),
]


def test_extreme_valid_params_complete_on_every_backend(tiny_model):
    """Valid-but-extreme sampling parameters (the issue's poisoning classes among them) finish
    normally, side by side with an ordinary request that keeps its reference tokens."""
    engine = _engine(tiny_model)
    prompt = [5, 6, 7, 8]
    requests = [(0, f"x{i}", dict(prompt_token_ids=prompt, sampling_params=p))
                for i, p in enumerate(EXTREME_PARAMS)]
    requests.append((0, "plain", dict(prompt_token_ids=prompt, sampling_params=greedy(5))))
    outs = run_requests(engine, requests)
    for rid, out in outs.items():
        assert out.error is None, (rid, out.error)
        assert all(c.finish_reason in ("length", "stop") for c in out.outputs), rid
        assert all(0 <= t < TINY_VOCAB for c in out.outputs for t in c.token_ids), rid
    assert outs["plain"].outputs[0].token_ids == reference_greedy(tiny_model, prompt, 5)
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
