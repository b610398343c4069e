"""Helpers of the tensor-parallel tests: tiny random Llama models written as HF directories
(tensor-parallel ranks read their shards from safetensors files), engines around them, and
greedy generation with per-step logits."""
from __future__ import annotations

import json
import os

import numpy as np

from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.runtime.weights import LayerWeights, ModelWeights


def tiny_config_dict(**overrides) -> dict:
    data = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 389, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2,
        "bos_token_id": 1, "torch_dtype": "float32",
    }
    data.update(overrides)
    return data


def random_weights(config: ModelConfig, seed: int) -> ModelWeights:
    """Random weights scaled so greedy decisions are far from ties."""
    rng = np.random.default_rng(seed)
    hidden, inter, q, kv = (config.hidden_size, config.intermediate_size, config.q_size,
                            config.kv_size)

    def mat(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def vec(n, scale=0.1, base=0.0):
        return (base + scale * rng.standard_normal(n)).astype(np.float32)

    bias = config.attention_bias
    layers = [LayerWeights(
        input_layernorm=vec(hidden, base=1.0), q_proj=mat(q, hidden), k_proj=mat(kv, hidden),
        v_proj=mat(kv, hidden), o_proj=mat(hidden, q),
        q_bias=vec(q) if bias else None, k_bias=vec(kv) if bias else None,
        v_bias=vec(kv) if bias else None, o_bias=vec(hidden) if config.o_proj_bias else None,
        post_attention_layernorm=vec(hidden, base=1.0), gate_proj=mat(inter, hidden),
        up_proj=mat(inter, hidden), down_proj=mat(hidden, inter),
    ) for _ in range(config.num_hidden_layers)]
    embed = rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)
    lm_head = embed if config.tie_word_embeddings else 4.0 * mat(config.vocab_size, hidden)
    return ModelWeights(config=config, embed_tokens=embed, layers=layers,
                        norm=vec(hidden, base=1.0), lm_head=lm_head)


def write_model_dir(path, seed: int = 0, **overrides) -> str:
    """A Hugging Face directory (config.json + model.safetensors) of a tiny random Llama."""
    from safetensors.numpy import save_file

    data = tiny_config_dict(**overrides)
    config = ModelConfig.from_dict(data)
    w = random_weights(config, seed)
    tensors = {"model.embed_tokens.weight": w.embed_tokens, "model.norm.weight": w.norm}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = w.lm_head
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = layer.input_layernorm
        tensors[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
        for name in ("q", "k", "v", "o"):
            tensors[p + f"self_attn.{name}_proj.weight"] = getattr(layer, f"{name}_proj")
            b = getattr(layer, f"{name}_bias")
            if b is not None:
                tensors[p + f"self_attn.{name}_proj.bias"] = b
        for name in ("gate", "up", "down"):
            tensors[p + f"mlp.{name}_proj.weight"] = getattr(layer, f"{name}_proj")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return str(path)


# The tensor-parallel authentication settings (runtime/distributed/auth.py) the executor reads
# from EngineConfig; set as attributes where EngineConfig does not declare them (yet).
TP_AUTH_FIELDS = ("tp_secret_file", "tp_curve")


def make_engine(model_dir: str, tp: int, device: str = "cpu", **kwargs) -> LLMEngine:
    config = {"num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 48,
              "check_invariants": True, **kwargs}
    extra = {k: config.pop(k) for k in TP_AUTH_FIELDS
             if k in config and k not in EngineConfig.__dataclass_fields__}
    engine_config = EngineConfig(model=model_dir, device=device, tensor_parallel_size=tp,
                                 **config)
    for name, value in extra.items():
        setattr(engine_config, name, value)
    return LLMEngine(engine_config)


def secret_file(directory) -> str:
    """A new tensor-parallel shared secret file (mode 0600) in directory."""
    from pagedrun.runtime.distributed.auth import write_secret_file

    path = os.path.join(str(directory), "tp.secret")
    write_secret_file(path)
    return path


def prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    """Awkward lengths: one token, under a block, several blocks (chunked by the budget)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, n).tolist() for n in (1, 13, 37, 70)]


def greedy_run(engine: LLMEngine, prompt_ids: list[list[int]], max_tokens: int = 8):
    """Run every prompt together, greedily. Returns (request id -> generated token ids, the
    logits [num_sampled, vocab] float32 the runner returned at each step)."""
    step_logits = []
    execute = engine.runner.execute

    def recording_execute(out, prompt_logit_rows=(), **kwargs):
        result = execute(out, prompt_logit_rows, **kwargs)
        step_logits.append(np.array(result.logits))
        return result

    engine.runner.execute = recording_execute
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    return tokens, step_logits
