"""The numpy reference forward against transformers (float32) on the tiny random models (dense,
the mixture-of-experts mixtral_moe / qwen3_moe, and Gemma 3's gemma3_tiny).

Ground truth: tests/fixtures/tiny/<model>/expected.npz, written by tests/fixtures/make_fixtures.py
from the very files the loader reads here. "Relative error" throughout is
max |reference - transformers| / max |transformers| over the whole logits array.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.reference import (
    DenseKVCache,
    ReferenceModel,
    apply_rotary,
    rope_cos_sin,
    rope_inv_freq,
)
from pagedrun.runtime.weights import load_model_weights

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
TINY_MODELS = ("llama3_sharded", "llama_tied_bf16", "mistral_fp16", "qwen2_tied", "qwen3_tied",
               "mixtral_moe", "qwen3_moe", "gemma3_tiny")
PROMPT_LENGTHS = (1, 5, 13, 21)
RELATIVE_TOLERANCE = 1e-4
# A feature the fixtures exercise must move the logits by far more than the tolerance.
FEATURE_EFFECT_MIN = 1e-2


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


_MODELS: dict[str, ReferenceModel] = {}


def tiny_model(name: str) -> ReferenceModel:
    if name not in _MODELS:
        config = ModelConfig.from_model_dir(TINY_DIR / name)
        _MODELS[name] = ReferenceModel(config, load_model_weights(TINY_DIR / name, config))
    return _MODELS[name]


def expected(name: str, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt [P], greedy tokens [N], logits [P + N - 1, vocab]) from transformers."""
    data = np.load(TINY_DIR / name / "expected.npz")
    return data[f"prompt_{length}"], data[f"generated_{length}"], data[f"logits_{length}"]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("name", TINY_MODELS)
def test_forward_logits_match_transformers(name: str, length: int) -> None:
    prompt, generated, hf_logits = expected(name, length)
    sequence = np.concatenate([prompt, generated[:-1]])
    logits = tiny_model(name).forward(sequence)
    assert logits.dtype == np.float32
    assert logits.shape == hf_logits.shape
    assert relative_error(logits, hf_logits) < RELATIVE_TOLERANCE


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("name", TINY_MODELS)
def test_greedy_tokens_match_transformers(name: str, length: int) -> None:
    prompt, generated, _ = expected(name, length)
    assert tiny_model(name).greedy_generate(prompt, len(generated)) == generated.tolist()


@pytest.mark.parametrize("chunk_size", (1, 3, 7))
@pytest.mark.parametrize("name", TINY_MODELS)
def test_cached_chunks_match_transformers(name: str, chunk_size: int) -> None:
    """Feeding the sequence through the KV cache in chunks gives transformers' logits per row."""
    prompt, generated, hf_logits = expected(name, PROMPT_LENGTHS[-1])
    sequence = np.concatenate([prompt, generated[:-1]])
    model = tiny_model(name)
    # Capacity 2: forces the cache to grow several times on the way.
    cache = DenseKVCache(model.config, capacity=2)
    rows = []
    for start in range(0, len(sequence), chunk_size):
        rows.append(model.forward(sequence[start:start + chunk_size], start, cache))
    assert cache.num_tokens == len(sequence)
    assert relative_error(np.concatenate(rows), hf_logits) < RELATIVE_TOLERANCE


def test_cache_rewind_recomputes_the_same_logits() -> None:
    model = tiny_model("qwen2_tied")
    prompt, generated, hf_logits = expected("qwen2_tied", 13)
    cache = DenseKVCache(model.config)
    model.forward(prompt, 0, cache)
    model.forward(generated[:5], len(prompt), cache)
    # Rewind to the end of the prompt (as a preempted-and-recomputed or diverging request
    # would) and decode different tokens than were cached there.
    logits = model.forward(generated[:3], len(prompt), cache)
    assert cache.num_tokens == len(prompt) + 3
    rows = slice(len(prompt), len(prompt) + 3)
    assert relative_error(logits, hf_logits[rows]) < RELATIVE_TOLERANCE


