"""Graceful shutdown and restart of a real server process (fake engine): SIGTERM/SIGINT stop
new work, in-flight requests end with a FINAL (finished, or aborted past the drain timeout),
the process exits 0, and a new server can bind the same endpoint at once; a second signal
forces the exit (protocol 1.2)."""
from __future__ import annotations

import signal
import time

import pytest
from wire import assert_error_shape, dealer, free_tcp_endpoint, recv, recv_until_final, send

from pagedrun.client import Client
from pagedrun.server.protocol import MsgType

EXIT_TIMEOUT_S = 20


def test_sigterm_finishes_in_flight_and_refuses_new(server_process, zmq_ctx):
    proc, ep = server_process(free_tcp_endpoint(), "--step-delay-s", 0.02)
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "inflight", "prompt": "abc",
                               "sampling_params": {"max_tokens": 40}})
    assert recv(s)[0] == MsgType.DELTA
    proc.send_signal(signal.SIGTERM)
    # The signal is noticed within one poll interval: ping until the server says so.
    seen = {}
    for attempt in range(100):
        send(s, MsgType.PING, {"request_id": f"p{attempt}"})
        while True:
            kind, body = recv(s)
            if kind == MsgType.PONG:
                break
            if kind != MsgType.DELTA:
                seen[body["request_id"]] = (kind, body)
        if body["status"] == "draining":
            break
    assert body["status"] == "draining"
    send(s, MsgType.GENERATE, {"request_id": "late", "prompt": "abc"})
    while "inflight" not in seen or "late" not in seen:
        kind, body = recv(s)
        if kind != MsgType.DELTA:
            seen[body["request_id"]] = (kind, body)
    assert seen["late"][0] == MsgType.ERROR and seen["late"][1]["code"] == "shutting_down"
    kind, final = seen["inflight"]
    assert kind == MsgType.FINAL and final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 40
    assert proc.wait(EXIT_TIMEOUT_S) == 0


def test_sigint_past_drain_timeout_aborts_with_final(server_process, zmq_ctx):
    proc, ep = server_process(free_tcp_endpoint(), "--step-delay-s", 0.02,
                              "--shutdown-timeout", 0.3)
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "long", "prompt": "abc",
                               "sampling_params": {"max_tokens": 2000}})
    assert recv(s)[0] == MsgType.DELTA
    proc.send_signal(signal.SIGINT)
    _, kind, final = recv_until_final(s, "long")
    assert kind == MsgType.FINAL and final["finish_reason"] == "abort"
    assert proc.wait(EXIT_TIMEOUT_S) == 0


def test_restart_on_same_endpoint(server_process, tmp_path):
    for ep in (free_tcp_endpoint(), f"ipc://{tmp_path}/pagedrun.sock"):
        for round_ in range(2):
            proc, bound = server_process(ep)
            assert bound == ep
            with Client(ep, timeout_s=10) as c:
                out = c.generate("restart", sampling_params={"max_tokens": 3})
                assert out.finish_reason == "length" and len(out.token_ids) == 3
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(EXIT_TIMEOUT_S) == 0, round_


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_forces_exit_with_shutting_down(server_process, zmq_ctx, second):
    """The first signal drains (30 s here); the second ends the process at once: the request
    still running gets `shutting_down`, exit status 128 + the second signal's number."""
    proc, ep = server_process(free_tcp_endpoint(), "--step-delay-s", 0.05)
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "long", "prompt": "abc",
                               "sampling_params": {"max_tokens": 250}})  # ~12 s
    assert recv(s)[0] == MsgType.DELTA
    proc.send_signal(signal.SIGTERM)
    for attempt in range(100):  # until the server is draining
        send(s, MsgType.PING, {"request_id": f"p{attempt}"})
        while (reply := recv(s))[0] != MsgType.PONG:
            pass
        if reply[1]["status"] == "draining":
            break
    forced = time.monotonic()
    proc.send_signal(second)
    _, kind, body = recv_until_final(s, "long")
    assert kind == MsgType.ERROR and body["code"] == "shutting_down", body
    assert_error_shape(body)
    assert proc.wait(EXIT_TIMEOUT_S) == 128 + second
    assert time.monotonic() - forced < 5
