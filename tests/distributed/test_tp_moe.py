"""The tensor-parallel shard reader for mixture-of-experts layers: a rank's expert slices
(the replicated router, half of every expert's gate/up rows and down columns) concatenate to
the full experts, read from the per-expert checkpoint layout, from transformers 5's fused one
and from in-memory weights. (TP=2 == TP=1 end to end: test_tp_families.py.)"""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from pagedrun.runtime.distributed.sharding import load_shard, shard_spec
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import load_model_weights

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


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
