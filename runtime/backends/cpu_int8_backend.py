"""CpuInt8Backend: the cpu backend with int8 GEMMs (EngineConfig.quantization "int8").

Every weight the model passes to `linear` (the fused QKV, o_proj, gate/up, down_proj, the LM
head; MoE experts) is quantized once -- the model's at load, MoE experts at their first use --
to GGUF Q8_0 blocks (runtime/backends/q8_0_blocks.py: per 32 weights of a row an fp16 scale
d = max |w| / 127 rounded up, q = round(w / d) in [-127, 127]; 1.0625 bytes a weight) and
packed for pagedrun.pyx.cpu_gemm's GGUF kernels, the ones that serve a GGUF file's own Q8_0
matrices: gemm_gguf quantizes each GEMM's input per row per 32-wide block to int8 and
multiplies int8 by int8 (vpmaddubsw on AVX2, vpdpbusd on AVX512-VNNI, AMX-INT8 tiles), float32
scales, accumulation and output. `activations` picks how the input is quantized
(cpu_gemm.GGUF_ACTIVATION_MODES; DEFAULT_ACTIVATIONS says which and why). A matrix whose input
width is not a multiple of 32 keeps the earlier weight-only format (cpu_gemm.PackedInt8Weight:
a float32 scale per 64 weights, bf16 activations on float FMAs).
Everything else (embedding, norms, rotary, attention, the KV cache -- bf16 bits unless
kv_cache_dtype is "float32" or "fp8" --, LoRA deltas) is the bf16 backend's, float32 math.

The model keeps only the packed copies: ~143 MB for SmolLM2-135M's GEMM weights instead of
~540 MB of float32. The checkpoint is still read (or a GGUF dequantized) into float32 first,
one matrix at a time.

Measured on the default model (SmolLM2-135M-Instruct), AMD EPYC Zen 3, 2 vCPUs, AVX2 (GGUF
path "avx2"), 2026-12-07, against the format this replaced ("group64": int8 weights with a
float32 scale per 64, bf16 activations on float FMAs); the shared box was loaded (load average
11-13 in round 1, 5-6 in round 2), so absolute rates are low and only the paired ratios mean much:
- speed, benchmarks/bench_int8_gemm.py --engine (bench_engine's concurrency benchmark, prompt
  32, 24 new tokens, arms interleaved, medians of 3), decode tok/s q8 / group64, round 1 /
  round 2: 1.18 / 1.24x at 1 concurrent request, 1.41 / 1.53x at 8, 1.69 / 1.44x at 32,
  1.55 / 1.97x at 64 (round 2: 36.6 -> 45.4, 108 -> 165, 120 -> 173, 85 -> 167 tok/s); q8x2 /
  group64 (round 1) 1.21x, 0.83x, 0.87x, 1.01x. Per GEMM (benchmarks/bench_int8_gemm.py, the
  model's five shapes summed, two runs): q8 1.74-1.93x / 1.43-1.55x / 1.63-1.88x / 1.59-1.81x
  at M 1 / 8 / 32 / 64, q8x2 0.76-0.86x / 0.76-0.92x / 0.91-0.94x / 0.86-0.97x.
- accuracy, benchmarks/bench_quant_accuracy.py (perplexity over its 889-token text; greedy
  agreement with float32, 8 prompts x 32 tokens): float32 22.050, bf16 22.062; q8 22.235
  (+0.78% vs bf16; prefix agreement 69.5%, 4 of 8 prompts identical), q8x2 22.182 (+0.54%;
  85.9%, 5 of 8), group64 22.106 (+0.20%; 63.7%, 4 of 8). Relative error per GEMM on the model's
  own activations (300 prompt tokens, median over calls): q8 0.93%, q8x2 0.50% (= its weight
  rounding alone: Q8_0's per-32 fp16 scales round 11% finer than groups of 64, and the LM head,
  Q8_0 in the model file, is kept exactly), group64 0.58%. So q8 trades the activations'
  rounding (~0.8% per GEMM, llama.cpp's Q8_0 arithmetic) for the speed; the demo question's
  greedy answer is unchanged ("The capital of France is Paris.").
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pagedrun.pyx import cpu_gemm

from .cpu_gguf_backend import CpuGgufBackend
from .q8_0_blocks import Q8_0_BLOCK, quantize_q8_0

# gemm_gguf's activation mode for this backend: "q8", llama.cpp's single int8 pass per 32-wide
# block (error <= dx / 2, dx = max |x_b| / 127), the arithmetic of the Q8_0 GEMM it is measured
# against. Measured on the default model, AMD EPYC Zen 3 (AVX2), 2026-12-07 (numbers: the
# module docstring). "q8x2" (a second pass over the residual, error <= dx / 256) keeps the
# activations' error negligible but doubles the integer work, and on AVX2 the kernel is bound
# by it even at one row: it was slower than the weight-only format it replaces.
DEFAULT_ACTIVATIONS = "q8"


class CpuInt8Backend(CpuGgufBackend):
    dtype_name = "bfloat16"  # the non-GEMM ops and the KV cache are the bf16 backend's
    keeps_quantized = False  # a GGUF checkpoint's blocks arrive dequantized, then Q8_0 here
    capabilities = dataclasses.replace(CpuGgufBackend.capabilities,
                                       quantized_gemms=frozenset({"int8"}))
    # The fallback format (input width not a multiple of Q8_0_BLOCK) and its GEMM.
    gemm = staticmethod(cpu_gemm.gemm_int8)

    # What `activations=None` takes (benchmarks/bench_quant_accuracy.py sets it per arm).
    default_activations = DEFAULT_ACTIVATIONS

    def __init__(self, *, activations: str | None = None, gguf_path: str | None = None,
                 **kwargs) -> None:
        """activations: gemm_gguf's mode (cpu_gemm.GGUF_ACTIVATION_MODES; None:
        default_activations); gguf_path: the Q8_0 GEMM's path (cpu_gemm.GGUF_PATHS or "auto";
        None: "portable" when `path` is, else "auto"); kwargs: CpuBf16Backend's (`path` is the
        fallback format's GEMM path)."""
        super().__init__(activations=activations or self.default_activations,
                         quantization="int8", **kwargs)
        if gguf_path is not None:
            cpu_gemm._resolve_gguf_path(gguf_path)  # refuse an unknown / unrunnable one now
            self.gguf_path = gguf_path

    @staticmethod
    def weight_packing(weight):
        """A float [out, in] weight in the int8 GEMM's format: Q8_0 blocks when `in` is a
        multiple of 32, else PackedInt8Weight."""
        w = np.asarray(weight, dtype=np.float32)
        if w.ndim == 2 and w.shape[1] % Q8_0_BLOCK == 0 and w.shape[1] > 0:
            return cpu_gemm.PackedGgufWeight(quantize_q8_0(w), "Q8_0", w.shape[1])
        return cpu_gemm.PackedInt8Weight(w)

    def linear_weight(self, weight):
        packed = self.weight_packing(weight)
        self._model_weight_bytes += packed.nbytes
        return packed

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        """x: [num_tokens, in] float32; weight: what linear_weight returned, or a float32
        [out, in] array (MoE experts: packed at first use); bias: [out] or None. Returns
        [num_tokens, out] float32."""
        if isinstance(weight, np.ndarray):
            weight = self.packed(weight)
        return super().linear(x, weight, bias, out_dtype=out_dtype)
