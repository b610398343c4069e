"""Whole-engine decode of two installs of paged-run (two commits, each in its own venv),
compared in tight pairs: each install's engines stay loaded in a worker process, and the
driver asks the two in turn for one short greedy generate (~0.5-1.5 s), alternating which goes
first. On a shared 2-core VM the rate drifts by 1.3-1.7x over minutes, so runs of a whole
benchmark a minute apart (bench_engine.py concurrency, one process per tree) could not tell a
4-12% difference from drift; pairs a second apart can.

    python benchmarks/ab_decode.py --python-a VENV_A/bin/python --python-b VENV_B/bin/python \
        --rounds 40 [--json out.json]

Each worker runs `python ab_decode.py --worker` from its own interpreter (the install under
test); this file needs only numpy and paged-run's public LLM API there. Prints, per case (arm,
sequences), both medians, the median of the paired b/a ratios, how often b was lower, and the
ratios' quartiles.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# (arm, concurrent sequences, new tokens): the default model's GGUF blocks and the bf16 backend.
CASES = (("default", 1, 48), ("bfloat16", 1, 48), ("default", 8, 32), ("bfloat16", 8, 32))
ARMS = {"default": {}, "bfloat16": {"dtype": "bfloat16"}}
PROMPT_TOKENS = 32


def worker() -> int:
    """Load both arms once; per stdin line "ARM NUM NEW", one greedy generate, print the
    decode-only tok/s (tokens after the first, over the time after the last first token)."""
    import numpy as np

    from pagedrun import LLM, SamplingParams

    llms = {arm: LLM(device="cpu", max_model_len=512, num_kv_blocks=512,
                     enable_prefix_caching=False, **kw) for arm, kw in ARMS.items()}
    vocab = llms["default"].engine.model_config.vocab_size
    rng = np.random.default_rng(4)
    prompts = {n: [rng.integers(3, vocab, PROMPT_TOKENS).tolist() for _ in range(n)]
               for n in sorted({c[1] for c in CASES})}
    for llm in llms.values():
        llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    print("ready", flush=True)
    for line in sys.stdin:
        arm, num, new = line.split()
        num, new = int(num), int(new)
        outs = llms[arm].generate(prompts[num], SamplingParams(temperature=0.0, max_tokens=new,
                                                               ignore_eos=True))
        last_first = max(o.first_token_time for o in outs)
        end = max(o.finished_time for o in outs)
        print(num * (new - 1) / (end - last_first), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--python-a", help="the interpreter of install a (the baseline)")
    ap.add_argument("--python-b", help="the interpreter of install b")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", help="write every pair's numbers here")
    args = ap.parse_args()
    if args.worker:
        return worker()
    if not (args.python_a and args.python_b):
        ap.error("--python-a and --python-b are required")
    here = os.path.abspath(__file__)
    # Outside any checkout, so each interpreter imports its own install.
    procs = {name: subprocess.Popen([py, here, "--worker"], cwd="/", stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
             for name, py in (("a", args.python_a), ("b", args.python_b))}
    for name, proc in procs.items():
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"worker {name} did not start")
    rates = {(case, name): [] for case in CASES for name in procs}
    for r in range(args.rounds):
        for case in CASES:
            for name in (("a", "b") if r % 2 == 0 else ("b", "a")):
                procs[name].stdin.write(" ".join(map(str, case)) + "\n")
                procs[name].stdin.flush()
                rates[(case, name)].append(float(procs[name].stdout.readline()))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    result = {}
    for case in CASES:
        a, b = rates[(case, "a")], rates[(case, "b")]
        ratios = [y / x for x, y in zip(a, b)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"{case[0]:9s} {case[1]:2d} seqs: a {statistics.median(a):7.1f}  "
              f"b {statistics.median(b):7.1f} tok/s  median b/a {statistics.median(ratios):.3f} "
              f"(b lower in {sum(x < 1 for x in ratios)}/{len(ratios)}; quartiles "
              f"{q1:.3f}-{q3:.3f})")
        result[f"{case[0]}_{case[1]}"] = {"a": a, "b": b}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
