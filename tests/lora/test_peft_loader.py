"""The PEFT loader: fused QKV / gate-up mapping, scales (alpha / r, rsLoRA, alpha_pattern),
tensor-parallel shards consistent with the base weights' sharding, and the refusals.

Ground truth: tests/fixtures/tiny/llama3_sharded_lora/<adapter>/expected.npz, transformers +
peft logits of the merged model (tests/fixtures/make_fixtures.py --only llama3_lora), and the
raw adapter tensors read here with the safetensors package (not our reader)."""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
import safetensors.numpy

from pagedrun.runtime.distributed.sharding import load_shard, rank_config, shard_spec
from pagedrun.runtime.lora import LoRARequest
from pagedrun.runtime.lora.adapter_weights import merged_weights
from pagedrun.runtime.lora.errors import LoRALoadError
from pagedrun.runtime.lora.lora_ops import LoRABatch, add_lora
from pagedrun.runtime.lora.peft_loader import load_peft_adapter
from pagedrun.runtime.lora.weight_stack import LoRAWeightStack
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.reference import ReferenceModel
from pagedrun.runtime.weights import load_model_weights

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
BASE = TINY_DIR / "llama3_sharded"
LORA_DIR = TINY_DIR / "llama3_sharded_lora"
PROMPT_LENGTHS = (5, 13)
RELATIVE_TOLERANCE = 1e-4
FEATURE_EFFECT_MIN = 1e-2
# Scales by hand from the fixtures' adapter_config.json: alpha / r; rsLoRA alpha / sqrt(r) with
# down_proj's alpha_pattern 24.
SCALES = {"full_r8": {p: 16 / 8 for p in ("q", "k", "v", "o", "gate", "up", "down")},
          "rslora_subset_r16": {"q": 8 / 4, "v": 8 / 4, "down": 24 / 4}}
PROJ_GROUP = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
              "gate": "mlp", "up": "mlp", "down": "mlp"}
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}

_CACHE: dict = {}


def base():
    if "base" not in _CACHE:
        config = ModelConfig.from_model_dir(BASE)
        _CACHE["base"] = config, load_model_weights(BASE, config)
    return _CACHE["base"]


def adapter(name: str, shard=None, max_lora_rank=16):
    config, _ = base()
    return load_peft_adapter(LoRARequest(name, 1, LORA_DIR / name), config, max_lora_rank,
                             shard=shard)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("name", tuple(SCALES))
def test_merged_adapter_matches_transformers_peft(name, length):
    config, weights = base()
    data = np.load(LORA_DIR / name / "expected.npz")
    prompt, generated = data[f"prompt_{length}"], data[f"generated_{length}"]
    sequence = np.concatenate([prompt, generated[:-1]])
    expected = data[f"logits_{length}"]
    merged = ReferenceModel(config, merged_weights(weights, adapter(name))).forward(sequence)
    scale = np.abs(expected).max()
    assert np.abs(merged - expected).max() / scale < RELATIVE_TOLERANCE
    plain = ReferenceModel(config, weights).forward(sequence)
    assert np.abs(plain - expected).max() / scale > FEATURE_EFFECT_MIN  # the adapter matters


def _raw_delta(name: str, layer: int, proj: str) -> np.ndarray | None:
    if name not in _CACHE:
        _CACHE[name] = safetensors.numpy.load_file(
            str(LORA_DIR / name / "adapter_model.safetensors"))
    tensors = _CACHE[name]
    prefix = f"base_model.model.model.layers.{layer}.{PROJ_GROUP[proj]}.{proj}_proj."
    if prefix + "lora_A.weight" not in tensors:
        return None
    a = tensors[prefix + "lora_A.weight"].astype(np.float64)
    b = tensors[prefix + "lora_B.weight"].astype(np.float64)
    return SCALES[name][proj] * b @ a


@pytest.mark.parametrize("name", tuple(SCALES))
def test_fused_modules_hold_the_stacked_scaled_deltas(name):
    config, weights = base()
    loaded = adapter(name)
    for index, modules in enumerate(loaded.layers):
        lw = weights.layers[index]
        for fused, projs in FUSED.items():
            raw = [_raw_delta(name, index, p) for p in projs]
            if all(d is None for d in raw):
                assert fused not in modules
                continue
            shapes = [getattr(lw, f"{p}_proj").shape for p in projs]
            expected = np.concatenate([np.zeros(shape) if d is None else d
                                       for shape, d in zip(shapes, raw)])
            np.testing.assert_allclose(modules[fused].delta(), expected, rtol=1e-6, atol=1e-7)
    if name == "rslora_subset_r16":
        assert loaded.layers[1] == {}   # layers_to_transform [0, 2]


def _fused_base(lw, fused: str) -> np.ndarray:
    return np.concatenate([getattr(lw, f"{p}_proj") for p in FUSED[fused]]).astype(np.float64)


