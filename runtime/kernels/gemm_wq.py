"""Launch wrappers of the weight-only quantized GEMM kernels (cuda/gemm_wq.cu): W8A16, W4A16.

    module = load_module("gemm_wq.cu", backend="sim")          # or "cuda"
    out = gemm_w8a16(module, x, qweight, scales, n=N, group_size=g)          # x @ (s q8).T
    out = gemm_w4a16(module, x, qweight, scales, zeros, n=N, group_size=g)   # x @ (s (q4 - z)).T

x: [M, K] float16 or uint16 (bf16 bits), 16-byte aligned; K % 32 == 0. group_size g in
{32, 64, 128} or K (per-channel), K % g == 0. Weights pre-shuffled by wq_pack (Ng =
ceil(N / 32)): qweight uint32 [K / 32, Ng, 32, 8] (W8, pack_w8) or [K / 32, Ng, 32, 4] (W4,
pack_w4); scales [K / g, Ng * 32] in x's dtype and W4's zeros [K / g, Ng * 32] uint8
(pack_groups). bias [N] in x's dtype or None. out: [M, N] in x's dtype. Arrays are numpy under
the CPU harness and cupy on a GPU. Shapes no kernel serves raise UnsupportedKernelShape.
M <= 16 runs the register-only decode kernel (8 or 16 tokens x 128 columns per CTA) split over
K (wq_num_splits: ~8 CTAs per SM; fp32 partials and a reduce kernel that adds the bias), larger
M the 64-row shared-memory tile in one pass.
"""
from __future__ import annotations

import numpy as np

from .kernel_args import (VEC16_BYTES, UnsupportedKernelShape, array_module, ceil_div,
                          device_num_sms, dtype_suffix, nullable, require, require_aligned,
                          require_contiguous, require_pair_stores)
from .wq_pack import W4_GROUP_N, W4_LANES, W4_TILE_K, W4_WORDS, W8_WORDS, num_column_groups

WQ_THREADS = 128
WQ_TILE_N = 64               # columns per CTA of the 64-row tile
WQ_DECODE_TILE_N = 4 * W4_GROUP_N   # the decode kernel: 4 warps x one 32-column group
WQ_TILE_K = W4_TILE_K        # the K granularity of every instantiation
WQ_DECODE_MAX_M = 16         # M up to this runs the decode kernel, larger M the 64-row tile
GROUP_SIZES = (32, 64, 128)
# Split-K target for the decode kernel: resident CTAs per SM (4 fit by registers; 8 gives the
# scheduler a second wave to balance uneven slices).
WQ_TARGET_CTAS_PER_SM = 8
LANE_WORDS = {4: W4_WORDS, 8: W8_WORDS}
# cuda/gemm_wq.cu's narrower vector loads: a uint2 of 4 bf16 / f16 scales, a uint32_t of 4
# zero points.
SCALE_LOAD_BYTES = 8
ZERO_LOAD_BYTES = 4


def wq_tile_m(M: int) -> int:
    """Rows per CTA: the decode kernel takes 8 or 16 tokens, larger M the 64-row tile."""
    if M > WQ_DECODE_MAX_M:
        return 64
    return 8 if M <= 8 else 16


def wq_tile_n(M: int) -> int:
    return WQ_DECODE_TILE_N if M <= WQ_DECODE_MAX_M else WQ_TILE_N


def wq_num_splits(M: int, N: int, K: int, num_sms: int) -> int:
    """K slices for one launch: only the decode kernel splits, enough to put ~8 CTAs on every
    SM, never an empty slice."""
    if M > WQ_DECODE_MAX_M:
        return 1
    k_tiles = K // WQ_TILE_K
    want = ceil_div(num_sms * WQ_TARGET_CTAS_PER_SM, ceil_div(N, wq_tile_n(M)))
    return max(1, min(k_tiles, want))


