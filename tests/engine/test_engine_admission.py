"""Admission: KV capacity stated up front, clear errors for requests that can never run, devices,
and the offline LLM API over a model directory written to disk."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from engine_helpers import TINY_VOCAB, backend_of, greedy, make_engine, reference_greedy
from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.engine import RequestError
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.errors import PagedRunError
from pagedrun.runtime.model_runner import kv_bytes_per_block
from pagedrun.runtime.sampling_params import SamplingParams


def test_capacity_logged_and_reported(tiny_model, caplog):
    with caplog.at_level(logging.INFO, logger="pagedrun.engine"):
        engine = make_engine(tiny_model, block_size=16, num_kv_blocks=100, max_model_len=320)
    info = engine.model_info()
    assert info["num_kv_blocks"] == 100
    assert info["kv_capacity_tokens"] == 1600
    assert info["max_concurrency_at_max_len"] == pytest.approx(100 / 20)
    message = caplog.text
    assert "100 blocks" in message and "1600 tokens" in message and "5.00" in message


def test_kv_blocks_derived_from_memory_budget(tiny_model):
    # The block bytes of the backend's KV dtype (cpu-bf16: bf16 bits, half of float32's).
    backend = make_backend(**backend_of(tiny_model).engine_kwargs)
    per_block = kv_bytes_per_block(tiny_model[0], 16, backend.kv_dtype)
    engine = make_engine(tiny_model, block_size=16, max_model_len=512,
                         kv_cache_memory_bytes=37 * per_block + per_block // 2)
    assert engine.model_info()["num_kv_blocks"] == 37


def test_rejections(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=8, max_model_len=200)

    def code_of(**kwargs) -> str:
        kwargs.setdefault("sampling_params", greedy(4))
        with pytest.raises(RequestError) as info:
            engine.add_request(kwargs.pop("request_id", "x"), **kwargs)
        return info.value.code

    assert code_of(prompt_token_ids=list(range(3, 204))) == "prompt_too_long"
    # 150 prompt tokens + 50 new need 13 blocks of 16; the whole pool has 8.
    assert code_of(prompt_token_ids=[5] * 150, sampling_params=greedy(50)) == "capacity"
    assert code_of(prompt_token_ids=[]) == "empty_prompt"
    assert code_of(prompt_token_ids=[TINY_VOCAB]) == "invalid_request"
    assert code_of(prompt="text but no tokenizer") == "invalid_request"
    assert code_of(prompt_token_ids=[5], sampling_params=greedy(4, stop=["x"])) == "invalid_request"
    assert code_of(prompt_token_ids=[5], prompt="both") == "invalid_request"
    engine.add_request("dup", prompt_token_ids=[5, 6], sampling_params=greedy(2))
    assert code_of(request_id="dup", prompt_token_ids=[5]) == "duplicate_request_id"
    # Nothing of a refused request was admitted: only "dup" runs.
    assert engine.get_stats()["num_requests_waiting"] + engine.get_stats()[
        "num_requests_running"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    # Exactly fitting the pool is fine: 8 blocks = 128 tokens = 120 prompt + 8 new; one more is not.
    assert code_of(prompt_token_ids=[7] * 120, sampling_params=greedy(9)) == "capacity"
    engine.add_request("fits", prompt_token_ids=[7] * 120, sampling_params=greedy(8))
    while engine.has_unfinished_requests():
        engine.step()


def test_devices(tiny_cpu_model):
    # "sim" runs the CUDA kernels on the CPU harness (tests/engine/test_sim_backend.py);
    # tiny_cpu_model's head_dim 16 has no attention kernel, refused at construction.
    with pytest.raises(UnsupportedKernelShape, match="head_dim"):
        make_engine(tiny_cpu_model, device="sim", num_kv_blocks=8)
    with pytest.raises(NotImplementedError):
        make_engine(tiny_cpu_model, device="cuda", num_kv_blocks=8)
    assert make_engine(tiny_cpu_model, device="auto", num_kv_blocks=8).device == "cpu"
    # Tensor parallel ranks load their shards from a directory (tests/distributed cover TP).
    with pytest.raises(PagedRunError, match="model directory"):
        make_engine(tiny_cpu_model, num_kv_blocks=8, tensor_parallel_size=2)


def _save_hf_dir(path, config, weights) -> None:
    from safetensors.numpy import save_file

    tensors = {"model.embed_tokens.weight": weights.embed_tokens, "model.norm.weight": weights.norm,
               "lm_head.weight": weights.lm_head}
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = getattr(layer, name)
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[p + f"mlp.{name}.weight"] = getattr(layer, name)
        tensors[p + "input_layernorm.weight"] = layer.input_layernorm
        tensors[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1}))


def test_offline_llm_from_model_dir(tiny_cpu_model, tmp_path):
    from pagedrun import LLM

    _save_hf_dir(tmp_path, *tiny_cpu_model)
    llm = LLM(model=str(tmp_path), device="cpu", block_size=8, max_model_len=256,
              num_kv_blocks=64, max_num_batched_tokens=32)
    prompts = [[5, 6, 7], list(range(10, 80)), [300] * 3]
    params = [greedy(6), greedy(3), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4,
                                                    ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert outs[0].outputs[0].token_ids == reference_greedy(tiny_cpu_model, prompts[0], 6)
    assert outs[1].outputs[0].token_ids == reference_greedy(tiny_cpu_model, prompts[1], 3)
    assert [c.index for c in outs[2].outputs] == [0, 1]
    assert all(o.finished for o in outs)
    # One prompt as a flat token list is one request.
    (single,) = llm.generate(prompts[0], greedy(2))
    assert single.outputs[0].token_ids == reference_greedy(tiny_cpu_model, prompts[0], 2)
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 64
    assert math.isclose(llm.engine.model_info()["max_concurrency_at_max_len"], 64 / 32)
    with pytest.raises(RequestError):
        llm.generate([[5], []], greedy(2))  # all or nothing
    assert not llm.engine.has_unfinished_requests()


def test_engine_config_validates():
    with pytest.raises(ValueError):
        EngineConfig(block_size=12)


def test_queue_time_is_arrival_to_first_scheduled_step(tiny_cpu_model):
    """RequestOutput.first_scheduled_time / queue_time (vLLM's request_queue_time_seconds):
    with max_num_seqs 1 the second request waits for the whole first one."""
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=[5, 6, 7], sampling_params=params, arrival_time=0.0)
    engine.add_request("b", prompt_token_ids=[8, 9], sampling_params=params, arrival_time=0.0)
    first_seen: dict[str, float] = {}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.first_scheduled_time is not None:
                first_seen.setdefault(out.request_id, out.first_scheduled_time)
            if out.finished:
                finished[out.request_id] = out
    a, b = finished["a"], finished["b"]
    assert a.queue_time == a.first_scheduled_time - a.arrival_time > 0
    # b is scheduled only after a has finished: after a's first token and a's finish step.
    assert b.first_scheduled_time >= a.first_token_time
    assert first_seen == {"a": a.first_scheduled_time, "b": b.first_scheduled_time}
