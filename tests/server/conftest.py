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
