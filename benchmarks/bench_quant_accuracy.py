"""Accuracy of the weight formats on the default model (SmolLM2-135M-Instruct), cpu backend.

For each format: perplexity over benchmarks/data/quant_eval_text.txt (the engine's prompt
logprobs of every token of the text, one request) and greedy agreement with float32 over the
first --new-tokens tokens of a fixed prompt set (the share of positions before the first
divergence, and of prompts that agree all the way). The issue's targets (issue 16): int8
perplexity within 0.5% of bf16, int4 within 3%, bf16 weights with an fp8 (e4m3) KV cache within
1% of bf16 with its bf16 KV cache ("bfloat16" below: kv_cache_dtype auto). The fp8 cache uses
the per-tensor scale 1.0 (vLLM's default without calibrated k_scale / v_scale).

The text was written for this project (an original short story, 754 words) and is under the
repository's licence (Apache-2.0): a fixed, licence-clean text the model has not memorised.

    python benchmarks/bench_quant_accuracy.py [--json out.json] [--new-tokens 32]

The int4 arms are the default model's own weights quantized to int4 by
benchmarks/make_int4_checkpoint.py (no AWQ / GPTQ checkpoint of it ships, and AutoAWQ / AutoGPTQ
need torch): round to nearest in AutoAWQ's packing, and GPTQ (benchmarks/gptq.py, calibrated on
benchmarks/data/quant_calib_text.txt, another original text under the same licence) in GPTQ's.
Those weights are already Q4_1, so RTN measures re-rounding 4-bit weights onto an integer-zero
grid; GPTQ is what a user quantizing these weights with GPTQ would get (make_int4_checkpoint.py).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent / "data" / "quant_eval_text.txt"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_int4_checkpoint, bench_common
from bench_common import add_json_option, cpu_model, write_json  # noqa: E402
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe idea with rice and beans.",
    "Translate 'good morning' into Spanish and German.",
    "What does a compiler do?",
]
# name -> LLM keywords (cpu). float32 is the reference.
FORMATS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    # The int8 backend's other arithmetic (issue 35), set on CpuInt8Backend for the arm only:
    # each activation mode of its Q8_0 GEMM, and the weight-only format it had before (int8
    # weights, a float32 scale per 64, bf16 activations: cpu_gemm.PackedInt8Weight).
    "int8 q8x2": {"dtype": "bfloat16", "quantization": "int8",
                  "int8_backend": {"default_activations": "q8x2"}},
    "int8 q8": {"dtype": "bfloat16", "quantization": "int8",
                "int8_backend": {"default_activations": "q8"}},
    "int8 group64 (before)": {"dtype": "bfloat16", "quantization": "int8",
                              "int8_backend": {"weight_packing": "group64"}},
    "bf16 + fp8 KV": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"},
    # The model package's own file kept in its blocks: Q4_1 layers, Q8_0 embedding / LM head.
    "gguf Q4_1 (native)": {"quantization": "gguf"},
    # Int4 checkpoints of the same weights (benchmarks/make_int4_checkpoint.py), served int4:
    # round-to-nearest in AWQ's packing (quantization "awq"), GPTQ in GPTQ's ("gptq").
    "int4 RTN (awq, g64)": {"int4_checkpoint": (64, "rtn")},
    "int4 GPTQ (gptq, g64)": {"int4_checkpoint": (64, "gptq")},
    "int4 GPTQ (gptq, g32)": {"int4_checkpoint": (32, "gptq")},
    "int4 GPTQ act order (g32)": {"int4_checkpoint": (32, "gptq-act")},
}
NOT_BUILT = ()


def set_int8_backend(attributes: dict) -> dict:
    """Set class attributes of CpuInt8Backend (a FORMATS arm's "int8_backend"); returns what
    restores them. "weight_packing": "group64" is cpu_gemm.PackedInt8Weight for every matrix."""
    from pagedrun.pyx import cpu_gemm
    from pagedrun.runtime.backends.cpu_int8_backend import CpuInt8Backend

    restore = {}
    for name, value in attributes.items():
        restore[name] = CpuInt8Backend.__dict__[name]
        if value == "group64":
            value = staticmethod(cpu_gemm.PackedInt8Weight)
        setattr(CpuInt8Backend, name, value)
    return restore


def perplexity(llm, token_ids: list[int]) -> float:
    from pagedrun.runtime.sampling_params import SamplingParams

    out = llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0,
                                                   prompt_logprobs=0))[0]
    if out.prompt_logprobs is None:
        raise RuntimeError(f"the perplexity request failed: {out.error}")
    nll = [-entry[token].logprob for token, entry in zip(token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))


def greedy_tokens(llm, new_tokens: int) -> list[list[int]]:
    from pagedrun.runtime.sampling_params import SamplingParams

    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(messages, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                             ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(mean share of positions before the first divergence, share of prompts agreeing fully)."""
    prefix = []
    for got, want in zip(tokens, ref):
        same = 0
        while same < len(want) and same < len(got) and got[same] == want[same]:
            same += 1
        prefix.append(same / len(want))
    return sum(prefix) / len(prefix), sum(p == 1.0 for p in prefix) / len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_option(ap, bare_to_stdout=False)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--only", nargs="+", default=None, metavar="FORMAT",
                    help="run these formats (float32 and bfloat16 always run: the references)")
    args = ap.parse_args()
    from pagedrun import LLM

    results = {"cpu": cpu_model(), "text_words": len(TEXT.read_text().split()),
               "new_tokens": args.new_tokens, "formats": {}}
    ref_tokens = None
    scratch = tempfile.TemporaryDirectory(prefix="pagedrun-int4-")
    for name, kwargs in FORMATS.items():
        if args.only and name not in args.only and name not in ("float32", "bfloat16"):
            continue
        start = time.perf_counter()
        if "int4_checkpoint" in kwargs:
            from make_int4_checkpoint import make_checkpoint

            group, method = kwargs["int4_checkpoint"]
            checkpoint = Path(scratch.name) / f"{method}-g{group}"
            kwargs = {"model": str(make_checkpoint(checkpoint, group, method))}
        kwargs = dict(kwargs)
        restore = set_int8_backend(kwargs.pop("int8_backend", {}))
        llm = LLM(device="cpu", max_model_len=2048, **kwargs)
        set_int8_backend(restore)  # the backend read its class attributes at construction
        token_ids = llm.get_tokenizer().encode(TEXT.read_text())
        ppl = perplexity(llm, token_ids)
        tokens = greedy_tokens(llm, args.new_tokens)
        if ref_tokens is None:
            ref_tokens = tokens
        prefix, full = agreement(tokens, ref_tokens)
        results["formats"][name] = {"perplexity": ppl, "text_tokens": len(token_ids),
                                    "greedy_prefix_agreement": prefix,
                                    "greedy_full_agreement": full,
                                    "wall_s": time.perf_counter() - start}
        del llm
    base = results["formats"]["bfloat16"]["perplexity"]
    print(f"cpu: {results['cpu']}; text: {results['formats']['float32']['text_tokens']} tokens;"
          f" greedy: {len(PROMPTS)} prompts x {args.new_tokens} tokens vs float32")
    print(f"{'format':<22} {'perplexity':>10} {'vs bf16':>8} {'prefix agree':>13} "
          f"{'full agree':>11}")
    for name, r in results["formats"].items():
        print(f"{name:<22} {r['perplexity']:>10.4f} {100 * (r['perplexity'] / base - 1):>+7.2f}%"
              f" {100 * r['greedy_prefix_agreement']:>12.1f}% "
              f"{100 * r['greedy_full_agreement']:>10.1f}%")
    for name in NOT_BUILT:
        print(f"{name:<20} {'not built yet':>10}")
    write_json(results, args.json)


if __name__ == "__main__":
    main()
