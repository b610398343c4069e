"""`paged-run serve [MODEL]`: load an engine, print its capacity, serve it on a ROUTER socket.

vLLM's flag names map onto EngineConfig; the server's own knobs (endpoint, limits, leases,
CURVE) onto ServerConfig. SIGINT/SIGTERM drain and exit 0; a second one stops at once, every
in-flight request answered `shutting_down`, exit status 128 + the signal's number
(docs/protocol.md, "Shutdown"). Binding beyond loopback without CURVE is logged as a warning.
`--http-port PORT` also runs the OpenAI-compatible gateway (server/http/, docs/http.md) on
HOST:PORT, a thread of this process that reaches the engine through the ZeroMQ socket like any
other client; it stops after the drain. Only argparse is imported at module load so
`paged-run --help` stays instant.
"""
from __future__ import annotations

import argparse
import os
import sys

NEEDS_SECRET = ("paged-run serve: --nnodes > 1 needs --tp-secret-file FILE, the same 0600 file "
                "on every node (create one with `python -m pagedrun.runtime.distributed.auth "
                "FILE`)")


def _positive_ints(text: str, example: str, too_small: str) -> tuple[int, ...]:
    """"N,N,..." -> a tuple of ints >= 1 (argparse errors: `example` for text that is not a
    list of ints, `too_small` for a value below 1)."""
    try:
        values = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}")
    if any(n < 1 for n in values):
        raise argparse.ArgumentTypeError(f"{too_small}, got {text!r}")
    return values


def _layer_partition(text: str) -> tuple[int, ...]:
    """--pp-layer-partition: "10,11,9" -> (10, 11, 9)."""
    return _positive_ints(text, "layer counts like 10,11,9", "every stage needs at least one layer")


