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
- Control plane: a ROUTER bound at master_addr (HOST:PORT; loopback with a free port when
  master_addr is None); every worker's DEALER authenticates (hello / challenge / join, auth.py),
  gets the plan (model, device, dtype, KV sizes, and the CpuCommunicator's address or the NCCL
  unique id that rank 0 created), loads its shard and answers ready.

Messages (type frame first; bodies msgpack; "sealed": a trailer frame with a counter and the
HMAC-SHA256 under the connection's session key, auth.Channel):
  worker -> driver  `hello {rank, pid, host, nonce}` + MAC under the group secret,
                    `join {rank}`, `ready {rank}`, `error {rank, message}`   (sealed)
  driver -> worker  `challenge {nonce}` + MAC under the secret over the worker's nonce,
                    `error` (refused; text, before the session only: not sealed),
                    `plan {...}`, `step` (step_broadcast.py), `shutdown`     (sealed)
Pipeline parallelism (pp_size > 1) adds one round after the plan (stage_pipe.py):
  worker -> driver  `bound {rank, link, comm}`: the addresses it listens on      (sealed)
  driver -> worker  `peers {links: [per rank], comms: [per stage]}`           (sealed)
and the executor's `submit` / `collect` (one batch per virtual engine in flight; pipeline.py).
Ranks may be Ray actors instead of processes (`executor_backend="ray"`, ray_workers.py).

Authentication (auth.py): the group secret is a random token per executor, written to each local
worker's stdin; with nnodes > 1 it is read from `secret_file` on every node (refused without
one). A ROUTER identity becomes a rank only by a join sealed with a session key that needs the
secret and both fresh nonces; after that the driver accepts a message only from a bound
identity, sealed under that identity's key with a counter above the last one, and naming the
rank bound to that identity. Everything else (strangers, forged or replayed messages, ranks that
do not exist) is dropped with a rate-limited warning and changes nothing. Only the bound
connections are watched for drops. `curve=True` makes the ROUTERs CURVE servers (auth.py).

Step broadcast: each step's SchedulerOutput fields go to every worker as one multipart message
(zero-copy frames) over the control connection before rank 0 starts its forward; the workers'
forwards meet rank 0's at the collectives, so no per-step acknowledgement is needed.

Failures: a worker that dies, drops its (authenticated) connection, reports an error (sealed),
or leaves a collective unanswered turns the executor dead: the local workers are killed, and
every later `execute` raises PeerLostError, whose `engine_dead` makes the server fail every
in-flight request and exit. A rank that does not join within `rendezvous_timeout_s` fails
start-up with the missing ranks named. Nothing a non-rank sends (or a connection it opens and
closes) does any of this.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import zmq

from pagedrun.runtime.backends import make_backend, uses_gpu
from pagedrun.runtime.distributed import auth
from pagedrun.runtime.distributed.communicator import (POLL_INTERVAL_S,
                                                       DEFAULT_COLLECTIVE_TIMEOUT_S,
                                                       ConnectionWatch, CpuCommunicator,
                                                       PeerLostError, set_heartbeats, source_fd)
from pagedrun.runtime.distributed.pipeline import (GroupLayout, SoloCommunicator,
                                                   receive_logits, send_hidden,
                                                   stage_layer_ranges)
from pagedrun.runtime.distributed.sharding import check_shardable
from pagedrun.runtime.distributed.step_broadcast import encode_step
from pagedrun.runtime.distributed.worker import build_rank, parse_master_addr, zmq_tcp
from pagedrun.runtime.errors import PagedRunError

log = logging.getLogger("pagedrun.tp")

DEFAULT_RENDEZVOUS_TIMEOUT_S = 60.0
# Loading a shard of a big checkpoint can take minutes; a dead worker is noticed at once anyway.
DEFAULT_LOAD_TIMEOUT_S = 900.0
# A worker that ignores `shutdown` this long is killed.
SHUTDOWN_GRACE_S = 5.0
STEP_TIMES_KEPT = 4096
# Workers send only small control messages; a larger one (a stranger's) closes its connection.
CONTROL_MAX_MSG_BYTES = 1 << 20


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


