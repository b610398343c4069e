"""Clients that follow the server (docs/protocol.md 1.2, "Liveness"): heartbeats at a fraction
of the lease the server announces, a dead or restarted server noticed within seconds
(`ServerUnavailable`, not the full timeout), and the server's start-up warning when it binds
beyond loopback without CURVE."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from fake_engine import FakeEngine, expected_tokens
from wire import free_tcp_endpoint

from pagedrun.client import AsyncClient, Client
from pagedrun.server.protocol import is_loopback_endpoint

# Upper bound on noticing a dead server with a 3 s lease: PINGs every 1 s, one unanswered for
# ping_timeout_s (4 s) -- about 5 s; the margin is for a loaded CI box.
DETECT_BOUND_S = 10.0


def test_clients_follow_a_lease_shorter_than_their_heartbeat(start_server):
    """Lease 3 s, default heartbeat_s (5 s), a generation of ~4 s with nothing streamed: the
    clients must PING at lease_s / 3 (1.1 clients PINGed every 5 s: LeaseExpiredError)."""
    _, ep = start_server(FakeEngine(step_delay_s=0.05), lease_s=3.0)
    results = {}

    def blocking():
        with Client(ep, timeout_s=30) as c:
            results["sync"] = c.generate("lease", sampling_params={"max_tokens": 80})
            results["sync_lease"] = c.lease_s

    async def non_blocking():
        async with AsyncClient(ep, timeout_s=30) as c:
            s = await c.stream("lease", sampling_params={"max_tokens": 80}, request_id="a")
            async for _ in s:  # streamed: the DELTAs do not renew the lease, PINGs do
                pass
            return s.result, c.lease_s

    thread = threading.Thread(target=blocking)
    start = time.monotonic()
    thread.start()
    result, async_lease = asyncio.run(non_blocking())
    thread.join(60)
    assert time.monotonic() - start > 3.0  # longer than the lease
    want = expected_tokens(list(b"lease"), 80)
    assert results["sync"].token_ids == want and result.token_ids == want
    assert results["sync_lease"] == async_lease == 3.0


def test_killed_server_raises_server_unavailable_within_seconds(server_process):
    from pagedrun.client import ServerUnavailable

    proc, ep = server_process(free_tcp_endpoint(), "--step-delay-s", 0.05, "--lease-s", 3)
    outcome: dict = {}
    started = threading.Event()

    def blocking():  # no stream: nothing arrives until the FINAL, which never will
        with Client(ep, timeout_s=40) as c:
            c.ping()
            started.set()
            try:
                c.generate("dies", sampling_params={"max_tokens": 250})
            except Exception as exc:  # noqa: BLE001
                outcome["sync"] = (exc, time.monotonic())

    async def non_blocking():
        async with AsyncClient(ep, timeout_s=40) as c:
            s = await c.stream("dies too", sampling_params={"max_tokens": 250})
            await s.__anext__()
            started.wait(10)
            proc.kill()
            outcome["killed"] = time.monotonic()
            try:
                async for _ in s:
                    pass
            except Exception as exc:  # noqa: BLE001
                outcome["async"] = (exc, time.monotonic())

    thread = threading.Thread(target=blocking)
    thread.start()
    asyncio.run(non_blocking())
    thread.join(60)
    for side in ("sync", "async"):
        exc, when = outcome[side]
        assert isinstance(exc, ServerUnavailable), (side, exc)
        assert exc.code == "server_unavailable" and "PING" in exc.message
        assert when - outcome["killed"] < DETECT_BOUND_S, (side, when - outcome["killed"])


def test_restarted_server_raises_server_unavailable_and_the_client_goes_on(server_process):
    from pagedrun.client import ServerError, ServerUnavailable

    endpoint = free_tcp_endpoint()
    proc, ep = server_process(endpoint, "--step-delay-s", 0.05, "--lease-s", 3)
    with Client(ep, timeout_s=40) as c:
        first_id = c.ping()["server_id"]
        s = c.stream("restart", sampling_params={"max_tokens": 250})
        next(s)
        proc.kill()
        proc.wait(10)
        server_process(endpoint, "--lease-s", 3)  # a new process on the same endpoint
        killed = time.monotonic()
        with pytest.raises(ServerUnavailable) as info:
            list(s)
        assert time.monotonic() - killed < DETECT_BOUND_S
        assert isinstance(info.value, ServerError)
        # The new instance is told apart by its id (or, if the old one's death was seen first,
        # by the unanswered PING); either way the connection serves new requests.
        out = c.generate("again", sampling_params={"max_tokens": 3})
        assert out.token_ids == expected_tokens(list(b"again"), 3)
        assert c.server_id != first_id


def test_async_client_sees_a_restart(server_process):
    from pagedrun.client import ServerUnavailable

    endpoint = free_tcp_endpoint()
    proc, ep = server_process(endpoint, "--step-delay-s", 0.05, "--lease-s", 3)

    async def main():
        async with AsyncClient(ep, timeout_s=40) as c:
            first_id = (await c.ping())["server_id"]
            s = await c.stream("restart", sampling_params={"max_tokens": 250})
            await s.__anext__()
            proc.kill()
            proc.wait(10)
            server_process(endpoint, "--lease-s", 3)
            killed = time.monotonic()
            with pytest.raises(ServerUnavailable):
                async for _ in s:
                    pass
            assert time.monotonic() - killed < DETECT_BOUND_S
            out = await c.generate("again", sampling_params={"max_tokens": 3})
            assert out.token_ids == expected_tokens(list(b"again"), 3)
            assert c.server_id != first_id

    asyncio.run(main())


def test_idle_client_uses_a_restarted_server_without_error(server_process):
    """A request sent after an idle spell reaches the new server and is not failed."""
    endpoint = free_tcp_endpoint()
    proc, ep = server_process(endpoint)
    with Client(ep, timeout_s=20) as c:
        assert c.generate("one", sampling_params={"max_tokens": 2}).finish_reason == "length"
        first_id = c.server_id
        proc.kill()
        proc.wait(10)
        server_process(endpoint)
        time.sleep(0.5)
        out = c.generate("two", sampling_params={"max_tokens": 4})
        assert out.token_ids == expected_tokens(list(b"two"), 4)
        assert c.server_id not in (None, first_id)


def test_never_started_server_is_unavailable_not_a_timeout():
    from pagedrun.client import ServerUnavailable

    with Client(free_tcp_endpoint(), timeout_s=30, ping_timeout_s=1.0) as c:
        start = time.monotonic()
        with pytest.raises(ServerUnavailable):
            c.generate("nobody home")
        assert time.monotonic() - start < 5


@pytest.mark.parametrize("endpoint,loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:*", True), ("tcp://[::1]:5555", True),
    ("tcp://localhost:5555", True), ("ipc:///tmp/x.sock", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://[::]:5555", False),
    ("tcp://10.0.0.5:5555", False), ("tcp://eth0:5555", False), ("tcp://example.com:1", False),
    ("tcp://[::ffff:10.0.0.1]:1", False), ("nonsense", False),
])
def test_loopback_endpoints(endpoint, loopback):
    assert is_loopback_endpoint(endpoint) is loopback


def test_binding_beyond_loopback_without_curve_warns(start_server, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedrun.server"):
        start_server(endpoint="tcp://127.0.0.1:*")
        assert not [r for r in caplog.records if "CURVE" in r.getMessage()]
        _, ep = start_server(endpoint="tcp://0.0.0.0:*")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and ep in warnings[0]
    assert "--curve-secret-key" in warnings[0] and "--curve-allowed-clients" in warnings[0]
