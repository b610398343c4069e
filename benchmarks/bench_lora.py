"""Multi-LoRA benchmarks on the default model (SmolLM2-135M-Instruct), cpu backend (issue 18).

Subcommands (`all` runs both; `--json PATH` writes every number measured):
  throughput  output tokens/s at 32 concurrent requests (32-token prompts, 24 new tokens, greedy):
              base model only vs 8 distinct rank-16 adapters spread over the requests (4 each),
              on one engine with enable_lora=True, max_loras=8 (so every adapter has a slot),
              plus the base-only rate of an engine without LoRA (requests without an adapter
              must cost nothing extra). Runs interleaved, medians of `--repeats`. Target:
              adapters >= 0.8x base.
  ops         the LoRA ops' time per decode step on the numpy path (runtime/lora/lora_ops.py):
              the four targets of every layer for 32 rows over 8 adapter slots, next to the four
              base GEMMs of the same layers (what the LoRA rides on); medians.
Adapters are random PEFT directories (every q/k/v/o/gate/up/down projection, rank 16, alpha 16)
written on the default model's shapes into a temporary directory.

BLAS threads: `--blas-threads` (default 1), as benchmarks/bench_engine.py (a shared 2-core
machine gives stable numbers with one thread).

Usage: python benchmarks/bench_lora.py all --json /tmp/bench_lora.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    add_json_option,
    load_average,
    run_benches,
    set_blas_threads,
    write_json,
)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bench", choices=["all", "throughput", "ops"])
    add_json_option(parser, bare_to_stdout=False)
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (medians)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    set_blas_threads(ARGS.blas_threads)

import numpy as np  # noqa: E402  (after the thread setting)

from pagedrun.runtime.lora import LoRARequest  # noqa: E402
from pagedrun.runtime.sampling_params import SamplingParams  # noqa: E402

PROMPT_TOKENS = 32
NEW_TOKENS = 24
PEFT_GROUPS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(path: str, config, rank: int, seed: int) -> str:
    """A PEFT LoRA directory on `config`'s shapes: every projection, rank `rank`, alpha = rank,
    A ~ N(0, 1/in), B ~ N(0, 0.01): a small, realistic delta."""
    import safetensors.numpy

    rng = np.random.default_rng(seed)
    h, i, q, kv = (config.hidden_size, config.intermediate_size, config.q_size, config.kv_size)
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (out_f, in_f) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{PEFT_GROUPS[proj]}.{proj}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, in_f))
                                                / np.sqrt(in_f)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (0.01 * rng.standard_normal((out_f, rank))
                                                ).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                   "target_modules": list(shapes), "bias": "none"}, f)
    return path


def _adapters(config, directory: str, num: int, rank: int) -> list[LoRARequest]:
    return [LoRARequest(f"bench{k}", k + 1, write_random_adapter(
        os.path.join(directory, f"a{k}"), config, rank, seed=k)) for k in range(num)]


def _run(llm, prompts, loras) -> tuple[float, float]:
    """(output tok/s including prefill, decode-only tok/s) of one generate."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    wall = time.perf_counter() - start
    last_first = max(o.first_token_time for o in outs)
    end = max(o.finished_time for o in outs)
    num = len(prompts)
    return num * NEW_TOKENS / wall, num * (NEW_TOKENS - 1) / (end - last_first)


