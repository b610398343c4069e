"""The vocabulary of the model registry: what one `Architecture` entry says, and its tensor map.

A family is data: its config reader (`read_fields` -> `FamilyFields`), the forward that runs it
(a key of runtime/models/registry.py's FORWARDS) and its **tensor map**, the checkpoint tensors
it holds, each with the weight fields it fills, the forward GEMM they join (the fused group),
how tensor parallelism splits it (the shard kind) and llama.cpp's name for it. Three readers
walk the map and none of them branches on a family: the Hugging Face loader
(runtime/weights.py), a tensor-parallel rank's shard loader (runtime/distributed/sharding.py)
and the GGUF converter (runtime/gguf_convert.py).

A checkpoint tensor may hold several weight fields stacked along its rows (`parts`): Phi-3
stores q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj`. Each part keeps its
own size and its own shard range, so a rank reads its heads of q, k and v from one fused tensor
without reading the rest.

This module sits below runtime/architectures.py (which lists the entries) so that a family's
own module (runtime/families/<name>.py) can build an `Architecture` without importing the list
it joins.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedrun.runtime.model_config import FieldReader, ModelConfig

# The forward of the Llama family (runtime/models/llama.py): RMSNorm, rotary grouped-query
# attention (optional q/k/v/o biases, sliding window, per-head q/k RMSNorm), SwiGLU MLP or a
# mixture of SwiGLU experts (runtime/models/moe.py) per layer.
LLAMA_FORWARD = "llama"
FULL_ATTENTION_LAYER = "full_attention"
SLIDING_ATTENTION_LAYER = "sliding_attention"

# -- shard kinds: how a tensor-parallel rank holds a tensor (runtime/distributed/sharding.py)
COLUMN = "column"          # split along rows (out features): a rank's heads / MLP features
ROW = "row"                # split along columns (in features): products are partial sums
ROW_BIAS = "row_bias"      # a row-parallel GEMM's bias: held by rank 0 only (added once)
REPLICATED = "replicated"  # every rank holds all of it (norms)
VOCAB = "vocab"            # ceil(vocab / tp) rows per rank, the last zero-padded

# -- fused groups: what in the forward a tensor feeds
QKV, O_PROJ, GATE_UP, DOWN = "qkv", "o", "gate_up", "down"  # the four GEMMs of a layer
NORM = "norm"              # an RMSNorm weight (Gemma's (1 + w) folded at load)
EMBED, LM_HEAD = "embed", "lm_head"

# -- dimensions: a part's rows or a matrix's columns, by the ModelConfig size they are
DIM_Q, DIM_KV, DIM_INTER = "q", "kv", "inter"              # split by tensor parallelism
DIM_HIDDEN, DIM_HEAD, DIM_VOCAB = "hidden", "head_dim", "vocab"
_DIM_SIZES = {
    DIM_Q: lambda c: c.q_size, DIM_KV: lambda c: c.kv_size,
    DIM_INTER: lambda c: c.intermediate_size, DIM_HIDDEN: lambda c: c.hidden_size,
    DIM_HEAD: lambda c: c.head_dim, DIM_VOCAB: lambda c: c.vocab_size,
}

# -- presence: when a map entry is in a checkpoint (None: always). Per layer, as MoE layers have
# no dense MLP; the rest are config fields a family's reader sets.
PRESENCE: dict[str, Callable[["ModelConfig", int], bool]] = {
    "attention_bias": lambda c, i: c.attention_bias,
    "o_proj_bias": lambda c, i: c.o_proj_bias,
    "dense_mlp": lambda c, i: not c.is_moe_layer(i),
    "untied": lambda c, i: not c.tie_word_embeddings,
}


def dim_size(config: "ModelConfig", dim: str) -> int:
    return _DIM_SIZES[dim](config)


@dataclass(frozen=True)
class Part:
    """One weight field (a LayerWeights / ModelWeights attribute) inside a checkpoint tensor,
    `dim` rows of it."""

    field: str
    dim: str


@dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor. `name` and `gguf` hold `{i}` for the layer index in layer
    entries. A vector has `cols` None; a matrix is [sum of the parts' rows, cols] (HF's
    [out, in])."""

    name: str
    parts: tuple[Part, ...]
    group: str
    shard: str
    cols: str | None = None
    when: str | None = None   # a PRESENCE key, or None: always present
    gguf: str | None = None   # llama.cpp's name, or None: no GGUF of the family holds it

    def present(self, config: "ModelConfig", layer_index: int = 0) -> bool:
        return self.when is None or PRESENCE[self.when](config, layer_index)

    def shape(self, config: "ModelConfig") -> tuple[int, ...]:
        rows = sum(dim_size(config, part.dim) for part in self.parts)
        return (rows,) if self.cols is None else (rows, dim_size(config, self.cols))

    def row_offsets(self, config: "ModelConfig") -> list[int]:
        """Where each part's rows start in the tensor."""
        offsets, start = [], 0
        for part in self.parts:
            offsets.append(start)
            start += dim_size(config, part.dim)
        return offsets


