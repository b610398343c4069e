"""The driver side of tensor parallelism: spawn and rendezvous the ranks, broadcast each step,
run rank 0 in-process, detect failures. The engine uses it in place of ModelRunner.

Process layout (docs/architecture.md, "Tensor parallelism"):
- The driver process (the engine: scheduler, sampler, server) *is* rank 0: it owns device 0,
  rank 0's shard and KV pools, and runs rank 0's forward itself, so the gathered logits land
  where the sampler is and never cross a process boundary. Rank 0 samples; the other ranks only
  compute (they need no sampler state: seeds, penalties and stop checks stay in one place).
- Ranks 1 .. tp-1 are worker processes (worker.py), one per rank. With `nnodes` K, node 0's
  driver spawns ranks 1 .. tp/K - 1 itself (each in its own session, killed by process group);
  node R runs `paged-run serve --node-rank R`, which spawns ranks R*tp/K .. (R+1)*tp/K - 1.
- Control plane: a ROUTER bound at master_addr (HOST:PORT); every worker's DEALER says hello,
  gets the plan (model, device, dtype, KV sizes, and the CpuCommunicator's address or the NCCL
  unique id that rank 0 created), loads its shard and answers ready.

Messages (type frame first; bodies msgpack): worker -> driver `hello {rank, pid, host}`,
`ready {rank}`, `error {rank, message}`; driver -> worker `plan {...}`, `error` (refused),
`step` (step_broadcast.py), `shutdown`.

Step broadcast: each step's SchedulerOutput fields go to every worker as one multipart message
(zero-copy frames) over the control connection before rank 0 starts its forward; the workers'
forwards meet rank 0's at the collectives, so no per-step acknowledgement is needed.

Failures: a worker that dies, drops its connection, reports an error, or leaves a collective
unanswered turns the executor dead: the local workers are killed, and every later `execute`
raises PeerLostError, whose `engine_dead` makes the server fail every in-flight request and
exit. A rank that does not join within `rendezvous_timeout_s` fails start-up with the missing
ranks named.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import zmq

from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.distributed.communicator import (POLL_INTERVAL_S,
                                                       DEFAULT_COLLECTIVE_TIMEOUT_S,
                                                       ConnectionWatch, CpuCommunicator,
                                                       PeerLostError, set_heartbeats)
from pagedrun.runtime.distributed.sharding import check_shardable
from pagedrun.runtime.distributed.step_broadcast import encode_step
from pagedrun.runtime.distributed.worker import build_rank, parse_master_addr, zmq_tcp

log = logging.getLogger("pagedrun.tp")

DEFAULT_RENDEZVOUS_TIMEOUT_S = 60.0
# Loading a shard of a big checkpoint can take minutes; a dead worker is noticed at once anyway.
DEFAULT_LOAD_TIMEOUT_S = 900.0
# A worker that ignores `shutdown` this long is killed.
SHUTDOWN_GRACE_S = 5.0


def ranks_of_node(tp_size: int, nnodes: int, node_rank: int) -> range:
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"--nnodes {nnodes} must divide --tensor-parallel-size {tp_size}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
    per_node = tp_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def bind_host(host: str) -> str:
    """An address ZeroMQ can bind: IP literals as they are, host names resolved (bind takes
    interfaces and addresses, not DNS names)."""
    import ipaddress
    import socket

    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


def spawn_workers(master_addr: str, ranks: range, per_node: int, join_timeout_s: float
                  ) -> dict[int, subprocess.Popen]:
    """One worker process per rank, each in its own session (so its process group can be
    killed as a whole). stdout / stderr are inherited: worker errors show in the server log."""
    procs = {}
    for rank in ranks:
        cmd = [sys.executable, "-m", "pagedrun.runtime.distributed.worker",
               "--master-addr", master_addr, "--rank", str(rank),
               "--local-rank", str(rank % per_node), "--join-timeout", str(join_timeout_s)]
        procs[rank] = subprocess.Popen(cmd, start_new_session=True)
    return procs


def kill_workers(procs: dict[int, subprocess.Popen], grace_s: float = 0.0) -> None:
    """Wait up to grace_s for the workers to exit, then kill each one's process group."""
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def start_tensor_parallel(config, model_config, backend, max_model_len: int
                          ) -> "TensorParallelExecutor":
    """The executor of an LLMEngine whose config has tensor_parallel_size > 1: rank 0 on the
    engine's backend, every rank's KV pools sized from rank 0's shard (all shards hold the same
    number of KV heads). A rank cannot profile its shard alone (the collectives need every
    rank), so the budget is the backend's without a profiling step (cuda: give num_kv_blocks)."""
    from pagedrun.runtime.distributed.sharding import rank_config, shard_spec
    from pagedrun.runtime.kv_capacity import num_swap_blocks, plan_num_kv_blocks
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    tp_size = config.tensor_parallel_size
    check_shardable(model_config, tp_size)  # refuse what cannot shard before anything starts
    rank0 = rank_config(model_config, shard_spec(model_config, tp_size, 0))
    bytes_per_block = kv_bytes_per_block(rank0, config.block_size, backend.kv_dtype)
    num_gpu_blocks = plan_num_kv_blocks(config, backend, bytes_per_block, max_model_len)
    return TensorParallelExecutor(
        config.model, model_config, tp_size=tp_size, device=backend.name, dtype=config.dtype,
        block_size=config.block_size, max_model_len=max_model_len,
        num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_swap_blocks(config, bytes_per_block),
        nnodes=config.nnodes, master_addr=config.master_addr, ops=backend)


