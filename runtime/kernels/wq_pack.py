"""Host-side packers of weight-only quantized GEMM weights (numpy): from the logical q / s / z
to the layouts cuda/gemm_wq.cu reads, and back (the tests' reference and a debugging aid).

    qweight = pack_w4(q4)                  # q4 [N, K] uint8 in 0..15 -> uint32 [K/32, Ng, 32, 4]
    qweight = pack_w8(q8)                  # q8 [N, K] int8 -> uint32 [K/32, Ng, 32, 8]
    scales = pack_groups(s)                # s [K / g, N] -> [K / g, Ng * 32] (same dtype)
    zeros = pack_groups(z)                 # z [K / g, N] uint8 -> [K / g, Ng * 32] uint8 (W4)
    q4 = unpack_w4(qweight, n)             # the inverses
    q8 = unpack_w8(qweight, n)
    s = unpack_groups(scales, n)

W4 layout (also in the kernel header): the mma fragments, pre-shuffled. Ng = ceil(N / 32)
column groups of 32 output rows, N padded with zero rows. Within a 32-k tile kt, thread `lane`
of the warp that owns column group ng holds 4 words, one per n8 tile j = 0..3: word
[kt, ng, lane, j] holds the 8 consecutive k = kt*32 + 8 (lane % 4) + e, e = 0..7, of weight row
n = ng*32 + 8j + lane // 4, element e in nibble (e >> 1) + 4 (e & 1) -- nibbles hold elements
0,2,4,6,1,3,5,7, so pair (2i, 2i + 1) is `(word >> 4i) & 0x000f000f`. Those are exactly the
B-fragment values of two m16n8k16 steps once k is permuted within the tile (the kernel permutes
the activations' k the same way), so one 16-byte load per thread feeds 8 mma and nothing passes
through shared memory on the decode path.

W8 layout: the same fragments, a byte per weight. Word [kt, ng, lane, 2j + h] holds the 4
consecutive k = kt*32 + 8 (lane % 4) + 4h + b, b = 0..3 (byte b), of row ng*32 + 8j + lane // 4:
a lane's 32 bytes (two 16-byte loads) per (k-tile, column group).

Group arrays (scales in the activation dtype, W4's zeros uint8), [K / g, Ng * 32]: within each
group of 32 columns, column 4r + j holds column 8j + r (r = lane // 4), so a thread's four n8
tiles' scales are one 8-byte load and its zeros one 4-byte load; padded columns are 0.
"""
from __future__ import annotations

import numpy as np

W4_TILE_K = 32          # k per packed tile (the kernel's K granularity)
W4_GROUP_N = 32         # output rows per column group (one warp's n tile)
W4_LANES = 32
W4_WORDS = 4            # words per lane per (k-tile, column group): one per n8 tile
W8_WORDS = 8            # W8: two per n8 tile
# NIBBLE_OF_ELEMENT[e]: the nibble of a word holding element e of its 8 consecutive k.
NIBBLE_OF_ELEMENT = np.array([(e >> 1) + 4 * (e & 1) for e in range(8)], dtype=np.uint32)


