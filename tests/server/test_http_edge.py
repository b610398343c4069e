"""The HTTP edge's limits (server/http/edge.py, issue 36): a request head that does not come in
time gets 408 and its connection closes (the first request's and a keep-alive connection's
next), while other clients are answered; a body over the cap gets 413 whether it is declared
or chunked; a body that does not come in time gets 408; past the connection cap, 503; a head
over its cap, 400. Raw sockets, because an HTTP library always sends whole heads."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fake_engine import FakeEngine
from http_gateway import start_stack

from pagedrun.server.http.edge import LATE_HEAD_REPLY, EdgeLimits

# Short deadlines so the tests wait little; the margins below are many times the loop's own
# latency on a loaded 2-core box.
HEAD_S = 0.5
BODY_S = 0.5


@pytest.fixture
def edge_stack():
    stacks = []

    def start(**limits):
        s = start_stack(FakeEngine(), limits=EdgeLimits(**limits))
        stacks.append(s)
        return s

    yield start
    for s in stacks:
        s.stop()


def connect(stack) -> socket.socket:
    sock = socket.create_connection((stack.gateway.host, stack.gateway.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_a_late_head_gets_408_and_the_others_are_answered(edge_stack):
    s = edge_stack(header_timeout_s=HEAD_S)
    silent = connect(s)                                   # sends nothing at all
    slow = connect(s)
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    start = time.monotonic()
    with httpx.Client(base_url=s.gateway.url, timeout=10) as client:
        assert client.get("/health").status_code == 200  # not held up by the two
    for sock in (silent, slow):
        assert read_until_closed(sock) == LATE_HEAD_REPLY
    waited = time.monotonic() - start
    assert HEAD_S * 0.9 <= waited < HEAD_S + 5.0, waited


def test_the_deadline_runs_again_for_a_keep_alive_connections_next_head(edge_stack):
    s = edge_stack(header_timeout_s=HEAD_S, keep_alive_s=30.0)
    sock = connect(s)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    first = sock.recv(65536)
    assert status_of(first) == 200
    time.sleep(HEAD_S * 2)        # idle between requests: keep-alive's time, not the head's
    sock.sendall(b"GET /health HTTP/1.1\r\n")
    start = time.monotonic()
    assert read_until_closed(sock) == LATE_HEAD_REPLY
    assert time.monotonic() - start >= HEAD_S * 0.9


def test_a_head_sent_slowly_but_in_time_is_served(edge_stack):
    s = edge_stack(header_timeout_s=5.0)
    sock = connect(s)
    for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n\r\n"):
        sock.sendall(part)
        time.sleep(0.2)
    assert status_of(read_until_closed(sock)) == 200


def post_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\n{extra}\r\n").encode()


def test_bodies_over_the_cap_get_413_declared_or_chunked(edge_stack):
    cap = 4096
    s = edge_stack(max_body_bytes=cap)
    body = json.dumps({"model": "m", "prompt": "x" * cap}).encode()
    with httpx.Client(base_url=s.gateway.url, timeout=10) as client:
        r = client.post("/v1/completions", content=body,
                        headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"

        def chunks():  # no content-length: the cap applies while it streams in
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        r = client.post("/v1/completions", content=chunks(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
        # exactly at the cap is served (JSON padded with trailing spaces to `cap` bytes)
        small = json.dumps({"model": "fake-byte-model", "prompt": "hi", "max_tokens": 2})
        r = client.post("/v1/completions", content=small.encode().ljust(cap),
                        headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text


def test_a_late_body_gets_408(edge_stack):
    s = edge_stack(body_timeout_s=BODY_S)
    sock = connect(s)
    sock.sendall(post_head("/v1/completions", "Content-Length: 100\r\n") + b'{"model": ')
    reply = read_until_closed(sock)
    assert status_of(reply) == 408, reply
    assert b"request_timeout" in reply


def test_past_the_connection_cap_503_then_served_again(edge_stack):
    cap = 4
    s = edge_stack(max_connections=cap, header_timeout_s=30.0)
    held = [connect(s) for _ in range(cap)]
    time.sleep(0.2)   # the accepts happen on the gateway's loop
    with httpx.Client(base_url=s.gateway.url, timeout=10) as client:
        assert client.get("/health").status_code == 503
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while (code := client.get("/health").status_code) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert code == 200


def test_a_head_over_its_cap_gets_400(edge_stack):
    """h11 counts what it holds of a head not yet complete: a client trickling an endless head
    is cut off at the cap (a complete head that arrives in one read is parsed at once)."""
    s = edge_stack(max_header_bytes=2048)
    sock = connect(s)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096)
    assert status_of(read_until_closed(sock)) == 400


@pytest.mark.parametrize("field,value", [("header_timeout_s", 0), ("body_timeout_s", -1.0),
                                         ("keep_alive_s", 0.0), ("max_connections", 0),
                                         ("max_header_bytes", 0), ("max_body_bytes", 0)])
def test_limits_refuse_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        EdgeLimits(**{field: value})