@pytest.mark.parametrize(
    "name, change",
    [
        ("mistral_fp16", {"sliding_window": None}),
        ("llama3_sharded", {"rope_scaling": None}),
        ("qwen2_tied", {"rope_theta": 10000.0}),
        ("qwen3_tied", {"qk_norm": False}),
        # The experts' weighting: Mixtral renormalizes the top-k, this Qwen3-MoE does not.
        ("mixtral_moe", {"norm_topk_prob": False}),
        ("qwen3_moe", {"norm_topk_prob": True}),
        ("mixtral_moe", {"num_experts_per_tok": 1}),
        # Gemma 3: each of its departures from the Llama layer shows in the logits.
        ("gemma3_tiny", {"local_sliding_window": None}),
        ("gemma3_tiny", {"local_rope_theta": 1000000.0}),
        ("gemma3_tiny", {"rope_scaling": None}),
        ("gemma3_tiny", {"attention_scale": None}),
        ("gemma3_tiny", {"embedding_scale": None}),
        ("gemma3_tiny", {"hidden_activation": "silu"}),
        ("gemma3_tiny", {"qk_norm": False}),
    ],
)
def test_fixtures_exercise_each_config_feature(name: str, change: dict) -> None:
    """Dropping a feature breaks the match, so the tests above would catch it being ignored."""
    model = tiny_model(name)
    prompt, generated, hf_logits = expected(name, PROMPT_LENGTHS[-1])
    changed = ReferenceModel(dataclasses.replace(model.config, **change), model.weights)
    logits = changed.forward(np.concatenate([prompt, generated[:-1]]))
    assert relative_error(logits, hf_logits) > FEATURE_EFFECT_MIN


def test_fixtures_exercise_attention_biases() -> None:
    model = tiny_model("llama_tied_bf16")
    prompt, generated, hf_logits = expected("llama_tied_bf16", PROMPT_LENGTHS[-1])
    without_o_bias = dataclasses.replace(model.weights, layers=[
        dataclasses.replace(layer, o_bias=None) for layer in model.weights.layers])
    logits = ReferenceModel(model.config, without_o_bias).forward(
        np.concatenate([prompt, generated[:-1]]))
    assert relative_error(logits, hf_logits) > FEATURE_EFFECT_MIN


def test_greedy_stops_after_eos_and_includes_it() -> None:
    prompt, generated, _ = expected("llama3_sharded", 5)
    model = tiny_model("llama3_sharded")
    stop_at = int(generated[3])
    first = generated.tolist().index(stop_at)
    assert (model.greedy_generate(prompt, len(generated), eos_token_ids=[stop_at])
            == generated[:first + 1].tolist())
    assert model.greedy_generate(prompt, 0) == []


def test_forward_rejects_bad_token_ids_and_positions() -> None:
    model = tiny_model("qwen2_tied")
    with pytest.raises(ValueError):
        model.forward(np.array([model.config.vocab_size]))
    with pytest.raises(ValueError):
        model.forward(np.array([], dtype=np.int64))
    with pytest.raises(ValueError):
        model.forward(np.array([1, 2]), start_pos=3, kv_cache=DenseKVCache(model.config))


def test_reference_refuses_non_float32_weights() -> None:
    half = load_model_weights(TINY_DIR / "qwen2_tied", dtype=np.float16)
    with pytest.raises(ValueError, match="float32"):
        ReferenceModel(half.config, half)


def test_llama3_inv_freq_bands() -> None:
    """head_dim 12, theta 1e4, original context 64, factors 1/8/8: one pair per band."""
    config = tiny_model("llama3_sharded").config
    base = 1.0 / 10000.0 ** (np.arange(0, 12, 2) / 12)
    inv_freq = rope_inv_freq(config)
    assert inv_freq.shape == (6,)
    # wavelength 2*pi < 64/8: unchanged.
    assert inv_freq[0] == pytest.approx(base[0], rel=1e-12)
    # wavelengths > 64/1: divided by the factor.
    np.testing.assert_allclose(inv_freq[2:], base[2:] / 8.0, rtol=1e-12)
    # wavelength 29 in between: blend weight (64/29.2 - 1) / (8 - 1) toward the unscaled value.
    blend = (64 * base[1] / (2 * np.pi) - 1.0) / 7.0
    assert inv_freq[1] == pytest.approx((1 - blend) * base[1] / 8.0 + blend * base[1], rel=1e-12)


def test_rotary_scores_depend_only_on_relative_position() -> None:
    """<rot(q, m), rot(k, n)> is a function of m - n, and rotation keeps norms."""
    config = tiny_model("mistral_fp16").config
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 1, config.head_dim))
    k = rng.standard_normal((1, 1, config.head_dim))

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rope_cos_sin(config, np.array([m]))
        cos_n, sin_n = rope_cos_sin(config, np.array([n]))
        return float(np.sum(apply_rotary(q, cos_m, sin_m) * apply_rotary(k, cos_n, sin_n)))

    assert score(17, 5) == pytest.approx(score(112, 100), rel=1e-9)
    assert score(17, 5) != pytest.approx(score(18, 5), rel=1e-3)
    cos, sin = rope_cos_sin(config, np.array([41]))
    assert np.linalg.norm(apply_rotary(q, cos, sin)) == pytest.approx(np.linalg.norm(q), rel=1e-12)
