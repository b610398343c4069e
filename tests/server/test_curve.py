"""CURVE on: an allowed client key is served, an unknown key or a plain client gets nothing;
CURVE off (every other test) serves plain clients."""
from __future__ import annotations

import os

import pytest

from pagedrun.client import Client, RequestTimeout
from pagedrun.server.auth import CurveConfig, create_key_pair


@pytest.fixture
def keys(tmp_path):
    server_pub, server_secret = create_key_pair(str(tmp_path / "server"), "server")
    _, allowed_secret = create_key_pair(str(tmp_path / "allowed_pairs"), "alice")
    os.makedirs(tmp_path / "allowed", exist_ok=True)
    os.replace(tmp_path / "allowed_pairs" / "alice.key", tmp_path / "allowed" / "alice.key")
    _, stranger_secret = create_key_pair(str(tmp_path / "stranger"), "mallory")
    return {"server_pub": server_pub, "server_secret": server_secret,
            "allowed_dir": str(tmp_path / "allowed"), "alice": allowed_secret,
            "mallory": stranger_secret}


def test_curve_allows_listed_client_only(start_server, keys):
    _, ep = start_server(curve=CurveConfig(keys["server_secret"], keys["allowed_dir"]))
    with Client(ep, timeout_s=10, server_public_key_file=keys["server_pub"],
                client_secret_key_file=keys["alice"]) as c:
        assert c.generate("secret", sampling_params={"max_tokens": 3}).finish_reason == "length"
    with Client(ep, timeout_s=0.5, server_public_key_file=keys["server_pub"],
                client_secret_key_file=keys["mallory"]) as c:
        with pytest.raises(RequestTimeout):
            c.ping()
    with Client(ep, timeout_s=0.5) as c:  # no CURVE at all
        with pytest.raises(RequestTimeout):
            c.ping()


def test_serve_flags_need_both_curve_options():
    import argparse

    from pagedrun.server import serve_cmd
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--curve-secret-key", "k"])
    with pytest.raises(SystemExit):
        serve_cmd.server_config_from_args(args)
