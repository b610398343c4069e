"""One adapter's weights in the layout of our fused projections, and its dense merge.

The model fuses q/k/v into one QKV matrix and gate/up into one gate-up matrix (runtime/models/
llama.py), so a layer has four LoRA targets, FUSED_MODULES: "qkv", "o", "gate_up", "down". A
fused target is a list of slices (q, k, v / gate, up / a single one), each with its own PEFT
pair A_i [r_i, in], B_i [out_i, r_i]. A LoRAModule keeps them as

    a: [num_slices * rank, in]   slice i's A in rows [i * rank, i * rank + r_i), zeros after
    b: [out, rank]               slice i's output rows [slice_starts[i], slice_starts[i + 1]),
                                 scale_i * B_i in columns [0, r_i), zeros after

with `rank` the largest r_i of the target. Then, for output column o of slice i,

    delta_W[o, :] = b[o, :] @ a[i * rank:(i + 1) * rank, :]

which is scale_i * B_i @ A_i for each slice: the same delta as PEFT's merge. The scale
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) is folded into b at load, so per-slice
ranks and alpha patterns need nothing at run time. This compact layout (not a block-diagonal
[out, num_slices * rank] B) is what the slot stacks and the kernels take: expand reads only
its own slice's rank columns.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import ModelWeights

FUSED_MODULES = ("qkv", "o", "gate_up", "down")
# HF projection -> (fused target, slice index within it).
PROJECTION_SLICES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# Fused target -> the LayerWeights fields of its slices, in slice order.
MODULE_PROJECTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Fused target -> (in_features, slice output sizes) for a (rank's) config."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv": (hidden, (config.q_size, config.kv_size, config.kv_size)),
        "o": (config.q_size, (hidden,)),
        "gate_up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }


def slice_starts_of(sizes) -> tuple[int, ...]:
    """Output column boundaries of slices of these sizes: (0, s0, s0 + s1, ...)."""
    return tuple(int(v) for v in np.concatenate([[0], np.cumsum(sizes)]))


@dataclass
class LoRAModule:
    """One fused target of one layer (layout: the module docstring)."""

    a: np.ndarray                   # [num_slices * rank, in] float32
    b: np.ndarray                   # [out, rank] float32, scale folded in
    slice_starts: tuple[int, ...]   # num_slices + 1 output column boundaries

    @property
    def num_slices(self) -> int:
        return len(self.slice_starts) - 1

    @property
    def rank(self) -> int:
        return self.b.shape[1]

    def delta(self) -> np.ndarray:
        """The dense [out, in] float64 weight delta this module adds (scale included)."""
        out = np.zeros((self.b.shape[0], self.a.shape[1]), np.float64)
        r = self.rank
        for i in range(self.num_slices):
            rows = slice(self.slice_starts[i], self.slice_starts[i + 1])
            out[rows] = self.b[rows].astype(np.float64) @ self.a[i * r:(i + 1) * r].astype(
                np.float64)
        return out


@dataclass
class LoRAAdapter:
    """A loaded adapter: per layer, the fused targets it touches (absent ones add nothing)."""

    lora_int_id: int
    lora_name: str
    path: str
    layers: list[dict[str, LoRAModule]]
    # The adapter_config.json fields that decided the scales, kept for model info and errors.
    info: dict = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max((m.rank for layer in self.layers for m in layer.values()), default=0)

    def host_bytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for layer in self.layers for m in layer.values())


def merged_weights(base: ModelWeights, adapter: LoRAAdapter) -> ModelWeights:
    """The dense reference of an adapter: W + scale * B @ A in every targeted projection (new
    arrays; `base` is unchanged). Used by tests and by the dense oracle (runtime/reference.py)
    to check a LoRA forward against a plain one."""
    layers = []
    for lw, modules in zip(base.layers, adapter.layers):
        changes = {}
        for name, module in modules.items():
            delta = module.delta()
            for i, proj in enumerate(MODULE_PROJECTIONS[name]):
                rows = slice(module.slice_starts[i], module.slice_starts[i + 1])
                weight = getattr(lw, proj)
                changes[proj] = (weight.astype(np.float64) + delta[rows]).astype(weight.dtype)
        layers.append(dataclasses.replace(lw, **changes) if changes else lw)
    return dataclasses.replace(base, layers=layers)