def spawn_workers(master_addr: str, ranks: range, per_node: int, join_timeout_s: float,
                  secret: bytes, curve: bool = False) -> dict[int, subprocess.Popen]:
    """One worker process per rank, each in its own session (so its process group can be
    killed as a whole). stdout / stderr are inherited: worker errors show in the server log.
    The group secret goes down a pipe to the worker's stdin (auth.encode_launch), closed at
    once: it is on no command line, in no environment and in no file."""
    procs = {}
    launch = auth.encode_launch(secret, curve)
    try:
        for rank in ranks:
            cmd = [sys.executable, "-m", "pagedrun.runtime.distributed.worker",
                   "--master-addr", master_addr, "--rank", str(rank),
                   "--local-rank", str(rank % per_node), "--join-timeout", str(join_timeout_s)]
            proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.PIPE)
            procs[rank] = proc
            try:  # a few dozen bytes: the pipe buffer takes them without waiting for the child
                proc.stdin.write(launch)
            except BrokenPipeError:
                pass  # it died already; noticed like any exited worker
            finally:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
    except BaseException:
        kill_workers(procs)
        raise
    return procs


def start_workers(executor_backend: str, master_addr: str, ranks: range, per_node: int,
                  join_timeout_s: float, secret: bytes, curve: bool = False,
                  ray_address: str | None = None, num_gpus_per_rank: float = 0) -> dict:
    """This node's worker ranks: processes of our own ("mp", spawn_workers) or Ray actors
    ("ray", ray_workers.spawn_ray_workers). Either way rank -> a handle with `pid`, `poll()`,
    `wait(timeout)` and, for actors, `kill()` and `release()` (kill_workers uses them)."""
    if executor_backend == "ray":
        from pagedrun.runtime.distributed.ray_workers import spawn_ray_workers

        return spawn_ray_workers(master_addr, ranks, per_node, join_timeout_s, secret, curve,
                                 ray_address=ray_address, num_gpus_per_rank=num_gpus_per_rank)
    return spawn_workers(master_addr, ranks, per_node, join_timeout_s, secret, curve)


def group_secret(secret_file: str | None, nnodes: int) -> bytes:
    """The group's shared secret: read from secret_file when given (every node reads the same
    file); otherwise a new random one, which only works on one node (nothing else knows it)."""
    if secret_file is not None:
        return auth.read_secret_file(secret_file)
    if nnodes > 1:
        raise auth.TensorParallelSecretError(
            f"tensor parallel over {nnodes} nodes needs a shared secret: write one with "
            "`python -m pagedrun.runtime.distributed.auth FILE`, copy it (mode 0600) to every "
            "node and give it to each `paged-run serve` as --tp-secret-file FILE")
    return auth.new_secret()


def kill_workers(procs: dict, grace_s: float = 0.0) -> None:
    """Wait up to grace_s for the workers to exit, then kill each one's process group (a Ray
    actor: the actor), and release what their launcher holds (a Ray placement group)."""
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            if not isinstance(proc, subprocess.Popen):
                proc.kill()
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    for proc in procs.values():
        release = getattr(proc, "release", None)
        if release is not None:
            release()


