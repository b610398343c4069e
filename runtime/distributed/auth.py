"""Authentication of the tensor-parallel sockets: who may talk on the control and communicator
connections (docs/architecture.md, "Tensor parallelism", Authentication).

The group shares one secret: a random 32-byte token per launch (`new_secret`), or, with several
nodes, the content of a file every node reads (`read_secret_file`; `python -m
pagedrun.runtime.distributed.auth FILE` writes a new one, mode 0600). Local workers receive it
on their stdin (`encode_launch` / `read_launch`): it never appears on a command line or in an
environment, and no file holds it.

Control connection (worker DEALER -> driver ROUTER), a challenge-response then a session:
  worker -> driver  hello {rank, pid, host, nonce}        MAC(secret, "hello", frames)
  driver -> worker  challenge {nonce}                     MAC(secret, "challenge" + worker nonce)
  worker -> driver  join {rank}                           sealed with the session key
  ... every later message, both ways, sealed with the session key
The session key is HMAC(secret, rank + both nonces): fresh per connection, so nothing recorded
from another connection or launch verifies. `Channel.seal` appends one trailer frame: an 8-byte
counter (strictly increasing per direction: a replayed or reordered message is refused) and
HMAC-SHA256(key, direction + counter + SHA-256 of the length-prefixed frames). The digest of a
step is computed once and MACed per worker.

Communicator (CpuCommunicator): a rank's hello carries HMAC(session key, "comm-hello" + rank);
rank 0 binds the connection's identity to that rank and drops frames from every other identity.

A message that fails any check is dropped (`DropLog`: a warning, at most one per reason every
DROP_LOG_INTERVAL_S, with the count suppressed); it never fails the group.

CURVE (optional): the control and communicator ROUTERs become CURVE servers whose key pair is
derived from the secret (`curve_server_keys`), so every node that holds the secret knows the
server's public key; each worker connects with an ephemeral client key pair. No ZAP handler:
CURVE adds encryption, the MACs above still decide who is a rank.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import sys
import time

import msgpack

from pagedrun.runtime.errors import PagedRunError

SECRET_BYTES = 32
MIN_SECRET_CHARS = 32  # a secret file holds at least this many non-blank bytes
NONCE_BYTES = 16
COUNTER_BYTES = 8
MAC_BYTES = 32
TRAILER_BYTES = COUNTER_BYTES + MAC_BYTES
DRIVER_TO_WORKER = b"d2w"
WORKER_TO_DRIVER = b"w2d"
DROP_LOG_INTERVAL_S = 10.0


class AuthError(Exception):
    """A message that failed verification (the receiver drops it)."""


class TensorParallelSecretError(PagedRunError):
    """No usable shared secret for a multi-node group (missing, unreadable, too short, or
    readable by other users)."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def read_secret_file(path: str) -> bytes:
    """The shared secret of a multi-node group: the file's content without surrounding blanks.
    Refused when the file is readable or writable by group / others (as ssh refuses keys)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read().strip()
    except OSError as exc:
        raise TensorParallelSecretError(f"tensor parallel secret file: {exc}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TensorParallelSecretError(
            f"tensor parallel secret file {path} is accessible by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`")
    if len(data) < MIN_SECRET_CHARS:
        raise TensorParallelSecretError(
            f"tensor parallel secret file {path} holds {len(data)} bytes, needs at least "
            f"{MIN_SECRET_CHARS}; write one with `python -m pagedrun.runtime.distributed.auth "
            f"{path}`")
    return data


def write_secret_file(path: str) -> None:
    """A new secret file (64 hex characters, mode 0600); refuses to overwrite one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")


def encode_launch(secret: bytes, curve: bool) -> bytes:
    """What a spawned worker reads on its stdin."""
    return msgpack.packb({"secret": secret, "curve": curve})


def read_launch(stream) -> tuple[bytes, bool]:
    """The worker side of encode_launch: (secret, curve) from a binary stream read to EOF."""
    data = stream.read()
    try:
        launch = msgpack.unpackb(data)
        secret, curve = launch["secret"], bool(launch["curve"])
    except Exception as exc:
        raise TensorParallelSecretError(
            "a tensor-parallel worker reads its launch secret on stdin (the driver or "
            "`paged-run serve --node-rank` writes it); none was given") from exc
    if not isinstance(secret, bytes) or not secret:
        raise TensorParallelSecretError("the launch secret on stdin is empty")
    return secret, curve


# ---------------------------------------------------------------------- MACs


def _buffer(frame):
    return frame.buffer if hasattr(frame, "buffer") else frame


def digest(frames) -> bytes:
    """SHA-256 of the frames, each prefixed by its length (bytes, zmq.Frame or contiguous
    numpy arrays)."""
    h = hashlib.sha256()
    for frame in frames:
        view = memoryview(_buffer(frame))
        h.update(view.nbytes.to_bytes(8, "big"))
        h.update(view)
    return h.digest()


