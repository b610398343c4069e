"""The sim device: KernelBackend over the harness runtime -- the cuda backend's code, every
kernel executed on CPU threads by the harness (cuda/sim), on numpy arrays.

    backend = sim_backend("bfloat16")   # = KernelBackend(HarnessRuntime(), "bfloat16")
"""
from __future__ import annotations

from .harness_runtime import HarnessRuntime
from .kernel_backend import KernelBackend


def sim_backend(dtype_name: str = "float32", *, kv_cache_dtype: str = "auto",
                quantization: str | None = None) -> KernelBackend:
    """A KernelBackend on a fresh harness runtime (KernelBackend's arguments)."""
    return KernelBackend(HarnessRuntime(), dtype_name, kv_cache_dtype=kv_cache_dtype,
                         quantization=quantization)
