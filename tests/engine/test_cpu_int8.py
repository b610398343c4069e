"""Weight-only int8 on the cpu backend (EngineConfig.quantization "int8"): the quantizer against
its definition, pagedrun.pyx.cpu_gemm's int8 kernel against a float64 product of the same
bf16-rounded activations and int8 weights (every path, decode and prefill row counts, both
thread counts), the backend's model logits against the float32 backend running the dequantized
weights, and the configuration / CLI surface. The default model's int8 answer is checked in
test_cpu_bf16.py (test_default_model_greedy_answer)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_helpers import greedy, make_engine, prefill_logits, run_requests

from pagedrun.pyx import cpu_gemm
from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.backends.cpu_int8_backend import CpuInt8Backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError

PATHS = list(cpu_gemm.available_paths())
FP32_UNIT_ROUNDOFF = 2.0 ** -24


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


def dequantized_weights(weights):
    """A copy of ModelWeights whose GEMM weights are their int8 round trip (by row and group,
    which is what the backend's quantization of the fused matrices gives too)."""
    def dq(w):
        return None if w is None else cpu_gemm.PackedInt8Weight(w).dequantized()

    # Groups run along K (the input features), which the fused matrices share with each part.
    layers = [dataclasses.replace(lw, q_proj=dq(lw.q_proj), k_proj=dq(lw.k_proj),
                                  v_proj=dq(lw.v_proj), o_proj=dq(lw.o_proj),
                                  gate_proj=dq(lw.gate_proj), up_proj=dq(lw.up_proj),
                                  down_proj=dq(lw.down_proj))
              for lw in weights.layers]
    return dataclasses.replace(weights, layers=layers, lm_head=dq(weights.lm_head))


# As test_cpu_bf16's BF16_LOGIT_TOLERANCE: the bf16-rounded activations are the only
# difference from float32 on the dequantized weights (measured ~2% of the logits' spread).
BF16_LOGIT_TOLERANCE = 0.05


@pytest.mark.parametrize("path", PATHS)
def test_tiny_model_logits_are_float32_of_the_dequantized_weights(tiny_cpu_model, rng, path):
    config, weights = tiny_cpu_model
    tokens = rng.integers(3, config.vocab_size, 29).tolist()
    ref = prefill_logits(config, dequantized_weights(weights), NumpyBackend(), tokens)
    got = prefill_logits(config, weights, CpuInt8Backend(path=path), tokens)
    spread = float(ref.std())
    assert np.max(np.abs(got - ref)) <= BF16_LOGIT_TOLERANCE * spread
    # ... and not the float32 weights' logits: the int8 rounding is really there.
    plain = prefill_logits(config, weights, NumpyBackend(), tokens)
    assert np.max(np.abs(plain - ref)) > 0


def test_tiny_engine_int8_runs_batched(tiny_cpu_model, rng):
    engine = make_engine(tiny_cpu_model, quantization="int8", block_size=8,
                         max_num_batched_tokens=40)
    assert isinstance(engine.backend, CpuInt8Backend)
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
