"""Reading a PEFT LoRA directory into our fused layout (adapter_weights.py), with checks.

    adapter = load_peft_adapter(LoRARequest("sql", 1, "/adapters/sql"), config, max_lora_rank=16)
    rank_adapter = load_peft_adapter(request, config, 16, shard=shard_spec(config, tp, rank))

A PEFT directory holds adapter_config.json and adapter_model.safetensors, whose tensors are
named `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`, A [r, in]
and B [out, r] (HF's [out, in] layout). Served: any subset of q/k/v/o/gate/up/down_proj, in any
subset of layers (layers_to_transform), ranks up to max_lora_rank (per module: the tensors'
shapes, which is what rank_pattern sets), scale lora_alpha / r or, with use_rslora,
lora_alpha / sqrt(r), alpha_pattern matched the way PEFT matches it (a key applies to module
name m when `re.match(rf"(.*\\.)?({key})$", m)`, first key in order wins).

Refused with a LoRALoadError naming the file and the reason: embed_tokens / lm_head targets
(embedding LoRA, extra vocabulary), modules_to_save, DoRA, LoRA biases, fan_in_fan_out, experts
of mixture-of-experts layers, other peft types, ranks above max_lora_rank, shapes that do not
fit the model, an A without its B.

Tensor parallel (`shard`, a runtime/distributed/sharding.py ShardSpec: read by field name, not
imported, so this module stays below the distributed layer): consistent with the base weights'
sharding. Column-parallel targets (qkv, gate_up) keep A whole and take the rank's output rows of
B (its q heads, KV heads, intermediate features); row-parallel ones (o, down) keep B whole and
take the rank's input columns of A, so each rank's LoRA output is a partial sum that rides on
the base output's all-reduce: sum_r B (A_r x_r) = B A x.
"""
from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np

from pagedrun.runtime.lora.adapter_files import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from pagedrun.runtime.lora.adapter_weights import (
    PROJECTION_SLICES,
    LoRAAdapter,
    LoRAModule,
    module_shapes,
    slice_starts_of,
)
from pagedrun.runtime.lora.errors import LoRALoadError
from pagedrun.runtime.lora.lora_request import LoRARequest
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import SafetensorsFile

PEFT_TYPE_LORA = "LORA"
PEFT_BIAS_NONE = "none"
# Which decoder sub-module each served projection lives in.
PROJECTION_GROUPS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                     "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
                     "down_proj": "mlp"}
UNSUPPORTED_TARGETS = {"embed_tokens": "embedding LoRA (embed_tokens)",
                       "lm_head": "LoRA on the LM head (lm_head)"}
