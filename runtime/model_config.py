"""`ModelConfig`: the shape and numerics of a Llama-family decoder, read from a Hugging Face
model directory's `config.json` (plus `generation_config.json` for extra stop ids).

Which architectures we serve, and what their configs mean beyond the shared fields, is the
model registry's (runtime/architectures.py): Llama 2/3 (and SmolLM2), Mistral, Qwen2, Qwen3,
Mixtral, Qwen3-MoE and Gemma 3 share one forward -- RMSNorm, rotary attention with grouped-query
heads, SwiGLU MLP or mixture of SwiGLU experts -- and differ in data kept here as fields (q/k/v/o
biases, a sliding window, Qwen3's per-head QK-norm, Llama 3's rotary scaling, the experts,
Gemma 3's norms, GeGLU, embedding and softmax scales and local sliding layers).

Both config layouts Hugging Face has written are read: the older one (`rope_theta` and
`rope_scaling` at top level, `torch_dtype`) and transformers 5's (`rope_parameters` holding
`rope_theta` and the scaling keys, `dtype`). Anything we cannot run exactly (another
architecture, another rope type, a non-SiLU activation, MLP biases, sliding-window layers in a
stack of full ones) is a `ModelLoadError` naming the file and the field, never a silently wrong
model.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from .architectures import SLIDING_ATTENTION_LAYER, SUPPORTED_ARCHITECTURES, architecture_of
from .errors import ModelLoadError

CONFIG_FILE_NAME = "config.json"
GENERATION_CONFIG_FILE_NAME = "generation_config.json"

# Re-exported: the registry's list (runtime/architectures.py) is the one source.
__all__ = ["ModelConfig", "RopeScaling", "FieldReader", "SUPPORTED_ARCHITECTURES"]
# Rope types that mean "theta only, no scaling".
_UNSCALED_ROPE_TYPES = ("default", None)
LLAMA3_ROPE_TYPE = "llama3"
LINEAR_ROPE_TYPE = "linear"
# Gemma's RMSNorm multiplies by (1 + weight).
GEMMA_NORM_WEIGHT_OFFSET = 1.0
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 rotary frequency scaling (rope type "llama3").

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are kept,
    those longer than `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, and the band between is interpolated (see `runtime/rope.py: rope_inv_freq`).
    """

    rope_type: str
    factor: float
    # llama3 only (a "linear" scaling, Gemma 3's, divides every frequency by factor).
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model, and nothing about weights."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    # Biases on q_proj, k_proj, v_proj (Qwen2 always; Llama when `attention_bias`).
    attention_bias: bool
    # Bias on o_proj (only Llama with `attention_bias`; Qwen2 has none).
    o_proj_bias: bool
    max_position_embeddings: int
    # None: full causal attention. Otherwise a query at position i sees keys at positions
    # j with i - sliding_window < j <= i (Mistral's window, as transformers applies it).
    sliding_window: int | None
    bos_token_id: int | None
    # config.json's eos ids first, then generation_config.json's, without repeats.
    eos_token_ids: tuple[int, ...]
    # On-disk dtype the checkpoint declares ("float32", "bfloat16", "float16"), or None.
    torch_dtype: str | None
    # Qwen3: RMSNorm (weights q_norm / k_norm, [head_dim], eps rms_norm_eps) over every query
    # and key head after the projections, before RoPE.
    qk_norm: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0: a dense model. Layers in
    # `moe_layers` replace the SwiGLU MLP by `num_experts` SwiGLU experts of
    # `moe_intermediate_size`, of which each token uses the `num_experts_per_tok` with the largest
    # router softmax probabilities, weighted by them (divided by their sum when `norm_topk_prob`).
    # The other layers keep the dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # Gemma 3 (defaults: every other family). The MLP activation ("silu": SwiGLU;
    # "gelu_pytorch_tanh": GeGLU); a factor on looked-up embeddings (the tied LM head uses the
    # unscaled table); the softmax scale, None = head_dim ** -0.5; norms on the attention and MLP
    # outputs before their residual adds (`post_sublayer_norms`; post_attention_layernorm is then
    # the attention output's norm, pre_feedforward_layernorm the MLP input's); RMSNorm weights
    # stored as w and applied as (`norm_weight_offset` + w), folded at load.
    hidden_activation: str = "silu"
    embedding_scale: float | None = None
    attention_scale: float | None = None
    post_sublayer_norms: bool = False
    norm_weight_offset: float = 0.0
    # Per-layer attention kinds (empty: every layer full, or Mistral's `sliding_window` on all).
    # A "sliding_attention" layer sees keys j with i - local_sliding_window < j <= i and rotates
    # with `local_rope_theta` (unscaled); the others use rope_theta / rope_scaling.
    layer_types: tuple[str, ...] = ()
    local_sliding_window: int | None = None
    local_rope_theta: float | None = None

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window layer `layer_index` attends within, None for full attention."""
        if self.layer_types and self.layer_types[layer_index] == SLIDING_ATTENTION_LAYER:
            return self.local_sliding_window
        return self.sliding_window

    def is_local_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` is a Gemma-style local (sliding, own rope base) layer."""
        return bool(self.layer_types) and self.layer_types[layer_index] == SLIDING_ATTENTION_LAYER

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale."""
        if self.attention_scale is not None:
            return self.attention_scale
        return float(self.head_dim) ** -0.5

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index`'s MLP is the mixture of experts."""
        return layer_index in self.moe_layers

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        """Output features of q_proj: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Output features of k_proj and of v_proj: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """Read `config.json` (required) and `generation_config.json` (optional) in model_dir."""
        model_dir = pathlib.Path(model_dir)
        config_path = model_dir / CONFIG_FILE_NAME
        config = _read_json_object(config_path)
        generation_path = model_dir / GENERATION_CONFIG_FILE_NAME
        generation = _read_json_object(generation_path) if generation_path.is_file() else None
        return cls.from_dict(
            config, source=str(config_path), generation_config=generation,
            generation_source=str(generation_path),
        )

    @classmethod
    def from_dict(
        cls,
        config: dict[str, Any],
        *,
        source: str = CONFIG_FILE_NAME,
        generation_config: dict[str, Any] | None = None,
        generation_source: str = GENERATION_CONFIG_FILE_NAME,
    ) -> "ModelConfig":
        """Build from parsed config.json contents; `source` names the file in error messages."""
        reader = FieldReader(config, source)
        architecture = architecture_of(reader)
        family = architecture.read_fields(reader)

        if family.gemma is None and reader.optional("hidden_act", str, "silu") != "silu":
            raise reader.error("hidden_act",
                               f"only 'silu' is supported, got {config['hidden_act']!r}")
        if reader.optional("mlp_bias", bool, False):
            raise reader.error("mlp_bias", "MLP biases are not supported")

        hidden_size = reader.positive_int("hidden_size")
        num_attention_heads = reader.positive_int("num_attention_heads")
        num_key_value_heads = reader.optional("num_key_value_heads", int, num_attention_heads)
        if num_key_value_heads <= 0 or num_attention_heads % num_key_value_heads:
            raise reader.error(
                "num_key_value_heads",
                f"{num_key_value_heads} does not divide num_attention_heads={num_attention_heads}",
            )
        head_dim = reader.optional("head_dim", int, architecture.default_head_dim)
        if head_dim is None:
            if hidden_size % num_attention_heads:
                raise reader.error(
                    "head_dim",
                    f"missing and hidden_size={hidden_size} is not a multiple of "
                    f"num_attention_heads={num_attention_heads}",
                )
            head_dim = hidden_size // num_attention_heads
        if head_dim <= 0 or head_dim % 2:
            raise reader.error("head_dim", f"must be a positive even number, got {head_dim}")

        if family.gemma is None:
            rope_theta, rope_scaling = _rope(reader)
            gemma = {}
        else:
            rope_theta, rope_scaling, gemma = _gemma_fields(family.gemma)

        eos_token_ids = _token_ids(reader, "eos_token_id")
        if generation_config is not None:
            generation_reader = FieldReader(generation_config, generation_source)
            for token_id in _token_ids(generation_reader, "eos_token_id"):
                if token_id not in eos_token_ids:
                    eos_token_ids += (token_id,)
        bos_ids = _token_ids(reader, "bos_token_id")

        torch_dtype = config.get("dtype", config.get("torch_dtype"))
        if torch_dtype is not None and not isinstance(torch_dtype, str):
            raise reader.error("torch_dtype", f"expected a dtype name, got {torch_dtype!r}")

        return cls(
            architecture=architecture.name,
            vocab_size=reader.positive_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=reader.positive_int("intermediate_size"),
            num_hidden_layers=reader.positive_int("num_hidden_layers"),
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(reader.optional("rms_norm_eps", float, 1e-6)),
            tie_word_embeddings=reader.optional("tie_word_embeddings", bool, False),
            attention_bias=family.attention_bias,
            o_proj_bias=family.o_proj_bias,
            max_position_embeddings=reader.positive_int("max_position_embeddings"),
            sliding_window=family.sliding_window,
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos_token_ids,
            torch_dtype=torch_dtype,
            qk_norm=family.qk_norm,
            **(dataclasses.asdict(family.moe) if family.moe is not None else {}),
            **gemma,
        )


class FieldReader:
    """Typed access to one JSON object; every failure names the file and the field (the
    registry's per-family readers in runtime/architectures.py get one too)."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, field: str, message: str) -> ModelLoadError:
        return ModelLoadError(self.source, message, field=field)

    def required(self, field: str, kind: type) -> Any:
        if self.data.get(field) is None:
            raise self.error(field, "missing")
        return self._typed(field, self.data[field], kind)

    def optional(self, field: str, kind: type, default: Any) -> Any:
        value = self.data.get(field)
        return default if value is None else self._typed(field, value, kind)

    def positive_int(self, field: str) -> int:
        value = self.required(field, int)
        if value <= 0:
            raise self.error(field, f"must be positive, got {value}")
        return value

    def _typed(self, field: str, value: Any, kind: type) -> Any:
        # bool is an int subclass in Python; a JSON true is never a valid size.
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind in (bool, str, dict, list) and isinstance(value, kind):
            return value
        raise self.error(field, f"expected {kind.__name__}, got {value!r}")


def _read_json_object(path: pathlib.Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelLoadError(path, "file not found") from None
    except OSError as exc:
        raise ModelLoadError(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object at top level")
    return data


def _rope(reader: FieldReader) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config layout; see the module docstring."""
    if reader.data.get("rope_parameters") is not None:
        field = "rope_parameters"
        params = reader.required(field, dict)
        theta_source = params
    else:
        field = "rope_scaling"
        params = reader.optional(field, dict, None) or {}
        theta_source = reader.data
    theta = theta_source.get("rope_theta", DEFAULT_ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise reader.error("rope_theta", f"must be a positive number, got {theta!r}")

    # Old configs spell the key "type", newer ones "rope_type".
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in _UNSCALED_ROPE_TYPES:
        return float(theta), None
    if rope_type != LLAMA3_ROPE_TYPE:
        raise reader.error(field,
                           f"unsupported rope type {rope_type!r}; supported: default, llama3")
    values = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"):
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise reader.error(f"{field}.{key}", f"must be a positive number, got {value!r}")
        values[key] = value
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise reader.error(f"{field}.high_freq_factor", "must be greater than low_freq_factor")
    return float(theta), RopeScaling(
        rope_type=LLAMA3_ROPE_TYPE,
        factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]),
        original_max_position_embeddings=int(values["original_max_position_embeddings"]),
    )


def _gemma_fields(gemma) -> tuple[float, RopeScaling | None, dict[str, Any]]:
    """(rope_theta, rope_scaling, the other ModelConfig fields) of architectures.GemmaFields."""
    scaling = None
    if gemma.rope_linear_factor is not None:
        scaling = RopeScaling(rope_type=LINEAR_ROPE_TYPE, factor=gemma.rope_linear_factor)
    return gemma.rope_theta, scaling, dict(
        hidden_activation=gemma.hidden_activation, embedding_scale=gemma.embedding_scale,
        attention_scale=gemma.attention_scale, post_sublayer_norms=True,
        norm_weight_offset=GEMMA_NORM_WEIGHT_OFFSET, layer_types=gemma.layer_types,
        local_sliding_window=gemma.local_sliding_window, local_rope_theta=gemma.local_rope_theta)


def _token_ids(reader: FieldReader, field: str) -> tuple[int, ...]:
    """A token-id field that may be absent, one int, or a list of ints, as a tuple."""
    value = reader.data.get(field)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    result: list[int] = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise reader.error(field, f"expected token ids, got {value!r}")
        if item not in result:
            result.append(item)
    return tuple(result)
