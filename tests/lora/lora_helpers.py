"""Helpers of the engine-level LoRA tests: random PEFT adapter directories for any model config
(written with the safetensors package, PEFT's file names and tensor names), and the oracle:
greedy tokens of the dense reference with the adapter merged into the weights
(runtime/lora/adapter_weights.merged_weights, W + scale * B @ A per projection)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors.numpy

from pagedrun.runtime.lora import LoRARequest
from pagedrun.runtime.lora.adapter_weights import merged_weights
from pagedrun.runtime.lora.peft_loader import load_peft_adapter
from pagedrun.runtime.reference import ReferenceModel

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_GROUP = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """HF projection -> (out_features, in_features) of the full model."""
    h, i, q, kv = (config.hidden_size, config.intermediate_size, config.q_size, config.kv_size)
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def write_peft_adapter(path, config, rank: int, seed: int, targets=ALL_TARGETS,
                       alpha: float | None = None, use_rslora: bool = False,
                       strength: float = 0.6) -> pathlib.Path:
    """A random PEFT LoRA directory whose delta (alpha / r) * B @ A is about `strength` times
    a base weight's scale (1 / sqrt(in)): large enough to change greedy tokens."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    alpha = float(rank if alpha is None else alpha)
    scale = alpha / (np.sqrt(rank) if use_rslora else rank)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj in targets:
            out_f, in_f = projection_shapes(config)[proj]
            name = f"base_model.model.model.layers.{layer}.{_GROUP[proj]}.{proj}"
            a = rng.standard_normal((rank, in_f)) / np.sqrt(in_f)
            b = rng.standard_normal((out_f, rank)) * strength / (np.sqrt(rank) * scale)
            tensors[f"{name}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = b.astype(np.float32)
    safetensors.numpy.save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
        "target_modules": list(targets), "bias": "none"}))
    return path


_REFERENCE: dict = {}


def merged_greedy(model, lora_request: LoRARequest | None, prompt: list[int],
                  max_tokens: int) -> list[int]:
    """Greedy tokens of the float32 dense reference; with an adapter, over the merged weights."""
    config, weights = model
    key = (id(weights), lora_request, tuple(prompt), max_tokens)
    if key not in _REFERENCE:
        if lora_request is not None:
            adapter = load_peft_adapter(lora_request, config, max_lora_rank=64)
            weights = merged_weights(weights, adapter)
        _REFERENCE[key] = (model[1], ReferenceModel(config, weights).greedy_generate(
            prompt, max_tokens))
    return _REFERENCE[key][1]