def test_batched_ops_on_fused_weights_equal_the_merged_dense_projection():
    """W + scale B A applied to x equals base(x) + lora(x) through the slot stack, for every
    target of every layer, with unused slots NaN-poisoned and some tokens without adapter."""
    rng = np.random.default_rng(18)
    config, weights = base()
    full, subset = adapter("full_r8"), adapter("rslora_subset_r16")
    stack = LoRAWeightStack(config, max_loras=4, max_lora_rank=16)
    for targets in stack.layers:
        for lora_a, lora_b in targets.values():
            lora_a[:] = np.nan
            lora_b[:] = np.nan
    stack.write_slot(1, full)
    stack.write_slot(3, subset)
    token_slots = np.array([1, -1, 3, 3, 1, -1, 1, 3, 1], np.int32)
    batch = LoRABatch.from_token_slots(token_slots, 4)
    merged = {1: merged_weights(weights, full), 3: merged_weights(weights, subset)}
    for index, lw in enumerate(weights.layers):
        for fused in FUSED:
            w = _fused_base(lw, fused)
            x = rng.standard_normal((len(token_slots), w.shape[1])).astype(np.float32)
            y = (x @ w.T).astype(np.float32)
            lora_a, lora_b, starts = stack.module(index, fused)
            add_lora(y, x, lora_a, lora_b, batch, starts)
            for t, slot in enumerate(token_slots):
                dense = w if slot < 0 else _fused_base(merged[slot].layers[index], fused)
                np.testing.assert_allclose(y[t], dense @ x[t], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model, adapter_name", [("llama3_sharded", "full_r8"),
                                                 ("llama3_sharded", "rslora_subset_r16"),
                                                 ("llama_tied_bf16", None)])
def test_tp_shards_merge_like_the_sharded_base(tmp_path, model, adapter_name):
    """merge(shard(W), shard(lora)) == shard(merge(W, lora)) for every rank and projection: A/B
    sharding is consistent with the base weights' (column- and row-parallel, replicated KV
    heads in llama_tied_bf16's MQA)."""
    config = ModelConfig.from_model_dir(TINY_DIR / model)
    weights = load_model_weights(TINY_DIR / model, config)
    if adapter_name is None:
        path = _random_adapter(tmp_path, config, rank=4)
    else:
        path = LORA_DIR / adapter_name
    request = LoRARequest("x", 1, path)
    full = load_peft_adapter(request, config, 16)
    merged_full = merged_weights(weights, full)
    for rank in range(2):
        spec = shard_spec(config, 2, rank)
        part = load_peft_adapter(request, config, 16, shard=spec)
        got = merged_weights(load_shard(weights, config, spec), part)
        want = load_shard(merged_full, config, spec)
        for lw_got, lw_want in zip(got.layers, want.layers):
            for proj in ("q", "k", "v", "o", "gate", "up", "down"):
                np.testing.assert_allclose(getattr(lw_got, f"{proj}_proj"),
                                           getattr(lw_want, f"{proj}_proj"), rtol=1e-6,
                                           atol=1e-6)
        LoRAWeightStack(rank_config(config, spec), 2, 16).write_slot(1, part)  # shapes fit


# -- refusals -------------------------------------------------------------------------------
def _random_adapter(tmp_path, config, rank=4, projs=("q", "k", "v", "o", "gate", "up", "down"),
                    layers=None, extra=None, config_changes=None) -> pathlib.Path:
    rng = np.random.default_rng(7)
    sizes = {"q": (config.q_size, config.hidden_size), "k": (config.kv_size, config.hidden_size),
             "v": (config.kv_size, config.hidden_size), "o": (config.hidden_size, config.q_size),
             "gate": (config.intermediate_size, config.hidden_size),
             "up": (config.intermediate_size, config.hidden_size),
             "down": (config.hidden_size, config.intermediate_size)}
    tensors = {}
    for layer in (range(config.num_hidden_layers) if layers is None else layers):
        for p in projs:
            out, inp = sizes[p]
            prefix = f"base_model.model.model.layers.{layer}.{PROJ_GROUP[p]}.{p}_proj."
            tensors[prefix + "lora_A.weight"] = rng.standard_normal((rank, inp), np.float32)
            tensors[prefix + "lora_B.weight"] = rng.standard_normal((out, rank), np.float32)
    tensors.update(extra or {})
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
           "target_modules": [f"{p}_proj" for p in projs], "use_rslora": False}
    cfg.update(config_changes or {})
    path = tmp_path / "adapter"
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    safetensors.numpy.save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _load_error(path, config=None, max_lora_rank=16) -> str:
    config = config or base()[0]
    with pytest.raises(LoRALoadError) as info:
        load_peft_adapter(LoRARequest("bad", 1, path), config, max_lora_rank)
    return str(info.value)


EMB = "base_model.model.model.embed_tokens."
HEAD = "base_model.model.lm_head."