def mac(key: bytes, context: bytes, frames=(), frames_digest: bytes | None = None) -> bytes:
    if frames_digest is None:
        frames_digest = digest(frames)
    return hmac.new(key, context + frames_digest, hashlib.sha256).digest()


def check_mac(key: bytes, context: bytes, frames, tag) -> None:
    if not hmac.compare_digest(mac(key, context, frames), bytes(_buffer(tag))):
        raise AuthError("bad MAC")


def session_key(secret: bytes, rank: int, worker_nonce: bytes, driver_nonce: bytes) -> bytes:
    return hmac.new(secret, b"pagedrun-tp-session" + rank.to_bytes(4, "big") + worker_nonce +
                    driver_nonce, hashlib.sha256).digest()


def comm_hello_mac(key: bytes, rank: int) -> bytes:
    return hmac.new(key, b"comm-hello" + rank.to_bytes(4, "big"), hashlib.sha256).digest()


class Channel:
    """One control connection's session: seals what this side sends, opens what it receives."""

    def __init__(self, key: bytes, outgoing: bytes, incoming: bytes) -> None:
        self.key, self.outgoing, self.incoming = key, outgoing, incoming
        self.sent = 0
        self.received = 0

    def seal(self, frames: list, frames_digest: bytes | None = None) -> list:
        """frames + the trailer frame (counter, MAC). frames_digest: digest(frames), when the
        caller seals the same frames for several peers."""
        self.sent += 1
        counter = self.sent.to_bytes(COUNTER_BYTES, "big")
        return [*frames, counter + mac(self.key, self.outgoing + counter, frames, frames_digest)]

    def open(self, frames: list) -> list:
        """The frames without the trailer, or AuthError (bad MAC, replayed, malformed)."""
        if len(frames) < 2:
            raise AuthError("no MAC frame")
        trailer = bytes(_buffer(frames[-1]))
        if len(trailer) != TRAILER_BYTES:
            raise AuthError("malformed MAC frame")
        counter = int.from_bytes(trailer[:COUNTER_BYTES], "big")
        body = frames[:-1]
        if not hmac.compare_digest(
                mac(self.key, self.incoming + trailer[:COUNTER_BYTES], body),
                trailer[COUNTER_BYTES:]):
            raise AuthError("bad MAC")
        if counter <= self.received:
            raise AuthError(f"replayed message (counter {counter}, last {self.received})")
        self.received = counter
        return body


class DropLog:
    """Rate-limited warnings about dropped messages: the first of each reason at once, then at
    most one per `interval_s`, saying how many were dropped in between."""

    def __init__(self, log: logging.Logger, what: str,
                 interval_s: float = DROP_LOG_INTERVAL_S) -> None:
        self.log, self.what, self.interval_s = log, what, interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.count = 0

    def __call__(self, reason: str, detail: str = "") -> None:
        self.count += 1
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        more = self._suppressed.pop(reason, 0)
        self.log.warning("%s: dropped a message: %s%s%s", self.what, reason,
                         f" ({detail})" if detail else "",
                         f"; {more} more dropped for this reason since the last warning"
                         if more else "")


# ---------------------------------------------------------------------- CURVE


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of the group's CURVE servers, derived from the shared secret."""
    import zmq
    from zmq.utils import z85

    server_secret = z85.encode(hmac.new(secret, b"pagedrun-tp-curve-server",
                                        hashlib.sha256).digest())
    return zmq.curve_public(server_secret), server_secret


def _require_curve() -> None:
    import zmq

    if not zmq.has("curve"):
        raise TensorParallelSecretError("tensor parallel CURVE: this libzmq has no CURVE "
                                        "support (built without libsodium)")


def apply_curve_server(sock, secret: bytes) -> None:
    _require_curve()
    public, server_secret = curve_server_keys(secret)
    sock.curve_secretkey = server_secret
    sock.curve_publickey = public
    sock.curve_server = True


def apply_curve_client(sock, secret: bytes) -> None:
    import zmq

    _require_curve()
    public, client_secret = zmq.curve_keypair()  # ephemeral: the MACs authenticate the rank
    sock.curve_secretkey = client_secret
    sock.curve_publickey = public
    sock.curve_serverkey = curve_server_keys(secret)[0]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m pagedrun.runtime.distributed.auth FILE\n"
              "writes a new tensor-parallel shared secret (mode 0600) to FILE; copy it to every "
              "node and give it to each `paged-run serve` as --tp-secret-file", file=sys.stderr)
        return 2
    try:
        write_secret_file(argv[0])
    except FileExistsError:
        print(f"{argv[0]}: exists; not overwritten", file=sys.stderr)
        return 1
    print(f"wrote a tensor-parallel secret to {argv[0]} (mode 0600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
