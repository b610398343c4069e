"""Raw-frame helpers for tests that speak docs/protocol.md without the Python client."""
from __future__ import annotations

import socket

import msgpack
import zmq

from pagedrun.server.protocol import PROTOCOL_VERSION, MsgType

REPLY_TIMEOUT_MS = 10_000


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, msg_type: int, body) -> None:
    payload = body if isinstance(body, bytes) else msgpack.packb(body)
    sock.send_multipart([bytes((PROTOCOL_VERSION, int(msg_type))), payload])


def recv(sock: zmq.Socket, timeout_ms: int = REPLY_TIMEOUT_MS) -> tuple[MsgType, dict]:
    if not sock.poll(timeout_ms):
        raise TimeoutError("no reply from the server")
    frames = sock.recv_multipart()
    assert len(frames) == 2 and len(frames[0]) == 2 and frames[0][0] == PROTOCOL_VERSION
    return MsgType(frames[0][1]), msgpack.unpackb(frames[1])


def recv_until_final(sock: zmq.Socket, request_id: str) -> tuple[list[dict], MsgType, dict]:
    """DELTAs of `request_id` then its FINAL or ERROR (other ids' frames are ignored)."""
    deltas = []
    while True:
        msg_type, body = recv(sock)
        if body.get("request_id") != request_id:
            continue
        if msg_type == MsgType.DELTA:
            deltas.append(body)
        elif msg_type in (MsgType.FINAL, MsgType.ERROR):
            return deltas, msg_type, body


def assert_error_shape(body: dict) -> None:
    """The ERROR shape of docs/protocol.md: code, message, request_id, and (1.2) server_id."""
    assert set(body) == {"code", "message", "request_id", "server_id"}
    assert isinstance(body["code"], str) and isinstance(body["message"], str)
    assert body["request_id"] is None or isinstance(body["request_id"], str)
    assert_server_id(body["server_id"])


def assert_server_id(value) -> None:
    """A server instance id (protocol 1.2): 16 lowercase hex characters."""
    assert isinstance(value, str) and len(value) == 16, value
    assert all(c in "0123456789abcdef" for c in value), value


def free_tcp_endpoint() -> str:
    """A loopback endpoint on a port that was free a moment ago (for servers in subprocesses)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
