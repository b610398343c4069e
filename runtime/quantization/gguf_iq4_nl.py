"""GGUF IQ4_NL served kept quantized, as Q8_0 blocks of the same values (the Q8_0 kernel).

IQ4_NL (ggml's block_iq4_nl, 18 bytes per 32 weights): fp16 d, then 16 bytes of nibbles; byte i
holds weight i in its low nibble and weight 16 + i in its high one, and a nibble q stands for
d * IQ4_NL_VALUES[q], a fixed non-uniform table of 16 int8 values. Q8_0 (34 bytes per 32
weights) is fp16 d and 32 int8 q standing for d * q: the table's values are int8, so the Q8_0
block with the same d and q_i = IQ4_NL_VALUES[nibble_i] holds exactly the same weights, and the
cpu Q8_0 kernel computes on them unchanged (d * sum(q * qx) * dx: the same arithmetic as any
Q8_0 file). It costs Q8_0's 1.0625 bytes a weight against the file's 0.5625 (still about half
of bf16's); the embedding table, looked up row by row, stays in the file's IQ4_NL blocks.

The table is the gguf library's (gguf.quants.IQ4_NL.kvalues), which also dequantizes IQ4_NL
for the reference: tests/engine/test_gguf_iq4_nl.py checks the repack against it.
"""
from __future__ import annotations

import numpy as np

from .gguf_blocks import register_block_repack

IQ4_NL = "IQ4_NL"
IQ4_NL_BLOCK_BYTES = 18  # fp16 d, 16 bytes of nibbles, per 32 weights
Q8_0_BLOCK_BYTES = 34    # fp16 d, 32 int8 q, per 32 weights


def iq4_nl_values() -> np.ndarray:
    """The 16 int8 values an IQ4_NL nibble indexes (gguf's table)."""
    from gguf.quants import IQ4_NL as gguf_iq4_nl

    return np.asarray(gguf_iq4_nl.kvalues, dtype=np.int8)


def iq4_nl_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """IQ4_NL rows uint8 [out, in / 32 * 18] -> Q8_0 rows uint8 [out, in / 32 * 34] of exactly
    the same values (module doc)."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % IQ4_NL_BLOCK_BYTES:
        raise ValueError(f"IQ4_NL rows must be uint8 [out, blocks * {IQ4_NL_BLOCK_BYTES}], "
                         f"got {raw.dtype} {raw.shape}")
    out_rows, num_blocks = raw.shape[0], raw.shape[1] // IQ4_NL_BLOCK_BYTES
    blocks = raw.reshape(out_rows, num_blocks, IQ4_NL_BLOCK_BYTES)
    nibbles = blocks[:, :, 2:]
    index = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=2)
    q = iq4_nl_values()[index].view(np.uint8)  # weights 0..15 low nibbles, 16..31 high
    return np.concatenate([blocks[:, :, :2], q], axis=2).reshape(
        out_rows, num_blocks * Q8_0_BLOCK_BYTES)


register_block_repack(IQ4_NL, "Q8_0", iq4_nl_as_q8_0)
