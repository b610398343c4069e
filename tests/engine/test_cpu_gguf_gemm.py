"""The cpu GEMM over GGUF blocks kept quantized (pagedrun.pyx.cpu_gemm.PackedGgufWeight /
gemm_gguf): the packing against gguf's own dequantization, every path against a numpy
reference of the same quantized-activation math (read straight from the file's blocks, not
from the packed layout), and against the float64 product of the dequantized weights within the
bound the activation rounding allows; paths and thread counts against each other; refusals.
K-quants (Q4_K, Q5_K, Q6_K, Q3_K): gguf has no numpy quantizer for them, so their blocks are
random bytes with finite fp16 super-scales (every such block is a valid one). Q3_K runs as Q6_K
(repacked at load): its reference reads the Q3_K bytes themselves."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from pagedrun.pyx import cpu_gemm

TYPES = cpu_gemm.GGUF_NATIVE_TYPES
K_TYPES = ("Q4_K", "Q6_K", "Q5_K", "Q3_K")
PATHS = list(cpu_gemm.available_gguf_paths())
FP32_UNIT_ROUNDOFF = 2.0 ** -24
# (N, K, M): awkward widths (a partial last tile, one output), K of 1 .. 48 blocks, decode and
# prefill row counts (the kernels' 1-3-row and 4-row-block shapes and their remainders).
SHAPES = [(1, 32, 1), (17, 96, 3), (111, 576, 8), (576, 576, 17), (17, 1536, 64),
          (111, 32, 64), (576, 1536, 1), (1, 96, 17)]
# K-quants: K a multiple of 256 (1, 2, 6 super-blocks); N 1 / 17 / 111, M 1 / 3 / 17 / 64.
K_SHAPES = [(1, 256, 1), (17, 512, 3), (111, 1536, 17), (17, 256, 64), (111, 512, 1),
            (1, 1536, 64), (17, 1536, 17), (111, 256, 3)]
GEMM_CASES = [(t, *shape) for t in TYPES for shape in (K_SHAPES if t in K_TYPES else SHAPES)]
# File bytes per super-block (256 weights) and packed bytes per output per super-block.
K_FILE_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q5_K": 176, "Q3_K": 110}
K_PACKED_BYTES = {"Q4_K": 148, "Q6_K": 274, "Q5_K": 276, "Q3_K": 274}


@pytest.fixture
def rng():
    return np.random.default_rng(20261216)


def qtype(name: str) -> GGMLQuantizationType:
    return getattr(GGMLQuantizationType, name)


def random_fp16_bytes(rng, shape, wild: bool) -> np.ndarray:
    """Finite fp16 values as bytes [..., 2]: wild = any finite bit pattern (subnormals,
    negatives, 65504), else a weight-like scale in [1e-3, 2e-2)."""
    if wild:
        bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
    else:
        bits = rng.uniform(1e-3, 2e-2, shape).astype(np.float16).view(np.uint16)
    return bits.view(np.uint8).reshape(*shape, 2)


def random_k_raw(rng, ggml_type: str, n: int, k: int, wild: bool = False) -> np.ndarray:
    """Random [n, k] K-quant super-blocks: random bytes, finite fp16 d (and dmin), one
    all-zero row when there are several."""
    sb = k // 256
    raw = rng.integers(0, 256, (n, sb, K_FILE_BYTES[ggml_type]), dtype=np.uint8)
    if ggml_type in ("Q4_K", "Q5_K"):  # fp16 d, fp16 dmin, scales, (5th bits,) nibbles
        raw[:, :, 0:2] = random_fp16_bytes(rng, (n, sb), wild)
        raw[:, :, 2:4] = random_fp16_bytes(rng, (n, sb), wild)
    elif ggml_type == "Q6_K":  # ql, qh, scales, fp16 d
        raw[:, :, 208:210] = random_fp16_bytes(rng, (n, sb), wild)
    else:  # Q3_K: hmask, qs, scales, fp16 d
        raw[:, :, 108:110] = random_fp16_bytes(rng, (n, sb), wild)
    if n > 2:
        raw[n // 2] = 0
    return raw.reshape(n, -1)


def random_raw(rng, ggml_type: str, n: int, k: int) -> np.ndarray:
    """The file's blocks of a random [n, k] weight, via gguf's own quantizer; rows of varied
    scale and offset (Q4_1's min matters), one all-zero row when there are several."""
    if ggml_type in K_TYPES:
        return random_k_raw(rng, ggml_type, n, k)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, (n, 1))
    w += rng.uniform(-0.5, 0.5, (n, 1)).astype(np.float32)
    if n > 2:
        w[n // 2] = 0.0
    return quants.quantize(w.astype(np.float32), qtype(ggml_type))


def file_k_blocks(raw: np.ndarray, ggml_type: str, k: int):
    """K-quant super-blocks read from ggml's format as file_blocks: Q4_K per 32 weights d =
    d * sc, m = -dmin * mn (the 6-bit pairs via gguf's own unpacker), q the nibble (per 64
    weights, 32 bytes: low nibbles weights 0-31, high 32-63); Q6_K per 16 weights d = d * sc,
    q = ql | qh << 4 - 32 (per 128 weights: ql's 64 bytes low nibbles 0-63, high 64-127; qh's
    32 bytes bit pairs 2s weights 32 s + l)."""
    n, sb = raw.shape[0], k // 256
    blocks = raw.reshape(n * sb, -1)
    half = lambda b: b.copy().view(np.float16)[:, 0].astype(np.float64)  # noqa: E731
    if ggml_type == "Q4_K":
        sc, mn = quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        d = half(blocks[:, 0:2])[:, None] * sc
        m = -half(blocks[:, 2:4])[:, None] * mn
        qs = blocks[:, 16:].reshape(n * sb, 4, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int64)
        return d.reshape(n, sb * 8), m.reshape(n, sb * 8), q.reshape(n, sb * 8, 32)
    if ggml_type == "Q5_K":  # Q4_K's scales and nibbles (after 32 bytes of 5th bits: bit j of
        # byte l is weight l of 32-block j)
        sc, mn = quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        d = half(blocks[:, 0:2])[:, None] * sc
        m = -half(blocks[:, 2:4])[:, None] * mn
        qs = blocks[:, 48:176].reshape(n * sb, 4, 32)
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n * sb, 8, 32)
        high = np.stack([(blocks[:, 16:48] >> j) & 1 for j in range(8)], axis=1)
        q = (low | (high << 4)).astype(np.int64)
        return d.reshape(n, sb * 8), m.reshape(n, sb * 8), q.reshape(n, sb * 8, 32)
    if ggml_type == "Q3_K":
        return q3_k_blocks(blocks, n, sb, half)
    ql = blocks[:, 0:128].reshape(n * sb, 2, 64).astype(np.int64)
    qh = blocks[:, 128:192].reshape(n * sb, 2, 32).astype(np.int64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [., 2, 128]
    high = np.concatenate([(qh >> (2 * s)) & 3 for s in range(4)], axis=2)
    q = (low | (high << 4)) - 32
    d = half(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8)
    return d.reshape(n, sb * 16), None, q.reshape(n, sb * 16, 16)


def q3_k_blocks(blocks: np.ndarray, n: int, sb: int, half):
    """Q3_K super-blocks [n * sb, 110] as file_k_blocks' Q6_K form, after ggml's
    dequantize_row_q3_K: per 128 weights a 32-byte run of qs, read at 4 shifts of 2 bits, each
    covering 32 weights; the high bit from hmask (its mask doubling per shift, on across both
    halves), unset meaning -4; the 16 scales unpacked from 12 bytes with ggml's kmask words."""
    aux = np.ascontiguousarray(blocks[:, 96:108]).view("<u4").astype(np.int64)  # [., 3]
    tmp, k1, k2 = aux[:, 2], 0x03030303, 0x0F0F0F0F
    words = [(aux[:, 0] & k2) | (((tmp >> 0) & k1) << 4),
             (aux[:, 1] & k2) | (((tmp >> 2) & k1) << 4),
             ((aux[:, 0] >> 4) & k2) | (((tmp >> 4) & k1) << 4),
             ((aux[:, 1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
    scales = np.stack([(w >> (8 * j)) & 0xFF for w in words for j in range(4)], axis=1) - 32
    d = half(blocks[:, 108:110])[:, None] * scales
    hmask = blocks[:, 0:32].astype(np.int64)
    q = np.zeros((n * sb, 256), dtype=np.int64)
    y, mask = 0, 1
    for run in (32, 64):  # qs bytes of the first and second 128 weights
        qs = blocks[:, run:run + 32].astype(np.int64)
        for shift in (0, 2, 4, 6):
            q[:, y:y + 32] = ((qs >> shift) & 3) - np.where(hmask & mask, 0, 4)
            y, mask = y + 32, mask << 1
    return d.reshape(n, sb * 16), None, q.reshape(n, sb * 16, 16)


def file_blocks(raw: np.ndarray, ggml_type: str, k: int):
    """The GGUF block format read independently of the packing: (d [N, nb], m [N, nb] or
    None, q [N, nb, 32] int64) with W = d * q + m (Q4_1) or d * q (Q4_0, Q8_0; Q4_0's q is
    the nibble - 8). Q4 nibbles: byte i holds weight i (low) and weight i + 16 (high).
    K-quants: file_k_blocks (Q6_K's sub-blocks are 16 wide: [N, 2 nb] and [N, 2 nb, 16]).
    Q5_0: q = nibble | 5th bit << 4 - 16 (bit i of the 4 bytes after d: weight i)."""
    if ggml_type in K_TYPES:
        return file_k_blocks(raw, ggml_type, k)
    n, nb = raw.shape[0], k // 32
    blocks = raw.reshape(n, nb, -1)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    if ggml_type == "Q8_0":
        q = blocks[:, :, 2:].copy().view(np.int8).astype(np.int64)
        return d, None, q
    if ggml_type == "Q5_0":  # d, 32 5th bits (bit i: weight i), nibbles as Q4_0's
        bits = np.unpackbits(blocks[:, :, 2:6], axis=2, bitorder="little").astype(np.int64)
        qs = blocks[:, :, 6:22]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int64) | (bits << 4)
        return d, None, q - 16
    qs = blocks[:, :, 4:] if ggml_type == "Q4_1" else blocks[:, :, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int64)
    if ggml_type == "Q4_1":
        return d, blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64), q
    return d, None, q - 8


def round_blocks(xb: np.ndarray, dx: np.ndarray):
    """xb [M, nb, 32] float32 against dx [M, nb] float32: (qx int64, sx float32), qx =
    round-half-even(x / dx) in [-127, 127] (dx 0: qx 0), sx = dx * sum(qx)."""
    safe = np.where(dx > 0, dx, np.float32(1.0))[:, :, None]
    qx = np.where(dx[:, :, None] > 0, np.clip(np.rint(xb / safe), -127, 127), 0).astype(np.int64)
    return qx, (dx * qx.sum(axis=2).astype(np.float32)).astype(np.float32)


def quantize_activations(x: np.ndarray, activations: str = "q8"):
    """The passes [(qx, dx, sx)] of llama.cpp-style q8 activations per 32-wide block, float32
    like the kernel: dx = max|x| / 127; "q8x2" adds the residual r = x - dx qx (rounded once
    to float32) against dx / 256."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    dx = (np.abs(xb).max(axis=2) / np.float32(127.0)).astype(np.float32)
    qx, sx = round_blocks(xb, dx)
    passes = [(qx, dx, sx)]
    if activations == "q8x2":
        r = (xb.astype(np.float64) - dx.astype(np.float64)[:, :, None] * qx).astype(np.float32)
        dx2 = (dx / np.float32(256.0)).astype(np.float32)
        q2, sx2 = round_blocks(r, dx2)
        passes.append((q2, dx2, sx2))
    return passes


def reference(x, raw, ggml_type, k, bias, activations="q8"):
    """(y, slack): y = sum over the passes and blocks b of (d * dx)_f32 * intdot_b (+ m *
    sx_b) (+ bias) in float64 from the kernel's float32 factors; slack = the float32
    accumulation bound of the kernel's per-block FMAs (gamma_(2 nb + 2) times the sum of
    |terms|), plus q8x2's two float32 adds (the passes' sum, the bias)."""
    passes = quantize_activations(x, activations)
    y, slack = 0.0, 0.0
    for qx, dx, sx in passes:
        yp, sp = reference_pass(qx, dx, sx, raw, ggml_type, k, bias if len(passes) == 1 else None)
        y, slack = y + yp, slack + sp
    if len(passes) > 1:
        if bias is not None:
            y = y + bias.astype(np.float64)
        slack = slack + 2 * FP32_UNIT_ROUNDOFF * (np.abs(y) + np.abs(slack))
    return y, slack


def reference_pass(qx, dx, sx, raw, ggml_type, k, bias):
    d, mins, q = file_blocks(raw, ggml_type, k)
    if q.shape[2] != 32:  # sub-blocks of 16 (Q6_K): the activation block's dx for both
        qx = qx.reshape(qx.shape[0], -1, q.shape[2])
        dx = np.repeat(dx, 32 // q.shape[2], axis=1)
    dot = np.einsum("mbk,nbk->mnb", qx.astype(np.float64), q.astype(np.float64))  # exact ints
    dd = (d.astype(np.float32)[None, :, :] * dx[:, None, :]).astype(np.float64)  # f32 product
    terms = dot * dd
    mag = np.abs(terms).sum(axis=2)
    y = terms.sum(axis=2)
    if mins is not None:
        mterms = mins[None, :, :] * sx.astype(np.float64)[:, None, :]
        y += mterms.sum(axis=2)
        mag += np.abs(mterms).sum(axis=2)
    if bias is not None:
        y += bias.astype(np.float64)
        mag += np.abs(bias.astype(np.float64))
    nb = d.shape[1]  # one or two float32 fmas per 32-block, whatever their kind
    gamma = (2 * nb + 2) * FP32_UNIT_ROUNDOFF / (1 - (2 * nb + 2) * FP32_UNIT_ROUNDOFF)
    return y, gamma * mag


def make_x(rng, m, k, layout):
    x = rng.standard_normal((m, k)).astype(np.float32) * np.float32(3.0)
    if m > 1 and k > 32:
        x[1, 32:64] = 0.0  # an all-zero activation block: dx 0
    if layout == "transposed":
        return np.ascontiguousarray(x.T).T
    if layout == "strided":
        big = np.zeros((m, 2 * k), np.float32)
        big[:, ::2] = x
        return big[:, ::2]
    return x


@pytest.mark.parametrize("ggml_type", K_TYPES)
@pytest.mark.parametrize("n,k", [(1, 256), (17, 512), (111, 1536)])
def test_k_dequantize_matches_gguf(rng, ggml_type, n, k):
    """Any finite fp16 super-scales (subnormal, negative, 65504) and any scale / quant bytes:
    bit-exact against gguf's float32 dequantization; the packed bytes per 256 weights."""
    assert ggml_type in TYPES
    raw = random_k_raw(rng, ggml_type, n, k, wild=True)
    packed = cpu_gemm.PackedGgufWeight(raw, ggml_type, k)
    want = quants.dequantize(raw, qtype(ggml_type)).astype(np.float32)
    got = packed.dequantize()
    assert got.dtype == np.float32 and got.shape == (n, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # The independent reader (used by the gemm reference) agrees with gguf too.
    d, mins, q = file_k_blocks(raw, ggml_type, k)
    w = d[:, :, None] * q + (0 if mins is None else mins[:, :, None])
    assert np.allclose(w.reshape(n, k), want, rtol=2 ** -23, atol=0)
    assert packed.nbytes == -(-n // 16) * 16 * (k // 256) * K_PACKED_BYTES[ggml_type]


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t not in K_TYPES])
@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (111, 576), (576, 1536)])
def test_dequantize_matches_gguf(rng, ggml_type, n, k):
    raw = random_raw(rng, ggml_type, n, k)
    packed = cpu_gemm.PackedGgufWeight(raw, ggml_type, k)
    assert (packed.n, packed.k, packed.ggml_type) == (n, k, ggml_type)
    want = quants.dequantize(raw, qtype(ggml_type))
    got = packed.dequantize()
    assert got.dtype == np.float32 and got.shape == (n, k)
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    # Streamed bytes: the file's block bytes per 32 weights (+ padding to 16 outputs).
    per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 34}[ggml_type]  # Q5_0: as Q8_0
    assert packed.nbytes == -(-n // 16) * 16 * (k // 32) * per_block


@pytest.mark.parametrize("ggml_type,n,k,m", GEMM_CASES)
@pytest.mark.parametrize("activations", cpu_gemm.GGUF_ACTIVATIONS)
def test_gemm_matches_reference(rng, ggml_type, n, k, m, activations):
    raw = random_raw(rng, ggml_type, n, k)
    packed = cpu_gemm.PackedGgufWeight(raw, ggml_type, k)
    layout = ("contiguous", "transposed", "strided")[(n + m) % 3]
    x = make_x(rng, m, k, layout)
    bias = rng.standard_normal(n).astype(np.float32) if m % 2 else None
    want, slack = reference(x, raw, ggml_type, k, bias, activations)
    # Against float64 dequantize(W) @ x: each activation moves by at most dx / 2 when rounded
    # ("q8x2": dx / 256 (the residual's clamp at 127 included), + its float32 rounding u dx /
    # 2), so |err| <= sum_b bound_b * sum_k |w_k| (+ the float32 slack, + gguf's float32
    # dequantization's own rounding: u |w| per weight).
    w = quants.dequantize(raw, qtype(ggml_type)).astype(np.float64)
    dx = quantize_activations(x)[0][1].astype(np.float64)
    per_dx = 0.5 if activations == "q8" else 1.0 / 256 + FP32_UNIT_ROUNDOFF / 2
    absw = np.abs(w).reshape(n, k // 32, 32).sum(axis=2)  # [N, nb]
    act_bound = per_dx * dx @ absw.T  # [M, N]
    exact = x.astype(np.float64) @ w.T + (0 if bias is None else bias.astype(np.float64))
    deq_slack = FP32_UNIT_ROUNDOFF * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
    results = {}
    for path in PATHS:
        for threads in (1, 2):
            y = cpu_gemm.gemm_gguf(x, packed, bias, path=path, threads=threads,
                                   activations=activations)
            assert y.shape == (m, n) and y.dtype == np.float32
            err = np.abs(y.astype(np.float64) - want)
            tol = slack + FP32_UNIT_ROUNDOFF * np.abs(want)  # + the output's own rounding
            assert (err <= tol).all(), (path, threads, float((err - tol).max()))
            assert (np.abs(y - exact) <= act_bound + 2 * slack + deq_slack).all(), (path, threads)
            results[path, threads] = y
    # Both paths do the same float32 operations per output, in the same order: bit-identical.
    first = next(iter(results.values()))
    for key, y in results.items():
        assert np.array_equal(y, first), key


def test_activation_rounding_is_half_even():
    """Ties x / dx = j + 0.5 round to even (np.rint), not away from zero (roundf): dx = 1
    exactly (the block's max is 127), the weight a single one-hot row per output."""
    k = 32
    x = np.zeros((1, k), np.float32)
    x[0, 0] = 127.0
    x[0, 1:6] = [0.5, 1.5, 2.5, -0.5, -2.5]  # -> 0, 2, 2, 0, -2
    w = np.zeros((6, k), np.float32)
    for j in range(6):
        w[j, j] = 1.0  # Q8_0 of a one-hot row: d = 1/127 rounded to fp16, q 127
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    packed = cpu_gemm.PackedGgufWeight(raw, "Q8_0", k)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    for path in PATHS:
        y = cpu_gemm.gemm_gguf(x, packed, path=path, threads=1)[0]
        qx = np.array([127, 0, 2, 2, 0, -2], np.float32)
        want = (qx * 127).astype(np.float32) * (d * np.float32(1.0))
        assert np.array_equal(y, want), (path, y, want)


def test_q4_nibble_order_and_min():
    """A Q4_1 block built by hand: weight i (i < 16) in byte i's low nibble, weight i + 16 in
    its high nibble, w = d * q + m; y against the hand-written dot product."""
    k = 32
    q = np.arange(32) % 16
    q[16:] = 15 - q[16:]  # high nibbles differ from low ones
    d, mn = np.float16(0.25), np.float16(-1.5)
    block = np.concatenate([np.array([d, mn], np.float16).view(np.uint8),
                            (q[:16] | (q[16:] << 4)).astype(np.uint8)])
    raw = block[None, :]
    packed = cpu_gemm.PackedGgufWeight(raw, "Q4_1", k)
    w = (np.float32(d) * q + np.float32(mn)).astype(np.float32)
    assert np.array_equal(packed.dequantize()[0], w)
    x = np.zeros((1, k), np.float32)
    x[0, :] = 0.0
    x[0, 0] = 127.0  # dx = 1: qx = x exactly for integer x
    x[0, 3], x[0, 20], x[0, 31] = 5.0, -7.0, 1.0
    want = float(w.astype(np.float64) @ x[0].astype(np.float64))
    for path in PATHS:
        y = cpu_gemm.gemm_gguf(x, packed, path=path, threads=1)
        assert y[0, 0] == pytest.approx(want, rel=1e-6, abs=1e-5), path


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("activations", cpu_gemm.GGUF_ACTIVATIONS)
def test_pools_and_thread_split_agree(rng, ggml_type, activations):
    n, k, m = 576, 576, 16  # 36 tiles, 5.3 M multiply-adds: both pools split the tiles
    k = 512 if ggml_type in K_TYPES else k
    packed = cpu_gemm.PackedGgufWeight(random_raw(rng, ggml_type, n, k), ggml_type, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    one = cpu_gemm.gemm_gguf(x, packed, bias, threads=1, activations=activations)
    for pool in cpu_gemm.POOLS:
        y = cpu_gemm.gemm_gguf(x, packed, bias, threads=2, pool=pool, activations=activations)
        assert np.array_equal(y, one), pool


@pytest.mark.parametrize("ggml_type", TYPES)
def test_residual_pass_is_far_more_accurate(rng, ggml_type):
    """q8x2 against q8 on the same product: its error bound is 128x smaller, and so is the
    measured error (by well over 30x on random data)."""
    n, k, m = 111, 576, 5
    k = 512 if ggml_type in K_TYPES else k
    raw = random_raw(rng, ggml_type, n, k)
    packed = cpu_gemm.PackedGgufWeight(raw, ggml_type, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    exact = x.astype(np.float64) @ quants.dequantize(raw, qtype(ggml_type)).astype(np.float64).T
    err = {a: np.linalg.norm(cpu_gemm.gemm_gguf(x, packed, activations=a) - exact)
           for a in cpu_gemm.GGUF_ACTIVATIONS}
    assert err["q8x2"] * 30 < err["q8"], err


def test_empty_batch_and_refusals(rng):
    raw = random_raw(rng, "Q4_1", 17, 64)
    packed = cpu_gemm.PackedGgufWeight(raw, "Q4_1", 64)
    assert cpu_gemm.gemm_gguf(np.zeros((0, 64), np.float32), packed).shape == (0, 17)
    with pytest.raises(ValueError, match="ggml_type"):
        cpu_gemm.PackedGgufWeight(raw, "Q5_1", 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_gemm.PackedGgufWeight(raw, "Q4_1", 48)
    for ggml_type in K_TYPES:  # super-blocks of 256: K 64 / 288 cannot be one
        k_raw = random_k_raw(rng, ggml_type, 3, 256)
        with pytest.raises(ValueError, match="multiple of 256"):
            cpu_gemm.PackedGgufWeight(k_raw, ggml_type, 64)
        with pytest.raises(ValueError, match="multiple of 256"):
            cpu_gemm.PackedGgufWeight(k_raw, ggml_type, 288)
        with pytest.raises(ValueError, match="raw must be"):
            cpu_gemm.PackedGgufWeight(k_raw, ggml_type, 512)
    with pytest.raises(ValueError, match="raw must be"):
        cpu_gemm.PackedGgufWeight(raw, "Q4_1", 96)  # 2 blocks of bytes, 3 claimed
    with pytest.raises(ValueError, match="raw must be"):
        cpu_gemm.PackedGgufWeight(raw, "Q4_0", 64)  # Q4_1 rows are not Q4_0 rows
    with pytest.raises(ValueError, match="raw must be"):
        cpu_gemm.PackedGgufWeight(raw.astype(np.int16), "Q4_1", 64)
    with pytest.raises(ValueError, match="raw must be"):
        cpu_gemm.PackedGgufWeight(raw.reshape(-1), "Q4_1", 64)
    with pytest.raises(ValueError, match="x must be"):
        cpu_gemm.gemm_gguf(np.zeros((1, 32), np.float32), packed)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_gemm.gemm_gguf(np.zeros((1, 64), np.float32), packed, np.zeros(16, np.float32))
    with pytest.raises(ValueError, match="activations"):
        cpu_gemm.gemm_gguf(np.zeros((1, 64), np.float32), packed, activations="q16")
    with pytest.raises(ValueError, match="path"):
        cpu_gemm.gemm_gguf(np.zeros((1, 64), np.float32), packed, path="avx512bf16")
    with pytest.raises(TypeError):
        cpu_gemm.gemm_gguf(np.zeros((1, 64), np.float32),
                           cpu_gemm.PackedWeight(np.zeros((17, 64), np.float32)))
    assert "auto" not in cpu_gemm.GGUF_PATHS and set(PATHS) <= set(cpu_gemm.GGUF_PATHS)


@pytest.mark.parametrize("group", cpu_gemm.INT4_GROUPS)
@pytest.mark.parametrize("activations", cpu_gemm.GGUF_ACTIVATIONS)
def test_int4_type_paths_pools_and_decode_loop_agree(rng, group, activations):
    """INT4_TYPE ("I4Z", AWQ / GPTQ int4: W = s * (q - z) per group; its arithmetic against
    numpy is in test_hf_int4.py): dequantize() exact, 19 bytes per 32 weights, and every path,
    pool and thread split -- and the compiled decode loop's gemm -- bit-identical."""
    from pagedrun.pyx import cpu_decode_step

    n, k, m = 576, 512, 5
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = rng.uniform(1e-3, 2e-2, (n, k // group)).astype(np.float16)
    z = rng.integers(0, 16, (n, k // group), dtype=np.uint8)
    packed = cpu_gemm.PackedGgufWeight.from_int4(q, s, z, group)
    assert packed.ggml_type == cpu_gemm.INT4_TYPE and packed.group == group
    w = np.repeat(s.astype(np.float32), group, 1) * (
        q.astype(np.float32) - np.repeat(z, group, 1).astype(np.float32))
    np.testing.assert_array_equal(packed.dequantize(), w)
    assert packed.nbytes == n * (k // 32) * 19
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    one = cpu_gemm.gemm_gguf(x, packed, bias, threads=1, activations=activations)
    for path in PATHS:
        for pool in cpu_gemm.POOLS:
            y = cpu_gemm.gemm_gguf(x, packed, bias, path=path, threads=2, pool=pool,
                                   activations=activations)
            assert np.array_equal(y, one), (path, pool)
        y = cpu_decode_step.gemm(x, packed, bias, gguf_path=path, activations=activations)
        assert np.array_equal(y, one), (path, "decode loop")
    exact = x.astype(np.float64) @ w.astype(np.float64).T + bias
    assert np.max(np.abs(one - exact)) <= (0.02 if activations == "q8" else 2e-4) * np.abs(
        exact).max()


# The AMX-INT8 kernel (path "amx", from 8 kernel rows) and its scalar-tile twin
# ("amx-emulated", any AVX512-VNNI CPU): row counts around its 16-row tiles (8 = its threshold,
# 9 / 17 / 33 a partial last row block, 64 four full ones), N a partial tile, K an odd number
# of 32-blocks (the kernel pairs blocks) or several super-blocks.
AMX_PATHS = [p for p in ("amx", cpu_gemm.GGUF_AMX_EMULATED)
             if p == cpu_gemm.GGUF_AMX_EMULATED and cpu_gemm.has_avx512vnni()
             or p == "amx" and cpu_gemm.has_amx_int8()]
AMX_CASES = [(m, n, k) for m, n, k in ((8, 17, 160), (9, 40, 96), (17, 33, 224), (33, 17, 32),
                                       (64, 24, 160))]


def amx_weight(rng, ggml_type, n, k):
    if ggml_type == cpu_gemm.INT4_TYPE:
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        s = rng.uniform(1e-3, 2e-2, (n, k // 32)).astype(np.float16)
        z = rng.integers(0, 16, (n, k // 32), dtype=np.uint8)
        return None, cpu_gemm.PackedGgufWeight.from_int4(q, s, z, 32)
    raw = random_raw(rng, ggml_type, n, k)
    return raw, cpu_gemm.PackedGgufWeight(raw, ggml_type, k)


@pytest.mark.skipif(not AMX_PATHS, reason="no AVX512-VNNI: neither AMX path runs here")
@pytest.mark.parametrize("ggml_type", TYPES + (cpu_gemm.INT4_TYPE,))
@pytest.mark.parametrize("m,n,k", AMX_CASES)
def test_amx_kernel_matches_portable(rng, ggml_type, m, n, k):
    """Bit-identical to the portable path (the same float32 ops per output in the same order;
    the tile's int32 dots are exact), and within the numpy reference's bound; both activation
    modes ("q8x2" doubles the kernel rows: m 8 -> 16), bias on odd m; the decode loop's gemm."""
    from pagedrun.pyx import cpu_decode_step

    if ggml_type in K_TYPES:
        k = 256 * (1 + k // 128)  # 1 .. 2 super-blocks (8 / 16 blocks)
    raw, packed = amx_weight(rng, ggml_type, n, k)
    x = make_x(rng, m, k, ("contiguous", "strided")[m % 2])
    bias = rng.standard_normal(n).astype(np.float32) if m % 2 else None
    for activations in cpu_gemm.GGUF_ACTIVATIONS:
        want = cpu_gemm.gemm_gguf(x, packed, bias, path="portable", threads=1,
                                  activations=activations)
        if raw is not None:
            ref, slack = reference(x, raw, ggml_type, k, bias, activations)
            assert (np.abs(want - ref) <= slack + FP32_UNIT_ROUNDOFF * np.abs(ref)).all()
        for path in AMX_PATHS:
            for threads in (1, 2):
                y = cpu_gemm.gemm_gguf(x, packed, bias, path=path, threads=threads,
                                       activations=activations)
                np.testing.assert_array_equal(y, want, err_msg=f"{path} {threads}")
            y = cpu_decode_step.gemm(x, packed, bias, gguf_path=path, activations=activations)
            np.testing.assert_array_equal(y, want, err_msg=f"{path} decode loop")


# ---------------------------------------------------------------- activations "bf16"
# x rounded to bf16, each weight tile unpacked to bf16 (pyx/cpu_gguf_bf16_kernels.h), the bf16
# GEMM's micro-kernel. Reference: the packed weight's own float32 dequantization (bit-exact
# against gguf's: the tests above) rounded to bf16, times bf16(x), in float64. The kernel's
# products of two bf16 values are exact in float32; its K accumulating adds and the bias add
# each round once, so |err| <= gamma_(K + 2) * (|bf16 x| @ |bf16 W|.T + |bias|) (Higham's
# bound for a float32 sum of K + 1 exact terms, plus the output's own rounding).
# The unpack kernel is AVX-512's: the avx2 path runs activations "bf16" on the portable one.
BF16_PATHS = [p for p in PATHS if p == "portable" or (p != "avx2" and cpu_gemm.has_gguf_bf16())]
# (N, K, M): a partial last tile (17, 111, 49), one output, an odd tile count (49: the kernel
# pairs tiles), K of 1 .. 48 blocks, M from 1 to past a pass of rows (83 at K 1536: the pass is
# 80 rows), and M not a multiple of the 8-row micro-kernel.
BF16_SHAPES = [(1, 32, 1), (17, 96, 3), (49, 576, 9), (111, 1536, 83), (17, 32, 64),
               (33, 1536, 17)]
BF16_K_SHAPES = [(1, 256, 1), (17, 512, 3), (49, 1536, 17), (111, 256, 83), (33, 1536, 64)]
BF16_CASES = ([(t, *s) for t in TYPES for s in (BF16_K_SHAPES if t in K_TYPES else BF16_SHAPES)]
              + [(cpu_gemm.INT4_TYPE, *s) for s in BF16_SHAPES if s[1] % 64 == 0])


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even) as float32; finite inputs only. Numpy's own,
    independent of the kernel's f32_to_bf16."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def bf16_weight(rng, ggml_type, n, k):
    """A PackedGgufWeight of a random [n, k] weight of any type here (I4Z: groups of 64)."""
    if ggml_type == cpu_gemm.INT4_TYPE:
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        s = rng.uniform(1e-3, 2e-2, (n, k // 64)).astype(np.float16)
        z = rng.integers(0, 16, (n, k // 64), dtype=np.uint8)
        return cpu_gemm.PackedGgufWeight.from_int4(q, s, z, 64)
    return cpu_gemm.PackedGgufWeight(random_raw(rng, ggml_type, n, k), ggml_type, k)


@pytest.mark.parametrize("ggml_type,n,k,m", BF16_CASES)
def test_bf16_activations_match_bf16_reference(rng, ggml_type, n, k, m):
    packed = bf16_weight(rng, ggml_type, n, k)
    x = make_x(rng, m, k, ("contiguous", "transposed", "strided")[(n + m) % 3])
    bias = rng.standard_normal(n).astype(np.float32) if m % 2 else None
    xb = bf16_round(x).astype(np.float64)
    wb = bf16_round(packed.dequantize()).astype(np.float64)
    want = xb @ wb.T + (0 if bias is None else bias.astype(np.float64))
    mag = np.abs(xb) @ np.abs(wb).T + (0 if bias is None else np.abs(bias.astype(np.float64)))
    gamma = (k + 2) * FP32_UNIT_ROUNDOFF / (1 - (k + 2) * FP32_UNIT_ROUNDOFF)
    results = {}
    for path in BF16_PATHS:
        for threads in (1, 2):
            y = cpu_gemm.gemm_gguf(x, packed, bias, path=path, threads=threads,
                                   activations="bf16")
            assert y.shape == (m, n) and y.dtype == np.float32
            err = np.abs(y.astype(np.float64) - want)
            assert (err <= gamma * mag).all(), (path, threads, float((err - gamma * mag).max()))
            results[path, threads] = y
    for path in BF16_PATHS:  # one path: the same bits whatever the thread split
        assert np.array_equal(results[path, 1], results[path, 2]), path


@pytest.mark.parametrize("ggml_type", TYPES + (cpu_gemm.INT4_TYPE,))
def test_bf16_unpack_is_the_rounded_dequantization_exactly(rng, ggml_type):
    """x = the identity (M = K rows): row j of y is column j of the unpacked weight, one exact
    product each, so y.T must equal bf16(dequantize()) bit for bit (a wrong scale, offset, k
    order or rounding shows here however small), and with a bias float32(that + bias)."""
    n, k = 49, 512
    packed = bf16_weight(rng, ggml_type, n, k)
    want = bf16_round(packed.dequantize())
    bias = rng.standard_normal(n).astype(np.float32)
    eye = np.eye(k, dtype=np.float32)
    for path in BF16_PATHS:
        y = cpu_gemm.gemm_gguf(eye, packed, path=path, activations="bf16")
        np.testing.assert_array_equal(y.T, want, err_msg=path)
        y = cpu_gemm.gemm_gguf(eye, packed, bias, path=path, threads=1, activations="bf16")
        np.testing.assert_array_equal(y, want.T + bias, err_msg=path)


def test_auto_activations_choose_by_rows():
    """"auto": q8x2 below BF16_MIN_ROWS rows, bf16 from there on the avx512vnni path of a CPU
    that runs the unpack kernel; q8x2 on the portable and AMX paths."""
    t = cpu_gemm.BF16_MIN_ROWS
    assert cpu_gemm.gguf_activations_for(t - 1) == "q8x2"
    # What "auto" resolves to now (a --cpu-isa cap may hold it below the CPU's best).
    vector = cpu_gemm.auto_paths()[1] == "avx512vnni" and cpu_gemm.has_gguf_bf16()
    assert cpu_gemm.gguf_activations_for(t) == ("bf16" if vector else "q8x2")
    assert cpu_gemm.gguf_activations_for(4 * t, path="portable") == "q8x2"
    if cpu_gemm.has_avx512vnni():
        assert cpu_gemm.gguf_activations_for(4 * t, path=cpu_gemm.GGUF_AMX_EMULATED) == "q8x2"
    for mode in ("q8", "q8x2", "bf16"):
        assert cpu_gemm.gguf_activations_for(1, activations=mode) == mode
    with pytest.raises(ValueError, match="activations"):
        cpu_gemm.gguf_activations_for(1, activations="int4")


@pytest.mark.parametrize("ggml_type", ("Q4_1", "Q8_0", "Q6_K"))
def test_auto_and_bf16_pools_and_decode_loop_agree(rng, ggml_type):
    """"auto" equals the mode it names (gguf_activations_for) bit for bit at the threshold and
    one row below, on both pools and in the compiled decode loop's gemm (which must choose
    alike: the step's results equal the per-op path's)."""
    from pagedrun.pyx import cpu_decode_step

    n, k = 576, 512
    packed = bf16_weight(rng, ggml_type, n, k)
    bias = rng.standard_normal(n).astype(np.float32)
    for m in (cpu_gemm.BF16_MIN_ROWS - 1, cpu_gemm.BF16_MIN_ROWS, 37):
        x = rng.standard_normal((m, 2 * k)).astype(np.float32)[:, ::2]
        for path in PATHS:
            named = cpu_gemm.gguf_activations_for(m, path=path)
            want = cpu_gemm.gemm_gguf(x, packed, bias, path=path, threads=1, activations=named)
            for activations in ("auto", named):
                for pool in cpu_gemm.POOLS:
                    y = cpu_gemm.gemm_gguf(x, packed, bias, path=path, threads=2, pool=pool,
                                           activations=activations)
                    np.testing.assert_array_equal(y, want, err_msg=f"{m} {path} {pool}")
                for threads in (1, 2):
                    y = cpu_decode_step.gemm(x, packed, bias, threads=threads, gguf_path=path,
                                             activations=activations)
                    np.testing.assert_array_equal(y, want, err_msg=f"{m} {path} loop")


# Blocks whose every weight has the largest code its type stores (bytes of all ones; Q8_0 also
# -128, the largest |q|), with small positive scales: the integer dots of an all-equal
# activation row are then the largest the kernels ever form. Layout offsets: the file block's
# bytes after its fp16 scale(s) and 6-bit sub-scales (Q4_K / Q5_K: d, dmin, 12 scale bytes; Q6_K
# ends with 16 int8 scales and d).
_MAX_CODE_QUANTS = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q8_0": (2, 34), "Q5_0": (2, 22),
                    "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


def _max_code_raw(ggml_type, n, k, fill):
    fb = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q5_K": 176,
          "Q6_K": 210}[ggml_type]
    unit = 256 if ggml_type in K_TYPES else 32
    blocks = np.zeros((n, k // unit, fb), np.uint8)
    start, end = _MAX_CODE_QUANTS[ggml_type]
    blocks[:, :, start:end] = fill
    half = np.array([0.01], np.float16).view(np.uint8)
    if ggml_type == "Q6_K":
        blocks[:, :, 192:208] = 1  # int8 sub-scales
        blocks[:, :, 208:210] = half
    else:
        blocks[:, :, 0:2] = half  # d
        if ggml_type in ("Q4_1", "Q4_K", "Q5_K"):
            blocks[:, :, 2:4] = half  # m / dmin
        if ggml_type in ("Q4_K", "Q5_K"):
            blocks[:, :, 4:16] = 0x21  # 6-bit scales and mins: 33, and the high bits
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("ggml_type,fill", [(t, 0xFF) for t in _MAX_CODE_QUANTS]
                         + [("Q8_0", 0x80)])
@pytest.mark.parametrize("activations", cpu_gemm.GGUF_ACTIVATIONS)
def test_largest_integer_dots_are_exact(ggml_type, fill, activations):
    """The AVX2 kernel sums vpmaddubsw's saturating int16 pairs a bounded number of times per
    type (pyx/cpu_quant_avx2_kernels.h: 8, 4, 2 or 1); one more would overflow int16 on these
    blocks. Every path must give the portable path's bits (its int32 sums cannot overflow) and
    the float64 product of the dequantized weights; rows of +1 and -1 (qx all +127 / -127) at
    M 1 (decode) and 6 (4-row blocks and a tail)."""
    k = 512 if ggml_type in K_TYPES else 96
    packed = cpu_gemm.PackedGgufWeight(_max_code_raw(ggml_type, 19, k, fill), ggml_type, k)
    w = packed.dequantize().astype(np.float64)
    for m in (1, 6):
        x = np.where(np.arange(m)[:, None] % 2 == 0, 1.0, -1.0) * np.ones((m, k))
        x = x.astype(np.float32)
        want = cpu_gemm.gemm_gguf(x, packed, path="portable", threads=1, activations=activations)
        exact = x.astype(np.float64) @ w.T
        # qx = +-127 exactly; x ~= dx * qx with dx = 1/127 in float32: relative 2^-24 per
        # activation, plus float32 sums of the per-block products.
        np.testing.assert_allclose(want, exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())
        for path in PATHS:
            y = cpu_gemm.gemm_gguf(x, packed, path=path, threads=2, activations=activations)
            np.testing.assert_array_equal(y, want, err_msg=f"{path} m {m}")
