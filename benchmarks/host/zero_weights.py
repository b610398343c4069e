"""zero_weights: a dense model's ModelWeights of the right shapes, every tensor a broadcast view
of one float32 zero (no memory until the model copies them into its fused layout).

The host-overhead benchmark removes the model's compute, so the values never matter; the shapes
do (every op's output shape follows from them), and so does the vocabulary (sampling cost).
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import LayerWeights, ModelWeights

_ZERO = np.zeros((), np.float32)


def _zeros(*shape: int) -> np.ndarray:
    return np.broadcast_to(_ZERO, shape)


def zero_weights(config: ModelConfig) -> ModelWeights:
    """Weights of a dense Llama-family config (biases and QK-norm as the config says). MoE and
    Gemma-3-style sandwich norms are refused: the benchmark measures the default model's path."""
    moe = any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if moe or config.post_sublayer_norms:
        raise ValueError(f"{config.architecture}: zero_weights builds dense Llama-family "
                         "weights only")
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.q_size, config.kv_size
    bias = config.attention_bias

    def layer() -> LayerWeights:
        return LayerWeights(
            input_layernorm=_zeros(hidden), q_proj=_zeros(q_size, hidden),
            k_proj=_zeros(kv_size, hidden), v_proj=_zeros(kv_size, hidden),
            o_proj=_zeros(hidden, q_size),
            q_bias=_zeros(q_size) if bias else None, k_bias=_zeros(kv_size) if bias else None,
            v_bias=_zeros(kv_size) if bias else None,
            o_bias=_zeros(hidden) if config.o_proj_bias else None,
            post_attention_layernorm=_zeros(hidden), gate_proj=_zeros(inter, hidden),
            up_proj=_zeros(inter, hidden), down_proj=_zeros(hidden, inter),
            q_norm=_zeros(config.head_dim) if config.qk_norm else None,
            k_norm=_zeros(config.head_dim) if config.qk_norm else None)

    embed = _zeros(config.vocab_size, hidden)
    lm_head = embed if config.tie_word_embeddings else _zeros(config.vocab_size, hidden)
    return ModelWeights(config=config, embed_tokens=embed,
                        layers=[layer() for _ in range(config.num_hidden_layers)],
                        norm=_zeros(hidden), lm_head=lm_head)
