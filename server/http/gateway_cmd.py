"""`paged-run http`: the OpenAI-compatible gateway alone, in front of a running engine server;
and `GatewayThread`, the same gateway on a thread of another process (`serve --http-port`,
tests, benchmarks).

    paged-run serve --port 5555 &
    paged-run http --engine tcp://127.0.0.1:5555 --port 8000 [--api-key KEY]

Binds to loopback unless `--host` says otherwise, like the ZeroMQ socket. Only argparse is
imported at module load (`paged-run --help` stays instant); uvicorn, Starlette and the ZeroMQ
client come with the command.
"""
from __future__ import annotations

import argparse
import sys

DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
# On stop, in-flight HTTP responses get this long to finish before their connections close.
GRACEFUL_SHUTDOWN_S = 5.0
START_TIMEOUT_S = 60.0
# Hosts that mean "every interface" when binding; a client on this machine reaches them on
# loopback.
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]", "")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagedrun.server.protocol import DEFAULT_ENDPOINT

    p = subparsers.add_parser(
        "http", help="OpenAI-compatible HTTP API in front of a running server (docs/http.md)",
        description="Serve the OpenAI HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics, ...) for the engine server at --engine, speaking the "
        "ZeroMQ protocol to it. Several gateways can front one engine server.")
    p.add_argument("--engine", default=DEFAULT_ENDPOINT, metavar="ENDPOINT",
                   help=f"the engine server's ZeroMQ endpoint (default {DEFAULT_ENDPOINT})")
    p.add_argument("--host", default=DEFAULT_HTTP_HOST,
                   help=f"address to bind (default {DEFAULT_HTTP_HOST}: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT,
                   help=f"default {DEFAULT_HTTP_PORT}")
    add_gateway_options(p)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the engine's model)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="model directory, .gguf or 'default' whose tokenizer serves /tokenize "
                   "and /detokenize (default: the engine's model, when it is on this machine)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="longest wait for the engine's next frame of a request (default 600)")
    p.add_argument("--curve-server-key", default=None, metavar="FILE",
                   help="the engine server's public CURVE certificate (with CURVE on)")
    p.add_argument("--curve-client-key", default=None, metavar="FILE",
                   help="this gateway's CURVE certificate (public + secret key)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)
    return p


def add_gateway_options(p) -> None:
    """Options both `http` and `serve --http-port` take."""
    from pagedrun.server.http.edge import add_edge_options

    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/ routes")
    add_edge_options(p)


def connect_endpoint(bound: str) -> str:
    """The endpoint a local client connects to for a server bound at `bound` (a wildcard host
    becomes loopback)."""
    prefix, sep, rest = bound.partition("://")
    if prefix != "tcp" or not sep:
        return bound
    host, _, port = rest.rpartition(":")
    if host in WILDCARD_HOSTS:
        host = "[::1]" if host in ("::", "[::]") else "127.0.0.1"
    return f"tcp://{host}:{port}"


def http_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


class GatewayThread:
    """uvicorn serving `app` on its own thread (and event loop), under the app's EdgeLimits
    (header deadline, keep-alive, connection and head-size caps: server/http/edge.py).
    `start()` returns once the socket is bound and the app has started (the engine's
    MODEL_INFO asked), with the bound (host, port); `stop()` ends it. Port 0 picks a free
    port."""

    def __init__(self, app, host: str = DEFAULT_HTTP_HOST, port: int = DEFAULT_HTTP_PORT,
                 log_level: str = "warning") -> None:
        import uvicorn

        from pagedrun.server.http.edge import uvicorn_options

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                     timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                     lifespan="on", **uvicorn_options(app.state.edge_limits))
        self.server = uvicorn.Server(self.config)
        self.thread = None
        self.host, self.port = host, port

    def start(self, timeout_s: float = START_TIMEOUT_S) -> tuple[str, int]:
        import threading
        import time

        # uvicorn binds (asyncio's create_server), not us: the connections of a socket we made
        # with socket.socket() have proto 0, so asyncio would not set TCP_NODELAY on them, and
        # Nagle's algorithm with the client's delayed ACKs holds SSE events back ~40 ms.
        self.thread = threading.Thread(target=self.server.run, name="http-gateway", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP gateway did not start on {self.host}:{self.port} "
                                   "(see the log)")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.host, self.port

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def stop(self, timeout_s: float = GRACEFUL_SHUTDOWN_S + 5.0) -> None:
        if self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout_s)


def serve_until_signalled(gateway: GatewayThread) -> int:
    """Block until SIGINT/SIGTERM (then stop the gateway: in-flight responses get
    GRACEFUL_SHUTDOWN_S, exit status 0) or until the gateway thread dies (status 1). The
    signals are ours, not uvicorn's: uvicorn re-raises a signal it handled once it has shut
    down, which would end the process with 128 + the signal instead of 0."""
    import signal
    import threading

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda signum, frame: stop.set())
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.2):
            if not gateway.thread.is_alive():
                return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    gateway.stop()
    return 0


def run(args) -> int:
    import logging

    from pagedrun.server.http.app import build_app
    from pagedrun.server.http.edge import edge_limits

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(args.curve_server_key) != bool(args.curve_client_key):
        raise SystemExit("paged-run http: --curve-server-key and --curve-client-key go together")
    app = build_app(args.engine, api_key=args.api_key,
                    served_model_name=args.served_model_name,
                    tokenizer_model=args.tokenizer, timeout_s=args.timeout_s,
                    server_public_key_file=args.curve_server_key,
                    client_secret_key_file=args.curve_client_key, limits=edge_limits(args))
    gateway = GatewayThread(app, host=args.host, port=args.port, log_level=args.log_level)
    try:
        gateway.start()
    except RuntimeError as exc:
        print(f"paged-run http: {exc}", file=sys.stderr)
        return 1
    print(f"paged-run http: OpenAI API on {gateway.url}/v1 for the engine at {args.engine}",
          flush=True)
    return serve_until_signalled(gateway)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="paged-run")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
