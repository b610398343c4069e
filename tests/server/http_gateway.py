"""Helpers of the HTTP gateway tests (tests/server/test_http_*.py): a real engine stack that is
cheap to start, and the gateway in front of it.

`make_tiny_chat_model(dir)` builds a model directory the real LLMEngine loads in well under a
second: the tiny fixture weights (tests/fixtures/tiny/llama_tied_bf16, vocab 257) plus a
byte-level tokenizer written here with the `tokenizers` library (token id = byte value, id 256
= `<|end|>`, the EOS token) and a plain-text chat template. So text prompts, chat messages,
stop strings and logprob token texts all go through the real tokenizer and detokenizer code.

`Stack` runs an engine (real or fake) behind a ZeroMQ server on a random loopback port and the
gateway (uvicorn on a thread, port 0) in front of it.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

TINY_WEIGHTS = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama_tied_bf16"
END_TOKEN = "<|end|>"
END_TOKEN_ID = 256
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
TINY_ENGINE = dict(device="cpu", num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=128)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def make_tiny_chat_model(dst: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copyfile(TINY_WEIGHTS / name, dst / name)
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([END_TOKEN])
    assert tok.token_to_id(END_TOKEN) == END_TOKEN_ID
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": END_TOKEN, "chat_template": CHAT_TEMPLATE}))
    return dst


def tiny_engine(model_dir: Path, **overrides):
    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.runtime.engine_config import EngineConfig

    return LLMEngine(EngineConfig(model=str(model_dir), **{**TINY_ENGINE, **overrides}))


@dataclass
class Stack:
    server: object
    endpoint: str
    gateway: object

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def base_url(self) -> str:
        return self.gateway.url + "/v1"

    def stop(self) -> None:
        self.gateway.stop()
        self.server.stop()


def start_stack(engine, *, api_key: str | None = None, tokenizer=None, limits=None,
                **server_config) -> Stack:
    """`engine` behind a ZeroMQ server (loopback, random port) and the gateway in front of it
    (tokenizer: what the gateway gets for /tokenize; `serve --http-port` passes the engine's;
    limits: the gateway's EdgeLimits, default its defaults)."""
    from pagedrun.server.http.app import build_app
    from pagedrun.server.http.gateway_cmd import GatewayThread
    from pagedrun.server.server import Server, ServerConfig

    server_config.setdefault("endpoint", "tcp://127.0.0.1:*")
    server = Server(engine, ServerConfig(**server_config))
    endpoint = server.start()
    gateway = GatewayThread(build_app(endpoint, api_key=api_key, tokenizer=tokenizer,
                                      timeout_s=60, limits=limits), port=0)
    gateway.start()
    return Stack(server, endpoint, gateway)


def sdk(stack: Stack, api_key: str = "unused", asynchronous: bool = False):
    """The official openai SDK pointed at the stack; no retries (a 429 must reach the test)."""
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=stack.base_url, api_key=api_key, max_retries=0, timeout=60)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def model_name(stack: Stack) -> str:
    return str(stack.server.model_info["model"])
