"""benchmarks/kernels/bench_gemm.py must keep running: its CPU-harness mode (toy sizes, each
result, the weight-only quantized decode rows included, checked against a float64 reference)
runs here, so the GPU table cannot rot unnoticed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_gemm.py"


def test_bench_gemm_runs_on_the_harness(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))  # the script imports device_timing from there
    spec = importlib.util.spec_from_file_location("bench_gemm", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "sim"]) == 0
    table = capsys.readouterr().out
    assert "## prefill" in table and "## decode" in table and "## decode, weight-only" in table
    rows = [line for line in table.splitlines() if line.split()[:1] in (["qkv"], ["down"])]
    wq_rows = 2 * len(bench.SIM_LAYERS) * len(bench.SIM_WQ_DECODE_M)   # W4 and W8
    assert len(rows) == len(bench.SIM_LAYERS) * (len(bench.SIM_PREFILL_M) +
                                                 len(bench.SIM_DECODE_M)) + wq_rows
    assert sum("skinny" in line for line in rows) == len(bench.SIM_LAYERS) * len(bench.SIM_DECODE_M)
    # M = 1 runs the 8-token register-only decode kernel, M = 9 the 16-token one
    for kernel in ("w4a16_bf16_m8", "w4a16_bf16_m16", "w8a16_bf16_m8", "w8a16_bf16_m16"):
        assert sum(f"gemm_{kernel} " in line for line in rows) == len(bench.SIM_LAYERS), kernel
