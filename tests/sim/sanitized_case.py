"""Runs one planted-bug case in a child process that the sanitizer runtime was preloaded into
(see test_sanitizers.py and scripts/ci_sanitizers.sh). Usage: python sanitized_case.py CASE.
Prints CASE-COMPLETED if the launch finished; a sanitizer report aborts the process first."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pagedrun.runtime.kernels.sim_module import CUDA_DIR, SimModule

KERNELS = Path(__file__).resolve().parent / "kernels"
TILE = 64  # kTile in planted_bugs.cu


def main(case: str) -> None:
    mod = SimModule('#include "planted_bugs.cu"\n', include_dirs=(CUDA_DIR, KERNELS))
    rng = np.random.default_rng(0)
    if case in ("neighbour_missing_sync", "neighbour_synced"):
        x = rng.standard_normal(2 * TILE).astype(np.float32)
        mod.get_function(case)((2,), (TILE,), (x, np.empty_like(x)))
    elif case in ("shift_out_of_bounds", "shift_in_bounds"):
        n = 37
        x = rng.standard_normal(n).astype(np.float32)
        count = n if case == "shift_out_of_bounds" else n - 1
        mod.get_function("shift_out_of_bounds")((1,), (64,), (x, np.empty(n, np.float32),
                                                             np.int32(count)))
    elif case in ("load_float4_misaligned", "load_float4_aligned"):
        threads = 8
        x = rng.standard_normal(4 * threads + 4).astype(np.float32)
        offset = 1 if case == "load_float4_misaligned" else 0
        mod.get_function("load_float4_at")((1,), (threads,), (x, np.empty(threads, np.float32),
                                                              np.int32(offset)))
    elif case in ("smem_overflow", "smem_exact"):
        threads = 48
        x = rng.standard_normal(threads).astype(np.float32)
        nbytes = 4 * threads - (4 if case == "smem_overflow" else 0)
        mod.get_function("stage_dynamic_smem")((1,), (threads,), (x, np.empty_like(x)),
                                               shared_mem=nbytes)
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"{case}-COMPLETED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
