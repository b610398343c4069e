"""Host-side packers of weight-only quantized GEMM weights (numpy): from the logical q / s / z
to the layouts cuda/gemm_wq.cu reads, and back (the tests' reference and a debugging aid).

    qweight = pack_w4(q4)          # q4 [N, K] uint8 in 0..15 -> uint32 [K / 32, N, 4]
    q4 = unpack_w4(qweight)        # the inverse
    q8 = pack_w8(q8)               # int8 [N, K] is read as is (contiguous copy)

W4 layout (also in the kernel header): k-tile kt = k // 32, row n, word w = (k % 32) // 8,
element e = k % 8 in nibble (e >> 1) + 4 * (e & 1) -- nibbles hold elements 0,2,4,6,1,3,5,7,
so a pair (2i, 2i + 1) is `(word >> 4i) & 0x000f000f`. Scales [K / g, N] in the activation
dtype and zeros [K / g, N] uint8 need no packing.
"""
from __future__ import annotations

import numpy as np

W4_TILE_K = 32          # k per packed tile (the kernel's K granularity)
W4_WORDS = W4_TILE_K // 8
# NIBBLE_OF_ELEMENT[e]: the nibble of a word holding element e of its 8 consecutive k.
NIBBLE_OF_ELEMENT = np.array([(e >> 1) + 4 * (e & 1) for e in range(8)], dtype=np.uint32)


def pack_w4(q: np.ndarray) -> np.ndarray:
    """q [N, K] integers in 0..15 (K % 32 == 0) -> uint32 [K / 32, N, 4]."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] % W4_TILE_K:
        raise ValueError(f"q must be [N, K] with K % {W4_TILE_K} == 0, got {q.shape}")
    if q.size and (q.min() < 0 or q.max() > 15):
        raise ValueError("4-bit values must lie in 0..15")
    N, K = q.shape
    # [N, K] -> [N, K/32, 4, 8] -> [K/32, N, 4, 8]
    e = q.astype(np.uint32).reshape(N, K // W4_TILE_K, W4_WORDS, 8).transpose(1, 0, 2, 3)
    words = np.bitwise_or.reduce(e << (4 * NIBBLE_OF_ELEMENT), axis=-1)
    return np.ascontiguousarray(words, dtype=np.uint32)


def unpack_w4(qweight: np.ndarray) -> np.ndarray:
    """uint32 [K / 32, N, 4] -> q [N, K] uint8 (the inverse of pack_w4)."""
    kt, N, w = qweight.shape
    if w != W4_WORDS:
        raise ValueError(f"qweight must be [K / 32, N, {W4_WORDS}], got {qweight.shape}")
    e = (qweight[..., None] >> (4 * NIBBLE_OF_ELEMENT)) & 0xF      # [K/32, N, 4, 8]
    return np.ascontiguousarray(e.transpose(1, 0, 2, 3).reshape(N, kt * W4_TILE_K)
                                .astype(np.uint8))


def pack_w8(q: np.ndarray) -> np.ndarray:
    """q [N, K] integers in -128..127 -> contiguous int8 [N, K] (the kernel's layout)."""
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"q must be [N, K], got {q.shape}")
    if q.size and (q.min() < -128 or q.max() > 127):
        raise ValueError("8-bit values must lie in -128..127")
    return np.ascontiguousarray(q, dtype=np.int8)


__all__ = ["NIBBLE_OF_ELEMENT", "W4_TILE_K", "pack_w4", "pack_w8", "unpack_w4"]
