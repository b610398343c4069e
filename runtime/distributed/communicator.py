"""The collectives a tensor-parallel forward needs, and the CPU implementation over ZeroMQ.

Interface (`Communicator`): `all_reduce(x)` (the sum over ranks, every rank gets it) and
`gather(x)` (rank 0 gets every rank's array in rank order; the others get None). The cuda
backend uses NCCL (nccl_communicator.py); the cpu and sim backends use `CpuCommunicator`.

CpuCommunicator is a star through rank 0: rank 0 binds a ROUTER, every other rank connects a
DEALER. An all-reduce sends each rank's array to rank 0, which sums in the fixed order
((x0 + x1) + x2) + ... in float32 and sends the result back, so the result is bit-identical on
every rank and from run to run. bfloat16 activations (uint16 bits) are widened for the sum and
rounded back once.

No wait is unbounded: every receive polls in POLL_INTERVAL_S slices and checks a socket monitor;
a peer whose connection drops (its process died, or ZMTP heartbeats stopped: its host is gone)
raises `PeerLostError` at once, and a peer that is merely silent for `timeout_s` raises it too.

Who is a rank (auth.py): rank 0's ROUTER is bound on loopback unless the group spans nodes, but
any local process can connect to it. A rank's first message is `hello` with a MAC under its
control session key (`auth_key`; rank 0 holds every rank's in `peer_keys`); rank 0 binds the
connection's ROUTER identity to that rank and drops (rate-limited warning) frames from any other
identity. Only the bound connections count for the monitor: a stranger that connects and hangs
up is not a lost peer. With `curve_secret` the ROUTER is a CURVE server (auth.py).
"""
from __future__ import annotations

import hmac
import logging
import time
from typing import Protocol

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedrun.runtime.distributed.auth import (AuthError, DropLog, apply_curve_client,
                                               apply_curve_server, comm_hello_mac)
from pagedrun.runtime.errors import PagedRunError

log = logging.getLogger("pagedrun.tp")

# How often a blocked receive wakes up to look at the connection monitor.
POLL_INTERVAL_S = 0.05
# ZMTP heartbeats: a peer host that vanishes without closing its TCP connection is noticed
# after HEARTBEAT_TIMEOUT_MS instead of the kernel's TCP timeout (minutes).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# A collective whose peers stay silent this long (but connected) fails; a forward between two
# collectives is one layer's work, far below this even on the sim backend.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
_BF16_BITS = np.dtype(np.uint16)


class PeerLostError(PagedRunError):
    """A tensor-parallel peer died, dropped its connection, or did not answer in time."""

    engine_dead = True  # the server fails in-flight requests and exits (server/engine_loop.py)


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x): ...   # x: activations on this rank's device; returns the sum
    def gather(self, x): ...       # rank 0: [x_0, ..., x_{n-1}]; other ranks: None
    def close(self) -> None: ...


def set_heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)


def source_fd(frames) -> int | None:
    """The file descriptor of the connection a received message (copy=False frames) came on."""
    try:
        fd = frames[-1].get(zmq.SRCFD)
    except (AttributeError, zmq.ZMQError):
        return None
    return fd if fd >= 0 else None


class ConnectionWatch:
    """Reports when a connection of `sock` drops, through a ZeroMQ socket monitor.

    known_only: count only the connections registered with `add` (a bound socket's
    authenticated peers); others (strangers, refused peers) may come and go. A connection whose
    fd is unknown (`add(None)`) turns that filter off."""

    def __init__(self, sock: zmq.Socket, known_only: bool = False) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.lost = False
        self.known_only = known_only
        self.fds: set[int] = set()

    def add(self, fd: int | None) -> None:
        """Watch the connection on fd (from `source_fd`)."""
        if fd is None:
            self.known_only = False
        else:
            self.fds.add(fd)

    def check(self) -> bool:
        """True once a (watched) connection has dropped (non-blocking)."""
        while not self.lost and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED and (
                    not self.known_only or int(event["value"]) in self.fds):
                self.lost = True
        return self.lost

    def close(self) -> None:
        # Unbind the monitor's inproc endpoint (named after the socket's fd, which a later
        # socket of this context may reuse) before closing.
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.monitor.close(linger=0)


