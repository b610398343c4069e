"""The int8 cpu backend's GEMM, old against new, paired on the default model's shapes
(SmolLM2-135M: fused QKV 960x576, o 576x576, fused gate/up 3072x576, down 576x1536, LM head
49152x576): "group64" = cpu_gemm.gemm_int8 over PackedInt8Weight (int8 weights, a float32 scale
per 64, bf16 activations on float FMAs: the backend until issue 35) and "q8_0" = gemm_gguf over
the same weights quantized to Q8_0 blocks (runtime/backends/q8_0_blocks.py; int8 x int8 dots),
with the backend's activations ("auto", and "q8" for llama.cpp's single pass). The arms
alternate call by call (one round = each arm once, in rotating order), so a busy shared box
slows them alike; medians per call, speedup = group64 / q8_0 time, weight bytes streamed / time.

    scripts/python benchmarks/bench_int8_gemm.py [--repeats 40] [--m 1 8 32 64] [--path avx2]

--engine: the same arms end to end instead, as bench_engine.py's concurrency benchmark runs
them (its bench_concurrency: one LLM per arm, the arms interleaved per repeat, decode tok/s,
medians; prompt 32, 24 new tokens, --levels 1,8,32,64, --cpu-isa avx2): "int8 group64" (the
backend with every matrix in the old format) against "int8" (its Q8_0 GEMM) per activation mode.

    scripts/python benchmarks/bench_int8_gemm.py --engine [--repeats 3] [--modes q8 q8x2]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine (--engine)
from pagedrun.pyx import cpu_gemm  # noqa: E402
from pagedrun.runtime.backends.q8_0_blocks import quantize_q8_0  # noqa: E402

SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate/up", 3072, 576), ("down", 576, 1536),
          ("lm head", 49152, 576))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--path", default="avx2",
                        help="both GEMMs' path (cpu_gemm's bf16 and GGUF path names share it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES])
    parser.add_argument("--modes", nargs="+", default=["auto", "q8"])
    parser.add_argument("--engine", action="store_true",
                        help="engine tok/s per arm (bench_engine's concurrency benchmark)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64])
    args = parser.parse_args()
    if args.engine:
        return engine(args)
    print(f"cpu: {platform.processor() or platform.machine()}; path {args.path}; "
          f"threads {args.threads}; repeats {args.repeats} (alternating)")
    rng = np.random.default_rng(35)
    totals = {}
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        old = cpu_gemm.PackedInt8Weight(w)
        new = cpu_gemm.PackedGgufWeight(quantize_q8_0(w), "Q8_0", k)
        for m in args.m:
            x = rng.standard_normal((m, k)).astype(np.float32)
            arms = {"group64": lambda: cpu_gemm.gemm_int8(x, old, path=args.path,
                                                          threads=args.threads)}
            for mode in args.modes:
                arms[f"q8_0 {mode}"] = (lambda mode=mode: cpu_gemm.gemm_gguf(
                    x, new, path=args.path, threads=args.threads, activations=mode))
            times = {arm: [] for arm in arms}
            names = list(arms)
            for fn in arms.values():
                fn()  # warm
            for r in range(args.repeats):
                for i in range(len(names)):
                    arm = names[(r + i) % len(names)]
                    t0 = time.perf_counter()
                    arms[arm]()
                    times[arm].append(time.perf_counter() - t0)
            med = {arm: float(np.median(t)) for arm, t in times.items()}
            cells = []
            for arm in names:
                nbytes = old.nbytes if arm == "group64" else new.nbytes
                gb_s = nbytes / med[arm] / 1e9
                cells.append(f"{arm} {med[arm] * 1e6:8.1f} us ({gb_s:5.1f} GB/s)")
                totals.setdefault((m, arm), 0.0)
                totals[(m, arm)] += med[arm]
            ratio = "  ".join(f"x{med['group64'] / med[a]:.2f} {a}" for a in names[1:])
            resolved = cpu_gemm.gguf_activations_for(m, args.path, "auto")
            print(f"{name:8s} {n:5d}x{k:<5d} M {m:3d} (auto={resolved}): " + " | ".join(cells)
                  + f" || {ratio}")
    print("sum over the shapes (one of each: a layer's GEMMs + the head):")
    for m in args.m:
        base = totals[(m, "group64")]
        print(f"  M {m:3d}: " + "  ".join(
            f"{arm} {totals[(m, arm)] * 1e3:7.3f} ms (x{base / totals[(m, arm)]:.2f})"
            for (mm, arm) in totals if mm == m))


def engine(args) -> None:
    """bench_engine.bench_concurrency over int8 arms that differ in CpuInt8Backend's class
    attributes, set around each arm's LLM construction only (the backend reads them there)."""
    import bench_engine
    from pagedrun.runtime.backends.cpu_int8_backend import CpuInt8Backend

    int8 = {"dtype": "bfloat16", "quantization": "int8", "cpu_isa": args.path}
    arms = {"int8_group64": dict(int8, int8_backend={
        "weight_packing": staticmethod(cpu_gemm.PackedInt8Weight)})}
    for mode in args.modes:
        arms[f"int8_q8_0_{mode}"] = dict(int8, int8_backend={"default_activations": mode})
    plain_llm = bench_engine._llm

    def llm_with_backend_attributes(**kw):
        attributes = kw.pop("int8_backend", {})
        saved = {name: CpuInt8Backend.__dict__[name] for name in attributes}
        for name, value in attributes.items():
            setattr(CpuInt8Backend, name, value)
        try:
            return plain_llm(**kw)
        finally:
            for name, value in saved.items():
                setattr(CpuInt8Backend, name, value)

    bench_engine._llm = llm_with_backend_attributes
    bench_engine.CONC_ARMS.update(arms)
    result = bench_engine.bench_concurrency(tuple(arms), tuple(args.levels), args.repeats,
                                            prompt_tokens=32, new_tokens=24)
    print(f"cpu: {platform.processor() or platform.machine()}; --cpu-isa {args.path}; "
          f"decode tok/s, medians of {args.repeats} interleaved repeats")
    for num in args.levels:
        base = result[f"decode_tok_s_{num}_int8_group64"]
        print(f"  {num:3d} concurrent: " + "  ".join(
            f"{arm} {result[f'decode_tok_s_{num}_{arm}']:7.1f}"
            f" (x{result[f'decode_tok_s_{num}_{arm}'] / base:.2f})" for arm in arms))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