def start_tensor_parallel(config, model_config, backend, max_model_len: int
                          ) -> "TensorParallelExecutor":
    """The executor of an LLMEngine whose config has tensor_parallel_size > 1 or
    pipeline_parallel_size > 1: rank 0 on the engine's backend, every rank's KV pools sized
    from the largest stage's layers of rank 0's shard (all shards hold the same number of KV
    heads), the budget split evenly over the virtual engines (one per stage). A rank cannot
    profile its shard alone (the collectives need every rank), so the budget is the backend's
    without a profiling step (cuda: give num_kv_blocks)."""
    from pagedrun.runtime.decode_graphs import graph_sizes
    from pagedrun.runtime.distributed.sharding import rank_config, shard_spec
    from pagedrun.runtime.kv_capacity import num_swap_blocks, plan_num_kv_blocks
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    check_shardable(model_config, tp_size)  # refuse what cannot shard before anything starts
    stage_layers = stage_layer_ranges(model_config.num_hidden_layers, pp_size,
                                      config.pp_layer_partition)
    rank0 = rank_config(model_config, shard_spec(model_config, tp_size, 0))
    per_stage = [kv_bytes_per_block(dataclasses.replace(rank0, num_hidden_layers=end - start),
                                    config.block_size, backend.kv_dtype)
                 for start, end in stage_layers]
    bytes_per_block = max(per_stage)  # every stage has the same block count
    num_blocks = plan_num_kv_blocks(config, backend, bytes_per_block, max_model_len)
    num_gpu_blocks = num_blocks // pp_size
    if num_gpu_blocks < 1:
        raise PagedRunError(f"KV cache: {num_blocks} blocks cannot be split over {pp_size} "
                            f"virtual engines (one per pipeline stage); give more memory")
    num_cpu_blocks = num_swap_blocks(config, bytes_per_block) // pp_size
    if pp_size > 1:
        for stage, ((start, end), nbytes) in enumerate(zip(stage_layers, per_stage)):
            log.info("pipeline stage %d: layers %d-%d, KV %d virtual engines x %d blocks x %d "
                     "bytes = %.1f MiB per rank", stage, start, end - 1, pp_size,
                     num_gpu_blocks, nbytes, pp_size * num_gpu_blocks * nbytes / 2**20)
    return TensorParallelExecutor(
        config.model, model_config, tp_size=tp_size, device=backend.name, dtype=config.dtype,
        block_size=config.block_size, max_model_len=max_model_len,
        num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
        pp_size=pp_size, stage_layers=stage_layers, bytes_per_block=bytes_per_block,
        nnodes=config.nnodes, master_addr=config.master_addr, ops=backend,
        secret_file=getattr(config, "tp_secret_file", None),
        curve=getattr(config, "tp_curve", False), lora_config=config.lora_config(),
        quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
        executor_backend=config.distributed_executor_backend, ray_address=config.ray_address,
        # Decode graphs on every rank in step (the collectives are captured with the rest);
        # pipeline stages run eagerly.
        graph_sizes=graph_sizes(config, backend) if pp_size == 1 else ())


