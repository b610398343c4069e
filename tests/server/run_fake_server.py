"""A real server process around the fake engine (shutdown, restart, liveness, fuzz and C client
tests), or around the real LLMEngine with the tiny fixture model (`--engine tiny`).

    python tests/server/run_fake_server.py ENDPOINT [--step-delay-s S] [--shutdown-timeout S]
        [--lease-s S] [--max-message-bytes N] [--engine fake|tiny]
        [--curve-secret-key FILE --curve-allowed-clients DIR]

Prints "READY <endpoint>" once bound; SIGINT/SIGTERM drain and exit 0 like `paged-run serve`
(a second signal forces the exit, status 128 + its number).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_engine import FakeEngine  # noqa: E402

from pagedrun.server.auth import CurveConfig  # noqa: E402
from pagedrun.server.serve_cmd import serve_until_signalled  # noqa: E402
from pagedrun.server.server import Server, ServerConfig  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("--step-delay-s", type=float, default=0.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--max-message-bytes", type=int, default=None)
    p.add_argument("--engine", choices=("fake", "tiny"), default="fake")
    p.add_argument("--curve-secret-key")
    p.add_argument("--curve-allowed-clients")
    args = p.parse_args()
    curve = (CurveConfig(args.curve_secret_key, args.curve_allowed_clients)
             if args.curve_secret_key else None)
    if args.engine == "tiny":
        from test_real_engine import tiny_engine
        engine = tiny_engine()
    else:
        engine = FakeEngine(step_delay_s=args.step_delay_s)
    limits = {} if args.max_message_bytes is None else {
        "max_message_bytes": args.max_message_bytes}
    server = Server(engine, ServerConfig(endpoint=args.endpoint,
                                         shutdown_timeout_s=args.shutdown_timeout,
                                         lease_s=args.lease_s, curve=curve, **limits))

    def announce():
        endpoint = server.wait_bound(30)
        print(f"READY {endpoint}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    return serve_until_signalled(server)


if __name__ == "__main__":
    sys.exit(main())