def _check_common(x, scales, bias, N: int, group_size: int, scale_cols: int):
    suffix = dtype_suffix(x)
    if suffix not in ("f16", "bf16"):
        raise UnsupportedKernelShape(f"weight-only GEMM takes float16 / bf16 activations, got "
                                     f"{x.dtype}")
    require(x.ndim == 2, lambda: f"x must be [M, K], got {x.shape}")
    M, K = x.shape
    if K == 0 or K % WQ_TILE_K:
        raise UnsupportedKernelShape(f"weight-only GEMM needs K % {WQ_TILE_K} == 0, got K={K}")
    if not (group_size in GROUP_SIZES or group_size == K) or K % group_size:
        raise UnsupportedKernelShape(f"group_size must be one of {GROUP_SIZES} or K ({K}) and "
                                     f"divide K, got {group_size}")
    require_contiguous("x", x)
    require_aligned(VEC16_BYTES, "the weight-only GEMM reads x in 16-byte loads", x=x)
    require(scales.shape == (K // group_size, scale_cols) and scales.dtype == x.dtype,
            lambda: f"scales must be [{K // group_size}, {scale_cols}] {x.dtype}, got "
                    f"{scales.shape} {scales.dtype}")
    require_contiguous("scales", scales)
    if bias is not None:
        require(bias.shape == (N,) and bias.dtype == x.dtype,
                lambda: f"bias must be [{N}] {x.dtype}, got {bias.shape} {bias.dtype}")
        require_contiguous("bias", bias)
    return suffix, M, K


def _out(xp, out, M, N, dtype):
    if out is None:
        out = xp.empty((M, N), dtype=dtype)
    require(out.shape == (M, N) and out.dtype == dtype,
            lambda: f"out must be [{M}, {N}] {dtype}, got {out.shape} {out.dtype}")
    require_contiguous("out", out)
    return out


def _launch(module, name, xp, out, bias, M, N, K, num_splits, head, tail):
    """head: the pointers after (out, partial); tail: the scalars after (M, N, K, group)."""
    tile_m, tile_n = wq_tile_m(M), wq_tile_n(M)
    k_tiles = K // WQ_TILE_K
    num_splits = max(1, min(num_splits, k_tiles))
    kps = ceil_div(k_tiles, num_splits)
    num_splits = ceil_div(k_tiles, kps)          # no empty slice
    grid = (ceil_div(N, tile_n), ceil_div(M, tile_m), num_splits)
    kernel = module.get_function(f"{name}_m{tile_m}")
    scalars = (np.int32(M), np.int32(N), np.int32(K), *tail, np.int32(kps))
    null = nullable(None, xp)
    if num_splits == 1:
        kernel(grid, (WQ_THREADS,), (out, null, *head, nullable(bias, xp), *scalars))
        return
    partial = xp.empty((num_splits, M, N), dtype=np.float32)
    kernel(grid, (WQ_THREADS,), (out, partial, *head, null, *scalars))
    reduce = module.get_function(f"gemm_wq_splitk_reduce_{dtype_suffix(out)}")
    reduce((ceil_div(M * N, WQ_THREADS),), (WQ_THREADS,),
           (out, partial, nullable(bias, xp), np.int32(M), np.int32(N), np.int32(num_splits)))


def _gemm_wq(bits, module, x, qweight, scales, zeros, n, group_size, bias, out, num_splits,
             num_sms):
    xp = array_module(x)
    words = LANE_WORDS[bits]
    require(qweight.ndim == 4 and qweight.shape[2:] == (W4_LANES, words)
            and qweight.dtype == np.uint32,
            lambda: f"qweight must be uint32 [K / 32, Ng, {W4_LANES}, {words}] (wq_pack."
                    f"pack_w{bits}), got {qweight.shape} {qweight.dtype}")
    N = int(n)
    require(N > 0 and qweight.shape[1] == num_column_groups(N),
            lambda: f"qweight {qweight.shape} holds {qweight.shape[1]} groups of 32 rows, not "
                    f"the {num_column_groups(N)} of n = {N}")
    padded = qweight.shape[1] * W4_GROUP_N
    suffix, M, K = _check_common(x, scales, bias, N, group_size, scale_cols=padded)
    require(qweight.shape[0] * W4_TILE_K == K,
            lambda: f"x {x.shape} and qweight {qweight.shape} disagree on K")
    require_contiguous("qweight", qweight)
    if qweight.size >= 1 << 32:   # the decode kernel's 32-bit word offsets
        raise UnsupportedKernelShape(f"qweight of {qweight.size} words: at most 2^32")
    require_aligned(VEC16_BYTES, "the weight-only GEMM reads qweight in 16-byte loads",
                    qweight=qweight)
    require_aligned(SCALE_LOAD_BYTES, "the weight-only GEMM reads 4 scales per 8-byte load",
                    scales=scales)
    if bits == 4:
        require(zeros.shape == scales.shape and zeros.dtype == np.uint8,
                lambda: f"zeros must be {scales.shape} uint8, got {zeros.shape} {zeros.dtype}")
        require_contiguous("zeros", zeros)
        require_aligned(ZERO_LOAD_BYTES, "the W4 GEMM reads 4 zero points per 4-byte load",
                        zeros=zeros)
    out = _out(xp, out, M, N, x.dtype)
    require_pair_stores(out, N)
    if M:
        splits = num_splits or wq_num_splits(M, N, K, num_sms or device_num_sms(xp))
        _launch(module, f"gemm_w{bits}a16_{suffix}", xp, out, bias, M, N, K, splits,
                (x, qweight, scales, nullable(zeros, xp)), (np.int32(group_size),))
    return out


def gemm_w8a16(module, x, qweight, scales, *, n: int, group_size: int, bias=None, out=None,
               num_splits: int | None = None, num_sms: int | None = None):
    """out = x @ (s[k // g, j] * q[j, k]).T (+ bias), j < n: the weight's n output rows.
    qweight: uint32 [K / 32, ceil(n / 32), 32, 8] from wq_pack.pack_w8; scales from
    wq_pack.pack_groups. num_splits: K slices (default wq_num_splits; clamped to the
    k-tiles)."""
    return _gemm_wq(8, module, x, qweight, scales, None, n, group_size, bias, out, num_splits,
                    num_sms)


def gemm_w4a16(module, x, qweight, scales, zeros, *, n: int, group_size: int, bias=None,
               out=None, num_splits: int | None = None, num_sms: int | None = None):
    """out = x @ (s[k // g, j] * (q[j, k] - z[k // g, j])).T (+ bias), j < n. qweight: uint32
    [K / 32, ceil(n / 32), 32, 4] from wq_pack.pack_w4; scales and zeros from
    wq_pack.pack_groups. num_splits as in gemm_w8a16."""
    return _gemm_wq(4, module, x, qweight, scales, zeros, n, group_size, bias, out, num_splits,
                    num_sms)


__all__ = ["GROUP_SIZES", "WQ_DECODE_TILE_N", "WQ_TILE_K", "gemm_w4a16", "gemm_w8a16",
           "wq_num_splits", "wq_tile_m", "wq_tile_n"]
