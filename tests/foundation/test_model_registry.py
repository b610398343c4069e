"""The model registry (runtime/architectures.py, runtime/models/registry.py): every registered
architecture parses and resolves to a forward and a weight loader; anything else is refused with
the supported list; Qwen3's config fields (QK-norm, head_dim, biases, sliding layers) and its
q/k norm weights; the mixture-of-experts families' fields (experts, top-k, normalization, sparse
layers) and both checkpoint layouts of their experts."""
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
    SUPPORTED_MODEL_TYPES,
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


def test_registry_lists_the_families_once():
    names = [arch.name for arch in ARCHITECTURES]
    assert names == list(SUPPORTED_ARCHITECTURES)
    assert set(names) >= {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "MixtralForCausalLM", "Qwen3MoeForCausalLM"}
    assert len(set(names)) == len(names)
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
    ({"architectures": None, "model_type": "dbrx"}, "model_type", SUPPORTED_MODEL_TYPES),
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


# --------------------------------------------------------------------- mixture of experts

MIXTRAL_DIR = TINY_DIR / "mixtral_moe"
QWEN3_MOE_DIR = TINY_DIR / "qwen3_moe"


def test_moe_fixture_configs():
    mixtral = ModelConfig.from_model_dir(MIXTRAL_DIR)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.moe_layers) == (8, 2, 80, True, (0, 1))
    assert not mixtral.qk_norm and mixtral.sliding_window is None
    qwen = ModelConfig.from_model_dir(QWEN3_MOE_DIR)
    # transformers 5 writes num_experts as num_local_experts; layer 1 is in mlp_only_layers.
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size,
            qwen.norm_topk_prob, qwen.moe_layers) == (6, 2, 48, False, (0, 2))
    assert qwen.qk_norm and qwen.intermediate_size == 112 and qwen.head_dim == 64
    assert not ModelConfig.from_model_dir(QWEN3_DIR).num_experts


def test_qwen3_moe_sparse_layers_and_hub_field_names():
    config = ModelConfig.from_dict(minimal_config(
        "Qwen3MoeForCausalLM", num_hidden_layers=6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3],
        norm_topk_prob=True))
    # transformers' rule: sparse when not mlp_only and (i + 1) % step == 0.
    assert config.moe_layers == (1, 5) and config.num_experts == 4 and config.norm_topk_prob
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    # Without head_dim: hidden / heads, as Qwen3MoeConfig (unlike Qwen3Config) does.
    assert config.head_dim == 8


