"""benchmarks/gptq.py and make_int4_checkpoint.py's GPTQ packing (the accuracy benchmark's int4
GPTQ arm): the Hessian recorder leaves the forward unchanged and records each projection's real
input; GPTQ without correlation between inputs is round-to-nearest, and with correlation it beats
it on the inputs it was calibrated on; its tensors load through the runtime's GPTQ reader."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import random_weights, tiny_config
from pagedrun.runtime.quantization.hf_int4 import unpack_gptq
from pagedrun.runtime.reference import ReferenceModel, rms_norm

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gptq = _load("gptq")
make = _load("make_int4_checkpoint")


def dequant(q, s, z):
    group = q.shape[1] // s.shape[1]
    return (np.repeat(s.astype(np.float64), group, 1)
            * (q.astype(np.float64) - np.repeat(z.astype(np.float64), group, 1)))


def test_recorder_keeps_the_forward_and_records_the_projection_inputs():
    config = tiny_config()
    weights = random_weights(config, seed=3)
    rng = np.random.default_rng(11)
    chunks = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 17, 40)]
    before = [ReferenceModel(config, weights).forward(np.array(c)) for c in chunks]
    hessians = gptq.collect_hessians(config, weights, chunks, make.PROJECTIONS)
    for c, want in zip(chunks, before):   # weights restored, forward unchanged
        np.testing.assert_array_equal(ReferenceModel(config, weights).forward(np.array(c)), want)
    assert all(type(layer.q_proj) is np.ndarray for layer in weights.layers)
    assert len(hessians) == config.num_hidden_layers * len(make.PROJECTIONS)
    # Layer 0's q/k/v input is rms_norm(embedding): H = 2/n sum h h^T over every chunk's tokens.
    layer = weights.layers[0]
    h = np.concatenate([rms_norm(weights.embed_tokens[c], layer.input_layernorm,
                                 config.rms_norm_eps) for c in chunks]).astype(np.float64)
    want = 2.0 / h.shape[0] * h.T @ h
    for name in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_allclose(hessians[f"model.layers.0.self_attn.{name}"], want,
                                   rtol=1e-5, atol=1e-8)
    assert hessians["model.layers.1.mlp.down_proj"].shape == (config.intermediate_size,) * 2


@pytest.mark.parametrize("group", [32, 64])
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(group):
    rng = np.random.default_rng(group)
    w = rng.standard_normal((24, 192)).astype(np.float32)
    q, s, z = gptq.quantize_gptq(w, np.eye(192), group)
    q_rtn, s_rtn, z_rtn = make.quantize_rtn(w, group)
    np.testing.assert_array_equal(s, s_rtn)
    np.testing.assert_array_equal(z, z_rtn)
    np.testing.assert_array_equal(q, q_rtn)


@pytest.mark.parametrize("group,mse", [(32, False), (64, False), (32, True)])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(group, mse):
    rng = np.random.default_rng(7 + group)
    k, n = 320, 1500
    mix = np.eye(k) + 2.0 * rng.standard_normal((k, k)) / np.sqrt(k)
    x = rng.standard_normal((n, k)) @ mix
    w = rng.standard_normal((40, k)).astype(np.float32)
    hessian = 2.0 / n * x.T @ x

    def output_error(parts):
        return np.linalg.norm(x @ (w - dequant(*parts)).T)

    got = gptq.quantize_gptq(w, hessian, group, mse=mse)
    assert got[0].max() <= 15 and got[2].max() <= 15
    assert output_error(got) < 0.85 * output_error(make.quantize_rtn(w, group))


def test_gptq_packing_loads_through_the_runtime_reader():
    rng = np.random.default_rng(5)
    out, k, group = 24, 96, 32
    q = rng.integers(0, 16, (out, k)).astype(np.uint8)
    s = (rng.random((out, k // group)) + 0.1).astype(np.float16)
    z = rng.integers(0, 16, (out, k // group)).astype(np.uint8)
    t = make.pack_gptq(q, s, z)
    assert t["qweight"].shape == (k // 8, out) and t["qzeros"].shape == (k // group, out // 8)
    matrix = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], group, "gptq", t["g_idx"])
    assert matrix.input_perm is None
    np.testing.assert_array_equal(matrix.dequantize(), dequant(q, s, z).astype(np.float32))


def test_act_order_groups_follow_the_permutation_and_load_sorted():
    rng = np.random.default_rng(9)
    out, k, group = 16, 128, 32
    mix = np.eye(k) + 2.0 * rng.standard_normal((k, k)) / np.sqrt(k)
    x = (rng.standard_normal((600, k)) @ mix) * rng.uniform(0.1, 3.0, k)   # unequal scales
    w = rng.standard_normal((out, k)).astype(np.float32)
    hessian = 2.0 / x.shape[0] * x.T @ x
    perm = gptq.act_order(hessian)
    assert np.all(np.diff(np.diag(hessian)[perm]) <= 0)
    q, s, z = gptq.quantize_gptq(w, hessian, group, perm=perm)
    # The same as quantizing the permuted problem in order, columns put back.
    q_p, s_p, z_p = gptq.quantize_gptq(w[:, perm], hessian[np.ix_(perm, perm)], group)
    np.testing.assert_array_equal(q[:, perm], q_p)
    np.testing.assert_array_equal(s, s_p)
    t = make.pack_gptq(q, s, z, perm)
    g_idx = t["g_idx"]
    np.testing.assert_array_equal(g_idx[perm], np.arange(k) // group)
    matrix = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], group, "gptq", g_idx)
    assert matrix.input_perm is not None
    want = s.astype(np.float64)[:, g_idx] * (q.astype(np.float64) - z.astype(np.float64)[:, g_idx])
    np.testing.assert_array_equal(matrix.dequantize(), want.astype(np.float32))
    # Act order fits inputs like the calibration ones better than round to nearest.
    err = np.linalg.norm(x @ (w - want).T)
    assert err < 0.85 * np.linalg.norm(x @ (w - dequant(*make.quantize_rtn(w, group))).T)
