"""CupyRuntime (runtime/backends/cupy_runtime.py) against the strict fake of CuPy 14
(tests/engine/fake_cupy.py), and the capture faults the shared code must never commit.

Every function of CupyRuntime is driven here; whole engines over it are in
test_strict_device.py (eager) and below (decode graphs, asynchronous scheduling, the KV budget).
The planted-fault tests run the shared capture sequence (runtime/backends/graph_capture.py) on
both runtimes with one fault each -- a host synchronize inside the captured region, an
allocation outside the graph pool, a launch made around the runtime -- and require a loud error.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext

import numpy as np
import pytest

import fake_cupy
from engine_helpers import ENGINE_BACKENDS, greedy, make_engine, random_weights, run_requests, \
    tiny_config

from pagedrun.runtime.backends.cupy_runtime import CupyRuntime
from pagedrun.runtime.backends.graph_capture import GraphCaptureError
from pagedrun.runtime.backends.kernel_backend import KernelBackend
from pagedrun.runtime.backends.kernel_devices import sim_backend
from pagedrun.runtime.sampling_params import SamplingParams


def _fake_backend(dtype: str = "float32") -> KernelBackend:
    cupy, cupyx = fake_cupy.make()
    return KernelBackend(CupyRuntime(0, cupy=cupy, cupyx=cupyx), dtype)


def _silu(backend, gate_up):
    """One kernel launch through the backend (silu_and_mul), on its arrays."""
    return backend.silu_and_mul(gate_up)


def _host_silu(gate_up: np.ndarray) -> np.ndarray:
    g, u = np.split(gate_up.astype(np.float64), 2, axis=1)
    return g / (1 + np.exp(-g)) * u


# ---------------------------------------------------------------------- the runtime's functions
def test_copies_and_the_deferred_download():
    backend = _fake_backend()
    runtime, cupy = backend.runtime, backend.xp
    host = np.arange(6, dtype=np.float32)
    dev = runtime.upload(host)                         # upload
    assert isinstance(dev, cupy.ndarray) and not isinstance(host, cupy.ndarray)
    runtime.upload_into(dev, host * 2)                 # upload_into
    assert runtime.to_host(dev).tolist() == (host * 2).tolist()   # to_host
    pending = runtime.download_async(dev)              # download_async: a pinned copy
    dev[...] = cupy.zeros(6, np.float32)               # later work does not change it
    assert pending.read().tolist() == (host * 2).tolist()
    runtime.synchronize()                              # synchronize (no capture: fine)


def test_launches_go_to_the_compute_stream_on_any_thread():
    backend = _fake_backend()
    runtime, cupy = backend.runtime, backend.xp
    gate_up = runtime.upload(np.random.default_rng(0).standard_normal((3, 8), np.float32))
    seen = []

    def step():
        out = _silu(backend, gate_up)                  # launch, on a thread that never used it
        seen.append((cupy.cuda.get_current_stream() is runtime.stream, runtime.to_host(out)))

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    on_stream, got = seen[0]
    assert on_stream
    np.testing.assert_allclose(got, _host_silu(runtime.to_host(gate_up)), rtol=1e-5, atol=1e-6)


def test_capture_replay_and_graph_output():
    backend = _fake_backend()
    runtime = backend.runtime
    rng = np.random.default_rng(1)
    gate_up = runtime.upload(rng.standard_normal((2, 16), np.float32))
    _silu(backend, gate_up)                            # warm-up: the module is loaded
    with backend.graph_capture() as captured:          # new_pool, use_pool, begin/end_capture
        assert runtime.is_capturing()
        out = _silu(backend, gate_up)
    assert not runtime.is_capturing()
    assert captured.graph.uploaded                     # instantiate
    assert captured.num_launches is None               # graph_launches: the driver's
    view = backend.graph_output(out)                   # graph_output: the same memory
    assert view.data.ptr == out.data.ptr and view.shape == out.shape
    new = rng.standard_normal((2, 16), np.float32)
    runtime.upload_into(gate_up, new)
    captured.replay()                                  # replay
    np.testing.assert_allclose(runtime.to_host(view), _host_silu(new), rtol=1e-5, atol=1e-6)
    assert backend.graph_memory_bytes([captured]) == runtime.pool_bytes(backend.graph_pool) > 0


def test_capture_refuses_what_a_gpu_refuses():
    backend = _fake_backend()
    runtime, cupy = backend.runtime, backend.xp
    gate_up = runtime.upload(np.ones((1, 8), np.float32))
    _silu(backend, gate_up)
    cases = {
        "synchronize": runtime.synchronize,
        "to_host": lambda: runtime.to_host(gate_up),
        "download_async": lambda: runtime.download_async(gate_up).read(),
        "upload": lambda: runtime.upload(np.ones(3, np.float32)),
        "host_call": lambda: runtime.host_call(np.sum, (gate_up,)),
        "another stream": lambda: _on_other_stream(cupy, lambda: _silu(backend, gate_up)),
    }
    for what, fault in cases.items():
        with pytest.raises((fake_cupy.FakeCudaError, GraphCaptureError)):
            with backend.graph_capture():
                fault()
        assert not runtime.is_capturing(), what        # abort_capture left the stream usable
    # array_op: CuPy's own kernels are captured with the launches.
    with backend.graph_capture() as captured:
        doubled = runtime.array_op(lambda a: a * np.float32(2), (gate_up,))
    runtime.upload_into(gate_up, np.full((1, 8), 3, np.float32))
    captured.replay()
    assert runtime.to_host(doubled).tolist() == [[6.0] * 8]


def _on_other_stream(cupy, fn):
    with cupy.cuda.Stream(non_blocking=True):
        fn()


def test_kv_budget_is_measured_around_the_profile_step():
    backend = _fake_backend()
    runtime, cupy = backend.runtime, backend.xp
    weights = backend.weight(np.ones((64, 64), np.float32))  # placed before: counted in use
    scratch = 1 << 20

    def profile():
        backend.weight(np.ones((32, 64), np.float32))        # a weight the step places
        cupy.zeros(scratch // 4, np.float32)                 # the scratch KV pool
        cupy.empty(3 << 20, np.uint8)                        # the step's activations
        return scratch

    free, total = runtime.memory_info()
    used_before = total - free
    got = backend.kv_cache_budget_bytes(profile, gpu_memory_utilization=0.5)
    expected = int(0.5 * total) - used_before - 32 * 64 * 4 - (3 << 20)
    assert got == expected and used_before >= weights.nbytes
    # release_cached after the step: the pool keeps only what is alive, the placed weights.
    assert runtime.reserved_bytes() == backend.placed_weight_bytes() == (64 + 32) * 64 * 4
    with pytest.raises(Exception, match="tensor-parallel shard"):
        backend.kv_cache_budget_bytes(None, gpu_memory_utilization=0.5)


# ---------------------------------------------------------------------- planted faults
NORM_WEIGHT = np.ones(8, np.float32)  # one array: placed once, at the warm-up


def _capture_a_forward(backend):
    gate_up = backend.device(np.ones((2, 8), np.float32))
    backend.fused_add_rms_norm(gate_up, gate_up, NORM_WEIGHT, 1e-6)  # warm-up
    with backend.graph_capture():
        backend.fused_add_rms_norm(gate_up, gate_up, NORM_WEIGHT, 1e-6)


@pytest.mark.parametrize("make", [lambda: sim_backend("float32"), _fake_backend],
                         ids=["harness", "fake-cupy"])
def test_planted_capture_faults_are_loud(make, monkeypatch):
    backend = make()
    _capture_a_forward(backend)  # the shared sequence as it is: fine
    # 1. A host synchronize inside the captured step.
    with monkeypatch.context() as m:
        norm = KernelBackend.fused_add_rms_norm

        def synchronizing(self, *args):
            self.runtime.synchronize()
            return norm(self, *args)

        m.setattr(KernelBackend, "fused_add_rms_norm", synchronizing)
        with pytest.raises((GraphCaptureError, fake_cupy.FakeCudaError), match="synchron"):
            _capture_a_forward(backend)
    # 2. An allocation outside the graph pool: the capture forgets use_pool.
    with monkeypatch.context() as m:
        m.setattr(type(backend.runtime), "use_pool", lambda self, pool: nullcontext())
        with pytest.raises((GraphCaptureError, fake_cupy.FakeCudaError), match="pool"):
            _capture_a_forward(backend)
    # 3. A module launched under capture without being recorded: the backend hands out the
    # loaded module itself, not the one whose launches go through the runtime.
    with monkeypatch.context() as m:
        module = KernelBackend.module
        m.setattr(KernelBackend, "module", lambda self, group: module(self, group).raw)
        with pytest.raises((GraphCaptureError, fake_cupy.FakeCudaError),
                           match="(runtime|another stream)"):
            _capture_harness_or_off_stream(backend)


def _capture_harness_or_off_stream(backend):
    """On the fake a raw launch is still on the stream (CuPy launches on the current one): the
    runtime's guard there is the stream; launch off it inside the capture."""
    if backend.name == "sim":
        _capture_a_forward(backend)
        return
    cupy = backend.xp
    gate_up = backend.device(np.ones((2, 8), np.float32))
    with backend.graph_capture():
        _on_other_stream(cupy, lambda: backend.silu_and_mul(gate_up))


