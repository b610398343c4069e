"""Failures of a tensor-parallel group never hang and never leave a process behind:
- a worker killed mid-generation: every in-flight request gets an error reply, `paged-run
  serve` exits (code 1) and its other workers are gone;
- the driver killed outright (no cleanup runs): its workers notice the dropped connection and exit;
- a rank that never joins the rendezvous: start-up fails with the missing ranks named, and the
  local workers already spawned are killed;
- a model that cannot be split over tp ranks is refused before any process starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tp_helpers import secret_file, write_model_dir

from pagedrun.runtime.distributed.communicator import PeerLostError
from pagedrun.runtime.distributed.executor import TensorParallelExecutor
from pagedrun.runtime.distributed.sharding import TensorParallelConfigError
from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.server.client import Client, ServerError

SERVE_START_TIMEOUT_S = 60
EXIT_TIMEOUT_S = 30


def worker_pids(parent: int) -> list[int]:
    """Live tensor-parallel worker processes whose parent is `parent`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == parent and state != "Z" and b"pagedrun.runtime.distributed.worker" in cmdline:
            pids.append(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_killed_mid_generation(tmp_path):
    model_dir = write_model_dir(tmp_path / "m", num_hidden_layers=4)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedrun.server.serve_cmd", "serve",
                             model_dir, "--port", str(port), "--device", "cpu",
                             "--tensor-parallel-size", "2", "--num-kv-blocks", "128",
                             "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "paged-run serve" in proc.stdout.readline()
        workers = worker_pids(proc.pid)
        assert len(workers) == 1
        params = {"max_tokens": 500, "ignore_eos": True, "temperature": 0.0}
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=SERVE_START_TIMEOUT_S) as client:
            streams = [client.stream(prompt_token_ids=[5 + i, 6, 7], sampling_params=params)
                       for i in range(3)]
            first = next(iter(streams[0]))  # generation is under way
            assert first.token_ids
            os.kill(workers[0], signal.SIGKILL)
            errors = []
            for s in streams:
                with pytest.raises(ServerError) as info:
                    for _ in s:
                        pass
                errors.append(info.value)
        assert all(e.code == "internal_error" for e in errors), errors
        assert proc.wait(EXIT_TIMEOUT_S) == 1
        assert "engine failed" in proc.stderr.read()
        assert wait_gone(workers, 5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


DRIVER = """
import sys, time
from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", tensor_parallel_size=3,
                                num_kv_blocks=16))
print("UP", flush=True)
time.sleep(600)
"""


def test_driver_killed_workers_exit(tmp_path):
    model_dir = write_model_dir(tmp_path / "m", hidden_size=48, num_attention_heads=6,
                                num_key_value_heads=3)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, model_dir], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "UP"
        workers = worker_pids(proc.pid)
        assert len(workers) == 2
        proc.kill()  # SIGKILL: no finally, no atexit in the driver
        proc.wait()
        # The workers are now orphans (reparented); they notice the dropped connection.
        assert wait_gone(workers, EXIT_TIMEOUT_S) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_rank_that_never_joins(tmp_path):
    model_dir = write_model_dir(tmp_path / "m")
    config = ModelConfig.from_model_dir(model_dir)
    before = set(worker_pids(os.getpid()))
    addr = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(PeerLostError) as info:
        TensorParallelExecutor(model_dir, config, tp_size=4, device="cpu", dtype="auto",
                               block_size=16, max_model_len=256, num_gpu_blocks=8,
                               num_cpu_blocks=0, nnodes=2, master_addr=addr,
                               rendezvous_timeout_s=3.0, secret_file=secret_file(tmp_path))
    message = str(info.value)
    assert "ranks [2, 3] did not join" in message and addr in message
    assert "--node-rank" in message
    assert time.monotonic() - started < 20
    assert set(worker_pids(os.getpid())) - before == set()  # rank 1 (spawned here) is gone


@pytest.mark.parametrize("heads,kv_heads,tp,needle", [
    (9, 3, 2, "does not divide num_attention_heads 9"),
    (8, 4, 8, "tensor_parallel_size 8 does not divide num_attention_heads"),
    (12, 6, 4, "does not divide num_key_value_heads 6"),
    (12, 4, 6, "needs tp a multiple of 4"),
])
def test_unshardable_models_refused(tmp_path, heads, kv_heads, tp, needle):
    if tp == 8:
        heads = 4  # 4 query heads cannot go to 8 ranks
    model_dir = write_model_dir(tmp_path / "m", hidden_size=heads * 8,
                                num_attention_heads=heads, num_key_value_heads=kv_heads,
                                intermediate_size=48)
    before = set(worker_pids(os.getpid()))
    with pytest.raises(TensorParallelConfigError) as info:
        LLMEngine(EngineConfig(model=model_dir, device="cpu", tensor_parallel_size=tp))
    assert needle in str(info.value)
    assert set(worker_pids(os.getpid())) - before == set()


def test_watchdog_aborts_the_communicator_when_a_rank_dies(tmp_path):
    """The NCCL guard (a blocked collective cannot time out) exercised on the CPU: the watchdog
    notices a killed worker and calls the communicator's abort; the next step fails."""
    model_dir = write_model_dir(tmp_path / "m")
    config = ModelConfig.from_model_dir(model_dir)
    executor = TensorParallelExecutor(model_dir, config, tp_size=2, device="cpu", dtype="auto",
                                      block_size=16, max_model_len=256, num_gpu_blocks=8,
                                      num_cpu_blocks=0)
    aborted = []
    executor.comm.abort = lambda: aborted.append(time.monotonic())
    executor.start_watchdog()
    try:
        (worker,) = worker_pids(os.getpid())
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        deadline = killed + 10
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted, "the watchdog did not abort the communicator"
        with pytest.raises(PeerLostError, match="exited|dropped"):
            executor.execute(None)
    finally:
        executor.close()
    assert worker_pids(os.getpid()) == []


def test_headless_node_without_driver_gives_up(tmp_path):
    """`serve --node-rank 1` whose node 0 never comes up: its workers stop waiting after the
    join timeout, the node exits 1, nothing is left running."""
    from pagedrun.runtime.distributed.node import run_node

    started = time.monotonic()
    code = run_node(f"127.0.0.1:{free_port()}", tp_size=4, nnodes=2, node_rank=1,
                    join_timeout_s=1.5, secret_file=secret_file(tmp_path))
    assert code == 1
    assert time.monotonic() - started < 20
    assert worker_pids(os.getpid()) == []
