"""Loading a Hugging Face model directory's safetensors weights into `ModelWeights`.

Owns: reading safetensors files (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) through a memory map, widening bf16/fp16 to the requested numpy
dtype, and checking every tensor's presence and shape against `ModelConfig`; and the one
float32 <-> bf16 conversion (`to_bf16_bits` / `from_bf16_bits`) every layer uses.

The safetensors format is small enough to read directly: an 8-byte little-endian header length,
a JSON header mapping each tensor name to {dtype, shape, data_offsets}, then the raw bytes. We
parse it ourselves rather than through `safetensors.safe_open(framework="numpy")` because numpy
has no bfloat16 (most checkpoints are bf16) and because every defect (a truncated file, an offset
past the end, a size that does not match the shape) must become a `ModelLoadError` naming the
file and the tensor, never a numpy or Rust traceback.

Layout: weight matrices keep Hugging Face's `[out_features, in_features]` layout, so a linear
layer is `y = x @ W.T (+ b)`. Norm weights are `[hidden_size]` (Qwen3's per-head q/k norms:
`[head_dim]`); Gemma's (1 + w) norms are stored here already folded (`norm_weight_offset`
added at load), so the reference and every backend apply them as plain w. Which tensors a
layer has, and which weight field each fills, is the architecture's tensor map
(runtime/families/base.py; presence may follow config fields: biases, MoE layers' dense MLP).
With tied embeddings `lm_head` is the very same
array object as `embed_tokens`.

Mixture-of-experts layers (config.moe_layers) hold the router and every expert stacked, in the
layout the backends' `moe_experts` op takes (runtime/backends/base.py): gate rows then up rows
per expert, [num_experts, 2 * moe_intermediate, hidden], and down [num_experts, hidden,
moe_intermediate]. Both checkpoint layouts are read into it (`read_experts`): the hub's
per-expert matrices and transformers 5's fused 3-D tensors.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from .architectures import find_architecture
from .families.base import NORM, TensorEntry, dim_size
from .errors import ModelLoadError
from .model_config import ModelConfig

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
HEADER_LENGTH_BYTES = 8
# A header bigger than this is a corrupt length field, not a real header (real ones are KBs).
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"

# On-disk dtype name -> numpy dtype of its raw bits. bf16 is read as uint16 and widened.
_BF16 = "BF16"
_DISK_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    _BF16: np.dtype("<u2"),
    "I32": np.dtype("<i4"),  # AWQ / GPTQ packed int4 words (runtime/quantization/hf_int4.py)
}
_FLOAT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16))

# bfloat16 is the upper half of a float32.
_BF16_SHIFT = 16
_BF16_ROUND_BIAS = 0x7FFF         # plus the kept lsb: round half to even
_BF16_QUIET_NAN_BIT = 0x0040      # the top mantissa bit of a bf16
_F32_ABS_MASK = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000        # |bits| above this: NaN


# -- bfloat16 <-> float32 -----------------------------------------------------------------------
# Neither numpy nor cupy has a bfloat16 dtype: bf16 tensors are uint16 arrays of raw bits. These
# two functions are the one float32 <-> bf16 conversion of the Python code (the loader here;
# numpy_ops.round_to_bf16, the kernel wrappers and backends through kernel_args' re-export; the
# communicator). They live in this foundation-layer module so that every layer may use them.


def to_bf16_bits(x) -> np.ndarray:
    """float32 values -> uint16 bf16 bits: round to nearest, ties to even (RNE).

    Its C++ twin is f32_to_bf16 in pyx/cpu_gemm_kernels.h (the cpu GEMM's activations and
    weights; pyx/ may not import runtime/), and the CPU kernel harness's __float2bfloat16_rn
    (cuda/sim/fp16.cuh) follows the same rules; tests/foundation/test_bf16_rounding.py checks
    all of them bit for bit. Rules:
      - finite values round RNE; a value past the largest bf16 rounds to +-inf, as a bf16
        store does; subnormals round like any other value (no flush to zero); -0 stays -0;
      - +-inf stay +-inf;
      - NaN stays a quiet NaN with its sign: the top 16 bits with the quiet bit (0x0040) set,
        so the canonical NaN 0x7FC00000 becomes 0x7FC0 (the rounding bias must not be added:
        it could carry a NaN's payload into the exponent and turn it into inf).
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    upper = bits >> np.uint32(_BF16_SHIFT)
    rounded = (bits + np.uint32(_BF16_ROUND_BIAS) + (upper & np.uint32(1))) >> np.uint32(
        _BF16_SHIFT)
    is_nan = (bits & np.uint32(_F32_ABS_MASK)) > np.uint32(_F32_INF_BITS)
    return np.where(is_nan, upper | np.uint32(_BF16_QUIET_NAN_BIT), rounded).astype(np.uint16)


def from_bf16_bits(bits):
    """uint16 bf16 bits -> float32 values (exact). numpy in, numpy out; a cupy array in, cupy
    out (only array methods are used)."""
    if not hasattr(bits, "astype"):
        bits = np.asarray(bits, dtype=np.uint16)
    widened = bits.astype(np.uint16, copy=False).astype(np.uint32) << np.uint32(_BF16_SHIFT)
    return widened.view(np.float32)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, on-disk dtype name, shape and byte range in the data area."""

    file: pathlib.Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One memory-mapped safetensors file whose header has been fully validated."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)
        try:
            file_bytes = self.path.stat().st_size
        except FileNotFoundError:
            raise ModelLoadError(self.path, "file not found") from None
        if file_bytes < HEADER_LENGTH_BYTES:
            raise ModelLoadError(
                self.path, f"truncated: {file_bytes} bytes, too short for a safetensors header")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        header_bytes = int.from_bytes(self._map[:HEADER_LENGTH_BYTES].tobytes(), "little")
        if header_bytes > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + header_bytes > file_bytes:
            raise ModelLoadError(
                self.path,
                f"truncated or corrupt: header claims {header_bytes} bytes, file has {file_bytes}",
            )
        self._data_start = HEADER_LENGTH_BYTES + header_bytes
        data_bytes = file_bytes - self._data_start
        raw_header = self._map[HEADER_LENGTH_BYTES:self._data_start].tobytes()
        try:
            header = json.loads(raw_header.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(self.path, f"corrupt safetensors header: {exc}") from None
        if not isinstance(header, dict):
            raise ModelLoadError(self.path, "corrupt safetensors header: not a JSON object")
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == METADATA_KEY:
                continue
            info = self._parse_entry(name, entry)
            if info.end > data_bytes:
                raise ModelLoadError(
                    self.path,
                    f"truncated: needs data bytes up to {info.end}, file has {data_bytes}",
                    tensor=name,
                )
            self.tensors[name] = info

    def _parse_entry(self, name: str, entry: object) -> TensorInfo:
        def bad(message: str) -> ModelLoadError:
            return ModelLoadError(self.path, f"corrupt header entry: {message}", tensor=name)

        if not isinstance(entry, dict):
            raise bad("not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad(f"dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
            raise bad(f"shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_index(o) for o in offsets) or offsets[0] > offsets[1]):
            raise bad(f"data_offsets {offsets!r}")
        begin, end = offsets
        if dtype in _DISK_DTYPES:
            expected_bytes = math.prod(shape) * _DISK_DTYPES[dtype].itemsize
            if end - begin != expected_bytes:
                raise bad(f"{end - begin} bytes for shape {shape} of {dtype} "
                          f"(expected {expected_bytes})")
        return TensorInfo(self.path, dtype, tuple(shape), begin, end)

    def read(self, name: str, dtype: np.dtype, index=None) -> np.ndarray:
        """The tensor `name` (or `raw[index]` of it: only those bytes are read from the memory
        map; tensor-parallel ranks read their shards so) as a new C-contiguous `dtype` array."""
        info = self.tensors[name]
        if info.dtype not in _DISK_DTYPES:
            raise ModelLoadError(
                self.path, f"unsupported dtype {info.dtype} (supported: {', '.join(_DISK_DTYPES)})",
                tensor=name,
            )
        start = self._data_start + info.begin
        raw = (self._map[start:self._data_start + info.end]
               .view(_DISK_DTYPES[info.dtype]).reshape(info.shape))
        if index is not None:
            raw = raw[index]
        if info.dtype == _BF16:
            return np.ascontiguousarray(from_bf16_bits(raw), dtype=dtype)
        return np.array(raw, dtype=dtype, order="C", copy=True)


class SafetensorsCheckpoint:
    """All weight files of one model directory, addressed by tensor name."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        self.model_dir = pathlib.Path(model_dir)
        index_path = self.model_dir / INDEX_FILE_NAME
        single_path = self.model_dir / SINGLE_FILE_NAME
        self._files: dict[str, SafetensorsFile] = {}
        self._file_by_tensor: dict[str, SafetensorsFile] = {}
        if index_path.is_file():
            self._open_sharded(index_path)
        elif single_path.is_file():
            shard = SafetensorsFile(single_path)
            self._files[SINGLE_FILE_NAME] = shard
            self._file_by_tensor = {name: shard for name in shard.tensors}
        else:
            raise ModelLoadError(
                self.model_dir, f"no {SINGLE_FILE_NAME} or {INDEX_FILE_NAME} in this directory"
            )

    def _open_sharded(self, index_path: pathlib.Path) -> None:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(index_path, f"not valid JSON: {exc}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index_path, "no 'weight_map' object", field="weight_map")
        for name, file_name in weight_map.items():
            # Shards sit next to the index; a path component would point outside the model.
            if not isinstance(file_name, str) or pathlib.PurePath(file_name).name != file_name:
                raise ModelLoadError(index_path, f"bad shard file name {file_name!r}", tensor=name)
            if file_name not in self._files:
                shard_path = self.model_dir / file_name
                if not shard_path.is_file():
                    raise ModelLoadError(shard_path, f"shard listed in {index_path.name} not found",
                                         tensor=name)
                self._files[file_name] = SafetensorsFile(shard_path)
            shard = self._files[file_name]
            if name not in shard.tensors:
                raise ModelLoadError(shard.path,
                                     f"listed in {index_path.name} but not in this shard",
                                     tensor=name)
            self._file_by_tensor[name] = shard

    def names(self) -> list[str]:
        return sorted(self._file_by_tensor)

    def __contains__(self, name: str) -> bool:
        return name in self._file_by_tensor

    def info(self, name: str) -> TensorInfo:
        return self._file_by_tensor[name].tensors[name]

    def get(
        self,
        name: str,
        expected_shape: tuple[int, ...] | None = None,
        dtype: np.dtype | type = np.float32,
        index=None,
    ) -> np.ndarray:
        """Tensor `name` (or its `[index]` slice) as a new C-contiguous `dtype` array, the whole
        tensor's shape checked if given."""
        if name not in self._file_by_tensor:
            where = self._describe_files()
            raise ModelLoadError(where, "missing from the checkpoint", tensor=name)
        shard = self._file_by_tensor[name]
        shape = shard.tensors[name].shape
        if expected_shape is not None and shape != tuple(expected_shape):
            raise ModelLoadError(
                shard.path,
                f"shape {list(shape)} does not match the config's {list(expected_shape)}",
                tensor=name,
            )
        return shard.read(name, np.dtype(dtype), index)

    def _describe_files(self) -> pathlib.Path:
        if len(self._files) == 1:
            return next(iter(self._files.values())).path
        return self.model_dir / INDEX_FILE_NAME


@dataclass
class LayerWeights:
    """One decoder layer. Matrices are [out_features, in_features]; biases are [out_features].
    Which fields a family fills is its tensor map's (runtime/families/base.py); the rest stay
    None."""

    input_layernorm: np.ndarray | None = None           # [hidden_size]
    q_proj: np.ndarray | None = None      # [num_attention_heads * head_dim, hidden_size]
    k_proj: np.ndarray | None = None      # [num_key_value_heads * head_dim, hidden_size]
    v_proj: np.ndarray | None = None      # [num_key_value_heads * head_dim, hidden_size]
    o_proj: np.ndarray | None = None      # [hidden_size, num_attention_heads * head_dim]
    # The biases are present if config.attention_bias, else None.
    q_bias: np.ndarray | None = None      # [num_attention_heads * head_dim]
    k_bias: np.ndarray | None = None      # [num_key_value_heads * head_dim]
    v_bias: np.ndarray | None = None      # [num_key_value_heads * head_dim]
    o_bias: np.ndarray | None = None      # [hidden_size] if config.o_proj_bias
    post_attention_layernorm: np.ndarray | None = None  # [hidden_size]
    # The dense MLP; None in a mixture-of-experts layer.
    gate_proj: np.ndarray | None = None   # [intermediate_size, hidden_size]
    up_proj: np.ndarray | None = None     # [intermediate_size, hidden_size]
    down_proj: np.ndarray | None = None   # [hidden_size, intermediate_size]
    # Per-head RMSNorm weights of q and k, present if config.qk_norm (Qwen3), else None.
    q_norm: np.ndarray | None = None      # [head_dim]
    k_norm: np.ndarray | None = None      # [head_dim]
    # A mixture-of-experts layer (config.is_moe_layer): router and stacked experts, else None.
    router: np.ndarray | None = None           # [num_experts, hidden_size]
    experts_gate_up: np.ndarray | None = None  # [num_experts, 2 * moe_intermediate, hidden]
    experts_down: np.ndarray | None = None     # [num_experts, hidden, moe_intermediate]
    # config.post_sublayer_norms (Gemma 3): the MLP input's and output's norms, else None
    # (post_attention_layernorm is then the attention output's norm).
    pre_feedforward_layernorm: np.ndarray | None = None   # [hidden_size]
    post_feedforward_layernorm: np.ndarray | None = None  # [hidden_size]


@dataclass
class ModelWeights:
    """A whole model's weights, in one float dtype, shapes checked against `config`."""

    config: ModelConfig
    # A pipeline stage's shard (sharding.load_shard) has None for the parts it does not hold.
    embed_tokens: np.ndarray | None  # [vocab_size, hidden_size]
    layers: list[LayerWeights]
    norm: np.ndarray | None          # [hidden_size]
    lm_head: np.ndarray | None       # [vocab_size, hidden_size]; `is embed_tokens` when tied


def load_model_weights(
    model_dir: str | os.PathLike,
    config: ModelConfig | None = None,
    dtype: np.dtype | type = np.float32,
    linears: dict | None = None,
) -> ModelWeights:
    """Load every weight of a model directory of any registered architecture as `dtype`
    (float64/32/16) arrays: the tensors its tensor map lists (runtime/families/base.py),
    fused checkpoint tensors split into their weight fields, plus MoE layers' experts.

    `config` defaults to the directory's own config.json. Extra tensors in the files (e.g. old
    `rotary_emb.inv_freq` buffers) are ignored; a missing or misshaped one is a ModelLoadError.
    `linears`: {HF ".weight" name: matrix} already read in another form (a quantization
    method's read_linears, runtime/quantization/), used in place of those tensors (their
    shapes checked).
    """
    dtype = np.dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in _FLOAT_DTYPES]}, got {dtype}")
    if config is None:
        config = ModelConfig.from_model_dir(model_dir)
    checkpoint = SafetensorsCheckpoint(model_dir)
    tensor_map = find_architecture(config.architecture).tensors

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if linears and name in linears:
            if tuple(linears[name].shape) != tuple(shape):
                raise ModelLoadError(model_dir, f"shape {list(linears[name].shape)} does not "
                                     f"match the config's {list(shape)}", tensor=name)
            return linears[name]
        return checkpoint.get(name, shape, dtype)

    def read(entry: TensorEntry, layer_index: int = 0) -> dict[str, np.ndarray]:
        """{weight field: array} of one map entry (several for a fused checkpoint tensor)."""
        name = entry.name.format(i=layer_index)
        tensor = get(name, entry.shape(config))
        if entry.group == NORM and config.norm_weight_offset:
            # Gemma's (1 + w) folded here, so every RMSNorm op and kernel serves it as plain w;
            # torch adds in float32 (float64 stays).
            wide = np.promote_types(dtype, np.float32)
            tensor = (tensor.astype(wide) + wide.type(config.norm_weight_offset)).astype(dtype)
        if len(entry.parts) == 1:
            return {entry.parts[0].field: tensor}
        if not isinstance(tensor, np.ndarray):
            raise ModelLoadError(model_dir, "a fused tensor in a quantized form is not split "
                                 "here", tensor=name)
        rows = [dim_size(config, part.dim) for part in entry.parts]
        pieces = np.split(tensor, np.cumsum(rows)[:-1], axis=0)
        return {part.field: np.ascontiguousarray(piece)
                for part, piece in zip(entry.parts, pieces)}

    layers = []
    for i in range(config.num_hidden_layers):
        fields: dict[str, np.ndarray] = {}
        for entry in tensor_map.layer:
            if entry.present(config, i):
                fields.update(read(entry, i))
        if config.is_moe_layer(i):
            fields["router"], fields["experts_gate_up"], fields["experts_down"] = read_experts(
                checkpoint, config, i, dtype)
        layers.append(LayerWeights(**fields))
    tops: dict[str, np.ndarray] = {}
    for entry in tensor_map.model:
        if entry.present(config):
            tops.update(read(entry))
    if config.tie_word_embeddings:
        tops["lm_head"] = tops["embed_tokens"]
    return ModelWeights(config=config, layers=layers, **tops)


