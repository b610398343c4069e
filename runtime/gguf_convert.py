"""GGUF file -> Hugging Face model directory (config, weights, tokenizer, chat template).

`convert_gguf(gguf_path, out_dir)` writes what the rest of paged-run loads from any Hugging Face
checkpoint: `config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`. The result is meant to equal the checkpoint llama.cpp's converter
started from, up to the quantization the GGUF applied:

- Weights are dequantized with the `gguf` library (every type it knows: F32/F16/BF16, Q4_0,
  Q4_1, Q8_0, the k-quants...) and stored as float32. float32 is the only narrow format that
  holds dequantized values exactly: Q4_1 is `d * q + m` with fp16 `d`, `m` and a 4-bit `q`, and
  Q8_0 is `d * q` with an 8-bit `q`; those products and sums need up to ~20 significant bits.
  On SmolLM2-135M Q4_1, 62% of the values are not representable in fp16 and 89% not in bf16.
  The cost is size (135M params -> 540 MB), which is acceptable for a reference-exact cache.
- llama.cpp's converter permutes the rows of `attn_q` and `attn_k` of Llama-architecture models
  so its interleaved (GPT-J style) rotary embedding gives the same result as Hugging Face's
  half-split (NeoX style) one; `unpermute_rotary_rows` undoes it. Qwen2 and Gemma 3 GGUFs are
  not permuted.
- Gemma 3 (`gemma3`): its converter stores the (1 + w) norms as w + 1 (subtracted back here) and
  leaves out what llama.cpp's runtime assumes (every 6th layer global, local rope base 10000,
  query_pre_attn_scalar = head_dim except 27B's hidden / heads); the config says them.
- `tokenizer.json` is rebuilt from the vocabulary, merges and token types in the metadata: a
  byte-level BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Qwen2, Llama 3) with the
  pre-tokenizer named by `tokenizer.ggml.pre`, or a SentencePiece BPE with byte fallback
  (`"llama"`: Llama 2, Mistral) whose merges are rebuilt from the token scores.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from pagedrun.runtime.architectures import ARCHITECTURES, gguf_architecture
from pagedrun.runtime.errors import ModelLoadError

# Bump when the written directory changes in any way; default_model.py keys its cache on it.
CONVERTER_VERSION = 1

WEIGHTS_FILE = "model.safetensors"
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
)

# GGUF architecture name -> (HF model_type, HF architectures entry, q/k rows permuted?): the
# registered architectures that name a `gguf_arch` (runtime/architectures.py).
_ARCHITECTURES = {arch.gguf_arch: (arch.model_type, arch.name, arch.gguf_rotary_permuted)
                  for arch in ARCHITECTURES if arch.gguf_arch is not None}
GEMMA3 = "gemma3"
# What llama.cpp's gemma3 GGUFs leave out and its runtime assumes: every 6th layer global, local
# layers at rope base 10000, and Gemma's (1 + w) norms stored as w + 1 by its converter.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_NORM_SHIFT = 1.0
# Gemma 3 27B (62 layers) scales attention by (hidden / heads) ** -0.5, the others by
# head_dim ** -0.5 (query_pre_attn_scalar in their HF configs; llama.cpp keys on the size).
GEMMA3_27B_BLOCK_COUNT = 62

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type enum).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Pre-tokenizer split patterns, by `tokenizer.ggml.pre`. Written from the published tokenizers'
# behaviour: Qwen2 splits digits one at a time, Llama 3 in runs of up to three.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# SentencePiece's visible space (U+2581 LOWER ONE EIGHTH BLOCK).
SPM_SPACE = "\u2581"
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm", "starcoder", "qwen2", "llama-bpe")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    weight: [num_heads * head_dim, ...] (a projection matrix [out, in] or a bias [out]).
    llama.cpp stores, inside each head, the row `j * head_dim/2 + i` of the HF weight at row
    `2 * i + j` (j in {0, 1}: first or second rotary half; i: the frequency index), so that
    rotating adjacent pairs equals HF's rotation of the two halves. Reading each stored head as
    [head_dim/2, 2] and transposing to [2, head_dim/2] puts every row back where HF had it.
    """
    num_rows = weight.shape[0]
    if num_rows % (2 * num_heads) != 0:
        raise ValueError(f"{num_rows} rows do not split into {num_heads} heads of even size")
    half = num_rows // num_heads // 2
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape).copy()
    )


