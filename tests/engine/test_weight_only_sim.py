"""AWQ / GPTQ int4 checkpoints on the sim backend (the cuda backend's code on the CPU harness):
the projections kept int4 (runtime/backends/weight_only.py) and multiplied by cuda/gemm_wq.cu's
W4A16 kernel, float16 / bfloat16 activations.

Oracles: one packed linear against numpy's dequantize() @ x within the kernel test's bound
(tests/kernels/test_gemm_wq.py), and a check that the same comparison rejects a packing that
drops the zero points; engines over tiny AWQ and GPTQ checkpoints (test_hf_int4.py's fixture
writer, head_dim 64: the sim's attention serves 64 / 128) against the float32 numpy engine over
the reference-dequantized weights -- prefill logits within a bound derived from the 16-bit
roundings, and greedy tokens; decode graphs (replay == eager) and asynchronous scheduling on
the packed weights; the refusals (float32 activations). int8 (W8A16, KernelBackend
quantization "int8"): the load-time quantization against a codec written here, the linear and
the prefill logits against numpy over the same dequantized weights."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_helpers import (greedy, make_engine, prefill_logits, random_weights, run_requests,
                            tiny_config)
from test_hf_int4 import reference_weights, write_checkpoint

from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.quantization.base import KeptQuantizedMethod, linear_method_for
from pagedrun.runtime.backends.kernel_devices import sim_backend
from pagedrun.runtime.backends.weight_only import WeightOnlyMatrix
from pagedrun.runtime.kernels.wq_pack import unpack_groups, unpack_w8
from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
from pagedrun.runtime.quantization import QuantizedMatrix
from pagedrun.runtime.quantization.hf_int4 import Int4Matrix
from pagedrun.runtime.model_loader import load_model

# head_dim 128 / 2 = 64 (the sim's attention kernels serve 64 and 128); GQA 2:1.
SIM_CONFIG = {"num_attention_heads": 2, "num_key_value_heads": 1}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
FP32_EPS = 2.0**-24
CASES = [("awq", 64), ("gptq", 128)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{method: (path, config, ModelWeights with Int4Matrix projections, reference weights)}."""
    out = {}
    for method, group in CASES:
        path = tmp_path_factory.mktemp(method)
        config, refs = write_checkpoint(path, method, group, seed=5, config_overrides=SIM_CONFIG)
        _, weights, _ = load_model(str(path), quantization=method)
        out[method] = (path, config, weights, reference_weights(config, weights, refs))
    return out