@pytest.mark.parametrize("arch, change, field", [
    ("MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok"),
    ("MixtralForCausalLM", {"num_local_experts": 0}, "num_local_experts"),
    ("Qwen3MoeForCausalLM", {"mlp_only_layers": ["0"]}, "mlp_only_layers"),
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("Qwen3MoeForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
])
def test_moe_configs_refused(arch, change, field):
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(minimal_config(arch, **change))


def _rewrite_fused(src: pathlib.Path, dst: pathlib.Path, block: str, names: tuple[str, ...],
                   new_block: str) -> None:
    """A copy of `src` with every MoE layer's experts in transformers 5's fused tensors."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    config = ModelConfig.from_model_dir(src)
    tensors = load_file(dst / "model.safetensors")
    gate, up, down = names
    for i in config.moe_layers:
        old, new = f"model.layers.{i}.{block}", f"model.layers.{i}.{new_block}"
        gate_up = [np.concatenate([tensors.pop(f"{old}experts.{e}.{gate}.weight"),
                                   tensors.pop(f"{old}experts.{e}.{up}.weight")])
                   for e in range(config.num_experts)]
        downs = [tensors.pop(f"{old}experts.{e}.{down}.weight")
                 for e in range(config.num_experts)]
        tensors[f"{new}experts.gate_up_proj"] = np.stack(gate_up)
        tensors[f"{new}experts.down_proj"] = np.stack(downs)
        tensors[f"{new}gate.weight"] = tensors.pop(f"{old}gate.weight")
    save_file(tensors, dst / "model.safetensors")


@pytest.mark.parametrize("name, block, names, new_block", [
    # Hub Mixtral says block_sparse_moe.; transformers 5's module is mlp.
    ("mixtral_moe", "block_sparse_moe.", ("w1", "w3", "w2"), "mlp."),
    ("qwen3_moe", "mlp.", ("gate_proj", "up_proj", "down_proj"), "mlp."),
])
def test_fused_and_per_expert_layouts_load_the_same_experts(tmp_path, name, block, names,
                                                             new_block):
    per_expert = load_model_weights(TINY_DIR / name)
    _rewrite_fused(TINY_DIR / name, tmp_path / "fused", block, names, new_block)
    fused = load_model_weights(tmp_path / "fused")
    for a, b in zip(per_expert.layers, fused.layers):
        for field in ("router", "experts_gate_up", "experts_down", "gate_proj", "down_proj"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None and y is None) or np.array_equal(x, y), field
    layer = per_expert.layers[0]
    config = per_expert.config
    inter = config.moe_intermediate_size
    assert layer.experts_gate_up.shape == (config.num_experts, 2 * inter, config.hidden_size)
    assert layer.experts_down.shape == (config.num_experts, config.hidden_size, inter)


def test_missing_expert_names_the_tensor(tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(MIXTRAL_DIR, model_dir)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        load_model_weights(model_dir)


def test_build_model_runs_moe_blocks_and_refuses_weights_without_router():
    config = ModelConfig.from_model_dir(QWEN3_MOE_DIR)
    weights = load_model_weights(QWEN3_MOE_DIR, config)
    model = build_model(config, weights, NumpyBackend(), max_position=64)
    assert [layer.moe is not None for layer in model.layers] == [True, False, True]
    stripped = dataclasses.replace(weights, layers=[
        dataclasses.replace(layer, router=None) for layer in weights.layers])
    with pytest.raises(ValueError, match="router / expert weights missing"):
        build_model(config, stripped, NumpyBackend(), max_position=64)


# ----------------------------------------------------------------------------------- Gemma 3
GEMMA3_DIR = TINY_DIR / "gemma3_tiny"


def test_gemma3_fixture_config():
    config = ModelConfig.from_model_dir(GEMMA3_DIR)
    assert config.architecture == "Gemma3ForCausalLM"
    assert forward_of(config).model_class is LlamaModel
    assert config.qk_norm and config.post_sublayer_norms and config.norm_weight_offset == 1.0
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert config.embedding_scale == pytest.approx(96 ** 0.5)
    assert config.softmax_scale == pytest.approx(48 ** -0.5)  # query_pre_attn_scalar, not 64
    assert [config.layer_sliding_window(i) for i in range(4)] == [5, 5, None, 5]
    assert config.sliding_window is None  # no Mistral-style cap on max_model_len
    assert config.rope_theta == 1e6 and config.local_rope_theta == 1e4
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 2.0


def test_gemma3_older_config_layout():
    """Hub configs before transformers 5: top-level rope_theta / rope_local_base_freq /
    rope_scaling, sliding_window_pattern instead of layer_types, defaults for the rest."""
    config = ModelConfig.from_dict(minimal_config(
        "Gemma3ForCausalLM", num_hidden_layers=7, head_dim=16, rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512, sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh"))
    assert [config.layer_sliding_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert config.rope_scaling.factor == 8.0 and config.local_rope_theta == 1e4
    assert config.softmax_scale == pytest.approx(16 ** -0.5)  # query_pre_attn_scalar: head_dim
    by_type = ModelConfig.from_dict(minimal_config(None, model_type="gemma3_text"))
    assert by_type.architecture == "Gemma3ForCausalLM" and by_type.head_dim == 256


@pytest.mark.parametrize("change, field", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["full_attention", "chunked_attention"], "num_hidden_layers": 2},
     "layer_types"),
    ({"layer_types": ["full_attention"], "num_hidden_layers": 2}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                          "sliding_attention": {}}}, "rope_parameters"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_gemma3_configs_refused(change, field):
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dict(minimal_config("Gemma3ForCausalLM", **change))
    assert field in str(info.value)


def test_gemma3_norms_are_folded_at_load():
    """(1 + w): the loader hands every backend w + 1, the checkpoint's own tensor plus one."""
    from pagedrun.runtime.weights import SafetensorsCheckpoint

    config = ModelConfig.from_model_dir(GEMMA3_DIR)
    weights = load_model_weights(GEMMA3_DIR, config)
    raw = SafetensorsCheckpoint(GEMMA3_DIR)
    layer = weights.layers[1]
    for name, got in (("input_layernorm", layer.input_layernorm),
                      ("post_attention_layernorm", layer.post_attention_layernorm),
                      ("pre_feedforward_layernorm", layer.pre_feedforward_layernorm),
                      ("post_feedforward_layernorm", layer.post_feedforward_layernorm),
                      ("self_attn.q_norm", layer.q_norm), ("self_attn.k_norm", layer.k_norm)):
        stored = raw.get(f"model.layers.1.{name}.weight", got.shape, np.float32)
        np.testing.assert_array_equal(got, stored + np.float32(1.0), err_msg=name)
    np.testing.assert_array_equal(
        weights.norm, raw.get("model.norm.weight", weights.norm.shape, np.float32) + 1)
    # Tied: the LM head is the unscaled embedding table.
    assert weights.lm_head is weights.embed_tokens


def test_gemma3_build_model_refuses_weights_without_feedforward_norms():
    config = ModelConfig.from_model_dir(GEMMA3_DIR)
    weights = load_model_weights(GEMMA3_DIR, config)
    model = build_model(config, weights, NumpyBackend, 64)
    assert [layer.sliding_window for layer in model.layers] == [5, 5, None, 5]
    assert model.layers[0].cos_sin_cache is model.layers[1].cos_sin_cache
    assert model.layers[0].cos_sin_cache is not model.layers[2].cos_sin_cache
    weights.layers[2].post_feedforward_layernorm = None
    with pytest.raises(ValueError, match="feed-forward norm"):
        build_model(config, weights, NumpyBackend, 64)


# ------------------------------------------------------------------------------- tensor maps

@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_tensor_maps_name_real_fields_once(arch):
    """Every map entry fills LayerWeights / ModelWeights fields (each at most once per layer),
    with a known group, shard kind and dimensions; checkpoint and GGUF names are unique."""
    from pagedrun.runtime.families import base
    from pagedrun.runtime.weights import LayerWeights, ModelWeights

    groups = {base.QKV, base.O_PROJ, base.GATE_UP, base.DOWN, base.NORM, base.EMBED, base.LM_HEAD}
    shards = {base.COLUMN, base.ROW, base.ROW_BIAS, base.REPLICATED, base.VOCAB}
    for entries, holder in ((arch.tensors.layer, LayerWeights), (arch.tensors.model,
                                                                  ModelWeights)):
        names = {f.name for f in dataclasses.fields(holder)}
        fields = [part.field for entry in entries for part in entry.parts]
        assert len(fields) == len(set(fields)) and set(fields) <= names, arch.name
        for entry in entries:
            assert entry.group in groups and entry.shard in shards, entry.name
            assert entry.when is None or entry.when in base.PRESENCE, entry.name
            assert all(part.dim in base._DIM_SIZES for part in entry.parts), entry.name
            # A row-parallel matrix is split along its columns: one part, a split dimension.
            if entry.shard == base.ROW:
                assert len(entry.parts) == 1 and entry.cols in (base.DIM_Q, base.DIM_INTER)
            if entry.shard == base.COLUMN:
                assert all(p.dim in (base.DIM_Q, base.DIM_KV, base.DIM_INTER)
                           for p in entry.parts), entry.name
        for key in ("name", "gguf"):
            values = [getattr(e, key) for e in entries if getattr(e, key) is not None]
            assert len(values) == len(set(values)), (arch.name, key)


def test_fused_entry_shapes_and_offsets():
    from pagedrun.runtime.families.base import (DIM_HIDDEN, DIM_KV, DIM_Q, LLAMA_TENSORS, QKV,
                                                COLUMN, Part, TensorEntry)

    config = ModelConfig.from_dict(minimal_config())  # q 32, kv 16, hidden 32
    entry = TensorEntry("x.{i}.qkv", (Part("q_proj", DIM_Q), Part("k_proj", DIM_KV),
                                      Part("v_proj", DIM_KV)), QKV, COLUMN, DIM_HIDDEN)
    assert entry.shape(config) == (64, 32) and entry.row_offsets(config) == [0, 32, 48]
    fused = LLAMA_TENSORS.fusing(("model.layers.{i}.self_attn.q_proj.weight",
                                  "model.layers.{i}.self_attn.k_proj.weight",
                                  "model.layers.{i}.self_attn.v_proj.weight"), entry)
    assert len(fused.layer) == len(LLAMA_TENSORS.layer) - 2
    assert fused.layer[1] is entry  # at the first replaced entry's place
    with pytest.raises(ValueError, match="no such entries"):
        LLAMA_TENSORS.fusing(("model.layers.{i}.self_attn.qkv.weight",), entry)


def test_presence_follows_the_config():
    """Biases only with attention_bias; a MoE layer has no dense MLP; lm_head only untied."""
    from pagedrun.runtime.families.base import LLAMA_TENSORS

    def present(config, layer):
        return {e.name.rsplit(".", 2)[-2] for e in LLAMA_TENSORS.layer
                if e.present(config, layer)}

    plain = ModelConfig.from_dict(minimal_config())
    assert "q_proj" in present(plain, 0) and not {"gate_proj", "up_proj"} - present(plain, 0)
    biased = ModelConfig.from_dict(minimal_config(attention_bias=True))
    bias_entries = [e for e in LLAMA_TENSORS.layer if e.name.endswith(".bias")]
    assert all(e.present(biased) for e in bias_entries)
    assert not any(e.present(plain) for e in bias_entries)
    moe = ModelConfig.from_dict(minimal_config("Qwen3MoeForCausalLM", num_hidden_layers=2,
                                               num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=16, mlp_only_layers=[1]))
    mlp = {"gate_proj", "up_proj", "down_proj"}
    assert not mlp & present(moe, 0) and mlp <= present(moe, 1)
    lm_head = LLAMA_TENSORS.model[-1]
    assert lm_head.name == "lm_head.weight"
    assert not lm_head.present(ModelConfig.from_dict(minimal_config(tie_word_embeddings=True)))
    assert lm_head.present(ModelConfig.from_dict(minimal_config(tie_word_embeddings=False)))


def test_runner_builds_its_model_through_the_registry(monkeypatch):
    """ModelRunner names no model class: it builds what forward_of(config) says."""
    from pagedrun.runtime import model_runner
    from pagedrun.runtime.models import registry

    built = []

    class Recording(LlamaModel):
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("tp"))
            super().__init__(*args, **kwargs)

    config = ModelConfig.from_model_dir(QWEN3_DIR)
    weights = load_model_weights(QWEN3_DIR, config)
    llama = registry.FORWARDS["llama"]
    monkeypatch.setitem(registry.FORWARDS, "llama",
                        dataclasses.replace(llama, model_class=Recording))
    runner = model_runner.ModelRunner(config, weights, block_size=16, max_model_len=64,
                                      ops=NumpyBackend())
    assert type(runner.model) is Recording and built == [registry.SINGLE_DEVICE]
