"""The tail the benchmark scripts in this folder share: the BLAS thread count set before numpy
loads, the machine they ran on (CPU model, the cpu kernels' ISA path, load average), a median
wall-clock timer, a loop that runs the chosen benches and records each one's wall time, and the
`--json` option with the writer behind it.

Not a script. The bench_*.py scripts here put this folder on sys.path and import it as
`bench_common`. The kernel scripts in benchmarks/kernels/ share device_timing.py there (device
timers, copy bandwidth) instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

# Imports nothing heavy (no numpy): scripts call set_blas_threads before numpy loads.

# `--json` given without a PATH: the JSON goes to stdout (and the table, if any, elsewhere).
JSON_TO_STDOUT = "-"


BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def set_blas_threads(num_threads: int) -> None:
    """Pin numpy's BLAS pool; BLAS reads these once, when numpy is first imported."""
    for var in BLAS_THREAD_VARS:
        os.environ[var] = str(num_threads)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the line every result is labeled with."""
    from pagedrun.runtime.cpu_isa import cpu_name

    return cpu_name()


def cpu_kernels(isa: str = "auto") -> str:
    """One line naming the CPU, its ISA level, the cap and the path each compiled cpu kernel
    runs: a number from a cpu engine means nothing without it."""
    from pagedrun.runtime import cpu_isa

    return cpu_isa.describe(isa)


def load_average() -> float:
    """The 1-minute load average: on a shared machine a busy neighbour inflates every time."""
    return os.getloadavg()[0]


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median host wall time of fn() over `repeats` calls, after `warmup` untimed calls (first
    touch, packing on first use, thread start)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))


def add_json_option(parser: argparse.ArgumentParser, *, bare_to_stdout: bool,
                    help: str = "write the results to PATH") -> None:
    """`--json PATH`; with bare_to_stdout, a bare `--json` means JSON only, on stdout."""
    if bare_to_stdout:
        parser.add_argument("--json", nargs="?", const=JSON_TO_STDOUT, default=None,
                            metavar="PATH",
                            help=f"{help} (bare --json: JSON only, on stdout)")
    else:
        parser.add_argument("--json", default=None, metavar="PATH", help=help)


def write_json(results: dict, path: str | None, indent: int = 1) -> None:
    """Write `results` to `path` (JSON_TO_STDOUT: to stdout, newline-terminated); None: no-op."""
    if path is None:
        return
    if path == JSON_TO_STDOUT:
        print(json.dumps(results, indent=indent), flush=True)
        return
    with open(path, "w") as f:
        json.dump(results, f, indent=indent)


def run_benches(benches: dict[str, Callable[[], dict]], names: list[str], results: dict,
                echo: bool) -> dict:
    """Run benches[name]() for each name into results[name], adding its `bench_wall_s`; with
    echo, print each result as JSON when it ends (a long run shows progress and loses nothing
    if interrupted). Returns `results`."""
    for name in names:
        start = time.perf_counter()
        results[name] = benches[name]()
        results[name]["bench_wall_s"] = time.perf_counter() - start
        if echo:
            print(json.dumps({name: results[name]}, indent=1), flush=True)
    return results
