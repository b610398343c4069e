"""The quantized matrix a loader hands on: an HF [out, in] matrix as rows of blocks of one type
(a GGUF block type, or cpu_gemm's own "I4Z" for AWQ / GPTQ int4), and the weight whose inputs
are gathered before its GEMM (act-order GPTQ). Format-neutral containers: the formats that
fill them live beside this module (gguf_blocks.py, hf_int4.py), the methods that hand them to
a backend in base.py.

A block type keeps each row's `in` weights in blocks along `in`, so row operations are exact on
the raw bytes: a row permutation (llama.cpp's q/k order undone) permutes the rows, and a fused
QKV / gate-up matrix is the row concatenation of matrices of one type (stack() refuses mixed
types or widths; the method then dequantizes those parts).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass
class QuantizedMatrix:
    """An HF [out, in] matrix in a block type: raw [out, row_bytes] uint8, row n the blocks of
    output channel n exactly as the file stores them."""

    ggml_type: str          # the block type's name, e.g. "Q4_1" (GGMLQuantizationType) or "I4Z"
    shape: tuple[int, int]  # (out, in)
    raw: np.ndarray         # uint8 [out, row_bytes]
    # Drops the resident file pages this matrix was read from (GgufIndex.drop_pages), for the
    # backend to call once it has repacked the matrix; None: nothing to drop.
    # (keyword-only: a subclass's own fields, Int4Matrix's input_perm, stay positional)
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False,
                                                kw_only=True)

    def release_pages(self) -> None:
        if self.release is not None:
            self.release()

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 [out, in] through the gguf library (the reference dequantization)."""
        import gguf

        values = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.ggml_type])
        return np.ascontiguousarray(values.reshape(self.shape), dtype=np.float32)

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """float32 [len(rows), in] of the given rows only (an embedding lookup)."""
        import gguf

        picked = self.raw[np.asarray(rows, dtype=np.intp).reshape(-1)]
        values = gguf.quants.dequantize(picked, gguf.GGMLQuantizationType[self.ggml_type])
        return np.ascontiguousarray(values.reshape(picked.shape[0], self.shape[1]),
                                    dtype=np.float32)

    def take_rows(self, rows: np.ndarray) -> "QuantizedMatrix":
        rows = np.asarray(rows)
        return QuantizedMatrix(self.ggml_type, (int(rows.size), self.shape[1]),
                               np.ascontiguousarray(self.raw[rows]), release=self.release)

    @staticmethod
    def stack(matrices) -> "QuantizedMatrix | None":
        """The row concatenation of quantized matrices of one type and width; None when any
        is not a QuantizedMatrix or the types or widths differ."""
        matrices = list(matrices)
        if not all(isinstance(m, QuantizedMatrix) for m in matrices):
            return None
        first = matrices[0]
        if any(m.ggml_type != first.ggml_type or m.shape[1] != first.shape[1]
               for m in matrices):
            return None
        if len(matrices) == 1:
            return first
        releases = [m.release for m in matrices if m.release is not None]
        return QuantizedMatrix(first.ggml_type, (sum(m.shape[0] for m in matrices),
                                                 first.shape[1]),
                               np.concatenate([m.raw for m in matrices], axis=0),
                               release=(lambda: [r() for r in releases]) if releases else None)


def dense(matrix) -> np.ndarray:
    """A weight as a float array: a QuantizedMatrix dequantized, anything else as it is."""
    return matrix.dequantize() if isinstance(matrix, QuantizedMatrix) else matrix


class InputPermuted(NamedTuple):
    """A packed weight whose column j multiplies input perm[j] (an act-order GPTQ matrix kept
    int4, hf_int4.py): the method's apply gathers x[:, perm] before the GEMM."""

    weight: object  # what ops.linear_weight returned
    perm: object    # int64 [in] in ops.xp
