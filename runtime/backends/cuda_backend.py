"""CudaBackend: the model's ops on a GPU -- CuPy arrays, cuda/*.cu through cupy.RawModule, no
torch, no cuBLAS on the hot path (CuPy's matmul is only the benchmarks' baseline).

The ops are KernelBackend's (runtime/backends/sim_backend.py), the very code the sim backend
runs under the CPU harness; only the array module and the module loader differ. This module
adds what only a GPU has: the device check, the stream every launch goes to, and the KV budget
from `gpu_memory_utilization`:

    budget = utilization x total - memory in use before - weights - peak of a max-size step

(`CudaBackend.measure_kv_budget` runs the dummy step, `kv_cache_budget_bytes` is the
arithmetic; the engine turns the budget into blocks and logs the capacity in tokens).
Importing this module never imports cupy; constructing a CudaBackend does.
"""
from __future__ import annotations

import logging

import numpy as np

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

    def measure_kv_budget(self, model_config, weights, *, block_size: int,
                          max_num_batched_tokens: int, max_model_len: int,
                          gpu_memory_utilization: float) -> int:
        """KV bytes for the engine: run one maximum-size prefill (max_num_batched_tokens tokens,
        one request) on a minimal KV pool, measure weights and the activation peak, release
        everything (the runner places weights again on first use), and return
        kv_cache_budget_bytes(...) of what was measured."""
        from pagedrun.runtime.model_runner import build_attention_inputs
        from pagedrun.runtime.models.llama import LlamaModel

        xp = self.xp
        pool = xp.get_default_memory_pool()
        pool.free_all_blocks()
        free_before, total = self.memory_info()
        reserved_before = pool.total_bytes()
        num_tokens = max(1, min(max_num_batched_tokens, max_model_len))
        num_blocks = -(-num_tokens // block_size)
        shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        k_caches = [self.zeros(shape, self.kv_dtype) for _ in range(model_config.num_hidden_layers)]
        v_caches = [self.zeros(shape, self.kv_dtype) for _ in range(model_config.num_hidden_layers)]
        dummy_kv_bytes = sum(c.nbytes for c in k_caches + v_caches)
        model = LlamaModel(model_config, weights, self, max_position=max_model_len)
        positions = np.arange(num_tokens, dtype=np.int32)
        qsl = np.array([0, num_tokens], dtype=np.int32)
        attn = build_attention_inputs(qsl, np.array([num_tokens], np.int32),
                                      np.array([num_tokens], np.int32),
                                      np.arange(num_blocks, dtype=np.int32)[None, :])
        x, residual = model.forward(np.zeros(num_tokens, np.int32), positions, positions, attn,
                                    k_caches, v_caches)
        self.to_host(model.logits(x[-1:], residual[-1:]))
        self.stream.synchronize()
        weights_bytes = sum(int(dev.nbytes) for _, dev in self._weights.values())
        step_bytes = pool.total_bytes() - reserved_before
        activation_peak = max(0, step_bytes - weights_bytes - dummy_kv_bytes)
        del x, residual, k_caches, v_caches, model
        self._weights.clear()
        pool.free_all_blocks()
        return kv_cache_budget_bytes(total, total - free_before, weights_bytes, activation_peak,
                                     gpu_memory_utilization)


def kv_cache_budget_bytes(total_bytes: int, used_before_bytes: int, weights_bytes: int,
                          activation_peak_bytes: int, gpu_memory_utilization: float) -> int:
    """utilization x total, minus what was in use before the engine (CUDA context, other
    processes), the weights and the activation peak of a maximum-size step; never negative."""
    budget = (int(gpu_memory_utilization * total_bytes) - used_before_bytes - weights_bytes
              - activation_peak_bytes)
    log.info("GPU memory: %.2f GiB total, utilization %.2f, in use before %.2f GiB, weights "
             "%.2f GiB, step peak %.2f GiB -> KV budget %.2f GiB", total_bytes / 2**30,
             gpu_memory_utilization, used_before_bytes / 2**30, weights_bytes / 2**30,
             activation_peak_bytes / 2**30, max(budget, 0) / 2**30)
    return max(budget, 0)
