"""CpuGgufBackend: the cpu backend that computes on a GGUF file's quantized weights as the file
stores them (EngineConfig.quantization "gguf").

The gguf method (runtime/quantization/gguf_blocks.py) hands the model the GEMM matrices -- q/k/v/o,
gate/up, down, the LM head -- and the embedding table as QuantizedMatrix blocks. `linear_weight`
repacks the types pagedrun.pyx.cpu_gemm has a kernel for (cpu_gemm.GGUF_NATIVE_TYPES: Q4_0, Q4_1,
Q8_0, Q4_K, Q6_K, Q5_0, Q5_K, Q3_K) into that kernel's layout at about the file's own bytes per
weight (Q4_1 0.625, Q4_K 0.578, Q8_0 1.0625, Q6_K 1.07; Q5_0 1.0625 and Q5_K 1.08: one byte a
weight, against the file's 0.69; Q3_K as Q6_K, 1.07 against the file's 0.43), and `linear` runs
cpu_gemm.gemm_gguf on them: activations quantized per row per 32-weight block to int8 twice (the
value, then the residual; see __init__), integer dot products (AMX-INT8 from 8 kernel rows where the
CPU has it, else AVX512-VNNI), float32 scales and output; or, on a CPU without AMX-INT8 from
cpu_gemm.BF16_MIN_ROWS rows (batched decode, prefill), bf16 activations against each weight tile
unpacked to bf16 in cache (the bf16 GEMM's vdpbf16ps kernel: faster there than two int8 passes, with
the weights still quantized in memory). A block type an existing kernel serves after an exact repack
arrives already repacked (runtime/quantization/gguf_blocks.py's registered block repacks). A matrix
in another block type (Q5_1, Q2_K until they get a kernel), or a fused matrix whose parts differ in
type, is dequantized at load and packed as bf16 (the bf16 backend's GEMM), logged once per type.

The embedding lookup dequantizes only the rows a step reads (llama.py). Everything else --
norms, rotary, attention, the bf16 KV cache (kv_cache_dtype "auto"), MoE experts, LoRA deltas --
is the bf16 backend's.

The same backend serves Hugging Face AWQ / GPTQ int4 checkpoints (quantization "awq" / "gptq",
runtime/quantization/hf_int4.py): their matrices arrive as QuantizedMatrix of cpu_gemm's own
type "I4Z" (W = s * (q - z) per group of 32 / 64 / 128, exact) and run on the Q4_1 kernels at
0.59 bytes a weight.
"""
from __future__ import annotations

import dataclasses
import logging

from pagedrun.pyx import cpu_decode_step, cpu_gemm
from pagedrun.runtime.quantization import QuantizedMatrix

from .cpu_bf16_backend import CpuBf16Backend

log = logging.getLogger(__name__)


class CpuGgufBackend(CpuBf16Backend):
    dtype_name = "bfloat16"  # the non-GEMM ops and the KV cache are the bf16 backend's
    quantization = "gguf"
    capabilities = dataclasses.replace(CpuBf16Backend.capabilities,
                                       quantized_gemms=frozenset({"gguf", "awq", "gptq"}))
    # linear() runs its GGUF GEMMs on the decode loop's helper thread while the loop is on
    # (cpu_decode_step.gemm: gemm_gguf's bits), so the compiled decode step applies here too.
    loop_aware_linear = True

    def __init__(self, *, activations: str = "auto", quantization: str = "gguf",
                 **kwargs) -> None:
        """activations: how gemm_gguf takes a GEMM's input (cpu_gemm.GGUF_ACTIVATION_MODES).
        "q8x2": int8 per 32 weights plus a second int8 pass over the residual, error <= dx /
        256 -- llama.cpp's single pass "q8" (error <= dx / 2) measured 0.6-0.9% relative error
        per GEMM on the default model and changed its greedy answer to the demo question; q8x2
        keeps it (benchmarks/bench_quant_accuracy.py has both) at about the same decode speed,
        memory-bound at batch 1. "bf16": x rounded to bf16, the weights unpacked to bf16 tile
        by tile. "auto" (the default): q8x2, or bf16 from cpu_gemm.BF16_MIN_ROWS rows on a CPU
        without AMX-INT8 (cpu_gemm.gguf_activations_for; the compiled decode loop asks the same
        function). quantization: the EngineConfig name it serves ("gguf", "awq", "gptq").
        kwargs: CpuBf16Backend's."""
        super().__init__(**kwargs)
        self.quantization = quantization
        if activations not in cpu_gemm.GGUF_ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {cpu_gemm.GGUF_ACTIVATION_MODES}, "
                             f"got {activations!r}")
        self.activations = activations
        # The quantized kernel's path follows a forced portable GEMM path (tests).
        self.gguf_path = "portable" if self.path == "portable" else "auto"
        self.dequantized_types: set[str] = set()  # types that fell back to bf16 (logged once)

    def linear_weight(self, weight):
        """A model weight [out, in] packed once at load: a QuantizedMatrix of a native type in
        the quantized kernel's layout, anything else as the bf16 backend packs it."""
        if isinstance(weight, QuantizedMatrix):
            if (weight.ggml_type in cpu_gemm.GGUF_NATIVE_TYPES
                    or weight.ggml_type == cpu_gemm.INT4_TYPE):
                packed = cpu_gemm.PackedGgufWeight(weight.raw, weight.ggml_type, weight.shape[1])
                self._model_weight_bytes += packed.nbytes
                weight.release_pages()  # the file's bytes of it: read once, now repacked
                return packed
            if weight.ggml_type not in self.dequantized_types:
                self.dequantized_types.add(weight.ggml_type)
                log.info("quantization gguf: %s has no cpu kernel yet; its matrices are "
                         "dequantized and packed as bf16", weight.ggml_type)
            weight = weight.dequantize()
        return super().linear_weight(weight)

    def decode_loop_options(self) -> dict:
        return {"gguf_path": self.gguf_path, "activations": self.activations}

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        """x: [num_tokens, in] float32; weight: what linear_weight returned (or a float32
        [out, in] array); bias: [out] or None. Returns [num_tokens, out] float32."""
        if isinstance(weight, cpu_gemm.PackedGgufWeight):
            if self.decode_loop:
                return cpu_decode_step.gemm(x, weight, bias, threads=self.gemm_threads,
                                            gguf_path=self.gguf_path,
                                            activations=self.activations)
            return cpu_gemm.gemm_gguf(x, weight, bias, path=self.gguf_path,
                                      threads=self.gemm_threads, pool=self.gemm_pool,
                                      activations=self.activations)
        return super().linear(x, weight, bias, out_dtype=out_dtype)
