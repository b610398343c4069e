"""TensorParallel: one tensor-parallel rank's collectives, given to the model it runs.

The model (runtime/models/llama.py) is built from the rank's config and weights
(sharding.rank_config / load_shard), so attention and MLP run unchanged on the rank's heads and
features; it calls this object where ranks meet (runtime/models/tensor_parallel.py lists the
calls):
- the embedding: a masked lookup into the rank's vocabulary slice (ids outside it read an
  appended zero row, so no masking op is needed on the device), then an all-reduce;
- `all_reduce`: after the row-parallel o_proj and down_proj (two per layer);
- `gather_logits`: the rank's [rows, vocab/tp] slice of the LM head, gathered to rank 0, which
  concatenates in rank order and trims the padding; other ranks return their own slice (unused).
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.distributed.sharding import ShardSpec


class TensorParallel:
    single_device = False

    def __init__(self, spec: ShardSpec, comm, ops) -> None:
        """spec: this rank's shard plan (sharding.shard_spec); comm: a Communicator whose
        arrays are host numpy (CpuCommunicator) or device arrays (`comm.device_arrays`), among
        the tensor-parallel ranks of this rank's pipeline stage; ops: the rank's backend."""
        self.spec = spec
        self.comm = comm
        self.ops = ops
        self._device_arrays = getattr(comm, "device_arrays", False)

    def embedding_table(self, table):
        """The rank's [vocab/tp, hidden] table plus row spec.vocab_size: the zero row every id
        outside this rank's slice reads."""
        if table is None:
            return None
        return np.concatenate([table, np.zeros((1, table.shape[1]), np.float32)], axis=0)

    def local_token_ids(self, token_ids):
        """token_ids: [num_tokens] int32 on the host, or the step's device copy (`.device` of
        a DeviceInts: a decode graph's static buffer, runtime/decode_graphs.py), which is
        masked where it is, so that a captured graph re-reads it on every replay."""
        if hasattr(token_ids, "host"):  # DeviceInts
            ids = token_ids.device
            return (self._local_ids(ids) if self._device_arrays
                    else self._host_step(self._local_ids, ids))
        return self._local_ids(token_ids)

    def _local_ids(self, ids):
        """Global token ids -> rows of this rank's table; ids outside its slice read the zero
        row spec.vocab_size (elementwise ops: on a device they run there)."""
        xp = np if isinstance(ids, np.ndarray) else self.ops.xp
        local = ids.astype(xp.int64) - self.spec.vocab_start
        outside = (local < 0) | (local >= self.spec.num_real_vocab)
        return xp.where(outside, self.spec.vocab_size, local).astype(xp.int32)

    def _host_step(self, fn, *args):
        """fn(*args) on the host, as a step of a decode graph being captured on the backend
        (KernelBackend.host_call; the numpy backends have no graphs: a plain call)."""
        host_call = getattr(self.ops, "host_call", None)
        return fn(*args) if host_call is None else host_call(fn, *args)

    def all_reduce(self, x):
        if self._device_arrays:
            return self.comm.all_reduce(x)
        # Host communicator: the backend's arrays are numpy already (cpu, sim).
        return self._host_step(self.comm.all_reduce, np.asarray(x))

    def gather_logits(self, local):
        """local: [rows, spec.vocab_size] float32 -> rank 0: [rows, full vocab]."""
        if not self._device_arrays:
            return self._host_step(self._gather_host, local)
        parts = self.comm.gather(local)
        if parts is None:
            return local
        return self.ops.xp.concatenate(parts, axis=1)[:, :self.spec.full_vocab_size]

    def _gather_host(self, local):
        """Rank 0: every rank's logits slice, concatenated and trimmed to the vocabulary; the
        other ranks: a copy of their own slice (unused)."""
        parts = self.comm.gather(self.ops.to_host(local))
        if parts is None:
            return np.array(local)
        return np.concatenate(parts, axis=1)[:, :self.spec.full_vocab_size]
