"""The GGUF-block cpu GEMM (pagedrun.pyx.cpu_gemm.gemm_gguf) against the bf16 one (gemm_bf16
over the same weights dequantized) on the default model's (SmolLM2-135M GGUF) shapes: median
time per call on 2 threads and GB/s of weight bytes streamed (packed nbytes / time); speedup =
bf16 time / gguf time ("q8x2": gemm_gguf's residual-pass activations, the accurate mode).

    scripts/python benchmarks/bench_gguf_gemm.py [--repeats 30] [--m 1 8 32 64]
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants

from pagedrun.pyx import cpu_gemm

# (name, ggml type, N, K): q/o 576x576, gate/up fused 3072x576, down 576x1536, tied LM head.
SHAPES = (
    ("attn q/o", "Q4_1", 576, 576),
    ("gate/up fused", "Q4_1", 3072, 576),
    ("down", "Q4_1", 576, 1536),
    ("lm head", "Q8_0", 49152, 576),
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch, the helper thread's start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    amx = cpu_gemm.available_paths()[0] == "amx"
    print(f"cpu: {cpu_model()}; gguf paths {cpu_gemm.available_gguf_paths()}, "
          f"bf16 paths {cpu_gemm.available_paths()}; 2 threads, median of {args.repeats}")
    print(f"{'shape':>14} {'type':>5} {'N':>6} {'K':>5} {'M':>3} | {'gguf us':>8} {'GB/s':>6} | "
          f"{'bf16 us':>8} {'GB/s':>6} | {'gguf/bf16 GB/s':>14} {'speedup':>7} | "
          f"{'q8x2 us':>8} {'speedup':>7}"
          + (f" | {'avx512bf16 us':>8} {'speedup':>7}" if amx else ""))
    for name, ggml_type, n, k in SHAPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = quants.quantize(w, getattr(GGMLQuantizationType, ggml_type))
        packed = cpu_gemm.PackedGgufWeight(raw, ggml_type, k)
        bf16 = cpu_gemm.PackedWeight(packed.dequantize())
        for m in args.m:
            x = rng.standard_normal((m, k)).astype(np.float32)
            tg = median_seconds(lambda: cpu_gemm.gemm_gguf(x, packed, threads=2), args.repeats)
            tb = median_seconds(lambda: cpu_gemm.gemm_bf16(x, bf16, threads=2), args.repeats)
            t2 = median_seconds(lambda: cpu_gemm.gemm_gguf(x, packed, threads=2,
                                                           activations="q8x2"), args.repeats)
            gg, gb = packed.nbytes / tg / 1e9, bf16.nbytes / tb / 1e9
            line = (f"{name:>14} {ggml_type:>5} {n:>6} {k:>5} {m:>3} | "
                    f"{tg * 1e6:>8.1f} {gg:>6.1f} | {tb * 1e6:>8.1f} {gb:>6.1f} | "
                    f"{gg / gb:>13.0%} {tb / tg:>6.2f}x | {t2 * 1e6:>8.1f} {tb / t2:>6.2f}x")
            if amx:  # auto is AMX from 8 rows: the vector bf16 kernel too (CPUs without AMX)
                tv = median_seconds(lambda: cpu_gemm.gemm_bf16(x, bf16, threads=2,
                                                               path="avx512bf16"), args.repeats)
                line += f" | {tv * 1e6:>8.1f} {tv / tg:>6.2f}x"
            print(line)


if __name__ == "__main__":
    main()
