#!/usr/bin/env python3
"""GEMM benchmarks: tensor-core TFLOP/s against cupy.matmul (cuBLAS), skinny GB/s against copy.

    python benchmarks/kernels/bench_gemm.py --device cuda      # the tables on a GPU
    python benchmarks/kernels/bench_gemm.py --device sim       # toy sizes, CPU harness

Shapes are Llama-3-8B's linear layers (hidden 4096, 32/8 heads of 128, intermediate 14336,
vocab 128256), weights bf16 in the HF [out, in] layout as the cuda backend stores them.
Prefill (cuda/gemm.cu, split-K where the tile grid is under half the SMs): M = 128 .. 8192;
TFLOP/s = 2 M N K over the median time, next to cupy.matmul on the same arrays in the same run
(CuPy's matmul is the baseline only: it never runs on the serving path) and the ratio (the
mission's target: >= 1.0). On a compute capability 9.0 GPU (and on the CPU harness, at toy
sizes) a second column times the Hopper GEMM (cuda/gemm_hopper.cu: TMA, wgmma) on the same
arrays, the kernel gemm() takes there for these shapes; "ratio" is the better of the two.
Decode (cuda/gemm_skinny.cu with the split-K plan: CUDA cores below M = 8, tensor cores from
M = 8): M = 1 .. 64 rows; GB/s = weight + activation + output bytes over the median time, next
to the device-to-device copy bandwidth measured in the same run and the ratio (target: >= 0.85).
L2 is flushed between repeats.

Weight-only quantized decode (cuda/gemm_wq.cu, issue 16: W4A16 as AWQ / GPTQ checkpoints run
it, W8A16 as --quantization int8 makes it; groups of 128, bf16 activations): M = 1 / 8 / 16;
GB/s = the bytes the kernel must read and write (packed int4 or int8 weights, scales, zero
points, x, out) over the median time, next to copy and the ratio (issue 16's target for W4A16:
>= 0.8).

Each row also shows the static model's estimate ("model": docs/kernel_report.md's "est" for the
kernel that ran, the Hopper GEMM's after a slash), so a GPU run prints model and measurement side
by side.

On the CPU harness the same code runs at toy sizes, one repeat, and checks every result against
a float64 reference so the script cannot rot; its times measure the harness, not a GPU.
"""
from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

from pagedrun.runtime.kernels.gemm import gemm
from pagedrun.runtime.kernels.gemm_hopper import HOPPER_MIN_M, gemm_hopper
from pagedrun.runtime.kernels.gemm_plan import SKINNY, SKINNY_TC, plan_gemm
from pagedrun.runtime.kernels.gemm_wq import gemm_w4a16, gemm_w8a16, wq_num_splits, wq_tile_m
from pagedrun.runtime.kernels.kernel_args import from_bf16_bits, to_bf16_bits
from pagedrun.runtime.kernels.loader import load_module
from pagedrun.runtime.kernels.wq_pack import num_column_groups, pack_groups, pack_w4, pack_w8

from device_timing import (Timer, copy_bandwidth, model_estimate,  # this folder (device_timing)
                          random_bf16)

BF16_BYTES = 2
# (name, N, K) of Llama-3-8B's GEMMs.
GPU_LAYERS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
              ("down", 4096, 14336), ("lm_head", 128256, 4096))
# 128 rows: a 1-tile-high grid (32 tiles for N 4096), where the plan splits K.
GPU_PREFILL_M = (128, 512, 2048, 8192)
GPU_DECODE_M = (1, 8, 16, 32, 64)
SIM_LAYERS = (("qkv", 96, 64), ("down", 40, 160))
SIM_PREFILL_M = (70,)
SIM_DECODE_M = (1, 9)
GPU_WQ_DECODE_M = (1, 8, 16)
SIM_WQ_DECODE_M = (1, 9)
GPU_WQ_GROUP = 128
SIM_WQ_GROUP = 32
GPU_REPEATS = 20
SIM_TOLERANCE = 2e-2  # bf16 output rounding vs the float64 reference, relative to max |ref|


def _check(out, a, w, what: str) -> None:
    """Harness mode: the result against float64 on the same bf16 values."""
    ref = from_bf16_bits(a).astype(np.float64) @ from_bf16_bits(w).astype(np.float64).T
    err = np.abs(from_bf16_bits(out) - ref).max() / max(np.abs(ref).max(), 1e-30)
    if err > SIM_TOLERANCE:
        raise AssertionError(f"{what}: relative error {err:.3g} > {SIM_TOLERANCE}")