# ------------------------------------------------------------------ one linear
def _random_int4(rng, n, k, group):
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = rng.uniform(5e-3, 2e-2, (n, k // group)).astype(np.float16)
    s[0, 0] = -s[0, 0]
    z = rng.integers(0, 16, (n, k // group), dtype=np.uint8)
    return Int4Matrix.from_parts(q, s, z)


def _linear_error_ratio(backend, packed, reference_w, x, bias):
    """max |kernel - reference| / bound over the outputs; the reference is float64 over the
    16-bit x, bias and scales the kernel reads, the bound test_gemm_wq.py's: each weight rounded
    to T, fp32 sums over K, the output rounded once."""
    u = UNIT_ROUNDOFF[backend.dtype_name]
    x_dev = backend.device(backend.to_kernel_dtype(x))
    x_ref = backend.to_host(x_dev).astype(np.float64)
    got = backend.to_host(backend.linear(x_dev, packed, bias)).astype(np.float64)
    want = x_ref @ reference_w.T
    if bias is not None:
        want += backend.to_host(backend.weight(bias))
    sum_abs = np.abs(x_ref) @ np.abs(reference_w).T
    inner = (u + x.shape[1] * FP32_EPS) * sum_abs
    bound = inner + u * (np.abs(want) + inner) + 1e-30
    return float(np.max(np.abs(got - want) / bound))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_linear_matches_dequantized(dtype):
    rng = np.random.default_rng(11)
    backend = sim_backend(dtype, quantization="gptq")
    # gptq's matrices reach linear_weight as their int4 blocks; float weights otherwise.
    assert isinstance(linear_method_for(backend), KeptQuantizedMethod)
    assert not isinstance(linear_method_for(sim_backend(dtype)), KeptQuantizedMethod)
    # A fused matrix (two parts stacked along out, as q/k/v or gate/up reach linear_weight).
    matrix = QuantizedMatrix.stack([_random_int4(rng, 40, 192, 32), _random_int4(rng, 24, 192, 32)])
    packed = backend.linear_weight(matrix)
    assert isinstance(packed, WeightOnlyMatrix) and packed.shape == (64, 192)
    assert packed.group_size == 32
    # The reference over the scales as the kernel holds them (exact in float16, rounded once
    # to nearest in bfloat16, in the kernel's column order); the weights placed once and
    # counted.
    scales = unpack_groups(backend.to_host(packed.scales), 64)
    s16 = Int4Matrix(matrix.ggml_type, matrix.shape, matrix.raw).parts()[1].astype(np.float32).T
    if dtype == "float16":
        np.testing.assert_array_equal(scales, s16)
    assert np.max(np.abs(scales - s16) / np.abs(s16)) <= UNIT_ROUNDOFF[dtype]
    as_int4 = Int4Matrix(matrix.ggml_type, matrix.shape, matrix.raw)
    q, _, z = as_int4.parts()
    w = np.repeat(scales.T.astype(np.float64), 32, 1) * (
        q.astype(np.float64) - np.repeat(z.astype(np.float64), 32, 1))
    bias = rng.standard_normal(64).astype(np.float32)
    for m in (1, 5, 33):  # the decode tile (split over K) and the prefill tile
        x = rng.standard_normal((m, 192)).astype(np.float32)
        assert _linear_error_ratio(backend, packed, w, x, bias if m != 5 else None) <= 1.0, m
    # Mutation: the zero points dropped from the packing must fail the same comparison.
    dropped = dataclasses.replace(packed, zeros=backend.device(np.zeros_like(packed.zeros)))
    x = rng.standard_normal((3, 192)).astype(np.float32)
    assert _linear_error_ratio(backend, dropped, w, x, None) > 10.0
    # Out in float32 when asked (the LM head's out_dtype; not the int4 projections' path).
    out = backend.linear(backend.device(backend.to_kernel_dtype(x)), packed, out_dtype=np.float32)
    assert out.dtype == np.float32


def test_float32_and_other_quantizations_refused(checkpoints):
    path = checkpoints["awq"][0]
    with pytest.raises(EngineConfigError, match="need dtype float16 or bfloat16"):
        make_backend("sim", "float32", quantization="awq")
    with pytest.raises(EngineConfigError, match="need dtype float16 or bfloat16"):
        LLMEngine(EngineConfig(model=str(path), device="sim", dtype="float32", block_size=16))
    with pytest.raises(ValueError, match="cpu"):
        make_backend("sim", "float16", quantization="gguf")
    with pytest.raises(EngineConfigError, match="int8 on sim/cuda need dtype float16"):
        sim_backend("float32", quantization="int8")
    # "auto" on sim means float16 here (the checkpoints' fp16 scales are exact in it).
    assert make_backend("sim", "auto", quantization="gptq").dtype_name == "float16"


# ------------------------------------------------------------------ engines
def _prefill_logits(config, weights, backend, tokens):
    """(host float32 logits [len(tokens), vocab], model) of one prefill on `backend`, KV pools
    in the backend's cache dtype."""
    return prefill_logits(config, weights, backend, tokens, backend_caches=True)


@pytest.mark.parametrize("method", [m for m, _ in CASES])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_logits_match_float_reference(checkpoints, method, dtype):
    _, config, weights, ref_weights = checkpoints[method]
    tokens = np.random.default_rng(7).integers(3, config.vocab_size, 37).tolist()
    want, _ = _prefill_logits(config, ref_weights, NumpyBackend(), tokens)
    got, model = _prefill_logits(config, weights, sim_backend(dtype, quantization=method), tokens)
    for packed in (model.layers[0].qkv, model.layers[0].gate_up, model.layers[1].down):
        assert isinstance(packed, WeightOnlyMatrix)
    assert not isinstance(model.lm_head, WeightOnlyMatrix)  # the float LM head stays float
    # Every op rounds its output to the 16-bit dtype (relative u each; bf16 also the scales):
    # measured max error / (u * spread) 6.4 - 8.4 over both checkpoints and dtypes; bound 25.
    # A wrong zero point or nibble order moves logits by a large fraction of the spread.
    ratio = float(np.max(np.abs(got - want))) / (UNIT_ROUNDOFF[dtype] * float(want.std()))
    assert ratio <= 25, ratio


@pytest.mark.parametrize("method", [m for m, _ in CASES])
def test_engine_greedy_matches_float_engine(checkpoints, method):
    path, config, _, ref_weights = checkpoints[method]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (1, 9, 30, 4)]
    requests = [(i % 2, f"r{i}", dict(prompt_token_ids=p, sampling_params=greedy(6)))
                for i, p in enumerate(prompts)]
    want = run_requests(make_engine((config, ref_weights), block_size=16), requests)
    engine = LLMEngine(EngineConfig(model=str(path), device="sim", dtype="float16",
                                    block_size=16, num_kv_blocks=32, check_invariants=True))
    assert engine.quantization == method and engine.backend.quantization == method
    got = run_requests(engine, requests)
    for key in want:
        assert got[key].outputs[0].token_ids == want[key].outputs[0].token_ids, key
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_act_order_gptq_greedy_matches_float_engine(tmp_path):
    """desc_act: the W4A16 GEMM over inputs gathered into the groups' order; no decode graphs
    (the gather is not a kernel the sim's recording replays)."""
    from pagedrun.runtime.quantization import InputPermuted

    config, refs = write_checkpoint(tmp_path, "gptq", 32, seed=6, config_overrides=SIM_CONFIG,
                                    act_order=True)
    _, weights, _ = load_model(str(tmp_path), quantization="gptq")
    ref_weights = reference_weights(config, weights, refs)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (1, 17)]
    requests = [(0, f"r{i}", dict(prompt_token_ids=p, sampling_params=greedy(5)))
                for i, p in enumerate(prompts)]
    want = run_requests(make_engine((config, ref_weights), block_size=16), requests)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="sim", dtype="float16",
                                    block_size=16, num_kv_blocks=32, cuda_graph_sizes=(1, 2)))
    model = engine.runner.model
    assert type(model.layers[0].qkv) is InputPermuted
    assert isinstance(model.layers[0].qkv.weight, WeightOnlyMatrix)
    assert engine.runner.decode_graphs is None
    got = run_requests(engine, requests)
    for key in want:
        assert got[key].outputs[0].token_ids == want[key].outputs[0].token_ids, key


