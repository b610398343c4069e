"""Decode graphs (runtime/decode_graphs.py) on the sim backend: replay == eager.

The sim backend runs the cuda backend's code with every kernel on the CPU harness; its graph
capture records the launch list once and replays it against the static input buffers, so these
tests prove the capture/replay logic a GPU runs: padding rows, bucket changes, block tables that
grow, preemption (recompute and swap), prefix hits, n > 1, logprobs and aborts mid-run.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from engine_helpers import (ENGINE_BACKENDS, TINY_VOCAB, EngineModel, make_engine,
                            random_prompts, random_weights, run_requests, tiny_config)
from pagedrun.runtime.backends.graph_capture import (CapturedGraph, GraphCaptureError,
                                                     capture_graph)
from pagedrun.runtime.backends.harness_runtime import HarnessRuntime, RecordingNumpy, SimGraph
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
from pagedrun.runtime.sampling_params import SamplingParams

SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def sim_model():
    spec = ENGINE_BACKENDS["sim"]
    config = tiny_config(**spec.model_overrides)
    return EngineModel(config, random_weights(config), spec)


def _mix(seed: int, num: int, max_tokens_hi: int = 14):
    """Requests arriving over the first steps: shared prefixes, greedy with logprobs, seeded
    n = 2 sampling, lengths that cross block boundaries while decoding."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, TINY_VOCAB, 24).tolist()
    prompts = random_prompts(rng, TINY_VOCAB, num, 90, shared_prefix=shared)
    requests = []
    for i, prompt in enumerate(prompts):
        max_tokens = int(rng.integers(4, max_tokens_hi + 1))
        if i == 0:
            max_tokens = 2 * max_tokens_hi + 5  # decodes alone at the end: the graph of 1
        if i % 5 == 3:
            params = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=1000 + i,
                                    max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    logprobs=2 if i % 3 == 0 else None)
        requests.append((int(rng.integers(0, 10)), f"r{i}",
                         dict(prompt_token_ids=prompt, sampling_params=params)))
    return requests


def _engine(model, graphs: bool, **kw):
    kw.setdefault("num_kv_blocks", 128)
    kw = dict(block_size=16, max_model_len=160, max_num_seqs=12, max_num_batched_tokens=96, **kw)
    if graphs:
        return make_engine(model, cuda_graph_sizes=SIZES, **kw)
    return make_engine(model, enforce_eager=True, **kw)


def _completions(outputs) -> dict:
    return {(rid, c.index): c for rid, out in outputs.items() for c in out.outputs}


def _assert_same(eager_out, graph_out) -> None:
    eager, graph = _completions(eager_out), _completions(graph_out)
    assert eager.keys() == graph.keys()
    for key, want in eager.items():
        got = graph[key]
        assert got.token_ids == want.token_ids, key
        assert got.finish_reason == want.finish_reason, key
        if want.logprobs:
            for w, g in zip(want.logprobs, got.logprobs):
                assert list(w) == list(g), key
                # Padding changes a GEMM's row count and the attention plan is captured for
                # max_model_len: float32 sums in another order, nothing more.
                assert np.allclose([v.logprob for v in w.values()],
                                   [v.logprob for v in g.values()], atol=1e-4), key


def _assert_clean(engine) -> dict:
    stats = engine.get_stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return stats


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_graph_replay_matches_eager_on_a_mix(sim_model, preemption_mode):
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    # 12 blocks of 16 tokens for 15 requests of up to 90 + 14 tokens: preemption; batches of
    # 1..12 decodes: every size and the eager path above 8.
    swap = 64 * kv_bytes_per_block(sim_model[0], 16) if preemption_mode == "swap" else 0
    kw = dict(num_kv_blocks=12, preemption_mode=preemption_mode, swap_space_bytes=swap)
    requests = _mix(3, 15)
    eager = _engine(sim_model, False, **kw)
    graph = _engine(sim_model, True, **kw)
    assert eager.runner.decode_graphs is None
    _assert_same(run_requests(eager, requests), run_requests(graph, requests))
    replays = graph.runner.decode_graphs.replays
    assert sum(n > 0 for n in replays.values()) >= 3, replays  # bucket changes
    stats = _assert_clean(graph)
    assert stats["num_preemptions_total"] > 0
    assert stats["prefix_cache_hits"] > 0


def test_graph_replay_matches_eager_with_aborts(sim_model):
    def abort_mid_decode(engine, step, totals):
        if step in (8, 11):  # mid-decode: the next graph batch shrinks under the abort
            running = sorted(r for r in totals if not totals[r].finished)
            if running:
                engine.abort_request(running[0])

    requests = _mix(5, 10)
    results = []
    for graphs in (False, True):
        engine = _engine(sim_model, graphs)
        results.append(run_requests(engine, requests, before_step=abort_mid_decode))
        _assert_clean(engine)
    assert sum(results[1][r].finished and results[1][r].outputs[0].finish_reason == "abort"
               for r in results[1]) >= 1
    _assert_same(*results)


