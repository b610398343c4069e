"""Cost of the tensor-parallel step broadcast: SchedulerOutput fields, driver -> workers.

What is timed (median over repeats, one run): the driver encodes a step (step_broadcast.
encode_step), sends it to every worker over its control connection (ROUTER -> DEALER, frames
without a copy), each worker process decodes it into a StepInputs and answers a 1-byte ack;
the time until the last ack is the broadcast's round trip. Workers are real processes (spawn),
as in serving. Transports: tcp on loopback (what multi-node uses) and ipc (a Unix socket).
Cases (block 16): decode_N: N sequences decoding, each with a 2048-token context (128-block
table rows); prefill_2048: 8 prompts of 256 tokens. Also reported: encode alone, the driver's
blocking part (encode + hand the frames to ZeroMQ: the rest overlaps rank 0's own forward), and
the bytes on the wire per worker.

Usage: python benchmarks/bench_step_broadcast.py [--workers 3] [--repeats 200] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import zmq

from pagedrun.runtime.distributed.step_broadcast import StepInputs, decode_step, encode_step

BLOCK_SIZE = 16
DECODE_CONTEXT = 2048
WARMUP = 20


def make_step(num_seqs: int, query_len: int, context_len: int) -> StepInputs:
    rng = np.random.default_rng(num_seqs)
    num_tokens = num_seqs * query_len
    max_blocks = -(-context_len // BLOCK_SIZE)
    qsl = np.arange(num_seqs + 1, dtype=np.int32) * query_len
    return StepInputs(
        seq=0, num_batched_tokens=num_tokens, prompt_logit_rows=(),
        input_token_ids=rng.integers(0, 128000, num_tokens, dtype=np.int32),
        positions=rng.integers(0, context_len, num_tokens, dtype=np.int32),
        slot_mapping=rng.integers(0, 1 << 20, num_tokens, dtype=np.int32),
        query_start_loc=qsl, query_lens=np.full(num_seqs, query_len, np.int32),
        context_lens=np.full(num_seqs, context_len, np.int32),
        block_tables=rng.integers(0, 1 << 16, (num_seqs, max_blocks), dtype=np.int32),
        sample_mask=np.ones(num_seqs, bool), block_copies=np.zeros((0, 2), np.int32),
        swap_out=np.zeros((0, 2), np.int32), swap_in=np.zeros((0, 2), np.int32))


CASES = {"decode_1": (1, 1, DECODE_CONTEXT), "decode_32": (32, 1, DECODE_CONTEXT),
         "decode_256": (256, 1, DECODE_CONTEXT), "prefill_2048": (8, 256, 256)}


def worker(endpoint: str, rank: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
    sock.connect(endpoint)
    sock.send(b"hello")
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            break
        step = decode_step(frames)
        sock.send(step.block_tables[:1, :1].tobytes()[:1] or b".")
    sock.close(linger=0)
    ctx.term()


def measure(transport: str, num_workers: int, repeats: int) -> dict:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    tmpdir = tempfile.mkdtemp()
    router.bind("tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmpdir}/bcast")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=worker, args=(endpoint, r + 1)) for r in range(num_workers)]
    for p in procs:
        p.start()
    identities = [router.recv_multipart()[0] for _ in procs]
    results = {}
    try:
        for name, (num_seqs, query_len, context_len) in CASES.items():
            step = make_step(num_seqs, query_len, context_len)
            encode_s, send_s, round_trip_s = [], [], []
            for i in range(WARMUP + repeats):
                t0 = time.perf_counter()
                frames = encode_step(i + 1, step, ())
                t1 = time.perf_counter()
                for identity in identities:
                    router.send_multipart([identity, *frames], copy=False)
                t_sent = time.perf_counter()
                for _ in identities:
                    router.recv_multipart()
                t2 = time.perf_counter()
                if i >= WARMUP:
                    encode_s.append(t1 - t0)
                    send_s.append(t_sent - t0)
                    round_trip_s.append(t2 - t0)
            wire_bytes = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            results[name] = {"wire_bytes": wire_bytes,
                             "encode_us": 1e6 * statistics.median(encode_s),
                             "driver_us": 1e6 * statistics.median(send_s),
                             "round_trip_us": 1e6 * statistics.median(round_trip_s)}
    finally:
        for identity in identities:
            router.send_multipart([identity, b"stop"])
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        router.close(linger=0)
        ctx.term()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3, help="tp - 1 (rank 0 is the driver)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    report = {"workers": args.workers, "cpus": os.cpu_count(),
              "transports": {t: measure(t, args.workers, args.repeats) for t in ("tcp", "ipc")}}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"step broadcast to {args.workers} worker processes ({os.cpu_count()} CPUs), "
          f"median of {args.repeats}")
    print(f"{'case':<14}{'bytes':>10}{'encode us':>11}{'driver us':>11}{'tcp rt us':>11}"
          f"{'ipc rt us':>11}")
    tcp, ipc = report["transports"]["tcp"], report["transports"]["ipc"]
    for name in CASES:
        print(f"{name:<14}{tcp[name]['wire_bytes']:>10}{tcp[name]['encode_us']:>11.1f}"
              f"{tcp[name]['driver_us']:>11.1f}{tcp[name]['round_trip_us']:>11.1f}"
              f"{ipc[name]['round_trip_us']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