def add_parser(subparsers) -> argparse.ArgumentParser:
    # Defaults come from their one definition: the engine's from EngineConfig, the address from
    # the protocol module (both light: dataclasses; msgpack).
    from pagedrun.runtime.engine_config import (BLOCK_SIZES, DEVICES, DTYPES,
                                                EXECUTOR_BACKENDS, LOGPROBS_MODES, EngineConfig)
    from pagedrun.server.protocol import DEFAULT_HOST, DEFAULT_PORT

    engine = EngineConfig()
    p = subparsers.add_parser(
        "serve", help="serve a model over ZeroMQ (docs/protocol.md)",
        description="Load MODEL (a Hugging Face directory or .gguf; default: the embedded "
        "SmolLM2-135M) and serve it on tcp://HOST:PORT until SIGINT/SIGTERM.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL")
    net = p.add_argument_group("network")
    net.add_argument("--host", default=DEFAULT_HOST,
                     help=f"address to bind (default {DEFAULT_HOST}: loopback only)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    net.add_argument("--endpoint", default=None,
                     help="full ZeroMQ endpoint instead of host/port, e.g. ipc:///tmp/pr.sock")
    eng = p.add_argument_group("engine (vLLM names)")
    eng.add_argument("--device", default=engine.device, choices=DEVICES)
    eng.add_argument("--dtype", default=engine.dtype, choices=DTYPES,
                     help="auto: on cpu the checkpoint's own precision (a .gguf's blocks, "
                          "the default model's Q4_1 included; bfloat16 for a bf16 checkpoint; "
                          "float32 for others), bfloat16 on cuda; float32: the numpy reference")
    add_quantization_option(eng)
    add_step_options(eng)
    eng.add_argument("--tensor-parallel-size", type=int, default=engine.tensor_parallel_size)
    eng.add_argument("--pipeline-parallel-size", type=int,
                     default=engine.pipeline_parallel_size,
                     help="split the layers into this many stages of --tensor-parallel-size "
                          "ranks each, with as many batches in flight")
    eng.add_argument("--pp-layer-partition", type=_layer_partition, default=None,
                     metavar="N,N,...",
                     help="layers per pipeline stage, e.g. 10,11,9 (default: even, earlier "
                          "stages the larger)")
    eng.add_argument("--distributed-executor-backend", default=engine.distributed_executor_backend,
                     choices=EXECUTOR_BACKENDS,
                     help="who starts the ranks: mp (worker processes; --nnodes > 1 with "
                          "`--node-rank R` on each node) or ray (one actor per rank on a Ray "
                          "cluster; `pip install paged-run[ray]`)")
    eng.add_argument("--ray-address", default=engine.ray_address,
                     help="the Ray cluster to join (default: the running one on this node, "
                          "else a local one)")
    eng.add_argument("--nnodes", type=int, default=engine.nnodes,
                     help="mp executor: ranks over this many nodes (the same number on each)")
    eng.add_argument("--node-rank", type=int, default=0,
                     help="this node's index; > 0 runs headless workers that join node 0")
    eng.add_argument("--master-addr", default=engine.master_addr, metavar="HOST:PORT",
                     help="node 0's tensor-parallel control address (all nodes give the same)")
    eng.add_argument("--tp-secret-file", default=engine.tp_secret_file, metavar="FILE",
                     help="shared secret of a multi-node tensor-parallel group (the same file "
                          "on every node, mode 0600; create one with `python -m "
                          "pagedrun.runtime.distributed.auth FILE`)")
    eng.add_argument("--tp-curve", default=engine.tp_curve,
                     action=argparse.BooleanOptionalAction,
                     help="CURVE-encrypt the tensor-parallel sockets (give it on every node)")
    eng.add_argument("--max-model-len", type=int, default=engine.max_model_len)
    eng.add_argument("--gpu-memory-utilization", type=float,
                     default=engine.gpu_memory_utilization)
    eng.add_argument("--block-size", type=int, default=engine.block_size, choices=BLOCK_SIZES)
    eng.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs)
    eng.add_argument("--max-num-batched-tokens", type=int,
                     default=engine.max_num_batched_tokens)
    eng.add_argument("--enable-prefix-caching", default=engine.enable_prefix_caching,
                     action=argparse.BooleanOptionalAction)
    eng.add_argument("--num-kv-blocks", type=int, default=engine.num_kv_blocks,
                     help="explicit KV capacity in blocks (default: from the memory budget)")
    eng.add_argument("--seed", type=int, default=engine.seed)
    eng.add_argument("--max-logprobs", type=int, default=engine.max_logprobs,
                     help="most top logprobs a request may ask for (-1: the whole vocabulary)")
    eng.add_argument("--logprobs-mode", default=engine.logprobs_mode, choices=LOGPROBS_MODES,
                     help="raw: from the model's logits; processed: after bias, penalties, "
                          "temperature and the top-k / top-p / min-p filters")
    add_speculative_config_option(eng)
    # None: ServerConfig's default (server/server.py imports zmq, too slow for `--help`).
    lora = p.add_argument_group("LoRA adapters (vLLM names)")
    lora.add_argument("--enable-lora", action="store_true", default=engine.enable_lora,
                      help="serve PEFT LoRA adapters (GENERATE lora_name)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="adapters loaded at start")
    lora.add_argument("--allow-runtime-lora", action="store_true",
                      help="accept LOAD_LORA messages (off: adapters come from --lora-modules "
                           "only); needs --lora-root")
    lora.add_argument("--lora-root", metavar="DIR", default=None,
                      help="with --allow-runtime-lora: the one directory LOAD_LORA may read "
                           "adapters from (paths resolving outside it are refused)")
    lora.add_argument("--max-loras", type=int, default=engine.max_loras,
                      help="adapters one step can run (device slots)")
    lora.add_argument("--max-lora-rank", type=int, default=engine.max_lora_rank)
    lora.add_argument("--max-cpu-loras", type=int, default=engine.max_cpu_loras,
                      help="adapters kept loaded in host memory (default: --max-loras)")
    srv = p.add_argument_group("server")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="requests in flight before new ones get `overloaded`")
    srv.add_argument("--max-message-bytes", type=int, default=None)
    srv.add_argument("--lease-s", type=float, default=None,
                     help="a client with requests in flight must send something this often")
    srv.add_argument("--shutdown-timeout", type=float, default=None,
                     help="on SIGINT/SIGTERM, let in-flight requests finish this long, "
                     "then abort them")
    srv.add_argument("--curve-secret-key", default=None, metavar="FILE",
                     help="enable CURVE: the server's zmq certificate (public + secret key)")
    srv.add_argument("--curve-allowed-clients", default=None, metavar="DIR",
                     help="directory of allowed clients' public certificates")
    srv.add_argument("--log-level", default="INFO")
    # The OpenAI-compatible gateway (server/http/), in this process, speaking ZeroMQ to the
    # socket above; `paged-run http` runs the same gateway alone.
    from pagedrun.server.http.gateway_cmd import add_gateway_options

    web = p.add_argument_group("OpenAI HTTP API (docs/http.md)")
    web.add_argument("--http-port", type=int, default=None, metavar="PORT",
                     help="also serve the OpenAI API on http://HOST:PORT/v1 (HOST: --host)")
    add_gateway_options(web)
    p.set_defaults(func=run)
    return p


