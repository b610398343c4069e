"""NullBackend: the Backend interface (runtime/backends/base.py) with every op's compute removed.

Each op returns a preallocated array of the shape and dtype the numpy backend would return, one
per (shape, dtype) made on first use and handed out again on every later call: the engine,
the model runner and the model's per-layer Python run unmodified above it, and what is left of
a step is host work. Activations are zeros (never read); arrays whose last axis is the
vocabulary (the LM head's logits) hold fixed seeded normal values, so the real numpy sampler
picks real token ids that the detokenizer then turns into text. Every op call is counted
(`num_op_calls`), the analogue of kernel launches for this backend.
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.backends.base import BackendCapabilities
from pagedrun.runtime.backends.step_inputs import StepInputs
from pagedrun.runtime.sampler import Sampler

# Seed of the fixed logits: same values, same sampled tokens, on every run.
LOGITS_SEED = 0
# The KV "budget" it reports if asked (the benchmark gives num_kv_blocks, so never in practice).
NULL_KV_BUDGET_BYTES = 1 << 30


class NullBackend:
    """Ops that cost a dictionary look-up: see the module docstring."""

    name = "null"
    dtype_name = "float32"
    kv_dtype = np.dtype(np.float32)
    xp = np
    logits_on_device = False  # logits are numpy: the numpy sampler reads them
    communicator = "cpu"
    capabilities = BackendCapabilities()  # nothing beyond the ops: no graphs, no decode loop
    quantization = None  # float weights

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_op_calls = 0
        self._outputs: dict[tuple, np.ndarray] = {}
        self._rng = np.random.default_rng(LOGITS_SEED)

    def _out(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """One op call's (first) output: counts the call, returns `_buffer(shape, dtype)`."""
        self.num_op_calls += 1
        return self._buffer(shape, dtype)

    def _buffer(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """The preallocated array of this shape and dtype (made now if it is the first).
        Hot: one tuple and one dict look-up per call."""
        out = self._outputs.get((shape, dtype))
        if out is None:
            out = self._outputs[(shape, dtype)] = self._allocate(shape, dtype)
        return out

    def _allocate(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        if shape and shape[-1] == self.vocab_size and np.dtype(dtype).kind == "f":
            return self._rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        return np.zeros(shape, dtype)  # mapped lazily: an output nobody reads costs no memory

    # ------------------------------------------------------------------ placement
    @staticmethod
    def check_model(model_config, block_size: int) -> None:
        del model_config, block_size

    @staticmethod
    def kv_cache_budget_bytes(profile, *, gpu_memory_utilization: float) -> int:
        del profile, gpu_memory_utilization
        return NULL_KV_BUDGET_BYTES

    @staticmethod
    def sampler(eos_token_ids, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> Sampler:
        """The numpy sampler, for real: sampling is host work on the cpu backends."""
        return Sampler(eos_token_ids, seed=seed, logprobs_mode=logprobs_mode)

    @staticmethod
    def step_inputs(positions, slot_mapping, attn) -> StepInputs:
        return StepInputs(positions, slot_mapping, attn)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype)  # the KV pools: mapped lazily, never touched

    @staticmethod
    def empty_like(x):
        return np.empty_like(x)

    @staticmethod
    def to_host(x) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)  # float32 already: no copy

    # ------------------------------------------------------------------ ops
    def embedding(self, token_ids, table):
        return self._out((len(token_ids), table.shape[1]))

    def rms_norm(self, x, weight, eps):
        return self._out(x.shape)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        out = self._out(x.shape)
        return out, out

    @staticmethod
    def linear_weight(weight):
        return weight

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        return self._out((x.shape[0], weight.shape[0]))  # weight: HF [out, in]

    def silu_and_mul(self, gate_up):
        return self._out((gate_up.shape[0], gate_up.shape[1] // 2))

    def gelu_tanh_and_mul(self, gate_up):
        return self._out((gate_up.shape[0], gate_up.shape[1] // 2))

    def scale_activations(self, x, factor: float):
        return self._out(x.shape)

    def rotary_embedding_and_cache_write(self, q, k, v, positions, cos_sin_cache, k_cache,
                                         v_cache, slot_mapping):
        return self._out(q.shape), self._buffer(k.shape)

    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale,
                               *, sliding_window=None):
        return self._out(q.shape)

    def paged_prefill_attention(self, q, k_cache, v_cache, block_tables, query_start_loc,
                                context_lens, scale, *, sliding_window=None):
        return self._out(q.shape)

    def moe_route(self, router_logits, top_k: int, renormalize: bool):
        num_tokens = router_logits.shape[0]
        return self._out((num_tokens, top_k), np.int32), self._buffer((num_tokens, top_k))

    def moe_experts(self, x, topk_ids, topk_weights, w_gate_up, w_down):
        return self._out(x.shape)

    def copy_blocks(self, k_caches, v_caches, block_copies) -> None:
        self.num_op_calls += 1

    def swap_blocks(self, src_caches, dst_caches, block_pairs) -> None:
        self.num_op_calls += 1