def recv_bounded(sock: zmq.Socket, watch: ConnectionWatch | None, timeout_s: float,
                 what: str) -> list[zmq.Frame]:
    """One multipart message, or PeerLostError if a connection drops or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if sock.poll(int(POLL_INTERVAL_S * 1000)):
            return sock.recv_multipart(copy=False)
        if watch is not None and watch.check():
            raise PeerLostError(f"{what}: a peer's connection dropped (its process died?)")
        if time.monotonic() > deadline:
            raise PeerLostError(f"{what}: no answer within {timeout_s:.0f} s")


def _to_f32(x: np.ndarray) -> np.ndarray:
    if x.dtype == _BF16_BITS:
        from pagedrun.runtime.kernels.kernel_args import from_bf16_bits

        return from_bf16_bits(x)
    return np.asarray(x, dtype=np.float32)


def _from_f32(total: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == _BF16_BITS:
        from pagedrun.runtime.kernels.kernel_args import to_bf16_bits

        return to_bf16_bits(total)
    return total.astype(dtype, copy=False)


class CpuCommunicator:
    """Deterministic collectives over ZeroMQ for host (numpy) arrays.

    rank 0: `CpuCommunicator(0, n, bind="tcp://127.0.0.1:0", peer_keys={r: key})`, then
    `.address` (for the others) and `.wait_for_peers()`; rank r > 0:
    `CpuCommunicator(r, n, connect=address, auth_key=key)`. Without keys (tests of the
    collectives alone) a hello is taken at its word, and still binds its connection to one rank.
    """

    def __init__(self, rank: int, world_size: int, *, bind: str | None = None,
                 connect: str | None = None, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                 context: zmq.Context | None = None, auth_key: bytes | None = None,
                 peer_keys: dict[int, bytes] | None = None,
                 curve_secret: bytes | None = None) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._ctx = context or zmq.Context.instance()
        self._seq = 0
        self._stash: dict[tuple[int, int], list] = {}  # (rank, seq) -> frames that came early
        if rank == 0:
            self.sock = self._ctx.socket(zmq.ROUTER)
            set_heartbeats(self.sock)
            if curve_secret is not None:
                apply_curve_server(self.sock, curve_secret)
            self.watch = ConnectionWatch(self.sock, known_only=True)
            self.sock.bind(bind or "tcp://127.0.0.1:0")
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._peer_keys = peer_keys
            self._identities: dict[int, bytes] = {}  # rank -> its authenticated identity
            self._ranks: dict[bytes, int] = {}       # the reverse
            self.dropped = DropLog(log, "communicator rank 0")
        else:
            self.sock = self._ctx.socket(zmq.DEALER)
            set_heartbeats(self.sock)
            if curve_secret is not None:
                apply_curve_client(self.sock, curve_secret)
            self.watch = ConnectionWatch(self.sock)
            self.sock.connect(connect)
            self.address = connect
            hello = [b"hello", str(rank).encode()]
            if auth_key is not None:
                hello.append(comm_hello_mac(auth_key, rank))
            self.sock.send_multipart(hello)

    def wait_for_peers(self, timeout_s: float) -> None:
        """Rank 0: block until every other rank has said hello (bounded)."""
        deadline = time.monotonic() + timeout_s
        while len(self._identities) < self.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(min(left, POLL_INTERVAL_S) * 1000) + 1):
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, self.world_size)) - set(self._identities))
                    raise PeerLostError(f"communicator: ranks {missing} did not connect to "
                                        f"{self.address} within {timeout_s:.0f} s")
                continue
            msg = self._receive(self.sock.recv_multipart(copy=False))
            if msg is not None:  # a collective already under way on a rank that joined
                rank, header, frame = msg
                self._stash[(rank, header["seq"])] = (header, frame)
        if not self.watch.known_only:  # handshake noise before everyone joined is not a loss
            self.watch.check()
            self.watch.lost = False

    def _hello(self, identity: bytes, frames: list) -> None:
        """Rank 0: bind identity to the rank its hello proves (or drop it)."""
        try:
            rank = int(frames[1].bytes)
        except (IndexError, ValueError):
            raise AuthError("malformed hello") from None
        if not 0 < rank < self.world_size:
            raise AuthError(f"hello for rank {rank}, not a rank of this group")
        if self._peer_keys is not None:
            key = self._peer_keys.get(rank)
            if key is None or len(frames) != 3 or not hmac.compare_digest(
                    comm_hello_mac(key, rank), frames[2].bytes):
                raise AuthError(f"bad MAC on a hello for rank {rank}")
        if rank in self._identities:
            raise AuthError(f"a second hello for rank {rank}")
        self._identities[rank] = identity
        self._ranks[identity] = rank
        self.watch.add(source_fd(frames))

    def _receive(self, frames: list):
        """Rank 0: one message from the ROUTER. A hello binds its sender; a collective's frames
        from a bound rank come back as (rank, header, array frame); the rest is dropped."""
        identity = frames[0].bytes
        rank = self._ranks.get(identity)
        if rank is None:
            try:
                if len(frames) >= 2 and frames[1].bytes == b"hello":
                    self._hello(identity, frames[1:])
                else:
                    self.dropped("unknown identity", "a connection that has not said hello")
            except AuthError as exc:
                self.dropped("rejected hello", str(exc))
            return None
        if len(frames) != 3:
            self.dropped(f"malformed collective frames from rank {rank}")
            return None
        return rank, msgpack.unpackb(frames[1].bytes), frames[2]

    # ------------------------------------------------------------------ collectives

    def _send(self, frames: list, identity: bytes | None = None) -> None:
        self.sock.send_multipart(([identity] if identity is not None else []) + frames, copy=False)

    def _recv_from_all(self, seq: int, what: str) -> dict[int, np.ndarray]:
        """Rank 0: every other rank's (header, array) for collective `seq`."""
        parts = {}
        for r in range(1, self.world_size):
            early = self._stash.pop((r, seq), None)
            if early is not None:
                parts[r] = early
        deadline = time.monotonic() + self.timeout_s
        while len(parts) < self.world_size - 1:
            msg = self._receive(recv_bounded(self.sock, self.watch,
                                             max(0.0, deadline - time.monotonic()), what))
            if msg is None:
                continue
            rank, header, frame = msg
            if header["seq"] != seq:
                self._stash[(rank, header["seq"])] = (header, frame)
            else:
                parts[rank] = (header, frame)
        return {r: np.frombuffer(f.buffer, dtype=h["dtype"]).reshape(h["shape"])
                for r, (h, f) in parts.items()}

    def _header(self, x: np.ndarray) -> bytes:
        return msgpack.packb({"seq": self._seq, "dtype": x.dtype.str, "shape": list(x.shape)})

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """x: any-shape float32 / float16 / bf16-bits array -> the sum over ranks (same shape,
        dtype; x itself is left unchanged)."""
        self._seq += 1
        x = np.ascontiguousarray(x)
        if self.world_size == 1:
            return x
        what = f"all_reduce #{self._seq} on rank {self.rank}"
        if self.rank != 0:
            self._send([self._header(x), x])
            frames = recv_bounded(self.sock, self.watch, self.timeout_s, what)
            return np.frombuffer(frames[0].buffer, dtype=x.dtype).reshape(x.shape).copy()
        parts = self._recv_from_all(self._seq, what)
        total = _to_f32(x).copy()
        for r in range(1, self.world_size):  # the fixed order that makes the sum deterministic
            total += _to_f32(parts[r])
        result = _from_f32(total, x.dtype)
        for r in range(1, self.world_size):
            self._send([result], self._identities[r])
        return result

    def gather(self, x: np.ndarray) -> list[np.ndarray] | None:
        """x: this rank's array -> rank 0: [x_0 .. x_{n-1}] (copies); other ranks: None."""
        self._seq += 1
        x = np.ascontiguousarray(x)
        if self.rank != 0:
            self._send([self._header(x), x])
            return None
        parts = self._recv_from_all(self._seq, f"gather #{self._seq} on rank 0")
        return [x] + [parts[r].copy() for r in range(1, self.world_size)]

    def close(self) -> None:
        self.watch.close()
        self.sock.close(linger=0)
