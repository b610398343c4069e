"""Pipeline parallelism == one device: PP = 2 and 3 (an uneven split), PP x TP = 2 x 3, an
explicit layer partition and the sim backend (the real kernels) give the greedy tokens of
PP = TP = 1 under a mix with chunked prefill, preemption, prefix hits and aborts; the stages'
compute overlaps (P batches in flight); every block returns to the pool; a lost stage fails the
engine cleanly; and the layer split and the configuration are checked. Every engine spawns real
worker processes."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from test_tp_failures import worker_pids
from tp_helpers import write_model_dir

from pagedrun.runtime.distributed.communicator import PeerLostError
from pagedrun.runtime.distributed.pipeline import PipelineConfigError, stage_layer_ranges
from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
from pagedrun.runtime.sampling_params import SamplingParams

VOCAB = 389
SHARED_PREFIX_LEN = 32  # two blocks of 16: later requests with it hit the prefix cache
ABORT_AFTER_STEPS = 6


def make_engine(model_dir: str, pp: int = 1, tp: int = 1, **kwargs) -> LLMEngine:
    config = {"num_kv_blocks": 18, "max_num_seqs": 6, "max_num_batched_tokens": 48,
              "check_invariants": True, **kwargs}
    return LLMEngine(EngineConfig(model=model_dir, tensor_parallel_size=tp,
                                  pipeline_parallel_size=pp, **config))


def workload(seed: int = 3) -> list[tuple[str, list[int], int, int | None]]:
    """(request id, prompt, max_tokens, arrival step); awkward lengths, a shared prefix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, VOCAB, SHARED_PREFIX_LEN).tolist()
    requests = []
    for i, n in enumerate((1, 17, 37, 70, 5, 23, 44, 9)):
        prompt = rng.integers(3, VOCAB, n).tolist()
        if i % 3 == 1:
            prompt = prefix + prompt
        requests.append((f"r{i}", prompt, int(rng.integers(8, 40)), 0 if i < 5 else 2 * i))
    return requests