# ---------------------------------------------------------------------- engines
def test_engine_with_graphs_and_async_scheduling_matches_sim(monkeypatch):
    """The cuda backend's whole step over the fake: decode graphs (sizes 1, 2, 4) replayed,
    asynchronous scheduling's deferred reads, bf16; the sim backend's tokens."""
    spec = ENGINE_BACKENDS["sim"]
    config = tiny_config(**spec.model_overrides)
    model = (config, random_weights(config))
    rng = np.random.default_rng(5)
    requests = [(i, f"r{i}", dict(prompt_token_ids=rng.integers(3, config.vocab_size, n).tolist(),
                                  sampling_params=params))
                for i, (n, params) in enumerate(zip((1, 17, 9), (
                    greedy(7), SamplingParams(max_tokens=6, temperature=0.8, seed=4),
                    greedy(5, logprobs=1))))]
    kw = dict(dtype="bfloat16", block_size=16, max_model_len=96, max_num_seqs=4,
              async_scheduling=True)
    backend = _fake_backend("bfloat16")
    monkeypatch.setattr("pagedrun.runtime.engine.core.make_backend", lambda *a, **k: backend)
    got = run_requests(make_engine(model, device="sim", cuda_graph_sizes=(1, 2, 4), **kw),
                       requests)
    monkeypatch.undo()
    assert backend.graph_pool is not None, "no decode graph was captured"
    reference = run_requests(make_engine(model, device="sim", enforce_eager=True, **kw),
                             requests)
    for rid, out in got.items():
        assert out.outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
