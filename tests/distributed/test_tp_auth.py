"""Only the group's ranks can talk on the tensor-parallel sockets (runtime/distributed/auth.py):

- a stranger (a local process with a raw DEALER) that sends `error` for rank 1 and for rank 99,
  a forged `hello` / `join` / `ready`, a message with a bad MAC, or collective frames to the
  communicator, and then hangs up, changes nothing: the engine keeps serving TP=1's tokens, the
  messages are dropped and logged, the forged hello gets a refusal and no challenge;
- on a rank's own (authenticated) connection, seen through a proxy: a tampered message, a
  replayed one and a correctly sealed one naming another rank are dropped; the worker drops a
  replayed plan and a forged `shutdown` from the driver's side; a correctly sealed `error` does
  fail the group (the positive control);
- the secret: per launch on one node; several nodes refuse to start without a secret file, and
  refuse one that others can read; sessions refuse tampering and replays;
- CURVE on the internal sockets serves the same tokens.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from test_tp_failures import free_port, worker_pids
from tp_helpers import greedy_run, make_engine, prompts, secret_file, write_model_dir

VOCAB = 389
PROMPTS = prompts(VOCAB)[:2]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("auth") / "m", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def reference(model_dir):
    engine = make_engine(model_dir, 1)
    try:
        return greedy_run(engine, PROMPTS, MAX_TOKENS)[0]
    finally:
        engine.close()


def _tcp(address: str) -> str:
    return address if address.startswith("tcp://") else f"tcp://{address}"


def _drain(sock, timeout_s: float = 1.0) -> list[list[bytes]]:
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            got.append(sock.recv_multipart())
    return got


def test_stranger_cannot_fail_or_join_the_group(model_dir, reference, caplog):
    caplog.set_level(logging.WARNING, logger="pagedrun.tp")
    engine = make_engine(model_dir, 2)
    ctx = zmq.Context()
    try:
        executor = engine.runner
        control = ctx.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 0)
        control.connect(_tcp(executor.master_addr))
        pack = msgpack.packb
        forged = [
            [b"error", pack({"rank": 1, "message": "forged: rank 1 failed"})],
            [b"error", pack({"rank": 99, "message": "forged: rank 99 failed"})],
            [b"hello", pack({"rank": 1, "pid": os.getpid(), "host": socket.gethostname(),
                             "nonce": b"n" * 16}), b"\0" * 32],
            [b"join", pack({"rank": 1}), b"\0" * 40],
            [b"ready", pack({"rank": 1})],
            [b"error", pack({"rank": 1, "message": "bad MAC"}), bytes(8) + b"\0" * 32],
            [b"error", b"\xc1 not msgpack"],
        ]
        for frames in forged:
            control.send_multipart(frames)
        # The communicator's ROUTER (cpu backend): a hello without / with a wrong MAC and
        # collective frames for the next all-reduce.
        comm = ctx.socket(zmq.DEALER)
        comm.setsockopt(zmq.LINGER, 0)
        comm.connect(executor.comm.address)
        comm.send_multipart([b"hello", b"1"])
        comm.send_multipart([b"hello", b"1", b"\0" * 32])
        x = np.full(64, 1e6, np.float32)
        comm.send_multipart([pack({"seq": executor.comm._seq + 1, "dtype": x.dtype.str,
                                   "shape": list(x.shape)}), x])
        time.sleep(0.3)  # delivered before the first step reads them
        tokens, _ = greedy_run(engine, PROMPTS, MAX_TOKENS)  # every forgery is read by now
        assert executor.dead is None
        assert tokens == reference
        assert _drain(control, 0.3) == []  # the forged hello: no challenge, no plan, nothing
        assert executor.dropped.count == len(forged)
        assert executor.comm.dropped.count == 3
        logged = caplog.text
        assert "tensor parallel control: dropped a message: unknown identity" in logged
        assert "communicator rank 0: dropped a message: rejected hello" in logged
        assert "communicator rank 0: dropped a message: unknown identity" in logged
        # Rate-limited: one warning per reason, not one per forged message.
        assert logged.count("tensor parallel control: dropped a message") == 1
        comm.close()
        control.close()  # the strangers hang up: not a lost rank
        time.sleep(0.5)  # the disconnects reach the socket monitors before the next step
        tokens, _ = greedy_run(engine, PROMPTS, MAX_TOKENS)
        assert executor.dead is None
        assert tokens == reference
    finally:
        engine.close()
        ctx.destroy(linger=0)


class Proxy(threading.Thread):
    """A man in the middle of one worker's control connection: forwards both ways, records
    every message, and sends what the test queues (to the driver or to the worker)."""

    def __init__(self, driver_addr: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)  # the worker connects here
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind("tcp://127.0.0.1:0")
        self.address = self.front.getsockopt_string(zmq.LAST_ENDPOINT)[len("tcp://"):]
        self.back = self.ctx.socket(zmq.DEALER)  # to the driver, as the worker
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(_tcp(driver_addr))
        self.worker_id = None
        self.seen: list[tuple[str, list[bytes]]] = []
        self.inject: queue.Queue = queue.Queue()
        self.stop = threading.Event()

    def sent(self, direction: str, kind: bytes) -> list[bytes]:
        return next(f for d, f in self.seen if d == direction and f[0] == kind)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(10))
            if self.front in events:
                self.worker_id, *frames = self.front.recv_multipart()
                self.seen.append(("w2d", frames))
                self.back.send_multipart(frames)
            if self.back in events:
                frames = self.back.recv_multipart()
                self.seen.append(("d2w", frames))
                self.front.send_multipart([self.worker_id, *frames])
            while not self.inject.empty():
                direction, frames = self.inject.get()
                if direction == "w2d":
                    self.back.send_multipart(frames)
                else:
                    self.front.send_multipart([self.worker_id, *frames])
        self.front.close()
        self.back.close()
        self.ctx.term()

    def flush(self) -> None:
        while not self.inject.empty():
            time.sleep(0.01)
        time.sleep(0.3)


def test_tampered_replayed_and_misnamed_messages_on_a_rank_connection(model_dir, reference,
                                                                      tmp_path, caplog):
    """Two "nodes" on loopback (node 0: rank 0; rank 1 spawned here as node 1 would), rank 1's
    control connection through a Proxy."""
    from pagedrun.runtime.distributed import auth
    from pagedrun.runtime.distributed.communicator import PeerLostError
    from pagedrun.runtime.distributed.executor import kill_workers, spawn_workers

    caplog.set_level(logging.WARNING, logger="pagedrun.tp")
    secret_path = secret_file(tmp_path)
    secret = auth.read_secret_file(secret_path)
    addr = f"127.0.0.1:{free_port()}"
    proxy = Proxy(addr)
    proxy.start()
    procs = spawn_workers(proxy.address, range(1, 2), 1, 60.0, secret)
    engine = None
    try:
        engine = make_engine(model_dir, 2, nnodes=2, master_addr=addr,
                             tp_secret_file=secret_path)
        executor = engine.runner
        hello, challenge = proxy.sent("w2d", b"hello"), proxy.sent("d2w", b"challenge")
        ready, plan = proxy.sent("w2d", b"ready"), proxy.sent("d2w", b"plan")
        key = auth.session_key(secret, 1, msgpack.unpackb(hello[1])["nonce"],
                               msgpack.unpackb(challenge[1])["nonce"])
        forger = auth.Channel(key, outgoing=auth.WORKER_TO_DRIVER,
                              incoming=auth.DRIVER_TO_WORKER)
        forger.sent = 1000  # above anything the worker sent
        executor.dropped.interval_s = 0  # log every drop, to see each reason
        tampered = [b"error", msgpack.packb({"rank": 1, "message": "tampered"}), ready[-1]]
        for frames in (tampered, ready, proxy.sent("w2d", b"join"),
                       forger.seal([b"error", msgpack.packb({"rank": 99, "message": "x"})])):
            proxy.inject.put(("w2d", frames))
        # Towards the worker: a replayed plan, an unsealed and a mis-sealed shutdown.
        for frames in (plan, [b"shutdown"], [b"shutdown", plan[-1]]):
            proxy.inject.put(("d2w", frames))
        proxy.flush()
        tokens, _ = greedy_run(engine, PROMPTS, MAX_TOKENS)
        assert tokens == reference
        assert executor.dead is None and procs[1].poll() is None
        logged = caplog.text
        assert logged.count("dropped a message: failed verification") == 3
        assert "connection: bad MAC" in logged  # tampered
        assert logged.count("connection: replayed message") == 2  # ready, join
        assert "dropped a message: rank mismatch" in logged and "names rank 99" in logged
        assert executor.dropped.count == 4
        # The positive control: an error sealed under rank 1's session is believed.
        proxy.inject.put(("w2d", forger.seal(
            [b"error", msgpack.packb({"rank": 1, "message": "sealed by the test"})])))
        proxy.flush()
        with pytest.raises(PeerLostError, match="rank 1 failed: sealed by the test"):
            executor.execute(None)
    finally:
        if engine is not None:
            engine.close()
        kill_workers(procs)
        proxy.stop.set()
        proxy.join()


def test_worker_with_another_secret_is_refused(model_dir, tmp_path):
    """A node whose secret file differs: its worker is refused at hello and exits at once
    (code 1) instead of waiting out the join timeout."""
    from pagedrun.runtime.distributed import auth
    from pagedrun.runtime.distributed.communicator import PeerLostError
    from pagedrun.runtime.distributed.executor import TensorParallelExecutor, spawn_workers
    from pagedrun.runtime.model_config import ModelConfig

    addr = f"127.0.0.1:{free_port()}"
    procs = spawn_workers(addr, range(1, 2), 1, 60.0, auth.new_secret())
    started = time.monotonic()
    with pytest.raises(PeerLostError, match=r"ranks \[1\] did not join"):
        TensorParallelExecutor(model_dir, ModelConfig.from_model_dir(model_dir), tp_size=2,
                               device="cpu", dtype="auto", block_size=16, max_model_len=256,
                               num_gpu_blocks=8, num_cpu_blocks=0, nnodes=2, master_addr=addr,
                               secret_file=secret_file(tmp_path), rendezvous_timeout_s=4.0)
    assert procs[1].wait(30) == 1
    assert time.monotonic() - started < 30


def test_multinode_needs_a_private_secret_file(model_dir, tmp_path):
    from pagedrun.runtime.distributed import auth
    from pagedrun.runtime.distributed.executor import TensorParallelExecutor
    from pagedrun.runtime.distributed.node import run_node
    from pagedrun.runtime.model_config import ModelConfig

    config = ModelConfig.from_model_dir(model_dir)
    before = set(worker_pids(os.getpid()))
    kwargs = dict(tp_size=4, device="cpu", dtype="auto", block_size=16, max_model_len=256,
                  num_gpu_blocks=8, num_cpu_blocks=0, nnodes=2,
                  master_addr=f"127.0.0.1:{free_port()}")
    with pytest.raises(auth.TensorParallelSecretError, match="--tp-secret-file"):
        TensorParallelExecutor(model_dir, config, **kwargs)
    with pytest.raises(auth.TensorParallelSecretError, match="--tp-secret-file"):
        run_node(kwargs["master_addr"], 4, 2, 1)
    path = secret_file(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(auth.TensorParallelSecretError, match="chmod 600"):
        TensorParallelExecutor(model_dir, config, secret_file=path, **kwargs)
    short = tmp_path / "short"
    short.write_text("too short\n")
    short.chmod(0o600)
    with pytest.raises(auth.TensorParallelSecretError, match="at least 32"):
        run_node(kwargs["master_addr"], 4, 2, 1, secret_file=str(short))
    assert set(worker_pids(os.getpid())) - before == set()  # nothing was spawned


def test_secret_is_per_launch_and_not_on_the_command_line(model_dir):
    engines = [make_engine(model_dir, 2) for _ in range(2)]
    try:
        a, b = (e.runner._secret for e in engines)
        assert a != b and len(a) == 32
        for pid in worker_pids(os.getpid()):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            for secret in (a, b):
                assert secret not in cmdline and secret.hex().encode() not in cmdline
                assert secret not in environ and secret.hex().encode() not in environ
    finally:
        for e in engines:
            e.close()


def test_channel_refuses_tampering_and_replays():
    from pagedrun.runtime.distributed import auth

    key = auth.new_secret()
    sender = auth.Channel(key, outgoing=auth.DRIVER_TO_WORKER, incoming=auth.WORKER_TO_DRIVER)
    receiver = auth.Channel(key, outgoing=auth.WORKER_TO_DRIVER, incoming=auth.DRIVER_TO_WORKER)
    arrays = [b"step", b"header", np.arange(12, dtype=np.int32).reshape(3, 4)]
    sealed = sender.seal(arrays, auth.digest(arrays))
    assert receiver.open([*sealed[:2], sealed[2].tobytes(), sealed[3]])[:2] == arrays[:2]
    with pytest.raises(auth.AuthError, match="replayed"):
        receiver.open(sealed)
    second = sender.seal([b"ready", b"x"])
    with pytest.raises(auth.AuthError, match="bad MAC"):
        receiver.open([b"error", b"x", second[-1]])
    with pytest.raises(auth.AuthError, match="bad MAC"):  # the other direction's key use
        sender.open(second)
    with pytest.raises(auth.AuthError):
        receiver.open([b"ready", b"x"])
    assert receiver.open(second) == [b"ready", b"x"]


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_on_the_internal_sockets(model_dir, reference):
    engine = make_engine(model_dir, 2, tp_curve=True)
    try:
        executor = engine.runner
        assert executor.control.curve_server and executor.comm.sock.curve_server
        tokens, _ = greedy_run(engine, PROMPTS, MAX_TOKENS)
        assert tokens == reference
    finally:
        engine.close()
