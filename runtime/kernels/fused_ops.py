"""Launch wrappers of the small fused ops: RMSNorm (+ residual add), SiLU·mul, embedding gather.

    norm = load_module("rms_norm.cu", backend="sim")          # or "cuda"
    out = rms_norm(norm, x, weight, eps)
    out, residual = fused_add_rms_norm(norm, x, residual, weight, eps)   # residual f32, in place
    out = silu_and_mul(load_module("activation.cu"), gate_up)
    out = embedding(load_module("embedding.cu"), token_ids, table)

Arguments mirror runtime/backends/numpy_ops.py (the reference); activations are float32,
float16 or uint16 bf16 bits; the residual stream is float32 whatever the activation dtype.
Arrays are numpy under the CPU harness and cupy on a GPU; unsupported inputs raise
UnsupportedKernelShape before launching.
"""
from __future__ import annotations

import numpy as np

from .kernel_args import (VEC16_BYTES, array_module, ceil_div, dtype_suffix, from_bf16_bits,
                          require, require_contiguous, require_int32, vec16_aligned)

NORM_THREADS = 256
ACTIVATION_THREADS = 256
EMBEDDING_THREADS = 256


def _check_rows(name: str, x) -> tuple[int, int]:
    require(x.ndim == 2, lambda: f"{name} must be [num_tokens, hidden], got {x.shape}")
    require_contiguous(name, x)
    return x.shape


def _check_weight(weight, x, hidden: int) -> None:
    require(weight.shape == (hidden,) and weight.dtype == x.dtype,
            lambda: f"weight must be [{hidden}] {x.dtype}, got {weight.shape} {weight.dtype}")
    require_contiguous("weight", weight)


def to_float32(x):
    """float32 copy of an activation array (bf16 bits decoded); float32 input is returned as is."""
    if np.dtype(x.dtype) == np.float32:
        return x
    if np.dtype(x.dtype) == np.uint16:
        return from_bf16_bits(x)
    return x.astype(np.float32)


def rms_norm(module, x, weight, eps: float, out=None):
    """x [num_tokens, hidden] -> x * rsqrt(mean(x^2) + eps) * weight, same dtype as x."""
    suffix = dtype_suffix(x)
    num_tokens, hidden = _check_rows("x", x)
    _check_weight(weight, x, hidden)
    xp = array_module(x)
    out = xp.empty_like(x) if out is None else out
    require(out.shape == x.shape and out.dtype == x.dtype, "out must match x")
    if num_tokens:
        module.get_function(f"rms_norm_{suffix}")(
            (num_tokens,), (NORM_THREADS,), (out, x, weight, np.int32(hidden), np.float32(eps)))
    return out


def fused_add_rms_norm(module, x, residual, weight, eps: float, out=None, residual_out=None):
    """r = x + residual (float32), out = rms_norm(r); returns (out, r).

    x: [num_tokens, hidden] activations; residual: [num_tokens, hidden], float32 or x's dtype
    (converted to float32 first). r is written to residual_out when given (float32, may be the
    residual itself), else in place into a float32 residual, else into the converted copy.
    """
    suffix = dtype_suffix(x)
    num_tokens, hidden = _check_rows("x", x)
    _check_weight(weight, x, hidden)
    require(residual.shape == x.shape, lambda: f"residual {residual.shape} must match x {x.shape}")
    residual = to_float32(residual)
    require_contiguous("residual", residual)
    if residual_out is None:
        # float32 x passed as its own residual: keep x intact
        residual_out = residual.copy() if residual is x else residual
    require(residual_out.shape == x.shape and np.dtype(residual_out.dtype) == np.float32,
            lambda: f"residual_out must be {x.shape} float32")
    require_contiguous("residual_out", residual_out)
    xp = array_module(x)
    out = xp.empty_like(x) if out is None else out
    require(out.shape == x.shape and out.dtype == x.dtype, "out must match x")
    if num_tokens:
        module.get_function(f"fused_add_rms_norm_{suffix}")(
            (num_tokens,), (NORM_THREADS,),
            (out, residual_out, residual, x, weight, np.int32(hidden), np.float32(eps)))
    return out, residual_out