@pytest.mark.parametrize("changes, extra, message", [
    ({"target_modules": ["q_proj", "embed_tokens"]}, None, "embedding LoRA (embed_tokens)"),
    ({"target_modules": ["lm_head"]}, None, "LoRA on the LM head (lm_head) is not supported"),
    ({"target_modules": ["q_proj", "mlp"]}, None, "unsupported target module 'mlp'"),
    ({}, {EMB + "lora_embedding_A": np.zeros((4, 311), np.float32)}, "embedding LoRA"),
    ({}, {HEAD + "lora_A.weight": np.zeros((4, 72), np.float32)}, "LM head (lm_head)"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({}, {HEAD + "modules_to_save.weight": np.zeros((2, 2), np.float32)}, "modules_to_save"),
    ({"use_dora": True}, None, "DoRA (use_dora) is not supported"),
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
          np.ones(72, np.float32)}, "DoRA (lora_magnitude_vector)"),
    ({"bias": "all"}, None, "bias 'all'"),
    ({"lora_bias": True}, None, "LoRA biases (lora_bias)"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, None, "peft_type 'IA3' is not supported"),
    ({"lora_alpha": 0}, None, "lora_alpha must be a positive number"),
])
def test_unsupported_adapters_are_refused_with_the_reason(tmp_path, changes, extra, message):
    path = _random_adapter(tmp_path, base()[0], projs=("q",), extra=extra, config_changes=changes)
    error = _load_error(path)
    assert message in error
    assert str(path) in error    # names the file


def test_rank_above_max_lora_rank(tmp_path):
    path = _random_adapter(tmp_path, base()[0], rank=32, projs=("q", "v"))
    assert "rank 32 exceeds max_lora_rank 16" in _load_error(path)
    assert load_peft_adapter(LoRARequest("ok", 1, path), base()[0], 32).max_rank == 32


def test_shapes_layers_and_pairs_are_checked(tmp_path):
    config = base()[0]
    wrong = {"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight":
             np.zeros((4, 72), np.float32),
             "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight":
             np.zeros((72, 4), np.float32)}  # k_proj outputs kv_size 24, not 72
    assert "do not fit the model" in _load_error(
        _random_adapter(tmp_path / "a", config, projs=("q",), extra=wrong))
    past = {"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight":
            np.zeros((4, 72), np.float32)}
    assert "layer 3 past the model's 3 layers" in _load_error(
        _random_adapter(tmp_path / "b", config, projs=("q",), extra=past))
    lone = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight":
            np.zeros((4, 72), np.float32)}
    assert "lora_B missing" in _load_error(
        _random_adapter(tmp_path / "c", config, projs=("q",), extra=lone))
    misplaced = {"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight":
                 np.zeros((4, 72), np.float32)}
    assert "unsupported tensor" in _load_error(
        _random_adapter(tmp_path / "d", config, projs=("q",), extra=misplaced))


def test_mixture_of_experts_mlp_targets_are_refused(tmp_path):
    config = ModelConfig.from_model_dir(TINY_DIR / "qwen3_moe")   # layer 1 dense, 0 and 2 MoE
    ok = _random_adapter(tmp_path / "ok", config, projs=("q", "o", "gate", "up", "down"),
                         layers=[1])
    loaded = load_peft_adapter(LoRARequest("ok", 1, ok), config, 16)
    assert sorted(loaded.layers[1]) == ["down", "gate_up", "o", "qkv"]
    bad = _random_adapter(tmp_path / "bad", config, projs=("gate",), layers=[0])
    assert "layer 0 is a mixture-of-experts layer" in _load_error(bad, config)
    experts = {"base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_A.weight":
               np.zeros((4, 96), np.float32)}
    assert "mixture-of-experts experts" in _load_error(
        _random_adapter(tmp_path / "e", config, projs=("q",), layers=[0], extra=experts), config)


def test_missing_files(tmp_path):
    assert "no such LoRA adapter directory" in _load_error(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "not a PEFT adapter directory" in _load_error(tmp_path / "empty")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    assert "only the safetensors format is read" in _load_error(tmp_path / "cfg")
    (tmp_path / "cfg" / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in _load_error(tmp_path / "cfg")


def test_rslora_and_alpha_pattern_scales(tmp_path):
    """Per-module rank (rank_pattern: the tensors' shapes) and alpha: PEFT's scale rules."""
    config = base()[0]
    path = _random_adapter(tmp_path, config, rank=4, projs=("q", "down"), layers=[0],
                           config_changes={"use_rslora": True, "lora_alpha": 6,
                                           "alpha_pattern": {"layers.0.mlp.down_proj": 10}})
    loaded = load_peft_adapter(LoRARequest("s", 1, path), config, 16)
    tensors = safetensors.numpy.load_file(str(path / "adapter_model.safetensors"))

    def delta(p, group):
        prefix = f"base_model.model.model.layers.0.{group}.{p}_proj."
        return (tensors[prefix + "lora_B.weight"].astype(np.float64)
                @ tensors[prefix + "lora_A.weight"])

    q_rows = slice(0, config.q_size)
    np.testing.assert_allclose(loaded.layers[0]["qkv"].delta()[q_rows],
                               6 / math.sqrt(4) * delta("q", "self_attn"), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(loaded.layers[0]["down"].delta(),
                               10 / math.sqrt(4) * delta("down", "mlp"), rtol=1e-6, atol=1e-5)
    assert not loaded.layers[0]["qkv"].delta()[config.q_size:].any()   # k, v untouched
