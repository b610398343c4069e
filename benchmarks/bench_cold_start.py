"""Cold start of `paged-run generate` with the converted-model cache warm, and GGUF conversion.

Time to first token: wall time from spawning `paged-run generate PROMPT` to the first byte of
generated text on its stdout (interpreter start, imports, cache verification, tokenizer, weight
load, chat template, prefill, first decode step). The target is under 3 s.
Conversion: `paged-run convert` of the default model's GGUF into a temporary directory.

Reports medians and the machine's load average next to them: on a shared machine a busy
neighbour slows every number, so compare runs made under similar load.

    python benchmarks/bench_cold_start.py [--repeats 5] [--convert]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "What is the capital of France?"
MAX_TOKENS = 16


def time_to_first_token(extra_args: list[str]) -> tuple[float, float, str]:
    """(seconds to first stdout byte, seconds to exit, text) of one `paged-run generate`."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedrun", "generate", PROMPT, "--max-tokens", str(MAX_TOKENS),
         *extra_args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    first = process.stdout.read(1)
    first_s = time.perf_counter() - started
    rest = process.stdout.read()
    process.wait()
    return first_s, time.perf_counter() - started, (first + rest).decode()


def conversion_seconds() -> float:
    from pagedrun.runtime.default_model import default_gguf_path

    with tempfile.TemporaryDirectory() as out_dir:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pagedrun", "convert", str(default_gguf_path()),
                        out_dir, "--quiet"], check=True, capture_output=True)
        return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--convert", action="store_true", help="also time a full GGUF conversion")
    args = parser.parse_args()

    _, _, text = time_to_first_token([])   # warms the model cache (converts on a fresh machine)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    # Interleaved so both settings see the same neighbours.
    settings = {"default BLAS threads": [], "--threads 1": ["--threads", "1"]}
    runs: dict[str, list] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, extra in settings.items():
            runs[name].append(time_to_first_token(extra))
    for name, results in runs.items():
        first = [r[0] for r in results]
        total = [r[1] for r in results]
        print(f"{name}: time to first token median {statistics.median(first):.2f} s "
              f"(min {min(first):.2f}, max {max(first):.2f}; target < 3 s); "
              f"whole run ({MAX_TOKENS} tokens max) median {statistics.median(total):.2f} s")
    print(f"output: {text.strip()!r}")
    if args.convert:
        print(f"conversion of the default GGUF: {conversion_seconds():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
