"""Tensor parallel == one device for the mixture-of-experts fixtures (tests/fixtures/tiny/
mixtral_moe, qwen3_moe): TP=2 on the numpy backend gives TP=1's greedy tokens and logits.

A rank holds the replicated router and its half of every expert's intermediate features (gate
and up rows, down columns), so it routes every token exactly as one device does and its expert
output is a partial sum, all-reduced like the dense down_proj's; Qwen3-MoE's dense layer (layer
1, mlp_only_layers) is split as any dense MLP. The shard reader is also checked against the
full weights, from the per-expert checkpoint layout and from transformers 5's fused one."""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from pagedrun.runtime.distributed.sharding import load_shard, shard_spec
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import load_model_weights
from tp_helpers import greedy_run, make_engine, prompts

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
# Logits of the sharded forward differ from one device's only by float32 summation order.
LOGITS_RTOL = 1e-5
LOGITS_ATOL = 1e-5


@pytest.mark.parametrize("name", ["mixtral_moe", "qwen3_moe"])
def test_moe_tp2_matches_single_device(name):
    model_dir = TINY_DIR / name
    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    ps = prompts(vocab)
    kwargs = {"max_model_len": 128}
    ref_tokens, ref_logits = greedy_run(make_engine(str(model_dir), 1, **kwargs), ps, 8)
    engine = make_engine(str(model_dir), 2, **kwargs)
    try:
        tokens, logits = greedy_run(engine, ps, 8)
        assert engine.runner.dead is None
    finally:
        engine.close()
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits):
        assert got.shape == want.shape and got.shape[1] == vocab
        np.testing.assert_allclose(got, want, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)


def _fused_copy(src: pathlib.Path, dst: pathlib.Path, config: ModelConfig) -> None:
    """The checkpoint rewritten with transformers 5's fused expert tensors."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for i in config.moe_layers:
        prefix = f"model.layers.{i}.mlp.experts."
        gate_up, down = [], []
        for e in range(config.num_experts):
            gate_up.append(np.concatenate([tensors.pop(f"{prefix}{e}.gate_proj.weight"),
                                           tensors.pop(f"{prefix}{e}.up_proj.weight")]))
            down.append(tensors.pop(f"{prefix}{e}.down_proj.weight"))
        tensors[prefix + "gate_up_proj"] = np.stack(gate_up)
        tensors[prefix + "down_proj"] = np.stack(down)
    save_file(tensors, dst / "model.safetensors")


@pytest.mark.parametrize("layout", ["per_expert", "fused", "in_memory"])
def test_expert_shards_concatenate_to_the_full_experts(tmp_path, layout):
    src = TINY_DIR / "qwen3_moe"
    config = ModelConfig.from_model_dir(src)
    full = load_model_weights(src, config)
    source = src
    if layout == "fused":
        source = tmp_path / "fused"
        _fused_copy(src, source, config)
    elif layout == "in_memory":
        source = full
    parts = [load_shard(source, config, shard_spec(config, 2, rank)) for rank in range(2)]
    half = config.moe_intermediate_size // 2
    for i in config.moe_layers:
        want = full.layers[i]
        for part in parts:
            assert np.array_equal(part.layers[i].router, want.router)
            assert part.layers[i].gate_proj is None
        gate = np.concatenate([p.layers[i].experts_gate_up[:, :half] for p in parts], axis=1)
        up = np.concatenate([p.layers[i].experts_gate_up[:, half:] for p in parts], axis=1)
        assert np.array_equal(np.concatenate([gate, up], axis=1), want.experts_gate_up)
        assert np.array_equal(np.concatenate([p.layers[i].experts_down for p in parts], axis=2),
                              want.experts_down)
    assert parts[0].config.moe_intermediate_size == half
    assert np.array_equal(np.concatenate([p.layers[1].gate_proj for p in parts]),
                          full.layers[1].gate_proj)
