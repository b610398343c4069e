"""Adapters over the wire (protocol 1.4): GENERATE with `lora_name` through the Python client
gives the merged reference's tokens, an unknown name is a clear `invalid_request` and the server
goes on, MODEL_INFO lists the adapters, LOAD_LORA / UNLOAD_LORA work at run time (unload is
refused while a request uses the adapter). Real LLMEngine on the tiny numpy model."""
from __future__ import annotations

import os
import pathlib

import pytest

from engine_helpers import random_weights, tiny_config
from lora_helpers import merged_greedy, write_peft_adapter

from pagedrun.client import Client
from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.lora import LoRARequest
from pagedrun.server.client import InvalidRequestError
from pagedrun.server.server import Server, ServerConfig

GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 9, 17, 33, 2, 8]


@pytest.fixture
def served(tmp_path):
    config = tiny_config()
    weights = random_weights(config, seed=4)
    paths = [str(write_peft_adapter(tmp_path / f"a{i}", config, rank=8, seed=i))
             for i in range(2)]
    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=64, enable_lora=True,
                                    max_loras=2, check_invariants=True),
                       model_config=config, weights=weights)
    engine.add_lora(LoRARequest("first", 1, paths[0]))   # as --lora-modules first=PATH
    # LOAD_LORA reads adapters under tmp_path only (--allow-runtime-lora --lora-root tmp_path).
    server = Server(engine, ServerConfig(endpoint="tcp://127.0.0.1:*",
                                         runtime_lora_root=str(tmp_path)))
    endpoint = server.start()
    yield (config, weights), paths, endpoint
    server.stop()


def test_generate_with_adapter_and_errors(served):
    model, paths, endpoint = served
    with Client(endpoint, timeout_s=30) as client:
        info = client.model_info()
        assert info["enable_lora"] is True
        assert info["lora_adapters"] == [{"name": "first", "id": 1}]
        assert info["server"]["protocol_revision"] == "1.4"
        got = client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY, lora_name="first")
        want = merged_greedy(model, LoRARequest("first", 1, paths[0]), PROMPT, 5)
        assert got.outputs[0]["token_ids"] == want
        base = client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY)
        assert base.outputs[0]["token_ids"] == merged_greedy(model, None, PROMPT, 5) != want
        with pytest.raises(InvalidRequestError, match="unknown adapter 'nope'.*'first'"):
            client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY, lora_name="nope")
        with pytest.raises(InvalidRequestError, match="could not be loaded"):
            client.load_lora("broken", "/nonexistent/adapter")
        assert client.ping()["status"] == "ok"   # the server goes on

        reply = client.load_lora("second", paths[1])
        assert reply["loaded"] is True and reply["lora_int_id"] > 1
        got = client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY,
                              lora_name="second")
        assert got.outputs[0]["token_ids"] == merged_greedy(
            model, LoRARequest("second", reply["lora_int_id"], paths[1]), PROMPT, 5)
        stream = client.stream(prompt_token_ids=PROMPT, lora_name="second",
                               sampling_params={**GREEDY, "max_tokens": 200})
        next(iter(stream))   # running: the adapter is in use
        with pytest.raises(InvalidRequestError, match="in use"):
            client.unload_lora("second")
        stream.close()
        assert client.unload_lora("first")["loaded"] is False
        names = [a["name"] for a in client.model_info()["lora_adapters"]]
        assert names == ["second"]


def test_async_client_adapters(served):
    """AsyncClient: load_lora, generate / stream with lora_name, unload_lora, as Client."""
    import asyncio

    from pagedrun.client import AsyncClient

    model, paths, endpoint = served

    async def run():
        async with AsyncClient(endpoint, timeout_s=30) as client:
            reply = await client.load_lora("second", paths[1])
            got = await client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY,
                                        lora_name="second")
            want = merged_greedy(model, LoRARequest("second", reply["lora_int_id"], paths[1]),
                                 PROMPT, 5)
            assert got.outputs[0]["token_ids"] == want
            first = await client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY,
                                          lora_name="first")
            assert first.outputs[0]["token_ids"] == merged_greedy(
                model, LoRARequest("first", 1, paths[0]), PROMPT, 5) != want
            with pytest.raises(InvalidRequestError, match="unknown adapter 'nope'"):
                await client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY,
                                      lora_name="nope")
            assert (await client.unload_lora("second"))["loaded"] is False

    asyncio.run(run())