def bench(xp, device: str, timer: Timer, rng, module, m_values, layers, num_sms: int,
          baseline: bool, hopper: bool = False) -> list[tuple]:
    rows = []
    repeats = GPU_REPEATS if device == "cuda" else 1
    for name, N, K in layers:
        w = random_bf16(xp, rng, (N, K))
        for M in m_values:
            a = random_bf16(xp, rng, (M, K))
            out = xp.empty((M, N), dtype=np.uint16)
            plan = plan_gemm(M, N, K, dtype_name="bf16", b_layout="nk", num_sms=num_sms)
            seconds = timer(lambda: gemm(module, a, w, out=out, plan=plan), repeats)
            if device != "cuda":
                _check(out, a, w, f"{name} M={M}")
            wgmma = float("nan")
            if hopper and M >= HOPPER_MIN_M:
                wgmma = timer(lambda: gemm_hopper(module, a, w, out=out), repeats)
                if device != "cuda":
                    _check(out, a, w, f"{name} M={M} (Hopper GEMM)")
            cublas = float("nan")
            if baseline and device == "cuda":
                # cuBLAS on the same values: bf16 bits viewed as bfloat16 need a real dtype;
                # CuPy has none, so the baseline runs float16 of the same shape (same FLOPs).
                a16, w16 = a.view(np.float16), w.view(np.float16)
                cublas = timer(lambda: xp.matmul(a16, w16.T), repeats)
            rows.append((name, M, N, K, plan, seconds, wgmma, cublas))
    return rows


