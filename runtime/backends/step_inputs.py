"""StepInputs: one step's metadata as the forward's layers take it, uploaded once per step.

    step = backend.step_inputs(positions, slot_mapping, attn)     # in ModelRunner.execute
    model.forward(token_ids, step.positions, step.slot_mapping, step.attn, k_caches, v_caches)

Every layer's rotary/cache-write and attention read the same positions, slot_mapping, block
tables, context lengths and query_start_loc. On the kernel backends (sim, cuda) each of them is
a DeviceInts -- the host int32 array (for the few host-side scalars a launch needs, such as the
longest context) with its device copy -- made once here, so a step uploads its metadata once,
not once per layer. The numpy backend keeps the plain host arrays (nothing to upload).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the model imports nothing from backends; keep it that way
    from pagedrun.runtime.models.llama import AttentionInputs


class DeviceInts:
    """An int32 host array and its device copy (a numpy array under the harness, cupy on a GPU).

    host: C-contiguous int32 numpy array; device: the same values in the backend's array module.
    """

    __slots__ = ("host", "device")

    def __init__(self, host: np.ndarray, device) -> None:
        self.host = host
        self.device = device

    @property
    def shape(self) -> tuple[int, ...]:
        return self.host.shape


@dataclass
class StepInputs:
    """positions, slot_mapping: [num_tokens] int32 (host arrays or DeviceInts); attn: the step's
    AttentionInputs, with its int32 arrays as DeviceInts on the kernel backends."""

    positions: np.ndarray | DeviceInts
    slot_mapping: np.ndarray | DeviceInts
    attn: AttentionInputs


def upload_step(to_device, positions: np.ndarray, slot_mapping: np.ndarray,
                attn: AttentionInputs, upload_rows=None) -> StepInputs:
    """StepInputs with every int32 array paired with `to_device(host)`, called once per array.

    upload_rows: optional callable for token-row index arrays (the non-contiguous decode /
    prefill rows of a mixed step), so layers index device activations with a device index.
    """
    def pair(a) -> DeviceInts:
        host = np.ascontiguousarray(a, dtype=np.int32)
        return DeviceInts(host, to_device(host))

    def rows(r):
        return r if isinstance(r, slice) or upload_rows is None else upload_rows(r)

    # Only the kinds of rows the step has: the other kind's (empty) arrays are never read.
    if attn.num_decode:
        attn = replace(attn, decode_token_rows=rows(attn.decode_token_rows),
                       decode_block_tables=pair(attn.decode_block_tables),
                       decode_context_lens=pair(attn.decode_context_lens))
    if attn.num_prefill:
        attn = replace(attn, prefill_token_rows=rows(attn.prefill_token_rows),
                       prefill_block_tables=pair(attn.prefill_block_tables),
                       prefill_query_start_loc=pair(attn.prefill_query_start_loc),
                       prefill_context_lens=pair(attn.prefill_context_lens))
    return StepInputs(pair(positions), pair(slot_mapping), attn)
