"""Phi-3 (`Phi3ForCausalLM`, model_type `phi3`): the Llama layer and forward, with q/k/v stored
as one `qkv_proj` [q_size + 2 * kv_size, hidden] and gate/up as one `gate_up_proj`
[2 * intermediate, hidden] in the checkpoint, and (Phi-3 mini) a sliding window over every
layer, as Mistral's. The fused tensors are only a storage difference: the tensor map splits them
into the q/k/v and gate/up fields (and a tensor-parallel rank reads its heads of each).

Refused: a partial rotary embedding (`partial_rotary_factor` < 1, Phi-4-mini) and the 128k
models' `longrope` scaling (ModelConfig's rope reader names the type).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedrun.runtime.families.base import (
    COLUMN,
    DIM_HIDDEN,
    DIM_INTER,
    DIM_KV,
    DIM_Q,
    GATE_UP,
    LLAMA_FORWARD,
    LLAMA_TENSORS,
    QKV,
    Architecture,
    FamilyFields,
    Part,
    TensorEntry,
)

if TYPE_CHECKING:
    from pagedrun.runtime.model_config import FieldReader

_ATTN, _MLP = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
PHI3_TENSORS = LLAMA_TENSORS.fusing(
    (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
    TensorEntry(_ATTN + "qkv_proj.weight",
                (Part("q_proj", DIM_Q), Part("k_proj", DIM_KV), Part("v_proj", DIM_KV)),
                QKV, COLUMN, DIM_HIDDEN),
).fusing(
    (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"),
    TensorEntry(_MLP + "gate_up_proj.weight",
                (Part("gate_proj", DIM_INTER), Part("up_proj", DIM_INTER)),
                GATE_UP, COLUMN, DIM_HIDDEN, when="dense_mlp"),
)


def _phi3_fields(reader: "FieldReader") -> FamilyFields:
    """No biases; an optional sliding window over the whole stack; full rotary only."""
    params = reader.optional("rope_parameters", dict, None) or {}
    for field, factor in (("partial_rotary_factor",
                           reader.optional("partial_rotary_factor", float, None)),
                          ("rope_parameters.partial_rotary_factor",
                           params.get("partial_rotary_factor"))):
        if factor is not None and factor != 1.0:
            raise reader.error(field, f"partial rotary embedding ({factor}) is not supported")
    window = reader.optional("sliding_window", int, None)
    if window is not None and window <= 0:
        raise reader.error("sliding_window", f"must be positive, got {window}")
    return FamilyFields(sliding_window=window)


PHI3 = Architecture("Phi3ForCausalLM", "phi3", LLAMA_FORWARD, _phi3_fields, PHI3_TENSORS)
