"""CpuBf16Backend: the cpu backend with bf16 weights (EngineConfig.dtype "bfloat16" on cpu).

The GEMMs (`linear`, ~2/3 of a cpu step in float32) run on pagedrun.pyx.cpu_gemm: weights
rounded to bf16 (RNE) and packed once, activations rounded to bf16 per call, float32
accumulation and float32 output. Half the weight bytes stream per step, and the AVX512-BF16
path does two multiply-adds per float32 lane. Everything else -- embedding, norms, rotary,
attention, the KV cache -- is NumpyBackend's float32 numpy, so only the GEMM inputs are
rounded; the float32 backend stays the exact reference.

Mixture-of-experts layers run the same grouped op as numpy (numpy_ops.grouped_moe_experts:
tokens sorted by expert, one GEMM pair per expert that has tokens) with this backend's bf16 GEMM
per expert: each expert's [2I, H] and [H, I] matrices are packed once like any weight; routing
(softmax, top-k) stays float32 numpy.

Decode attention is batched over sequences (`paged_decode_attention` below): one padded
gather and two batched matmuls per layer instead of numpy_ops' per-sequence loop, which was
~20% of a 32-sequence step; same math, float32.

Weights arrive as the model's float32 arrays (llama.py passes views like `w_t.T` each call):
each is packed once and kept keyed by the array's memory, as the sim backend does. The model
keeps its float32 copies (llama.py owns them), so this backend adds the bf16 bytes (~270 MB
for SmolLM2-135M) rather than halving the weight memory.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from pagedrun.pyx import cpu_gemm

from . import numpy_ops
from .numpy_backend import NumpyBackend

log = logging.getLogger(__name__)

# The GEMM splits its output tiles over this many threads (the calling thread and a pooled one
# that sleeps between calls). benchmarks/bench_engine.py measures 1 vs 2.
DEFAULT_GEMM_THREADS = min(2, os.cpu_count() or 1)
# The batched decode pads every context to the longest: past this many padded slots per real
# one (mixed short and long contexts) the per-sequence loop of numpy_ops does less work.
MAX_DECODE_PADDING_RATIO = 2.0


class CpuBf16Backend(NumpyBackend):
    dtype_name = "bfloat16"
    kv_dtype = np.dtype(np.float32)  # activations and KV stay float32 numpy

    def __init__(self, *, gemm_threads: int = DEFAULT_GEMM_THREADS, path: str = "auto",
                 gemm_pool: str = "native") -> None:
        """gemm_threads: threads of one GEMM; path: cpu_gemm's "auto" | "avx512bf16" | "avx2"
        | "portable" (tests force each); gemm_pool: cpu_gemm's "native" | "python" helper."""
        self.gemm_threads = gemm_threads
        self.gemm_pool = gemm_pool
        self.path = path
        if path == "auto" and cpu_gemm.available_paths()[0] == "portable":
            log.warning("dtype bfloat16 on cpu: this CPU has neither AVX512-BF16 nor AVX2+FMA; "
                        "the portable GEMM is slower than float32 (use --dtype float32)")
        self._packed: dict[tuple, tuple[np.ndarray, cpu_gemm.PackedWeight]] = {}

    def packed(self, weight: np.ndarray) -> cpu_gemm.PackedWeight:
        """The packed bf16 copy of a [out, in] weight (once per underlying array)."""
        key = (weight.__array_interface__["data"][0], weight.shape, weight.strides)
        hit = self._packed.get(key)
        if hit is None:
            # Keep the original alive: its address is the key.
            hit = self._packed[key] = (weight, cpu_gemm.PackedWeight(weight))
        return hit[1]

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        """x: [num_tokens, in] float32; weight: [out, in]; bias: [out] or None.
        Returns [num_tokens, out] float32 (out_dtype is accepted for the interface)."""
        del out_dtype
        return cpu_gemm.gemm_bf16(x, self.packed(weight), bias, path=self.path,
                                  threads=self.gemm_threads, pool=self.gemm_pool)

    def moe_experts(self, x, topk_ids, topk_weights, w_gate_up, w_down):
        """numpy_ops.moe_experts' contract, each expert's two GEMMs on the bf16 GEMM."""
        return numpy_ops.grouped_moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down,
                                             self.linear)

    @staticmethod
    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                               sliding_window=None):
        """numpy_ops.paged_decode_attention's contract, batched over sequences.

        q: [num_seqs, num_heads, head_dim] float32; k_cache, v_cache: [num_blocks, block_size,
        num_kv_heads, head_dim] float32; block_tables: [num_seqs, max_blocks] int32;
        context_lens: [num_seqs] int32 >= 1. Returns [num_seqs, num_heads, head_dim] float32.
        """
        context_lens = np.asarray(context_lens)
        num_seqs = q.shape[0]
        if (num_seqs < 2 or q.dtype != np.float32 or context_lens.shape != (num_seqs,)
                or block_tables.shape[0] != num_seqs or context_lens.min() < 1):
            return numpy_ops.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                    context_lens, scale, sliding_window)
        numpy_ops._check_attention_shapes(q, k_cache, v_cache)
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        max_len = int(context_lens.max())
        padded_blocks = -(-max_len // block_size)
        if (padded_blocks * block_size * num_seqs
                > MAX_DECODE_PADDING_RATIO * int(context_lens.sum()) + block_size * num_seqs
                or padded_blocks > block_tables.shape[1]):
            return numpy_ops.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                    context_lens, scale, sliding_window)
        # Blocks past a sequence's context are masked; read block 0 there (never out of range).
        used = np.arange(padded_blocks) * block_size < context_lens[:, None]
        blocks = np.where(used, block_tables[:, :padded_blocks], 0).astype(np.int64)
        numpy_ops._check_block_ids(blocks, num_blocks, "block_tables")
        padded_len = padded_blocks * block_size
        group = q.shape[1] // num_kv_heads
        # [num_seqs, num_kv_heads, padded_len, head_dim]
        k_ctx = k_cache[blocks].reshape(num_seqs, padded_len, num_kv_heads, head_dim
                                        ).transpose(0, 2, 1, 3)
        v_ctx = v_cache[blocks].reshape(num_seqs, padded_len, num_kv_heads, head_dim
                                        ).transpose(0, 2, 1, 3)
        q_g = q.reshape(num_seqs, num_kv_heads, group, head_dim)
        scores = q_g @ k_ctx.transpose(0, 1, 3, 2)  # [num_seqs, num_kv_heads, group, padded]
        scores *= np.float32(scale)
        invisible = np.arange(padded_len) >= context_lens[:, None]  # [num_seqs, padded_len]
        if sliding_window is not None:  # the query sits at context_len - 1
            invisible |= np.arange(padded_len) <= context_lens[:, None] - 1 - sliding_window
        scores[np.broadcast_to(invisible[:, None, None, :], scores.shape)] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = probs @ v_ctx  # [num_seqs, num_kv_heads, group, head_dim]
        return out.reshape(q.shape).astype(np.float32, copy=False)