def endpoint_from_args(args) -> str:
    if args.endpoint:
        return args.endpoint
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"tcp://{host}:{args.port}"


def server_config_from_args(args):
    from pagedrun.server.auth import CurveConfig
    from pagedrun.server.server import ServerConfig

    curve = None
    if args.curve_secret_key or args.curve_allowed_clients:
        if not (args.curve_secret_key and args.curve_allowed_clients):
            raise SystemExit("paged-run serve: --curve-secret-key and --curve-allowed-clients "
                             "go together")
        curve = CurveConfig(args.curve_secret_key, args.curve_allowed_clients)
    if args.allow_runtime_lora != (args.lora_root is not None):
        raise SystemExit("paged-run serve: --allow-runtime-lora and --lora-root DIR go together")
    if args.allow_runtime_lora and not args.enable_lora:
        raise SystemExit("paged-run serve: --allow-runtime-lora needs --enable-lora")
    if args.lora_root is not None and not os.path.isdir(args.lora_root):
        raise SystemExit(f"paged-run serve: --lora-root {args.lora_root}: not a directory")
    given = {"max_message_bytes": args.max_message_bytes,
             "runtime_lora_root": args.lora_root,
             "max_queued_requests": args.max_queued_requests, "lease_s": args.lease_s,
             "shutdown_timeout_s": args.shutdown_timeout}
    return ServerConfig(endpoint=endpoint_from_args(args), curve=curve,
                        **{name: value for name, value in given.items() if value is not None})


def speculative_config_arg(text: str):
    """argparse `type=` of --speculative-config: the JSON as a SpeculativeConfig; a bad value is
    a usage error (exit 2) that names the field."""
    # Through engine_config: the server's one door into the engine's configuration.
    from pagedrun.runtime.engine_config import SpeculativeConfig, SpeculativeConfigError

    try:
        return SpeculativeConfig.from_json(text)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_quantization_option(group) -> None:
    """--quantization, --cpu-isa and --kv-cache-dtype, shared by serve, generate and chat
    --in-process."""
    from pagedrun.runtime.engine_config import CPU_ISAS, KV_CACHE_DTYPES, QUANTIZATIONS

    group.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="weight quantization (vLLM's name): gguf = a .gguf model's GEMM "
                            "weights kept in the file's block types (kernels for Q4_0, Q4_1, "
                            "Q8_0, Q4_K, Q6_K; the default for a .gguf --model on cpu with "
                            "--dtype auto); awq / gptq = a Hugging Face int4 checkpoint "
                            "(4 bits, groups of 32/64/128, desc_act false) kept int4 (the "
                            "default for such a checkpoint); int8 = "
                            "int8 weights made at load (cpu: Q8_0 blocks, int8 activations); "
                            "none = the dtype's weights (a .gguf dequantized). cpu backend only")
    group.add_argument("--cpu-isa", default="auto", choices=CPU_ISAS,
                       help="cap the cpu kernels' instruction set (auto = the fastest this CPU "
                            "runs; avx2 runs what an AVX2-only CPU gets, on any CPU; portable = "
                            "the plain C++ reference). The start-up log names the paths chosen")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache element type (vLLM's name): auto = bfloat16 on cpu with "
                            "--dtype bfloat16 or --quantization int8 (half the KV bytes), "
                            "float32 on the float32 cpu backend, the activation dtype on "
                            "sim/cuda; fp8 (= fp8_e4m3) = fp8 e4m3 bits, round to nearest "
                            "even saturated to +-448, per-tensor scale 1.0 (no calibration), "
                            "on the cpu backends only (a quarter of float32's KV bytes)")