def _wq_operands(xp, rng, bits: int, N: int, K: int, group: int):
    """(weights tuple for gemm_w{4,8}a16, float64 reference W [N, K] or None). On a GPU the
    packed arrays are random bytes drawn there (timing only: the kernel tests check values); on
    the harness, random q / s / z packed on the host with their reference."""
    groups = K // group
    ng = num_column_groups(N)
    if xp is not np:
        words = 4 if bits == 4 else 8
        qweight = xp.random.randint(0, 256, size=K * ng * words * 4).astype(np.uint8)
        weights = (qweight.view(np.uint32).reshape(K // 32, ng, 32, words),
                   random_bf16(xp, rng, (groups, ng * 32)))
        if bits == 4:
            weights += (xp.random.randint(0, 16, size=(groups, ng * 32)).astype(np.uint8),)
        return weights, None
    s = from_bf16_bits(to_bf16_bits(rng.uniform(0.5, 1.5, (groups, N)).astype(np.float32) / 64))
    if bits == 4:
        q, z = rng.integers(0, 16, (N, K)), rng.integers(0, 16, (groups, N))
        weights = (pack_w4(q), pack_groups(to_bf16_bits(s)), pack_groups(z.astype(np.uint8)))
    else:
        q, z = rng.integers(-128, 128, (N, K)), np.zeros((groups, N))
        weights = (pack_w8(q), pack_groups(to_bf16_bits(s)))
    ref = np.repeat(s.astype(np.float64), group, axis=0).T * (q - np.repeat(z, group, axis=0).T)
    return weights, ref


def bench_wq(xp, device: str, timer: Timer, rng, module, m_values, layers, group: int,
             num_sms: int) -> list[tuple]:
    rows = []
    repeats = GPU_REPEATS if device == "cuda" else 1
    for bits in (4, 8):
        for name, N, K in layers:
            weights, ref = _wq_operands(xp, rng, bits, N, K, group)
            for M in m_values:
                a = random_bf16(xp, rng, (M, K))
                out = xp.empty((M, N), dtype=np.uint16)
                if bits == 4:
                    run = functools.partial(gemm_w4a16, module, a, *weights, n=N,
                                            group_size=group, out=out, num_sms=num_sms)
                else:
                    run = functools.partial(gemm_w8a16, module, a, *weights, n=N,
                                            group_size=group, out=out, num_sms=num_sms)
                seconds = timer(run, repeats)
                if ref is not None:
                    want = from_bf16_bits(a).astype(np.float64) @ ref.T
                    err = np.abs(from_bf16_bits(out) - want).max() / max(np.abs(want).max(), 1e-30)
                    if err > SIM_TOLERANCE:
                        raise AssertionError(f"W{bits}A16 {name} M={M}: relative error {err:.3g}")
                moved = sum(int(w.nbytes) for w in weights) + int(a.nbytes) + int(out.nbytes)
                splits = wq_num_splits(M, N, K, num_sms)
                rows.append((bits, name, M, N, K, splits, seconds, moved))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import cupy as xp

        num_sms = int(xp.cuda.Device().attributes["MultiProcessorCount"])
        where = xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    else:
        xp, num_sms, where = np, 4, "the CPU harness (times are not GPU times)"
    timer = Timer(args.device)
    rng = np.random.default_rng(0)
    gpu = args.device == "cuda"
    hopper = not gpu or int(xp.cuda.Device().compute_capability) == 90
    sources = ["gemm.cu", "gemm_skinny.cu"] + (["gemm_hopper.cu"] if hopper else [])
    module = load_module(sources, backend=args.device)
    print(f"# bench_gemm on {where}")
    copy_gbps = copy_bandwidth(xp, timer, GPU_REPEATS) / 1e9 if gpu else float("nan")
    print(f"# device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")

    print("\n## prefill (tensor core), bf16, weight [N, K]")
    print(f"{'layer':>8} {'M':>6} {'N':>7} {'K':>6} {'splits':>6} {'median ms':>10} "
          f"{'TFLOP/s':>8} {'Hopper':>8} {'cuBLAS':>8} {'ratio':>6} {'model':>18}")
    for name, M, N, K, plan, sec, wgmma, cublas in bench(
            xp, args.device, timer, rng, module, GPU_PREFILL_M if gpu else SIM_PREFILL_M,
            GPU_LAYERS if gpu else SIM_LAYERS, num_sms, baseline=True, hopper=hopper):
        tflops = 2 * M * N * K / sec / 1e12
        hopper_tflops = 2 * M * N * K / wgmma / 1e12
        base = 2 * M * N * K / cublas / 1e12
        best = np.nanmax([tflops, hopper_tflops])
        kernel = "gemm_bf16_nk_splitk" if plan.num_splits > 1 else "gemm_bf16_nk_obf16"
        model = model_estimate(kernel)
        if not np.isnan(wgmma):
            model += " / " + model_estimate("gemm_hopper_bf16_nk_obf16")
        print(f"{name:>8} {M:>6} {N:>7} {K:>6} {plan.num_splits:>6} {sec * 1e3:>10.3f} "
              f"{tflops:>8.2f} {hopper_tflops:>8.2f} {base:>8.2f} {best / base:>6.2f} "
              f"{model:>18}")

    print("\n## decode (skinny, split-K plan), bf16, weight [N, K]")
    print(f"{'layer':>8} {'M':>6} {'N':>7} {'K':>6} {'kernel':>11} {'splits':>6} "
          f"{'median us':>10} {'GB/s':>8} {'of copy':>8} {'model':>9}")
    for name, M, N, K, plan, sec, _, _ in bench(
            xp, args.device, timer, rng, module, GPU_DECODE_M if gpu else SIM_DECODE_M,
            GPU_LAYERS if gpu else SIM_LAYERS, num_sms, baseline=False):
        moved = (N * K + M * K + M * N) * BF16_BYTES
        gbps = moved / sec / 1e9
        kind = {SKINNY: f"skinny m{plan.m_tile}", SKINNY_TC: "skinny tc"}.get(plan.kind, "tensor")
        kernel = {SKINNY: f"gemm_skinny_bf16_obf16_m{plan.m_tile}",
                  SKINNY_TC: "gemm_skinny_tc_bf16_obf16"}.get(plan.kind, "gemm_bf16_nk_obf16")
        print(f"{name:>8} {M:>6} {N:>7} {K:>6} {kind:>11} {plan.num_splits:>6} "
              f"{sec * 1e6:>10.1f} {gbps:>8.1f} {gbps / copy_gbps:>8.2f} "
              f"{model_estimate(kernel):>9}")

    print(f"\n## decode, weight-only quantized (gemm_wq.cu), bf16 x, groups of "
          f"{GPU_WQ_GROUP if gpu else SIM_WQ_GROUP}")
    print(f"{'layer':>8} {'W':>3} {'M':>6} {'N':>7} {'K':>6} {'kernel':>22} {'splits':>6} "
          f"{'median us':>10} {'GB/s':>8} {'of copy':>8} {'model':>9}")
    wq_module = load_module("gemm_wq.cu", backend=args.device)
    for bits, name, M, N, K, splits, sec, moved in bench_wq(
            xp, args.device, timer, rng, wq_module, GPU_WQ_DECODE_M if gpu else SIM_WQ_DECODE_M,
            GPU_LAYERS if gpu else SIM_LAYERS, GPU_WQ_GROUP if gpu else SIM_WQ_GROUP, num_sms):
        gbps = moved / sec / 1e9
        kernel = f"gemm_w{bits}a16_bf16_m{wq_tile_m(M)}"
        print(f"{name:>8} {bits:>3} {M:>6} {N:>7} {K:>6} {kernel:>22} {splits:>6} "
              f"{sec * 1e6:>10.1f} {gbps:>8.1f} {gbps / copy_gbps:>8.2f} "
              f"{model_estimate(kernel):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