@dataclass(frozen=True)
class TensorMap:
    """A family's checkpoint tensors: `layer` entries repeat per decoder layer; `model` ones
    occur once (embedding, final norm, LM head)."""

    layer: tuple[TensorEntry, ...]
    model: tuple[TensorEntry, ...]

    def fusing(self, names: tuple[str, ...], fused: TensorEntry) -> "TensorMap":
        """This map with the layer entries named `names` replaced by one `fused` entry (at the
        first one's place), as a checkpoint that stacks them stores it."""
        layer, placed = [], False
        for entry in self.layer:
            if entry.name not in names:
                layer.append(entry)
            elif not placed:
                layer.append(fused)
                placed = True
        missing = set(names) - {entry.name for entry in self.layer}
        if missing:
            raise ValueError(f"no such entries to fuse: {sorted(missing)}")
        return replace(self, layer=tuple(layer))


def _vector(name: str, field: str, dim: str, group: str, shard: str, when=None, gguf=None):
    return TensorEntry(name, (Part(field, dim),), group, shard, None, when, gguf)


def _matrix(name: str, field: str, dim: str, cols: str, group: str, shard: str, when=None,
            gguf=None):
    return TensorEntry(name, (Part(field, dim),), group, shard, cols, when, gguf)


def decoder_tensors(qk_norm: bool = False, sandwich_norms: bool = False) -> TensorMap:
    """The Llama-layout checkpoint (Hugging Face names, llama.cpp's beside them). qk_norm:
    Qwen3's per-head q_norm / k_norm. sandwich_norms: Gemma 3's four norms a layer, where
    post_attention_layernorm norms the attention output and pre_feedforward_layernorm takes
    its Llama role (which llama.cpp calls ffn_norm in both)."""
    layer, attn, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    blk = "blk.{i}."
    entries = [
        _vector(layer + "input_layernorm.weight", "input_layernorm", DIM_HIDDEN, NORM,
                REPLICATED, gguf=blk + "attn_norm.weight"),
        _matrix(attn + "q_proj.weight", "q_proj", DIM_Q, DIM_HIDDEN, QKV, COLUMN,
                gguf=blk + "attn_q.weight"),
        _matrix(attn + "k_proj.weight", "k_proj", DIM_KV, DIM_HIDDEN, QKV, COLUMN,
                gguf=blk + "attn_k.weight"),
        _matrix(attn + "v_proj.weight", "v_proj", DIM_KV, DIM_HIDDEN, QKV, COLUMN,
                gguf=blk + "attn_v.weight"),
        _vector(attn + "q_proj.bias", "q_bias", DIM_Q, QKV, COLUMN, "attention_bias",
                blk + "attn_q.bias"),
        _vector(attn + "k_proj.bias", "k_bias", DIM_KV, QKV, COLUMN, "attention_bias",
                blk + "attn_k.bias"),
        _vector(attn + "v_proj.bias", "v_bias", DIM_KV, QKV, COLUMN, "attention_bias",
                blk + "attn_v.bias"),
        _matrix(attn + "o_proj.weight", "o_proj", DIM_HIDDEN, DIM_Q, O_PROJ, ROW,
                gguf=blk + "attn_output.weight"),
        _vector(attn + "o_proj.bias", "o_bias", DIM_HIDDEN, O_PROJ, ROW_BIAS, "o_proj_bias",
                blk + "attn_output.bias"),
        _vector(layer + "post_attention_layernorm.weight", "post_attention_layernorm",
                DIM_HIDDEN, NORM, REPLICATED,
                gguf=blk + ("post_attention_norm.weight" if sandwich_norms
                            else "ffn_norm.weight")),
        _matrix(mlp + "gate_proj.weight", "gate_proj", DIM_INTER, DIM_HIDDEN, GATE_UP, COLUMN,
                "dense_mlp", blk + "ffn_gate.weight"),
        _matrix(mlp + "up_proj.weight", "up_proj", DIM_INTER, DIM_HIDDEN, GATE_UP, COLUMN,
                "dense_mlp", blk + "ffn_up.weight"),
        _matrix(mlp + "down_proj.weight", "down_proj", DIM_HIDDEN, DIM_INTER, DOWN, ROW,
                "dense_mlp", blk + "ffn_down.weight"),
    ]
    if qk_norm:  # a rank norms whole heads: replicated
        entries += [
            _vector(attn + "q_norm.weight", "q_norm", DIM_HEAD, NORM, REPLICATED,
                    gguf=blk + "attn_q_norm.weight"),
            _vector(attn + "k_norm.weight", "k_norm", DIM_HEAD, NORM, REPLICATED,
                    gguf=blk + "attn_k_norm.weight"),
        ]
    if sandwich_norms:
        entries += [
            _vector(layer + "pre_feedforward_layernorm.weight", "pre_feedforward_layernorm",
                    DIM_HIDDEN, NORM, REPLICATED, gguf=blk + "ffn_norm.weight"),
            _vector(layer + "post_feedforward_layernorm.weight", "post_feedforward_layernorm",
                    DIM_HIDDEN, NORM, REPLICATED, gguf=blk + "post_ffw_norm.weight"),
        ]
    model = (
        _matrix("model.embed_tokens.weight", "embed_tokens", DIM_VOCAB, DIM_HIDDEN, EMBED, VOCAB,
                gguf="token_embd.weight"),
        _vector("model.norm.weight", "norm", DIM_HIDDEN, NORM, REPLICATED,
                gguf="output_norm.weight"),
        # Tied models may still store lm_head.weight; transformers ignores it, and so do we.
        _matrix("lm_head.weight", "lm_head", DIM_VOCAB, DIM_HIDDEN, LM_HEAD, VOCAB, "untied",
                "output.weight"),
    )
    return TensorMap(tuple(entries), model)