class TensorParallelExecutor:
    """ModelRunner's `execute` over tp ranks; rank 0 in this process."""

    def __init__(self, model: str | None, model_config, *, tp_size: int, device: str, dtype: str,
                 block_size: int, max_model_len: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 nnodes: int = 1, master_addr: str | None = None,
                 rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, ops=None) -> None:
        """model: as EngineConfig.model (a directory, a .gguf, None for the default model);
        every rank resolves it on its own node, so the default model and converted GGUFs need
        no shared path across nodes (a directory must exist at the same path on each)."""
        check_shardable(model_config, tp_size)
        self.tp_size = tp_size
        self.dead: str | None = None  # why, once a rank is lost
        self._seq = 0
        self._procs: dict[int, subprocess.Popen] = {}
        self._ctx = zmq.Context()
        self.control = self._ctx.socket(zmq.ROUTER)
        set_heartbeats(self.control)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished rank raises
        self._watch = ConnectionWatch(self.control)
        if master_addr is None:  # one node: loopback, any free port
            self.control.bind("tcp://127.0.0.1:0")
            port = int(self.control.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            master_addr = f"127.0.0.1:{port}"
        else:
            host, port = parse_master_addr(master_addr)
            self.control.bind(zmq_tcp(bind_host(host), port))
        self.master_addr = master_addr
        self.comm = None
        self._watchdog: _Watchdog | None = None
        atexit.register(self.close)
        try:
            self._start(model, device, dtype, block_size, max_model_len, num_gpu_blocks,
                        num_cpu_blocks, nnodes, rendezvous_timeout_s, collective_timeout_s, ops)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up

    def _start(self, model, device, dtype, block_size, max_model_len, num_gpu_blocks,
               num_cpu_blocks, nnodes, rendezvous_timeout_s, collective_timeout_s, ops) -> None:
        local = ranks_of_node(self.tp_size, nnodes, 0)
        self._procs = spawn_workers(self.master_addr, range(1, local.stop), len(local),
                                    rendezvous_timeout_s)
        self._identities = self._rendezvous(nnodes, rendezvous_timeout_s)
        plan = {"model": None if model is None else str(model), "tp_size": self.tp_size,
                "device": device, "dtype": dtype, "block_size": block_size,
                "max_model_len": max_model_len, "num_gpu_blocks": num_gpu_blocks,
                "num_cpu_blocks": num_cpu_blocks, "collective_timeout_s": collective_timeout_s,
                "nccl_unique_id": None, "local_rank": 0}
        if ops is None:
            ops = make_backend(device, dtype, device_id=0)
        if ops.communicator == "nccl":
            from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

            plan["nccl_unique_id"] = NcclCommunicator.make_unique_id()
        else:
            host = bind_host(parse_master_addr(self.master_addr)[0])
            self.comm = CpuCommunicator(0, self.tp_size, bind=zmq_tcp(host, 0),
                                        timeout_s=collective_timeout_s, context=self._ctx)
            plan["comm_address"] = self.comm.address
        for rank, identity in self._identities.items():
            self.control.send_multipart([identity, b"plan", msgpack.packb(plan)])
        if self.comm is None:  # NCCL: every rank joins the communicator's init together
            from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

            self.comm = NcclCommunicator(0, self.tp_size, plan["nccl_unique_id"], device_id=0)
        else:
            self.comm.wait_for_peers(rendezvous_timeout_s)
        self.runner = build_rank(plan, 0, self.comm, ops)
        self._wait_ready(DEFAULT_LOAD_TIMEOUT_S)
        if hasattr(self.comm, "abort"):
            self.start_watchdog()
        log.info("tensor parallel: %d ranks on %d node(s), control %s, local workers %s",
                 self.tp_size, nnodes, self.master_addr,
                 {r: p.pid for r, p in self._procs.items()})

    def _recv_control(self, timeout_ms: int):
        if not self.control.poll(timeout_ms):
            return None
        identity, kind, *rest = self.control.recv_multipart()
        body = msgpack.unpackb(rest[0]) if rest else {}
        return identity, kind, body

    def _rendezvous(self, nnodes: int, timeout_s: float) -> dict[int, bytes]:
        deadline = time.monotonic() + timeout_s
        joined: dict[int, bytes] = {}
        while len(joined) < self.tp_size - 1:
            self._check_local_workers()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.tp_size)) - set(joined))
                hint = ("" if nnodes == 1 else
                        f"; is `paged-run serve --tensor-parallel-size {self.tp_size} --nnodes "
                        f"{nnodes} --node-rank R --master-addr {self.master_addr}` running on "
                        f"every other node?")
                raise PeerLostError(f"tensor parallel rendezvous: ranks {missing} did not join "
                                    f"{self.master_addr} within {timeout_s:.0f} s{hint}")
            msg = self._recv_control(int(POLL_INTERVAL_S * 1000))
            if msg is None:
                continue
            identity, kind, body = msg
            rank = body.get("rank") if isinstance(body, dict) else None
            if kind != b"hello" or not isinstance(rank, int) or not 0 < rank < self.tp_size \
                    or rank in joined:
                self.control.send_multipart([identity, b"error", (
                    f"rank {rank!r} is not an expected rank of this {self.tp_size}-rank group "
                    "(out of range or already joined)").encode()])
                continue
            log.info("rank %d joined from %s (pid %s)", rank, body.get("host"), body.get("pid"))
            joined[rank] = identity
        self._watch.check()  # connection churn before everyone joined is not a loss
        self._watch.lost = False
        return joined

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ready = set()
        while len(ready) < self.tp_size - 1:
            self._check_connections()  # not _check_alive: it would swallow the ready messages
            if time.monotonic() > deadline:
                raise PeerLostError(f"tensor parallel: ranks "
                                    f"{sorted(set(self._identities) - ready)} did not load their "
                                    f"shards within {timeout_s:.0f} s")
            msg = self._recv_control(int(POLL_INTERVAL_S * 1000))
            if msg is None:
                continue
            _, kind, body = msg
            if kind == b"error":
                raise PeerLostError(f"rank {body.get('rank')} failed: {body.get('message')}")
            if kind == b"ready":
                ready.add(body["rank"])

    # ------------------------------------------------------------------ health

    def _check_local_workers(self) -> None:
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                raise PeerLostError(f"tensor parallel rank {rank} (pid {proc.pid}) exited "
                                    f"with code {code}")

    def _check_connections(self) -> None:
        if self._watchdog is not None:  # it owns the monitor socket now (not thread-safe)
            if self._watchdog.lost is not None:
                raise PeerLostError(self._watchdog.lost)
            return
        self._check_local_workers()
        if self._watch.check():
            raise PeerLostError("tensor parallel: a worker's connection dropped")

    def start_watchdog(self) -> None:
        """Watch the ranks from a thread that aborts the communicator when one is lost.

        NCCL collectives block rank 0 inside CUDA calls no Python timeout reaches; a rank that
        dies mid-collective would hang it. The watchdog calls `comm.abort()`
        (ncclCommAbort), so the blocked call returns with an error and `execute` fails as on
        the CPU. Started after the rendezvous on communicators that have `abort`.
        """
        self._watchdog = _Watchdog(self)
        self._watchdog.start()

    def _check_alive(self) -> None:
        """Between steps: raise PeerLostError if any rank is gone or has reported an error
        (the only message a worker sends after `ready`)."""
        self._check_connections()
        while True:
            msg = self._recv_control(0)
            if msg is None:
                return
            if msg[1] == b"error":
                raise PeerLostError(f"rank {msg[2].get('rank')} failed: {msg[2].get('message')}")

    # ------------------------------------------------------------------ capacity

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks of each rank's pools (the same on every rank)."""
        return self.runner.num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.runner.num_cpu_blocks

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on one rank (its KV heads only)."""
        return self.runner.kv_bytes_per_block()

    # ------------------------------------------------------------------ steps

    def execute(self, out, prompt_logit_rows: tuple[int, ...] = ()):
        """Broadcast the step, run rank 0's forward; the RunnerOutput of ModelRunner.execute."""
        if self.dead is not None:
            raise PeerLostError(f"tensor parallel group is down: {self.dead}")
        try:
            self._check_alive()
            self._seq += 1
            frames = encode_step(self._seq, out, prompt_logit_rows)
            for identity in self._identities.values():
                self.control.send_multipart([identity, *frames], copy=False)
            return self.runner.execute(out, prompt_logit_rows)
        except BaseException as exc:
            # Whatever broke, the ranks are out of step now: the group cannot continue.
            self.dead = f"{type(exc).__name__}: {exc}"
            log.error("tensor parallel group failed: %s", self.dead)
            self.close()
            if isinstance(exc, PeerLostError):
                raise
            raise PeerLostError(f"tensor parallel step failed: {self.dead}") from exc

    def close(self) -> None:
        """Tell the workers to exit, kill those that do not, release the sockets. Idempotent."""
        if self._ctx is None:
            return
        if self.dead is None:
            for identity in getattr(self, "_identities", {}).values():
                try:
                    self.control.send_multipart([identity, b"shutdown"], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if self._watchdog is not None:
            self._watchdog.stop.set()
            self._watchdog.join()
        kill_workers(self._procs, SHUTDOWN_GRACE_S if self.dead is None else 0.0)
        if self.comm is not None:
            self.comm.close()
        self._watch.close()
        self.control.close(linger=0 if self.dead else int(SHUTDOWN_GRACE_S * 1000))
        self._ctx.term()
        self._ctx = None
        atexit.unregister(self.close)



class _Watchdog(threading.Thread):
    """TensorParallelExecutor.start_watchdog's thread: polls the local workers and the control
    connections every POLL_INTERVAL_S; on a loss records why and aborts the communicator."""

    def __init__(self, executor: TensorParallelExecutor) -> None:
        super().__init__(name="pagedrun-tp-watchdog", daemon=True)
        self.executor = executor
        self.stop = threading.Event()
        self.lost: str | None = None

    def run(self) -> None:
        ex = self.executor
        while not self.stop.wait(POLL_INTERVAL_S):
            try:
                ex._check_local_workers()
                if ex._watch.check():
                    raise PeerLostError("tensor parallel: a worker's connection dropped")
            except PeerLostError as exc:
                self.lost = str(exc)
                log.error("watchdog: %s; aborting the communicator", exc)
                ex.comm.abort()
                return