def silu_and_mul(module, gate_up, out=None):
    """gate_up [num_tokens, 2 * intermediate] -> silu(gate) * up [num_tokens, intermediate]."""
    return _act_and_mul(module, "silu_and_mul", gate_up, out)


def gelu_tanh_and_mul(module, gate_up, out=None):
    """gate_up [num_tokens, 2 * intermediate] -> gelu_tanh(gate) * up [num_tokens,
    intermediate] (Gemma's GeGLU; numpy_ops.gelu_tanh_and_mul)."""
    return _act_and_mul(module, "gelu_tanh_and_mul", gate_up, out)


def _act_and_mul(module, kernel: str, gate_up, out):
    suffix = dtype_suffix(gate_up)
    num_tokens, width = _check_rows("gate_up", gate_up)
    require(width % 2 == 0, lambda: f"gate_up width {width} is odd")
    intermediate = width // 2
    xp = array_module(gate_up)
    out = xp.empty((num_tokens, intermediate), dtype=gate_up.dtype) if out is None else out
    require(out.shape == (num_tokens, intermediate) and out.dtype == gate_up.dtype,
            "out must be [num_tokens, intermediate] in gate_up's dtype")
    require_contiguous("out", out)  # the kernel writes rows of `intermediate` at its pointer
    if num_tokens and intermediate:
        # 16-byte units when every row's gate and up halves start on 16-byte boundaries
        # (cuda/activation.cu); element-wise otherwise.
        vec = VEC16_BYTES // gate_up.itemsize
        if intermediate % vec == 0 and vec16_aligned(gate_up, out):
            name, columns = f"{kernel}_{suffix}", intermediate // vec
        else:
            name, columns = f"{kernel}_{suffix}_unaligned", intermediate
        module.get_function(name)(
            (num_tokens, ceil_div(columns, ACTIVATION_THREADS)), (ACTIVATION_THREADS,),
            (out, gate_up, np.int32(intermediate)))
    return out


def embedding(module, token_ids, table, out=None):
    """token_ids [num_tokens] int32 -> table rows [num_tokens, hidden].

    Host (numpy) ids are range-checked here (ValueError, like numpy_ops); on the device an
    out-of-range id yields a NaN row rather than a wild read.
    """
    suffix = dtype_suffix(table)
    require(table.ndim == 2, lambda: f"table must be [vocab, hidden], got {table.shape}")
    require_contiguous("table", table)
    require_int32("token_ids", token_ids, 1)
    vocab, hidden = table.shape
    if isinstance(token_ids, np.ndarray) and token_ids.size and (
            token_ids.min() < 0 or token_ids.max() >= vocab):
        raise ValueError(f"token id out of range [0, {vocab})")
    xp = array_module(table)
    num_tokens = token_ids.shape[0]
    out = xp.empty((num_tokens, hidden), dtype=table.dtype) if out is None else out
    require(out.shape == (num_tokens, hidden) and out.dtype == table.dtype,
            "out must be [num_tokens, hidden] in the table's dtype")
    require_contiguous("out", out)  # the kernel writes rows of `hidden` at its pointer
    if num_tokens:
        # 16-byte units when the rows allow (cuda/embedding.cu); element-wise otherwise.
        units = (hidden * table.itemsize) % VEC16_BYTES == 0 and vec16_aligned(table, out)
        module.get_function(f"embedding_{suffix}" + ("" if units else "_unaligned"))(
            (num_tokens,), (EMBEDDING_THREADS,),
            (out, token_ids, table, np.int32(hidden), np.int32(vocab)))
    return out


__all__ = ["embedding", "fused_add_rms_norm", "rms_norm", "silu_and_mul", "to_float32"]
