"""Shared helpers of the engine tests: tiny random Llama models (hidden 64, 2 layers) built in
memory, engines around them, a driver that adds requests at chosen steps, and the dense
reference's answers (the oracle; cached per model and prompt).

Weights are scaled so that the logits are spread out (a random model with too-small weights ties
its argmax constantly, and a greedy comparison would then test float rounding, not the engine).
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.reference import ReferenceModel
from pagedrun.runtime.sampling_params import SamplingParams
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



_REFERENCE_CACHE: dict[tuple, list[int]] = {}


def make_engine(model, tokenizer=None, **config) -> LLMEngine:
    model_config, weights = model
    config.setdefault("device", "cpu")
    config.setdefault("check_invariants", True)
    return LLMEngine(EngineConfig(**config), model_config=model_config, weights=weights,
                     tokenizer=tokenizer)


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    key = (id(model[1]), tuple(prompt), max_tokens)
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = ReferenceModel(*model).greedy_generate(prompt, max_tokens)
    return _REFERENCE_CACHE[key]


def random_prompts(rng: np.random.Generator, vocab: int, num: int, max_len: int,
                   shared_prefix: list[int] | None = None) -> list[list[int]]:
    """Prompts with long-tailed lengths in [1, max_len]; token 0..2 (specials) avoided."""
    prompts = []
    for _ in range(num):
        length = int(min(max_len, 1 + rng.geometric(1.0 / (max_len / 4))))
        body = rng.integers(3, vocab, length).tolist()
        if shared_prefix is not None and rng.random() < 0.7:
            body = (shared_prefix + body)[:max_len]
        prompts.append(body)
    return prompts


def run_requests(engine: LLMEngine, requests: list[tuple[int, str, dict]],
                 max_steps: int = 100_000) -> dict[str, "object"]:
    """Drive the engine: requests are (arrival_step, request_id, add_request kwargs).

    Returns request_id -> accumulated final RequestOutput (token ids, text, logprobs of every
    completion, concatenated from the streaming deltas).
    """
    from pagedrun.runtime.llm import _merge

    pending = sorted(requests, key=lambda r: r[0])
    totals = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, kwargs = pending.pop(0)
            engine.add_request(request_id, **kwargs)
        for delta in engine.step():
            totals[delta.request_id] = _merge(totals.get(delta.request_id), delta)
        step += 1
        assert step < max_steps, "engine did not finish"
    return totals


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
