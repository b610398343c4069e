"""CpuBf16Backend: the cpu backend with bf16 weights (EngineConfig.dtype "bfloat16" on cpu).

What runs where:
- the GEMMs (`linear`, ~2/3 of a cpu step in float32): pagedrun.pyx.cpu_gemm, weights rounded
  to bf16 (RNE) and packed once, activations rounded to bf16 per call, float32 accumulation and
  float32 output. Half the weight bytes stream per step, and the AVX512-BF16 path does two
  multiply-adds per float32 lane.
- the other ops of a decode layer -- rms_norm, fused_add_rms_norm, silu_and_mul,
  gelu_tanh_and_mul, rotary_embedding_and_cache_write, paged_decode_attention: one pass of C++
  each in pagedrun.pyx.cpu_ops (AVX512F where the CPU has it), float32, numpy_ops' contracts.
  Decode attention reads k/v through the block table once per (sequence, kv head) for all the
  group's query heads, online softmax. numpy did each of these in several passes and Python
  calls: ~8 ms of a batch-1 decode step on the default model (benchmarks/host/bench_cpu_ops.py).
- the rest -- embedding, prefill attention, block moves, MoE routing -- is NumpyBackend's
  float32 numpy.
The KV cache (kv_cache_dtype, EngineConfig's): "bfloat16" (what "auto" picks) keeps uint16 pools
of bf16 bits, the sim backend's representation: the cache write rounds k and v to nearest even,
decode attention (cpu_ops) and prefill attention (numpy_ops, the gathered blocks only) widen
them exactly and compute in float32. Half the bytes per block, so twice the blocks per budget
and half the KV bytes a decode step reads. "float32" keeps float32 pools. "fp8" / "fp8_e4m3"
keeps uint8 pools of OCP fp8 e4m3 bits (vLLM's fp8 cache with its default per-tensor scale 1.0,
no calibration): written rounded to nearest even and saturated to +-448, widened exactly where
read (cpu_ops and numpy_ops alike); half of bf16's bytes again.
Only the GEMM inputs are rounded to bf16; the float32 NumpyBackend stays pure numpy, the
independent reference these ops are tested against (tests/pyx/test_cpu_ops.py).

Mixture-of-experts layers run the same grouped op as numpy (numpy_ops.grouped_moe_experts:
tokens sorted by expert, one GEMM pair per expert that has tokens) with this backend's bf16 GEMM
per expert: each expert's [2I, H] and [H, I] matrices are packed once like any weight; routing
(softmax, top-k) stays float32 numpy.

The model's GEMM weights are packed at load (`linear_weight`: llama.py keeps only the packed
copy, so their float32 matrices are freed: ~270 MB of bf16 instead of ~540 MB of float32 for
SmolLM2-135M); a float32 weight given to `linear` directly (MoE experts) is packed at its first
use and kept keyed by the array's memory, as the sim backend does. The embedding table stays
float32 (a tied LM head is packed separately).

Decode steps run compiled (`make_decode_loop`): LlamaModel asks once, at construction, for a
pagedrun.pyx.cpu_decode_step.DecodeLoop, and a pure-decode step then runs all its layers in one
call without the GIL -- the same kernels with the same arguments as the per-op path, so the same
bits, without ~9 Python calls per layer (argument checks and numpy allocations: the forward of
a batch-1 step of SmolLM2-135M 9.5-11.4 -> 8.2-9.8 ms on a 2-core Xeon VM, 2026-12-02; from
two sequences up decode attention also splits over the two threads, batch 8 tok/s +20%).
Dense SwiGLU layers with bf16 / int8 packed weights only; anything else returns None and the
model keeps the per-op path. `decode_loop=False` turns it off. While it is on, `linear` runs
every GEMM (prefill, the LM head) through cpu_decode_step.gemm, cpu_gemm's GEMM on the loop's
helper thread (same bits): one polling helper per process, where cpu_gemm's and the loop's
would take turns on a 2-core machine.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import numpy as np

from pagedrun.pyx import cpu_decode_step, cpu_gemm, cpu_ops

from . import numpy_ops
from .numpy_backend import NumpyBackend

log = logging.getLogger(__name__)

# The GEMM splits its output tiles over this many threads (the calling thread and a pooled one
# that sleeps between calls). benchmarks/bench_engine.py measures 1 vs 2.
DEFAULT_GEMM_THREADS = min(2, os.cpu_count() or 1)
# The ops of pagedrun.pyx.cpu_ops this backend runs instead of numpy_ops'.
# kv_cache_dtype -> the pools' element dtype.
KV_DTYPES = {"auto": np.dtype(np.uint16), "bfloat16": np.dtype(np.uint16),
             "float32": np.dtype(np.float32), "fp8": np.dtype(np.uint8),
             "fp8_e4m3": np.dtype(np.uint8)}
CPU_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul",
           "rotary_embedding_and_cache_write", "paged_decode_attention")


class CpuBf16Backend(NumpyBackend):
    dtype_name = "bfloat16"
    kv_dtype = np.dtype(np.uint16)  # bf16 bits; activations stay float32 numpy (see __init__)
    # make_decode_loop: the compiled decode step (pyx/cpu_decode_step).
    capabilities = dataclasses.replace(NumpyBackend.capabilities, decode_loop=True)

    # cpu_ops on its fastest path ("auto"); __init__ forces the portable one per instance when
    # the GEMM's path is forced to "portable".
    rms_norm = staticmethod(cpu_ops.rms_norm)
    fused_add_rms_norm = staticmethod(cpu_ops.fused_add_rms_norm)
    silu_and_mul = staticmethod(cpu_ops.silu_and_mul)
    gelu_tanh_and_mul = staticmethod(cpu_ops.gelu_tanh_and_mul)
    rotary_embedding_and_cache_write = staticmethod(cpu_ops.rotary_embedding_and_cache_write)
    paged_decode_attention = staticmethod(cpu_ops.paged_decode_attention)

    def __init__(self, *, gemm_threads: int = DEFAULT_GEMM_THREADS, path: str = "auto",
                 gemm_pool: str = "native", kv_cache_dtype: str = "auto",
                 decode_loop: bool = True) -> None:
        """gemm_threads: threads of one GEMM; path: cpu_gemm's "auto" | "avx512bf16" | "avx2"
        | "portable" (tests force each; "portable" also puts cpu_ops on its portable path);
        gemm_pool: cpu_gemm's "native" | "python" helper; kv_cache_dtype: "auto" / "bfloat16"
        (uint16 pools of bf16 bits), "float32", or "fp8" / "fp8_e4m3" (uint8 e4m3 bits);
        decode_loop: False keeps decode steps on the per-op path (make_decode_loop: None) and
        the GEMMs on cpu_gemm's own helper thread."""
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_DTYPES)}, "
                             f"got {kv_cache_dtype!r}")
        self.kv_dtype = KV_DTYPES[kv_cache_dtype]
        self.gemm_threads = gemm_threads
        self.gemm_pool = gemm_pool
        self.path = path
        if path == "auto" and cpu_gemm.available_paths()[0] == "portable":
            log.warning("dtype bfloat16 on cpu: this CPU has neither AVX512-BF16 nor AVX2+FMA; "
                        "the portable GEMM is slower than float32 (use --dtype float32)")
        if path == "portable":
            for name in CPU_OPS:
                setattr(self, name, functools.partial(getattr(cpu_ops, name), path="portable"))
        self._packed: dict[tuple, tuple[np.ndarray, cpu_gemm.PackedWeight]] = {}
        self._model_weight_bytes = 0  # packed by linear_weight
        # Not for a subclass with its own `linear`, unless it declares that its GEMMs run on
        # the loop's helper too (CpuGgufBackend: loop_aware_linear).
        self.decode_loop = (decode_loop and gemm_pool == "native"
                            and (type(self).linear is CpuBf16Backend.linear
                                 or getattr(type(self), "loop_aware_linear", False)))

    # The packed form of a weight and the GEMM over it (CpuInt8Backend swaps both).
    weight_packing = cpu_gemm.PackedWeight
    gemm = staticmethod(cpu_gemm.gemm_bf16)

    def packed(self, weight: np.ndarray):
        """The packed copy of a [out, in] weight (once per underlying array)."""
        key = (weight.__array_interface__["data"][0], weight.shape, weight.strides)
        hit = self._packed.get(key)
        if hit is None:
            # Keep the original alive: its address is the key.
            hit = self._packed[key] = (weight, self.weight_packing(weight))
        return hit[1]

    def linear_weight(self, weight: np.ndarray):
        """A model weight [out, in] packed once at load; the model keeps only this, so its
        float32 copy is freed (packed_weight_bytes counts it)."""
        packed = self.weight_packing(weight)
        self._model_weight_bytes += packed.nbytes
        return packed

    def packed_weight_bytes(self) -> int:
        """Bytes of the GEMM weights packed so far: the model's (at load) and those packed at
        first use (MoE experts); after one step, what a decode step reads."""
        return self._model_weight_bytes + sum(packed.nbytes for _, packed in self._packed.values())

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        """x: [num_tokens, in] float32; weight: [out, in]; bias: [out] or None.
        Returns [num_tokens, out] float32 (out_dtype is accepted for the interface)."""
        del out_dtype
        if not isinstance(weight, (cpu_gemm.PackedWeight, cpu_gemm.PackedInt8Weight)):
            weight = self.packed(weight)  # a float32 weight the model did not prepare (MoE)
        if self.decode_loop and cpu_decode_step.weight_supported(weight):
            # The same GEMM on the decode loop's helper thread: one polling helper per step
            # (cpu_decode_step.gemm says why), the same bits.
            return cpu_decode_step.gemm(x, weight, bias, path=self.path,
                                        threads=self.gemm_threads)
        return self.gemm(x, weight, bias, path=self.path,
                         threads=self.gemm_threads, pool=self.gemm_pool)

    def moe_experts(self, x, topk_ids, topk_weights, w_gate_up, w_down):
        """numpy_ops.moe_experts' contract, each expert's two GEMMs on the bf16 GEMM."""
        return numpy_ops.grouped_moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down,
                                             self.linear)

    def make_decode_loop(self, model, max_tokens: int = 8):
        """A cpu_decode_step.DecodeLoop running all of `model`'s layers for a pure-decode step
        (called once by LlamaModel), or None where it would not compute what the per-op path
        does: turned off, a subclass with its own `linear`, the python GEMM pool, or any layer
        that is not a dense SwiGLU block with packed bf16 / int8 weights (MoE, QK-norm, sliding
        window, post-sublayer norms, GeGLU). A GGUF weight (cpu_gemm.PackedGgufWeight) is
        refused by cpu_decode_step.weight_supported until the loop dispatches it (WEIGHT_GGUF
        in pyx/cpu_decode_step.h). max_tokens: rows the work buffers start with (grown to the
        largest batch seen)."""
        cfg = model.config
        if not self.decode_loop or not model.layers or cfg.hidden_activation != "silu":
            return None
        specs = []
        for layer in model.layers:
            if (layer.moe is not None or layer.q_norm is not None or layer.k_norm is not None
                    or layer.sliding_window is not None or layer.attn_out_norm is not None
                    or layer.mlp_out_norm is not None
                    or not all(cpu_decode_step.weight_supported(w)
                               for w in (layer.qkv, layer.o, layer.gate_up, layer.down))):
                return None
            specs.append({"input_norm": layer.input_norm, "post_norm": layer.post_norm,
                          "qkv": layer.qkv, "qkv_bias": layer.qkv_bias, "o": layer.o,
                          "o_bias": layer.o_bias, "gate_up": layer.gate_up, "down": layer.down,
                          "cos_sin": layer.cos_sin_cache})
        return cpu_decode_step.DecodeLoop(
            specs, hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, scale=model.scale,
            gemm_path=self.path, ops_path="portable" if self.path == "portable" else "auto",
            threads=self, max_tokens=max_tokens,  # self.gemm_threads at each call
            **self.decode_loop_options())

    def decode_loop_options(self) -> dict:
        """Extra DecodeLoop keywords of a subclass (CpuGgufBackend: its GGUF GEMM's path and
        activations mode)."""
        return {}
