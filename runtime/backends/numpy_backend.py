"""NumpyBackend: the cpu backend, runtime/backends/numpy_ops.py behind the Backend interface.

Everything is float32 numpy (numpy has no bfloat16; see numpy_ops' docstring); the ops are the
reference functions themselves, so this backend is the oracle the others are compared with.
The KV pools are float32, or with kv_cache_dtype "fp8" / "fp8_e4m3" uint8 fp8 e4m3 bits (scale
1.0: numpy_ops rounds k and v to e4m3 where it stores them and widens the blocks it reads).
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.lora import lora_ops
from pagedrun.runtime.sampler import Sampler

from . import numpy_ops
from .base import DEFAULT_HOST_KV_CACHE_BYTES, BackendCapabilities
from .step_inputs import StepInputs

# kv_cache_dtype -> the pools' element dtype (CpuBf16Backend has its own table).
KV_DTYPES = {"auto": np.dtype(np.float32), "float32": np.dtype(np.float32),
             "fp8": np.dtype(np.uint8), "fp8_e4m3": np.dtype(np.uint8)}


class NumpyBackend:
    name = "cpu"
    dtype_name = "float32"
    kv_dtype = np.dtype(np.float32)
    xp = np
    logits_on_device = False  # logits are numpy already
    quantization = None  # float weights (the gguf / int8 subclasses name their method)
    capabilities = BackendCapabilities(
        # Speculative verification rows run as 1 + k decode rows (the numpy decode attention
        # over a few queries per sequence is ~2.4x cheaper than the prefill path;
        # model_runner.py).
        verify_as_decode_rows=True,
        # Speculation off from this many running decodes unless speculative_config says
        # otherwise: on the CPU a step's extra query tokens cost compute in proportion, and with
        # several sequences a step's length is set by the slowest (measured with
        # bench_spec_decode.py, n-gram, default model, bf16: batch 8 0.89x, batch 32 0.88x,
        # batch 1 copy-heavy 1.61x).
        spec_disable_by_batch_size=4)
    communicator = "cpu"

    embedding = staticmethod(numpy_ops.embedding)
    rms_norm = staticmethod(numpy_ops.rms_norm)
    fused_add_rms_norm = staticmethod(numpy_ops.fused_add_rms_norm)
    silu_and_mul = staticmethod(numpy_ops.silu_and_mul)
    gelu_tanh_and_mul = staticmethod(numpy_ops.gelu_tanh_and_mul)
    scale_activations = staticmethod(numpy_ops.scale_activations)
    rotary_embedding_and_cache_write = staticmethod(numpy_ops.rotary_embedding_and_cache_write)
    paged_decode_attention = staticmethod(numpy_ops.paged_decode_attention)
    paged_prefill_attention = staticmethod(numpy_ops.paged_prefill_attention)
    copy_blocks = staticmethod(numpy_ops.copy_blocks)
    swap_blocks = staticmethod(numpy_ops.swap_blocks)
    moe_route = staticmethod(numpy_ops.moe_route)
    moe_experts = staticmethod(numpy_ops.moe_experts)
    lora_weights = (np.float32, np)   # slot stacks: float32 numpy, like the weights

    def __init__(self, *, kv_cache_dtype: str = "auto") -> None:
        """kv_cache_dtype: "auto" / "float32" (float32 pools) or "fp8" / "fp8_e4m3" (uint8
        pools of e4m3 bits)."""
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_DTYPES)}, "
                             f"got {kv_cache_dtype!r}")
        self.kv_dtype = KV_DTYPES[kv_cache_dtype]

    @staticmethod
    def lora_batch(batch):
        """The step's LoRABatch itself (lora_ops reads its host arrays)."""
        return batch

    @staticmethod
    def add_lora(y, x, lora_a, lora_b, batch, slice_starts):
        """y [T, out] += LoRA(x [T, in]) in place, float32 (lora_ops.add_lora); returns y."""
        return lora_ops.add_lora(y, x, lora_a, lora_b, batch, slice_starts)

    @staticmethod
    def linear_weight(weight):
        return weight  # numpy multiplies the float32 view as it is

    @staticmethod
    def linear(x, weight, bias=None, *, out_dtype=None):
        """numpy_ops.linear; out_dtype is accepted for the interface (the result is float32)."""
        del out_dtype
        return numpy_ops.linear(x, weight, bias)

    @staticmethod
    def check_model(model_config, block_size: int) -> None:
        """numpy serves every head_dim and block size."""
        del model_config, block_size

    @staticmethod
    def kv_cache_budget_bytes(profile, *, gpu_memory_utilization: float) -> int:
        """A fixed host budget (base.DEFAULT_HOST_KV_CACHE_BYTES): numpy maps pool pages
        lazily, so nothing needs measuring and the profiling step is not run."""
        del profile, gpu_memory_utilization
        return DEFAULT_HOST_KV_CACHE_BYTES

    @staticmethod
    def step_inputs(positions, slot_mapping, attn) -> StepInputs:
        """The host arrays themselves: the reference ops read numpy directly."""
        return StepInputs(positions, slot_mapping, attn)

    @staticmethod
    def zeros(shape, dtype):
        # np.zeros maps untouched pages lazily: a large pool costs memory only as it fills.
        return np.zeros(shape, dtype)

    @staticmethod
    def empty_like(x):
        return np.empty_like(x)

    @staticmethod
    def to_host(x) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    @staticmethod
    def sampler(eos_token_ids, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> Sampler:
        """The numpy sampler (the kernel backends return their KernelSampler, same draws)."""
        return Sampler(eos_token_ids, seed=seed, logprobs_mode=logprobs_mode)

    @staticmethod
    def rejection_sampler():
        """None: speculative decoding verifies with the numpy reference
        (spec_decode/rejection_sampler.py); the kernel backends return their kernel's."""
        return None
