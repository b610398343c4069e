"""CPU cost of one n-gram proposal pass (runtime/spec_decode/ngram_proposer.py) per step.

Cases: batch B in 1, 32, 256 requests, each with L tokens of history (prompt + output) in
512, 4096, 16384; prompt_lookup 2..4, k = 4. Histories are copy-heavy (a random passage of 50k
ids, then a copy of part of it, so the lookup finds long matches) -- the cost does not depend on
the matches found: every pass compares each candidate position once per n (<= 4 passes over
B x L tokens). Median of REPEATS calls; tokens/us = B x L / time. Usage:
    python benchmarks/bench_ngram_proposer.py [--json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from pagedrun.runtime.spec_decode.ngram_proposer import NgramProposer

BATCH_SIZES = (1, 32, 256)
HISTORY_LENGTHS = (512, 4096, 16384)
VOCAB = 50_000
REPEATS = 7


def histories(batch: int, length: int, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for _ in range(batch):
        passage = rng.integers(0, VOCAB, size=length * 2 // 3)
        copied = passage[: length - passage.size]
        out.append(np.concatenate([passage, copied]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4, num_speculative_tokens=4)
    rows = []
    for batch in BATCH_SIZES:
        for length in HISTORY_LENGTHS:
            seqs = histories(batch, length, rng)
            times = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                proposals = proposer.propose(seqs)
                times.append(time.perf_counter() - start)
            median_s = float(np.median(times))
            rows.append({"batch": batch, "history_len": length, "median_ms": median_s * 1e3,
                         "tokens_per_us": batch * length / median_s / 1e6,
                         "mean_proposed": float(np.mean([len(p) for p in proposals]))})
    if args.json:
        print(json.dumps({"cpu": platform.processor() or platform.machine(), "rows": rows}))
        return
    print(f"n-gram proposer, {platform.machine()}: median of {REPEATS}")
    print(f"{'batch':>6} {'history':>8} {'ms':>9} {'tokens/us':>10} {'proposed':>9}")
    for r in rows:
        print(f"{r['batch']:>6} {r['history_len']:>8} {r['median_ms']:>9.3f} "
              f"{r['tokens_per_us']:>10.1f} {r['mean_proposed']:>9.2f}")


if __name__ == "__main__":
    main()
