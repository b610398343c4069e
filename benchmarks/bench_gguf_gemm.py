"""The GGUF-block cpu GEMM (pagedrun.pyx.cpu_gemm.gemm_gguf) against the bf16 one (gemm_bf16
over the same weights dequantized) on the default model's (SmolLM2-135M GGUF) shapes: median
time per call on 2 threads and GB/s of weight bytes streamed (packed nbytes / time); speedup =
bf16 time / gguf time ("q8x2": gemm_gguf's residual-pass activations, the accurate mode;
"unpack-bf16": activations "bf16", each weight tile unpacked to a bf16 panel for the bf16
GEMM's micro-kernel, where its speedup is against the same bf16 GEMM; "auto": what the backend
runs, q8x2 below cpu_gemm.BF16_MIN_ROWS rows and unpack-bf16 from there on CPUs without AMX).
K-quant rows (Q4_K, Q5_K, Q6_K: K a multiple of 256, so the 576-wide inputs cannot be one) use a
3072x1536 matrix (a 1.7B-class FFN shape) next to Q4_1 on the same shape; gguf has no numpy
K-quantizer, so their blocks are random bytes with weight-like fp16 super-scales.

On a CPU with AMX-INT8, "auto" is the GGUF "amx" path (TDPBSUD from 8 kernel rows): the
"avx512vnni" arm is then timed too (q8 and q8x2), and the bf16 reference is AMX's bf16 kernel
(plus its vector "avx512bf16" arm).

    scripts/python benchmarks/bench_gguf_gemm.py [--repeats 30] [--m 1 8 32 64]
        [--types Q4_1 Q4_K Q6_K] [--shapes default]  (default: the default model's matrices only)
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants

from pagedrun.pyx import cpu_gemm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_model, median_seconds  # noqa: E402

# (name, ggml type, N, K): q/o 576x576, gate/up fused 3072x576, down 576x1536, tied LM head.
SHAPES = (
    ("attn q/o", "Q4_1", 576, 576),
    ("gate/up fused", "Q4_1", 3072, 576),
    ("down", "Q4_1", 576, 1536),
    ("lm head", "Q8_0", 49152, 576),
    ("3072x1536", "Q4_1", 3072, 1536),
    ("3072x1536", "Q4_K", 3072, 1536),
    ("down", "Q4_K", 576, 1536),
    ("3072x1536", "Q6_K", 3072, 1536),
    ("down", "Q6_K", 576, 1536),
    ("3072x1536", "Q5_K", 3072, 1536),
    ("down", "Q5_0", 576, 1536),
)
DEFAULT_MODEL_SHAPES = tuple((name, ggml_type) for name, ggml_type, _, _ in SHAPES[:4])
# Bytes per 256-weight super-block in the file: the scale bytes' offsets and sizes differ.
K_FILE_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q5_K": 176}


def k_quant_raw(rng, ggml_type: str, n: int, k: int) -> np.ndarray:
    """Random [n, k] K-quant blocks: random bytes, fp16 super-scales in [1e-3, 2e-2)."""
    sb = k // 256
    raw = rng.integers(0, 256, (n, sb, K_FILE_BYTES[ggml_type]), dtype=np.uint8)
    scale = rng.uniform(1e-3, 2e-2, (n, sb, 2)).astype(np.float16).view(np.uint8)
    if ggml_type in ("Q4_K", "Q5_K"):
        raw[:, :, 0:4] = scale  # d, dmin
    else:
        raw[:, :, 208:210] = scale[:, :, :2]  # d
    return raw.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--types", nargs="+", default=list(cpu_gemm.GGUF_NATIVE_TYPES))
    parser.add_argument("--shapes", choices=("all", "default"), default="all",
                        help="default: only the default model's own matrices (Q4_1, Q8_0 head)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    amx = cpu_gemm.available_paths()[0] == "amx"
    amx_int8 = cpu_gemm.has_amx_int8()
    unpack = cpu_gemm.has_gguf_bf16()
    print(f"cpu: {cpu_model()}; gguf paths {cpu_gemm.available_gguf_paths()}, "
          f"bf16 paths {cpu_gemm.available_paths()}; 2 threads, median of {args.repeats}")
    print(f"{'shape':>14} {'type':>5} {'N':>6} {'K':>5} {'M':>3} | {'gguf us':>8} {'GB/s':>6} | "
          f"{'bf16 us':>8} {'GB/s':>6} | {'gguf/bf16 GB/s':>14} {'speedup':>7} | "
          f"{'q8x2 us':>8} {'speedup':>7}"
          + (f" | {'unpack-bf16 us':>14} {'speedup':>7} {'auto':>11}" if unpack else "")
          + (f" | {'avx512bf16 us':>8} {'speedup':>7}" if amx else "")
          + (f" | {'vnni us':>8} {'speedup':>7} {'vnni q8x2':>9} {'speedup':>7}"
             if amx_int8 else ""))
    for name, ggml_type, n, k in SHAPES:
        if ggml_type not in args.types or (args.shapes == "default"
                                           and (name, ggml_type) not in DEFAULT_MODEL_SHAPES):
            continue
        if ggml_type in K_FILE_BYTES:
            raw = k_quant_raw(rng, ggml_type, n, k)
        else:
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
            if unpack:
                tu = median_seconds(lambda: cpu_gemm.gemm_gguf(x, packed, threads=2,
                                                               activations="bf16"), args.repeats)
                line += (f" | {tu * 1e6:>14.1f} {tb / tu:>6.2f}x "
                         f"{cpu_gemm.gguf_activations_for(m):>11}")
            if amx:  # auto is AMX from 8 rows: the vector bf16 kernel too (CPUs without AMX)
                tv = median_seconds(lambda: cpu_gemm.gemm_bf16(x, bf16, threads=2,
                                                               path="avx512bf16"), args.repeats)
                line += f" | {tv * 1e6:>8.1f} {tv / tg:>6.2f}x"
            if amx_int8:  # auto is the AMX-INT8 kernel from 8 kernel rows: its vector twin
                tn = median_seconds(lambda: cpu_gemm.gemm_gguf(x, packed, threads=2,
                                                               path="avx512vnni"), args.repeats)
                tn2 = median_seconds(lambda: cpu_gemm.gemm_gguf(
                    x, packed, threads=2, path="avx512vnni", activations="q8x2"), args.repeats)
                line += (f" | {tn * 1e6:>8.1f} {tb / tn:>6.2f}x {tn2 * 1e6:>9.1f} "
                         f"{tb / tn2:>6.2f}x")
            print(line)


if __name__ == "__main__":
    main()