def run_mix(engine: LLMEngine, abort: tuple[str, ...] = ()) -> dict[str, list[int]]:
    """Greedy over the workload, requests arriving at their step; `abort` ones are aborted
    ABORT_AFTER_STEPS steps after the start. Returns request id -> tokens."""
    pending = sorted(workload(), key=lambda r: r[3])
    tokens: dict[str, list[int]] = {r[0]: [] for r in pending}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, max_tokens, _ = pending.pop(0)
            engine.add_request(rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        if step == ABORT_AFTER_STEPS:
            for rid in abort:
                engine.abort_request(rid)
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
        step += 1
        assert step < 2000, "the engine did not finish"
    return tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 5 layers: no split over 2 or 3 stages is even; 6 heads / 3 KV heads: TP = 3 divides.
    return write_model_dir(tmp_path_factory.mktemp("pp") / "m", vocab_size=VOCAB,
                           num_hidden_layers=5, hidden_size=96, num_attention_heads=6,
                           num_key_value_heads=3)


@pytest.fixture(scope="module")
def reference(model_dir):
    return run_mix(make_engine(model_dir))


def _check_against_reference(engine: LLMEngine, reference: dict, abort=("r3",)) -> None:
    try:
        tokens = run_mix(engine, abort)
        stats = engine.get_stats()
    finally:
        engine.close()
    for rid, want in reference.items():
        if rid in abort:  # cut short: what it produced is the start of the reference's
            assert tokens[rid] == want[:len(tokens[rid])]
        else:
            assert tokens[rid] == want, rid
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # every block came back
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions_total"] > 0


@pytest.mark.parametrize("pp,tp,partition", [
    (2, 1, None),        # layers 0-2 | 3-4
    (3, 1, None),        # 0-1 | 2-3 | 4
    (2, 3, None),        # two stages of three tensor-parallel ranks
    (2, 1, (1, 4)),      # an explicit, lopsided split
], ids=["pp2", "pp3-uneven", "pp2xtp3", "pp2-partition-1-4"])
def test_pipeline_matches_single_device(model_dir, reference, pp, tp, partition):
    engine = make_engine(model_dir, pp, tp, pp_layer_partition=partition)
    assert engine.num_virtual_engines == pp
    assert engine.runner.stage_layers == stage_layer_ranges(5, pp, partition)
    _check_against_reference(engine, reference)


def _features_run(engine: LLMEngine) -> dict:
    """Seeded sampling with n = 2, logprobs, prompt logprobs, stop token ids and min_tokens:
    everything a request's result holds, per request (final outputs, FINAL_ONLY)."""
    from pagedrun.runtime.sampling_params import RequestOutputKind

    rng = np.random.default_rng(11)
    requests = [
        ("n2", SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=9)),
        ("lp", SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)),
        ("stop", SamplingParams(temperature=0.7, seed=3, max_tokens=30, min_tokens=2,
                                stop_token_ids=[5, 17, 23, 42, 77, 99])),
        ("topk", SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=1, max_tokens=12,
                                repetition_penalty=1.3)),
    ]
    results = {}
    try:
        for rid, params in requests:
            params.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(rid, prompt_token_ids=rng.integers(3, VOCAB, 21).tolist(),
                               sampling_params=params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out
        stats = engine.get_stats()
    finally:
        engine.close()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    summary = {}
    for rid, out in results.items():
        assert out.finished and out.error is None
        summary[rid] = [(o.token_ids, o.finish_reason, o.stop_reason,
                         None if o.logprobs is None else
                         [sorted((t, lp.logprob) for t, lp in pos.items())
                          for pos in o.logprobs]) for o in out.outputs]
        if out.prompt_logprobs is not None:
            summary[rid + ":prompt"] = [None if pos is None else sorted(
                (t, lp.logprob) for t, lp in pos.items())
                for pos in out.prompt_logprobs]
    return summary


def test_pipeline_sampling_features_match_single_device(model_dir):
    """Per-request seeded sampling, n = 2 forks, logprobs and prompt logprobs (the logits of
    every prompt position come back from the last stage), stop ids: the same as PP = 1."""
    want = _features_run(make_engine(model_dir, num_kv_blocks=64))
    got = _features_run(make_engine(model_dir, 2, num_kv_blocks=64))
    assert "lp:prompt" in want and len(want["n2"]) == 2
    _assert_same_features(got, want)


# Log-probs of the float32 model through different batch shapes (a stage's micro-batch vs the
# whole step) differ by summation order only: logits of magnitude <= ~20 agree to ~1e-5
# (float32's 6e-8 relative over the layers' sums), so a log-prob to well within 1e-4. Rounding
# both to 3 decimals instead failed on one CPU where a value sat on a rounding boundary.
LOGPROB_ATOL = 1e-4


def _assert_same_features(got, want, where="") -> None:
    """Equal structure, ids, reasons; floats within LOGPROB_ATOL."""
    if isinstance(want, float):
        assert isinstance(got, float) and abs(got - want) <= LOGPROB_ATOL, (where, got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_same_features(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same_features(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def test_pipeline_ngram_speculation_matches_single_device(model_dir):
    """n-gram speculation with two batches in flight: drafts proposed for an engine after its
    batch was collected, the verify rows' logits (1 + k per row) back from the last stage:
    greedy and seeded sampled requests give PP = 1's tokens with the same acceptance."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1}
    rng = np.random.default_rng(4)
    phrase = rng.integers(3, VOCAB, 4).tolist()
    prompt_ids = [phrase * 5, (phrase[::-1] * 4)[:13], phrase * 3 + [7]]
    params = [SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.7, seed=9, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=12)]
    results = []
    for pp in (1, 2):
        engine = make_engine(model_dir, pp, num_kv_blocks=64, speculative_config=spec)
        try:
            for i, ids in enumerate(prompt_ids):
                engine.add_request(f"s{i}", prompt_token_ids=ids, sampling_params=params[i])
            tokens: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            stats = engine.get_stats()
        finally:
            engine.close()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        results.append((tokens, stats["spec_decode_num_draft_tokens"],
                        stats["spec_decode_num_accepted_tokens"]))
    assert results[1] == results[0]
    assert results[0][1] > 0 and results[0][2] > 0


def test_pipeline_swap_preemption(model_dir, reference):
    engine = make_engine(model_dir, 2, preemption_mode="swap", swap_space_bytes=1 << 20)
    _check_against_reference(engine, reference, abort=())


def test_sim_pipeline_matches_single_device(tmp_path):
    """The real kernels (cuda/*.cu on the CPU harness) at PP = 2; head_dim 64."""
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, hidden_size=128,
                                num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [[5, 9, 11], list(range(3, 40))]
    results = []
    for pp in (1, 2):
        engine = make_engine(model_dir, pp, device="sim")
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"s{i}", prompt_token_ids=prompt, sampling_params=params)
            got: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            results.append(got)
        finally:
            engine.close()
    assert results[0] == results[1] and len(results[0]["s1"]) == 3


def test_requests_added_and_aborted_while_in_flight(model_dir, reference):
    """A request added while its engine's batch is in flight waits for that batch's update
    (the scheduler takes none between schedule and update); one aborted before it was ever
    scheduled ends with "abort" and holds nothing; the others are unaffected."""
    engine = make_engine(model_dir, 2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        rid, prompt, max_tokens, _ = workload()[0]
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        engine.step()  # engine 0's batch is in flight
        engine.add_request("late", prompt_token_ids=[7, 8, 9], sampling_params=params)
        engine.add_request("gone", prompt_token_ids=[7, 8, 9, 10], sampling_params=params)
        deferred = [r.request_id for ve in engine.stepper.deferred for r, _ in ve]
        assert deferred, "no request waited for an engine's batch in flight"
        assert engine.abort_request("gone")
        outs: dict = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
        stats = engine.get_stats()
    finally:
        engine.close()
    assert outs["gone"][-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs["gone"]) == 0
    assert sum(len(o.outputs[0].token_ids) for o in outs["late"]) == 5
    assert [t for o in outs[rid] for t in o.outputs[0].token_ids] == reference[rid]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_stages_overlap(tmp_path):
    """With two batches in flight, stage 0 (this process) computes one batch while stage 1
    (a worker) computes the other: some of their compute intervals intersect. Run one at a
    time (no pipelining), they never would. Not a timing assertion: intervals, not speed."""
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, hidden_size=256,
                                intermediate_size=768, num_hidden_layers=4)
    engine = make_engine(model_dir, 2, num_kv_blocks=256, max_num_seqs=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for i in range(16):
            engine.add_request(f"o{i}", prompt_token_ids=[3 + i] * 20, sampling_params=params)
        while engine.has_unfinished_requests():
            engine.step()
        times = [t for _, step in engine.runner.step_times for t in step]
    finally:
        engine.close()
    stage0 = [(s, e) for stage, s, e in times if stage == 0]
    stage1 = [(s, e) for stage, s, e in times if stage == 1]
    assert len(stage0) == len(stage1) > 20
    overlaps = sum(1 for s0, e0 in stage0 for s1, e1 in stage1 if s0 < e1 and s1 < e0)
    busy = sum(e - s for s, e in stage0 + stage1)
    wall = max(e for _, e in stage0 + stage1) - min(s for s, _ in stage0 + stage1)
    assert overlaps > 0, f"no overlap: busy {busy:.3f} s over {wall:.3f} s of wall time"


def test_lost_stage_fails_the_engine(model_dir):
    """A stage's worker killed mid-generation: the engine's step fails with the group lost
    (engine_dead: the server fails every request and exits), nothing hangs, no worker stays."""
    engine = make_engine(model_dir, 3)
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"k{i}", prompt_token_ids=[5 + i] * 9, sampling_params=params)
    for _ in range(6):
        engine.step()
    victims = worker_pids(os.getpid())
    assert len(victims) == 2
    os.kill(victims[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    with pytest.raises(PeerLostError) as info:
        while time.monotonic() < deadline:
            engine.step()
    assert info.value.engine_dead
    engine.close()
    deadline = time.monotonic() + 10
    while worker_pids(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_pids(os.getpid()) == []


def test_stage_layer_ranges():
    assert stage_layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_layer_ranges(5, 1) == [(0, 5)]
    assert stage_layer_ranges(5, 2, (1, 4)) == [(0, 1), (1, 5)]
    for args in ((2, 3, None), (5, 2, (2, 2)), (5, 2, (5, 0)), (5, 3, (2, 3))):
        with pytest.raises(PipelineConfigError):
            stage_layer_ranges(*args)


def test_pipeline_config_errors():
    with pytest.raises(EngineConfigError, match="pp_layer_partition"):
        EngineConfig(pipeline_parallel_size=2, pp_layer_partition=(3,))
    with pytest.raises(EngineConfigError, match="draft model"):
        EngineConfig(pipeline_parallel_size=2, speculative_config={
            "method": "draft_model", "model": "/draft", "num_speculative_tokens": 2})
    with pytest.raises(EngineConfigError, match="nnodes"):
        EngineConfig(pipeline_parallel_size=3, nnodes=2)  # 3 ranks over 2 nodes
    with pytest.raises(EngineConfigError, match="distributed_executor_backend"):
        EngineConfig(distributed_executor_backend="slurm")
    assert EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=3).world_size == 6


def test_cli_pipeline_flags():
    import argparse

    from pagedrun.server import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--pipeline-parallel-size", "3", "--pp-layer-partition",
                              "10,11,9", "--distributed-executor-backend", "ray"])
    config = serve_cmd.engine_config_from_args(args)
    assert (config.pipeline_parallel_size, config.pp_layer_partition,
            config.distributed_executor_backend) == (3, (10, 11, 9), "ray")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--pp-layer-partition", "10,x"])
