"""The wire format of one step, driver -> tensor-parallel workers: what a rank needs of a
SchedulerOutput to run the forward (and the step's block moves) exactly as rank 0 does.

Frames: [b"step", header (msgpack: seq, num_batched_tokens, prompt_logit_rows, per array its
name, dtype and shape), one frame per array (raw bytes, sent without a copy)]. Only the fields
the runner reads travel; the request ids, the sampling bookkeeping and the prefix-cache counts
stay with the scheduler on the driver. A decode step of 256 sequences with 128-block tables is
about 140 KB, mostly the block table (benchmarks/bench_step_broadcast.py measures the cost).

Pipeline parallelism adds `virtual_engine` to the header (whose KV pools the step uses).

Multi-LoRA adds two header fields: `lora_writes`, the device slots to fill before this step's
forward ([slot, lora_name, lora_int_id, lora_path] each: every rank loads its own shard of the
adapter from lora_path), and `row_lora_slots`, each row's adapter slot (-1: none) or None when no
row has one.

On the wire the executor seals these frames per worker (auth.Channel: one more frame, a counter
and an HMAC over the frames' SHA-256, computed once per step); the worker opens them before
`decode_step`, so only steps from the driver it authenticated run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np

STEP = b"step"
# SchedulerOutput fields ModelRunner.execute reads, in wire order.
STEP_ARRAYS = ("input_token_ids", "positions", "slot_mapping", "query_start_loc", "query_lens",
               "context_lens", "block_tables", "sample_mask", "block_copies", "swap_out",
               "swap_in")


@dataclass
class StepInputs:
    """A worker's view of one step: the SchedulerOutput fields ModelRunner.execute reads
    (same names, shapes and dtypes as pagedrun.pyx.scheduler.SchedulerOutput)."""

    seq: int
    num_batched_tokens: int
    prompt_logit_rows: tuple[int, ...]
    input_token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    sample_mask: np.ndarray
    block_copies: np.ndarray
    swap_out: np.ndarray
    swap_in: np.ndarray
    lora_writes: list = field(default_factory=list)   # [[slot, name, id, path], ...]
    row_lora_slots: np.ndarray | None = None          # int32 [num_reqs], -1: no adapter
    # int32 [num_reqs] drafts verified per row (speculative decoding); None: none this step
    num_draft_tokens: np.ndarray | None = None
    virtual_engine: int = 0  # pipeline parallelism: whose KV pools (pipeline.py)


def encode_step(seq: int, out, prompt_logit_rows: tuple[int, ...], lora_writes=(),
                row_lora_slots=None, virtual_engine: int = 0) -> list:
    """Frames of one step; `out` is a SchedulerOutput (or a StepInputs). lora_writes:
    [(slot, LoRARequest)]; row_lora_slots: int [num_reqs] or None; virtual_engine: the
    pipeline's batch slot whose KV pools the step uses (0 without pipelining)."""
    arrays = [np.ascontiguousarray(getattr(out, name)) for name in STEP_ARRAYS]
    header = {"seq": seq, "num_batched_tokens": int(out.num_batched_tokens),
              "prompt_logit_rows": [int(r) for r in prompt_logit_rows],
              "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
              "lora_writes": [[int(slot), r.lora_name, r.lora_int_id, r.lora_path]
                              for slot, r in lora_writes],
              "row_lora_slots": (None if row_lora_slots is None
                                 else [int(s) for s in row_lora_slots]),
              "num_draft_tokens": _draft_counts(out), "virtual_engine": int(virtual_engine)}
    return [STEP, msgpack.packb(header), *arrays]


def _draft_counts(out) -> list[int] | None:
    """The step's per-row draft counts, or None when no row verifies drafts."""
    counts = getattr(out, "num_draft_tokens", None)
    if counts is None or not np.any(counts):
        return None
    return [int(c) for c in counts]


def decode_step(frames: list) -> StepInputs:
    """frames: what encode_step produced (bytes or zmq.Frame), the leading b"step" included."""
    def buf(f):
        return f.buffer if hasattr(f, "buffer") else f

    header = msgpack.unpackb(bytes(buf(frames[1])))
    arrays = {name: np.frombuffer(buf(f), dtype=dtype).reshape(shape)
              for name, (dtype, shape), f in zip(STEP_ARRAYS, header["arrays"], frames[2:])}
    slots = header.get("row_lora_slots")
    drafts = header.get("num_draft_tokens")
    return StepInputs(seq=header["seq"], num_batched_tokens=header["num_batched_tokens"],
                      prompt_logit_rows=tuple(header["prompt_logit_rows"]), **arrays,
                      lora_writes=header.get("lora_writes", []),
                      row_lora_slots=None if slots is None else np.asarray(slots, np.int32),
                      num_draft_tokens=None if drafts is None else np.asarray(drafts, np.int32),
                      virtual_engine=header.get("virtual_engine", 0))
