"""int8 weights (EngineConfig.quantization "int8"): the checkpoint is read as float32 and the
backend quantizes each GEMM weight in its own `linear_weight` at load -- the int8 cpu backend
(runtime/backends/cpu_int8_backend.py: its weight packing) and the sim / cuda W8A16 GEMM
(runtime/backends/weight_only.py: pack_int8). So the model-side method is the float one's:
float matrices fused and handed to ops.linear_weight, ops.linear applied; registered under its
own name so that a backend serving "int8" has a method.
"""
from __future__ import annotations

from .base import LinearMethod, register

INT8 = "int8"


class Int8Method(LinearMethod):
    name = INT8


register(Int8Method())
