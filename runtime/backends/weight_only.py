"""Weight-only quantized matrices on the kernel backends (sim / cuda; EngineConfig.quantization
"awq" / "gptq" / "int8"): a weight in the layout cuda/gemm_wq.cu reads, and the GEMM on it.

    packed = pack_int4(matrix, backend)      # a QuantizedMatrix of type "I4Z" -> WeightOnlyMatrix
    packed = pack_int8(w, backend)           # float32 [N, K] -> WeightOnlyMatrix (int8, g 64)
    y = linear(module, x, packed, bias)      # x [M, K] f16 / bf16 -> [M, N], gemm_w4a16 / w8a16

The loader (runtime/quantization/hf_int4.py) hands over exact q / s / z (W = s * (q - z) per
group of 32 / 64 / 128 inputs), possibly several projections stacked along out (fused q/k/v,
gate/up: a plain QuantizedMatrix of I4Z rows). They are repacked once at load into the kernel's
pre-shuffled layouts (kernels/wq_pack.py): q through pack_w4, s transposed to [K / g, N] in the
activation dtype (fp16 scales are exact in float16, rounded once to nearest in bfloat16) and z
to [K / g, N] uint8, both through pack_groups; then placed on the device by the backend,
which counts them among its weights.

int8 is made at load from any float weight as the cpu int8 backend makes it
(runtime/backends/cpu_int8_backend.py): symmetric, one scale per INT8_GROUP = 64 inputs of a
row, s = max |w| / 127, q = round(w / s); the scale then rounded to the activation dtype (the
kernel reads it so), q computed against the float32 scale; q through pack_w8 and s through
pack_groups (the same pre-shuffled layouts as int4's).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.quantization import QuantizedMatrix
from pagedrun.runtime.quantization.hf_int4 import INT4_TYPE, Int4Matrix
from pagedrun.runtime.kernels import fused_ops
from pagedrun.runtime.kernels.gemm_wq import gemm_w4a16, gemm_w8a16
from pagedrun.runtime.kernels.wq_pack import pack_groups, pack_w4, pack_w8

INT8_GROUP = 64  # cpu_gemm.DEFAULT_INT8_GROUP_SIZE: measured closest to bf16 there


@dataclass(frozen=True)
class WeightOnlyMatrix:
    """An [n, k] weight W = scales * (q - zeros) on the device (kernels/gemm_wq.py layouts);
    int8: W = scales * q, no zeros."""

    qweight: object      # uint32 [k / 32, ceil(n / 32), 32, 4] (int4, wq_pack.pack_w4) or
                         # [.., 8] (int8, wq_pack.pack_w8)
    scales: object       # [k / g, ceil(n / 32) * 32] (wq_pack.pack_groups), activation dtype
    zeros: object        # uint8, as the scales; None for int8
    group_size: int
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        zeros = 0 if self.zeros is None else self.zeros.nbytes
        return int(self.qweight.nbytes + self.scales.nbytes + zeros)

    @property
    def bits(self) -> int:
        return 8 if self.zeros is None else 4


def int4_parts(matrix: QuantizedMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(q uint8 [N, K], s float16 [K / g, N], z uint8 [K / g, N], g) of an I4Z matrix (stacked
    parts included: the rows are Int4Matrix rows)."""
    if matrix.ggml_type != INT4_TYPE:
        raise ValueError(f"expected an {INT4_TYPE} matrix, got {matrix.ggml_type}")
    as_int4 = Int4Matrix(matrix.ggml_type, matrix.shape, matrix.raw)
    q, s, z = as_int4.parts()  # s, z: [N, K / g]
    return (q, np.ascontiguousarray(s.T), np.ascontiguousarray(z.T), as_int4.group)


def pack_int4(matrix: QuantizedMatrix, backend) -> WeightOnlyMatrix:
    """The device form of an I4Z matrix: `backend.to_kernel_dtype` makes the scales' activation
    dtype, `backend.place_weight` puts each array on the device (once)."""
    q, s, z, group = int4_parts(matrix)
    n, k = matrix.shape
    return WeightOnlyMatrix(
        qweight=backend.place_weight(pack_w4(q)),
        scales=backend.place_weight(pack_groups(backend.to_kernel_dtype(
            s.astype(np.float32)))),
        zeros=backend.place_weight(pack_groups(z)), group_size=group, n=n, k=k)


def int8_servable(w) -> bool:
    """Whether a float weight can take the int8 path: a 2-D [N, K] with K % 64 == 0 (whole
    groups, whole 32-k kernel tiles); others stay float."""
    return getattr(w, "ndim", 0) == 2 and w.shape[1] % INT8_GROUP == 0


def quantize_int8(w: np.ndarray, backend) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [N, K], s [K / 64, N] in the activation dtype, host arrays) of float32 w."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    blocks = w.reshape(n, k // INT8_GROUP, INT8_GROUP)
    s = np.abs(blocks).max(axis=2) / np.float32(127)          # [N, K / g] float32
    safe = np.where(s == 0, np.float32(1), s)
    q = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8).reshape(n, k)
    return q, backend.to_kernel_dtype(np.ascontiguousarray(s.T))


def pack_int8(w: np.ndarray, backend) -> WeightOnlyMatrix:
    """The device form of a float32 [N, K] weight quantized to int8 (module doc)."""
    q, s = quantize_int8(w, backend)
    n, k = q.shape
    return WeightOnlyMatrix(qweight=backend.place_weight(pack_w8(q)),
                            scales=backend.place_weight(pack_groups(s)), zeros=None,
                            group_size=INT8_GROUP, n=n, k=k)


def linear(module, x, weight: WeightOnlyMatrix, bias=None, *, out_dtype=None):
    """x [M, K] (float16 / bf16 bits, contiguous) @ W.T (+ bias, in x's dtype): [M, N] in x's
    dtype, or float32 when out_dtype asks for it (widened from x's dtype)."""
    if weight.zeros is None:
        out = gemm_w8a16(module, x, weight.qweight, weight.scales, n=weight.n,
                         group_size=weight.group_size, bias=bias)
    else:
        out = gemm_w4a16(module, x, weight.qweight, weight.scales, weight.zeros, n=weight.n,
                         group_size=weight.group_size, bias=bias)
    if out_dtype is None or np.dtype(out_dtype) == out.dtype:
        return out
    if np.dtype(out_dtype) == np.float32:
        return fused_ops.to_float32(out)
    raise ValueError(f"weight-only linear: out_dtype {out_dtype} (the output is {out.dtype})")


__all__ = ["INT4_TYPE", "INT8_GROUP", "WeightOnlyMatrix", "int4_parts", "int8_servable",
           "linear", "pack_int4", "pack_int8", "quantize_int8"]
