"""The two devices of KernelBackend (runtime/backends/kernel_backend.py), one constructor each:

    backend = sim_backend("bfloat16")                # KernelBackend(HarnessRuntime(), ...)
    backend = cuda_backend("bfloat16", device_id=0)  # KernelBackend(CupyRuntime(0), ...)

sim: the cuda backend's code with every kernel executed on CPU threads by the harness
(cuda/sim), on numpy arrays. cuda: the model's ops on a GPU, CuPy arrays, cuda/*.cu through
cupy.RawModule, no torch, no cuBLAS on the hot path (CuPy's matmul is only the benchmarks'
baseline). Everything but runtime/backends/cupy_runtime.py is the sim device's code, executed
in CI. Importing this module never imports cupy; calling cuda_backend does.
"""
from __future__ import annotations

from .cuda_probe import cuda_available
from .harness_runtime import HarnessRuntime
from .kernel_backend import KernelBackend


class CudaNotAvailableError(RuntimeError):
    """CuPy is missing or sees no GPU."""


def sim_backend(dtype_name: str = "float32", *, kv_cache_dtype: str = "auto",
                quantization: str | None = None) -> KernelBackend:
    """A KernelBackend on a fresh harness runtime (KernelBackend's arguments)."""
    return KernelBackend(HarnessRuntime(), dtype_name, kv_cache_dtype=kv_cache_dtype,
                         quantization=quantization)


def cuda_backend(dtype_name: str = "bfloat16", device_id: int = 0, *,
                 kv_cache_dtype: str = "auto", quantization: str | None = None) -> KernelBackend:
    """A KernelBackend on a CupyRuntime of GPU `device_id` (KernelBackend's arguments)."""
    if not cuda_available():
        raise CudaNotAvailableError("the cuda backend needs CuPy and a visible GPU "
                                    "(pip install cupy-cuda12x; check nvidia-smi)")
    from .cupy_runtime import CupyRuntime

    return KernelBackend(CupyRuntime(device_id), dtype_name, kv_cache_dtype=kv_cache_dtype,
                         quantization=quantization)
