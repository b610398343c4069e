"""Costs of the CPU execution harness (cuda/sim/): a __syncthreads at 32/128/256 threads, a
256^3 bf16 tiled GEMM (ldmatrix + mma + cp.async), a paged-attention decode of 8 sequences x 4
heads x 256 tokens; plain, and with --modes asan,tsan under each sanitizer (child processes with
the runtime preloaded). Medians of REPEATS runs, after one warm-up run.

    python benchmarks/sim/bench_harness.py [--modes plain,asan,tsan]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
PROBES = REPO / "tests" / "sim" / "kernels"
REPEATS = 5
BARRIER_ROUNDS = (10, 410)


def median_time(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure() -> dict[str, float]:
    from pagedrun.runtime.kernels import load_module
    from pagedrun.runtime.kernels.attention import paged_decode_attention
    from pagedrun.runtime.kernels.sim_module import CUDA_DIR, SimModule

    smoke = SimModule('#include "smoke.cu"\n', include_dirs=(CUDA_DIR, PROBES))
    probes = SimModule('#include "twin_probes.cu"\n', include_dirs=(CUDA_DIR, PROBES))
    out: dict[str, float] = {}
    barrier = smoke.get_function("barrier_rounds")
    for threads in (32, 128, 256):
        y = np.zeros(threads, np.float32)
        lo, hi = (median_time(lambda r=r: barrier(1, threads, (y, np.int32(r))))
                  for r in BARRIER_ROUNDS)
        out[f"syncthreads_us_{threads}"] = (hi - lo) / (BARRIER_ROUNDS[1] - BARRIER_ROUNDS[0]) * 1e6

    rng = np.random.default_rng(0)
    n = 256
    a = (rng.standard_normal((n, n)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    b = (rng.standard_normal((n, n)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    c = np.zeros((n, n), np.float32)
    gemm = probes.get_function("tiled_gemm_bf16")
    out["gemm256_ms"] = 1e3 * median_time(
        lambda: gemm((n // 64, n // 64), 128, (a, b, c, np.int32(n), np.int32(n), np.int32(n))))

    seqs, heads, tokens, head_dim, block_size = 8, 4, 256, 128, 16
    blocks_per_seq = tokens // block_size
    num_blocks = seqs * blocks_per_seq
    q = rng.standard_normal((seqs, heads, head_dim)).astype(np.float16)
    k = rng.standard_normal((num_blocks, block_size, heads, head_dim)).astype(np.float16)
    v = rng.standard_normal((num_blocks, block_size, heads, head_dim)).astype(np.float16)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, blocks_per_seq)
    lens = np.full(seqs, tokens, np.int32)
    decode = load_module("paged_attention_decode.cu", backend="sim")
    out["decode_8x4x256_ms"] = 1e3 * median_time(
        lambda: paged_decode_attention(decode, q, k, v, tables, lens, head_dim ** -0.5))
    return out


def run_child(mode: str) -> dict[str, float]:
    if mode == "plain":
        return measure()
    lib = subprocess.run(["g++", f"-print-file-name=lib{mode}.so"], capture_output=True,
                         text=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0",
               TSAN_OPTIONS="report_signal_unsafe=0")
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="plain")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    results = {mode: run_child(mode) for mode in args.modes.split(",")}
    keys = list(next(iter(results.values())))
    print(f"{'metric':24}" + "".join(f"{m:>12}" for m in results))
    for key in keys:
        print(f"{key:24}" + "".join(f"{results[m][key]:12.2f}" for m in results))
    if "plain" in results:
        for mode in results:
            if mode != "plain":
                ratios = [results[mode][k] / results["plain"][k] for k in keys]
                print(f"{mode} / plain: {min(ratios):.1f}x .. {max(ratios):.1f}x")


if __name__ == "__main__":
    main()