LLAMA_TENSORS = decoder_tensors()


@dataclass(frozen=True)
class MoeFields:
    """A mixture-of-experts family's config (ModelConfig's fields of the same names)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]


@dataclass(frozen=True)
class GemmaFields:
    """Gemma 3's departures from the Llama layer (ModelConfig's fields of the same names)."""

    hidden_activation: str            # "gelu_pytorch_tanh": GeGLU MLP
    embedding_scale: float            # sqrt(hidden_size), applied to looked-up embeddings
    attention_scale: float            # query_pre_attn_scalar ** -0.5
    layer_types: tuple[str, ...]      # per layer: SLIDING_ATTENTION_LAYER or FULL_ATTENTION_LAYER
    local_sliding_window: int         # the window of the sliding layers
    rope_theta: float                 # full-attention layers' base
    rope_linear_factor: float | None  # full-attention layers' linear rope scaling, if any
    local_rope_theta: float           # sliding layers' base (never scaled)


@dataclass(frozen=True)
class FamilyFields:
    """The ModelConfig fields a family decides (see ModelConfig for their meaning)."""

    attention_bias: bool = False
    o_proj_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False
    moe: MoeFields | None = None
    gemma: GemmaFields | None = None


@dataclass(frozen=True)
class ExpertNames:
    """Where a MoE layer's tensors live under `model.layers.{i}.`: the block prefix (Mixtral's
    hub checkpoints say `block_sparse_moe.`, transformers 5 models `mlp.`; the loader takes the
    first present), the router `{prefix}gate.weight` [num_experts, hidden], and either
    per-expert matrices `{prefix}experts.{e}.{gate|up|down}.weight` (hub layout) or transformers
    5's fused `{prefix}experts.gate_up_proj` [E, 2I, H] / `{prefix}experts.down_proj` [E, H, I].
    Kept beside the tensor map: an expert stack is read by runtime/weights.py's read_experts,
    in either layout, and split by expert features (every expert's gate / up rows and down
    columns, like the dense MLP's)."""

    prefixes: tuple[str, ...]
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class Architecture:
    name: str        # config.json "architectures" entry, e.g. "Qwen3ForCausalLM"
    model_type: str  # config.json "model_type"; names the architecture when that list is absent
    forward: str     # key of the model class in runtime/models/registry.py
    read_fields: Callable[["FieldReader"], FamilyFields]
    tensors: TensorMap = LLAMA_TENSORS
    # head_dim when config.json has none: None = hidden_size / num_attention_heads (transformers'
    # fallback); Qwen3's config class defaults it to 128 instead.
    default_head_dim: int | None = None
    # Mixture-of-experts families: their expert tensors' names (runtime/weights.py).
    expert_names: ExpertNames | None = None
    # llama.cpp's `general.architecture` for this family (None: no GGUF conversion), and
    # whether its converter permuted q/k rows for interleaved rotary (runtime/gguf_convert.py).
    gguf_arch: str | None = None
    gguf_rotary_permuted: bool = False