def num_column_groups(n: int) -> int:
    return -(-n // W4_GROUP_N)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
    out[:a.shape[0]] = a
    return out


def pack_w4(q: np.ndarray) -> np.ndarray:
    """q [N, K] integers in 0..15 (K % 32 == 0) -> uint32 [K / 32, ceil(N / 32), 32, 4]."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] % W4_TILE_K:
        raise ValueError(f"q must be [N, K] with K % {W4_TILE_K} == 0, got {q.shape}")
    if q.size and (q.min() < 0 or q.max() > 15):
        raise ValueError("4-bit values must lie in 0..15")
    N, K = q.shape
    ng = num_column_groups(N)
    q = _pad_rows(q.astype(np.uint32), ng * W4_GROUP_N)
    # row n = ng*32 + 8j + r, k = kt*32 + 8c + e  ->  [kt, ng, r, c, j, e]
    e = q.reshape(ng, 4, 8, K // W4_TILE_K, 4, 8).transpose(3, 0, 2, 4, 1, 5)
    words = np.bitwise_or.reduce(e << (4 * NIBBLE_OF_ELEMENT), axis=-1)   # [kt, ng, r, c, j]
    return np.ascontiguousarray(words.reshape(K // W4_TILE_K, ng, W4_LANES, W4_WORDS),
                                dtype=np.uint32)


def unpack_w4(qweight: np.ndarray, n: int) -> np.ndarray:
    """uint32 [K / 32, Ng, 32, 4] -> q [n, K] uint8 (the inverse of pack_w4)."""
    if qweight.ndim != 4 or qweight.shape[2:] != (W4_LANES, W4_WORDS):
        raise ValueError(f"qweight must be [K / 32, Ng, {W4_LANES}, {W4_WORDS}], got "
                         f"{qweight.shape}")
    kt, ng = qweight.shape[:2]
    words = qweight.reshape(kt, ng, 8, 4, W4_WORDS)                         # [kt, ng, r, c, j]
    e = (words[..., None] >> (4 * NIBBLE_OF_ELEMENT)) & 0xF               # [..., e]
    q = e.transpose(1, 4, 2, 0, 3, 5).reshape(ng * W4_GROUP_N, kt * W4_TILE_K)
    return np.ascontiguousarray(q[:n].astype(np.uint8))


def pack_groups(a: np.ndarray) -> np.ndarray:
    """Per-group scales or zeros [K / g, N] -> [K / g, ceil(N / 32) * 32], columns of each group
    of 32 in the order 8j + r at position 4r + j, padded with 0."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"group array must be [K / g, N], got {a.shape}")
    groups, N = a.shape
    ng = num_column_groups(N)
    padded = _pad_rows(a.T, ng * W4_GROUP_N).T                            # [groups, ng*32]
    shuffled = padded.reshape(groups, ng, 4, 8).transpose(0, 1, 3, 2)    # [.., r, j]
    return np.ascontiguousarray(shuffled.reshape(groups, ng * W4_GROUP_N))


def unpack_groups(a: np.ndarray, n: int) -> np.ndarray:
    """The inverse of pack_groups: [K / g, Ng * 32] -> [K / g, n]."""
    groups, width = a.shape
    plain = a.reshape(groups, width // W4_GROUP_N, 8, 4).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(plain.reshape(groups, width)[:, :n])


def pack_w8(q: np.ndarray) -> np.ndarray:
    """q [N, K] integers in -128..127 (K % 32 == 0) -> uint32 [K / 32, ceil(N / 32), 32, 8]."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] % W4_TILE_K:
        raise ValueError(f"q must be [N, K] with K % {W4_TILE_K} == 0, got {q.shape}")
    if q.size and (q.min() < -128 or q.max() > 127):
        raise ValueError("8-bit values must lie in -128..127")
    N, K = q.shape
    ng = num_column_groups(N)
    b = _pad_rows(q.astype(np.int8), ng * W4_GROUP_N).view(np.uint8)
    # row n = ng*32 + 8j + r, k = kt*32 + 8c + 4h + byte  ->  [kt, ng, r, c, j, h, byte]
    e = b.reshape(ng, 4, 8, K // W4_TILE_K, 4, 2, 4).transpose(3, 0, 2, 4, 1, 5, 6)
    return np.ascontiguousarray(e).view(np.uint32).reshape(K // W4_TILE_K, ng, W4_LANES,
                                                           W8_WORDS)


def unpack_w8(qweight: np.ndarray, n: int) -> np.ndarray:
    """uint32 [K / 32, Ng, 32, 8] -> q [n, K] int8 (the inverse of pack_w8)."""
    if qweight.ndim != 4 or qweight.shape[2:] != (W4_LANES, W8_WORDS):
        raise ValueError(f"qweight must be [K / 32, Ng, {W4_LANES}, {W8_WORDS}], got "
                         f"{qweight.shape}")
    kt, ng = qweight.shape[:2]
    e = np.ascontiguousarray(qweight).view(np.int8).reshape(kt, ng, 8, 4, 4, 2, 4)
    q = e.transpose(1, 4, 2, 0, 3, 5, 6).reshape(ng * W4_GROUP_N, kt * W4_TILE_K)
    return np.ascontiguousarray(q[:n])


__all__ = ["NIBBLE_OF_ELEMENT", "W4_GROUP_N", "W4_LANES", "W4_TILE_K", "W4_WORDS", "W8_WORDS",
           "num_column_groups", "pack_groups", "pack_w4", "pack_w8", "unpack_groups",
           "unpack_w4", "unpack_w8"]
