"""sharding.py: the rank slices put back together are the full tensors (column-parallel along
`out`, row-parallel along `in`, vocab rows padded on the last rank, replicated KV heads the ones
each rank's query heads read); a rank reads only its slices from the safetensors file (no read
returns more than its share of a sharded tensor); and its weights are ~1/tp of the model."""
from __future__ import annotations

import numpy as np
import pytest

from tp_helpers import write_model_dir

from pagedrun.runtime.distributed import sharding
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import SafetensorsFile, load_model_weights


@pytest.mark.parametrize("tp,kv_heads,vocab", [(2, 2, 389), (4, 2, 389), (4, 4, 400),
                                               (4, 1, 391)])
def test_shards_reassemble_to_the_model(tmp_path, tp, kv_heads, vocab):
    model_dir = write_model_dir(tmp_path / "m", vocab_size=vocab, num_key_value_heads=kv_heads,
                                attention_bias=True)
    config = ModelConfig.from_model_dir(model_dir)
    full = load_model_weights(model_dir, config)
    specs = [sharding.shard_spec(config, tp, r) for r in range(tp)]
    shards = [sharding.load_shard(model_dir, config, s) for s in specs]
    hd = config.head_dim
    for i, layer in enumerate(full.layers):
        parts = [s.layers[i] for s in shards]
        assert np.array_equal(np.concatenate([p.q_proj for p in parts]), layer.q_proj)
        assert np.array_equal(np.concatenate([p.q_bias for p in parts]), layer.q_bias)
        assert np.array_equal(np.concatenate([p.o_proj for p in parts], axis=1), layer.o_proj)
        assert np.array_equal(np.concatenate([p.gate_proj for p in parts]), layer.gate_proj)
        assert np.array_equal(np.concatenate([p.down_proj for p in parts], axis=1),
                              layer.down_proj)
        assert np.array_equal(parts[0].o_bias, layer.o_bias)
        assert all(p.o_bias is None for p in parts[1:])  # added once
        for spec, p in zip(specs, parts):
            # Each query head h of the rank reads KV head h // (H / KV) of the full model.
            group = config.num_attention_heads // config.num_key_value_heads
            for local_h in range(spec.num_heads):
                kv = (spec.head_start + local_h) // group
                local_kv = local_h // (spec.num_heads // spec.num_kv_heads)
                assert np.array_equal(p.k_proj[local_kv * hd:(local_kv + 1) * hd],
                                      layer.k_proj[kv * hd:(kv + 1) * hd])
                assert np.array_equal(p.v_bias[local_kv * hd:(local_kv + 1) * hd],
                                      layer.v_bias[kv * hd:(kv + 1) * hd])
    embed = np.concatenate([s.embed_tokens for s in shards])
    assert embed.shape[0] == specs[0].vocab_size * tp >= vocab
    assert np.array_equal(embed[:vocab], full.embed_tokens)
    assert not embed[vocab:].any()  # padding rows are zero
    assert np.array_equal(np.concatenate([s.lm_head for s in shards])[:vocab], full.lm_head)


def test_rank_reads_only_its_slices(tmp_path, monkeypatch):
    tp = 4
    model_dir = write_model_dir(tmp_path / "m", vocab_size=389, num_key_value_heads=4,
                                intermediate_size=128)
    config = ModelConfig.from_model_dir(model_dir)
    reads = []
    original = SafetensorsFile.read

    def recording_read(self, name, dtype, index=None):
        out = original(self, name, dtype, index)
        shape = self.tensors[name].shape
        share = -(-shape[0] // tp) * int(np.prod(shape[1:]))  # rows rounded up (vocab padding)
        reads.append((name, out.size, int(np.prod(shape)), share))
        return out

    monkeypatch.setattr(SafetensorsFile, "read", recording_read)
    shard = sharding.load_shard(model_dir, config, sharding.shard_spec(config, tp, 2))
    for name, got, whole, share in reads:
        if "norm" in name:
            assert got == whole  # replicated
        else:
            assert got <= share, name
    rank_bytes = sum(a.nbytes for a in _arrays(shard))
    full_bytes = sum(whole * 4 for _, _, whole, _ in reads)
    norm_bytes = sum(whole * 4 for name, _, whole, _ in reads if "norm" in name)
    assert rank_bytes <= (full_bytes - norm_bytes) / tp * 1.02 + norm_bytes


def _arrays(weights):
    yield weights.embed_tokens
    yield weights.lm_head
    yield weights.norm
    for layer in weights.layers:
        for value in vars(layer).values():
            if value is not None:
                yield value


def test_rank_config_and_capacity():
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048})
    spec = sharding.shard_spec(config, 3, 1)
    local = sharding.rank_config(config, spec)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size,
            local.vocab_size) == (3, 1, 512, 16384)
    assert (spec.head_start, spec.kv_head_start, spec.vocab_start) == (3, 1, 16384)
    with pytest.raises(sharding.TensorParallelConfigError, match="num_attention_heads 9"):
        sharding.check_shardable(config, 2)
