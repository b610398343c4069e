"""CpuInt8Backend: the cpu backend with weight-only int8 GEMMs (EngineConfig.quantization "int8").

Every weight the model passes to `linear` (the fused QKV, o_proj, gate/up, down_proj, the LM
head; MoE experts) is quantized once -- the model's at load, MoE experts at their first use --
to int8 with one float32 scale per 64 weights of a row (symmetric: scale = max |W[n, group]| /
127, q = round(W / scale); groups of 64 measured closest to bf16,
cpu_gemm.DEFAULT_INT8_GROUP_SIZE says by how much) and packed for pagedrun.pyx.cpu_gemm's int8
kernel: y = sum over groups of (bf16(x_g) @ q_g.T) * scale_g (+ bias), float32 accumulation. A
decode step streams 1.06 bytes per weight instead of the bf16 backend's two.
Everything else (embedding, norms, rotary, attention, the KV cache -- bf16 bits unless
kv_cache_dtype is "float32" or "fp8" --, LoRA deltas) is the bf16 backend's, float32 math.

The model keeps only the packed copies (CpuBf16Backend.linear_weight): ~143 MB for
SmolLM2-135M's GEMM weights instead of ~540 MB of float32. The checkpoint is still read (or a
GGUF dequantized) into float32 first, one matrix at a time; loading a quantized file as it is
stored is issue 16's loader work.

Accuracy: benchmarks/bench_quant_accuracy.py measures perplexity and greedy agreement against
float32 and bf16.
"""
from __future__ import annotations

from pagedrun.pyx import cpu_gemm

from .cpu_bf16_backend import CpuBf16Backend


class CpuInt8Backend(CpuBf16Backend):
    dtype_name = "bfloat16"  # activations enter the GEMMs bf16-rounded, as on the bf16 backend
    quantization = "int8"
    weight_packing = cpu_gemm.PackedInt8Weight
    gemm = staticmethod(cpu_gemm.gemm_int8)
