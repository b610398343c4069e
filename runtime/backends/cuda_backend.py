"""CudaBackend: the model's ops on a GPU -- CuPy arrays, cuda/*.cu through cupy.RawModule, no
torch, no cuBLAS on the hot path (CuPy's matmul is only the benchmarks' baseline).

The ops are KernelBackend's (runtime/backends/sim_backend.py), the very code the sim backend
runs under the CPU harness; only the array module and the module loader differ. This module
adds what only a GPU has: the device check, the stream every launch goes to, and the KV budget
from `gpu_memory_utilization`:

    budget = utilization x total device memory - weights - peak of a dummy max-size step

(`kv_cache_budget_bytes`; the engine turns it into blocks and logs the capacity in tokens).
Importing this module never imports cupy; constructing a CudaBackend does.
"""
from __future__ import annotations

import logging

from .sim_backend import KernelBackend

log = logging.getLogger("pagedrun.cuda")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- no driver / no device: CuPy raises its runtime error
        return False


class CudaNotAvailableError(RuntimeError):
    """CuPy is missing or sees no GPU."""


class CudaBackend(KernelBackend):
    name = "cuda"
    loader_backend = "cuda"

    def __init__(self, dtype_name: str = "bfloat16", device_id: int = 0) -> None:
        if not cuda_available():
            raise CudaNotAvailableError("the cuda backend needs CuPy and a visible GPU "
                                        "(pip install cupy-cuda12x; check nvidia-smi)")
        import cupy

        super().__init__(dtype_name, cupy)
        self.device_id = device_id
        cupy.cuda.Device(device_id).use()
        # One non-default stream for the step: launches queue behind each other without the
        # legacy default stream's implicit syncs with other host threads' work.
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        free, total = self.xp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def pool_used_bytes(self) -> int:
        return int(self.xp.get_default_memory_pool().used_bytes())

    def kv_cache_budget_bytes(self, gpu_memory_utilization: float, run_dummy_step) -> int:
        """Bytes left for KV blocks: utilization x total, minus what the process holds after
        loading weights, minus the activation peak of `run_dummy_step()` (a callable running
        one maximum-size step on a minimal KV pool)."""
        pool = self.xp.get_default_memory_pool()
        _, total = self.memory_info()
        self.stream.synchronize()
        weights_bytes = pool.used_bytes()
        before = pool.total_bytes()
        run_dummy_step()
        self.stream.synchronize()
        peak_bytes = max(pool.total_bytes() - before, 0)
        budget = int(gpu_memory_utilization * total) - weights_bytes - peak_bytes
        log.info("GPU memory: %.2f GiB total, utilization %.2f, weights %.2f GiB, step peak "
                 "%.2f GiB -> KV budget %.2f GiB", total / 2**30, gpu_memory_utilization,
                 weights_bytes / 2**30, peak_bytes / 2**30, max(budget, 0) / 2**30)
        return max(budget, 0)
