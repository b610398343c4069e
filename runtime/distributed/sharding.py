"""Megatron-style sharding of a Llama-family model: which slice of which tensor each rank holds.

Each tensor's shard kind is its architecture's tensor map's (runtime/families/base.py); this
module turns the kinds into slices. Per layer (HF [out, in] matrices):
- q_proj, k_proj, v_proj (and their biases), gate_proj, up_proj: column-parallel, i.e. split
  along `out`; rank r holds query heads [r * H/tp, (r+1) * H/tp) and the matching rows.
- o_proj, down_proj: row-parallel, split along `in`; each rank's product is a partial sum and is
  all-reduced (two all-reduces per layer). o_proj's bias is added once, by rank 0.
- KV heads: with num_kv_heads >= tp each rank holds KV/tp of them; with num_kv_heads < tp each
  KV head is replicated on tp/KV ranks and rank r holds the one its query heads read
  (head r * H/tp belongs to KV group (r * H/tp) // (H/KV)).
- embed_tokens and lm_head: vocab-parallel, ceil(vocab/tp) rows per rank, the last rank's slice
  zero-padded; the embedding is a masked lookup plus all-reduce, the LM head's logits are
  gathered to rank 0 and the padding trimmed.
- norms: replicated (Qwen3's per-head q_norm / k_norm too: a rank norms whole heads).
- mixture-of-experts layers: the router is replicated (every rank routes every token the same
  way); every expert's intermediate features are split like the dense MLP's, rank r holding
  [r * I/tp, (r+1) * I/tp) of each expert's gate, up (rows) and down (columns), so a rank's
  `moe_experts` output is a partial sum all-reduced at the same place as down_proj's. Expert
  parallelism (whole experts per rank, tokens exchanged all-to-all) is not done.

A rank reads only its slices from the safetensors files (`SafetensorsCheckpoint.get(...,
index=)` slices the memory map before copying), so no rank materializes a full weight matrix.
Configurations that cannot be sharded are refused with `TensorParallelConfigError` naming the
numbers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.architectures import find_architecture
from pagedrun.runtime.errors import PagedRunError
from pagedrun.runtime.families.base import (
    COLUMN,
    DIM_INTER,
    DIM_KV,
    DIM_Q,
    NORM,
    REPLICATED,
    ROW,
    ROW_BIAS,
    VOCAB,
    Part,
    TensorEntry,
    dim_size,
)
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import (
    LayerWeights,
    ModelWeights,
    SafetensorsCheckpoint,
    read_experts,
)


class TensorParallelConfigError(PagedRunError):
    """The model cannot be split over this many ranks; the message says why."""


@dataclass(frozen=True)
class ShardSpec:
    """The slices rank `rank` of `tp_size` holds (head and row indices are global)."""

    tp_size: int
    rank: int
    head_start: int          # first query head
    num_heads: int           # query heads on this rank
    kv_head_start: int       # first KV head
    num_kv_heads: int        # KV heads on this rank (1 when replicated)
    inter_start: int         # first intermediate (MLP) feature
    inter_size: int
    vocab_start: int         # first vocabulary row
    vocab_size: int          # vocabulary rows on this rank, padding included (same on all ranks)
    full_vocab_size: int
    moe_inter_start: int = 0  # first intermediate feature of every expert (MoE models)
    moe_inter_size: int = 0

    @property
    def num_real_vocab(self) -> int:
        """Rows of this rank's vocabulary slice that are real tokens (the rest is padding)."""
        return max(0, min(self.vocab_size, self.full_vocab_size - self.vocab_start))


