"""Pipeline parallelism: which layers each stage holds, who is who in a stages x tensor-parallel
group, and the activation links that carry a step from stage to stage.

Group layout: pipeline_parallel_size P stages of tensor_parallel_size T ranks; global rank
g = stage * T + tp_rank. Rank 0 (stage 0, tp rank 0) is the driver (the engine's process). Each
stage's T ranks form their own tensor-parallel group (all-reduce / gather among themselves,
sharding.py's split of every layer they hold); stage 0 holds the embedding, the last stage the
final norm and the LM head.

One step of virtual engine v (docs/distributed.md, "Pipeline parallelism"): the driver sends the
step to every rank (step_broadcast.py, with v); stage 0 embeds and runs its layers, then each
rank (s, t) sends its (x, residual) [num_tokens, hidden] to rank (s + 1, t), which runs its own
layers on them and passes them on; the last stage's ranks compute the logits (gathered to its
tp rank 0), and that rank sends them to the driver. Every rank sends and answers every step,
also one without tokens (its block moves still run), so the links stay in step.

On cuda each link between stages also has a two-rank NCCL communicator (its unique id in the
plan): the header still goes over ZeroMQ, the arrays go device to device with NCCL send/recv on
the compute streams. The logits to the driver always travel over ZeroMQ (small; the driver's
sampler uploads them).

Links: the receiving rank binds a ROUTER and reports its address to the driver (executor.py's
`bound` / `peers` round); the sender connects a DEALER, whose sends queue without waiting for
the receiver: a stage hands its output over and starts its next batch at once, which is what
lets P batches (one per virtual engine) be in flight on P stages. A link's first message is a
hello with a MAC under a key derived from the group secret and the launch's fresh nonce
(`link_key`); the receiver binds the ROUTER identity that proved it and drops anything else, as
the CPU communicator does. A receive is bounded and watches the sender's connection: a stage
whose upstream died fails its step (and the driver fails the group) instead of hanging.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import zmq

from pagedrun.runtime.distributed.auth import DropLog, apply_curve_client, apply_curve_server
from pagedrun.runtime.distributed.communicator import (POLL_INTERVAL_S, ConnectionWatch,
                                                       PeerLostError, set_heartbeats, source_fd)
from pagedrun.runtime.errors import PagedRunError

log = logging.getLogger("pagedrun.pp")


class PipelineConfigError(PagedRunError):
    """The model's layers cannot be split as asked; the message names the numbers."""


