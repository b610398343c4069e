"""What a forward asks of tensor parallelism, and the single-device answer.

A model is given its tensor parallelism (`tp=`) instead of being subclassed for it. The forward
calls it at the three places where ranks meet:
- `local_token_ids(ids)`: the rows of the rank's embedding table the step's tokens read (with
  `embedding_table(table)` preparing that table once at build);
- `all_reduce(x)`: after the embedding lookup and after each row-parallel GEMM (o_proj,
  down_proj or the experts), where a rank's output is a partial sum;
- `gather_logits(local)`: the rank's vocabulary slice of the LM head's logits, gathered.
The many-rank implementation is runtime/distributed/tensor_parallel.py (a shard plan and a
communicator); `SINGLE_DEVICE` here is the identity, so a one-device model runs no collective
and its backend may compile the whole decode step (`single_device`).
"""
from __future__ import annotations


class SingleDevice:
    """Tensor parallelism over one rank: every call gives its input back."""

    single_device = True

    def embedding_table(self, table):
        return table

    def local_token_ids(self, token_ids):
        return token_ids

    def all_reduce(self, x):
        return x

    def gather_logits(self, local):
        return local


SINGLE_DEVICE = SingleDevice()
