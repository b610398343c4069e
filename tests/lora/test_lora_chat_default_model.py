"""LLM.chat with LoRA adapters on the default model (SmolLM2-135M-Instruct, its real tokenizer
and chat template): an adapter whose B is zero changes nothing, a strong random adapter changes
the answer, and one batch mixes the base model and both adapters, each answer as when alone."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pagedrun.runtime.sampling_params import SamplingParams

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
RANK = 8


def write_adapter(path, config, b_scale: float, seed: int) -> str:
    """A PEFT directory on config's shapes, every projection, rank RANK, B ~ b_scale * N(0, 1)."""
    import safetensors.numpy

    rng = np.random.default_rng(seed)
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (out_f, in_f) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((RANK, in_f))
                                                / np.sqrt(in_f)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (b_scale * rng.standard_normal((out_f, RANK))
                                                ).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": RANK,
                   "target_modules": list(shapes), "bias": "none"}, f)
    return str(path)


@pytest.fixture(scope="module")
def llm():
    from pagedrun import LLM
    from pagedrun.runtime.errors import ModelLoadError

    try:
        return LLM(device="cpu", max_model_len=256, enable_lora=True, max_loras=2,
                   max_lora_rank=RANK)
    except ModelLoadError as exc:  # the default model package is not installed
        pytest.skip(str(exc))


def test_chat_with_adapters(llm, tmp_path):
    from pagedrun import LoRARequest

    config = llm.engine.model_config
    zero = LoRARequest("zero", 1, write_adapter(tmp_path / "zero", config, 0.0, seed=1))
    strong = LoRARequest("strong", 2, write_adapter(tmp_path / "strong", config, 0.5, seed=2))
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    def answer(lora):
        return llm.chat(conversation, params, lora_request=lora)[0].outputs[0].token_ids

    base = answer(None)
    assert answer(zero) == base            # B = 0: the delta is exactly zero
    changed = answer(strong)
    assert changed != base                 # the adapter reaches the forward
    mixed = llm.chat([conversation] * 3, params, lora_request=[None, zero, strong])
    assert [list(o.outputs[0].token_ids) for o in mixed] == [list(base), list(base),
                                                             list(changed)]
