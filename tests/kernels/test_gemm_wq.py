"""cuda/gemm_wq.cu (through runtime/kernels/gemm_wq.py and wq_pack.py) against a float64
reference: dequantize q / s / z in float64, matmul with the same rounded activations, add the
bias. Awkward M (1, 3: the 8-token register-only decode kernel, partial; 12: the 16-token one;
17, 64: the 64-row tile), N (8, 24,
200: partial 64-column tiles), K (64, 192, 576; multiples of the 32-k tile), every group size and
per-channel, bias or not, f16 and bf16, W8A16 and W4A16 (N = 200 leaves the decode kernel a
partial column group and an idle warp), split-K as planned and forced; the packers' round
trips; wrong packings (W4 nibble order, no fragment shuffle) that the comparison must reject;
shapes the kernels refuse."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import BACKEND, as_kernel_dtype, result_f32, to_device
from pagedrun.runtime.kernels.gemm_wq import gemm_w4a16, gemm_w8a16, wq_num_splits
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.kernels.loader import load_module
from pagedrun.runtime.kernels.wq_pack import (NIBBLE_OF_ELEMENT, pack_groups, pack_w4, pack_w8,
                                              unpack_groups, unpack_w4, unpack_w8)

# Unit roundoff of T (half an ulp, relative): the kernel rounds each dequantized weight to T
# (the mma operand type) and the output once to T.
UNIT_ROUNDOFF = {"f16": 2.0**-11, "bf16": 2.0**-8}
FP32_EPS = 2.0**-24
# The plan splits K for M <= 16 to fill 4 * 8 CTAs here: N = 8 runs 2 slices, N = 200 six.
SIM_NUM_SMS = 4

_MODULE = []


def module():
    if not _MODULE:
        _MODULE.append(load_module("gemm_wq.cu", backend=BACKEND))
    return _MODULE[0]


def _bound(dt, x_ref, w_ref, expected):
    """Worst-case error per output: weights rounded to T (u * sum |x w|), fp32 accumulation
    over K terms (K * eps32 * sum |x w|), the output rounded to T (u * |out|, out <= ref plus the
    first two terms). A wrong kernel (nibble order, zero point, group index) is off by
    O(sqrt(K) * |x w|), far beyond it at these K."""
    u = UNIT_ROUNDOFF[dt]
    K = x_ref.shape[1]
    sum_abs = np.abs(x_ref) @ np.abs(w_ref).T
    inner = (u + K * FP32_EPS) * sum_abs
    return inner + u * (np.abs(expected) + inner) + 1e-30


def _quantized(rng, bits, N, K, g):
    ngroups = K // g
    if bits == 8:
        q = rng.integers(-128, 128, size=(N, K))
        z = np.zeros((ngroups, N))
        scale = 1.0 / 128
    else:
        q = rng.integers(0, 16, size=(N, K))
        z = rng.integers(0, 16, size=(ngroups, N))
        scale = 1.0 / 8
    s = scale * rng.uniform(0.5, 1.5, size=(ngroups, N))
    return q, s, z


def _run(rng, bits, dt, M, N, K, g, with_bias, pack=None, num_splits=None):
    x, x_ref = as_kernel_dtype(rng.standard_normal((M, K)), dt)
    q, s_raw, z = _quantized(rng, bits, N, K, g)
    s, s_ref = as_kernel_dtype(s_raw, dt)
    w_ref = (np.repeat(s_ref.astype(np.float64), g, axis=0).T *
             (q - np.repeat(z, g, axis=0).T))                          # [N, K]
    expected = x_ref.astype(np.float64) @ w_ref.T
    bias = None
    if with_bias:
        bias, bias_ref = as_kernel_dtype(rng.standard_normal(N), dt)
        expected += bias_ref
    b = None if bias is None else to_device(bias)
    scales = to_device(pack_groups(s))
    if bits == 8:
        out = gemm_w8a16(module(), to_device(x), to_device((pack or pack_w8)(q)), scales, n=N,
                         group_size=g, bias=b, num_splits=num_splits, num_sms=SIM_NUM_SMS)
    else:
        out = gemm_w4a16(module(), to_device(x), to_device((pack or pack_w4)(q)), scales,
                         to_device(pack_groups(z.astype(np.uint8))), n=N, group_size=g,
                         bias=b, num_splits=num_splits, num_sms=SIM_NUM_SMS)
    assert out.shape == (M, N) and out.dtype == x.dtype
    return result_f32(out, dt).astype(np.float64), expected, _bound(dt, x_ref, w_ref, expected)


# (N, K, group size or None for per-channel, bias); K % g == 0 (576 = 4.5 x 128 has no g=128)
NKG = [(8, 64, 32, True), (24, 192, 64, False), (200, 576, 32, True), (24, 384, 128, True),
       (200, 192, None, False)]


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dt", ("f16", "bf16"))
@pytest.mark.parametrize("M", (1, 3, 12, 17, 64))
@pytest.mark.parametrize("N,K,g,with_bias", NKG)
def test_gemm_wq_matches_reference(rng, bits, dt, M, N, K, g, with_bias):
    actual, expected, bound = _run(rng, bits, dt, M, N, K, g or K, with_bias)
    err = np.abs(actual - expected)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (f"W{bits}A16 {dt} M={M} N={N} K={K} g={g}: worst at {worst}: "
                                  f"{actual[worst]} vs {expected[worst]} (bound {bound[worst]})")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("M,splits", [(1, 1), (3, 5), (12, 3), (17, 4), (64, 18)])
def test_gemm_wq_forced_splits(rng, bits, M, splits):
    """One slice for a decode shape the plan would split; slices for the 64-row tile the plan
    never splits; uneven slices (18 k-tiles in 5 -> 4 x 4 + 2) and one k-tile per slice."""
    actual, expected, bound = _run(rng, bits, "bf16", M, 200, 576, 32, True, num_splits=splits)
    assert np.all(np.abs(actual - expected) <= bound)


def test_split_plan():
    assert wq_num_splits(1, 4096, 4096, 132) == 33         # 128-column CTAs: 32 x 33 >= 8 x 132
    assert wq_num_splits(1, 8, 64, 132) == 2               # capped at the k-tiles
    assert wq_num_splits(17, 8, 4096, 132) == 1            # prefill tile: never split
    assert wq_num_splits(16, 1 << 18, 4096, 132) == 1      # 2048 column tiles: full


def _naive_pack_w4(q):
    """Nibble e holds element e (plain order, the usual GPTQ packing) in the pre-shuffled
    layout: NOT the kernel's layout. pack_w4 puts element e in nibble NIBBLE_OF_ELEMENT[e], so
    packing q with each 8-k run permuted by that map leaves element e in nibble e."""
    N, K = q.shape
    runs = np.asarray(q).reshape(N, K // 8, 8)
    return pack_w4(runs[:, :, NIBBLE_OF_ELEMENT].reshape(N, K))


def _row_major_w4(q):
    """The right words and nibbles, without the fragment shuffle: row n's 4 words of a k-tile
    at [kt, n // 32, (n % 32) // 8 ... ] in plain row order -- NOT the kernel's layout."""
    packed = pack_w4(q)
    kt, ng = packed.shape[:2]
    plain = packed.reshape(kt, ng, 8, 4, 4).transpose(0, 1, 4, 2, 3)   # [kt, ng, j, r, c]
    return np.ascontiguousarray(plain.reshape(packed.shape))


def _row_major_w8(q):
    """W8's bytes without the fragment shuffle (rows in plain order): NOT the kernel's layout."""
    packed = pack_w8(q)
    kt, ng = packed.shape[:2]
    plain = packed.reshape(kt, ng, 8, 4, 4, 2).transpose(0, 1, 4, 2, 3, 5)   # [kt, ng, j, r, c, h]
    return np.ascontiguousarray(plain.reshape(packed.shape))


@pytest.mark.parametrize("M", (3, 17))
@pytest.mark.parametrize("bits,pack", [(4, _naive_pack_w4), (4, _row_major_w4),
                                       (8, _row_major_w8)], ids=("w4-nibbles", "w4-rows",
                                                                 "w8-rows"))
def test_wrong_packing_is_rejected(rng, M, bits, pack):
    """The comparison can fail: a plain nibble order, or rows in plain order instead of the
    fragment shuffle, must not pass -- on the decode kernel (M = 3) and the 64-row tile."""
    actual, expected, bound = _run(rng, bits, "f16", M, 72, 192, 64, True, pack=pack)
    assert np.mean(np.abs(actual - expected) > bound) > 0.5


def test_pack_w4_round_trip_and_layout(rng):
    q = rng.integers(0, 16, size=(40, 96))
    packed = pack_w4(q)
    assert packed.shape == (3, 2, 32, 4) and packed.dtype == np.uint32
    assert np.array_equal(unpack_w4(packed, 40), q)
    assert not unpack_w4(packed, 64)[40:].any()              # padded rows are zero
    one = np.zeros((1, 32), dtype=np.int64)
    one[0, 1] = 1    # element 1 of word 0 lives in nibble 4 (bits 16..19)
    assert pack_w4(one)[0, 0, 0, 0] == 1 << 16
    one = np.zeros((10, 64), dtype=np.int64)
    one[9, 32 + 13] = 7   # row 9 = 8 x 1 + 1 (j 1, r 1); k 45: tile 1, c 1, element 5
    assert pack_w4(one)[1, 0, 1 * 4 + 1, 1] == 7 << (4 * 6)   # nibble (5 >> 1) + 4 = 6
    assert np.count_nonzero(pack_w4(one)) == 1
    s = rng.standard_normal((3, 40)).astype(np.float16)
    groups = pack_groups(s)
    assert groups.shape == (3, 64) and np.array_equal(unpack_groups(groups, 40), s)
    assert groups[2, 4 * 3 + 2] == s[2, 8 * 2 + 3]             # column 8j + r at 4r + j
    assert not unpack_groups(groups, 64)[:, 40:].any()        # padded columns are zero
    q8 = rng.integers(-128, 128, size=(40, 96))
    packed8 = pack_w8(q8)
    assert packed8.shape == (3, 2, 32, 8) and np.array_equal(unpack_w8(packed8, 40), q8)
    one = np.zeros((10, 64), dtype=np.int64)
    one[9, 32 + 13] = -3  # row 9 (j 1, r 1); k 45: tile 1, c 1, element 5 = word 2j + 1, byte 1
    assert pack_w8(one)[1, 0, 1 * 4 + 1, 3] == (256 - 3) << 8
    assert np.count_nonzero(pack_w8(one)) == 1
    with pytest.raises(ValueError):
        pack_w4(np.full((2, 32), 16))


@pytest.mark.parametrize("K,g", [(48, 16), (96, 64), (100, 100), (64, 48)])
def test_refuses_unsupported_shapes(K, g):
    x = np.zeros((2, K), dtype=np.float16)
    q = np.zeros((max(K // 32, 1), 1, 32, 8), dtype=np.uint32)   # well formed for N = 8
    s = np.zeros((max(K // g, 1), 32), dtype=np.float16)
    with pytest.raises(UnsupportedKernelShape):
        gemm_w8a16(module(), x, q, s, n=8, group_size=g)


def test_refuses_float32_activations():
    x = np.zeros((2, 64), dtype=np.float32)
    with pytest.raises(UnsupportedKernelShape):
        gemm_w8a16(module(), x, pack_w8(np.zeros((8, 64), np.int8)),
                   np.zeros((2, 32), np.float32), n=8, group_size=32)
