"""benchmarks/kernels/bench_attention.py must keep running: its CPU-harness mode (toy sizes,
each result checked against numpy_ops) runs here, so the GPU table cannot rot unnoticed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_attention.py"


def test_bench_attention_runs_on_the_harness(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))  # the script imports device_timing from there
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "sim"]) == 0
    table = capsys.readouterr().out
    assert "## decode" in table and "## prefill" in table
    # One row per (context, batch) and per prefill shape.
    rows = [line for line in table.splitlines() if line[:1] == " " and line.split()[0].isdigit()]
    assert len(rows) == len(bench.SIM_BATCHES) * len(bench.SIM_CONTEXTS) + len(bench.SIM_PREFILL)
