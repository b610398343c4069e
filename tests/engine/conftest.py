"""Tiny random Llama models for the engine tests (hidden 64, 2 layers), built in memory.

The dense `ReferenceModel` on the same weights is the oracle. Weights are scaled so that the
logits are spread out (a random model with too-small weights ties its argmax constantly, and a
greedy comparison would then test float rounding instead of the engine).
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import LayerWeights, ModelWeights

TINY_VOCAB = 384
TINY_HIDDEN = 64
TINY_LAYERS = 2
TINY_MAX_POSITIONS = 1024


def tiny_config(**overrides) -> ModelConfig:
    data = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": TINY_VOCAB,
        "hidden_size": TINY_HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": TINY_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": TINY_MAX_POSITIONS,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    data.update(overrides)
    return ModelConfig.from_dict(data)


def random_weights(config: ModelConfig, seed: int = 0) -> ModelWeights:
    rng = np.random.default_rng(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.q_size, config.kv_size

    def mat(out_features: int, in_features: int) -> np.ndarray:
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(
            np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    def bias(n: int) -> np.ndarray | None:
        return (0.1 * rng.standard_normal(n)).astype(np.float32) if config.attention_bias else None

    layers = [LayerWeights(
        input_layernorm=norm_weight(), q_proj=mat(q_size, hidden), k_proj=mat(kv_size, hidden),
        v_proj=mat(kv_size, hidden), o_proj=mat(hidden, q_size), q_bias=bias(q_size),
        k_bias=bias(kv_size), v_bias=bias(kv_size),
        o_bias=bias(hidden) if config.o_proj_bias else None,
        post_attention_layernorm=norm_weight(), gate_proj=mat(inter, hidden),
        up_proj=mat(inter, hidden), down_proj=mat(hidden, inter),
    ) for _ in range(config.num_hidden_layers)]
    embed = rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)
    # A larger head scale spreads the logits: greedy decisions are far from ties.
    lm_head = embed if config.tie_word_embeddings else 4.0 * mat(config.vocab_size, hidden)
    return ModelWeights(config=config, embed_tokens=embed, layers=layers,
                        norm=norm_weight(), lm_head=lm_head)


@pytest.fixture(scope="session")
def tiny_model() -> tuple[ModelConfig, ModelWeights]:
    config = tiny_config()
    return config, random_weights(config)
