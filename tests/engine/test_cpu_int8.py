"""int8 on the cpu backend (EngineConfig.quantization "int8"): the Q8_0 quantizer
(runtime/backends/q8_0_blocks.py) against its definition and against gguf's Q8_0 format; the
backend's GEMM (Q8_0 weights, gemm_gguf with each activation mode, every GGUF path) against a
float64 product of the float weights within the bound its arithmetic gives; the fallback format
(cpu_gemm.PackedInt8Weight, for an input width that is not a multiple of 32: its quantizer and
kernel, every path, against a float64 product of the same bf16-rounded activations and int8
weights); the backend's model logits against the float32 backend running the Q8_0 weights, and
the configuration / CLI surface. The default model's int8 answer is checked in
test_cpu_bf16.py (test_default_model_greedy_answer)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_helpers import greedy, make_engine, prefill_logits, run_requests

from pagedrun.pyx import cpu_gemm
from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.backends.cpu_int8_backend import DEFAULT_ACTIVATIONS, CpuInt8Backend
from pagedrun.runtime.backends.q8_0_blocks import dequantize_q8_0, quantize_q8_0
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError

PATHS = list(cpu_gemm.available_paths())
GGUF_PATHS = list(cpu_gemm.available_gguf_paths())
FP32_UNIT_ROUNDOFF = 2.0 ** -24
FP16_SMALLEST = 2.0 ** -24  # fp16's smallest subnormal: its step below the normal range
FP16_RELATIVE_STEP = 2.0 ** -10  # between adjacent normal fp16 values, relative
BF16_UNIT_ROUNDOFF = 2.0 ** -9  # round to nearest even to 8 significant bits


@pytest.fixture
def rng():
    return np.random.default_rng(20261202)


def reference_quantize(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The definition, group by group in float64: scale = max |w| / 127, q = round(w / scale)."""
    n, k = w.shape
    num_groups = -(-k // group_size)
    q = np.zeros(w.shape, np.int64)
    scales = np.zeros((n, num_groups), np.float64)
    for row in range(n):
        for g in range(num_groups):
            part = w[row, g * group_size:(g + 1) * group_size].astype(np.float64)
            top = np.abs(part).max()
            if top == 0:
                continue
            scales[row, g] = np.float32(top / 127.0)
            q[row, g * group_size:(g + 1) * group_size] = np.rint(part / scales[row, g])
    return q, scales


def bf16_values(x: np.ndarray) -> np.ndarray:
    bits = cpu_gemm.to_bf16_bits(x).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(np.float64)


def check_int8_gemm(y, x, packed, bias):
    """y against float64 sum_g (bf16(x_g) @ q_g.T) * scale_g + bias. bf16 x int8 products are
    exact in float32, so the error is the float32 sums within a group (Higham's gamma_(G+2),
    doubled for vdpbf16ps' pairwise adds) times the scales, plus the float32 FMAs folding the
    groups and the bias add (gamma_(num_groups + 2) of the same magnitudes)."""
    xv = bf16_values(x)
    q, scales = packed.quantized()
    q, scales = q.astype(np.float64), scales.astype(np.float64)
    group = packed.group_size
    ref = np.zeros((x.shape[0], packed.n))
    abs_sum = np.zeros_like(ref)
    for g in range(scales.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        ref += (xv[:, cols] @ q[:, cols].T) * scales[:, g]
        abs_sum += (np.abs(xv[:, cols]) @ np.abs(q[:, cols]).T) * scales[:, g]
    if bias is not None:
        ref += bias.astype(np.float64)
        abs_sum += np.abs(bias.astype(np.float64))
    n = min(group, x.shape[1]) + scales.shape[1] + 6
    bound = 2 * n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF) * abs_sum + 1e-30
    assert y.dtype == np.float32 and y.shape == ref.shape
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("group_size", [None, 64, 32, 6])
def test_quantize_matches_definition_and_packing_round_trips(rng, group_size):
    w = (rng.standard_normal((37, 53)) * rng.uniform(0.01, 10, (37, 1))).astype(np.float32)
    w[5] = 0.0                                  # a zero row: scale 0, q 0
    w[7, 3] = -np.abs(w[7]).max() * 1.5          # the row's extreme is negative: q -127
    packed = cpu_gemm.PackedInt8Weight(w, group_size=group_size)
    q, scales = packed.quantized()
    group = group_size or 54                     # None: one group of all of K (53, padded 54)
    assert packed.group_size == group and scales.shape == (37, -(-53 // group))
    ref_q, ref_scales = reference_quantize(w, group)
    np.testing.assert_array_equal(scales, ref_scales.astype(np.float32))
    # float32 division may land a half-way value one step away from float64's: at most 1.
    assert np.max(np.abs(q.astype(np.int64) - ref_q)) <= 1
    assert np.mean(q.astype(np.int64) != ref_q) < 0.01
    assert q.min() >= -127 and q.max() <= 127 and q[7, 3] == -127
    assert not q[5].any() and not scales[5].any()
    # The round trip: at most half a step per weight.
    step = np.repeat(scales, group, axis=1)[:, :53]
    assert np.all(np.abs(packed.dequantized() - w) <= step * 0.5 * (1 + 1e-5))
    assert packed.packed.dtype == np.int8  # one byte per weight (tiles padded to 16 x 2)


def test_quantize_refuses_non_finite_and_bad_shapes():
    with pytest.raises(ValueError, match="non-finite"):
        cpu_gemm.PackedInt8Weight(np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        cpu_gemm.PackedInt8Weight(np.array([[np.inf, 1.0]], np.float32))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        cpu_gemm.PackedInt8Weight(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="group_size"):
        cpu_gemm.PackedInt8Weight(np.zeros((2, 4), np.float32), group_size=5)
    with pytest.raises(TypeError, match="PackedInt8Weight"):
        cpu_gemm.gemm_int8(np.zeros((1, 4), np.float32),
                           cpu_gemm.PackedWeight(np.zeros((2, 4), np.float32)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 111])
def test_int8_gemm_shapes(rng, path, m):
    # M 1-2: the streaming decode kernel (one tile, two accumulator sets); 3+: 4-row blocks by
    # two tiles with 1-3 remainder rows; odd K (the odd last pair), groups with a short last
    # one and groups of one pair, per-channel scales, N with partial and odd tile counts.
    for (n, k), group in zip(((33, 577), (1000, 64), (17, 1), (49, 130), (40, 96)),
                             (64, None, 64, 2, 32)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
        w[:, :k // 3] *= 20  # groups of very different magnitudes: the scales must differ
        bias = rng.standard_normal(n).astype(np.float32) if (m + n) % 2 else None
        packed = cpu_gemm.PackedInt8Weight(w, group_size=group)
        for threads, pool in ((1, "native"), (2, "native"), (2, "python")):
            check_int8_gemm(cpu_gemm.gemm_int8(x, packed, bias, path=path, threads=threads,
                                               pool=pool), x, packed, bias)


def test_int8_gemm_strided_input_and_paths_agree(rng):
    k, n = 131, 77
    packed = cpu_gemm.PackedInt8Weight(rng.standard_normal((n, k)).astype(np.float32))
    big = rng.standard_normal((40, 2 * k + 3)).astype(np.float32)
    strided = big[::3, 1:2 * k + 1:2]
    ys = [cpu_gemm.gemm_int8(strided, packed, path=p) for p in PATHS]
    check_int8_gemm(ys[0], strided, packed, None)
    for y in ys[1:]:
        np.testing.assert_allclose(y, ys[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ Q8_0 blocks (the format)

def fp16_ceil(value: float) -> float:
    """The smallest fp16 value >= value (value >= 0, below fp16's largest)."""
    f = np.float16(value)
    if float(f) < value:
        f = np.nextafter(f, np.float16(np.inf))
    return float(f)


def awkward_weight(rng, n: int, k: int) -> np.ndarray:
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3, (n, 1))).astype(np.float32)
    w[1] = 0.0                                     # a zero row: d 0, q 0
    w[2, 3] = -np.abs(w[2, :32]).max() * 1.5       # the block's extreme is negative
    w[3, :32] *= 1e-6                              # d in fp16's subnormal range
    w[3, 32:64] = 3e-10                            # d below fp16's smallest: rounded up to it
    w[4, :32] *= 1e4                               # a large d
    w[5, 32:64] = 0.0                              # one zero block in a live row
    return w


@pytest.mark.parametrize("shape", [(37, 96), (6, 576), (1, 32)])
def test_q8_0_quantizer_matches_its_definition(rng, shape):
    n, k = shape
    w = awkward_weight(rng, max(n, 6), k)[:n]
    raw = quantize_q8_0(w)
    assert raw.dtype == np.uint8 and raw.shape == (n, k // 32 * 34)
    blocks = raw.reshape(n, k // 32, 34)
    d = np.ascontiguousarray(blocks[:, :, :2]).view("<f2")[:, :, 0].astype(np.float64)
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).astype(np.int64)
    wb = w.reshape(n, k // 32, 32).astype(np.float64)
    for row in range(n):
        for b in range(k // 32):
            # d: float32 max |w| / 127, rounded up to fp16 (0 for an all-zero block).
            top = np.float32(np.abs(wb[row, b]).max())
            want = fp16_ceil(float(top / np.float32(127))) if top > 0 else 0.0
            assert d[row, b] == want, (row, b)
    # q: round half to even of w / d in float64 -- the quantizer divides in float32, which can
    # turn a value a hair off a half-way point into the half-way point: one step, rarely.
    safe = np.where(d > 0, d, 1.0)[:, :, None]
    want_q = np.rint(wb / safe)
    assert np.max(np.abs(q - want_q.reshape(q.shape))) <= 1
    assert np.mean(q != want_q) < 0.01
    assert q.min() >= -127 and q.max() <= 127
    # The error bound the GEMM tests use: |w - d q| <= d / 2 per weight, and d within one fp16
    # step (or fp16's smallest, below its normal range) of max |w| / 127.
    err = np.abs(wb - d[:, :, None] * q)
    assert np.all(err <= d[:, :, None] / 2 * (1 + 2 ** -20))
    top = np.abs(wb).max(axis=2)
    assert np.all(d >= top / 127 * (1 - 2 ** -23))
    assert np.all(d <= top / 127 * (1 + FP16_RELATIVE_STEP) + FP16_SMALLEST)
    if n > 4:
        assert q[2, 0].min() == -127 and not q[1].any() and not d[1].any()
        assert d[3, 1] == FP16_SMALLEST and not q[3, 1].any()   # 3e-10 < d / 2: rounds to 0
        assert 0 < d[3, 0] < 2 ** -14                             # subnormal, still in use


def test_q8_0_blocks_are_gguf_q8_0(rng):
    """The bytes are GGUF's Q8_0 (gguf's own dequantization reads them), PackedGgufWeight
    repacks them without changing a value, and llama.cpp's quantizer (gguf.quants, its
    bit-exact port) differs only where the rounding rule does: d one fp16 step lower when
    max / 127 rounds down to nearest, q by at most one step."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = awkward_weight(rng, 23, 160)
    raw = quantize_q8_0(w)
    ours = dequantize_q8_0(raw, 160)
    np.testing.assert_array_equal(quants.dequantize(raw, GGMLQuantizationType.Q8_0), ours)
    np.testing.assert_array_equal(cpu_gemm.PackedGgufWeight(raw, "Q8_0", 160).dequantize(), ours)
    theirs = quants.quantize(w, GGMLQuantizationType.Q8_0).reshape(23, 5, 34)
    mine = raw.reshape(23, 5, 34)
    d_theirs = np.ascontiguousarray(theirs[:, :, :2]).view("<f2").astype(np.float64)
    d_mine = np.ascontiguousarray(mine[:, :, :2]).view("<f2").astype(np.float64)
    assert not np.any(d_mine < d_theirs)
    up = np.nextafter(d_theirs.astype(np.float16), np.float16(np.inf)).astype(np.float64)
    assert np.all((d_mine == d_theirs) | (d_mine == up))
    q_diff = (mine[:, :, 2:].view(np.int8).astype(int) - theirs[:, :, 2:].view(np.int8))
    # Blocks with a normal fp16 d (below it, one step of d is no longer 2^-10 of it: there
    # llama.cpp's q, computed against the unrounded d, may be far from its fp16 d's).
    normal = d_theirs[:, :, 0] >= 2.0 ** -14
    assert normal.mean() > 0.9 and np.abs(q_diff[normal]).max() <= 1


def test_q8_0_quantizer_refuses():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_q8_0(np.array([[np.nan] + [0.0] * 31], np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="overflows fp16"):
        quantize_q8_0(np.full((1, 32), 1e7, np.float32))


# ------------------------------------------------------- the backend's GEMM (Q8_0, gemm_gguf)

def q8_0_gemm_bounds(x, w, raw, bias, mode):
    """(activation bound, weight bound), float64 [M, N]: the backend's GEMM over Q8_0 weights
    `raw` of the float weight w, with activation mode `mode` (one of gemm_gguf's resolved
    modes), gives y with |y - (x @ w_hat.T + bias)| <= the first (w_hat = dequantize(raw)) and
    so |y - (x @ w.T + bias)| <= their sum: x_hat @ w_hat.T - x @ w.T = (x_hat - x) @ w_hat.T +
    x @ (w_hat - w).T exactly.
    - weights: |w_hat - w| <= d / 2 per weight (the quantizer's bound, tested above); in mode
      "bf16" w_hat is rounded to bf16 again (2^-9 relative), which counts as activation-side;
    - activations, per element of a 32-block with dx = max |x_b| / 127: "q8" |e| <= dx / 2
      (plus the float32 division's rounding of x / dx <= 127: 2^-17 dx); "q8x2": the residual
      r = x - dx q (one rounding) quantized with dx / 256, |r / (dx / 256)| <= 128 (1 + 2^-16)
      clamped to 127: |e| <= dx / 256 (1 + 2^-15) + 2^-24 |r|, under dx / 256 (1 + 2^-12);
      "bf16": |e| <= 2^-9 |x|;
    - float32: the block products (integer dot x fl(d dx)) summed with fmas, the two passes'
      rows added, the bias added: Higham's gamma_n with n = K + 2 K / 32 + 8 of the sums of
      |terms| (K covers the bf16 kernel's per-element sums; the int8 kernels round far less)."""
    m, k = x.shape
    nb = k // 32
    x64 = x.astype(np.float64)
    blocks = raw.reshape(w.shape[0], nb, 34)
    d = np.ascontiguousarray(blocks[:, :, :2]).view("<f2")[:, :, 0].astype(np.float64)
    w_hat = dequantize_q8_0(raw, k).astype(np.float64)
    dx = np.abs(x64).reshape(m, nb, 32).max(axis=2) / 127 * (1 + 2 * FP32_UNIT_ROUNDOFF)
    per_element = np.repeat(dx, 32, axis=1)
    e_act = {"q8": per_element * (0.5 + 2 ** -17),
             "q8x2": per_element / 256 * (1 + 2 ** -12),
             "bf16": np.abs(x64) * BF16_UNIT_ROUNDOFF}[mode]
    abs_x, abs_w = np.abs(x64), np.abs(w_hat)
    n_ops = k + 2 * nb + 8
    gamma = n_ops * FP32_UNIT_ROUNDOFF / (1 - n_ops * FP32_UNIT_ROUNDOFF)
    abs_bias = 0.0 if bias is None else np.abs(bias.astype(np.float64))
    activation = e_act @ abs_w.T + gamma * (2 * (abs_x + e_act) @ abs_w.T + abs_bias)
    if mode == "bf16":  # the bf16 kernel's weights: w_hat rounded again
        activation += (abs_x + e_act) @ (abs_w * BF16_UNIT_ROUNDOFF).T
    weight = abs_x @ (np.repeat(d, 32, axis=1) / 2).T
    return activation + 1e-30, weight


def float64_linear(x, w, bias):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if bias is None else y + bias.astype(np.float64)


@pytest.mark.parametrize("gguf_path", GGUF_PATHS)
@pytest.mark.parametrize("activations", ["q8", "q8x2", "auto"])
def test_backend_gemm_within_its_arithmetic_bound(rng, gguf_path, activations):
    # M 1-2: the decode kernels; 3+: row blocks with remainders; 33+, 64: where "auto" may take
    # bf16 activations (AVX512-BF16 CPUs). N with partial and single tiles; K 32 (one block),
    # 96, 576 (the default model's width); inputs with a large outlier per row (a wide dx).
    for m in (1, 2, 5, 17, 64):
        for n, k in ((33, 576), (1, 96), (130, 32)):
            backend = CpuInt8Backend(activations=activations, gguf_path=gguf_path,
                                     decode_loop=False)
            w = awkward_weight(rng, n, k) if n > 6 else rng.standard_normal((n, k)).astype(
                np.float32)
            x = rng.standard_normal((m, k)).astype(np.float32)
            x[:, rng.integers(0, k)] *= 30
            bias = rng.standard_normal(n).astype(np.float32) if (m + n) % 2 else None
            packed = backend.linear_weight(w)
            assert isinstance(packed, cpu_gemm.PackedGgufWeight) and packed.ggml_type == "Q8_0"
            y = backend.linear(x, packed, bias).astype(np.float64)
            assert y.shape == (m, n)
            mode = cpu_gemm.gguf_activations_for(m, gguf_path, activations)
            raw = quantize_q8_0(w)
            activation, weight = q8_0_gemm_bounds(x, w, raw, bias, mode)
            err = np.abs(y - float64_linear(x, dequantize_q8_0(raw, k), bias))
            assert np.all(err <= activation), (m, n, k, mode, float(np.max(err / activation)))
            err = np.abs(y - float64_linear(x, w, bias))
            assert np.all(err <= activation + weight), (m, n, k, mode)


def test_backend_gemm_bound_is_tight_enough_to_tell_the_modes_apart(rng):
    """The q8x2 bound fails q8's output (llama.cpp's single pass): the bounds test each mode's
    arithmetic."""
    m, n, k = 17, 64, 576
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    raw = quantize_q8_0(w)
    q8 = CpuInt8Backend(activations="q8", decode_loop=False)
    err = np.abs(q8.linear(x, q8.linear_weight(w)).astype(np.float64)
                 - float64_linear(x, dequantize_q8_0(raw, k), None))
    assert np.any(err > q8_0_gemm_bounds(x, w, raw, None, "q8x2")[0])
    assert np.all(err <= q8_0_gemm_bounds(x, w, raw, None, "q8")[0])


def test_backend_default_activations_and_formats(rng):
    backend = CpuInt8Backend()
    assert backend.activations == DEFAULT_ACTIVATIONS and backend.quantization == "int8"
    assert CpuInt8Backend(path="portable").gguf_path == "portable"
    with pytest.raises(ValueError, match="activations"):
        CpuInt8Backend(activations="int4")
    with pytest.raises(ValueError, match="path"):
        CpuInt8Backend(gguf_path="sse2")
    # 1.0625 bytes a weight (34 per 32), tiles of 16 outputs.
    packed = backend.linear_weight(rng.standard_normal((48, 64)).astype(np.float32))
    assert packed.nbytes == 48 * 64 // 32 * 34
    # An input width that is not a multiple of 32: the group-64 weight-only format.
    w = rng.standard_normal((20, 70)).astype(np.float32)
    x = rng.standard_normal((3, 70)).astype(np.float32)
    fallback = backend.linear_weight(w)
    assert isinstance(fallback, cpu_gemm.PackedInt8Weight)
    check_int8_gemm(backend.linear(x, fallback), x, fallback, None)
    # A float32 weight given to linear directly (MoE experts): packed once at first use.
    w2 = rng.standard_normal((40, 96)).astype(np.float32)
    before = backend.packed_weight_bytes()
    y = backend.linear(rng.standard_normal((2, 96)).astype(np.float32), w2)
    assert y.shape == (2, 40)
    expert_bytes = 48 * 96 // 32 * 34  # 40 outputs padded to three 16-output tiles
    assert backend.packed_weight_bytes() == before + expert_bytes
    backend.linear(np.zeros((1, 96), np.float32), w2)
    assert backend.packed_weight_bytes() == before + expert_bytes


def dequantized_weights(weights):
    """A copy of ModelWeights whose GEMM weights are their Q8_0 round trip (by row and 32-block
    along K, which the fused matrices share with each part: quantizing the fused QKV or gate/up
    gives each part's blocks)."""
    def dq(w):
        return None if w is None else dequantize_q8_0(quantize_q8_0(w), w.shape[1])

    layers = [dataclasses.replace(lw, q_proj=dq(lw.q_proj), k_proj=dq(lw.k_proj),
                                  v_proj=dq(lw.v_proj), o_proj=dq(lw.o_proj),
                                  gate_proj=dq(lw.gate_proj), up_proj=dq(lw.up_proj),
                                  down_proj=dq(lw.down_proj))
              for lw in weights.layers]
    return dataclasses.replace(weights, layers=layers, lm_head=dq(weights.lm_head))


# The logits' largest difference from float32 on the Q8_0 weights, as a share of their spread,
# per activation mode (what the activations' rounding leaves after two random layers): measured
# q8x2 0.0002, q8 0.062 on both paths (avx2, portable; 2026-12-07); bf16 as test_cpu_bf16's
# BF16_LOGIT_TOLERANCE (~2% measured). Room: 10x, 2x, 2.5x.
ACTIVATION_LOGIT_TOLERANCE = {"q8x2": 0.002, "q8": 0.12, "bf16": 0.05}


@pytest.mark.parametrize("gguf_path", GGUF_PATHS)
@pytest.mark.parametrize("activations", ["q8x2", "q8", "auto"])
def test_tiny_model_logits_are_float32_of_the_q8_0_weights(tiny_cpu_model, rng, gguf_path,
                                                          activations):
    config, weights = tiny_cpu_model
    tokens = rng.integers(3, config.vocab_size, 29).tolist()
    ref = prefill_logits(config, dequantized_weights(weights), NumpyBackend(), tokens)
    got = prefill_logits(config, weights, CpuInt8Backend(gguf_path=gguf_path,
                                                         activations=activations), tokens)
    spread = float(ref.std())
    worst = np.max(np.abs(got - ref)) / spread
    mode = cpu_gemm.gguf_activations_for(len(tokens), gguf_path, activations)
    assert worst <= ACTIVATION_LOGIT_TOLERANCE[mode]
    # ... and not the float32 weights' logits: the int8 rounding is really there.
    plain = prefill_logits(config, weights, NumpyBackend(), tokens)
    assert np.max(np.abs(plain - ref)) > 0


def test_tiny_engine_int8_runs_batched(tiny_cpu_model, rng):
    engine = make_engine(tiny_cpu_model, quantization="int8", block_size=8,
                         max_num_batched_tokens=40)
    assert isinstance(engine.backend, CpuInt8Backend)
    assert engine.backend.activations == DEFAULT_ACTIVATIONS
    prompts = [rng.integers(3, tiny_cpu_model[0].vocab_size, n).tolist() for n in (5, 23, 61, 2)]
    requests = [(i, f"r{i}", dict(prompt_token_ids=p, sampling_params=greedy(7)))
                for i, p in enumerate(prompts)]
    outputs = run_requests(engine, requests)
    assert all(len(out.outputs[0].token_ids) == 7 for out in outputs.values())
    assert engine.backend.packed_weight_bytes() > 0
    # Every block back in the pool once the requests are done.
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_quantization_config_and_cli():
    assert EngineConfig().quantization is None
    assert EngineConfig(quantization="int8").quantization == "int8"
    with pytest.raises(EngineConfigError, match="quantization"):
        EngineConfig(quantization="int4")
    assert isinstance(make_backend("cpu", "bfloat16", quantization="int8"), CpuInt8Backend)
    assert type(make_backend("cpu", "float32", quantization="none")) is NumpyBackend
    # sim / cuda: W8A16 (cuda/gemm_wq.cu, tests/engine/test_weight_only_sim.py), 16-bit only.
    assert make_backend("sim", quantization="int8").quantization == "int8"
    with pytest.raises(EngineConfigError, match="float16 or bfloat16"):
        make_backend("sim", "float32", quantization="int8")
    from pagedrun.server.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--quantization", "int8"])
    assert args.quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])