def bench_throughput(args) -> dict:
    from pagedrun.runtime.llm import LLM

    common = dict(device="cpu", dtype="float32", max_num_seqs=args.num_requests,
                  max_model_len=256, num_kv_blocks=1024, enable_prefix_caching=False)
    plain = LLM(**common)
    lora_llm = LLM(**common, enable_lora=True, max_loras=args.num_adapters,
                   max_lora_rank=args.rank, max_cpu_loras=args.num_adapters)
    config = lora_llm.engine.model_config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, PROMPT_TOKENS).tolist()
               for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        loras = _adapters(config, tmp, args.num_adapters, args.rank)
        for lora in loras:
            lora_llm.engine.add_lora(lora)
        spread = [loras[i % len(loras)] for i in range(args.num_requests)]
        runs = {"no_lora_engine_base": (plain, None), "lora_engine_base": (lora_llm, None),
                "lora_engine_adapters": (lora_llm, spread)}
        for llm, per in runs.values():   # warm-up: kernels' caches, BLAS, slot writes
            _run(llm, prompts[:4], None if per is None else per[:4])
        samples: dict[str, list] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (llm, per) in runs.items():
                samples[name].append(_run(llm, prompts, per))
    out = {name: {"tok_s": statistics.median(s[0] for s in runs_),
                  "decode_tok_s": statistics.median(s[1] for s in runs_)}
           for name, runs_ in samples.items()}
    base = out["lora_engine_base"]
    out["ratio_adapters_vs_base"] = out["lora_engine_adapters"]["tok_s"] / base["tok_s"]
    out["ratio_decode_adapters_vs_base"] = (out["lora_engine_adapters"]["decode_tok_s"]
                                            / base["decode_tok_s"])
    out["ratio_lora_engine_base_vs_no_lora"] = (base["tok_s"]
                                                / out["no_lora_engine_base"]["tok_s"])
    out.update(num_requests=args.num_requests, num_adapters=args.num_adapters, rank=args.rank,
               prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS, repeats=args.repeats)
    return out


def bench_ops(args) -> dict:
    from pagedrun.runtime.backends import numpy_ops
    from pagedrun.runtime.backends.numpy_backend import NumpyBackend
    from pagedrun.runtime.lora.lora_ops import LoRABatch, add_lora
    from pagedrun.runtime.lora.peft_loader import load_peft_adapter
    from pagedrun.runtime.lora.weight_stack import LoRAWeightStack
    from pagedrun.runtime.model_loader import load_model
    from pagedrun.runtime.models.llama import LlamaModel

    config, weights, _ = load_model(None, True)
    model = LlamaModel(config, weights, NumpyBackend(), max_position=256)
    stack = LoRAWeightStack(config, args.num_adapters, args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        for k, lora in enumerate(_adapters(config, tmp, args.num_adapters, args.rank)):
            stack.write_slot(k, load_peft_adapter(lora, config, args.rank))
    rows = args.num_requests
    batch = LoRABatch.from_token_slots(np.arange(rows) % args.num_adapters, args.num_adapters)
    rng = np.random.default_rng(1)
    h = rng.standard_normal((rows, config.hidden_size)).astype(np.float32)
    o_in = rng.standard_normal((rows, config.q_size)).astype(np.float32)
    act = rng.standard_normal((rows, config.intermediate_size)).astype(np.float32)
    inputs = {"qkv": h, "o": o_in, "gate_up": h, "down": act}

    def base_step():
        for layer in model.layers:
            numpy_ops.linear(h, layer.qkv)
            numpy_ops.linear(o_in, layer.o)
            numpy_ops.linear(h, layer.gate_up)
            numpy_ops.linear(act, layer.down)

    outs = {name: np.zeros((rows, stack.module(0, name)[1].shape[1]), np.float32)
            for name in inputs}

    def lora_step():
        for index in range(config.num_hidden_layers):
            for name, x in inputs.items():
                lora_a, lora_b, starts = stack.module(index, name)
                add_lora(outs[name], x, lora_a, lora_b, batch, starts)

    def median_ms(fn):
        fn()
        times = []
        for _ in range(max(5, 3 * args.repeats)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    base_ms, lora_ms = median_ms(base_step), median_ms(lora_step)
    return {"rows": rows, "num_adapters": args.num_adapters, "rank": args.rank,
            "layers": config.num_hidden_layers, "base_gemms_ms_per_step": base_ms,
            "lora_ops_ms_per_step": lora_ms, "lora_over_base_gemms": lora_ms / base_ms}


def main() -> int:
    args = ARGS
    names = ["throughput", "ops"] if args.bench == "all" else [args.bench]
    results = {"blas_threads": args.blas_threads, "load_average_at_start": load_average()}
    benches = {"throughput": lambda: bench_throughput(args), "ops": lambda: bench_ops(args)}
    run_benches(benches, names, results, echo=True)
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
