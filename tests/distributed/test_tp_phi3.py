"""Tensor parallelism over Phi-3's fused checkpoint tensors (runtime/families/phi3.py): a rank
reads its heads of q, k and v out of one qkv_proj and its features of gate and up out of one
gate_up_proj (runtime/distributed/sharding.py walks the tensor map part by part). That TP=2
gives one device's greedy tokens and logits is test_tp_families.py's phi3_tiny case."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from pagedrun.runtime.distributed.sharding import load_shard, shard_spec
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import load_model_weights

PHI3_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "phi3_tiny"
# The sharded forward differs from one device's by summation order only (partial sums over two
# ranks, then the all-reduce): at width 256 that moved logits of magnitude ~5 by 2.3e-5 at most
# here; a wrong shard (another head's rows, a missed offset into the fused tensor) moves them by
# whole units.
LOGITS_RTOL = 1e-5
LOGITS_ATOL = 1e-4


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("source", ["checkpoint", "in_memory"])
def test_fused_tensor_shards_are_the_ranks_heads_and_features(tp, source):
    """tp 2: each rank one KV head of 2; tp 4: KV heads replicated (rank r reads KV head
    r // 2). Every column-parallel part is the rank's rows of the one-device field, every
    row-parallel matrix its columns."""
    config = ModelConfig.from_model_dir(PHI3_DIR)
    full = load_model_weights(PHI3_DIR, config)
    hd, inter = config.head_dim, config.intermediate_size // tp
    for rank in range(tp):
        spec = shard_spec(config, tp, rank)
        shard = load_shard(PHI3_DIR if source == "checkpoint" else full, config, spec)
        q_rows = slice(spec.head_start * hd, (spec.head_start + spec.num_heads) * hd)
        kv_rows = slice(spec.kv_head_start * hd, (spec.kv_head_start + spec.num_kv_heads) * hd)
        features = slice(rank * inter, (rank + 1) * inter)
        assert spec.num_kv_heads == 1 and spec.kv_head_start == rank * 2 // tp
        for got, want in zip(shard.layers, full.layers):
            np.testing.assert_array_equal(got.q_proj, want.q_proj[q_rows])
            np.testing.assert_array_equal(got.k_proj, want.k_proj[kv_rows])
            np.testing.assert_array_equal(got.v_proj, want.v_proj[kv_rows])
            np.testing.assert_array_equal(got.gate_proj, want.gate_proj[features])
            np.testing.assert_array_equal(got.up_proj, want.up_proj[features])
            np.testing.assert_array_equal(got.o_proj, want.o_proj[:, q_rows])
            np.testing.assert_array_equal(got.down_proj, want.down_proj[:, features])
            np.testing.assert_array_equal(got.input_layernorm, want.input_layernorm)
