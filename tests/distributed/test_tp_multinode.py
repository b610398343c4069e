"""Multi-node tensor parallelism on loopback, and `paged-run serve` on the default model.

- Two "nodes" as separate process groups: node 0 is an engine with nnodes=2 (rank 0 in-process,
  rank 1 spawned), node 1 is `paged-run serve --node-rank 1` (headless: ranks 2 and 3); both
  read one shared secret file; together one TP=4 group whose greedy tokens and logits equal
  TP=1's. Closing the engine shuts node 1 down (exit 0, no worker left).
- The default model (9 query heads, 3 KV heads): `serve --tensor-parallel-size 3` serves
  transformers' greedy tokens (the fixture); `--tensor-parallel-size 2` is refused, saying why.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from test_tp_failures import free_port, wait_gone, worker_pids
from tp_helpers import greedy_run, make_engine, prompts, secret_file, write_model_dir

from pagedrun.server.client import Client

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "default_model.json"
PAGED_RUN = [sys.executable, "-m", "pagedrun.server.cli"]
VOCAB = 389
EXIT_TIMEOUT_S = 30


def test_two_nodes_form_one_tp4_group(tmp_path):
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, num_key_value_heads=2)
    addr = f"localhost:{free_port()}"  # a host name, as users give it (bound resolved)
    secret = secret_file(tmp_path)  # both "nodes" read the same shared secret
    # Node 1 first: its workers keep knocking until node 0's control socket is bound.
    node1 = subprocess.Popen([*PAGED_RUN, "serve", "--tensor-parallel-size", "4", "--nnodes",
                              "2", "--node-rank", "1", "--master-addr", addr,
                              "--tp-secret-file", secret, "--log-level", "WARNING"])
    try:
        ref_tokens, ref_logits = greedy_run(make_engine(model_dir, 1), prompts(VOCAB))
        engine = make_engine(model_dir, 4, nnodes=2, master_addr=addr, tp_secret_file=secret)
        node1_workers = worker_pids(node1.pid)
        assert len(node1_workers) == 2 and len(worker_pids(os.getpid())) >= 1
        try:
            tokens, logits = greedy_run(engine, prompts(VOCAB))
        finally:
            engine.close()
        assert tokens == ref_tokens
        for got, want in zip(logits, ref_logits, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert node1.wait(EXIT_TIMEOUT_S) == 0
        assert wait_gone(node1_workers, 5) == []
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def _default_model_available() -> bool:
    from pagedrun.runtime.model_loader import resolve_model_dir
    from pagedrun.runtime.errors import ModelLoadError

    try:
        resolve_model_dir(None)
    except ModelLoadError:
        return False
    return True


needs_default_model = pytest.mark.skipif(not _default_model_available(),
                                         reason="the default model package is not installed")


@needs_default_model
def test_default_model_tp2_refused():
    proc = subprocess.run([*PAGED_RUN, "serve", "--tensor-parallel-size", "2", "--device", "cpu",
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "tensor_parallel_size 2 does not divide num_attention_heads 9" in proc.stderr


@needs_default_model
def test_default_model_tp3_serves_transformers_tokens():
    case = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"][0]
    num_tokens = 4
    port = free_port()
    proc = subprocess.Popen([*PAGED_RUN, "serve", "--tensor-parallel-size", "3", "--device",
                             "cpu", "--port", str(port), "--max-model-len", "256",
                             "--num-kv-blocks", "32", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "paged-run serve" in proc.stdout.readline()
        workers = worker_pids(proc.pid)
        assert len(workers) == 2
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=120) as client:
            out = client.generate(prompt_token_ids=case["prompt_token_ids"], sampling_params={
                "max_tokens": num_tokens, "temperature": 0.0})
        assert out.token_ids == case["output_token_ids"][:num_tokens]
        proc.terminate()
        assert proc.wait(EXIT_TIMEOUT_S) == 0
        assert wait_gone(workers, 5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve_args(*argv):
    import argparse

    from pagedrun.server import serve_cmd

    parser = argparse.ArgumentParser(prog="paged-run")
    serve_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return serve_cmd, parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("argv,needle", [
    (["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1"], "needs --master-addr"),
    (["--tensor-parallel-size", "4", "--nnodes", "2"], "needs --master-addr"),
    (["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr",
      "127.0.0.1:1"], "needs --tp-secret-file"),
    (["--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "127.0.0.1:1"],
     "needs --tp-secret-file"),
])
def test_serve_multinode_flags_checked(argv, needle):
    serve_cmd, args = _serve_args(*argv)
    with pytest.raises(SystemExit, match=needle):
        serve_cmd.run(args)


def test_nnodes_must_divide_tp():
    from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError

    with pytest.raises(EngineConfigError, match="nnodes 3 must divide tensor_parallel_size 4"):
        EngineConfig(tensor_parallel_size=4, nnodes=3)
