"""Overhead of the OpenAI HTTP gateway: the same load through HTTP (gateway -> ZeroMQ -> engine)
and through ZeroMQ directly, against the fake engine, on one machine.

Processes: the ZeroMQ server around the fake engine (tests/server/run_fake_server.py, no step
delay: it produces one token per request per step as fast as it can step), the gateway
(`python -m pagedrun http`, its own process, as deployed), and this script as the client. So
what differs between the two columns is the gateway hop: HTTP parsing, JSON + SSE encoding, and
a second ZeroMQ client, on top of the same server and engine.

Three measurements, each `--repeats` times with the two paths interleaved; medians reported:
- streamed tokens/s: `--streams` concurrent streamed requests of `--stream-tokens` tokens each
  (ZeroMQ: AsyncClient.stream; HTTP: streamed POST /v1/completions, usage from include_usage);
- requests/s: `--requests` non-streamed 1-token requests, `--concurrency` in flight
  (ZeroMQ: AsyncClient.generate; HTTP: POST /v1/completions);
- 1-token round-trip latency, one request at a time (median and p90 over `--latency-n`).
The clients differ too: pyzmq's AsyncClient against a small asyncio HTTP/1.1 client (RawHttp,
one keep-alive connection per request in flight), both a few Python lines per request.

Usage: python benchmarks/bench_http.py [--repeats 5] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx  # only to wait for /health

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_json_option, cpu_model, write_json  # noqa: E402
from bench_roundtrip import start_server, stop_server  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROMPT_IDS = [72, 105, 33]  # any ids: the fake engine's output depends only on them
GATEWAY_START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(endpoint: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedrun", "http", "--engine", endpoint,
                             "--port", str(port), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("bench_http: the gateway did not start")


def stop_gateway(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


# --- ZeroMQ -----------------------------------------------------------------------------------

async def zmq_stream_tokens(endpoint: str, streams: int, tokens: int) -> float:
    from pagedrun.client import AsyncClient

    async with AsyncClient(endpoint, timeout_s=60) as client:
        async def one() -> int:
            n = 0
            s = await client.stream(prompt_token_ids=PROMPT_IDS,
                                    sampling_params={"max_tokens": tokens})
            async for d in s:
                n += len(d.token_ids)
            return n

        await one()  # connection and lease set up outside the timing
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(streams)))
        elapsed = time.perf_counter() - t0
    assert sum(counts) == streams * tokens, counts
    return sum(counts) / elapsed


async def zmq_requests(endpoint: str, n: int, concurrency: int) -> float:
    from pagedrun.client import AsyncClient

    async with AsyncClient(endpoint, timeout_s=60) as client:
        async def worker(count: int) -> None:  # like the HTTP side: `concurrency` in a row
            for _ in range(count):
                out = await client.generate(prompt_token_ids=PROMPT_IDS,
                                            sampling_params={"max_tokens": 1})
                assert len(out.token_ids) == 1

        await worker(1)
        t0 = time.perf_counter()
        share = [n // concurrency + (i < n % concurrency) for i in range(concurrency)]
        await asyncio.gather(*(worker(k) for k in share))
        return n / (time.perf_counter() - t0)


async def zmq_latency(endpoint: str, n: int) -> list[float]:
    from pagedrun.client import AsyncClient

    samples = []
    async with AsyncClient(endpoint, timeout_s=60) as client:
        for i in range(n + 1):
            t0 = time.perf_counter()
            await client.generate(prompt_token_ids=PROMPT_IDS, sampling_params={"max_tokens": 1})
            if i:  # the first sets up the connection
                samples.append((time.perf_counter() - t0) * 1e6)
    return samples


# --- HTTP -------------------------------------------------------------------------------------

class RawHttp:
    """A minimal HTTP/1.1 keep-alive client for one connection (asyncio streams): httpx's
    connection pool costs more CPU per request than the gateway itself on this machine (its
    request assignment scans every connection), which would measure the client, not the
    gateway. Handles what uvicorn sends: Content-Length bodies and chunked streams."""

    def __init__(self, url: str) -> None:
        host_port = url.split("//", 1)[1]
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self.reader = self.writer = None

    async def __aenter__(self):
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()

    async def post(self, path: str, body: dict) -> tuple[int, bytes]:
        """One request; returns (status, the whole body: a chunked body de-chunked)."""
        data = json.dumps(body).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(),
                                                            len(data), data))
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        if "content-length" in headers:
            return status, await self.reader.readexactly(int(headers["content-length"]))
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return status, b"".join(parts)
            parts.append(chunk[:-2])


def sse_completion_tokens(body: bytes) -> int:
    """completion_tokens of the usage event of an SSE body ending with data: [DONE]."""
    events = body.decode().split("\n\n")
    assert events[-2] == "data: [DONE]", events[-3:]
    return json.loads(events[-3][len("data: "):])["usage"]["completion_tokens"]


async def http_stream_tokens(url: str, streams: int, tokens: int) -> float:
    body = {"prompt": PROMPT_IDS, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    conns = [RawHttp(url) for _ in range(streams)]
    for c in conns:
        await c.__aenter__()
    try:
        async def one(conn) -> int:
            status, raw = await conn.post("/v1/completions", body)
            assert status == 200, raw
            return sse_completion_tokens(raw)

        await one(conns[0])
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(c) for c in conns))
        elapsed = time.perf_counter() - t0
    finally:
        for c in conns:
            await c.__aexit__()
    assert sum(counts) == streams * tokens, counts
    return sum(counts) / elapsed


async def http_requests(url: str, n: int, concurrency: int) -> float:
    body = {"prompt": PROMPT_IDS, "max_tokens": 1}
    conns = [RawHttp(url) for _ in range(concurrency)]
    for c in conns:
        await c.__aenter__()
    try:
        async def worker(conn, count: int) -> None:
            for _ in range(count):
                status, raw = await conn.post("/v1/completions", body)
                assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 1

        await worker(conns[0], 1)
        t0 = time.perf_counter()
        share = [n // concurrency + (i < n % concurrency) for i in range(concurrency)]
        await asyncio.gather(*(worker(c, k) for c, k in zip(conns, share)))
        return n / (time.perf_counter() - t0)
    finally:
        for c in conns:
            await c.__aexit__()


async def http_latency(url: str, n: int) -> list[float]:
    samples = []
    body = {"prompt": PROMPT_IDS, "max_tokens": 1}
    async with RawHttp(url) as conn:
        for i in range(n + 1):
            t0 = time.perf_counter()
            status, _ = await conn.post("/v1/completions", body)
            assert status == 200
            if i:
                samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--latency-n", type=int, default=300)
    add_json_option(p, bare_to_stdout=False)
    args = p.parse_args()

    server, endpoint = start_server("tcp://127.0.0.1:0")
    gateway, url = start_gateway(endpoint)
    rows: dict[str, list[float]] = {k: [] for k in (
        "zmq_tok_s", "http_tok_s", "zmq_req_s", "http_req_s")}
    lat: dict[str, list[float]] = {"zmq": [], "http": []}
    try:
        for _ in range(args.repeats):
            rows["zmq_tok_s"].append(asyncio.run(zmq_stream_tokens(
                endpoint, args.streams, args.stream_tokens)))
            rows["http_tok_s"].append(asyncio.run(http_stream_tokens(
                url, args.streams, args.stream_tokens)))
            rows["zmq_req_s"].append(asyncio.run(zmq_requests(
                endpoint, args.requests, args.concurrency)))
            rows["http_req_s"].append(asyncio.run(http_requests(
                url, args.requests, args.concurrency)))
        lat["zmq"] = asyncio.run(zmq_latency(endpoint, args.latency_n))
        lat["http"] = asyncio.run(http_latency(url, args.latency_n))
    finally:
        stop_gateway(gateway)
        stop_server(server)

    med = {k: statistics.median(v) for k, v in rows.items()}
    cpu = cpu_model()
    print(f"HTTP gateway vs ZeroMQ, fake engine, medians of {args.repeats}; CPU: {cpu}")
    print(f"{'measurement':<44}{'ZeroMQ':>12}{'HTTP':>12}{'HTTP/ZeroMQ':>13}")
    for label, z, h in (
            (f"streamed tokens/s ({args.streams} x {args.stream_tokens} tokens)",
             med["zmq_tok_s"], med["http_tok_s"]),
            (f"requests/s (1 token, {args.concurrency} in flight)",
             med["zmq_req_s"], med["http_req_s"])):
        print(f"{label:<44}{z:>12.0f}{h:>12.0f}{h / z:>13.2f}")
    for q, fn in (("median", statistics.median), ("p90", p90)):
        z, h = fn(lat["zmq"]), fn(lat["http"])
        print(f"{'1-token round trip ' + q + ' (us)':<44}{z:>12.0f}{h:>12.0f}{h / z:>13.2f}")
    write_json({"benchmark": "http_gateway", "cpu": cpu, "args": vars(args), "runs": rows,
                "medians": med, "latency_us": {k: {"median": statistics.median(v), "p90": p90(v)}
                                               for k, v in lat.items()}}, args.json, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
