"""The plain-Python baseline (benchmarks/) and the Cython scheduler make the same decisions.

This keeps the benchmark's speedup honest (like is compared with like) and gives the Cython
code a second, independently written implementation to disagree with: same rows, tokens,
positions, slots, block tables, copies, preemptions and finishes at every step.
"""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scheduler.py"


def _load_bench():
    name = "pagedrun_tests_bench_scheduler"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


FIELDS = ("req_ids", "input_token_ids", "positions", "slot_mapping", "query_start_loc",
          "context_lens", "num_computed_tokens_before", "block_tables", "sample_mask",
          "block_copies", "preempted_ids", "new_req_ids", "num_prefix_cached_tokens")


@pytest.mark.parametrize("seed", [0, 1])
def test_python_baseline_matches_cython_step_by_step(seed, monkeypatch):
    bench = _load_bench()
    # A smaller pool than the benchmark's so preemption and eviction happen often.
    monkeypatch.setattr(bench, "MIXED_NUM_BLOCKS", 700)
    monkeypatch.setattr(bench, "MIXED_BUDGET", 512)
    trace = bench.make_mixed_trace(seed, num_steps=120, arrivals_per_step=1.5)
    recorded = {"cython": [], "python": []}
    for impl in recorded:
        bench.run_mixed(impl, trace, lambda step, out, fin, impl=impl: recorded[impl].append(
            ({f: np.asarray(getattr(out, f)).copy() for f in FIELDS}, list(fin))))
    num_preempted = num_hit_tokens = 0
    steps = zip(recorded["cython"], recorded["python"])
    for step, ((cy, cy_fin), (py, py_fin)) in enumerate(steps):
        for f in FIELDS:
            assert cy[f].shape == py[f].shape and np.array_equal(cy[f], py[f]), (step, f)
        assert cy_fin == py_fin, step
        num_preempted += len(cy["preempted_ids"])
        num_hit_tokens += int(cy["num_prefix_cached_tokens"].sum())
    assert num_preempted > 0 and num_hit_tokens > 0  # the trace exercised both
