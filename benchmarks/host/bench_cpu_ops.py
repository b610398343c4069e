"""The non-GEMM ops of one decode layer: numpy_ops (the float32 reference, what the bf16 cpu
backend ran before) against pagedrun.pyx.cpu_ops (what it runs now), per op, in microseconds.

The default model's shapes (SmolLM2-135M: hidden 576, 9 heads, 3 kv heads, head_dim 64,
intermediate 1536, 30 layers, block size 16) at 1, 8 and 32 decode rows with every sequence's
context at 64 and at 512 tokens (blocks scattered at random over the pool). Each cell is the
median of REPEATS calls after a warm-up; "layer" is the sum of one layer's calls (two fused norms,
rotary + cache write, decode attention, silu-and-mul) and "step" that times the layer count, the
non-GEMM time of a decode step. Usage:
    python benchmarks/host/bench_cpu_ops.py [--paths avx512,portable] [--json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from pagedrun.pyx import cpu_ops
from pagedrun.runtime.backends import numpy_ops

HIDDEN = 576
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = 64
INTERMEDIATE = 1536
NUM_LAYERS = 30
BLOCK_SIZE = 16
ROWS = (1, 8, 32)
CONTEXTS = (64, 512)
REPEATS = 200
EPS = 1e-5


def _median_us(fn, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return float(np.median(times)) / 1e3


def _inputs(rng, rows: int, context: int) -> dict:
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = rows * blocks_per_seq + 1
    qkv = rng.standard_normal((rows, q_size + 2 * kv_size)).astype(np.float32)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    tables = rng.permutation(num_blocks)[:rows * blocks_per_seq].reshape(rows, blocks_per_seq)
    # The decode token's slot: the last position of each sequence's context.
    slots = tables[:, (context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return dict(
        x=rng.standard_normal((rows, HIDDEN)).astype(np.float32),
        residual=rng.standard_normal((rows, HIDDEN)).astype(np.float32),
        weight=rng.standard_normal(HIDDEN).astype(np.float32),
        gate_up=rng.standard_normal((rows, 2 * INTERMEDIATE)).astype(np.float32),
        q=qkv[:, :q_size].reshape(rows, NUM_HEADS, HEAD_DIM),
        k=qkv[:, q_size:q_size + kv_size].reshape(rows, NUM_KV_HEADS, HEAD_DIM),
        v=qkv[:, q_size + kv_size:].reshape(rows, NUM_KV_HEADS, HEAD_DIM),
        positions=np.full(rows, context - 1, np.int32),
        cos_sin=numpy_ops.build_cos_sin_cache(numpy_ops.rope_inv_freq(HEAD_DIM, 10000.0), 2048),
        k_cache=rng.standard_normal(shape).astype(np.float32),
        v_cache=rng.standard_normal(shape).astype(np.float32),
        slots=slots.astype(np.int32),
        tables=tables.astype(np.int32),
        lens=np.full(rows, context, np.int32),
    )


def _ops(impl, a: dict, **path) -> dict:
    """One layer's non-GEMM calls on `impl` (numpy_ops or cpu_ops)."""
    scale = HEAD_DIM ** -0.5
    return {
        "fused_add_rms_norm": lambda: impl.fused_add_rms_norm(a["x"], a["residual"], a["weight"],
                                                              EPS, **path),
        "rotary_cache_write": lambda: impl.rotary_embedding_and_cache_write(
            a["q"], a["k"], a["v"], a["positions"], a["cos_sin"], a["k_cache"], a["v_cache"],
            a["slots"], **path),
        "decode_attention": lambda: impl.paged_decode_attention(
            a["q"], a["k_cache"], a["v_cache"], a["tables"], a["lens"], scale, **path),
        "silu_and_mul": lambda: impl.silu_and_mul(a["gate_up"], **path),
    }


# Calls per layer: the input and post-attention norms are both fused_add_rms_norm in decode.
CALLS_PER_LAYER = {"fused_add_rms_norm": 2, "rotary_cache_write": 1, "decode_attention": 1,
                   "silu_and_mul": 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", default=",".join(cpu_ops.available_paths()))
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    impls = [("numpy", numpy_ops, {})] + [(p, cpu_ops, {"path": p})
                                          for p in args.paths.split(",")]
    results = []
    for context in CONTEXTS:
        for rows in ROWS:
            a = _inputs(rng, rows, context)
            row = {"rows": rows, "context": context}
            for name, impl, path in impls:
                layer = 0.0
                for op, fn in _ops(impl, a, **path).items():
                    us = _median_us(fn)
                    row[f"{op}_{name}"] = us
                    layer += CALLS_PER_LAYER[op] * us
                row[f"layer_{name}"] = layer
                row[f"step_ms_{name}"] = layer * NUM_LAYERS / 1e3
            results.append(row)
    if args.json:
        print(json.dumps({"cpu": platform.processor() or platform.machine(),
                          "results": results}, indent=1))
        return 0
    names = [n for n, _, _ in impls]
    ops = list(CALLS_PER_LAYER) + ["layer"]
    print(f"per-call median us ({', '.join(names)}); step = layer x {NUM_LAYERS} layers, ms")
    header = f"{'ctx':>4} {'rows':>4} " + " ".join(f"{op:>26}" for op in ops) + f" {'step ms':>20}"
    print(header)
    for row in results:
        cells = [" / ".join(f"{row[f'{op}_{n}']:.1f}" for n in names) for op in ops]
        step = " / ".join(f"{row[f'step_ms_{n}']:.2f}" for n in names)
        print(f"{row['context']:>4} {row['rows']:>4} " + " ".join(f"{c:>26}" for c in cells)
              + f" {step:>20}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
