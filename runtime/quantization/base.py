"""LinearMethod and the method registry: what a linear layer needs to know about the form of its
weights, looked up by EngineConfig.quantization's name (as the engine resolved it from the config
or the checkpoint: model_loader.resolve_quantization).

A method answers four questions, so that neither the loader nor the model names a format:
- load: `read_linears(model_dir, config, gguf_file)` -- the GEMM matrices the checkpoint stores
  in the method's form, {HF ".weight" name: matrix}, which the float32 loader uses in place of
  those tensors (runtime/weights.py); `attach(weights, linears, gguf_file)` after that load;
- create: `create_weights(ops, *matrices)` -- HF [out, in] parts fused along out (q/k/v,
  gate/up) -> what the backend's `linear` takes (`ops.linear_weight` packs it: the cpu GGUF
  kernel's tiles, the sim / cuda W4A16 layouts of backends/weight_only.py, bf16 or int8 copies);
- apply: `apply(ops, x, weight, bias)` -- the GEMM over that weight;
- embed: `embedding_table(table)` / `embed(ops, token_ids, table)` -- a table kept in blocks is
  looked up by dequantizing only the rows a step reads.

Each method is one module of this package registering its object at import (the package's
__init__ imports them all); a GGUF block type that an existing kernel serves after an exact
repack registers with the gguf method instead (gguf_blocks.register_block_repack).

Which method a backend serves is its `quantization` name (CpuGgufBackend: "gguf" / "awq" /
"gptq", the kernel backends: "awq" / "gptq" / "int8", the int8 cpu backend: "int8"; none:
"none"); `linear_method_for(ops)` reads it.
"""
from __future__ import annotations

import functools

import numpy as np

from .blocks import InputPermuted, QuantizedMatrix, dense

NONE = "none"  # EngineConfig.quantization's "the dtype's own weights"

_METHODS: dict[str, "LinearMethod"] = {}


def _stacked_t(*matrices: np.ndarray) -> np.ndarray:
    """HF [out, in] matrices stacked along out, as one contiguous float32 [in, sum(out)]."""
    return np.ascontiguousarray(np.concatenate(matrices, axis=0).T, dtype=np.float32)


class LinearMethod:
    """The dtype's own weights (quantization "none"); the base of every method. A quantized
    matrix reaching it anyway (a test's weights on a float backend) is dequantized."""

    name = NONE

    def read_linears(self, model_dir, config, gguf_file=None) -> dict | None:
        """{HF ".weight" name: matrix} read in this method's form, or None (the float32 load
        reads every tensor). gguf_file: the .gguf the model is, when it is one."""
        return None

    def attach(self, weights, linears: dict | None, gguf_file=None) -> None:
        """After the float32 load: put `linears` where the load could not (nothing here)."""

    def create_weights(self, ops, *matrices):
        """What the backend's linear takes for HF [out, in] `matrices` fused along out: the
        float32 [in, out] storage's free `.T` view handed to ops.linear_weight."""
        return ops.linear_weight(_stacked_t(*(dense(m) for m in matrices)).T)

    def apply(self, ops, x, weight, bias=None, *, out_dtype=None):
        """x [num_tokens, in] @ weight.T (+ bias): [num_tokens, out]."""
        if out_dtype is None:
            return ops.linear(x, weight, bias)
        return ops.linear(x, weight, bias, out_dtype=out_dtype)

    def bind(self, ops):
        """apply with `ops` bound: (x, weight, bias=None) -> y. ops.linear itself where this
        method's apply adds nothing to it, so the forward calls the backend directly."""
        if type(self).apply is LinearMethod.apply:
            return ops.linear
        return functools.partial(self.apply, ops)

    def gathers_inputs(self, weight) -> bool:
        """Whether `weight`'s apply gathers its inputs on the host first (the sim harness's
        decode graphs would not record that step)."""
        return False

    def embedding_table(self, table):
        """The table the model keeps: a block-quantized one as it is (embed dequantizes the
        rows a step reads), else contiguous float32."""
        if table is None or isinstance(table, QuantizedMatrix):
            return table
        return np.ascontiguousarray(table, dtype=np.float32)

    def embed(self, ops, token_ids, table):
        """[num_tokens] int32 -> [num_tokens, hidden] activations."""
        if isinstance(table, QuantizedMatrix):  # host arrays: the cpu backends
            return table.dequantize_rows(token_ids)
        return ops.embedding(token_ids, table)


class KeptQuantizedMethod(LinearMethod):
    """Matrices kept in their blocks for a backend that computes on them: the parts of a fused
    matrix stacked into one QuantizedMatrix when they share a type (and, act-order int4, one
    input order: then an InputPermuted); otherwise they are dequantized."""

    def kernel_form(self, matrix: QuantizedMatrix) -> QuantizedMatrix:
        """The matrix as the backend takes it (a subclass repacks types that need it)."""
        return matrix

    def create_weights(self, ops, *matrices):
        if not any(isinstance(m, QuantizedMatrix) for m in matrices):
            return super().create_weights(ops, *matrices)
        matrices = tuple(self.kernel_form(m) if isinstance(m, QuantizedMatrix) else m
                         for m in matrices)
        perms = [getattr(m, "input_perm", None) for m in matrices]
        one_order = all(p is None for p in perms) or all(
            p is not None and np.array_equal(p, perms[0]) for p in perms)
        stacked = QuantizedMatrix.stack(matrices) if one_order else None
        if stacked is None:
            return super().create_weights(ops, *matrices)
        if perms[0] is None:
            return ops.linear_weight(stacked)
        return InputPermuted(ops.linear_weight(stacked), ops.xp.asarray(perms[0]))

    def apply(self, ops, x, weight, bias=None, *, out_dtype=None):
        if type(weight) is InputPermuted:  # y = W x = W[:, perm] x[perm]
            x, weight = ops.xp.take(x, weight.perm, axis=1), weight.weight
        return super().apply(ops, x, weight, bias, out_dtype=out_dtype)

    def gathers_inputs(self, weight) -> bool:
        return type(weight) is InputPermuted


def register(method: LinearMethod) -> LinearMethod:
    """Make `method` the one served under method.name (a second one of that name is a bug)."""
    if method.name in _METHODS:
        raise ValueError(f"quantization method {method.name!r} is registered twice")
    _METHODS[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    return tuple(_METHODS)


def get_method(name: str | None) -> LinearMethod:
    """The method registered under `name` (None: "none"); KeyError naming the known ones."""
    key = NONE if name is None else name
    if key not in _METHODS:
        raise KeyError(f"quantization {key!r} has no method; registered: {method_names()}")
    return _METHODS[key]


def linear_method_for(ops) -> LinearMethod:
    """The method of the weights backend `ops` serves: its `quantization` name (Backend
    protocol; None: "none")."""
    return get_method(ops.quantization)


register(LinearMethod())
