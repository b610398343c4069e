"""`paged-run chat`: an interactive, streaming chat against a server, or in-process.

With `--in-process [--model PATH]` it loads the engine and serves it on a private loopback
port for the session, so the same client path is exercised either way. `-p/--prompt TEXT`
asks one question, prints the answer and exits (scripts, the README demo). Commands:
`/reset` forgets the conversation, `/exit` (or end of input) leaves.
"""
from __future__ import annotations

import argparse
import sys

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"
PROMPT = "> "
# --in-process sizes its engine for a chat session, not EngineConfig's model-wide default.
IN_PROCESS_MAX_MODEL_LEN = 2048


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagedrun.runtime.engine_config import DEVICES, EngineConfig
    from pagedrun.server.protocol import DEFAULT_HOST, DEFAULT_PORT
    from pagedrun.server.serve_cmd import (add_quantization_option,
                                           add_speculative_config_option, add_step_options)

    p = subparsers.add_parser("chat", help="interactive streaming chat (server or in-process)",
                              description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--endpoint", default=None, help="full ZeroMQ endpoint (overrides host/port)")
    p.add_argument("--in-process", action="store_true",
                   help="load the model here instead of connecting to a server")
    p.add_argument("--model", default=None, help="with --in-process: model dir or .gguf")
    p.add_argument("--device", default=EngineConfig().device, choices=DEVICES)
    p.add_argument("--max-model-len", type=int, default=IN_PROCESS_MAX_MODEL_LEN)
    add_quantization_option(p)  # with --in-process
    add_step_options(p)
    add_speculative_config_option(p)  # with --in-process (a server has its own)
    p.add_argument("-p", "--prompt", default=None, help="ask one question and exit")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.set_defaults(func=run)
    return p


def in_process_engine_config(args):
    """The EngineConfig `--in-process` loads."""
    from pagedrun.runtime.engine_config import EngineConfig

    return EngineConfig(model=args.model, device=args.device, max_model_len=args.max_model_len,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        cpu_isa=args.cpu_isa,
                        enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                        async_scheduling=args.async_scheduling,
                        speculative_config=args.speculative_config)


def _start_in_process(args):
    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.server.protocol import DEFAULT_HOST
    from pagedrun.server.server import Server, ServerConfig

    engine = LLMEngine(in_process_engine_config(args))
    server = Server(engine, ServerConfig(endpoint=f"tcp://{DEFAULT_HOST}:*"))  # any free port
    return server, server.start()


def chat_turn(client, messages: list[dict], args, out=sys.stdout) -> str:
    """Stream one assistant reply to `out`; returns its text."""
    stream = client.stream(messages=messages, sampling_params={
        "max_tokens": args.max_tokens, "temperature": args.temperature})
    with stream:
        for delta in stream:
            out.write(delta.text)
            out.flush()
    out.write("\n")
    out.flush()
    return stream.result.text if stream.result else ""


def run(args, stdin=None, stdout=None) -> int:
    from pagedrun.server.client import Client, ServerError
    from pagedrun.server.serve_cmd import endpoint_from_args

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    server = None
    if args.speculative_config is not None and not args.in_process:
        raise SystemExit("paged-run chat: --speculative-config needs --in-process (a server "
                         "takes it at `paged-run serve`)")
    if args.in_process:
        server, endpoint = _start_in_process(args)
    else:
        endpoint = endpoint_from_args(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = args.prompt is None and stdin.isatty()
    try:
        with Client(endpoint, timeout_s=args.timeout_s) as client:
            if args.prompt is not None:
                chat_turn(client, history + [{"role": "user", "content": args.prompt}], args,
                          stdout)
                return 0
            while True:
                if interactive:
                    stdout.write(PROMPT)
                    stdout.flush()
                line = stdin.readline()
                if not line or line.strip() in EXIT_COMMANDS:
                    return 0
                text = line.rstrip("\n")
                if text.strip() == RESET_COMMAND:
                    history = history[:1] if args.system else []
                    continue
                if not text.strip():
                    continue
                history.append({"role": "user", "content": text})
                try:
                    reply = chat_turn(client, history, args, stdout)
                except ServerError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": reply})
    finally:
        if server is not None:
            server.stop()