def test_runtime_loading_is_bounded_and_says_nothing_about_paths(served, tmp_path):
    """Issue 36 item 4: LOAD_LORA reads only adapter directories under the server's --lora-root,
    never opens what is not a regular file (a FIFO would block the engine thread), and answers
    every failure with one message, so a client cannot probe the file system."""
    model, paths, endpoint = served
    root = pathlib.Path(paths[0]).parent
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    write_peft_adapter(outside / "adapter", model[0], rank=8, seed=3)
    (root / "not-an-adapter").mkdir()
    (root / "not-an-adapter" / "notes.txt").write_text("x")
    fifo_dir = root / "fifo"
    fifo_dir.mkdir()
    (fifo_dir / "adapter_config.json").write_text((pathlib.Path(paths[0]) /
                                                    "adapter_config.json").read_text())
    os.mkfifo(fifo_dir / "adapter_model.safetensors")
    (root / "escape").symlink_to(outside / "adapter")
    with Client(endpoint, timeout_s=10) as client:
        messages = set()
        for path in ("/etc", str(outside / "adapter"), "../" + outside.name + "/adapter",
                     "escape", "no-such-dir", "not-an-adapter", "fifo", "/nonexistent"):
            with pytest.raises(InvalidRequestError) as info:
                client.load_lora("probe", path)
            messages.add(info.value.message)
        assert messages == {"LOAD_LORA: adapter 'probe' could not be loaded (not a PEFT LoRA "
                            "adapter directory under the server's --lora-root that fits this "
                            "model)"}
        assert client.ping()["status"] == "ok"   # nothing blocked on the FIFO
        # A path relative to the root loads (the same adapter as paths[1]).
        reply = client.load_lora("relative", pathlib.Path(paths[1]).name)
        assert reply["loaded"] is True


def test_runtime_loading_is_off_by_default(tmp_path):
    config = tiny_config()
    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=16, enable_lora=True,
                                    max_loras=1),
                       model_config=config, weights=random_weights(config, seed=4))
    adapter = str(write_peft_adapter(tmp_path / "a", config, rank=8, seed=1))
    server = Server(engine, ServerConfig(endpoint="tcp://127.0.0.1:*"))
    endpoint = server.start()
    try:
        with Client(endpoint, timeout_s=30) as client:
            with pytest.raises(InvalidRequestError, match="--allow-runtime-lora"):
                client.load_lora("a", adapter)
    finally:
        server.stop()


def test_lora_name_type_and_disabled_server(tmp_path):
    config = tiny_config()
    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=16), model_config=config,
                       weights=random_weights(config, seed=4))
    server = Server(engine, ServerConfig(endpoint="tcp://127.0.0.1:*"))
    endpoint = server.start()
    try:
        with Client(endpoint, timeout_s=30) as client:
            with pytest.raises(InvalidRequestError, match="lora_name: must be a string"):
                client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY, lora_name=5)
            with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
                client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY, lora_name="a")
            with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
                client.load_lora("a", str(tmp_path))
            assert client.model_info()["enable_lora"] is False
    finally:
        server.stop()


def test_serve_flags():
    import argparse

    from pagedrun.server import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--enable-lora", "--lora-modules", "sql=/a/sql",
                              "chat=/b", "--max-loras", "2", "--max-lora-rank", "8",
                              "--max-cpu-loras", "4"])
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (
        True, 2, 8, 4)
    assert serve_cmd.lora_modules(args.lora_modules) == [LoRARequest("sql", 1, "/a/sql"),
                                                         LoRARequest("chat", 2, "/b")]
    with pytest.raises(SystemExit, match="NAME=PATH"):
        serve_cmd.lora_modules(["nopath"])
    with pytest.raises(SystemExit, match="distinct"):
        serve_cmd.lora_modules(["a=/x", "a=/y"])
    assert serve_cmd.server_config_from_args(args).runtime_lora_root is None
    for flags, words in ((["--allow-runtime-lora"], "go together"),
                         (["--lora-root", "/"], "go together"),
                         (["--allow-runtime-lora", "--lora-root", "/nonexistent-dir"],
                          "not a directory")):
        bad = parser.parse_args(["serve", "--enable-lora", *flags])
        with pytest.raises(SystemExit, match=words):
            serve_cmd.server_config_from_args(bad)
    ok = parser.parse_args(["serve", "--enable-lora", "--allow-runtime-lora", "--lora-root", "/"])
    assert serve_cmd.server_config_from_args(ok).runtime_lora_root == "/"
    no_lora = parser.parse_args(["serve", "--allow-runtime-lora", "--lora-root", "/"])
    with pytest.raises(SystemExit, match="needs --enable-lora"):
        serve_cmd.server_config_from_args(no_lora)