def check_shardable(config: ModelConfig, tp_size: int) -> None:
    """Raise TensorParallelConfigError if `config` cannot be split over `tp_size` ranks."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if tp_size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if heads % tp_size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {tp_size} does not divide num_attention_heads {heads}: "
            f"each rank must hold whole query heads (try a divisor of {heads})")
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {tp_size} does not divide num_key_value_heads {kv_heads}")
    if kv_heads < tp_size and tp_size % kv_heads:
        raise TensorParallelConfigError(
            f"num_key_value_heads {kv_heads} < tensor_parallel_size {tp_size} needs "
            f"tp a multiple of {kv_heads} (each KV head replicated on the same number of ranks)")
    if config.intermediate_size % tp_size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {tp_size} does not divide intermediate_size "
            f"{config.intermediate_size}")
    if config.num_experts and config.moe_intermediate_size % tp_size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {tp_size} does not divide moe_intermediate_size "
            f"{config.moe_intermediate_size}")


def shard_spec(config: ModelConfig, tp_size: int, rank: int) -> ShardSpec:
    check_shardable(config, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    num_heads = heads // tp_size
    head_start = rank * num_heads
    if kv_heads >= tp_size:
        num_kv = kv_heads // tp_size
        kv_start = rank * num_kv
    else:  # replicated: the KV group of this rank's (single-group) query heads
        num_kv = 1
        kv_start = head_start // (heads // kv_heads)
    inter = config.intermediate_size // tp_size
    vocab_per_rank = math.ceil(config.vocab_size / tp_size)
    moe_inter = config.moe_intermediate_size // tp_size
    return ShardSpec(tp_size, rank, head_start, num_heads, kv_start, num_kv, rank * inter, inter,
                     rank * vocab_per_rank, vocab_per_rank, config.vocab_size,
                     rank * moe_inter, moe_inter)


def rank_config(config: ModelConfig, spec: ShardSpec) -> ModelConfig:
    """The config one rank's forward sees: its head, KV head, MLP and vocabulary counts."""
    return dataclasses.replace(config, num_attention_heads=spec.num_heads,
                               num_key_value_heads=spec.num_kv_heads,
                               intermediate_size=spec.inter_size, vocab_size=spec.vocab_size,
                               moe_intermediate_size=spec.moe_inter_size)


def _rows(start: int, count: int, unit: int = 1) -> slice:
    return slice(start * unit, (start + count) * unit)


def _vocab_slice(read, spec: ShardSpec, hidden: int) -> np.ndarray:
    """[spec.vocab_size, hidden] rows of an embedding-like tensor (read(index) reads rows of
    it), zero-padded past the vocab."""
    real = spec.num_real_vocab
    out = np.zeros((spec.vocab_size, hidden), np.float32)
    if real:
        out[:real] = read((slice(spec.vocab_start, spec.vocab_start + real),))
    return out


def _part_index(entry: TensorEntry, part: Part, spec: ShardSpec,
                ranges: dict[str, slice]) -> tuple | None:
    """The index into `part` (its own rows, the tensor's columns) rank `spec.rank` holds, by
    the entry's shard kind; None when the rank holds nothing of it."""
    everything = slice(None)
    if entry.shard == COLUMN:
        return (ranges[part.dim],)
    if entry.shard == ROW:
        return (everything, ranges[entry.cols])
    if entry.shard == ROW_BIAS:  # added once, before the all-reduce, by rank 0 only
        return (everything,) if spec.rank == 0 else None
    if entry.shard == REPLICATED:
        return (everything,)
    raise ValueError(f"{entry.name}: no part index for shard kind {entry.shard!r}")