# adapter_config.json options we cannot serve when set, and why.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed weights) is not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "target_parameters": "LoRA on raw parameters (target_parameters, e.g. MoE experts) is not "
                         "supported",
}
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def _unsupported_tensor_reason(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return "DoRA (lora_magnitude_vector) is not supported"
    if "modules_to_save" in name:
        return UNSUPPORTED_OPTIONS["modules_to_save"]
    if "embed_tokens" in name or "lora_embedding" in name:
        return f"{UNSUPPORTED_TARGETS['embed_tokens']} is not supported"
    if "lm_head" in name:
        return f"{UNSUPPORTED_TARGETS['lm_head']} is not supported"
    if ".experts." in name:
        return "LoRA on mixture-of-experts experts is not supported"
    if name.endswith(".bias"):
        return UNSUPPORTED_OPTIONS["lora_bias"]
    return ("unsupported tensor: only lora_A / lora_B of "
            f"{', '.join(PROJECTION_SLICES)} in model.layers.N are served")


def read_adapter_config(adapter_dir: pathlib.Path) -> dict:
    path = adapter_dir / ADAPTER_CONFIG_FILE
    if not adapter_dir.is_dir():
        raise LoRALoadError(adapter_dir, "no such LoRA adapter directory")
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoRALoadError(path, "missing: not a PEFT adapter directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRALoadError(path, f"not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRALoadError(path, "not a JSON object")
    return cfg


def check_adapter_config(cfg: dict, path: pathlib.Path) -> None:
    """Refuse what we cannot serve, before reading any tensor."""
    peft_type = cfg.get("peft_type", PEFT_TYPE_LORA)
    if peft_type != PEFT_TYPE_LORA:
        raise LoRALoadError(path, f"peft_type {peft_type!r} is not supported (only LORA)",
                            field="peft_type")
    for option, reason in UNSUPPORTED_OPTIONS.items():
        if cfg.get(option):
            raise LoRALoadError(path, reason, field=option)
    if cfg.get("bias", PEFT_BIAS_NONE) != PEFT_BIAS_NONE:
        raise LoRALoadError(path, f"bias {cfg['bias']!r}: trained base biases are not "
                            "supported (only 'none')", field="bias")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            if target in UNSUPPORTED_TARGETS:
                raise LoRALoadError(path, f"{UNSUPPORTED_TARGETS[target]} is not supported",
                                    field="target_modules")
            if target not in PROJECTION_SLICES:
                raise LoRALoadError(
                    path, f"unsupported target module {target!r}; supported: "
                    f"{', '.join(PROJECTION_SLICES)}", field="target_modules")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise LoRALoadError(path, f"lora_alpha must be a positive number, got {alpha!r}",
                            field="lora_alpha")
    if not isinstance(cfg.get("alpha_pattern") or {}, dict):
        raise LoRALoadError(path, "alpha_pattern must be an object", field="alpha_pattern")


def lora_scale(cfg: dict, module_name: str, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with use_rslora; alpha from
    the first alpha_pattern key matching `module_name` (e.g. model.layers.0.self_attn.q_proj)."""
    alpha = cfg["lora_alpha"]
    for key, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            alpha = value
            break
    return float(alpha) / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _read_pairs(weights_path: pathlib.Path, config: ModelConfig
                ) -> dict[tuple[int, str], dict[str, np.ndarray]]:
    """(layer, projection) -> {"A": [r, in], "B": [out, r]} float32, names checked."""
    if not weights_path.is_file():
        raise LoRALoadError(weights_path, "missing (only the safetensors format is read)")
    file = SafetensorsFile(weights_path)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name in file.tensors:
        match = _TENSOR_NAME.match(name)
        if match is None or PROJECTION_GROUPS.get(match.group(3)) != match.group(2):
            raise LoRALoadError(weights_path, _unsupported_tensor_reason(name), tensor=name)
        layer, _, proj, which = int(match.group(1)), *match.group(2, 3, 4)
        if layer >= config.num_hidden_layers:
            raise LoRALoadError(weights_path, f"layer {layer} past the model's "
                                f"{config.num_hidden_layers} layers", tensor=name)
        if PROJECTION_SLICES[proj][0] in ("gate_up", "down") and config.is_moe_layer(layer):
            raise LoRALoadError(weights_path, f"layer {layer} is a mixture-of-experts layer: "
                                "LoRA on its experts is not supported", tensor=name)
        pairs.setdefault((layer, proj), {})[which] = file.read(name, np.float32)
    return pairs


def load_peft_adapter(lora_request: LoRARequest, config: ModelConfig, max_lora_rank: int,
                      shard=None, layer_range: range | None = None) -> LoRAAdapter:
    """The adapter at lora_request.lora_path in our fused layout (for tensor-parallel rank
    `shard`, that rank's part); `config` is the full (unsharded) model's. `layer_range`: a pipeline
    stage's layers (model-wide indices; None: all): the result holds only those, in order,
    after every layer's tensors were checked (a bad tensor anywhere fails every stage's load
    alike)."""
    adapter_dir = pathlib.Path(lora_request.lora_path)
    cfg = read_adapter_config(adapter_dir)
    config_path = adapter_dir / ADAPTER_CONFIG_FILE
    check_adapter_config(cfg, config_path)
    weights_path = adapter_dir / ADAPTER_WEIGHTS_FILE
    pairs = _read_pairs(weights_path, config)
    if not pairs:
        raise LoRALoadError(weights_path, "holds no LoRA tensors")
    shapes = module_shapes(config)
    per_layer: list[dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]] = [
        {} for _ in range(config.num_hidden_layers)]
    for (layer, proj), pair in sorted(pairs.items()):
        tensor = f"model.layers.{layer}.{PROJECTION_GROUPS[proj]}.{proj}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRALoadError(weights_path, f"{missing} missing", tensor=tensor)
        a, b = pair["A"], pair["B"]
        module, index = PROJECTION_SLICES[proj]
        in_features, sizes = shapes[module]
        rank = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape != (
                sizes[index], rank):
            raise LoRALoadError(
                weights_path, f"lora_A {a.shape} / lora_B {b.shape} do not fit the model: "
                f"expected [r, {in_features}] / [{sizes[index]}, r]", tensor=tensor)
        if rank > max_lora_rank:
            raise LoRALoadError(weights_path, f"rank {rank} exceeds max_lora_rank "
                                f"{max_lora_rank}", tensor=tensor)
        scale = lora_scale(cfg, tensor, rank)
        per_layer[layer].setdefault(module, {})[index] = (a, b * np.float32(scale))
    if layer_range is not None:
        per_layer = per_layer[layer_range.start:layer_range.stop]
    layers = [{name: _fuse(slices, *shapes[name]) for name, slices in modules.items()}
              for modules in per_layer]
    adapter = LoRAAdapter(
        lora_int_id=lora_request.lora_int_id, lora_name=lora_request.lora_name,
        path=str(adapter_dir), layers=layers,
        info={"r": cfg.get("r"), "lora_alpha": cfg["lora_alpha"],
              "use_rslora": bool(cfg.get("use_rslora")),
              "target_modules": sorted({proj for _, proj in pairs})})
    return adapter if shard is None else shard_adapter(adapter, config, shard)


def _fuse(slices: dict[int, tuple[np.ndarray, np.ndarray]], in_features: int,
          sizes: tuple[int, ...]) -> LoRAModule:
    """Per-slice (A, scaled B) -> one LoRAModule; untargeted slices stay zero."""
    rank = max(a.shape[0] for a, _ in slices.values())
    starts = slice_starts_of(sizes)
    a_fused = np.zeros((len(sizes) * rank, in_features), np.float32)
    b_fused = np.zeros((starts[-1], rank), np.float32)
    for i, (a, b) in slices.items():
        r = a.shape[0]
        a_fused[i * rank:i * rank + r] = a
        b_fused[starts[i]:starts[i + 1], :r] = b
    return LoRAModule(a_fused, b_fused, starts)


def shard_adapter(adapter: LoRAAdapter, config: ModelConfig, shard) -> LoRAAdapter:
    """Tensor-parallel rank `shard`'s part of a full adapter (rules: the module docstring)."""
    hd = config.head_dim
    q_rows = np.arange(shard.head_start * hd, (shard.head_start + shard.num_heads) * hd)
    kv_rows = np.arange(shard.kv_head_start * hd,
                        (shard.kv_head_start + shard.num_kv_heads) * hd)
    inter_rows = np.arange(shard.inter_start, shard.inter_start + shard.inter_size)
    # Column-parallel targets: the rows of each slice of B this rank keeps (slice-relative).
    column_rows = {"qkv": (q_rows, kv_rows, kv_rows), "gate_up": (inter_rows, inter_rows)}
    row_cols = {"o": q_rows, "down": inter_rows}
    layers = []
    for modules in adapter.layers:
        sharded = {}
        for name, m in modules.items():
            if name in column_rows:
                rows = np.concatenate([m.slice_starts[i] + kept
                                       for i, kept in enumerate(column_rows[name])])
                sharded[name] = LoRAModule(
                    m.a.copy(), np.ascontiguousarray(m.b[rows]),
                    slice_starts_of([len(kept) for kept in column_rows[name]]))
            else:
                sharded[name] = LoRAModule(np.ascontiguousarray(m.a[:, row_cols[name]]),
                                           m.b.copy(), m.slice_starts)
        layers.append(sharded)
    return LoRAAdapter(adapter.lora_int_id, adapter.lora_name, adapter.path, layers,
                       dict(adapter.info, tp_rank=shard.rank, tp_size=shard.tp_size))


__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "load_peft_adapter", "lora_scale",
           "shard_adapter"]
