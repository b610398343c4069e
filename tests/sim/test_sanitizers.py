"""Planted bugs only a sanitizer can see, each run in a child process with the sanitizer
runtime preloaded (sanitized_case.py); SimModule builds the matching instrumented module.
ASan+UBSan: out-of-bounds global read, misaligned float4 load, dynamic shared memory
overflow. TSan: a missing __syncthreads. Each bug's correct sibling must run clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASE_SCRIPT = Path(__file__).resolve().parent / "sanitized_case.py"
CHILD_TIMEOUT_S = 240


def _runtime(name: str) -> str | None:
    out = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def run_case(case: str, sanitizer: str) -> subprocess.CompletedProcess:
    lib = _runtime("libasan.so" if sanitizer == "asan" else "libtsan.so")
    if lib is None:
        pytest.skip(f"g++ has no {sanitizer} runtime")
    env = dict(os.environ, LD_PRELOAD=lib,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
               TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0")
    # sys.executable is the real interpreter: a preloaded TSan crashes shell-script shims.
    return subprocess.run([sys.executable, str(CASE_SCRIPT), case], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


@pytest.mark.parametrize("case, sanitizer, report", [
    ("shift_out_of_bounds", "asan", "AddressSanitizer: heap-buffer-overflow"),
    ("load_float4_misaligned", "asan", "misaligned address"),
    ("smem_overflow", "asan", "AddressSanitizer: use-after-poison"),
    ("neighbour_missing_sync", "tsan", "ThreadSanitizer: data race"),
])
def test_sanitizer_catches_planted_bug(case, sanitizer, report):
    proc = run_case(case, sanitizer)
    assert report in proc.stderr, proc.stderr[-3000:]
    assert "planted_bugs.cu:" in proc.stderr  # the report points at the kernel line
    assert f"{case}-COMPLETED" not in proc.stdout


@pytest.mark.parametrize("case, sanitizer", [
    ("shift_in_bounds", "asan"), ("load_float4_aligned", "asan"), ("smem_exact", "asan"),
    ("neighbour_synced", "tsan"),
])
def test_correct_sibling_runs_clean_under_sanitizer(case, sanitizer):
    proc = run_case(case, sanitizer)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{case}-COMPLETED" in proc.stdout
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr
