"""A converted GGUF computes what llama.cpp computes from the GGUF itself.

Independent reference: a float64 forward written here in llama.cpp's conventions, run on the
GGUF's own tensors (dequantized by gguf, q/k rows still permuted) with interleaved (GPT-J style)
rotary pairs (2i, 2i + 1). The model under test is `ReferenceModel` on the converted Hugging
Face directory (unpermuted rows, half-split rotary pairs (i, i + d/2)). Equal logits mean the
row unpermutation, tensor mapping and config are right together.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedrun.runtime.gguf_convert import convert_gguf

import pagedrun_tests_tiny_gguf as tiny_gguf  # registered by tests/conftest.py


def _gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    import gguf

    reader = gguf.GGUFReader(path)
    return {
        t.name: (gguf.quants.dequantize(t.data, t.tensor_type)
                 .reshape(tuple(reversed(t.shape))).astype(np.float64))
        for t in reader.tensors
    }


def _llama_cpp_forward(t: dict[str, np.ndarray], token_ids: list[int], num_layers: int,
                       num_heads: int, num_kv_heads: int, eps: float, theta: float,
                       interleaved: bool) -> np.ndarray:
    """Logits [T, vocab] float64 of llama.cpp's graph on GGUF tensors."""
    x = t["token_embd.weight"][token_ids]
    num_tokens = len(token_ids)
    head_dim = x.shape[1] // num_heads
    angles = np.arange(num_tokens)[:, None] * theta ** (-np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]          # [T, 1, d/2]

    def rope(v):                                                          # v: [T, heads, d]
        if interleaved:
            a, b = v[..., 0::2], v[..., 1::2]
            out = np.empty_like(v)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = v[..., : head_dim // 2], v[..., head_dim // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    def linear(v, name):
        bias = t.get(name.replace(".weight", ".bias"))
        return v @ t[name].T + (0 if bias is None else bias)

    causal = np.tril(np.ones((num_tokens, num_tokens), bool))
    for layer in range(num_layers):
        p = f"blk.{layer}."
        h = norm(x, t[p + "attn_norm.weight"])
        q = rope(linear(h, p + "attn_q.weight").reshape(num_tokens, num_heads, head_dim))
        k = rope(linear(h, p + "attn_k.weight").reshape(num_tokens, num_kv_heads, head_dim))
        v = linear(h, p + "attn_v.weight").reshape(num_tokens, num_kv_heads, head_dim)
        group = num_heads // num_kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(num_tokens, -1)
        x = x + linear(attn, p + "attn_output.weight")
        h = norm(x, t[p + "ffn_norm.weight"])
        gate = linear(h, p + "ffn_gate.weight")
        x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "ffn_up.weight"),
                       p + "ffn_down.weight")
    head = t.get("output.weight", t["token_embd.weight"])
    return norm(x, t["output_norm.weight"]) @ head.T


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True)])
def test_converted_model_matches_llama_cpp_graph(tmp_path, arch, tied):
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.reference import ReferenceModel
    from pagedrun.runtime.weights import load_model_weights

    tiny = tiny_gguf.write_tiny_gguf(tmp_path / "m.gguf", arch=arch, tied=tied, num_layers=3,
                                     seed=21, hidden_size=64, num_heads=4, num_kv_heads=2)
    out = convert_gguf(tiny.path, tmp_path / "hf")
    config = ModelConfig.from_model_dir(out)
    model = ReferenceModel(config, load_model_weights(out, config))
    token_ids = [3, 77, 150, 9, 260, 41, 5, 200, 18, 99, 1]
    c = tiny.config
    expected = _llama_cpp_forward(
        _gguf_tensors(tiny.path), token_ids, c["num_layers"], c["num_heads"], c["num_kv_heads"],
        # llama.cpp runs Qwen2 with NeoX rope.
        eps=1e-5, theta=10000.0, interleaved=(arch == "llama"),
    )
    logits = model.forward(token_ids)
    np.testing.assert_allclose(logits, expected, rtol=2e-4, atol=2e-4 * np.abs(expected).max())
    assert (logits.argmax(-1) == expected.argmax(-1)).all()