def test_decode_graphs_and_async_scheduling_replay_the_packed_kernels(checkpoints):
    path = checkpoints["gptq"][0]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 384, n).tolist() for n in (3, 17)]
    requests = [(i, f"r{i}", dict(prompt_token_ids=p, sampling_params=greedy(5)))
                for i, p in enumerate(prompts)]
    outputs = {}
    for name, extra in (("eager", dict(enforce_eager=True)),
                        ("graphs", dict(cuda_graph_sizes=(1, 2))),
                        ("graphs_async", dict(cuda_graph_sizes=(1, 2), async_scheduling=True))):
        engine = LLMEngine(EngineConfig(model=str(path), device="sim", dtype="bfloat16",
                                        block_size=16, num_kv_blocks=16, max_num_seqs=2,
                                        **extra))
        graphs = engine.runner.decode_graphs
        assert (graphs is None) == (name == "eager"), name
        outputs[name] = run_requests(engine, requests)
        stats = engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], name
    for name in ("graphs", "graphs_async"):
        for key, want in outputs["eager"].items():
            assert outputs[name][key].outputs[0].token_ids == want.outputs[0].token_ids, (name,
                                                                                         key)


# ------------------------------------------------------------------ int8 (W8A16)
def int8_codec(w):
    """The test's own symmetric int8: per row, per 64 inputs, s = max |w| / 127 (float32),
    q = round(w / s). Returns (q int8 [N, K], s float32 [N, K / 64])."""
    n, k = w.shape
    blocks = w.reshape(n, k // 64, 64).astype(np.float32)
    s = np.abs(blocks).max(axis=2) / np.float32(127)
    q = np.rint(blocks / np.where(s == 0, 1, s)[:, :, None]).astype(np.int8)
    return q.reshape(n, k), s


def int8_dequantized(backend, w):
    """float64 [N, K]: the codec's q times its scales rounded to the backend's dtype."""
    q, s = int8_codec(w)
    s16 = backend.to_host(backend.device(backend.to_kernel_dtype(s)))
    return np.repeat(s16.astype(np.float64), 64, 1) * q


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int8_linear_matches_codec(dtype):
    rng = np.random.default_rng(12)
    backend = sim_backend(dtype, quantization="int8")
    assert not isinstance(linear_method_for(backend), KeptQuantizedMethod)  # float weights
    w = (rng.standard_normal((72, 192)) / 14).astype(np.float32)
    w[3, 64:128] = 0  # an all-zero group: scale 0, q 0
    packed = backend.linear_weight(np.ascontiguousarray(w.T).T)  # llama.py's transposed view
    assert isinstance(packed, WeightOnlyMatrix) and packed.bits == 8 and packed.shape == (72, 192)
    q, _ = int8_codec(w)
    np.testing.assert_array_equal(unpack_w8(np.asarray(packed.qweight), 72), q)  # numpy on sim
    reference_w = int8_dequantized(backend, w)
    bias = rng.standard_normal(72).astype(np.float32)
    for m in (1, 20):
        x = rng.standard_normal((m, 192)).astype(np.float32)
        assert _linear_error_ratio(backend, packed, reference_w, x, bias) <= 1.0, m
    # Mutation: the scales' groups shifted by one must fail the same comparison.
    shifted = dataclasses.replace(packed, scales=np.ascontiguousarray(
        np.roll(packed.scales, 1, axis=0)))
    assert _linear_error_ratio(backend, shifted, reference_w, x, bias) > 10.0
    # K not a multiple of 64 stays float (the float GEMM).
    odd = rng.standard_normal((8, 96)).astype(np.float32)
    assert backend.linear_weight(odd) is odd


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int8_prefill_logits_match_numpy_on_the_dequantized_weights(dtype):
    config = tiny_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=192)
    weights = random_weights(config, seed=4)
    backend = sim_backend(dtype, quantization="int8")

    def deq(w):
        return int8_dequantized(backend, w).astype(np.float32)

    layers = [dataclasses.replace(lw, **{f: deq(getattr(lw, f)) for f in (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")})
        for lw in weights.layers]
    ref_weights = dataclasses.replace(weights, layers=layers, lm_head=deq(weights.lm_head))
    tokens = np.random.default_rng(8).integers(3, config.vocab_size, 29).tolist()
    want, _ = _prefill_logits(config, ref_weights, NumpyBackend(), tokens)
    got, model = _prefill_logits(config, weights, backend, tokens)
    assert all(isinstance(p, WeightOnlyMatrix) for p in (
        model.layers[0].qkv, model.layers[1].down, model.lm_head))
    ratio = float(np.max(np.abs(got - want))) / (UNIT_ROUNDOFF[dtype] * float(want.std()))
    # As the int4 logits above: measured 6.8 (f16) / 7.5 (bf16), bound 25.
    assert ratio <= 25, ratio