class TensorParallelExecutor:
    """ModelRunner's `execute` over tp ranks; rank 0 in this process."""

    def __init__(self, model: str | None, model_config, *, tp_size: int, device: str, dtype: str,
                 block_size: int, max_model_len: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 nnodes: int = 1, master_addr: str | None = None,
                 rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, ops=None,
                 secret_file: str | None = None, curve: bool = False,
                 lora_config=None, quantization: str | None = None,
                 kv_cache_dtype: str = "auto",
                 executor_backend: str = "mp", ray_address: str | None = None,
                 pp_size: int = 1, stage_layers: list[tuple[int, int]] | None = None,
                 bytes_per_block: int | None = None, graph_sizes: tuple[int, ...] = ()) -> None:
        """model: as EngineConfig.model (a directory, a .gguf, None for the default model);
        every rank resolves it on its own node, so the default model and converted GGUFs need
        no shared path across nodes (a directory must exist at the same path on each).
        secret_file: the group's shared secret (auth.read_secret_file), required when nnodes
        > 1; on one node a random secret per executor is used when it is None.
        curve: CURVE-encrypt the control and communicator sockets (auth.py).
        lora_config: a LoRAConfig to serve adapters with (every rank holds the slots of its
        shard; slot fills travel with the next step, each rank loading its own shard).
        graph_sizes: the decode batch sizes every rank captures (runtime/decode_graphs.py)."""
        check_shardable(model_config, tp_size)
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.layout = GroupLayout(tp_size, pp_size)  # rank -> (stage, tp rank)
        self.world_size = self.layout.world_size
        self.stage_layers = stage_layers or [(0, model_config.num_hidden_layers)]
        self.pipe = None  # pipeline parallelism: rank 0's StagePipe
        # Pipelining: per collected step (handle, [[stage, start, end], ...]) of the stages'
        # compute (pipeline.py's `times`), the latest STEP_TIMES_KEPT.
        self.step_times: collections.deque = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._bytes_per_block = bytes_per_block
        self.executor_backend = executor_backend  # "mp" or "ray": who starts the local ranks
        self.ray_address = ray_address
        self.dead: str | None = None  # why, once a rank is lost
        self._seq = 0
        self.lora_config = lora_config
        self.quantization = quantization
        self.kv_cache_dtype = kv_cache_dtype  # EngineConfig's: every rank's make_backend
        self._lora_writes: list = []  # (slot, LoRARequest) to send with the next step
        self.graph_sizes = tuple(graph_sizes)
        self._procs: dict[int, subprocess.Popen] = {}
        self._peers: dict[bytes, _Peer] = {}  # authenticated identity -> its rank and session
        self._identities: dict[int, bytes] = {}  # rank -> identity
        self._secret = group_secret(secret_file, nnodes)
        self._curve = curve
        self.dropped = auth.DropLog(log, "tensor parallel control")
        self._ctx = zmq.Context()
        self.control = self._ctx.socket(zmq.ROUTER)
        set_heartbeats(self.control)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished rank raises
        self.control.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_MSG_BYTES)
        if curve:
            auth.apply_curve_server(self.control, self._secret)
        # Only authenticated workers' connections count: strangers may connect and hang up.
        self._watch = ConnectionWatch(self.control, known_only=True)
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
        if self.executor_backend == "ray":  # the cluster places every rank, on any node
            ranks, per_node = range(1, self.world_size), self.world_size
        else:
            local = ranks_of_node(self.world_size, nnodes, 0)
            ranks, per_node = range(1, local.stop), len(local)
        self._procs = start_workers(self.executor_backend, self.master_addr, ranks, per_node,
                                    rendezvous_timeout_s, self._secret, self._curve,
                                    ray_address=self.ray_address,
                                    num_gpus_per_rank=1 if uses_gpu(device) else 0)
        self._rendezvous(nnodes, rendezvous_timeout_s)
        plan = {"model": None if model is None else str(model), "tp_size": self.tp_size,
                "pp_size": self.pp_size, "stage_layers": [list(r) for r in self.stage_layers],
                "group_nonce": secrets.token_bytes(16),
                "device": device, "dtype": dtype, "block_size": block_size,
                "max_model_len": max_model_len, "num_gpu_blocks": num_gpu_blocks,
                "num_cpu_blocks": num_cpu_blocks, "collective_timeout_s": collective_timeout_s,
                "nccl_unique_id": None, "local_rank": 0,
                "quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype,
                "graph_sizes": list(self.graph_sizes),
                "lora": None if self.lora_config is None else {
                    "max_loras": self.lora_config.max_loras,
                    "max_lora_rank": self.lora_config.max_lora_rank,
                    "max_cpu_loras": self.lora_config.max_cpu_loras}}
        if ops is None:
            ops = make_backend(device, dtype, device_id=0, quantization=self.quantization,
                               kv_cache_dtype=self.kv_cache_dtype)
        if ops.communicator == "nccl":
            from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

            ids = [NcclCommunicator.make_unique_id() for _ in range(self.pp_size)]
            plan["nccl_unique_id"] = ids[0]  # stage 0's tensor-parallel group
            if self.pp_size > 1:
                plan["nccl_unique_ids"] = ids  # one group per stage (stage_pipe.py)
                # One two-rank communicator per link, indexed by its sending rank (every rank
                # but the last stage's sends activations to the next stage).
                plan["nccl_link_ids"] = [
                    NcclCommunicator.make_unique_id() if not self.layout.is_last(r) else None
                    for r in range(self.world_size)]
        host = bind_host(parse_master_addr(self.master_addr)[0])  # loopback on one node
        if self.tp_size == 1:  # pipeline stages of one rank: no collectives
            self.comm = SoloCommunicator()
        elif ops.communicator != "nccl":
            self.comm = CpuCommunicator(
                0, self.tp_size, bind=zmq_tcp(host, 0), timeout_s=collective_timeout_s,
                context=self._ctx, curve_secret=self._secret if self._curve else None,
                peer_keys={p.rank: p.channel.key for p in self._peers.values()})
            plan["comm_address"] = self.comm.address
        if self.pp_size > 1:
            from pagedrun.runtime.distributed.stage_pipe import StagePipe

            self.pipe = StagePipe(plan, 0, self._ctx, self._secret, self._curve, host)
            driver_addresses = self.pipe.bind()
        body = msgpack.packb(plan)
        for identity in self._identities.values():
            self._send(identity, [b"plan", body])
        if self.pipe is not None:
            peers = self._exchange_addresses(driver_addresses, rendezvous_timeout_s)
        if self.comm is None:  # NCCL: every rank joins the communicator's init together
            from pagedrun.runtime.distributed.nccl_communicator import NcclCommunicator

            self.comm = NcclCommunicator(0, self.tp_size, plan["nccl_unique_id"], device_id=0)
        elif isinstance(self.comm, CpuCommunicator):
            self.comm.wait_for_peers(rendezvous_timeout_s)
        if self.pipe is not None:
            self.pipe.connect(peers, lambda: self.comm)
        self.runner = build_rank(plan, 0, self.comm, ops)
        if self.pipe is not None:
            self.pipe.use_stream(ops)
        self._wait_ready(DEFAULT_LOAD_TIMEOUT_S)
        if hasattr(self.comm, "abort"):
            self.start_watchdog()
        log.info("parallel group: %d stage(s) x %d tensor-parallel ranks on %d node(s) (%s), "
                 "control %s, local workers %s", self.pp_size, self.tp_size, nnodes,
                 self.executor_backend, self.master_addr,
                 {r: p.pid for r, p in self._procs.items()})

    def _exchange_addresses(self, driver_addresses: dict, timeout_s: float) -> dict:
        """Pipeline set-up's middle: every worker's `bound` (the addresses it listens on), then
        the full list to everyone (`peers`): links per rank, stage communicators per stage."""
        links: list = [None] * self.world_size
        comms: list = [None] * self.pp_size
        links[0] = driver_addresses["link"]
        bound = self._from_every_worker(b"bound", timeout_s,
                                        "pipeline set-up: ranks {} did not report their addresses")
        for rank, body in bound.items():
            links[rank] = body.get("link")
            if body.get("comm") is not None:
                comms[self.layout.stage(rank)] = body["comm"]
        peers = {"links": links, "comms": comms}
        body = msgpack.packb(peers)
        for identity in self._identities.values():
            self._send(identity, [b"peers", body])
        return peers

    def _send(self, identity: bytes, frames: list, frames_digest: bytes | None = None,
              flags: int = 0) -> None:
        self.control.send_multipart([identity, *self._peers[identity].channel.seal(
            frames, frames_digest)], flags, copy=False)

    def _recv_frames(self) -> tuple[bytes, list]:
        frames = self.control.recv_multipart(copy=False)
        return frames[0].bytes, frames[1:]

    def _open(self, identity: bytes, frames: list):
        """(rank, kind, body) of an authenticated worker's message, or None (dropped)."""
        peer = self._peers.get(identity)
        if peer is None:
            self.dropped("unknown identity", f"{_kind(frames)} from a connection that is not an "
                                             f"authenticated rank")
            return None
        try:
            frames = peer.channel.open(frames)
        except auth.AuthError as exc:
            self.dropped("failed verification", f"{_kind(frames)} on rank {peer.rank}'s "
                                                f"connection: {exc}")
            return None
        try:
            body = msgpack.unpackb(frames[1].bytes) if len(frames) > 1 else {}
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("rank") != peer.rank:
            named = body.get("rank") if isinstance(body, dict) else None
            self.dropped("rank mismatch", f"{_kind(frames)} on rank {peer.rank}'s connection "
                                          f"names rank {named!r}")
            return None
        return peer.rank, frames[0].bytes, body

    def _recv_control(self, timeout_ms: int):
        """The next authenticated message (rank, kind, body) within timeout_ms, or None; what
        fails verification on the way is dropped."""
        while self.control.poll(timeout_ms):
            timeout_ms = 0  # only the first wait blocks: then drain what is there
            msg = self._open(*self._recv_frames())
            if msg is not None:
                return msg
        return None

    def _rendezvous(self, nnodes: int, timeout_s: float) -> None:
        """Authenticate every rank (hello -> challenge -> join, auth.py) and bind its ROUTER
        identity; fills self._peers and self._identities."""
        deadline = time.monotonic() + timeout_s
        pending: dict[bytes, tuple] = {}  # challenged, not joined: (rank, nonces, host, pid)
        while len(self._identities) < self.world_size - 1:
            self._check_local_workers()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world_size)) - set(self._identities))
                hint = ("" if nnodes == 1 else
                        f"; is `paged-run serve --tensor-parallel-size {self.tp_size} --nnodes "
                        f"{nnodes} --node-rank R --master-addr {self.master_addr}` (with the "
                        f"same --tp-secret-file) running on every other node?")
                raise PeerLostError(f"tensor parallel rendezvous: ranks {missing} did not join "
                                    f"{self.master_addr} within {timeout_s:.0f} s{hint}")
            if not self.control.poll(int(POLL_INTERVAL_S * 1000)):
                continue
            identity, frames = self._recv_frames()
            kind = frames[0].bytes if frames else b""
            if identity in self._peers:
                self._open(identity, frames)  # nothing is expected from a joined rank yet
            elif kind == b"hello":
                self._hello(identity, frames, pending)
            elif kind == b"join" and identity in pending:
                self._join(identity, frames, pending.pop(identity))
            else:
                self.dropped("unknown identity", f"{_kind(frames)} before hello")

    def _refuse(self, identity: bytes, why: str) -> None:
        """An unsealed `error` to a peer that has no session: the worker exits with it."""
        try:
            self.control.send_multipart([identity, b"error", why.encode()], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _hello(self, identity: bytes, frames: list, pending: dict) -> None:
        try:
            if len(frames) != 3:
                raise auth.AuthError("malformed hello")
            auth.check_mac(self._secret, b"hello", frames[:2], frames[2])
        except auth.AuthError as exc:
            self.dropped("hello failed verification", str(exc))
            self._refuse(identity, "authentication failed: this worker's tensor-parallel "
                                   "secret is not the driver's (--tp-secret-file)")
            return
        body = msgpack.unpackb(frames[1].bytes)
        rank, nonce = body.get("rank"), body.get("nonce")
        if not isinstance(rank, int) or not 0 < rank < self.world_size \
                or rank in self._identities or not isinstance(nonce, bytes):
            self._refuse(identity, f"rank {rank!r} is not an expected rank of this "
                                   f"{self.world_size}-rank group (out of range or already "
                                   f"joined)")
            return
        driver_nonce = secrets.token_bytes(auth.NONCE_BYTES)
        pending[identity] = (rank, nonce, driver_nonce, body.get("host"), body.get("pid"))
        challenge = [b"challenge", msgpack.packb({"nonce": driver_nonce})]
        try:
            self.control.send_multipart(
                [identity, *challenge, auth.mac(self._secret, b"challenge" + nonce, challenge)],
                zmq.NOBLOCK)
        except zmq.ZMQError:  # it hung up already; a worker that retries says hello again
            pending.pop(identity, None)

    def _join(self, identity: bytes, frames: list, challenged: tuple) -> None:
        rank, nonce, driver_nonce, host, pid = challenged
        channel = auth.Channel(auth.session_key(self._secret, rank, nonce, driver_nonce),
                               outgoing=auth.DRIVER_TO_WORKER, incoming=auth.WORKER_TO_DRIVER)
        try:
            channel.open(frames)
        except auth.AuthError as exc:
            self.dropped("join failed verification", f"rank {rank}: {exc}")
            return
        if rank in self._identities:  # two authenticated workers claimed it: the first wins
            self._refuse(identity, f"rank {rank} already joined")
            return
        self._peers[identity] = _Peer(rank, channel)
        self._identities[rank] = identity
        self._watch.add(source_fd(frames))
        log.info("rank %d joined from %s (pid %s), authenticated", rank, host, pid)

    def _wait_ready(self, timeout_s: float) -> None:
        self._from_every_worker(b"ready", timeout_s,
                                "tensor parallel: ranks {} did not load their shards")

    def _from_every_worker(self, kind: bytes, timeout_s: float, late: str) -> dict[int, dict]:
        """Rank -> body of every worker's `kind` message, within timeout_s (else PeerLostError:
        `late` with the missing ranks); an `error` from any worker fails at once."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, dict] = {}
        while len(got) < self.world_size - 1:
            self._check_connections()  # not _check_alive: it would swallow these messages
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world_size)) - set(got))
                raise PeerLostError(f"{late.format(missing)} within {timeout_s:.0f} s")
            msg = self._recv_control(int(POLL_INTERVAL_S * 1000))
            if msg is None:
                continue
            rank, got_kind, body = msg
            if got_kind == b"error":
                raise PeerLostError(f"rank {rank} failed: {body.get('message')}")
            if got_kind == kind:
                got[rank] = body
        return got

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
        (the only message a worker sends after `ready`; only an authenticated one counts)."""
        self._check_connections()
        while True:
            msg = self._recv_control(0)
            if msg is None:
                return
            rank, kind, body = msg
            if kind == b"error":
                raise PeerLostError(f"rank {rank} failed: {body.get('message')}")

    # ------------------------------------------------------------------ capacity

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks of each rank's pools (the same on every rank), per virtual engine."""
        return self.runner.num_gpu_blocks

    @property
    def pipeline_depth(self) -> int:
        """Batches in flight (virtual engines): one per pipeline stage."""
        return self.pp_size

    @property
    def num_cpu_blocks(self) -> int:
        return self.runner.num_cpu_blocks

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on one rank (its KV heads only; with pipelining, on a rank of
        the stage with the most layers)."""
        if self._bytes_per_block is not None:
            return self._bytes_per_block
        return self.runner.kv_bytes_per_block()

    # ------------------------------------------------------------------ steps

    def load_adapter(self, lora_request):
        """Rank 0's shard of an adapter (the engine's AdapterCache keeps it on the host)."""
        return self.runner.load_adapter(lora_request)

    def apply_lora_writes(self, writes) -> None:
        """Fill rank 0's slots now; the other ranks fill theirs from the next step's header."""
        self.runner.apply_lora_writes(writes)
        self._lora_writes.extend((w.slot, w.lora_request) for w in writes)

    def execute(self, out, prompt_logit_rows: tuple[int, ...] = (), row_lora_slots=None):
        """Broadcast the step, run rank 0's forward; the RunnerOutput of ModelRunner.execute.
        (Pipeline parallelism: submit + collect.)"""
        if self.pp_size > 1:
            return self.collect(out, self.submit(out, prompt_logit_rows, row_lora_slots))
        try:
            self._broadcast(out, prompt_logit_rows, row_lora_slots, 0)
            return self.runner.execute(out, prompt_logit_rows, row_lora_slots)
        except BaseException as exc:
            self._fail(exc)

    def submit(self, out, prompt_logit_rows: tuple[int, ...] = (), row_lora_slots=None,
               virtual_engine: int = 0) -> int:
        """Pipeline parallelism: start a step of `virtual_engine` -- broadcast it, run stage
        0's layers here and hand the activations to stage 1 -- and return its handle for
        `collect` without waiting for the later stages."""
        try:
            seq = self._broadcast(out, prompt_logit_rows, row_lora_slots, virtual_engine)
            start = time.monotonic()
            hidden = self.runner.forward(out, None, virtual_engine, row_lora_slots)
            send_hidden(self.pipe.link_out, hidden, [[0, start, time.monotonic()]])
            return seq
        except BaseException as exc:
            self._fail(exc)

    def collect(self, out, handle: int):
        """The RunnerOutput of the step `submit` returned `handle` for (steps are collected in
        the order they were submitted), from the last stage; waits for it, watching the
        ranks."""
        try:
            output, times = receive_logits(self.pipe.link_in, np.flatnonzero(out.sample_mask),
                                           f"step {handle}'s logits", check=self._check_alive)
            self.step_times.append((handle, times))
            if self.runner.logits_on_device:
                output.logits = self.runner.ops.xp.asarray(output.logits)
            return output
        except BaseException as exc:
            self._fail(exc)

    def _broadcast(self, out, prompt_logit_rows, row_lora_slots, virtual_engine: int) -> int:
        if self.dead is not None:
            raise PeerLostError(f"tensor parallel group is down: {self.dead}")
        self._check_alive()
        self._seq += 1
        frames = encode_step(self._seq, out, prompt_logit_rows, self._lora_writes,
                             row_lora_slots, virtual_engine)
        self._lora_writes = []
        step_digest = auth.digest(frames)  # hashed once, MACed per worker
        for identity in self._identities.values():
            self._send(identity, frames, step_digest)
        return self._seq

    def _fail(self, exc: BaseException):
        """Whatever broke, the ranks are out of step now: the group cannot continue."""
        self.dead = f"{type(exc).__name__}: {exc}"
        log.error("parallel group failed: %s", self.dead)
        self.close()
        if isinstance(exc, PeerLostError):
            raise exc
        raise PeerLostError(f"parallel step failed: {self.dead}") from exc

    def close(self) -> None:
        """Tell the workers to exit, kill those that do not, release the sockets. Idempotent."""
        if self._ctx is None:
            return
        if self.dead is None:
            for identity in self._identities.values():
                try:
                    self._send(identity, [b"shutdown"], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if self._watchdog is not None:
            self._watchdog.stop.set()
            self._watchdog.join()
        kill_workers(self._procs, SHUTDOWN_GRACE_S if self.dead is None else 0.0)
        if self.comm is not None:
            self.comm.close()
        if self.pipe is not None:
            self.pipe.close()
        self._watch.close()
        self.control.close(linger=0 if self.dead else int(SHUTDOWN_GRACE_S * 1000))
        self._ctx.term()
        self._ctx = None
        atexit.unregister(self.close)



class _Peer:
    """An authenticated worker connection: its rank and its session."""

    __slots__ = ("rank", "channel")

    def __init__(self, rank: int, channel: auth.Channel) -> None:
        self.rank, self.channel = rank, channel


def _kind(frames: list) -> str:
    """A received message's type, printable and short (for the drop log)."""
    return repr(frames[0].bytes[:16] if frames else b"")


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
