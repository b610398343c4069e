"""Rotary position embeddings (RoPE): the one implementation of the frequencies (rope scaling
included), the cos/sin tables and the rotation.

Used by the numpy reference forward (runtime/reference.py, checked against Hugging Face
transformers, which makes this module the checked one), by the paged model's cos/sin cache
(runtime/models/llama.py, the table every backend's rotary op reads) and by the numpy backend's
rotary op (runtime/backends/numpy_ops.py, what the CUDA kernels are tested against).

Convention (transformers' rotate_half, "neox"): pair i of a head is dims (i, i + head_dim / 2),
turned by `position * inv_freq[i]` radians, inv_freq[i] = rope_theta ** (-2i / head_dim).
Frequencies and angles are float64; the cache table is rounded once to float32.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# rope_scaling types ("rope_type", or the legacy "type" key of an HF dict).
ROPE_TYPE_DEFAULT = "default"
ROPE_TYPE_LINEAR = "linear"
ROPE_TYPE_LLAMA3 = "llama3"


def _scaling_value(scaling: Any, key: str, default: Any = None) -> Any:
    """A field of `scaling`: an HF rope_scaling dict or a model_config.RopeScaling."""
    if isinstance(scaling, Mapping):
        return scaling.get(key, default)
    return getattr(scaling, key, default)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: Any = None) -> np.ndarray:
    """Rotary inverse frequencies [head_dim // 2] float64, with `rope_scaling` applied.

    rope_scaling: None, a `model_config.RopeScaling`, or an HF `rope_scaling` dict. Types
    ("rope_type" or legacy "type"): None/"default", "linear" (divide by factor), "llama3"
    (Llama 3.1 wavelength bands, see `_llama3_scaled`). Others raise NotImplementedError
    rather than silently serving a wrong model.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (float(rope_theta) ** exponents)
    if not rope_scaling:
        return inv_freq
    kind = _scaling_value(rope_scaling, "rope_type", _scaling_value(rope_scaling, "type"))
    if kind in (None, ROPE_TYPE_DEFAULT):
        return inv_freq
    factor = float(_scaling_value(rope_scaling, "factor"))
    if kind == ROPE_TYPE_LINEAR:
        return inv_freq / factor
    if kind == ROPE_TYPE_LLAMA3:
        return _llama3_scaled(
            inv_freq, factor, float(_scaling_value(rope_scaling, "low_freq_factor")),
            float(_scaling_value(rope_scaling, "high_freq_factor")),
            float(_scaling_value(rope_scaling, "original_max_position_embeddings")))
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")


def _llama3_scaled(inv_freq: np.ndarray, factor: float, low_freq_factor: float,
                   high_freq_factor: float, old_context: float) -> np.ndarray:
    """Llama 3's frequency-dependent stretch: short wavelengths kept, long ones divided by
    `factor`, a linear blend (in 1/wavelength) across the band between."""
    wavelen = 2.0 * math.pi / inv_freq
    short_wavelen = old_context / high_freq_factor  # below: unchanged
    long_wavelen = old_context / low_freq_factor    # above: divided by factor
    # 0 at wavelen == long_wavelen, 1 at wavelen == short_wavelen.
    blend = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1.0 - blend) * inv_freq / factor + blend * inv_freq
    return np.where(wavelen < short_wavelen, inv_freq,
                    np.where(wavelen > long_wavelen, inv_freq / factor, blended))


def model_inv_freq(config, layer_index: int | None = None) -> np.ndarray:
    """`rope_inv_freq` of a `ModelConfig` (its head_dim, rope_theta and rope_scaling); for a
    Gemma 3 local layer (`config.is_local_layer(layer_index)`), its own unscaled base
    `local_rope_theta` instead."""
    if layer_index is not None and config.is_local_layer(layer_index):
        return rope_inv_freq(config.head_dim, config.local_rope_theta)
    return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotary angles, each [len(positions), head_dim // 2] float64."""
    angles = (np.asarray(positions, dtype=np.float64)[:, None]
              * np.asarray(inv_freq, dtype=np.float64).reshape(-1)[None, :])
    return np.cos(angles), np.sin(angles)


def build_cos_sin_cache(inv_freq: np.ndarray, max_position: int) -> np.ndarray:
    """cos/sin table [max_position, head_dim] float32: row p = [cos(p*f_0..), sin(p*f_0..)].

    inv_freq: [head_dim // 2] (scaling already applied, see `rope_inv_freq`). Angles, cos and
    sin are float64 (`rope_cos_sin`, the reference's), rounded once to float32.
    """
    cos, sin = rope_cos_sin(inv_freq, np.arange(max_position))
    return np.concatenate([cos, sin], axis=1).astype(np.float32)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x: [T, num_heads, head_dim] by cos, sin: [T, head_dim // 2]; returns x's dtype.

    rotate_half convention (as transformers): dim i pairs with dim i + head_dim/2, i.e.
    out_lo = x_lo*cos - x_hi*sin, out_hi = x_hi*cos + x_lo*sin. The arithmetic runs in the
    promoted dtype of x and cos/sin (the reference: float64 tables; numpy_ops: float32).
    """
    half = x.shape[-1] // 2
    x_lo, x_hi = x[..., :half], x[..., half:]
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    out = np.concatenate([x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin], axis=-1)
    return out.astype(x.dtype, copy=False)
