"""Q8_0 blocks made from a float weight at load: the int8 cpu backend's quantizer
(runtime/backends/cpu_int8_backend.py), whose bytes pagedrun.pyx.cpu_gemm.PackedGgufWeight
repacks for gemm_gguf's Q8_0 kernels.

GGUF's Q8_0 block, per 32 consecutive weights of a row: fp16 d (2 bytes, little-endian) then
32 int8 q, W ~= d * q (34 bytes per 32 weights: 1.0625 bytes a weight). The block's scale is
d = max |w| / 127 (a float32 division) rounded UP to fp16 (so max |w| / d <= 127: no q needs
clamping), and q = round-half-even(w / d) against that fp16 d, the value the kernel multiplies
by. Hence every weight's error is at most d / 2, with d <= (max |w| / 127) * (1 + 2^-10) +
2^-24 (fp16's relative step, and its smallest subnormal step for blocks whose d is below fp16's
normal range). llama.cpp rounds d to nearest and q against the float32 d before rounding, which can
add up to 127 * |d - fp16(d)| ~ 0.06 d to a weight's error; the bytes are the same format.
"""
from __future__ import annotations

import numpy as np

Q8_0_BLOCK = 32  # weights per block (GGUF's QK8_0)
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK  # fp16 d, then the int8 quants
Q8_0_QMAX = 127  # symmetric: -128 is never produced
FP16_MAX = 65504.0


def quantize_q8_0(weight: np.ndarray) -> np.ndarray:
    """weight: [N, K] float (K a multiple of Q8_0_BLOCK, finite) -> uint8 [N, K / 32 * 34], each
    row its blocks in GGUF's Q8_0 layout (the module docstring's definition). A block whose
    scale would overflow fp16 (max |w| > 127 * 65504) or a non-finite weight is a ValueError."""
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % Q8_0_BLOCK or w.shape[1] == 0:
        raise ValueError(f"weight must be [N, K] with K a positive multiple of {Q8_0_BLOCK}, "
                         f"got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has non-finite values: Q8_0 quantization needs finite ones")
    n, k = w.shape
    blocks = w.reshape(n, k // Q8_0_BLOCK, Q8_0_BLOCK)
    d32 = np.abs(blocks).max(axis=2) / np.float32(Q8_0_QMAX)  # float32, as a kernel would
    if np.any(d32 > FP16_MAX):
        raise ValueError("weight has a block with max |w| beyond 127 * 65504: its Q8_0 scale "
                         "overflows fp16")
    d16 = d32.astype(np.float16)
    low = d16.astype(np.float32) < d32  # rounded down: one fp16 step up (no q past 127)
    d16[low] = np.nextafter(d16[low], np.float16(np.inf))
    d = d16.astype(np.float32)[:, :, None]
    safe = np.where(d > 0, d, np.float32(1.0))  # an all-zero block: d 0, q 0
    q = np.rint(blocks / safe)  # float32 division, round half to even
    out = np.empty((n, k // Q8_0_BLOCK, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    out[:, :, :2] = np.ascontiguousarray(d16, dtype="<f2").view(np.uint8).reshape(n, -1, 2)
    out[:, :, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(n, -1)


def dequantize_q8_0(raw: np.ndarray, k: int) -> np.ndarray:
    """The float32 [N, k] weight that Q8_0 rows `raw` (quantize_q8_0's output) stand for: d * q."""
    raw = np.asarray(raw, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], k // Q8_0_BLOCK, Q8_0_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :, :2]).view("<f2").astype(np.float32)
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).astype(np.float32)
    return (d * q).reshape(raw.shape[0], k)
