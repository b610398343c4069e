"""Weight quantization: one LinearMethod per EngineConfig.quantization name (base.py: the
interface, the registry, `linear_method_for(ops)`), one module per method registering it at
import, and the quantized matrix containers (blocks.py).

    method = get_method(config.quantization)           # or linear_method_for(ops)
    linears = method.read_linears(model_dir, config, gguf_file)
    qkv = method.create_weights(ops, q, k, v)          # at model build
    y = method.apply(ops, x, qkv, bias)                # each step

Methods: "none" (base.py), "int8" (int8.py: quantized by the backend at load), "gguf"
(gguf_blocks.py: a .gguf file's blocks kept; a block type served through an exact repack of
its own, one module each), "awq" / "gptq" (hf_int4.py). Models see only the method object
and never import a format module (tests/foundation/test_layering.py). Device-free: the
backends pack what a method hands them (backends/cpu_gguf_backend.py, backends/weight_only.py).
"""
from __future__ import annotations

from .base import (LinearMethod, KeptQuantizedMethod, get_method, linear_method_for,
                   method_names, register)
from .blocks import InputPermuted, QuantizedMatrix, dense

# The method modules register themselves at import.
from . import gguf_blocks, gguf_iq4_nl, hf_int4, int8  # noqa: E402,F401  (isort: skip)

__all__ = ["InputPermuted", "KeptQuantizedMethod", "LinearMethod", "QuantizedMatrix", "dense",
           "get_method", "linear_method_for", "method_names", "register"]
