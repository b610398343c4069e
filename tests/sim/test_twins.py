"""Host twins of cuda/ptx.cuh against scalar references written from the PTX ISA fragment
layouts, on random fragments: mma.m16n8k16 (bf16, f16), ldmatrix x1/x2/x4 (+ .trans),
cp.async zfill, and a full ldmatrix -> mma tile and a pipelined tiled GEMM."""

from __future__ import annotations

import numpy as np
import pytest

from pagedrun.runtime.kernels import SimKernelError

PROBE_ROWS = 64  # kProbeRows in twin_probes.cu


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bits_to_f32(bits: np.ndarray, is_bf16: bool) -> np.ndarray:
    if is_bf16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


def mma_fragments(A_bits, B_bits, C):
    """Per-lane registers for A[16,16], B[16,8] (16-bit bits), C[16,8] f32 (PTX ISA layout)."""
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        k = 2 * t
        a[lane] = [pack(A_bits[g, k], A_bits[g, k + 1]),
                   pack(A_bits[g + 8, k], A_bits[g + 8, k + 1]),
                   pack(A_bits[g, k + 8], A_bits[g, k + 9]),
                   pack(A_bits[g + 8, k + 8], A_bits[g + 8, k + 9])]
        b[lane] = [pack(B_bits[k, g], B_bits[k + 1, g]), pack(B_bits[k + 8, g], B_bits[k + 9, g])]
        c[lane] = [C[g, k], C[g, k + 1], C[g + 8, k], C[g + 8, k + 1]]
    return a, b, c


@pytest.mark.parametrize("is_bf16", [True, False])
def test_mma_m16n8k16_matches_scalar_reference(twins, rng, is_bf16):
    warps = 3
    a_all, b_all, c_all, expect = [], [], [], []
    for _ in range(warps):
        A = rng.standard_normal((16, 16)).astype(np.float32)
        B = rng.standard_normal((16, 8)).astype(np.float32)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        A_bits = bf16_bits(A) if is_bf16 else A.astype(np.float16).view(np.uint16)
        B_bits = bf16_bits(B) if is_bf16 else B.astype(np.float16).view(np.uint16)
        a, b, c = mma_fragments(A_bits, B_bits, C)
        D = (bits_to_f32(A_bits, is_bf16).astype(np.float64) @
             bits_to_f32(B_bits, is_bf16).astype(np.float64) + C)
        _, _, d_frag = mma_fragments(A_bits, B_bits, D.astype(np.float32))
        a_all.append(a), b_all.append(b), c_all.append(c), expect.append(d_frag)
    d = np.full((warps * 32, 4), np.nan, np.float32)
    twins.get_function("mma_fragments")((1,), (32 * warps,), (
        np.concatenate(a_all), np.concatenate(b_all), np.concatenate(c_all), d,
        np.int32(is_bf16)))
    np.testing.assert_allclose(d, np.concatenate(expect), rtol=1e-6, atol=1e-6)


def ldmatrix_reference(src, rows, count, trans):
    out = np.zeros((32, 4), np.uint32)
    for i in range(count):
        M = src[rows[8 * i: 8 * i + 8]]  # [8 rows, 8 cols] of matrix i
        for lane in range(32):
            r, c = lane // 4, 2 * (lane % 4)
            e0, e1 = (M[c, r], M[c + 1, r]) if trans else (M[r, c], M[r, c + 1])
            out[lane, i] = pack(e0, e1)
    return out


@pytest.mark.parametrize("variant, count, trans", [(0, 1, False), (1, 2, False), (2, 4, False),
                                                   (3, 1, True), (4, 2, True), (5, 4, True)])
def test_ldmatrix_matches_scalar_reference(twins, rng, variant, count, trans):
    src = rng.integers(0, 2**16, (PROBE_ROWS, 8), dtype=np.uint16)
    rows = rng.permutation(PROBE_ROWS)[:32].astype(np.int32)
    out = np.zeros((32, 4), np.uint32)
    twins.get_function("ldmatrix_probe")(1, 32, (src, rows, out, np.int32(variant)))
    np.testing.assert_array_equal(out, ldmatrix_reference(src, rows, count, trans))


def test_ldmatrix_then_mma_is_a_matmul(twins, rng):
    A = bf16_bits(rng.standard_normal((16, 16)).astype(np.float32))
    B = bf16_bits(rng.standard_normal((16, 8)).astype(np.float32))
    D = np.full((16, 8), np.nan, np.float32)
    twins.get_function("mma_tile_bf16")(1, 32, (A, B, D))
    expect = bits_to_f32(A, True).astype(np.float64) @ bits_to_f32(B, True).astype(np.float64)
    np.testing.assert_allclose(D, expect, rtol=1e-6, atol=1e-6)


def test_cp_async_zfill(twins, rng):
    threads = 37
    x = rng.standard_normal(4 * threads).astype(np.float32)
    src_bytes = (4 * rng.integers(0, 5, threads)).astype(np.int32)
    src_bytes[:5] = [0, 4, 8, 12, 16]
    y = np.full_like(x, np.nan)
    twins.get_function("cp_async_zfill_probe")(1, threads, (x, src_bytes, y))
    keep = np.arange(4)[None, :] < (src_bytes // 4)[:, None]
    np.testing.assert_array_equal(y.reshape(threads, 4), np.where(keep, x.reshape(threads, 4), 0))


def test_tiled_gemm_pipeline(twins, rng):
    M, N, K = 128, 64, 48
    A = bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
    B = bf16_bits(rng.standard_normal((K, N)).astype(np.float32))
    C = np.full((M, N), np.nan, np.float32)
    twins.get_function("tiled_gemm_bf16")((N // 64, M // 64), 128,
                                          (A, B, C, np.int32(M), np.int32(N), np.int32(K)))
    expect = bits_to_f32(A, True).astype(np.float64) @ bits_to_f32(B, True).astype(np.float64)
    np.testing.assert_allclose(C, expect, rtol=1e-5, atol=1e-4)


def test_ldmatrix_in_partial_warp_is_reported(twins, rng):
    src = rng.integers(0, 2**16, (PROBE_ROWS, 8), dtype=np.uint16)
    rows = np.arange(32, dtype=np.int32)
    out = np.zeros((32, 4), np.uint32)
    with pytest.raises(SimKernelError, match=r"ldmatrix.x4 with mask 0xffffffff in a partial warp"):
        twins.get_function("ldmatrix_probe")(1, 31, (src, rows, out, np.int32(2)))
