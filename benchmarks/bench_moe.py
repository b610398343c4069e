"""One mixture-of-experts layer on the cpu backends: router GEMM, moe_route, moe_experts.

Mixtral-8x7B's layer shape by default (hidden 4096, expert intermediate 14336, 8 experts, top-2),
random float32 weights (5.6 GB; the bf16 backend packs another 2.8 GB), at 1 / 32 / 256 tokens.
Reports the median of REPEATS calls after one warm-up (the bf16 backend packs each expert's
weights on its first call), tokens/s and the GFLOP/s of the routed work (2 * top_k * 3 * hidden
* intermediate FLOPs per token; the router is negligible). --scale divides hidden and
intermediate (e.g. --scale 2 when memory is short). Usage:
    python benchmarks/bench_moe.py [--scale N] [--backends cpu,cpu-bf16] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from pagedrun.runtime.backends.cpu_bf16_backend import CpuBf16Backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model, median_seconds  # noqa: E402

MIXTRAL_HIDDEN = 4096
MIXTRAL_INTERMEDIATE = 14336
NUM_EXPERTS = 8
TOP_K = 2
TOKEN_COUNTS = (1, 32, 256)
REPEATS = 3


def moe_layer(ops, h, router, w_gate_up, w_down):
    """What runtime/models/moe.py's MoeBlock runs (router [E, H] in HF layout)."""
    logits = ops.linear(h, router, out_dtype=np.float32)
    ids, weights = ops.moe_route(logits, TOP_K, True)
    return ops.moe_experts(h, ids, weights, w_gate_up, w_down)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--backends", default="cpu,cpu-bf16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    hidden, inter = MIXTRAL_HIDDEN // args.scale, MIXTRAL_INTERMEDIATE // args.scale
    rng = np.random.default_rng(0)
    # float32 draws straight away: a float64 intermediate would double the peak memory.
    w_gate_up = rng.standard_normal((NUM_EXPERTS, 2 * inter, hidden), dtype=np.float32)
    w_gate_up *= np.float32(hidden ** -0.5)
    w_down = rng.standard_normal((NUM_EXPERTS, hidden, inter), dtype=np.float32)
    w_down *= np.float32(inter ** -0.5)
    router = rng.standard_normal((NUM_EXPERTS, hidden), dtype=np.float32)
    flops_per_token = 2 * TOP_K * 3 * hidden * inter
    backends = {"cpu": NumpyBackend, "cpu-bf16": CpuBf16Backend}
    rows = []
    for name in args.backends.split(","):
        ops = backends[name]()
        for num_tokens in TOKEN_COUNTS:
            h = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
            # One warm-up call (bf16: packs the experts).
            median = median_seconds(lambda: moe_layer(ops, h, router, w_gate_up, w_down),
                                    REPEATS, warmup=1)
            rows.append({"backend": name, "tokens": num_tokens, "median_s": median,
                         "tokens_per_s": num_tokens / median,
                         "gflop_per_s": flops_per_token * num_tokens / median / 1e9})
            print(f"{name:9s} {num_tokens:4d} tokens: {median * 1e3:9.1f} ms  "
                  f"{num_tokens / median:8.1f} tok/s  "
                  f"{flops_per_token * num_tokens / median / 1e9:6.1f} GFLOP/s", flush=True)
    if args.json:
        print(json.dumps({"machine": cpu_model(),
                          "hidden": hidden, "intermediate": inter, "experts": NUM_EXPERTS,
                          "top_k": TOP_K, "rows": rows}))


if __name__ == "__main__":
    main()
