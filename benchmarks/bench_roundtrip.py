"""Round-trip latency of a 1-token request over ipc:// and tcp:// loopback, C client vs Python.

What is timed: one client, one request at a time, GENERATE with `max_tokens = 1` and
`stream: false` (one FINAL back), from the call until the decoded completion is returned. From C:
`pagedrun_generate` of libpagedrun_client (clients/c/bench/roundtrip.c, built here with CMake in
Release); from Python: `Client.generate` (server/client.py). The server is a separate process
around the fake engine (tests/server/run_fake_server.py, no step delay), so the numbers are the
wire, the server's I/O thread and its hand-off to the engine thread, not a model. Each client
runs WARMUP unmeasured requests, then N measured; median, p90 and p99 in microseconds.

Usage: python benchmarks/bench_roundtrip.py [-n 2000] [--warmup 200] [--json PATH]
           [--transports ipc,tcp] [--build-dir build/bench_roundtrip]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_json_option, cpu_model, write_json  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RUN_FAKE_SERVER = os.path.join(REPO, "tests", "server", "run_fake_server.py")
PROMPT = "ping"
SERVER_START_TIMEOUT_S = 60


def build_c(build_dir: str) -> str:
    for tool in ("cmake", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"bench_roundtrip: {tool} not found (scripts/install.sh installs it)")
    src = os.path.join(REPO, "clients", "c")
    for cmd in (["cmake", "-S", src, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                 "-DPAGEDRUN_CLIENT_BUILD_EXTRAS=ON"],
                ["cmake", "--build", build_dir, "--target", "roundtrip"]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"bench_roundtrip: {' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return os.path.join(build_dir, "roundtrip")


def start_server(endpoint: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, RUN_FAKE_SERVER, endpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    line = proc.stdout.readline()
    if not line.startswith("READY ") or time.monotonic() > deadline:
        proc.kill()
        sys.exit(f"bench_roundtrip: the server did not start ({line!r})")
    return proc, line.split()[1]


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def run_c(exe: str, endpoint: str, n: int, warmup: int) -> list[float]:
    proc = subprocess.run([exe, endpoint, str(n), str(warmup), PROMPT], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"bench_roundtrip: C client failed: {proc.stderr}")
    return [float(x) for x in proc.stdout.split()]


def run_python(endpoint: str, n: int, warmup: int) -> list[float]:
    from pagedrun.client import Client

    samples = []
    with Client(endpoint, timeout_s=30) as client:
        params = {"max_tokens": 1}
        for i in range(-warmup, n):
            t0 = time.perf_counter()
            out = client.generate(PROMPT, sampling_params=params)
            t1 = time.perf_counter()
            assert len(out.token_ids) == 1, out
            if i >= 0:
                samples.append((t1 - t0) * 1e6)
    return samples


def percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted samples."""
    k = max(0, min(len(sorted_xs) - 1, int(round(q / 100 * len(sorted_xs) + 0.5)) - 1))
    return sorted_xs[k]


def summarize(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"n": len(s), "median_us": statistics.median(s), "p90_us": percentile(s, 90),
            "p99_us": percentile(s, 99), "mean_us": statistics.fmean(s), "min_us": s[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=2000, help="measured requests per client/transport")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--transports", default="ipc,tcp")
    p.add_argument("--build-dir", default=os.path.join(REPO, "build", "bench_roundtrip"))
    add_json_option(p, bare_to_stdout=False, help="also write the results as JSON")
    args = p.parse_args()

    exe = build_c(args.build_dir)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedrun-bench-") as tmp:
        for transport in args.transports.split(","):
            endpoint = (f"ipc://{tmp}/roundtrip.sock" if transport == "ipc"
                        else "tcp://127.0.0.1:0")
            server, bound = start_server(endpoint)
            try:
                for client, fn in (("C (libpagedrun_client)", lambda: run_c(
                        exe, bound, args.n, args.warmup)),
                                   ("Python (Client)", lambda: run_python(
                                       bound, args.n, args.warmup))):
                    results.append({"transport": transport, "client": client,
                                    **summarize(fn())})
            finally:
                stop_server(server)

    cpu = cpu_model()
    print(f"1-token round trip (max_tokens=1, stream off), fake engine, one request at a time; "
          f"N={args.n} after {args.warmup} warm-up; CPU: {cpu}")
    header = f"{'transport':<10} {'client':<24} {'median us':>10} {'p90 us':>10} " \
             f"{'p99 us':>10} {'mean us':>10}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['transport']:<10} {r['client']:<24} {r['median_us']:>10.1f} "
              f"{r['p90_us']:>10.1f} {r['p99_us']:>10.1f} {r['mean_us']:>10.1f}")
    write_json({"benchmark": "roundtrip", "cpu": cpu, "n": args.n, "warmup": args.warmup,
                "prompt": PROMPT, "results": results}, args.json, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
