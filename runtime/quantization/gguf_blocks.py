"""GGUF weights kept quantized (EngineConfig.quantization "gguf"): the GEMM matrices of a .gguf
file as the blocks the file stores, for a backend that computes on them directly
(runtime/backends/cpu_gguf_backend.py), and the method that hands them over.

    quantized = read_quantized_linears("m.gguf", config)   # {HF name: QuantizedMatrix}
    attach_quantized(weights, quantized)                    # into a loaded ModelWeights

The float32 load (runtime/gguf_convert.py: dequantize, rename, undo llama.cpp's q/k row
permutation) stays the reference and still provides everything else (norms, biases); this
module swaps in the quantized form of the matrices the model multiplies by -- q/k/v/o,
gate/up/down, the LM head (token_embd when the embeddings are tied) -- and of the embedding
table, whose lookup dequantizes only the rows it reads. A GGUF matrix is row-major in HF's
[out, in] order with each row's `in` weights in blocks along `in` (blocks.py): the q/k
unpermutation is a row permutation of the blocks.

The block types the cpu kernel computes on are pagedrun.pyx.cpu_gemm.GGUF_NATIVE_TYPES (some
through a repack inside PackedGgufWeight: Q5_0 as Q8_0, Q3_K as Q6_K). A type whose values an
existing kernel type holds exactly can be served by registering its repack here
(`register_block_repack(file_type, kernel_type, convert)`, one module per type): the method
converts a matrix's raw rows at load, before stacking, so the backend sees the kernel's type.
Any other type is dequantized by the backend (logged once).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedrun.runtime.errors import ModelLoadError

from .base import KeptQuantizedMethod, register
from .blocks import QuantizedMatrix

GGUF = "gguf"  # EngineConfig.quantization's name for this method

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


# file block type -> (kernel block type, raw rows of the file type -> raw rows of the kernel
# type holding the same values exactly): register_block_repack's table.
_BLOCK_REPACKS: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {}


def register_block_repack(file_type: str, kernel_type: str,
                          convert: Callable[[np.ndarray], np.ndarray]) -> None:
    """Serve `file_type` matrices as `kernel_type` ones: convert(uint8 [out, file row bytes])
    -> uint8 [out, kernel row bytes] of exactly the same values (its module's test proves it
    against gguf's dequantization)."""
    if file_type in _BLOCK_REPACKS:
        raise ValueError(f"GGUF block type {file_type} has a repack already")
    _BLOCK_REPACKS[file_type] = (kernel_type, convert)


def block_repacks() -> dict[str, str]:
    """{file block type: kernel block type} of the registered repacks."""
    return {file_type: kind for file_type, (kind, _) in _BLOCK_REPACKS.items()}


class GgufMethod(KeptQuantizedMethod):
    """A .gguf file's GEMM matrices kept in its block types (module doc)."""

    name = GGUF

    def read_linears(self, model_dir, config, gguf_file=None):
        if gguf_file is None:
            raise ModelLoadError(model_dir, "quantization 'gguf' needs a .gguf model file "
                                 "(this is a Hugging Face directory: use --quantization int8 "
                                 "or none)")
        # The block matrices straight from the .gguf, so the float32 load reads only the rest
        # (norms, biases, float matrices): no float32 copy of a quantized weight is made.
        return read_quantized_linears(gguf_file, config)

    def attach(self, weights, linears, gguf_file=None) -> None:
        attach_quantized(weights, linears, gguf_file)

    def kernel_form(self, matrix: QuantizedMatrix) -> QuantizedMatrix:
        repack = _BLOCK_REPACKS.get(matrix.ggml_type)
        if repack is None:
            return matrix
        kind, convert = repack
        return QuantizedMatrix(kind, matrix.shape, np.ascontiguousarray(convert(matrix.raw)),
                               release=matrix.release)


register(GgufMethod())
