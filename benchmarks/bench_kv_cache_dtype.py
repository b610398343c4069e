"""KV cache dtype on the cpu bf16 backend: decode tokens/s with kv_cache_dtype float32 vs
bfloat16 vs fp8 (e4m3 bits, scale 1.0), in one run, interleaved, medians of --repeats.

    python benchmarks/bench_kv_cache_dtype.py [--num 32] [--prompt-len 512] [--new 32] [--json]

The default model, --dtype bfloat16, NUM sequences of PROMPT_LEN random tokens, NEW greedy
tokens each (ignore_eos), prefix caching off. Decode tok/s = NUM * (NEW - 1) over the time from
the last request's first token to the last finish (prefill excluded). Also reports bytes per
block and how many of 4 x 16 greedy tokens of each cache agree with the float32 cache's.
"""
from __future__ import annotations

import argparse
import json
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # the bf16 GEMMs thread themselves; numpy stays single

import numpy as np  # noqa: E402

from pagedrun import LLM  # noqa: E402
from pagedrun.runtime.sampling_params import SamplingParams  # noqa: E402

KV_DTYPES = ("float32", "bfloat16", "fp8")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    max_len = args.prompt_len + args.new + 16
    blocks = args.num * (-(-max_len // 16)) + 16
    llms = {kv: LLM(device="cpu", dtype="bfloat16", kv_cache_dtype=kv, max_model_len=max_len,
                    num_kv_blocks=blocks, enable_prefix_caching=False) for kv in KV_DTYPES}
    vocab = llms["float32"].engine.model_config.vocab_size
    rng = np.random.default_rng(4)
    for llm in llms.values():  # warm-up
        llm.generate([rng.integers(3, vocab, 8).tolist()], greedy(2))
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.num)]
    runs: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    for _ in range(args.repeats):
        for kv, llm in llms.items():
            outs = llm.generate(prompts, greedy(args.new))
            last_first = max(o.first_token_time for o in outs)
            end = max(o.finished_time for o in outs)
            runs[kv].append(args.num * (args.new - 1) / (end - last_first))
    tokens = {kv: [o.outputs[0].token_ids for o in llm.generate(prompts[:4], greedy(16))]
              for kv, llm in llms.items()}
    agree = {kv: sum(a == b for x, y in zip(tokens["float32"], tokens[kv]) for a, b in zip(x, y))
             for kv in KV_DTYPES}
    results = {kv: {"decode_tok_s_median": float(np.median(runs[kv])), "runs": runs[kv],
                    "bytes_per_block": llms[kv].engine.bytes_per_block,
                    "greedy_agree_with_float32_of_64": agree[kv]} for kv in KV_DTYPES}
    results["args"] = vars(args)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{args.num} seqs x {args.prompt_len}-token prompts, {args.new} new tokens, "
          f"decode tok/s (medians of {args.repeats})")
    for kv in KV_DTYPES:
        r = results[kv]
        print(f"  kv {kv:>8}: {r['decode_tok_s_median']:7.1f}  runs "
              f"{' '.join(f'{v:.1f}' for v in r['runs'])}  bytes/block {r['bytes_per_block']}"
              f"  greedy = float32's: {agree[kv]} of 64")
    tok_s = {kv: results[kv]["decode_tok_s_median"] for kv in KV_DTYPES}
    print(f"  bfloat16 / float32: {tok_s['bfloat16'] / tok_s['float32']:.2f}x; "
          f"fp8 / bfloat16: {tok_s['fp8'] / tok_s['bfloat16']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
