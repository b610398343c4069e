"""ModelConfig parsing and safetensors weight loading: formats, dtypes, sharding, and every
named error (the message must name the file and the tensor or field, never be a traceback).

Test checkpoints are written with the `safetensors` package's own writer (an implementation
independent of our reader), from the tiny fixture models or from fresh random arrays.
"""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.model_config import ModelConfig, RopeScaling
from pagedrun.runtime.weights import SafetensorsCheckpoint, SafetensorsFile, load_model_weights

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"

# A Llama 3.2 style config.json in the older layout (top-level rope_theta / rope_scaling).
LLAMA32_STYLE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": 128001,
}


# -- helpers ---------------------------------------------------------------------------------

def tensors_of(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint as float32 (read with our loader's low-level reader)."""
    checkpoint = SafetensorsCheckpoint(model_dir)
    return {name: checkpoint.get(name) for name in checkpoint.names()}


def write_bf16(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 arrays as BF16 with the safetensors writer (keeping the top 16 bits)."""
    raw = {name: (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
           for name, a in tensors.items()}
    specs = {name: safetensors.TensorSpec(dtype="bfloat16", shape=list(a.shape),
                                          data_ptr=a.ctypes.data, data_len=a.nbytes)
             for name, a in raw.items()}
    safetensors.serialize_file(specs, str(path))


def copy_model(name: str, tmp_path: pathlib.Path) -> pathlib.Path:
    target = tmp_path / name
    shutil.copytree(TINY_DIR / name, target)
    return target


def rewrite_single_file(model_dir: pathlib.Path, tensors: dict[str, np.ndarray]) -> pathlib.Path:
    path = model_dir / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    return path


def bf16_exact(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random float32 values that bf16 and fp16 both hold exactly (8 significant bits, small
    range)."""
    return (rng.integers(-128, 128, size=shape) / 64.0).astype(np.float32)


# -- ModelConfig -----------------------------------------------------------------------------

def test_config_transformers5_layout_from_fixture() -> None:
    config = ModelConfig.from_model_dir(TINY_DIR / "llama3_sharded")
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim) == (72, 6, 2, 12)
    assert config.num_queries_per_kv == 3 and config.q_size == 72 and config.kv_size == 24
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 8.0, 64)
    assert config.torch_dtype == "float32" and not config.tie_word_embeddings


def test_config_qwen2_and_mistral_specifics() -> None:
    qwen = ModelConfig.from_model_dir(TINY_DIR / "qwen2_tied")
    assert (qwen.attention_bias, qwen.o_proj_bias, qwen.rope_theta) == (True, False, 1e6)
    assert qwen.bos_token_id is None and qwen.eos_token_ids == (3,)
    mistral = ModelConfig.from_model_dir(TINY_DIR / "mistral_fp16")
    assert mistral.sliding_window == 6 and not mistral.attention_bias
    llama = ModelConfig.from_model_dir(TINY_DIR / "llama_tied_bf16")
    assert (llama.head_dim, llama.q_size, llama.hidden_size) == (20, 80, 64)
    assert (llama.attention_bias, llama.o_proj_bias, llama.eos_token_ids) == (True, True, (1, 2))


def test_config_older_layout_and_generation_eos_merge(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA32_STYLE))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    config = ModelConfig.from_model_dir(tmp_path)
    assert config.head_dim == 64 and config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.bos_token_id == 128000 and config.torch_dtype == "bfloat16"
    # Oldest spelling of the rope type key; no architectures list (inferred from model_type).
    older = dict(LLAMA32_STYLE, rope_scaling=dict(LLAMA32_STYLE["rope_scaling"]))
    del older["architectures"]
    older["rope_scaling"]["type"] = older["rope_scaling"].pop("rope_type")
    assert ModelConfig.from_dict(older).rope_scaling == config.rope_scaling


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"architectures": None, "model_type": "gpt2"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": "16"}, "num_hidden_layers"),
        ({"num_key_value_heads": 7}, "num_key_value_heads"),
        ({"eos_token_id": "</s>"}, "eos_token_id"),
    ],
)
def test_config_errors_name_file_and_field(tmp_path: pathlib.Path, change: dict,
                                           field: str) -> None:
    bad = {k: v for k, v in {**LLAMA32_STYLE, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelLoadError) as excinfo:
        ModelConfig.from_model_dir(tmp_path)
    message = str(excinfo.value)
    assert str(tmp_path / "config.json") in message and repr(field) in message
    assert excinfo.value.field == field


def test_config_broken_or_missing_json(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json: file not found"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        ModelConfig.from_model_dir(tmp_path)


# -- weights: layouts and dtypes -------------------------------------------------------------

def test_sharded_checkpoint_equals_single_file(tmp_path: pathlib.Path) -> None:
    sharded_dir = TINY_DIR / "llama3_sharded"
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    shutil.copy(sharded_dir / "config.json", single_dir)
    originals = {}
    for shard in sorted(set(index["weight_map"].values())):
        originals.update(safetensors.numpy.load_file(str(sharded_dir / shard)))
    safetensors.numpy.save_file(originals, str(single_dir / "model.safetensors"))

    sharded, single = load_model_weights(sharded_dir), load_model_weights(single_dir)
    np.testing.assert_array_equal(sharded.layers[2].k_proj,
                                  originals["model.layers.2.self_attn.k_proj.weight"])
    for name in ("embed_tokens", "norm", "lm_head"):
        np.testing.assert_array_equal(getattr(sharded, name), getattr(single, name))
    for a, b in zip(sharded.layers, single.layers):
        for field in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                      "input_layernorm", "post_attention_layernorm"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert sharded.lm_head is not sharded.embed_tokens


@pytest.mark.parametrize("disk_dtype", ["fp32", "fp16", "bf16"])
def test_disk_dtypes_load_to_the_same_float32_values(tmp_path: pathlib.Path,
                                                     disk_dtype: str) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    rng = np.random.default_rng(3)
    originals = {name: bf16_exact(a.shape, rng) for name, a in tensors_of(model_dir).items()}
    path = model_dir / "model.safetensors"
    if disk_dtype == "fp32":
        safetensors.numpy.save_file(originals, str(path))
    elif disk_dtype == "fp16":
        safetensors.numpy.save_file({n: a.astype(np.float16) for n, a in originals.items()},
                                    str(path))
    else:
        write_bf16(path, originals)
    weights = load_model_weights(model_dir)
    assert weights.embed_tokens.dtype == np.float32 and weights.embed_tokens.flags.c_contiguous
    np.testing.assert_array_equal(weights.embed_tokens, originals["model.embed_tokens.weight"])
    np.testing.assert_array_equal(weights.layers[1].q_bias,
                                  originals["model.layers.1.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(weights.layers[0].down_proj,
                                  originals["model.layers.0.mlp.down_proj.weight"])
    assert weights.lm_head is weights.embed_tokens


def test_bf16_widening_of_inexact_values(tmp_path: pathlib.Path) -> None:
    """bf16 keeps the top 16 bits of a float32: loading must restore exactly those bits."""
    values = np.random.default_rng(5).standard_normal((3, 17)).astype(np.float32)
    write_bf16(tmp_path / "x.safetensors", {"x": values})
    loaded = SafetensorsFile(tmp_path / "x.safetensors").read("x", np.dtype(np.float32))
    np.testing.assert_array_equal(loaded.view(np.uint32),
                                  values.view(np.uint32) & np.uint32(0xFFFF0000))
    assert np.abs(loaded - values).max() <= np.abs(values).max() * 2.0 ** -7


def test_bf16_fixture_and_requested_dtypes() -> None:
    weights = load_model_weights(TINY_DIR / "llama_tied_bf16")
    assert not np.any(weights.layers[0].q_proj.view(np.uint32) & np.uint32(0xFFFF))
    assert weights.layers[0].o_bias is not None and weights.layers[0].o_bias.shape == (64,)
    half = load_model_weights(TINY_DIR / "mistral_fp16", dtype=np.float16)
    assert half.layers[1].gate_proj.dtype == np.float16
    assert half.layers[1].gate_proj.shape == (116, 84)
    with pytest.raises(ValueError):
        load_model_weights(TINY_DIR / "mistral_fp16", dtype=np.int8)


# -- weights: named errors -------------------------------------------------------------------

def assert_load_error(model_dir: pathlib.Path, file: pathlib.Path, tensor: str | None,
                      match: str) -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_weights(model_dir)
    message = str(excinfo.value)
    assert str(file) in message, message
    if tensor is not None:
        assert repr(tensor) in message, message
        assert excinfo.value.tensor == tensor
    assert match in message, message


def test_missing_tensor(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    tensors = tensors_of(model_dir)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    path = rewrite_single_file(model_dir, tensors)
    assert_load_error(model_dir, path, "model.layers.1.mlp.up_proj.weight", "missing")


def test_missing_lm_head_of_untied_model(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("mistral_fp16", tmp_path)
    tensors = tensors_of(model_dir)
    del tensors["lm_head.weight"]
    path = rewrite_single_file(model_dir, tensors)
    assert_load_error(model_dir, path, "lm_head.weight", "missing")


def test_misshaped_tensor(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    tensors = tensors_of(model_dir)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    path = rewrite_single_file(model_dir, tensors)
    assert_load_error(model_dir, path, name, "shape [72, 36] does not match the config's [36, 72]")


def test_truncated_file_names_the_cut_tensor(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    path = model_dir / "model.safetensors"
    header_bytes = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_bytes])
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    assert_load_error(model_dir, path, last, "truncated")


@pytest.mark.parametrize("keep_bytes", [0, 5, 40])
def test_truncated_header(tmp_path: pathlib.Path, keep_bytes: int) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    path = model_dir / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(keep_bytes)
    assert_load_error(model_dir, path, None, "truncated")


def test_garbage_header(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    assert_load_error(model_dir, path, None, "corrupt safetensors header")


def test_unsupported_disk_dtype(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    tensors = tensors_of(model_dir)
    name = "model.norm.weight"
    tensors[name] = np.ones(tensors[name].shape, dtype=np.int8)
    path = rewrite_single_file(model_dir, tensors)
    assert_load_error(model_dir, path, name, "unsupported dtype I8")


def test_no_weight_files(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("qwen2_tied", tmp_path)
    (model_dir / "model.safetensors").unlink()
    assert_load_error(model_dir, model_dir, None, "no model.safetensors")


def test_index_not_json(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("llama3_sharded", tmp_path)
    index = model_dir / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-20])
    assert_load_error(model_dir, index, None, "not valid JSON")


def test_index_without_weight_map(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("llama3_sharded", tmp_path)
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    assert_load_error(model_dir, index, None, "weight_map")


def test_index_names_a_missing_shard(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("llama3_sharded", tmp_path)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    (model_dir / shard).unlink()
    assert_load_error(model_dir, model_dir / shard, name, "not found")


def test_index_lists_a_tensor_its_shard_lacks(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("llama3_sharded", tmp_path)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    index_path.write_text(json.dumps(index))
    assert_load_error(model_dir, model_dir / shards[1], name, "not in this shard")


def test_index_shard_path_may_not_leave_the_directory(tmp_path: pathlib.Path) -> None:
    model_dir = copy_model("llama3_sharded", tmp_path)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    assert_load_error(model_dir, index_path, name, "bad shard file name")
