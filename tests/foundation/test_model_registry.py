"""The model registry (runtime/architectures.py, runtime/models/registry.py): every registered
architecture parses and resolves to a forward and a weight loader; anything else is refused with
the supported list; Qwen3's config fields (QK-norm, head_dim, biases, sliding layers) and its
q/k norm weights."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from pagedrun.runtime.architectures import (
    ARCHITECTURES,
    QWEN3_DEFAULT_HEAD_DIM,
    SUPPORTED_ARCHITECTURES,
    find_architecture,
)
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.models.llama import LlamaModel
from pagedrun.runtime.models.registry import FORWARDS, build_model, forward_of
from pagedrun.runtime.weights import load_model_weights

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
QWEN3_DIR = TINY_DIR / "qwen3_tied"


def minimal_config(architecture: str | None = "LlamaForCausalLM", **overrides) -> dict:
    data = {
        "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    }
    if architecture is not None:
        data["architectures"] = [architecture]
    data.update(overrides)
    return data


def test_registry_lists_the_four_families_once():
    names = [arch.name for arch in ARCHITECTURES]
    assert names == list(SUPPORTED_ARCHITECTURES) == [
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    model_types = [arch.model_type for arch in ARCHITECTURES]
    assert len(set(model_types)) == len(model_types)


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_every_architecture_parses_and_has_a_forward(arch):
    by_name = ModelConfig.from_dict(minimal_config(arch.name))
    by_type = ModelConfig.from_dict(minimal_config(None, model_type=arch.model_type))
    assert by_name.architecture == by_type.architecture == arch.name
    assert find_architecture(arch.name) is arch
    assert arch.forward in FORWARDS
    forward = forward_of(by_name)
    assert forward.model_class is LlamaModel and forward.load_weights is load_model_weights


@pytest.mark.parametrize("change, field, listed", [
    ({"architectures": ["GemmaForCausalLM"]}, "architectures", SUPPORTED_ARCHITECTURES),
    ({"architectures": ["Qwen3ForCausalLM", "LlamaForCausalLM"]}, "architectures",
     SUPPORTED_ARCHITECTURES),
    ({"architectures": None, "model_type": "qwen3_moe"}, "model_type",
     ("llama", "mistral", "qwen2", "qwen3")),
])
def test_unsupported_architectures_are_refused_with_the_supported_list(change, field, listed):
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dict({**minimal_config(), **change}, source="m/config.json")
    message = str(info.value)
    assert "m/config.json" in message and field in message and "unsupported" in message
    assert "supported: " + ", ".join(listed) in message


def test_forward_of_an_unregistered_name_is_a_key_error():
    config = ModelConfig.from_dict(minimal_config())
    with pytest.raises(KeyError, match="GPT2LMHeadModel"):
        forward_of(dataclasses.replace(config, architecture="GPT2LMHeadModel"))


def test_qwen3_fixture_config():
    config = ModelConfig.from_model_dir(QWEN3_DIR)
    assert config.architecture == "Qwen3ForCausalLM"
    assert config.qk_norm and not config.attention_bias and not config.o_proj_bias
    # head_dim from config.json, not hidden / heads (96 / 4 = 24).
    assert config.head_dim == 64 and config.q_size == 256 and config.kv_size == 128
    assert config.sliding_window is None and config.tie_word_embeddings
    assert config.rope_theta == 1e6 and config.eos_token_ids == (5,)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_other_families_have_no_qk_norm(arch):
    assert not ModelConfig.from_dict(minimal_config(arch)).qk_norm


def test_qwen3_head_dim_default_and_biases():
    # Without head_dim, transformers' Qwen3Config uses 128 (not hidden / heads).
    config = ModelConfig.from_dict(minimal_config("Qwen3ForCausalLM"))
    assert config.head_dim == QWEN3_DEFAULT_HEAD_DIM
    # Llama keeps the hidden / heads fallback.
    assert ModelConfig.from_dict(minimal_config()).head_dim == 8
    biased = ModelConfig.from_dict(minimal_config("Qwen3ForCausalLM", attention_bias=True))
    assert biased.attention_bias and biased.o_proj_bias and biased.qk_norm


@pytest.mark.parametrize("change, field", [
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_qwen3_sliding_layers_refused(change, field):
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(minimal_config("Qwen3ForCausalLM", **change))


def test_qwen3_sliding_window_field_alone_is_ignored():
    """transformers drops `sliding_window` unless use_sliding_window: full attention."""
    config = ModelConfig.from_dict(minimal_config("Qwen3ForCausalLM", sliding_window=4096,
                                                  layer_types=["full_attention"]))
    assert config.sliding_window is None


def test_qwen3_weights_have_per_head_norms():
    config = ModelConfig.from_model_dir(QWEN3_DIR)
    weights = load_model_weights(QWEN3_DIR, config)
    for layer in weights.layers:
        assert layer.q_norm.shape == layer.k_norm.shape == (config.head_dim,)
        assert layer.q_bias is None and layer.o_bias is None
        # Randomized around 1 by the fixture script: really loaded, not defaulted.
        assert not np.allclose(layer.q_norm, 1.0) and not np.allclose(layer.q_norm, layer.k_norm)
    assert weights.lm_head is weights.embed_tokens
    llama = load_model_weights(TINY_DIR / "qwen2_tied")
    assert all(layer.q_norm is None and layer.k_norm is None for layer in llama.layers)


def test_qwen3_missing_k_norm_names_the_tensor(tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(QWEN3_DIR, model_dir)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model_weights(model_dir)


def test_qwen3_misshaped_q_norm_is_refused(tmp_path):
    """A q_norm over the whole q projection (OLMo-style) instead of one head is not Qwen3."""
    model_dir = tmp_path / "m"
    shutil.copytree(QWEN3_DIR, model_dir)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(256, np.float32)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"shape \[256\] does not match the config's \[64\]"):
        load_model_weights(model_dir)


def test_build_model_runs_qk_norm_and_refuses_weights_without_it():
    config = ModelConfig.from_model_dir(QWEN3_DIR)
    weights = load_model_weights(QWEN3_DIR, config)
    model = build_model(config, weights, NumpyBackend(), max_position=64)
    assert isinstance(model, LlamaModel)
    assert all(layer.q_norm is not None for layer in model.layers)
    stripped = dataclasses.replace(weights, layers=[
        dataclasses.replace(layer, q_norm=None, k_norm=None) for layer in weights.layers])
    with pytest.raises(ValueError, match="q_norm / k_norm weights missing"):
        build_model(config, stripped, NumpyBackend(), max_position=64)


def test_qwen3_inferred_from_model_type(tmp_path):
    """A config written by hand with only model_type "qwen3" loads as Qwen3."""
    data = json.loads((QWEN3_DIR / "config.json").read_text())
    del data["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert ModelConfig.from_model_dir(tmp_path) == ModelConfig.from_model_dir(QWEN3_DIR)
