"""Fixtures of the server tests: live servers (fake engine, loopback, random port) and raw sockets.

The folder is put on sys.path so tests can import their helpers (fake_engine, wire) by name;
pytest's importlib mode does not do that by itself.
"""
from __future__ import annotations

import os
import sys

import pytest
import zmq

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeEngine  # noqa: E402

from pagedrun.server.server import Server, ServerConfig  # noqa: E402

LOOPBACK_ANY_PORT = "tcp://127.0.0.1:*"


@pytest.fixture
def start_server():
    """start_server(engine=None, **ServerConfig fields) -> (server, endpoint); stopped after."""
    servers = []

    def start(engine=None, **config):
        config.setdefault("endpoint", LOOPBACK_ANY_PORT)
        server = Server(engine if engine is not None else FakeEngine(), ServerConfig(**config))
        endpoint = server.start()
        servers.append(server)
        return server, endpoint

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


RUN_FAKE_SERVER = os.path.join(os.path.dirname(__file__), "run_fake_server.py")
PROCESS_START_TIMEOUT_S = 30


@pytest.fixture
def server_process():
    """server_process(*args) -> (Popen, endpoint): run_fake_server.py in a child process;
    killed after the test if still alive."""
    import subprocess
    import time

    procs = []

    def start(*args):
        proc = subprocess.Popen([sys.executable, RUN_FAKE_SERVER, *map(str, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        deadline = time.monotonic() + PROCESS_START_TIMEOUT_S
        line = proc.stdout.readline()
        if not line.startswith("READY ") or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read()[-2000:]}")
        return proc, line.split()[1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