def stage_layer_ranges(num_layers: int, pp_size: int,
                       partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers. Even by default, the remainder going one layer
    each to the earliest stages (the last stage also runs the LM head, the first only the
    embedding lookup); `partition` gives the counts explicitly (vLLM's
    VLLM_PP_LAYER_PARTITION, here `--pp-layer-partition`)."""
    if pp_size < 1:
        raise PipelineConfigError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if partition is None:
        if pp_size > num_layers:
            raise PipelineConfigError(
                f"pipeline_parallel_size {pp_size} is more than the model's {num_layers} "
                f"layers: every stage must hold at least one")
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if s < extra else 0) for s in range(pp_size)]
    else:
        counts = list(partition)
        if len(counts) != pp_size or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise PipelineConfigError(
                f"pp_layer_partition {tuple(counts)}: must be {pp_size} counts >= 1 summing to "
                f"the model's {num_layers} layers")
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


@dataclass(frozen=True)
class GroupLayout:
    """pp_size stages x tp_size tensor-parallel ranks; global rank = stage * tp_size + tp_rank."""

    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def stage(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    def is_last(self, rank: int) -> bool:
        return self.stage(rank) == self.pp_size - 1


def link_key(secret: bytes, group_nonce: bytes, sender_rank: int, receiver_rank: int) -> bytes:
    """The key a link's hello is MACed with: the group secret, the launch's fresh nonce (an old
    launch's hello does not open) and both ends."""
    return hmac.new(secret, b"pagedrun-pp-link" + group_nonce + sender_rank.to_bytes(4, "big")
                    + receiver_rank.to_bytes(4, "big"), hashlib.sha256).digest()


def stage_comm_key(secret: bytes, group_nonce: bytes, rank: int) -> bytes:
    """The key a stage > 0 rank's hello to its stage's communicator is MACed with (stage 0's
    communicator keeps the control sessions' keys)."""
    return hmac.new(secret, b"pagedrun-pp-comm" + group_nonce + rank.to_bytes(4, "big"),
                    hashlib.sha256).digest()


class SoloCommunicator:
    """The collectives of a one-rank tensor-parallel group (a pipeline stage with T = 1)."""

    rank = 0
    world_size = 1
    device_arrays = True  # it never touches the data: the backend's arrays pass as they are

    def all_reduce(self, x):
        return x

    def gather(self, x):
        return [x]

    def close(self) -> None:
        pass


def _host(x) -> np.ndarray:
    """A backend array as a contiguous numpy array with the same bits (no dtype change:
    bfloat16 activations travel as their uint16 bits)."""
    get = getattr(x, "get", None)
    return np.ascontiguousarray(get() if callable(get) else x)


class LinkReceiver:
    """The receiving end of one link: binds, accepts one authenticated sender."""

    def __init__(self, context: zmq.Context, bind: str, key: bytes, sender_rank: int,
                 timeout_s: float, curve_secret: bytes | None = None) -> None:
        # cuda: a two-rank NCCL communicator with the sender (it is rank 0, we are 1) brings
        # the arrays device to device; the ZeroMQ message then carries the header only.
        self.nccl = None
        self.sock = context.socket(zmq.ROUTER)
        set_heartbeats(self.sock)
        if curve_secret is not None:
            apply_curve_server(self.sock, curve_secret)
        self.watch = ConnectionWatch(self.sock, known_only=True)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.key, self.sender_rank, self.timeout_s = key, sender_rank, timeout_s
        self.identity: bytes | None = None
        self.expected_seq = 1
        self.dropped = DropLog(log, f"pipeline link from rank {sender_rank}")

    def recv(self, what: str, check=None) -> tuple[dict, list[np.ndarray]]:
        """The next message (header, arrays), in order. check: called every poll slice while
        waiting (the driver's look at its control connections)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.sock.poll(int(POLL_INTERVAL_S * 1000)):
                frames = self.sock.recv_multipart(copy=False)
                message = self._accept(frames)
                if message is not None:
                    return message
                continue
            if check is not None:
                check()
            if self.watch.check():
                raise PeerLostError(f"{what}: rank {self.sender_rank}'s connection dropped "
                                    f"(its process died?)")
            if time.monotonic() > deadline:
                raise PeerLostError(f"{what}: nothing from rank {self.sender_rank} within "
                                    f"{self.timeout_s:.0f} s")

    def _accept(self, frames: list):
        identity = frames[0].bytes
        if identity != self.identity:
            if (self.identity is None and len(frames) == 3 and frames[1].bytes == b"hello"
                    and hmac.compare_digest(frames[2].bytes, self.key)):
                self.identity = identity
                self.watch.add(source_fd(frames))
            else:
                self.dropped("unknown identity", "not the authenticated sender")
            return None
        header = msgpack.unpackb(frames[1].bytes)
        if header.get("seq") != self.expected_seq:
            raise RuntimeError(f"pipeline link from rank {self.sender_rank}: message "
                               f"{header.get('seq')} arrived, expected {self.expected_seq}")
        self.expected_seq += 1
        if header.get("nccl"):
            return header, [self.nccl.recv(shape, np.dtype(dtype), peer=0)
                            for dtype, shape in header["arrays"]]
        arrays = [np.frombuffer(f.buffer, dtype=dtype).reshape(shape)
                  for (dtype, shape), f in zip(header["arrays"], frames[2:])]
        return header, arrays

    def close(self) -> None:
        self.watch.close()
        self.sock.close(linger=0)


class LinkSender:
    """The sending end of one link: connects and says hello; sends never wait for the
    receiver (ZeroMQ queues them)."""

    def __init__(self, context: zmq.Context, connect: str, key: bytes,
                 curve_secret: bytes | None = None) -> None:
        self.sock = context.socket(zmq.DEALER)
        set_heartbeats(self.sock)
        if curve_secret is not None:
            apply_curve_client(self.sock, curve_secret)
        self.sock.connect(connect)
        # The hello's proof is the derived key itself: only a holder of the group secret and
        # this launch's nonce can compute it, and the receiver takes only the first.
        self.sock.send_multipart([b"hello", key])
        self.seq = 0
        self.nccl = None  # cuda: as LinkReceiver's (we are rank 0 of the pair)

    def send(self, arrays: list, **fields) -> None:
        """arrays: backend or numpy arrays (sent as their bits; with `nccl`, device to device
        after the header); fields: more header entries."""
        self.seq += 1
        if self.nccl is not None and arrays:
            header = {"seq": self.seq, "nccl": True,
                      "arrays": [[np.dtype(a.dtype).str, list(a.shape)] for a in arrays],
                      **fields}
            self.sock.send_multipart([msgpack.packb(header)])
            for a in arrays:
                self.nccl.send(a, peer=1)
            return
        hosts = [_host(a) for a in arrays]
        header = {"seq": self.seq, "arrays": [[a.dtype.str, list(a.shape)] for a in hosts],
                  **fields}
        self.sock.send_multipart([msgpack.packb(header), *hosts], copy=False)

    def close(self) -> None:
        self.sock.close(linger=1000)  # let the last step's message leave


# Every link message carries `times`: [stage, start, end] (time.monotonic() seconds) of each
# stage's compute for the step so far, each stage appending its own; the driver keeps them per
# step (TensorParallelExecutor.step_times) for the overlap check and the benchmark. The clocks
# are comparable only between processes of one node.


def receive_hidden(link: LinkReceiver, ops, what: str) -> tuple[tuple | None, list]:
    """The previous stage's (x, residual) for this step, as the backend's arrays (writable
    copies: the ops may update them in place), or None for a step without tokens; and the
    stages' `times` so far."""
    header, arrays = link.recv(what)
    times = header.get("times", [])
    if not arrays:
        return None, times
    if header.get("nccl"):  # fresh device arrays already
        return tuple(arrays), times
    xp = ops.xp
    return tuple(xp.array(a) for a in arrays), times


def send_hidden(link: LinkSender, hidden, times: list) -> None:
    link.send([] if hidden is None else list(hidden), times=times)


def send_logits(link: LinkSender, output, times: list) -> None:
    """The last stage's RunnerOutput for the driver: logits, then the prompt-logit rows (their
    batch rows in the header), then logits_start when drafts were verified."""
    rows = sorted(output.prompt_logits)
    arrays = [output.logits, *(output.prompt_logits[r] for r in rows)]
    if output.logits_start is not None:
        arrays.append(output.logits_start)
    link.send(arrays, prompt_rows=rows, logits_start=output.logits_start is not None,
              times=times)


def receive_logits(link: LinkReceiver, sample_rows: np.ndarray, what: str, check=None):
    """The driver's side of send_logits: (a RunnerOutput with numpy logits, every stage's
    [stage, start, end])."""
    from pagedrun.runtime.model_runner import RunnerOutput

    header, arrays = link.recv(what, check)
    rows = header["prompt_rows"]
    logits_start = arrays[-1].copy() if header["logits_start"] else None
    prompt_logits = {row: arrays[1 + i].copy() for i, row in enumerate(rows)}
    return (RunnerOutput(sample_rows, arrays[0].copy(), prompt_logits, logits_start),
            header.get("times", []))