def _graph_sizes(text: str) -> tuple[int, ...]:
    """--cuda-graph-sizes: "1,2,4,8" -> (1, 2, 4, 8)."""
    return _positive_ints(text, "batch sizes like 1,2,4,8", "batch sizes must be >= 1")


def add_step_options(group) -> None:
    """--enforce-eager and --cuda-graph-sizes (decode graphs; runtime/decode_graphs.py) and
    --async-scheduling (runtime/engine/async_stepper.py), shared by serve, generate and chat
    --in-process."""
    group.add_argument("--enforce-eager", action="store_true",
                       help="never capture decode graphs: every step launches op by op "
                            "(vLLM's name)")
    group.add_argument("--cuda-graph-sizes", type=_graph_sizes, default=None, metavar="N,N,...",
                       help="decode batch sizes captured as graphs (default on cuda: 1,2,4 and "
                            "every 8 up to min(--max-num-seqs, 512); sim: none)")
    group.add_argument("--async-scheduling", action="store_true",
                       help="schedule and launch step N+1 while step N runs (its tokens read "
                            "back one step late; the same outputs); sim and cuda")


def add_speculative_config_option(group) -> None:
    """--speculative-config JSON, shared by serve, generate and chat --in-process."""
    group.add_argument(
        "--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
        help="speculative decoding (vLLM's speculative_config), e.g. '{\"method\": \"ngram\", "
             "\"num_speculative_tokens\": 4}'; fields: method (ngram | draft_model), "
             "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, model, "
             "disable_by_batch_size (docs/engine_api.md)")


def engine_config_from_args(args):
    from pagedrun.runtime.engine_config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        cpu_isa=args.cpu_isa, enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes,
        async_scheduling=args.async_scheduling, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pp_layer_partition=args.pp_layer_partition,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_address=args.ray_address, nnodes=args.nnodes,
        master_addr=args.master_addr, tp_secret_file=args.tp_secret_file,
        tp_curve=args.tp_curve, seed=args.seed, max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, speculative_config=args.speculative_config)


def build_engine(args):
    from pagedrun.runtime.engine import LLMEngine

    return LLMEngine(engine_config_from_args(args))


def lora_modules(specs: list[str]) -> list:
    """--lora-modules NAME=PATH ... as LoRARequests with lora_int_ids 1, 2, ..."""
    from pagedrun.runtime.engine import LoRARequest

    out = []
    for i, spec in enumerate(specs):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"paged-run serve: --lora-modules takes NAME=PATH, got {spec!r}")
        out.append(LoRARequest(name, i + 1, path))
    if len({r.lora_name for r in out}) != len(out):
        raise SystemExit("paged-run serve: --lora-modules names must be distinct")
    return out


def startup_summary(info: dict, endpoint: str, curve: bool) -> str:
    concurrency = info.get("max_concurrency_at_max_len")
    return "\n".join([
        f"paged-run serve: model {info.get('model')} on {info.get('device')} "
        f"({info.get('dtype')}" + (f", {info['quantization']} weights"
                                   if info.get("quantization") not in (None, "none") else "")
        + ")",
        f"  KV cache: {info.get('num_kv_blocks')} blocks x {info.get('block_size')} tokens = "
        f"{info.get('kv_capacity_tokens')} tokens",
        f"  max_model_len {info.get('max_model_len')}: max concurrency at max length "
        f"{concurrency:.2f}" if isinstance(concurrency, (int, float)) else
        f"  max_model_len {info.get('max_model_len')}",
        f"  listening on {endpoint} (CURVE {'on' if curve else 'off'})",
    ])


# After a second signal, the process ends by os._exit this long later if the forced shutdown
# has not returned by then (an engine step that never ends, a close that hangs).
FORCE_EXIT_WATCHDOG_S = 5.0


def start_gateway(endpoint: str, engine, args):
    """The HTTP gateway on --host:--http-port, a thread of this process connected to the bound
    ZeroMQ `endpoint` like any other client; it gets the engine's tokenizer object for
    /tokenize and /detokenize. Prints its address."""
    from pagedrun.server.http.app import build_app
    from pagedrun.server.http.edge import edge_limits
    from pagedrun.server.http.gateway_cmd import GatewayThread, connect_endpoint

    app = build_app(connect_endpoint(endpoint), api_key=args.api_key,
                    tokenizer=getattr(engine, "tokenizer", None), limits=edge_limits(args))
    gateway = GatewayThread(app, host=args.host, port=args.http_port,
                            log_level=args.log_level)
    gateway.start()
    print(f"  OpenAI HTTP API on {gateway.url}/v1", flush=True)
    return gateway