def read_experts(
    checkpoint: SafetensorsCheckpoint,
    config: ModelConfig,
    layer_index: int,
    dtype: np.dtype | type = np.float32,
    inter: slice = slice(None),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer `layer_index`'s (router [E, hidden], gate_up [E, 2 * n, hidden], down [E, hidden,
    n]) for the experts' intermediate features `inter` (n of them; all by default, a
    tensor-parallel rank's slice otherwise: only those rows are read), from either checkpoint
    layout (see the module docstring and architectures.ExpertNames)."""
    names = find_architecture(config.architecture).expert_names
    num_experts, hidden = config.num_experts, config.hidden_size
    full = config.moe_intermediate_size
    base = f"model.layers.{layer_index}."
    prefix = next((base + p for p in names.prefixes if base + p + "gate.weight" in checkpoint),
                  base + names.prefixes[0])
    router = checkpoint.get(prefix + "gate.weight", (num_experts, hidden), dtype)
    start, stop, _ = inter.indices(full)
    every = slice(None)
    fused = prefix + "experts.gate_up_proj"
    if fused in checkpoint:
        shape = (num_experts, 2 * full, hidden)
        gate = checkpoint.get(fused, shape, dtype, index=(every, slice(start, stop)))
        up = checkpoint.get(fused, shape, dtype, index=(every, slice(full + start, full + stop)))
        gate_up = np.concatenate([gate, up], axis=1)
        down = checkpoint.get(prefix + "experts.down_proj", (num_experts, hidden, full), dtype,
                              index=(every, every, slice(start, stop)))
        return router, gate_up, down
    rows = slice(start, stop)
    gate_up = np.empty((num_experts, 2 * (stop - start), hidden), dtype)
    down = np.empty((num_experts, hidden, stop - start), dtype)
    for e in range(num_experts):
        expert = f"{prefix}experts.{e}."
        gate_up[e, :stop - start] = checkpoint.get(expert + names.gate + ".weight",
                                                   (full, hidden), dtype, index=(rows,))
        gate_up[e, stop - start:] = checkpoint.get(expert + names.up + ".weight",
                                                   (full, hidden), dtype, index=(rows,))
        down[e] = checkpoint.get(expert + names.down + ".weight", (hidden, full), dtype,
                                 index=(every, rows))
    return router, gate_up, down


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