def test_replay_equals_eager_forward_of_the_same_static_inputs(sim_model):
    """Every replayed step, the eager forward over the very same static buffers gives the same
    logits bit for bit: nothing in the captured region was baked at capture."""
    engine = _engine(sim_model, True)
    graphs = engine.runner.decode_graphs
    replay = graphs.run
    checked = []

    def run(out, size, token_source=None):
        got = np.array(replay(out, size, token_source))
        want = np.asarray(graphs._forward(size))[:out.num_reqs]
        assert np.array_equal(got, want), (size, out.num_reqs)
        checked.append(size)
        return replay(out, size, token_source)

    graphs.run = run
    run_requests(engine, _mix(9, 12))
    assert len(set(checked)) >= 3, checked
    _assert_clean(engine)


def test_qk_norm_model_replays_its_head_copies():
    """Qwen3's QK-norm copies q and k out of the QKV GEMM's output between launches (the
    backend's xp.ascontiguousarray): the sim recorder must replay those copies. Greedy tokens
    equal transformers' (tests/fixtures/tiny/qwen3_tied) through the graphs."""
    from test_model_families import TINY_DIR, hf_cases

    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.weights import load_model_weights

    qwen3_dir = TINY_DIR / "qwen3_tied"
    config = ModelConfig.from_model_dir(qwen3_dir)
    model = EngineModel(config, load_model_weights(qwen3_dir, config), ENGINE_BACKENDS["sim"])
    engine = make_engine(model, block_size=16, max_model_len=128, num_kv_blocks=32,
                         cuda_graph_sizes=(1, 2, 4))
    requests = [(i, f"hf-{i}", dict(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=len(generated), ignore_eos=True)))
        for i, (prompt, generated, _) in enumerate(hf_cases("qwen3_tied"))]
    outputs = run_requests(engine, requests)
    for i, (_, generated, _) in enumerate(hf_cases("qwen3_tied")):
        assert outputs[f"hf-{i}"].outputs[0].token_ids == generated, i
    assert sum(engine.runner.decode_graphs.replays.values()) > 0


def test_padding_rows_write_no_kv(sim_model):
    """A batch of 3 in the graph of 4: the padding row's cache write must touch nothing (a
    slot of 0 would overwrite block 0, which a real sequence owns)."""
    engine = _engine(sim_model, True, num_kv_blocks=64)
    runner = engine.runner
    poison = [c.copy() for c in runner.k_caches]
    for i in range(3):
        engine.add_request(f"p{i}", prompt_token_ids=[5 + i] * 9,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=3,
                                                          ignore_eos=True))
    engine.step()  # the prefills
    before = [c.copy() for c in runner.k_caches]
    engine.step()  # 3 decodes in the graph of size 4
    assert runner.decode_graphs.replays[4] == 1
    for layer, (b, a) in enumerate(zip(before, runner.k_caches)):
        changed = np.flatnonzero((b != a).reshape(b.shape[0] * b.shape[1], -1).any(axis=1))
        assert len(changed) == 3, (layer, changed)  # one slot per real row, none for padding
    del poison


def test_enforce_eager_and_sizes(sim_model, caplog):
    assert _engine(sim_model, False).runner.decode_graphs is None
    # Sizes above max_num_seqs are never captured.
    engine = make_engine(sim_model, block_size=16, max_model_len=64, num_kv_blocks=32,
                         max_num_seqs=3, cuda_graph_sizes=(2, 3, 16))
    assert engine.runner.decode_graphs.sizes == (2, 3)
    # The sim default captures nothing (each capture is a forward on CPU threads).
    engine = make_engine(sim_model, block_size=16, max_model_len=64, num_kv_blocks=32)
    assert engine.runner.decode_graphs is None
    # A model the graphs do not serve runs eagerly, and says why.
    from pagedrun.runtime.models.llama import LlamaModel

    real = LlamaModel.graph_capture_refusal
    LlamaModel.graph_capture_refusal = lambda self: "a reason"
    try:
        with caplog.at_level(logging.INFO, logger="pagedrun.engine"):
            engine = make_engine(sim_model, block_size=16, max_model_len=64, num_kv_blocks=32,
                                 cuda_graph_sizes=(1, 2))
    finally:
        LlamaModel.graph_capture_refusal = real
    assert engine.runner.decode_graphs is None
    assert "decode graphs: off (a reason)" in caplog.text


@pytest.mark.parametrize("fixture, reason", [
    ("qwen3_tied", None),
    ("qwen3_moe", "experts"),
    ("gemma3_tiny", "embedding scale"),  # and sliding layers
    ("mistral_fp16", "sliding"),
    ("phi3_tiny", "sliding"),
])
def test_unsupported_models(fixture, reason):
    """The model says why its decode forward cannot be captured (graph_capture_refusal)."""
    import pathlib

    from pagedrun.runtime.backends.numpy_backend import NumpyBackend
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.models.registry import build_model
    from pagedrun.runtime.weights import load_model_weights

    model_dir = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / fixture
    config = ModelConfig.from_model_dir(model_dir)
    weights = load_model_weights(model_dir, config, np.float32)
    refusal = build_model(config, weights, NumpyBackend(), 64).graph_capture_refusal()
    assert refusal is None if reason is None else reason in refusal


