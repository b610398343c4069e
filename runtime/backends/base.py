"""The backend seam: the ops the model forward calls, as one object per device, and the factory.

    backend = make_backend("sim", dtype="auto")     # NumpyBackend | SimBackend | CudaBackend
    runner = ModelRunner(..., ops=backend)

Every backend has the op methods of runtime/backends/numpy_ops.py with the same arguments
(shapes, cache layout, slot_mapping / block_tables conventions) plus what the runner needs to
place memory: `kv_dtype`, `zeros` (KV pools), `empty_like`, `to_host` (logits back to numpy
float32). Activations stay in the backend's arrays and dtype between ops (numpy float32 on cpu;
numpy or cupy arrays of float32 / float16 / bf16 bits on sim and cuda); weights arrive as the
model's float32 numpy arrays and are converted and placed once by the backend. Host metadata
(token ids, positions, slot_mapping, block tables) arrives as numpy int32 arrays.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

# EngineConfig.dtype -> the activation / weight / KV dtype of the kernel backends.
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# Under "auto": the numpy and sim backends compute in float32 (the exact reference, and the sim
# backend's comparisons against it); the cuda backend in bfloat16. On cpu, "bfloat16" selects
# CpuBf16Backend (bf16 weights, float32 activations); "float16" runs float32.
AUTO_DTYPE = {"cpu": "float32", "sim": "float32", "cuda": "bfloat16"}


class Backend(Protocol):
    name: str           # "cpu" | "sim" | "cuda"
    dtype_name: str     # "float32" | "float16" | "bfloat16"
    kv_dtype: np.dtype  # element dtype of the KV pools (uint16 for bf16 bits)

    def zeros(self, shape, dtype): ...
    def empty_like(self, x): ...
    def to_host(self, x) -> np.ndarray: ...          # float32 numpy copy of an activation
    def embedding(self, token_ids, table): ...
    def rms_norm(self, x, weight, eps): ...
    def fused_add_rms_norm(self, x, residual, weight, eps): ...
    def linear(self, x, weight, bias=None, *, out_dtype=None): ...
    def silu_and_mul(self, gate_up): ...
    def rotary_embedding_and_cache_write(self, q, k, v, positions, cos_sin_cache, k_cache,
                                         v_cache, slot_mapping): ...
    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale): ...
    def paged_prefill_attention(self, q, k_cache, v_cache, block_tables, query_start_loc,
                                context_lens, scale): ...
    def copy_blocks(self, k_caches, v_caches, block_copies) -> None: ...
    def swap_blocks(self, src_caches, dst_caches, block_pairs) -> None: ...
    def sampler(self, eos_token_ids, seed: int = 0): ...  # Sampler | KernelSampler


def resolve_dtype(device: str, dtype: str) -> str:
    if dtype == "auto":
        return AUTO_DTYPE[device]
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be 'auto' or one of {DTYPE_NAMES}, got {dtype!r}")
    return dtype


def make_backend(device: str, dtype: str = "auto") -> Backend:
    """The backend of a resolved device ("cpu", "sim" or "cuda")."""
    if device == "cpu":
        if resolve_dtype(device, dtype) == "bfloat16":  # bf16 weights on the compiled GEMM
            from .cpu_bf16_backend import CpuBf16Backend

            return CpuBf16Backend()
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if device == "sim":
        from .sim_backend import SimBackend

        return SimBackend(resolve_dtype(device, dtype))
    if device == "cuda":
        from .cuda_backend import CudaBackend

        return CudaBackend(resolve_dtype(device, dtype))
    raise ValueError(f"device must be 'cpu', 'sim' or 'cuda', got {device!r}")
