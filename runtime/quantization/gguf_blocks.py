"""GGUF weights kept quantized (EngineConfig.quantization "gguf"): the GEMM matrices of a .gguf
file as the blocks the file stores, for a backend that computes on them directly.

    quantized = read_quantized_linears("m.gguf", config)   # {HF name: QuantizedMatrix}
    attach_quantized(weights, quantized)                    # into a loaded ModelWeights

The float32 load (runtime/gguf_convert.py: dequantize, rename, undo llama.cpp's q/k row
permutation) stays the reference and still provides everything else (norms, biases); this
module swaps in the quantized form of the matrices the model multiplies by -- q/k/v/o,
gate/up/down, the LM head (token_embd when the embeddings are tied) -- and of the embedding
table, whose lookup dequantizes only the rows it reads.

A GGUF matrix is row-major in HF's [out, in] order with each row's `in` weights cut into blocks
along `in`, so row operations are exact on the raw bytes: the q/k unpermutation is a row
permutation of the blocks, and the fused QKV / gate-up matrices are row concatenations of
matrices of one type (stack() refuses mixed types; the model then dequantizes those parts).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedrun.runtime.errors import ModelLoadError

# The LayerWeights fields a GGUF can hold quantized (HF names model.layers.N.{prefix}{name}).
_LAYER_LINEARS = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass
class QuantizedMatrix:
    """An HF [out, in] matrix in a GGUF block type: raw [out, row_bytes] uint8, row n the
    blocks of output channel n exactly as the file stores them."""

    ggml_type: str          # the GGMLQuantizationType's name, e.g. "Q4_1"
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


def read_quantized_linears(gguf_path: str | os.PathLike, config) -> dict[str, QuantizedMatrix]:
    """{HF tensor name: QuantizedMatrix} for every 2-D GEMM matrix of `gguf_path` stored in a
    block type (float tensors are left to the float32 load); q/k rows put back in HF's order
    as gguf_convert does. `config`: the ModelConfig the float32 load made from the same file."""
    from pagedrun.runtime.gguf_convert import (_ARCHITECTURES, hf_tensor_name,
                                               unpermute_rotary_rows)
    from pagedrun.runtime.gguf_index import GgufIndex

    index = GgufIndex(gguf_path)
    architecture = index.get("general.architecture")
    if architecture not in _ARCHITECTURES:
        raise ModelLoadError(gguf_path, f"GGUF architecture {architecture!r} is not served",
                             field="general.architecture")
    _, _, permuted = _ARCHITECTURES[architecture]
    heads = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
    out: dict[str, QuantizedMatrix] = {}
    for tensor in index.tensors:
        kind = tensor.type_name
        name = hf_tensor_name(tensor.name, architecture)
        if kind in _FLOAT_TYPES or name is None or len(tensor.shape) != 2:
            continue
        if not (name in ("model.embed_tokens.weight", "lm_head.weight")
                or name.split(".", 3)[-1] in _LAYER_LINEARS):
            continue
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGML's order is reversed
        # A read-only view of the file's map (no copy: what the cpu backend does not repack,
        # the embedding table's blocks, stays file-backed pages).
        raw = tensor.data.reshape(shape[0], -1)
        matrix = QuantizedMatrix(kind, shape, raw,
                                 release=functools.partial(index.drop_pages, tensor))
        for marker, num_heads in heads.items():
            if permuted and marker in tensor.name:
                matrix = matrix.take_rows(unpermute_rotary_rows(np.arange(shape[0]), num_heads))
        out[name] = matrix
    return out


def attach_quantized(weights, quantized: dict[str, QuantizedMatrix],
                     path: str | os.PathLike | None = None) -> int:
    """Swap the matrices `quantized` holds into `weights` (a ModelWeights loaded from the same
    file), checking each shape against the float32 load's. The LM head of a tied model is
    token_embd's quantized form, and so is the embedding table (looked up row by row). Returns
    the number of matrices swapped."""
    count = 0

    def swap(current: Any, name: str) -> Any:
        nonlocal count
        matrix = quantized.get(name)
        if matrix is None or current is None:
            return current
        if tuple(current.shape) != matrix.shape:
            raise ModelLoadError(path, f"quantized shape {matrix.shape} != the float32 load's "
                                 f"{tuple(current.shape)}", tensor=name)
        count += 1
        return matrix

    for index, layer in enumerate(weights.layers):
        prefix = f"model.layers.{index}."
        for suffix, name in _LAYER_LINEARS.items():
            setattr(layer, name, swap(getattr(layer, name), prefix + suffix))
    tied = weights.lm_head is weights.embed_tokens
    weights.lm_head = swap(weights.lm_head, "model.embed_tokens.weight" if tied
                           else "lm_head.weight")
    # The embedding lookup dequantizes only the rows a step reads (llama.py), so the float32
    # table (vocab x hidden x 4 bytes) is not kept.
    weights.embed_tokens = swap(weights.embed_tokens, "model.embed_tokens.weight")
    return count