def test_cpu_backend_ignores_graph_sizes(tiny_cpu_model):
    engine = make_engine(tiny_cpu_model, block_size=16, max_model_len=64, num_kv_blocks=16,
                         cuda_graph_sizes=(1, 2))
    assert engine.runner.decode_graphs is None


@pytest.mark.parametrize("sizes", [(0,), (True,), "8", (2, -1), (1.5,)])
def test_graph_sizes_validated(sizes):
    with pytest.raises(EngineConfigError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=sizes)
    assert EngineConfig(cuda_graph_sizes=[8, 1, 8]).cuda_graph_sizes == (1, 8)


def test_cli_graph_flags():
    import argparse

    from pagedrun.server import serve_cmd

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve_cmd.add_parser(sub)
    args = parser.parse_args(["serve", "--enforce-eager", "--cuda-graph-sizes", "1,2,8",
                              "--async-scheduling"])
    config = serve_cmd.engine_config_from_args(args)
    assert config.enforce_eager and config.cuda_graph_sizes == (1, 2, 8)
    assert config.async_scheduling
    assert not serve_cmd.engine_config_from_args(parser.parse_args(["serve"])).async_scheduling
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--cuda-graph-sizes", "1,0"])


# ---------------------------------------------------------------------- the recorder itself


def test_sim_graph_records_copies_and_fills():
    graph = SimGraph()
    runtime = HarnessRuntime()
    xp = RecordingNumpy(runtime, graph)
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    same = xp.ascontiguousarray(src)          # already contiguous: no copy, nothing recorded
    assert same is src
    col = xp.ascontiguousarray(src[:, 1])     # a strided view: copied, and recorded
    acc = xp.zeros(3, np.float32)             # a fill: recorded
    np.add(col, 1, out=acc)                   # host work: baked, not recorded
    src[:, 1] = -1.0
    acc[:] = 7.0
    graph.replay()
    assert col.tolist() == [-1.0, -1.0, -1.0]  # the copy re-read its source
    assert acc.tolist() == [0.0, 0.0, 0.0]     # the fill ran again
    assert graph.memory_bytes() == src.nbytes + col.nbytes + acc.nbytes
    assert graph.memory_bytes(exclude=[src]) == col.nbytes + acc.nbytes


def test_captured_graph_refuses_replay_before_capture_ends():
    with pytest.raises(GraphCaptureError):
        CapturedGraph(HarnessRuntime()).replay()


class _LoggingRuntime:
    """The capture primitives of a device runtime, logged (runtime/backends/device_runtime.py)."""

    def __init__(self):
        self.log: list = []
        self.capturing = False

    def is_capturing(self):
        return self.capturing

    def new_pool(self):
        self.log.append("new pool")
        return "pool"

    def synchronize(self):
        self.log.append("sync")

    @contextmanager
    def use_pool(self, pool):
        self.log.append(("pool", pool))
        try:
            yield
        finally:
            self.log.append("pool restored")

    def begin_capture(self):
        self.capturing = True
        self.log.append("begin")

    def end_capture(self):
        self.capturing = False
        self.log.append("end")
        return "graph"

    def abort_capture(self):
        self.capturing = False
        self.log.append("abort")

    def instantiate(self, graph):
        self.log.append(("instantiate", graph))

    def graph_launches(self, graph):
        return None

    def replay(self, graph):
        self.log.append(("replay", graph))


def test_capture_sequence_over_a_runtime():
    """graph_capture.capture_graph is the one capture sequence of every runtime: sync, the
    private pool, begin, the body, end, the pool restored, instantiate; replay launches it."""
    backend = SimpleNamespace(runtime=_LoggingRuntime(), graph_pool=None)
    log = backend.runtime.log
    with capture_graph(backend) as captured:
        log.append("body")
        assert backend.runtime.capturing
    assert log == ["new pool", "sync", ("pool", "pool"), "begin", "body", "end", "pool restored",
                   ("instantiate", "graph")]
    captured.replay()
    assert log[-1] == ("replay", "graph")
    # The pool is made once and shared by every later capture.
    with capture_graph(backend):
        pass
    assert log.count("new pool") == 1 and backend.graph_pool == "pool"


def test_capture_failure_aborts_the_capture():
    backend = SimpleNamespace(runtime=_LoggingRuntime(), graph_pool=None)
    with pytest.raises(ValueError):
        with capture_graph(backend):
            raise ValueError("a failure inside the region")
    assert backend.runtime.log[-2:] == ["abort", "pool restored"]
    assert not backend.runtime.capturing
    backend.runtime.capturing = True
    with pytest.raises(GraphCaptureError, match="already in progress"):
        with capture_graph(backend):
            pass
