"""The model registry's config side: every architecture we serve, what its `config.json` means
for the forward, and which forward runs it.

One `Architecture` per Hugging Face `architectures` entry. It owns what differs between
families in config.json (biases, sliding window, QK-norm, a default head_dim) as a function that
turns the family's fields into `FamilyFields`; `ModelConfig.from_dict` reads everything the
families share and asks the registry for the rest. `forward` names the model class that runs it
in `runtime/models/registry.py` (this module is below the model layer and cannot import it);
a test checks that every name resolves.

Mixture-of-experts families (Mixtral, Qwen3-MoE) run on the same forward: their `FamilyFields`
carry `MoeFields` (expert count, top-k, renormalization, which layers are sparse) and their
`Architecture` the checkpoint's expert tensor names (`ExpertNames`); the Llama forward swaps
the MLP of those layers for runtime/models/moe.py's block.

Gemma 3 text runs on it as well: its `FamilyFields` carry `GemmaFields` (GeGLU, embedding scale,
query_pre_attn_scalar, per-layer local/global kinds with their window and two rope bases), and
ModelConfig turns them into the forward's fields.

Each entry carries its tensor map (runtime/families/base.py): the checkpoint tensors, the
weight fields and fused GEMM group each fills, its tensor-parallel shard kind and its GGUF name.
The safetensors loader, the shard loader and the GGUF converter walk that map.

Adding a family: one `Architecture` (here, or in its own runtime/families/<name>.py when it
needs more than a few lines; a forward module under runtime/models/ only when the Llama forward
cannot express it) and its tests. Anything a family's config asks for that we
cannot run exactly is a `ModelLoadError` naming the field, never a silently different model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .families.base import (  # noqa: F401 -- the registry's names, re-exported
    FULL_ATTENTION_LAYER,
    LLAMA_FORWARD,
    LLAMA_TENSORS,
    SLIDING_ATTENTION_LAYER,
    Architecture,
    ExpertNames,
    FamilyFields,
    GemmaFields,
    MoeFields,
    TensorMap,
    decoder_tensors,
)
from .families.phi3 import PHI3

if TYPE_CHECKING:
    from .model_config import FieldReader


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


# transformers' MixtralConfig / Qwen3MoeConfig defaults: (experts, top-k, expert width).
MIXTRAL_MOE_DEFAULTS = (8, 2, None)  # width: intermediate_size, required anyway
QWEN3_MOE_DEFAULTS = (128, 8, 768)


def _positive(reader: "FieldReader", field: str, default: int | None = None) -> int:
    value = reader.optional(field, int, default)
    if value is None or value <= 0:
        raise reader.error(field, f"must be a positive integer, got {value!r}")
    return value


def _moe(reader: "FieldReader", experts_field: str, inter_field: str, renormalize: bool,
         moe_layers: tuple[int, ...], defaults: tuple[int, int, int | None]) -> MoeFields:
    """defaults: transformers' config-class defaults of (experts, top-k, expert width), which
    it applies to a config.json without them (released checkpoints always have them)."""
    num_experts = _positive(reader, experts_field, defaults[0])
    top_k = _positive(reader, "num_experts_per_tok", defaults[1])
    if top_k > num_experts:
        raise reader.error("num_experts_per_tok",
                           f"{top_k} is more than the {num_experts} experts")
    return MoeFields(num_experts=num_experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=_positive(reader, inter_field, defaults[2]),
                     norm_topk_prob=renormalize, moe_layers=moe_layers)


def _mixtral_fields(reader: "FieldReader") -> FamilyFields:
    """Mixtral: Mistral's attention; every layer's MLP is `num_local_experts` SwiGLU experts of
    `intermediate_size`, top `num_experts_per_tok` of a softmax router, always renormalized.
    `router_jitter_noise` only acts in training."""
    mistral = _mistral_fields(reader)
    num_layers = _positive(reader, "num_hidden_layers")
    moe = _moe(reader, "num_local_experts", "intermediate_size", True,
               tuple(range(num_layers)), MIXTRAL_MOE_DEFAULTS)
    return FamilyFields(attention_bias=mistral.attention_bias,
                        o_proj_bias=mistral.o_proj_bias,
                        sliding_window=mistral.sliding_window, moe=moe)


def _qwen3_moe_fields(reader: "FieldReader") -> FamilyFields:
    """Qwen3-MoE: Qwen3's attention (QK-norm); layer i is sparse when it is not in
    `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (transformers' rule), else a dense
    SwiGLU MLP of `intermediate_size`. Experts are `moe_intermediate_size` wide; the top-k
    weights are renormalized when `norm_topk_prob`. No shared experts in this family."""
    qwen3 = _qwen3_fields(reader)
    num_layers = _positive(reader, "num_hidden_layers")
    step = _positive(reader, "decoder_sparse_step", 1)
    dense_only = reader.optional("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        raise reader.error("mlp_only_layers", f"expected layer indices, got {dense_only!r}")
    moe_layers = tuple(i for i in range(num_layers)
                       if i not in dense_only and (i + 1) % step == 0)
    # Hub configs say num_experts; transformers 5 writes it as num_local_experts (attribute_map).
    experts_field = "num_experts" if "num_experts" in reader.data else "num_local_experts"
    moe = _moe(reader, experts_field, "moe_intermediate_size",
               reader.optional("norm_topk_prob", bool, False), moe_layers,
               QWEN3_MOE_DEFAULTS)
    return FamilyFields(attention_bias=qwen3.attention_bias, o_proj_bias=qwen3.o_proj_bias,
                        qk_norm=True, moe=moe)


# transformers' Gemma3TextConfig defaults a config.json may omit.
GEMMA3_DEFAULT_HEAD_DIM = 256
GEMMA3_DEFAULT_SLIDING_PATTERN = 6  # every 6th layer global
GEMMA3_DEFAULT_ROPE_THETA = 1_000_000.0
GEMMA3_DEFAULT_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_DEFAULT_SLIDING_WINDOW = 4096
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _gemma3_rope(reader: "FieldReader") -> tuple[float, float | None, float]:
    """(full layers' theta, their linear factor or None, sliding layers' theta) from either
    layout: transformers 5's `rope_parameters` keyed by layer type, or the older top-level
    `rope_theta`, `rope_local_base_freq` and `rope_scaling`."""
    params = reader.optional("rope_parameters", dict, None)
    if params is not None and FULL_ATTENTION_LAYER in params:
        full = params[FULL_ATTENTION_LAYER] or {}
        local = params.get(SLIDING_ATTENTION_LAYER) or {}
        field = "rope_parameters"
    else:
        full = dict(params or reader.optional("rope_scaling", dict, None) or {})
        full.setdefault("rope_theta", reader.optional("rope_theta", float,
                                                      GEMMA3_DEFAULT_ROPE_THETA))
        local = {"rope_theta": reader.optional("rope_local_base_freq", float,
                                               GEMMA3_DEFAULT_LOCAL_ROPE_THETA)}
        field = "rope_scaling"
    thetas = []
    for kind, source, default in ((FULL_ATTENTION_LAYER, full, GEMMA3_DEFAULT_ROPE_THETA),
                                  (SLIDING_ATTENTION_LAYER, local,
                                   GEMMA3_DEFAULT_LOCAL_ROPE_THETA)):
        theta = source.get("rope_theta", default)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise reader.error(f"{field}.rope_theta", f"{kind}: must be positive, got {theta!r}")
        thetas.append(float(theta))
    if (local.get("rope_type", local.get("type")) or "default") != "default":
        raise reader.error(field, "sliding layers' rope must be unscaled")
    rope_type = full.get("rope_type", full.get("type")) or "default"
    if rope_type == "default":
        return thetas[0], None, thetas[1]
    factor = full.get("factor")
    if rope_type != "linear" or isinstance(factor, bool) or not isinstance(
            factor, (int, float)) or factor <= 0:
        raise reader.error(field, f"unsupported rope {rope_type!r} (factor {factor!r}); "
                                  "supported: default, linear with a positive factor")
    return thetas[0], float(factor), thetas[1]


def _gemma3_fields(reader: "FieldReader") -> FamilyFields:
    """Gemma 3 text: QK-norm, (1 + w) RMSNorms (folded at load, runtime/weights.py), norms
    after attention and after the MLP too, GeGLU, embeddings times sqrt(hidden), softmax scale
    query_pre_attn_scalar ** -0.5, and local sliding-window layers (`layer_types`, else every
    `sliding_window_pattern`-th layer global) with their own rope base. Logit soft-capping is
    Gemma 2's: refused if a config sets it."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if reader.optional(field, float, None) is not None:
            raise reader.error(field, "logit soft-capping is not supported")
    if reader.optional("use_bidirectional_attention", bool, False):
        raise reader.error("use_bidirectional_attention", "only causal attention is supported")
    activation = reader.optional("hidden_activation", str,
                                 reader.optional("hidden_act", str, GEMMA_ACTIVATIONS[0]))
    if activation not in GEMMA_ACTIVATIONS:
        raise reader.error("hidden_activation",
                           f"only {GEMMA_ACTIVATIONS} supported, got {activation!r}")
    num_layers = _positive(reader, "num_hidden_layers")
    layer_types = reader.optional("layer_types", list, None)
    if layer_types is None:
        pattern = _positive(reader, "sliding_window_pattern",
                            reader.optional("_sliding_window_pattern", int,
                                            GEMMA3_DEFAULT_SLIDING_PATTERN))
        layer_types = [FULL_ATTENTION_LAYER if (i + 1) % pattern == 0
                       else SLIDING_ATTENTION_LAYER for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {
            FULL_ATTENTION_LAYER, SLIDING_ATTENTION_LAYER}:
        raise reader.error("layer_types", f"expected {num_layers} of {FULL_ATTENTION_LAYER!r} / "
                                          f"{SLIDING_ATTENTION_LAYER!r}, got {layer_types!r}")
    window = _positive(reader, "sliding_window", GEMMA3_DEFAULT_SLIDING_WINDOW)
    hidden = _positive(reader, "hidden_size")
    head_dim = reader.optional("head_dim", int, GEMMA3_DEFAULT_HEAD_DIM)
    scalar = reader.optional("query_pre_attn_scalar", float, float(head_dim))
    if scalar <= 0:
        raise reader.error("query_pre_attn_scalar", f"must be positive, got {scalar}")
    theta, factor, local_theta = _gemma3_rope(reader)
    bias = reader.optional("attention_bias", bool, False)
    return FamilyFields(attention_bias=bias, o_proj_bias=bias, qk_norm=True, gemma=GemmaFields(
        hidden_activation=activation, embedding_scale=float(hidden) ** 0.5,
        attention_scale=scalar ** -0.5, layer_types=tuple(layer_types),
        local_sliding_window=window, rope_theta=theta, rope_linear_factor=factor,
        local_rope_theta=local_theta))


QWEN3_DEFAULT_HEAD_DIM = 128
MIXTRAL_EXPERTS = ExpertNames(("block_sparse_moe.", "mlp."), "w1", "w3", "w2")
QWEN3_MOE_EXPERTS = ExpertNames(("mlp.",), "gate_proj", "up_proj", "down_proj")

QWEN3_TENSORS = decoder_tensors(qk_norm=True)
GEMMA3_TENSORS = decoder_tensors(qk_norm=True, sandwich_norms=True)

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", "llama", LLAMA_FORWARD, _llama_fields,
                 gguf_arch="llama", gguf_rotary_permuted=True),
    Architecture("MistralForCausalLM", "mistral", LLAMA_FORWARD, _mistral_fields),
    Architecture("Qwen2ForCausalLM", "qwen2", LLAMA_FORWARD, _qwen2_fields, gguf_arch="qwen2"),
    Architecture("Qwen3ForCausalLM", "qwen3", LLAMA_FORWARD, _qwen3_fields, QWEN3_TENSORS,
                 default_head_dim=QWEN3_DEFAULT_HEAD_DIM),
    Architecture("MixtralForCausalLM", "mixtral", LLAMA_FORWARD, _mixtral_fields,
                 expert_names=MIXTRAL_EXPERTS),
    # Qwen3MoeConfig has no head_dim default: hidden / heads, as for Llama.
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", LLAMA_FORWARD, _qwen3_moe_fields,
                 QWEN3_TENSORS, expert_names=QWEN3_MOE_EXPERTS),
    Architecture("Gemma3ForCausalLM", "gemma3_text", LLAMA_FORWARD, _gemma3_fields,
                 GEMMA3_TENSORS, default_head_dim=GEMMA3_DEFAULT_HEAD_DIM, gguf_arch="gemma3"),
    PHI3,
)
_BY_NAME = {arch.name: arch for arch in ARCHITECTURES}
_BY_MODEL_TYPE = {arch.model_type: arch for arch in ARCHITECTURES}
SUPPORTED_ARCHITECTURES = tuple(arch.name for arch in ARCHITECTURES)
SUPPORTED_MODEL_TYPES = tuple(arch.model_type for arch in ARCHITECTURES)


def find_architecture(name: str) -> Architecture | None:
    """The registered architecture called `name`, or None."""
    return _BY_NAME.get(name)


def gguf_architecture(gguf_arch: str) -> Architecture | None:
    """The registered architecture whose GGUF files say `general.architecture` gguf_arch."""
    return next((arch for arch in ARCHITECTURES if arch.gguf_arch == gguf_arch), None)


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
