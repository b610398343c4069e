"""Launch wrappers of the KV-cache kernels: rotary + cache write, block copy, swap moves.

    rot = load_module("rotary_cache_write.cu", backend="sim")           # or "cuda"
    q_rot, k_rot = rotary_embedding_and_cache_write(rot, q, k, v, positions, cos_sin_cache,
                                                    k_cache, v_cache, slot_mapping)
    blk = load_module("block_copy.cu", backend="sim")
    copy_blocks(blk, k_caches, v_caches, block_copies)                  # copy-on-write
    swap_blocks(blk, src_caches, dst_caches, block_pairs)               # swap out / in

Arguments mirror runtime/backends/numpy_ops.py, the reference. A KV cache holds q's dtype, or
uint8 fp8 e4m3 codes (kv_cache_dtype "fp8": rotary_cache_write_<dtype>_kv_fp8 rounds k and v
to e4m3 as it stores them; the block moves copy bytes, whatever the element). Arrays are numpy
under the CPU harness and cupy on a GPU. A swap between a device pool and a host pool goes
through a contiguous staging buffer on each side: gather the blocks (kernel), one bulk copy
between host and device, scatter them (kernel). Unsupported shapes raise UnsupportedKernelShape.
"""
from __future__ import annotations

import numpy as np

from .kernel_args import (VEC16_BYTES, UnsupportedKernelShape, array_module, cache_suffix,
                          require, require_aligned, require_contiguous, require_int32)

ROTARY_THREADS = 128
BLOCK_COPY_THREADS = 128


def _token_stride(name: str, x) -> int:
    """Elements between consecutive tokens of a [tokens, heads, head_dim] view whose heads and
    dims are contiguous (q/k/v may be column slices of a fused qkv row)."""
    itemsize = x.dtype.itemsize
    require(x.ndim == 3, lambda: f"{name} must be [num_tokens, heads, head_dim], got {x.shape}")
    require(x.strides[2] == itemsize and x.strides[1] == x.shape[2] * itemsize,
            lambda: f"{name}: heads and head_dim must be contiguous, got strides {x.strides}")
    require(x.strides[0] % itemsize == 0, lambda: f"{name}: token stride not a whole element")
    return x.strides[0] // itemsize


def rotary_embedding_and_cache_write(module, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                     slot_mapping, q_out=None, k_out=None):
    """Rotate q and k (HF rotate_half pairs), write rotated k and raw v at slot_mapping.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (token
    stride free, heads/dims contiguous); positions, slot_mapping: [num_tokens] int32 (negative
    slot = padding: rotated, not written); cos_sin_cache: [max_position, head_dim] float32;
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place: q's
    dtype, or uint8 (fp8 e4m3 codes of the rotated k, as k_out holds it, and of v; RNE,
    saturated to +-448, bit for bit numpy_ops.to_fp8_e4m3_bits).
    q_out / k_out (contiguous; may be q / k themselves when contiguous) default to new arrays.
    Returns (q_out, k_out).
    """
    xp = array_module(q)
    suffix = cache_suffix(q, k_cache, v_cache)
    require(q.dtype == k.dtype == v.dtype, "q, k, v must share one dtype")
    q_stride, k_stride, v_stride = (_token_stride("q", q), _token_stride("k", k),
                                    _token_stride("v", v))
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    require(k.shape == v.shape and k.shape[0] == num_tokens and k.shape[2] == head_dim,
            lambda: f"q {q.shape}, k {k.shape}, v {v.shape}: token counts / head_dims differ")
    require(head_dim % 2 == 0, lambda: f"head_dim {head_dim} must be even for rotary pairs")
    require(k_cache.ndim == 4 and k_cache.shape == v_cache.shape and
            k_cache.shape[2:] == (num_kv_heads, head_dim),
            lambda: f"caches {k_cache.shape} / {v_cache.shape} do not hold [.., .., "
                    f"{num_kv_heads}, "
            f"{head_dim}] rows")
    require_contiguous("k_cache", k_cache)
    require_contiguous("v_cache", v_cache)
    require(np.dtype(cos_sin_cache.dtype) == np.float32 and cos_sin_cache.ndim == 2 and
            cos_sin_cache.shape[1] == head_dim,
            lambda: f"cos_sin_cache must be [max_position, {head_dim}] float32, got "
            f"{cos_sin_cache.shape} {cos_sin_cache.dtype}")
    require_contiguous("cos_sin_cache", cos_sin_cache)
    require_int32("positions", positions, 1)
    require_int32("slot_mapping", slot_mapping, 1)
    require(positions.shape[0] == num_tokens and slot_mapping.shape[0] == num_tokens,
            "positions and slot_mapping must be [num_tokens]")
    q_out = xp.empty(q.shape, dtype=q.dtype) if q_out is None else q_out
    k_out = xp.empty(k.shape, dtype=k.dtype) if k_out is None else k_out
    for name, out, src in (("q_out", q_out, q), ("k_out", k_out, k)):
        require(out.shape == src.shape and out.dtype == src.dtype,
                lambda: f"{name} must match {src.shape} {src.dtype}")
        require_contiguous(name, out)
    if num_tokens == 0:
        return q_out, k_out
    # The kernel takes base pointers; a strided view is passed as the array it views, offset
    # included (numpy: the view's own data pointer; see _base_of).
    kernel = module.get_function(f"rotary_cache_write_{suffix}")
    kernel((num_tokens,), (ROTARY_THREADS,),
           (q_out, k_out, k_cache, v_cache, _base_of(q), _base_of(k), _base_of(v), positions,
            cos_sin_cache, slot_mapping, np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(head_dim), np.int64(q_stride), np.int64(k_stride), np.int64(v_stride)))
    return q_out, k_out


