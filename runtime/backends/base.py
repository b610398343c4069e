"""The backend seam: everything device-specific, as one object per device, and the factory.

    backend = make_backend("auto", dtype="auto")   # factory.py: NumpyBackend | KernelBackend | ...
    runner = ModelRunner(config, weights, ops=backend, ...)

Above this seam nothing knows which device runs: the engine asks its backend (never a device
string) whether a model's shapes are served (`check_model`), how many KV bytes the budget gives
(`kv_cache_budget_bytes`), for the sampler (`sampler`), whether logits stay on the device
(`logits_on_device`), for the step's uploaded inputs (`step_inputs`) and for the array module
(`xp`); the tensor-parallel executor asks which communicator the ranks share (`communicator`).

Every backend has the op methods of runtime/backends/numpy_ops.py with the same arguments
(shapes, cache layout, slot_mapping / block_tables conventions) plus what the runner needs to
place memory: `kv_dtype`, `zeros` (KV pools), `empty_like`, `to_host` (logits back to numpy
float32). Activations stay in the backend's arrays and dtype between ops (numpy float32 on cpu;
numpy or cupy arrays of float32 / float16 / bf16 bits on sim and cuda); weights arrive as the
model's float32 numpy arrays and are converted and placed once by the backend. Host metadata
(token ids, positions, slot_mapping, block tables) arrives as numpy int32 arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

# EngineConfig.dtype -> the activation / weight / KV dtype of the kernel backends.
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# Under "auto": the numpy and sim backends compute in float32 (the exact reference, and the sim
# backend's comparisons against it); the cuda backend in bfloat16. On cpu, "bfloat16" selects
# CpuBf16Backend (bf16 weights, float32 activations); "float16" runs float32.
AUTO_DTYPE = {"cpu": "float32", "sim": "float32", "cuda": "bfloat16"}
# KV memory budget of the host backends (cpu, sim) when neither num_kv_blocks nor
# kv_cache_memory_bytes is given. numpy maps pool pages lazily, so an unused budget costs
# address space, not memory.
DEFAULT_HOST_KV_CACHE_BYTES = 2 << 30

# Runs one maximum-size step of the model on the backend and returns the bytes of the scratch
# KV pool it used (ModelRunner.profile_run, bound to its arguments).
ProfileStep = Callable[[], int]


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do beyond the ops every backend has, declared once per backend
    class (or per instance where the device decides). Everything above the seam reads this;
    nothing probes a backend for attributes or asks its name."""

    # Decode steps may replay captured graphs (runtime/decode_graphs.py; `graph_capture`,
    # `default_graph_sizes`).
    graphs: bool = False
    # The sampler can leave token ids on the device, so the host schedules step N+1 while the
    # device runs N (runtime/engine/async_stepper.py).
    async_scheduling: bool = False
    # `stream`: the device's compute stream, which NCCL communicators join.
    compute_stream: bool = False
    # `host_call(fn, *args)`: a host function run as a step of a graph being captured (a
    # host-communicator all-reduce inside a decode graph).
    host_call: bool = False
    # `make_decode_loop(model)`: the compiled whole-step decode loop (pyx/cpu_decode_step).
    decode_loop: bool = False
    # Speculative verification rows run as 1 + k decode rows (else one prefill row).
    verify_as_decode_rows: bool = False
    # speculative_config's disable_by_batch_size when it sets none (None: no limit).
    spec_disable_by_batch_size: int | None = None
    # The quantization methods whose GEMMs run on the stored (packed) weights here.
    quantized_gemms: frozenset[str] = frozenset()


class Backend(Protocol):
    name: str              # "cpu" | "sim" | "cuda": for logs and model info, never for branches
    capabilities: BackendCapabilities
    quantization: str | None  # its GEMM weights' method (runtime/quantization/); None: float
    dtype_name: str        # "float32" | "float16" | "bfloat16"
    kv_dtype: np.dtype     # element dtype of the KV pools (uint16 for bf16 bits)
    xp: object             # the array module of activations and logits (numpy or cupy)
    logits_on_device: bool  # the sampler reads logits in xp; False: they come back as numpy
    communicator: str      # "cpu" (ZeroMQ collectives) | "nccl": what tensor-parallel ranks share

    def check_model(self, model_config, block_size: int) -> None: ...  # raise if not served
    def kv_cache_budget_bytes(self, profile: ProfileStep | None, *,
                              gpu_memory_utilization: float) -> int: ...
    def sampler(self, eos_token_ids, seed: int = 0,
                logprobs_mode: str = "raw_logprobs"): ...  # Sampler's interface
    def rejection_sampler(self): ...  # None (numpy reference) or the kernel's rejection_sample
    def step_inputs(self, positions, slot_mapping, attn): ...  # StepInputs, uploaded once

    def zeros(self, shape, dtype): ...
    def empty_like(self, x): ...
    def to_host(self, x) -> np.ndarray: ...          # float32 numpy copy of an activation
    def embedding(self, token_ids, table): ...
    def rms_norm(self, x, weight, eps): ...
    def fused_add_rms_norm(self, x, residual, weight, eps): ...
    # A model weight [out, in] float32 -> what `linear` takes for it, once at load (the model
    # keeps only the result: a backend that packs its own copy frees the float32 one).
    def linear_weight(self, weight): ...
    def linear(self, x, weight, bias=None, *, out_dtype=None): ...
    def silu_and_mul(self, gate_up): ...
    def gelu_tanh_and_mul(self, gate_up): ...    # Gemma's GeGLU, silu_and_mul's layout
    def scale_activations(self, x, factor: float): ...  # x * factor (in the activation dtype)
    def rotary_embedding_and_cache_write(self, q, k, v, positions, cos_sin_cache, k_cache,
                                         v_cache, slot_mapping): ...
    # sliding_window (keyword, Gemma 3's local layers): keys j > query position - window only.
    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale,
                               *, sliding_window=None): ...
    def paged_prefill_attention(self, q, k_cache, v_cache, block_tables, query_start_loc,
                                context_lens, scale, *, sliding_window=None): ...
    def moe_route(self, router_logits, top_k: int, renormalize: bool): ...  # (ids, weights)
    def moe_experts(self, x, topk_ids, topk_weights, w_gate_up, w_down): ...
    # Multi-LoRA (runtime/lora/): `lora_batch` prepares a step's LoRABatch once (the numpy
    # backends keep it, the kernel backends upload its tile plan); `add_lora` adds
    # y += LoRA(x) in place for the tokens with an adapter (runtime/lora/lora_ops.py's
    # contract) and returns y; `lora_weights` is (dtype, xp) of the slot weight stacks.
    lora_weights: tuple
    def lora_batch(self, batch): ...
    def add_lora(self, y, x, lora_a, lora_b, batch, slice_starts): ...
    def copy_blocks(self, k_caches, v_caches, block_copies) -> None: ...
    def swap_blocks(self, src_caches, dst_caches, block_pairs) -> None: ...
