"""What the kernel benchmarks in this folder share: the median device timer (L2 flushed between
repeats), the device-to-device copy bandwidth that bandwidth-bound kernels are compared with,
random bf16 inputs made where they live, and the static model's estimate per kernel
(docs/kernel_report.md), printed next to each measured row.

Not a script. The bench_*.py scripts import it as `device_timing`: running a script puts this
folder on sys.path; tests that load a script by path prepend the folder themselves.
"""
from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import numpy as np

from pagedrun.runtime.kernels.kernel_args import to_bf16_bits

REPORT = Path(__file__).resolve().parents[2] / "docs" / "kernel_report.md"
COPY_BYTES = 1 << 30          # bytes of the device-to-device copy that measures the ceiling
L2_FLUSH_BYTES = 256 << 20    # larger than any current L2 (H100 50 MB, H200 60 MB)


class Timer:
    """Median device time of fn() in seconds; flushes L2 between repeats on a GPU.

    device "cuda": one warm-up call (module load, first touch), then `repeats` calls timed
    with CUDA events. Any other device (the CPU harness): one call, host wall time."""

    def __init__(self, device: str):
        self.device = device
        if device == "cuda":
            import cupy

            self.cupy = cupy
            self.flush_buf = cupy.empty(L2_FLUSH_BYTES, dtype=np.uint8)

    def __call__(self, fn, repeats: int) -> float:
        if self.device != "cuda":
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        cupy = self.cupy
        fn()  # warm-up: module load (NVRTC or cache), first touch
        times = []
        for _ in range(repeats):
            self.flush_buf.fill(1)
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(begin, end) * 1e-3)
        return statistics.median(times)


def copy_bandwidth(xp, timer: Timer, repeats: int) -> float:
    """Bytes per second of a COPY_BYTES device-to-device copy, read + write counted."""
    src = xp.ones(COPY_BYTES, dtype=np.uint8)
    dst = xp.empty_like(src)
    seconds = timer(lambda: dst.__setitem__(Ellipsis, src), repeats)
    return 2 * COPY_BYTES / seconds


def random_bf16(xp, rng: np.random.Generator, shape: tuple[int, ...]):
    """Standard-normal bf16 bits (uint16, `shape`) made where they live: numpy from `rng`;
    on a GPU drawn by CuPy, so multi-GiB pools and weights are never built on the host."""
    if xp is np:
        return to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))
    values = xp.random.standard_normal(shape, dtype=np.float32)
    # Truncation (not round-to-nearest): fine for timing.
    return (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


@functools.lru_cache(maxsize=None)
def _model_estimates() -> dict[str, str]:
    """kernel name -> the "est" cell of docs/kernel_report.md (e.g. "100% HBM", "65% TC")."""
    estimates = {}
    if REPORT.is_file():
        for line in REPORT.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) > 2 and cells[0] != "kernel" \
                    and not cells[0].startswith("-"):
                estimates[cells[0]] = cells[-1]
    return estimates


def model_estimate(kernel: str) -> str:
    """The static model's estimate for `kernel` (scripts/kernel_report.py: a model of the sm_90a
    build on H200 constants, not a measurement), to print beside the measured number."""
    return _model_estimates().get(kernel, "n/a")