def _base_of(x):
    """A C-contiguous array whose data pointer is x's first element, for strided token views.

    cupy passes any array's data pointer; the harness wants C-contiguous numpy arrays, so a
    strided view is re-wrapped as the flat run of memory it spans (no copy).
    """
    if x.flags.c_contiguous:
        return x
    xp = array_module(x)
    span = (x.shape[0] - 1) * x.strides[0] // x.itemsize + x.shape[1] * x.shape[2]
    if xp is np:
        return np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(x.itemsize,))
    return xp.ndarray((span,), dtype=x.dtype, memptr=x.data)


def _check_pool(name: str, cache) -> int:
    """16-byte words per block of a [num_blocks, ...] cache."""
    require(cache.ndim >= 2, lambda: f"{name} must be [num_blocks, ...], got {cache.shape}")
    require_contiguous(name, cache)
    block_bytes = cache.dtype.itemsize * int(np.prod(cache.shape[1:]))
    require(block_bytes % VEC16_BYTES == 0,
            lambda: f"{name}: a block of {block_bytes} bytes is not a whole number of 16-byte "
                    f"words")
    return block_bytes // VEC16_BYTES


def move_blocks(module, dst, src, block_pairs) -> None:
    """dst[block_pairs[:, 1]] = src[block_pairs[:, 0]] by whole blocks (one launch).

    dst, src: [num_blocks_*, ...] arrays of one block layout and dtype, on the same device (may
    be the same array when no destination is also a source). block_pairs: [k, 2] int32.
    """
    require(dst.dtype == src.dtype and dst.shape[1:] == src.shape[1:],
            lambda: f"block layouts differ: {src.shape} {src.dtype} -> {dst.shape} {dst.dtype}")
    num_vec16 = _check_pool("dst", dst)
    _check_pool("src", src)
    # A block is whole 16-byte words (_check_pool); its inner rows need not be.
    require_aligned(VEC16_BYTES, "copy_blocks moves 16-byte words", rows=False, dst=dst, src=src)
    require_int32("block_pairs", block_pairs, 2)
    require(block_pairs.shape[1] == 2, lambda: f"block_pairs must be [k, 2], got "
                                               f"{block_pairs.shape}")
    num_pairs = block_pairs.shape[0]
    if num_pairs == 0:
        return
    kernel = module.get_function("copy_blocks")
    kernel((num_pairs,), (BLOCK_COPY_THREADS,), (dst, src, block_pairs, np.int64(num_vec16)))


def copy_blocks(module, k_caches, v_caches, block_copies) -> None:
    """Copy-on-write: every layer's K and V block src -> dst, in place (block_copies [k, 2])."""
    for cache in list(k_caches) + list(v_caches):
        move_blocks(module, cache, cache, block_copies)


def gather_blocks(module, cache, block_ids, staging=None):
    """staging[i] = cache[block_ids[i]]; staging: [len(block_ids), *cache.shape[1:]]."""
    xp = array_module(cache)
    ids = xp.asarray(block_ids, dtype=np.int32)
    if staging is None:
        staging = xp.empty((ids.shape[0],) + tuple(cache.shape[1:]), dtype=cache.dtype)
    pairs = xp.stack([ids, xp.arange(ids.shape[0], dtype=np.int32)], axis=1)
    move_blocks(module, staging, cache, xp.ascontiguousarray(pairs))
    return staging


def scatter_blocks(module, cache, block_ids, staging) -> None:
    """cache[block_ids[i]] = staging[i]."""
    xp = array_module(cache)
    ids = xp.asarray(block_ids, dtype=np.int32)
    pairs = xp.stack([xp.arange(ids.shape[0], dtype=np.int32), ids], axis=1)
    move_blocks(module, cache, staging, xp.ascontiguousarray(pairs))


def swap_blocks(module, src_caches, dst_caches, block_pairs) -> None:
    """Move blocks between two pools (per-layer lists), possibly on different devices.

    block_pairs: [k, 2] (src_block, dst_block), host integers. Pools in the same memory: one
    kernel launch per layer. A device pool and a host (numpy) pool: the device side gathers or
    scatters through a staging buffer with the kernel, the bytes cross in one bulk copy, and the
    host side is indexed by numpy (host memory needs no kernel).
    """
    require(len(src_caches) == len(dst_caches),
            lambda: f"{len(src_caches)} source caches vs {len(dst_caches)} destination caches")
    pairs = np.ascontiguousarray(np.asarray(block_pairs, dtype=np.int32).reshape(-1, 2))
    if pairs.shape[0] == 0:
        return
    for src, dst in zip(src_caches, dst_caches):
        require(src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype,
                lambda: f"block layouts differ: {src.shape} vs {dst.shape}")
        src_xp, dst_xp = array_module(src), array_module(dst)
        if src_xp is dst_xp:
            move_blocks(module, dst, src, src_xp.asarray(pairs))
        elif dst_xp is np:  # swap out: device -> host
            staging = gather_blocks(module, src, src_xp.asarray(pairs[:, 0]))
            dst[pairs[:, 1]] = staging.get()
        else:  # swap in: host -> device
            staging = dst_xp.asarray(np.ascontiguousarray(src[pairs[:, 0]]))
            scatter_blocks(module, dst, dst_xp.asarray(pairs[:, 1]), staging)


__all__ = ["UnsupportedKernelShape", "copy_blocks", "gather_blocks", "move_blocks",
           "rotary_embedding_and_cache_write", "scatter_blocks", "swap_blocks"]
