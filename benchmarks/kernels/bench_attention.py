#!/usr/bin/env python3
"""Attention kernel benchmarks: decode GB/s against a measured copy, prefill TFLOP/s.

    python benchmarks/kernels/bench_attention.py --device cuda      # the table on a GPU
    python benchmarks/kernels/bench_attention.py --device sim       # tiny sizes, CPU harness

Decode (cuda/paged_attention_decode.cu, the split-K plan of runtime/kernels/attention.py):
Llama-3-8B attention shapes (8 kv heads, head_dim 128, bf16, block 16) at GQA groups 1, 4
(Llama-3-8B's 32 query heads) and 8, batch 1..256 x context 512..32k. Bytes moved = K and V
of every context token + q + out; GB/s is that over the median kernel time, printed next to
the device-to-device copy bandwidth measured in the same run (read + write bytes of a 1 GiB
copy) and the ratio of the two (the mission's target: >= 90% at contexts >= 2k). The KV
pool is capped at KV_POOL_BYTES: block tables draw random blocks from it (with repeats across
requests), so big batches fit while every read still misses the L2 (the pool is far larger
than any L2); L2 is flushed between repeats as well.

Prefill (cuda/paged_attention_prefill.cu): one request per row of the table, a chunk of
query_len tokens behind a cached prefix; FLOPs = 4 * num_heads * head_dim * (visible keys summed
over query rows), TFLOP/s over the median time, next to the tensor-core ceiling measured in the
same run (cuBLAS through cupy.matmul on a square fp16 GEMM).

Each row also shows the static model's estimate for the kernel it ran ("model": the "est" of
docs/kernel_report.md, % of HBM for decode, % of the dense bf16 peak for prefill), so a GPU run
prints model and measurement side by side.

On the CPU harness the same code runs at toy sizes, one repeat, and checks each result against
numpy_ops so the script cannot rot; its times measure the harness, not a GPU.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.attention import (decode_group_instantiation,
                                                decode_uses_tensor_cores, paged_decode_attention,
                                                paged_prefill_attention, plan_decode_split)
from pagedrun.runtime.kernels.kernel_args import from_bf16_bits
from pagedrun.runtime.kernels.loader import load_module

from device_timing import (Timer, copy_bandwidth, model_estimate,  # this folder (device_timing)
                          random_bf16)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B attention
GPU_DECODE_GROUPS = (1, 4, 8)  # query heads per kv head: MHA, Llama-3-8B, the widest kernel
SIM_DECODE_GROUPS = (2,)
BF16_BYTES = 2
GPU_BATCHES = (1, 4, 16, 64, 256)
GPU_CONTEXTS = (512, 2048, 8192, 32768)
GPU_PREFILL = ((512, 0), (2048, 0), (2048, 6144), (8192, 0))  # (query_len, cached prefix)
SIM_BATCHES = (1, 4)
SIM_CONTEXTS = (64, 200)
SIM_PREFILL = ((40, 0), (33, 70))
SIM_HEADS = (4, 2)  # (num_heads, num_kv_heads) at toy size
KV_POOL_BYTES = 8 << 30       # cap of the KV pool on a GPU (both K and V)
GPU_REPEATS = 20
CEILING_GEMM_DIM = 8192       # square fp16 GEMM whose cuBLAS rate is the prefill ceiling
SIM_TOLERANCE = 3e-2          # bf16 outputs vs the float32 reference


def matmul_tflops(xp, timer: Timer) -> float:
    """Tensor-core ceiling for prefill: cuBLAS (through cupy.matmul) on a square fp16 GEMM."""
    a = xp.ones((CEILING_GEMM_DIM, CEILING_GEMM_DIM), dtype=np.float16)
    b = xp.ones_like(a)
    out = xp.empty_like(a)
    seconds = timer(lambda: xp.matmul(a, b, out=out), GPU_REPEATS)
    return 2 * CEILING_GEMM_DIM ** 3 / seconds / 1e12


def _paged_pool(xp, rng, num_blocks_needed: int, pool_cap_blocks: int, num_kv_heads: int,
                head_dim: int):
    num_blocks = max(1, min(num_blocks_needed, pool_cap_blocks))
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    return random_bf16(xp, rng, shape), random_bf16(xp, rng, shape), num_blocks


def _host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def bench_decode(xp, device: str, timer: Timer, rng, modules) -> list[str]:
    batches, contexts = (GPU_BATCHES, GPU_CONTEXTS) if device == "cuda" else (SIM_BATCHES,
                                                                             SIM_CONTEXTS)
    num_kv_heads = NUM_KV_HEADS if device == "cuda" else SIM_HEADS[1]
    groups = GPU_DECODE_GROUPS if device == "cuda" else SIM_DECODE_GROUPS
    pool_cap_blocks = KV_POOL_BYTES // (2 * BLOCK_SIZE * num_kv_heads * HEAD_DIM * BF16_BYTES)
    rows = []
    for group, context_len, num_seqs in ((g, c, b) for g in groups for c in contexts
                                         for b in batches):
        num_heads = group * num_kv_heads
        blocks_per_seq = -(-context_len // BLOCK_SIZE)
        k, v, num_blocks = _paged_pool(xp, rng, num_seqs * blocks_per_seq, pool_cap_blocks,
                                       num_kv_heads, HEAD_DIM)
        block_tables = rng.integers(0, num_blocks, (num_seqs, blocks_per_seq)).astype(np.int32)
        context_lens = np.full(num_seqs, context_len, np.int32)
        q = random_bf16(xp, rng, (num_seqs, num_heads, HEAD_DIM))
        d = [xp.asarray(a) for a in (q, k, v, block_tables, context_lens)]
        out = xp.empty_like(d[0])
        num_sms = None if device == "cuda" else 4
        scale = HEAD_DIM ** -0.5

        def run():
            paged_decode_attention(modules["decode"], d[0], d[1], d[2], d[3], d[4], scale,
                                   out, max_context_len=context_len, num_sms=num_sms)

        seconds = timer(run, GPU_REPEATS)
        plan = plan_decode_split(num_seqs, num_kv_heads, context_len,
                                 num_sms or int(xp.cuda.Device().attributes[
                                     "MultiProcessorCount"]))
        kv_bytes = 2 * num_seqs * context_len * num_kv_heads * HEAD_DIM * BF16_BYTES
        io_bytes = 2 * num_seqs * num_heads * HEAD_DIM * BF16_BYTES
        gbps = (kv_bytes + io_bytes) / seconds / 1e9
        if device != "cuda":
            expected = numpy_ops.paged_decode_attention(
                from_bf16_bits(_host(q)), from_bf16_bits(_host(k)), from_bf16_bits(_host(v)),
                block_tables, context_lens, scale)
            err = float(np.abs(from_bf16_bits(np.asarray(out)) - expected).max())
            if err > SIM_TOLERANCE:
                raise SystemExit(f"decode batch {num_seqs} context {context_len}: "
                                 f"max error {err:.3g} vs numpy_ops")
        rows.append((group, num_seqs, context_len, plan.num_splits, seconds * 1e6, gbps))
    return rows


def bench_prefill(xp, device: str, timer: Timer, rng, modules) -> list[tuple]:
    shapes = GPU_PREFILL if device == "cuda" else SIM_PREFILL
    num_heads, num_kv_heads = (NUM_HEADS, NUM_KV_HEADS) if device == "cuda" else SIM_HEADS
    rows = []
    for query_len, prefix in shapes:
        context_len = prefix + query_len
        blocks = -(-context_len // BLOCK_SIZE)
        k, v, num_blocks = _paged_pool(xp, rng, blocks, blocks, num_kv_heads, HEAD_DIM)
        block_tables = rng.permutation(num_blocks)[None, :blocks].astype(np.int32)
        query_start_loc = np.array([0, query_len], np.int32)
        context_lens = np.array([context_len], np.int32)
        q = random_bf16(xp, rng, (query_len, num_heads, HEAD_DIM))
        d = [xp.asarray(a) for a in (q, k, v, block_tables, query_start_loc, context_lens)]
        out = xp.empty_like(d[0])
        scale = HEAD_DIM ** -0.5

        def run():
            paged_prefill_attention(modules["prefill"], d[0], d[1], d[2], d[3], d[4], d[5],
                                    scale, out, max_query_len=query_len)

        seconds = timer(run, GPU_REPEATS)
        visible_keys = sum(prefix + j + 1 for j in range(query_len))
        flops = 4 * num_heads * HEAD_DIM * visible_keys
        if device != "cuda":
            expected = numpy_ops.paged_prefill_attention(
                from_bf16_bits(_host(q)), from_bf16_bits(_host(k)), from_bf16_bits(_host(v)),
                block_tables,
                query_start_loc, context_lens, scale)
            err = float(np.abs(from_bf16_bits(np.asarray(out)) - expected).max())
            if err > SIM_TOLERANCE:
                raise SystemExit(f"prefill {query_len} behind {prefix}: max error {err:.3g}")
        rows.append((query_len, prefix, seconds * 1e3, flops / seconds / 1e12))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    rng = np.random.default_rng(0)
    timer = Timer(args.device)
    modules = {"decode": load_module("paged_attention_decode.cu", backend=args.device),
               "prefill": load_module("paged_attention_prefill.cu", backend=args.device)}
    where = "CPU harness (times are the harness's, not a GPU's)" if args.device == "sim" else \
        xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# bench_attention on {where}")
    copy_gbps = (copy_bandwidth(xp, timer, GPU_REPEATS) / 1e9 if args.device == "cuda"
                 else float("nan"))
    print(f"# device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    print("\n## decode, bf16, head_dim 128, block 16")
    print(f"{'group':>5} {'batch':>6} {'context':>8} {'splits':>6} {'median us':>10} "
          f"{'GB/s':>8} {'% copy':>7} {'model':>9}")
    for group, num_seqs, context_len, splits, micros, gbps in bench_decode(xp, args.device, timer,
                                                                           rng, modules):
        kind = "tc_" if decode_uses_tensor_cores("bf16", decode_group_instantiation(group)) else ""
        model = model_estimate(f"paged_attention_decode_{kind}bf16_d{HEAD_DIM}_g{group}")
        print(f"{group:>5} {num_seqs:>6} {context_len:>8} {splits:>6} {micros:>10.1f} "
              f"{gbps:>8.1f} {100 * gbps / copy_gbps:>6.1f}% {model:>9}")
    ceiling = matmul_tflops(xp, timer) if args.device == "cuda" else float("nan")
    print(f"\n## prefill, bf16, head_dim 128, block 16, one request "
          f"(ceiling: cuBLAS fp16 {CEILING_GEMM_DIM}^3 GEMM {ceiling:.0f} TFLOP/s)")
    print(f"{'query':>6} {'prefix':>7} {'median ms':>10} {'TFLOP/s':>8} {'% gemm':>7} "
          f"{'model':>9}")
    model = model_estimate(f"paged_attention_prefill_bf16_d{HEAD_DIM}")
    for query_len, prefix, millis, tflops in bench_prefill(xp, args.device, timer, rng, modules):
        print(f"{query_len:>6} {prefix:>7} {millis:>10.3f} {tflops:>8.2f} "
              f"{100 * tflops / ceiling:>6.1f}% {model:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
