"""distributed_executor_backend "ray": the worker ranks as Ray actors (ray_workers.py).
- TP=2 through Ray gives TP=1's greedy tokens, and a clean close leaves every rank exited 0;
  PP=2 (a stage in an actor) gives PP=1's;
- a rank's actor killed mid-generation: the next steps fail the in-flight requests and raise
  PeerLostError (engine_dead, as with "mp" workers), and close() leaves no actor process and
  removes the placement group;
- ranks the cluster cannot place fail start-up within the bound, naming what was asked and
  what is available, and leave no placement group behind;
- without Ray installed the backend fails with how to install it, and importing the executor
  never imports ray.
One local Ray cluster (4 CPUs, no dashboard) serves the module: starting one takes seconds."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import ray

from test_tp_failures import alive
from tp_helpers import greedy_run, make_engine, prompts, write_model_dir

from pagedrun.runtime.distributed.communicator import PeerLostError
from pagedrun.runtime.distributed import ray_workers
from pagedrun.runtime.distributed.ray_workers import (RayNotInstalledError, RayPlacementError,
                                                      RayWorker, spawn_ray_workers)
from pagedrun.runtime.sampling_params import SamplingParams

VOCAB = 389
# Enough for the rank loss to be noticed well before the requests could finish.
MAX_STEPS_AFTER_KILL = 200
EXIT_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def ray_cluster():
    """Our own local cluster ("local": never a cluster some other process started); the
    executor finds it initialised, uses it and leaves it running."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("ray") / "m")


def ray_engine(model_dir):
    engine = make_engine(model_dir, 2, distributed_executor_backend="ray")
    workers = engine.runner._procs
    assert list(workers) == [1] and isinstance(workers[1], RayWorker), workers
    return engine, workers[1]


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_tp2_through_ray_matches_tp1(ray_cluster, model_dir):
    ps = prompts(VOCAB)
    ref_tokens, _ = greedy_run(make_engine(model_dir, 1), ps, 6)
    engine, worker = ray_engine(model_dir)
    try:
        assert worker.poll() is None and alive(worker.pid)
        tokens, _ = greedy_run(engine, ps, 6)
    finally:
        engine.close()
    assert tokens == ref_tokens
    assert worker.returncode == 0  # `shutdown` answered: run_worker returned EXIT_OK
    assert wait_gone(worker.pid, EXIT_TIMEOUT_S)


def test_pp2_through_ray_matches_single_device(ray_cluster, model_dir):
    """Pipeline parallelism with its stage-1 rank in an actor: the same links and virtual
    engines as with "mp" workers, PP=1's tokens."""
    ps = prompts(VOCAB)
    ref_tokens, _ = greedy_run(make_engine(model_dir, 1), ps, 6)
    engine = make_engine(model_dir, 1, pipeline_parallel_size=2,
                         distributed_executor_backend="ray")
    try:
        worker = engine.runner._procs[1]
        assert isinstance(worker, RayWorker) and engine.num_virtual_engines == 2
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, ids in enumerate(ps):
            engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id].extend(out.outputs[0].token_ids)
    finally:
        engine.close()
    assert tokens == ref_tokens
    assert worker.returncode == 0 and wait_gone(worker.pid, EXIT_TIMEOUT_S)


def test_actor_killed_mid_generation(ray_cluster, model_dir):
    engine, worker = ray_engine(model_dir)
    placement_group = worker.group.placement_group
    try:
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", prompt_token_ids=[5 + i, 6, 7], sampling_params=params)
        requests = list(engine.table.requests.values())
        engine.step()
        engine.step()  # generation is under way
        assert all(r.error is None for r in requests)
        ray.kill(worker.actor, no_restart=True)
        with pytest.raises(PeerLostError) as info:
            for _ in range(MAX_STEPS_AFTER_KILL):
                engine.step()
        assert info.value.engine_dead  # the server fails every in-flight request and exits
        assert "exited" in str(info.value) or "dropped" in str(info.value), info.value
        assert all(r.error for r in requests), [r.error for r in requests]
        assert engine.runner.dead is not None
    finally:
        engine.close()
    assert worker.poll() is not None and worker.poll() < 0  # died, not returned
    assert wait_gone(worker.pid, EXIT_TIMEOUT_S)
    state = ray.util.placement_group_table(placement_group)["state"]
    assert state == "REMOVED", state
    assert worker.group.released


def test_unplaceable_ranks_fail_with_the_resources_named(ray_cluster):
    with pytest.raises(RayPlacementError) as info:  # the cluster has no GPU
        spawn_ray_workers("127.0.0.1:1", range(1, 2), 2, 0.5, b"s" * 32, num_gpus_per_rank=1)
    message = str(info.value)
    assert "ranks [1]" in message and "'GPU': 1" in message and "available" in message
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    assert ray_workers._connection.users == 0 and ray.is_initialized()


def test_missing_ray_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayNotInstalledError, match=r"pip install paged-run\[ray\]"):
        spawn_ray_workers("127.0.0.1:1", range(1, 2), 2, 1.0, b"s" * 32)
    # Importing the executor (and the launcher module) does not import ray.
    code = ("import sys, pagedrun.runtime.distributed.executor, "
            "pagedrun.runtime.distributed.ray_workers; sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env=os.environ).returncode == 0
