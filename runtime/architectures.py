"""The model registry's config side: every architecture we serve, what its `config.json` means
for the forward, and which forward runs it.

One `Architecture` per Hugging Face `architectures` entry. It owns what differs between
families in config.json (biases, sliding window, QK-norm, a default head_dim) as a function that
turns the family's fields into `FamilyFields`; `ModelConfig.from_dict` reads everything the
families share and asks the registry for the rest. `forward` names the model class that runs it
in `runtime/models/registry.py` (this module is below the model layer and cannot import it);
a test checks that every name resolves.

Adding a family: one `Architecture` here (plus a forward module under runtime/models/ when the
Llama forward cannot express it) and its tests. Anything a family's config asks for that we
cannot run exactly is a `ModelLoadError` naming the field, never a silently different model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model_config import FieldReader

# The forward of the Llama family (runtime/models/llama.py): RMSNorm, rotary grouped-query
# attention (optional q/k/v/o biases, sliding window, per-head q/k RMSNorm), SwiGLU MLP.
LLAMA_FORWARD = "llama"
FULL_ATTENTION_LAYER = "full_attention"


@dataclass(frozen=True)
class FamilyFields:
    """The ModelConfig fields a family decides (see ModelConfig for their meaning)."""

    attention_bias: bool = False
    o_proj_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False


@dataclass(frozen=True)
class Architecture:
    name: str        # config.json "architectures" entry, e.g. "Qwen3ForCausalLM"
    model_type: str  # config.json "model_type"; names the architecture when that list is absent
    forward: str     # key of the model class in runtime/models/registry.py
    read_fields: Callable[["FieldReader"], FamilyFields]
    # head_dim when config.json has none: None = hidden_size / num_attention_heads (transformers'
    # fallback); Qwen3's config class defaults it to 128 instead.
    default_head_dim: int | None = None


def _llama_fields(reader: "FieldReader") -> FamilyFields:
    """Llama: q/k/v/o biases together when `attention_bias`."""
    bias = reader.optional("attention_bias", bool, False)
    return FamilyFields(attention_bias=bias, o_proj_bias=bias)


def _mistral_fields(reader: "FieldReader") -> FamilyFields:
    """Mistral: Llama's fields plus an optional sliding window over the whole stack."""
    bias = reader.optional("attention_bias", bool, False)
    window = reader.optional("sliding_window", int, None)
    if window is not None and window <= 0:
        raise reader.error("sliding_window", f"must be positive, got {window}")
    return FamilyFields(attention_bias=bias, o_proj_bias=bias, sliding_window=window)


def _refuse_sliding_layers(reader: "FieldReader", family: str) -> None:
    """Qwen2/Qwen3 slide only some layers (`use_sliding_window`, `layer_types`): refused."""
    if reader.optional("use_sliding_window", bool, False):
        raise reader.error("use_sliding_window",
                           f"{family} sliding-window layers are not supported")
    layer_types = reader.optional("layer_types", list, [])
    if any(kind != FULL_ATTENTION_LAYER for kind in layer_types):
        raise reader.error("layer_types",
                           f"only {FULL_ATTENTION_LAYER!r} layers are supported, got "
                           f"{sorted(set(map(str, layer_types)))}")


def _qwen2_fields(reader: "FieldReader") -> FamilyFields:
    """Qwen2: biases on q/k/v always (its config has no switch), never on o."""
    _refuse_sliding_layers(reader, "Qwen2")
    return FamilyFields(attention_bias=True, o_proj_bias=False)


def _qwen3_fields(reader: "FieldReader") -> FamilyFields:
    """Qwen3: RMSNorm over each q and k head before RoPE; q/k/v/o biases only when
    `attention_bias` (false in released checkpoints)."""
    _refuse_sliding_layers(reader, "Qwen3")
    bias = reader.optional("attention_bias", bool, False)
    return FamilyFields(attention_bias=bias, o_proj_bias=bias, qk_norm=True)


QWEN3_DEFAULT_HEAD_DIM = 128

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", "llama", LLAMA_FORWARD, _llama_fields),
    Architecture("MistralForCausalLM", "mistral", LLAMA_FORWARD, _mistral_fields),
    Architecture("Qwen2ForCausalLM", "qwen2", LLAMA_FORWARD, _qwen2_fields),
    Architecture("Qwen3ForCausalLM", "qwen3", LLAMA_FORWARD, _qwen3_fields,
                 default_head_dim=QWEN3_DEFAULT_HEAD_DIM),
)
_BY_NAME = {arch.name: arch for arch in ARCHITECTURES}
_BY_MODEL_TYPE = {arch.model_type: arch for arch in ARCHITECTURES}
SUPPORTED_ARCHITECTURES = tuple(arch.name for arch in ARCHITECTURES)
SUPPORTED_MODEL_TYPES = tuple(arch.model_type for arch in ARCHITECTURES)


def find_architecture(name: str) -> Architecture | None:
    """The registered architecture called `name`, or None."""
    return _BY_NAME.get(name)


def architecture_of(reader: "FieldReader") -> Architecture:
    """The config's architecture: its single `architectures` entry, else its `model_type`.
    Anything else is refused with the supported names."""
    names = reader.optional("architectures", list, None)
    if names is None:
        model_type = reader.optional("model_type", str, None)
        if model_type is None:
            raise reader.error("architectures", "missing (and no model_type to infer it from)")
        if model_type not in _BY_MODEL_TYPE:
            raise reader.error(
                "model_type",
                f"unsupported model type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}",
            )
        return _BY_MODEL_TYPE[model_type]
    if len(names) != 1 or names[0] not in _BY_NAME:
        raise reader.error(
            "architectures",
            f"unsupported architecture {names!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    return _BY_NAME[names[0]]