def serve_until_signalled(server) -> int:
    """Run `server.serve()` in this (main) thread. The first SIGINT/SIGTERM starts a graceful
    drain (exit status 0); a second forces the exit: in-flight requests are answered
    `shutting_down` and the status is 128 + that signal's number."""
    import os
    import signal
    import threading

    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            server.request_shutdown()
            return
        server.force_shutdown()
        if len(signals) == 2:
            watchdog = threading.Timer(FORCE_EXIT_WATCHDOG_S, os._exit, (128 + signum,))
            watchdog.daemon = True
            watchdog.start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if getattr(server, "forced", False) and len(signals) >= 2:
        return 128 + signals[1]
    return 0


def run(args) -> int:
    import logging
    import threading

    from pagedrun.server.heap import cap_arenas
    from pagedrun.server.server import Server

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0:  # headless: this node's tensor-parallel workers only
        from pagedrun.runtime.distributed.node import run_node

        if not args.master_addr:
            raise SystemExit("paged-run serve: --node-rank > 0 needs --master-addr HOST:PORT")
        if not args.tp_secret_file:
            raise SystemExit(NEEDS_SECRET)
        return run_node(args.master_addr,
                        args.tensor_parallel_size * args.pipeline_parallel_size, args.nnodes,
                        args.node_rank, secret_file=args.tp_secret_file, curve=args.tp_curve)
    if args.nnodes > 1 and not args.master_addr:
        raise SystemExit("paged-run serve: --nnodes > 1 needs --master-addr HOST:PORT "
                         "(an address of this node the other nodes can reach)")
    if args.nnodes > 1 and not args.tp_secret_file:
        raise SystemExit(NEEDS_SECRET)
    config = server_config_from_args(args)
    if args.api_key is not None and args.http_port is None:
        raise SystemExit("paged-run serve: --api-key protects the HTTP API: give --http-port")
    adapters = lora_modules(args.lora_modules)
    if adapters and not args.enable_lora:
        raise SystemExit("paged-run serve: --lora-modules needs --enable-lora")
    if args.http_port is not None and config.curve is not None:
        raise SystemExit("paged-run serve: --http-port with CURVE: run the gateway as "
                         "`paged-run http --curve-server-key ... --curve-client-key ...`")
    # Before the model's threads exist: freed memory stays in few malloc arenas (server/heap.py).
    cap_arenas()
    engine = build_engine(args)
    gateways: list = []  # the HTTP gateway, once started (by the announcing thread)
    try:
        for adapter in adapters:  # a bad adapter stops the start, naming the file and why
            try:
                engine.add_lora(adapter)
            except Exception as exc:  # noqa: BLE001 -- reported as the exit message
                raise SystemExit(f"paged-run serve: --lora-modules {adapter.lora_name}: "
                                 f"{exc}") from None
        server = Server(engine, config)

        def announce():  # once bound, so the endpoint printed is the real one (port 0 / '*')
            endpoint = server.wait_bound(60)
            if not endpoint:
                return
            print(startup_summary(server.model_info, endpoint, config.curve is not None),
                  flush=True)
            if args.http_port is not None:
                try:
                    gateways.append(start_gateway(endpoint, engine, args))
                except Exception as exc:  # noqa: BLE001 -- reported, then the server stops
                    print(f"paged-run serve: the HTTP gateway did not start: {exc}",
                          file=sys.stderr, flush=True)
                    gateways.append(None)
                    server.request_shutdown()

        threading.Thread(target=announce, daemon=True).start()
        code = serve_until_signalled(server)
    finally:
        for gateway in gateways:
            if gateway is not None:
                gateway.stop()
        engine.close()  # tensor parallel: the workers exit (or are killed) before we do
    if None in gateways:
        return 1
    if server.engine_dead is not None:
        print(f"paged-run serve: stopped, the engine failed: {server.engine_dead}",
              file=sys.stderr, flush=True)
        return 1
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="paged-run")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
