"""ShardedLlamaModel: one tensor-parallel rank's Llama forward (LlamaModel plus collectives).

Built from the rank's weights and config (sharding.py), so attention and MLP run unchanged on
the rank's heads and features; this class adds the three things that cross ranks:
- `embed`: a masked lookup into the rank's vocabulary slice (ids outside it read an appended
  zero row, so no masking op is needed on the device), then an all-reduce;
- `all_reduce`: after the row-parallel o_proj and down_proj (two per layer);
- `logits`: the rank's [rows, vocab/tp] slice of the LM head, gathered to rank 0, which
  concatenates in rank order and trims the padding; other ranks return their own slice (unused).
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.distributed.sharding import ShardSpec
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.models.llama import LlamaModel
from pagedrun.runtime.weights import ModelWeights


class ShardedLlamaModel(LlamaModel):
    def __init__(self, config: ModelConfig, weights: ModelWeights, ops, max_position: int,
                 spec: ShardSpec, comm, first_layer: int = 0) -> None:
        """config, weights: the rank's (sharding.rank_config / load_shard); comm: a Communicator
        whose arrays are host numpy (CpuCommunicator) or device arrays (`comm.device_arrays`),
        among the tensor-parallel ranks of this rank's pipeline stage. first_layer: as
        LlamaModel's (a pipeline stage's first layer)."""
        super().__init__(config, weights, ops, max_position, first_layer=first_layer)
        self.spec = spec
        self.comm = comm
        hidden = config.hidden_size
        if self.embed_tokens is not None:
            # Row spec.vocab_size is the zero row every id outside this rank's slice reads.
            self.embed_tokens = np.concatenate(
                [self.embed_tokens, np.zeros((1, hidden), np.float32)], axis=0)
        self._device_arrays = getattr(comm, "device_arrays", False)

    def embed(self, token_ids: np.ndarray):
        local = token_ids.astype(np.int64) - self.spec.vocab_start
        outside = (local < 0) | (local >= self.spec.num_real_vocab)
        local[outside] = self.spec.vocab_size
        return self.all_reduce(self.ops.embedding(local.astype(np.int32), self.embed_tokens))

    def all_reduce(self, x):
        if self._device_arrays:
            return self.comm.all_reduce(x)
        # Host communicator: the backend's arrays are numpy already (cpu, sim).
        return self.comm.all_reduce(np.asarray(x))

    def logits(self, x, residual):
        local = super().logits(x, residual)  # [rows, spec.vocab_size] float32
        parts = self.comm.gather(local if self._device_arrays else self.ops.to_host(local))
        if parts is None:
            return local
        xp = self.ops.xp if self._device_arrays else np
        return xp.concatenate(parts, axis=1)[:, :self.spec.full_vocab_size]
