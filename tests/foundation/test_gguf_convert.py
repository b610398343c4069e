"""GGUF -> Hugging Face conversion on tiny GGUF files written by the test (tiny_gguf.py).

Independent references: the original float32 weights the test quantized itself, gguf's own
dequantization of those originals (quantization acts on row blocks, so it commutes with the
row permutation and needs no inverse permutation from the code under test), and a rotary
embedding identity that says why llama.cpp permutes at all.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.gguf_convert import OUTPUT_FILES, convert_gguf, unpermute_rotary_rows

import pagedrun_tests_tiny_gguf as tiny_gguf  # registered by tests/conftest.py


# Worst-case dequantization error relative to a block's largest magnitude (or range, for Q4_1),
# with slack for the fp16 scale: Q8_0 steps by max/127, Q4_0 by max/8, Q4_1 by range/15.
QUANT_ERROR_BOUND = {"Q8_0": 1.0 / 127, "Q4_0": 1.0 / 8, "Q4_1": 1.0 / 15}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    model = tiny_gguf.write_tiny_gguf(tmp / "tiny.gguf", seed=7)
    out = convert_gguf(model.path, tmp / "hf")
    return model, out


def test_writes_every_output_file(converted):
    _, out = converted
    for name in OUTPUT_FILES:
        assert (out / name).is_file(), name


def test_float_tensors_equal_the_originals_exactly(converted):
    model, out = converted
    weights = _read_safetensors(out / "model.safetensors")
    assert set(weights) == set(model.hf_weights)
    checked = 0
    for name, original in model.hf_weights.items():
        assert weights[name].dtype == np.float32
        assert weights[name].shape == original.shape, name
        if model.gguf_types[name] in ("F32", "F16", "BF16"):
            np.testing.assert_array_equal(weights[name], original, err_msg=name)
            checked += 1
    # Every float type appears on q and k (permuted rows), so the unpermutation is checked exactly.
    permuted_types = {model.gguf_types[n] for n in model.hf_weights
                      if "q_proj" in n or "k_proj" in n}
    assert {"F32", "F16", "BF16"} <= permuted_types
    assert checked > 10


def test_quantized_tensors_equal_gguf_dequantization_of_the_originals(converted):
    import gguf

    model, out = converted
    weights = _read_safetensors(out / "model.safetensors")
    seen = set()
    for name, original in model.hf_weights.items():
        type_name = model.gguf_types[name]
        if type_name not in QUANT_ERROR_BOUND:
            continue
        seen.add(type_name)
        qtype = gguf.GGMLQuantizationType[type_name]
        expected = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)
        # And within the quantization error of the original, block by block (32 values).
        blocks = original.reshape(-1, 32)
        scale = np.abs(blocks).max(axis=1) if type_name != "Q4_1" else np.ptp(blocks, axis=1)
        error = np.abs(weights[name].reshape(-1, 32) - blocks).max(axis=1)
        assert np.all(error <= scale * QUANT_ERROR_BOUND[type_name] * 1.01 + 1e-6), name
    assert seen == set(QUANT_ERROR_BOUND)


def test_config_json_describes_the_model(converted):
    model, out = converted
    config = json.loads((out / "config.json").read_text())
    c = model.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == c["hidden_size"]
    assert config["intermediate_size"] == c["intermediate_size"]
    assert config["num_hidden_layers"] == c["num_layers"]
    assert config["num_attention_heads"] == c["num_heads"]
    assert config["num_key_value_heads"] == c["num_kv_heads"]
    assert config["head_dim"] == c["hidden_size"] // c["num_heads"]
    assert config["vocab_size"] == c["vocab_size"]
    assert config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256
    assert abs(config["rms_norm_eps"] - 1e-5) < 1e-12
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_converted_directory_loads_through_model_config_and_weights(converted):
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.weights import load_model_weights

    model, out = converted
    config = ModelConfig.from_model_dir(out)
    weights = load_model_weights(out, config)
    np.testing.assert_array_equal(weights.layers[0].input_layernorm,
                                  model.hf_weights["model.layers.0.input_layernorm.weight"])
    assert config.eos_token_ids == (2,)


def test_tied_embeddings_have_no_lm_head(tmp_path):
    model = tiny_gguf.write_tiny_gguf(tmp_path / "tied.gguf", seed=3, tied=True, num_layers=1,
                                      embed_type="F16")
    out = convert_gguf(model.path, tmp_path / "hf")
    weights = _read_safetensors(out / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"],
                                  model.hf_weights["model.embed_tokens.weight"])


def test_qwen2_is_not_unpermuted_and_keeps_biases(tmp_path):
    model = tiny_gguf.write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2", seed=5, num_layers=3)
    out = convert_gguf(model.path, tmp_path / "hf")
    weights = _read_safetensors(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    for name, original in model.hf_weights.items():
        if model.gguf_types[name] in ("F32", "F16", "BF16"):
            np.testing.assert_array_equal(weights[name], original, err_msg=name)
    assert "model.layers.2.self_attn.k_proj.bias" in weights
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.weights import load_model_weights

    loaded = load_model_weights(out, ModelConfig.from_model_dir(out))
    np.testing.assert_array_equal(loaded.layers[2].k_bias,
                                  model.hf_weights["model.layers.2.self_attn.k_proj.bias"])


@pytest.mark.parametrize("num_heads,head_dim,num_cols",
                         [(1, 2, 1), (3, 10, 7), (9, 64, 5), (2, 38, 0)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, head_dim, num_cols):
    rng = np.random.default_rng(num_heads * 100 + head_dim)
    shape = (num_heads * head_dim,) + ((num_cols,) if num_cols else ())  # 0 columns: a bias
    original = rng.standard_normal(shape).astype(np.float32)
    stored = tiny_gguf.llama_cpp_permute(original, num_heads)
    if head_dim > 2:
        assert not np.array_equal(stored, original)
    np.testing.assert_array_equal(unpermute_rotary_rows(stored, num_heads), original)


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError):
        unpermute_rotary_rows(np.zeros((10, 4), np.float32), 3)


def _rotate_half_rope(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Hugging Face's rotary: dims (i, i + d/2) rotate by angles[i]. x: [heads, d]."""
    half = x.shape[-1] // 2
    a, b = x[:, :half], x[:, half:]
    c, s = np.cos(angles), np.sin(angles)
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _interleaved_rope(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """llama.cpp's (GPT-J style) rotary: dims (2i, 2i + 1) rotate by angles[i]. x: [heads, d]."""
    a, b = x[:, 0::2], x[:, 1::2]
    c, s = np.cos(angles), np.sin(angles)
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c
    return out


def test_permutation_makes_interleaved_rope_equal_half_split_rope():
    # Why the rows are permuted: with permuted weights, llama.cpp's rotation computes the same
    # per-head dot products (q . k) as Hugging Face's rotation on the original weights.
    rng = np.random.default_rng(11)
    num_heads, head_dim, hidden = 3, 8, 12
    w_q = rng.standard_normal((num_heads * head_dim, hidden))
    w_k = rng.standard_normal((num_heads * head_dim, hidden))
    x_q, x_k = rng.standard_normal(hidden), rng.standard_normal(hidden)
    inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    for pos_q, pos_k in [(0, 0), (5, 2), (17, 16)]:
        hf_q = _rotate_half_rope((w_q @ x_q).reshape(num_heads, head_dim), pos_q * inv_freq)
        hf_k = _rotate_half_rope((w_k @ x_k).reshape(num_heads, head_dim), pos_k * inv_freq)
        cpp_q = _interleaved_rope((tiny_gguf.llama_cpp_permute(w_q, num_heads) @ x_q)
                                  .reshape(num_heads, head_dim), pos_q * inv_freq)
        cpp_k = _interleaved_rope((tiny_gguf.llama_cpp_permute(w_k, num_heads) @ x_k)
                                  .reshape(num_heads, head_dim), pos_k * inv_freq)
        np.testing.assert_allclose((hf_q * hf_k).sum(-1), (cpp_q * cpp_k).sum(-1), rtol=1e-10)


def test_unreadable_file_is_a_model_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        convert_gguf(bad, tmp_path / "out")


def test_unsupported_architecture_is_a_model_load_error(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'"):
        convert_gguf(path, tmp_path / "out")


def _write_gemma3_gguf(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A 7-layer Gemma 3 GGUF as llama.cpp's converter writes one (norms stored as w + 1,
    ffn_norm the MLP input's norm, no q/k permutation, tied); returns the HF tensors."""
    import gguf

    hidden, heads, kv_heads, head_dim, inter, layers = 64, 2, 1, 32, 96, 7
    tokens, scores, token_types = tiny_gguf.spm_vocab()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_sliding_window(32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    hf: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, values: np.ndarray, quantize: bool = False) -> None:
        values = values.astype(np.float32)
        if hf_name.endswith("norm.weight"):
            writer.add_tensor(gguf_name, values + np.float32(1.0))
        elif quantize:
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0
                                            ).reshape(values.shape)
        else:
            writer.add_tensor(gguf_name, values)
        hf[hf_name] = values

    add("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((len(tokens),
                                                                               hidden)))
    roles = {"attn_norm": ("input_layernorm", (hidden,)),
             "attn_q": ("self_attn.q_proj", (heads * head_dim, hidden)),
             "attn_k": ("self_attn.k_proj", (kv_heads * head_dim, hidden)),
             "attn_v": ("self_attn.v_proj", (kv_heads * head_dim, hidden)),
             "attn_q_norm": ("self_attn.q_norm", (head_dim,)),
             "attn_k_norm": ("self_attn.k_norm", (head_dim,)),
             "attn_output": ("self_attn.o_proj", (hidden, heads * head_dim)),
             "post_attention_norm": ("post_attention_layernorm", (hidden,)),
             "ffn_norm": ("pre_feedforward_layernorm", (hidden,)),
             "ffn_gate": ("mlp.gate_proj", (inter, hidden)),
             "ffn_up": ("mlp.up_proj", (inter, hidden)),
             "ffn_down": ("mlp.down_proj", (hidden, inter)),
             "post_ffw_norm": ("post_feedforward_layernorm", (hidden,))}
    for i in range(layers):
        for role, (hf_role, shape) in roles.items():
            add(f"blk.{i}.{role}.weight", f"model.layers.{i}.{hf_role}.weight",
                0.1 * rng.standard_normal(shape), quantize=role == "attn_v")
    add("output_norm.weight", "model.norm.weight", 0.1 * rng.standard_normal(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_gemma3_gguf_converts_to_a_gemma3_checkpoint(tmp_path):
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.weights import load_model_weights

    hf = _write_gemma3_gguf(tmp_path / "gemma3.gguf", np.random.default_rng(11))
    out = convert_gguf(tmp_path / "gemma3.gguf", tmp_path / "hf")
    weights = _read_safetensors(out / "model.safetensors")
    assert set(weights) == set(hf)  # tied: no lm_head; every norm under its HF name
    for name, original in hf.items():
        # Norms: (w + 1) - 1 in float32 is w up to one rounding of the sum.
        np.testing.assert_allclose(weights[name], original, rtol=0, atol=1e-7, err_msg=name)
    config = ModelConfig.from_model_dir(out)
    assert config.architecture == "Gemma3ForCausalLM" and config.head_dim == 32
    assert [config.layer_sliding_window(i) for i in range(7)] == [32] * 5 + [None, 32]
    assert config.rope_theta == 1e6 and config.local_rope_theta == 1e4
    assert config.softmax_scale == pytest.approx(32 ** -0.5)
    assert config.hidden_activation == "gelu_pytorch_tanh" and config.tie_word_embeddings
    loaded = load_model_weights(out, config)  # the loader folds the (1 + w) back in
    np.testing.assert_allclose(loaded.layers[3].post_feedforward_layernorm,
                               hf["model.layers.3.post_feedforward_layernorm.weight"] + 1,
                               atol=1e-6)
