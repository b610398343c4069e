"""The C client example (examples/c_client): built with the system cc against libzmq and
msgpack-c, run against a live server: one streamed generation (tokens checked against the fake
engine's reference), one abort (ABORTED found, FINAL "abort", blocks freed); and the same with
prompt logprobs asked for (protocol 1.1), whose reply field it must parse or skip."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from fake_engine import FakeEngine, expected_tokens

from pagedrun.client import Client

C_CLIENT_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "c_client")
BUILD_TIMEOUT_S = 120
RUN_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def c_client(tmp_path_factory):
    if shutil.which("cc") is None or shutil.which("make") is None:
        pytest.skip("no C compiler/make (scripts/install.sh installs the build deps)")
    build_dir = tmp_path_factory.mktemp("c_client")
    proc = subprocess.run(["make", "-C", C_CLIENT_DIR, f"BUILD_DIR={build_dir}"],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(build_dir / "pagedrun_client")


def test_c_client_stream_and_abort(start_server, c_client):
    _, ep = start_server(FakeEngine(step_delay_s=0.005))
    prompt, max_tokens = "Bonjour from C", 21
    proc = subprocess.run([c_client, ep, prompt, str(max_tokens)], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    want = expected_tokens(list(prompt.encode()), max_tokens)
    assert [int(t) for t in lines["TOKENS"].split()] == want
    assert lines["TEXT"] == bytes(want).decode()
    assert lines["FINISH"] == "length"
    assert lines["USAGE"] == f"{len(prompt)} {max_tokens}"
    assert lines["ABORTED"] == "found=1" and lines["ABORT_FINISH"] == "abort"
    assert "PROMPT_LOGPROBS" not in lines
    with Client(ep, timeout_s=10) as c:
        deadline = time.monotonic() + 10
        while (stats := c.stats())["gauges"]["server_requests_in_flight"] and \
                time.monotonic() < deadline:
            time.sleep(0.02)
    g = stats["gauges"]
    assert g["num_free_blocks"] == g["num_total_blocks"]
    assert stats["counters"]["request_abort_total"] == 1


def test_c_client_with_prompt_logprobs(start_server, c_client):
    _, ep = start_server(FakeEngine(step_delay_s=0.005))
    prompt, max_tokens = "logprobs in C", 5
    proc = subprocess.run([c_client, ep, prompt, str(max_tokens), "2"], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert [int(t) for t in lines["TOKENS"].split()] == expected_tokens(list(prompt.encode()),
                                                                        max_tokens)
    assert lines["FINISH"] == "length" and lines["ABORT_FINISH"] == "abort"
    ids = list(prompt.encode())
    # one frame carried them; nil for token 0, then the prompt's own ids
    assert lines["PROMPT_LOGPROBS"] == f"1 {len(ids)}: - " + " ".join(map(str, ids[1:]))