def load_shard(source, config: ModelConfig, spec: ShardSpec, layers: range | None = None,
               embed: bool = True, head: bool = True) -> ModelWeights:
    """Rank `spec.rank`'s weights, from a model directory (read slice by slice) or from an
    in-memory ModelWeights (tests). Shapes are the rank's: see `rank_config`.
    A pipeline stage reads only its `layers` (model-wide indices; None: all), the embedding
    only when `embed` (the first stage) and the final norm and LM head only when `head` (the
    last); what it skips is None in the result.
    Walks the architecture's tensor map (runtime/families/base.py): each part of each
    checkpoint tensor is cut by its shard kind, so a fused tensor (Phi-3's qkv_proj) gives each
    rank its heads of q, k and v."""
    moe_inter = slice(spec.moe_inter_start, spec.moe_inter_start + spec.moe_inter_size)
    tensor_map = find_architecture(config.architecture).tensors
    if isinstance(source, ModelWeights):
        def read(entry: TensorEntry, part: Part, index: tuple, i: int) -> np.ndarray:
            holder = source if i < 0 else source.layers[i]
            return np.ascontiguousarray(getattr(holder, part.field)[index], dtype=np.float32)

        def experts(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return _experts_in_memory(source.layers[i], config, moe_inter)

        # ModelWeights hold Gemma's (1 + w) norms folded already (weights.py).
        offset = 0.0
    else:
        checkpoint = SafetensorsCheckpoint(source)

        def read(entry: TensorEntry, part: Part, index: tuple, i: int) -> np.ndarray:
            # The part's rows, moved to where it starts in the (maybe fused) tensor.
            start = entry.row_offsets(config)[entry.parts.index(part)]
            rows = index[0].indices(dim_size(config, part.dim))
            shifted = (slice(start + rows[0], start + rows[1]), *index[1:])
            return checkpoint.get(entry.name.format(i=max(i, 0)), entry.shape(config),
                                  np.float32, index=shifted)

        def experts(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return read_experts(checkpoint, config, i, np.float32, moe_inter)

        offset = config.norm_weight_offset

    hd = config.head_dim
    ranges = {DIM_Q: _rows(spec.head_start, spec.num_heads, hd),
              DIM_KV: _rows(spec.kv_head_start, spec.num_kv_heads, hd),
              DIM_INTER: _rows(spec.inter_start, spec.inter_size)}

    def take(entry: TensorEntry, i: int = -1) -> dict[str, np.ndarray | None]:
        """{field: this rank's slice} of one entry (i: the layer, -1 for model entries)."""
        out: dict[str, np.ndarray | None] = {}
        for part in entry.parts:
            if entry.shard == VOCAB:
                out[part.field] = _vocab_slice(
                    lambda index: read(entry, part, index, i), spec, config.hidden_size)
                continue
            index = _part_index(entry, part, spec, ranges)
            value = None if index is None else read(entry, part, index, i)
            if value is not None and entry.group == NORM and offset:
                value = value + np.float32(offset)
            out[part.field] = value
        return out

    layer_weights = []
    for i in (range(config.num_hidden_layers) if layers is None else layers):
        fields: dict[str, np.ndarray | None] = {}
        for entry in tensor_map.layer:
            if entry.present(config, i):
                fields.update(take(entry, i))
        if config.is_moe_layer(i):
            fields["router"], fields["experts_gate_up"], fields["experts_down"] = experts(i)
        layer_weights.append(LayerWeights(**fields))
    by_field = {part.field: entry for entry in tensor_map.model for part in entry.parts}
    tied = config.tie_word_embeddings
    table = (take(by_field["embed_tokens"])["embed_tokens"]
             if embed or (head and tied) else None)
    lm_head = None
    if head:
        lm_head = table if tied else take(by_field["lm_head"])["lm_head"]
    return ModelWeights(config=rank_config(config, spec), embed_tokens=table if embed else None,
                        layers=layer_weights,
                        norm=take(by_field["norm"])["norm"] if head else None, lm_head=lm_head)


def _experts_in_memory(layer: LayerWeights, config: ModelConfig,
                       inter: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(router, gate_up, down) of an in-memory MoE layer, each expert cut to features `inter`."""
    full = config.moe_intermediate_size
    gate_up = layer.experts_gate_up
    up = slice(full + inter.start, full + inter.stop)
    return (np.ascontiguousarray(layer.router, dtype=np.float32),
            np.ascontiguousarray(np.concatenate([gate_up[:, inter], gate_up[:, up]], axis=1),
                                 dtype=np.float32),
            np.ascontiguousarray(layer.experts_down[:, :, inter], dtype=np.float32))
