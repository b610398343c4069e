"""Writes tiny Llama/Qwen2 GGUF files for the foundation tests, the way llama.cpp stores them.

Not a test module: tests/conftest.py loads it by path once (pytest runs with
--import-mode=importlib, so the tests folder is not on sys.path) and registers it as
`pagedrun_tests_tiny_gguf`, which test modules import. `write_tiny_gguf` returns the original
Hugging Face weights (float32, [out, in]) next to the file, so tests can compare a conversion
against them.

What it reproduces of llama.cpp's converter, written from its documented behaviour:
- tensor names (token_embd, blk.N.attn_q, ..., output_norm, output) and GGML's reversed shape
  order (the writer takes numpy [out, in] arrays and records GGML's [in, out]);
- for the Llama architecture, q/k rows permuted within each head by
  reshape(num_heads, 2, head_dim // 2, in).swapaxes(1, 2) (see `llama_cpp_permute`);
- quantization with gguf.quants.quantize (row blocks of 32 along the input dimension);
- a byte-level BPE vocabulary: 256 byte symbols, a few merges, control and user-defined tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKENS = ["<tool>"]
# Merged symbols, each merge joining two existing symbols (byte-level: "Ġ" is the space byte).
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "r l", "Ġwo rl", "Ġworl d", "Ã ©"]


# SentencePiece vocabulary (tokenizer "llama"): pieces and scores; a higher score merges first.
SPM_SPACE = "\u2581"
SPM_SINGLES = [SPM_SPACE, "h", "e", "l", "o", "w", "r", "d"]
SPM_MERGED = ["he", "ll", "or", "ld", "hell", "hello", SPM_SPACE + "hello", SPM_SPACE + "w",
              SPM_SPACE + "wor", SPM_SPACE + "world"]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a tiny SentencePiece BPE vocabulary with byte fallback."""
    import gguf

    tokens = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
              + SPM_SINGLES + SPM_MERGED)
    scores = ([0.0] * (3 + 256) + [-100.0] * len(SPM_SINGLES)
              + [-1.0 - i for i in range(len(SPM_MERGED))])
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * (len(SPM_SINGLES) + len(SPM_MERGED)))
    return tokens, scores, [int(t) for t in types]


def byte_symbols() -> list[str]:
    """The 256 byte-level BPE symbols in byte order (GPT-2's printable remapping of bytes)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    symbols = {}
    next_free = 256
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(next_free)
            next_free += 1
    return [symbols[b] for b in range(256)]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: weight [num_heads * head_dim, ...] -> same shape."""
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *rest)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@dataclass
class TinyModel:
    path: Path
    hf_weights: dict[str, np.ndarray]      # original HF tensors, float32
    gguf_types: dict[str, str]             # HF name -> GGML type name stored
    tokens: list[str]
    config: dict = field(default_factory=dict)


# Type per role; each test model alternates so every type appears on permuted and plain rows.
LAYER_TYPES = [
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "F16",
     "ffn_gate": "BF16", "ffn_up": "F32", "ffn_down": "Q4_1"},
    {"attn_q": "F16", "attn_k": "BF16", "attn_v": "F32", "attn_output": "Q4_0",
     "ffn_gate": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q4_0"},
    {"attn_q": "F32", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "BF16",
     "ffn_gate": "F16", "ffn_up": "Q8_0", "ffn_down": "F32"},
]
HF_ROLE = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _representable(values: np.ndarray, type_name: str) -> np.ndarray:
    """Round float32 values so a float type stores them exactly (F16, BF16); others unchanged."""
    if type_name == "F16":
        return values.astype(np.float16).astype(np.float32)
    if type_name == "BF16":
        bits = values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        return bits.view(np.float32)
    return values


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 3,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 96,
    tied: bool = False,
    embed_type: str = "Q8_0",
    tokenizer: str = "gpt2",
) -> TinyModel:
    """Write a random tiny model; sizes must keep every quantized row a multiple of 32."""
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = hidden_size // num_heads
    if tokenizer == "gpt2":
        tokens = (SPECIAL_TOKENS + byte_symbols() + [m.replace(" ", "") for m in MERGES]
                  + USER_DEFINED_TOKENS)
        token_types = (
            [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
            + [gguf.TokenType.NORMAL]
            * (len(tokens) - len(SPECIAL_TOKENS) - len(USER_DEFINED_TOKENS))
            + [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED_TOKENS)
        )
    else:
        tokens, scores, token_types = spm_vocab()
    vocab_size = len(tokens)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if tokenizer == "gpt2":
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_merges(MERGES)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
    else:
        # Llama 2 style: scores instead of merges; BOS and the space prefix left to defaults.
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)

    hf: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}

    def add(gguf_name: str, hf_name: str, values: np.ndarray, type_name: str,
            permute_heads: int = 0) -> None:
        values = _representable(values.astype(np.float32), type_name)
        hf[hf_name] = values
        types[hf_name] = type_name
        stored = llama_cpp_permute(values, permute_heads) if permute_heads else values
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(stored, dtype=np.float32))
        elif type_name == "F16":
            writer.add_tensor(gguf_name, np.ascontiguousarray(stored, dtype=np.float16))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(stored), qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)

    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    add("token_embd.weight", "model.embed_tokens.weight", randn(vocab_size, hidden_size),
        embed_type)
    shapes = {
        "attn_q": (num_heads * head_dim, hidden_size),
        "attn_k": (num_kv_heads * head_dim, hidden_size),
        "attn_v": (num_kv_heads * head_dim, hidden_size),
        "attn_output": (hidden_size, num_heads * head_dim),
        "ffn_gate": (intermediate_size, hidden_size), "ffn_up": (intermediate_size, hidden_size),
        "ffn_down": (hidden_size, intermediate_size),
    }
    permuted = arch == "llama"
    for layer in range(num_layers):
        prefix, hf_prefix = f"blk.{layer}.", f"model.layers.{layer}."
        add(prefix + "attn_norm.weight", hf_prefix + "input_layernorm.weight",
            1 + randn(hidden_size) * 0.1, "F32")
        add(prefix + "ffn_norm.weight", hf_prefix + "post_attention_layernorm.weight",
            1 + randn(hidden_size) * 0.1, "F32")
        for role, type_name in LAYER_TYPES[layer % len(LAYER_TYPES)].items():
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(role, 0) if permuted else 0
            add(prefix + role + ".weight", hf_prefix + HF_ROLE[role] + ".weight",
                randn(*shapes[role]), type_name, heads)
        if arch == "qwen2":
            for role in ("attn_q", "attn_k", "attn_v"):
                add(prefix + role + ".bias", hf_prefix + HF_ROLE[role] + ".bias",
                    randn(shapes[role][0]), "F32")
    add("output_norm.weight", "model.norm.weight", 1 + randn(hidden_size) * 0.1, "F32")
    if not tied:
        add("output.weight", "lm_head.weight", randn(vocab_size, hidden_size), "F16")

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                  vocab_size=vocab_size, tied=tied)
    return TinyModel(path=Path(path), hf_weights=hf, gguf_types=types, tokens=tokens, config=config)

