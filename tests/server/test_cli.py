"""`paged-run serve / chat / bench` (server/serve_cmd.py, chat_cmd.py, bench_cmd.py)."""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from fake_engine import FakeEngine, expected_tokens
from wire import free_tcp_endpoint

from pagedrun.client import Client
from pagedrun.server import bench_cmd, chat_cmd, serve_cmd

TINY_MODEL = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny", "llama_tied_bf16")
SERVE_START_TIMEOUT_S = 60


def parse(module, argv):
    parser = argparse.ArgumentParser(prog="paged-run")
    module.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_serve_flags_map_onto_configs():
    args = parse(serve_cmd, ["serve", "some/model", "--port", "6000", "--max-model-len", "512",
                             "--block-size", "32", "--max-num-seqs", "7",
                             "--max-num-batched-tokens", "99", "--no-enable-prefix-caching",
                             "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "1",
                             "--seed", "3", "--device", "cpu"])
    assert args.model == "some/model" and args.enable_prefix_caching is False
    assert serve_cmd.endpoint_from_args(args) == "tcp://127.0.0.1:6000"
    assert serve_cmd.server_config_from_args(args).endpoint == "tcp://127.0.0.1:6000"
    assert parse(serve_cmd, ["serve", "--host", "::1"]).host == "::1"
    assert serve_cmd.endpoint_from_args(parse(serve_cmd, ["serve", "--host", "::1"])) == \
        "tcp://[::1]:5555"
    args = parse(serve_cmd, ["serve", "--endpoint", "ipc:///tmp/x.sock"])
    assert serve_cmd.endpoint_from_args(args) == "ipc:///tmp/x.sock"
    assert parse(serve_cmd, ["serve"]).enable_prefix_caching is True
    text = serve_cmd.startup_summary(FakeEngine().model_info(), "tcp://127.0.0.1:1", False)
    assert "16384 tokens" in text and "max concurrency" in text and "tcp://127.0.0.1:1" in text


def test_serve_process_with_real_engine(tmp_path):
    ep = free_tcp_endpoint()
    port = ep.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedrun.server.serve_cmd", "serve",
                             TINY_MODEL, "--port", port, "--device", "cpu",
                             "--num-kv-blocks", "64", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        summary = [proc.stdout.readline() for _ in range(4)]
        assert "KV cache: 64 blocks x 16 tokens = 1024 tokens" in summary[1], summary
        assert "max concurrency at max length 8.00" in summary[2]
        assert ep in summary[3]
        with Client(ep, timeout_s=SERVE_START_TIMEOUT_S) as c:
            out = c.generate(prompt_token_ids=[5, 6, 7], sampling_params={
                "max_tokens": 4, "ignore_eos": True})
        assert len(out.token_ids) == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_chat_against_server(start_server):
    _, ep = start_server()
    port = ep.rsplit(":", 1)[1]
    args = parse(chat_cmd, ["chat", "--port", port, "--max-tokens", "6"])
    out = io.StringIO()
    assert chat_cmd.run(args, stdin=io.StringIO("hello\n/reset\n\nagain\n/exit\n"),
                        stdout=out) == 0
    lines = out.getvalue().splitlines()
    hello = "<user>hello<assistant>"
    assert lines[0] == bytes(expected_tokens(list(hello.encode()), 6)).decode()
    again = "<user>again<assistant>"  # /reset dropped the first turn
    assert lines[1] == bytes(expected_tokens(list(again.encode()), 6)).decode()
    out = io.StringIO()
    args = parse(chat_cmd, ["chat", "--port", port, "-p", "hello", "--max-tokens", "6"])
    assert chat_cmd.run(args, stdout=out) == 0
    assert out.getvalue().splitlines() == lines[:1]


def test_bench_json_report(start_server, capsys):
    _, ep = start_server(FakeEngine(step_delay_s=0.001, max_model_len=256))
    args = parse(bench_cmd, ["bench", "--endpoint", ep, "--num-prompts", "30",
                             "--concurrency", "8", "--input-len-mix", "5:1,40:1",
                             "--output-len-mix", "3:1,17:2", "--json", "--no-progress"])
    assert bench_cmd.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 30 and report["failed"] == 0
    work = bench_cmd.make_workload(30, [(5, 1), (40, 1)], [(3, 1), (17, 2)], 512, 256, 0)
    assert report["output_tokens"] == sum(n for _, n in work)
    assert report["input_tokens"] == sum(len(p) for p, _ in work)
    assert report["ttft_p50_ms"] <= report["ttft_p90_ms"] <= report["ttft_p99_ms"]
    assert report["tpot_p50_ms"] > 0 and report["output_token_throughput_per_s"] > 0


def test_bench_rate_mode_table(start_server, capsys):
    _, ep = start_server(FakeEngine(step_delay_s=0.001))
    args = parse(bench_cmd, ["bench", "--endpoint", ep, "--num-prompts", "10",
                             "--request-rate", "200", "--input-len-mix", "8:1",
                             "--output-len-mix", "4:1", "--no-progress"])
    assert bench_cmd.run(args) == 0
    table = capsys.readouterr().out
    assert "completed 10/10" in table and "TTFT" in table and "TPOT" in table


def test_percentile_matches_numpy():
    rng = np.random.default_rng(3)
    for n in (1, 2, 19, 111):
        xs = list(rng.random(n))
        for q in (50, 90, 99):
            assert bench_cmd.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert bench_cmd.percentile([], 50) is None


def test_parse_mix_rejects_garbage():
    assert bench_cmd.parse_mix("16:0.5,64:1") == [(16, 0.5), (64, 1.0)]
    for bad in ("", "x:1", "0:1", "16:0"):
        with pytest.raises(ValueError):
            bench_cmd.parse_mix(bad)