class GGUFMetadata:
    """Typed access to a GGUFReader's key/value fields, with errors that name the file."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.reader = reader
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(self.path, "missing GGUF metadata", field=key)
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def arch(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{suffix}", default)

    def require_arch(self, suffix: str) -> Any:
        return self.require(f"{self.architecture}.{suffix}")


def hf_config_from_gguf(
    meta: GGUFMetadata, vocab_size: int, tied: bool, attention_bias: bool = False
) -> dict:
    """The Hugging Face config.json dict for a GGUF's hyper-parameters.

    tied: the GGUF has no `output.weight` (lm_head is the embedding). attention_bias: it has
    `attn_q.bias` (Llama's flag; Qwen2 always has q/k/v biases).
    """
    arch = meta.architecture
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            meta.path,
            f"architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})",
            field="general.architecture",
        )
    model_type, hf_arch, _ = _ARCHITECTURES[arch]
    hidden_size = int(meta.require_arch("embedding_length"))
    num_heads = int(meta.require_arch("attention.head_count"))
    num_kv_heads = int(meta.arch("attention.head_count_kv", num_heads))
    head_dim = int(meta.arch("attention.key_length", hidden_size // num_heads))
    rotary_dim = int(meta.arch("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ModelLoadError(
            meta.path,
            f"partial rotary embedding ({rotary_dim} of {head_dim} dims) is not supported",
            field=f"{arch}.rope.dimension_count",
        )
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.require_arch("feed_forward_length")),
        "num_hidden_layers": int(meta.require_arch("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.arch("context_length", 2048)),
        "rms_norm_eps": float(meta.require_arch("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.arch("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if model_type == "llama":
        config.update(attention_bias=attention_bias, mlp_bias=False, pretraining_tp=1)
    elif arch == GEMMA3:
        del config["hidden_act"]
        num_layers = config["num_hidden_layers"]
        pattern = int(meta.arch("attention.sliding_window_pattern",
                                GEMMA3_SLIDING_WINDOW_PATTERN))
        config.update(
            hidden_activation="gelu_pytorch_tanh", attention_bias=False,
            sliding_window=int(meta.require_arch("attention.sliding_window")),
            layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                         for i in range(num_layers)],
            rope_local_base_freq=GEMMA3_LOCAL_ROPE_THETA,
            query_pre_attn_scalar=(hidden_size // num_heads
                                   if num_layers == GEMMA3_27B_BLOCK_COUNT else head_dim),
            final_logit_softcapping=None, attn_logit_softcapping=None)
        if config["rope_scaling"] is None:
            del config["rope_scaling"]
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    return config


def _rope_scaling(meta: GGUFMetadata) -> dict | None:
    kind = meta.arch("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear",
                "factor": float(meta.require_arch("rope.scaling.factor"))}
    raise ModelLoadError(meta.path, f"rope scaling {kind!r} is not supported",
                         field="rope.scaling.type")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture `arch`; None for tensors HF does
    not store (or an architecture not registered). The names are the architecture's tensor map's
    (runtime/families/base.py): Gemma 3's ffn_norm is the MLP input's norm (HF
    pre_feedforward_layernorm), and it has three more norms per layer."""
    architecture = gguf_architecture(arch)
    if architecture is None:
        return None
    tensors = architecture.tensors
    for entry in tensors.model:
        if entry.gguf == gguf_name:
            return entry.name
    parts = gguf_name.split(".")
    if len(parts) < 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    pattern = ".".join(["blk", "{i}", *parts[2:]])
    for entry in tensors.layer:
        if entry.gguf == pattern:
            return entry.name.format(i=int(parts[1]))
    return None


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF reader tensor as float32 [rows, cols] (HF's [out, in] order), or [n] for 1-D."""
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # tensor.shape is GGML's order (fastest dimension first); HF's order is its reverse.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def convert_weights(meta: GGUFMetadata, tensors: Iterable[Any]) -> dict[str, np.ndarray]:
    """Dequantize and rename every tensor; undo the q/k row permutation for Llama."""
    _, _, permuted = _ARCHITECTURES[meta.architecture]
    num_heads = int(meta.require_arch("attention.head_count"))
    num_kv_heads = int(meta.arch("attention.head_count_kv", num_heads))
    out: dict[str, np.ndarray] = {}
    for tensor in tensors:
        name = hf_tensor_name(tensor.name, meta.architecture)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                raise ModelLoadError(
                    meta.path, "per-frequency rope scaling (Llama 3.1 style) is not supported",
                    tensor=tensor.name,
                )
            raise ModelLoadError(meta.path, "unknown tensor", tensor=tensor.name)
        try:
            values = dequantize_tensor(tensor)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(
                meta.path, f"cannot dequantize {tensor.tensor_type.name}: {exc}", tensor=tensor.name
            ) from exc
        if permuted and ".attn_q." in tensor.name:
            values = unpermute_rotary_rows(values, num_heads)
        elif permuted and ".attn_k." in tensor.name:
            values = unpermute_rotary_rows(values, num_kv_heads)
        if meta.architecture == GEMMA3 and name.endswith("norm.weight"):
            values = values - np.float32(GEMMA3_NORM_SHIFT)  # back to HF's w of (1 + w)
        out[name] = values
    return out


def _token_strings(meta: GGUFMetadata) -> list[str]:
    tokens = meta.require("tokenizer.ggml.tokens")
    return [str(t) for t in tokens]


def build_tokenizer(meta: GGUFMetadata) -> Any:
    """A `tokenizers.Tokenizer` equal to the one the GGUF's vocabulary came from.

    "gpt2" vocabularies are byte-level BPE with their merges stored in the GGUF; "llama" ones
    are SentencePiece BPE with byte fallback, whose merges are rebuilt from the token scores.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import normalizers, processors

    kind = meta.require("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            meta.path, f"tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' or "
            "SentencePiece BPE 'llama')", field="tokenizer.ggml.model",
        )
    tokens = _token_strings(meta)
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type",
                                            [TOKEN_TYPE_NORMAL] * len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(meta.path, "duplicate tokens in vocabulary",
                             field="tokenizer.ggml.tokens")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = None if unk_id is None else tokens[int(unk_id)]
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tokenizer = Tokenizer(models.BPE(
            vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=False, byte_fallback=False,
        ))
        tokenizer.pre_tokenizer = _pre_tokenizer(meta, pre_tokenizers, Regex)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError(meta.path, "missing GGUF metadata", field="tokenizer.ggml.scores")
        tokenizer = Tokenizer(models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(tokens, [float(x) for x in scores], token_types),
            unk_token=unk_token, fuse_unk=True, byte_fallback=True,
        ))
        # SentencePiece marks spaces with U+2581 and (add_space_prefix) puts one before the text;
        # decoding maps it back, joins <0xNN> byte tokens into characters, and drops that space.
        steps = [normalizers.Replace(" ", SPM_SPACE)]
        decode_steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
            steps.insert(0, normalizers.Prepend(SPM_SPACE))
            decode_steps.append(decoders.Strip(" ", 1, 0))
        tokenizer.normalizer = normalizers.Sequence(steps)
        tokenizer.decoder = decoders.Sequence(decode_steps)
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, typ in zip(tokens, token_types)
        if typ in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, typ in zip(tokens, token_types)
        if typ == TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    # SentencePiece GGUFs (Llama 2, Mistral) add BOS unless they say otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos_id is not None:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, int(bos_id))],
        )
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float],
                         token_types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece BPE's scores.

    SentencePiece BPE repeatedly joins the adjacent pair whose joined piece has the highest
    score. As a merge list: every split (left, right) of a normal piece into two pieces that are
    themselves in the vocabulary is a merge producing that piece, ranked by the piece's score
    (ties keep vocabulary order; the splits of one piece are ordered by their parts' ids).
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for piece_id, piece in enumerate(tokens):
        if token_types[piece_id] != TOKEN_TYPE_NORMAL:
            continue
        splits = [
            (piece[:cut], piece[cut:]) for cut in range(1, len(piece))
            if piece[:cut] in vocab and piece[cut:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((-scores[piece_id], piece_id, left, right) for left, right in splits)
    ranked.sort(key=lambda entry: (entry[0], entry[1]))
    return [(left, right) for _, _, left, right in ranked]


def _pre_tokenizer(meta: GGUFMetadata, pre_tokenizers: Any, Regex: Any) -> Any:
    name = str(meta.get("tokenizer.ggml.pre", "default"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("default", "gpt-2", "gpt2"):
        return byte_level
    if name in ("smollm", "starcoder"):
        # Digits one by one, then GPT-2's split and byte mapping.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in ("qwen2", "llama-bpe"):
        pattern = _QWEN2_SPLIT if name == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ModelLoadError(
        meta.path,
        f"pre-tokenizer {name!r} is not supported (supported: {SUPPORTED_PRE_TOKENIZERS})",
        field="tokenizer.ggml.pre",
    )


def tokenizer_config(meta: GGUFMetadata, context_length: int) -> dict:
    """tokenizer_config.json: special tokens, chat template, BOS/EOS behaviour."""
    tokens = _token_strings(meta)
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type",
                                            [TOKEN_TYPE_NORMAL] * len(tokens))]
    is_spm = meta.get("tokenizer.ggml.model") == "llama"

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[int(token_id)]

    added = {
        str(i): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": typ in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN),
        }
        for i, (tok, typ) in enumerate(zip(tokens, token_types))
        if typ in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED)
    }
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", is_spm)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", is_spm)),
        "added_tokens_decoder": added,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return config


def generation_config(meta: GGUFMetadata) -> dict:
    """generation_config.json: the ids generation starts and stops on."""
    config: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    # End-of-generation ids: EOS plus the end-of-turn / end-of-message ids where the GGUF has them.
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = int(pad)
    return config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 progress: bool = False) -> Path:
    """Convert a GGUF file into a Hugging Face directory at `out_dir` (created if missing).

    Writes OUTPUT_FILES; existing files of those names are replaced. Raises ModelLoadError for an
    unreadable or unsupported GGUF. `progress` shows a tqdm bar over tensors on stderr.
    """
    import gguf
    from safetensors.numpy import save_file

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(gguf_path, f"cannot read GGUF file: {exc}") from exc
    meta = GGUFMetadata(reader, gguf_path)
    tensors = list(reader.tensors)
    names = {t.name for t in tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError(gguf_path, "missing tensor", tensor="token_embd.weight")
    vocab_size = int(next(t for t in tensors if t.name == "token_embd.weight").shape[1])
    config = hf_config_from_gguf(meta, vocab_size, tied="output.weight" not in names,
                                 attention_bias="blk.0.attn_q.bias" in names)
    tokenizer = build_tokenizer(meta)

    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"converting {gguf_path.name}", unit="tensor", leave=False)
    weights = convert_weights(meta, tensors)

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(meta))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json",
                tokenizer_config(meta, config["max_position_embeddings"]))
    return out_dir
