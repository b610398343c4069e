"""LoRAWeightStack: every device slot's adapter weights, stacked per layer and fused target.

    stack = LoRAWeightStack(rank_config, max_loras=4, max_lora_rank=16)
    stack.write_slot(slot, adapter)           # after AdapterCache.acquire gave `slot`
    lora_a, lora_b, starts = stack.module(layer_index, "qkv")

Per layer and target ("qkv", "o", "gate_up", "down"; MoE layers have no dense MLP targets):
    lora_a [max_loras, num_slices * max_lora_rank, in_features]
    lora_b [max_loras, out_features, max_lora_rank]
the layout runtime/lora/lora_ops.py and cuda/lora.cu take. An adapter of rank r < max_lora_rank
fills the first r rows of each slice's block of lora_a and the first r columns of lora_b; the
rest of its slot is zero, so it adds nothing (a target the adapter does not touch is all zero).
A slot is written only between steps, by whoever owns the device arrays (the model runner).

`xp` / `dtype`: numpy float32 for the cpu backend; a device backend passes its array module and
dtype (np.uint16 means bf16 bits, converted with runtime/weights.py's to_bf16_bits).
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.lora.adapter_weights import (FUSED_MODULES, LoRAAdapter, module_shapes,
                                                   slice_starts_of)
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import to_bf16_bits

_MLP_TARGETS = ("gate_up", "down")


class LoRAWeightStack:
    def __init__(self, config: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype=np.float32, xp=np, first_layer: int = 0) -> None:
        """config: the model's (a tensor-parallel rank's: sharding.rank_config) config;
        first_layer: a pipeline stage's first layer (config then counts the stage's layers;
        MoE layers are looked up by model-wide index)."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = np.dtype(dtype)
        self.xp = xp
        shapes = module_shapes(config)
        self.slice_starts = {name: slice_starts_of(sizes) for name, (_, sizes) in shapes.items()}
        self.layers: list[dict[str, tuple[object, object]]] = []
        for index in range(config.num_hidden_layers):
            targets = {}
            for name in FUSED_MODULES:
                if name in _MLP_TARGETS and config.is_moe_layer(first_layer + index):
                    continue
                in_features, sizes = shapes[name]
                targets[name] = (
                    xp.zeros((max_loras, len(sizes) * max_lora_rank, in_features), self.dtype),
                    xp.zeros((max_loras, sum(sizes), max_lora_rank), self.dtype))
            self.layers.append(targets)

    def module(self, layer: int, name: str):
        """(lora_a, lora_b, slice_starts) of one target, or None where the layer has none."""
        if name not in self.layers[layer]:
            return None
        lora_a, lora_b = self.layers[layer][name]
        return lora_a, lora_b, self.slice_starts[name]

    def _device(self, host: np.ndarray):
        values = to_bf16_bits(host) if self.dtype == np.uint16 else host.astype(self.dtype)
        return self.xp.asarray(values)

    def clear_slot(self, slot: int) -> None:
        for targets in self.layers:
            for lora_a, lora_b in targets.values():
                lora_a[slot] = 0
                lora_b[slot] = 0

    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` (already sharded for this rank) into device slot `slot`."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be in [0, {self.max_loras}), got {slot}")
        if adapter.max_rank > self.max_lora_rank:
            raise ValueError(f"adapter {adapter.lora_name!r} has rank {adapter.max_rank} > "
                             f"max_lora_rank {self.max_lora_rank}")
        if len(adapter.layers) != len(self.layers):
            raise ValueError(f"adapter {adapter.lora_name!r} has {len(adapter.layers)} layers, "
                             f"the model {len(self.layers)}")
        self.clear_slot(slot)
        width = self.max_lora_rank
        for index, (targets, modules) in enumerate(zip(self.layers, adapter.layers)):
            for name, module in modules.items():
                if name not in targets or module.slice_starts != self.slice_starts[name]:
                    raise ValueError(f"adapter {adapter.lora_name!r}: layer {index} {name} "
                                     f"does not fit this model's {name} (slices "
                                     f"{module.slice_starts} vs {self.slice_starts.get(name)})")
                lora_a, lora_b = targets[name]
                r = module.rank
                for i in range(module.num_slices):
                    lora_a[slot, i * width:i * width + r] = self._device(
                        module.a[i * r:(i + 1) * r])
                lora_b[slot, :, :r] = self._device(module.b)
