"""Hugging Face int4 checkpoints kept int4 (EngineConfig.quantization "awq" / "gptq"): the
projection matrices of an AutoAWQ or GPTQ checkpoint read into an exact in-memory form the cpu
int4 kernel computes on; everything else (norms, embeddings, the LM head, any projection the
checkpoint left unquantized) goes through the float32 loader (runtime/weights.py).

    method = checkpoint_quant_method(model_dir)                 # "awq", "gptq" or None
    linears = read_int4_linears(model_dir, config, method)      # {HF ".weight" name: Int4Matrix}

Both formats quantize W [out, in] (HF's layout) in groups of `group_size` consecutive inputs per
output: W[o, i] = s[i // g, o] * (q[o, i] - z[i // g, o]), q and z 4-bit integers, s fp16.
They differ only in how the nibbles are packed into int32 words (all little-endian; nibble j
of a word = bits 4j .. 4j + 3):

AWQ (AutoAWQ's "gemm" version; llm-awq / AutoAWQ's pack routine, and vLLM's awq dequantizer
which undoes it): qweight int32 [in, out / 8] -- word (i, c) holds the 8 outputs 8c .. 8c + 7
of input i, interleaved: nibble j holds output 8c + AWQ_ORDER[j], AWQ_ORDER = 0 2 4 6 1 3 5 7.
qzeros int32 [in / g, out / 8] packed the same way; scales fp16 [in / g, out]. zero_point true
only; the "gemv" versions pack differently and are refused.

GPTQ (AutoGPTQ / GPTQModel's classic "gptq" checkpoint_format, v1; vLLM's gptq loader):
qweight int32 [in / 8, out] -- word (r, o) holds inputs 8r .. 8r + 7 of output o in order
(nibble j = input 8r + j); qzeros int32 [in / g, out / 8] -- nibble j of word (gi, c) = output
8c + j, stored as z - 1 (the v1 quirk: z = (stored + 1) mod 16); scales fp16 [in / g, out];
g_idx int32 [in] (input -> group): i // g, or with desc_act (act order) any assignment that gives
every group exactly g inputs (GPTQ quantizes the inputs in order of decreasing Hessian diagonal,
input perm[j] in group j // g, so g_idx[perm[j]] = j // g). checkpoint_format "gptq_v2" stores z
itself. `sym` changes nothing here (z is stored either way).

Act order is served kept int4 by sorting the inputs by group: perm = argsort(g_idx) (stable),
the matrix's column j holds input perm[j], so its groups are again g consecutive columns and the
kernels run unchanged; the matrix carries `input_perm` and the method's apply gathers x[:, perm]
before the GEMM (y = W x = W[:, perm] x[perm]). q/k/v (and gate/up) read the same input, and
GPTQ orders a layer's inputs by that input's Hessian, so their perms agree and they still fuse
(base.KeptQuantizedMethod; differing perms are dequantized there instead).

Accepted: bits 4, group_size 32 / 64 / 128 (the kernel's groups), in_features a multiple of the
group and out_features of 8. The result is an Int4Matrix: a QuantizedMatrix of type "I4Z" whose
raw rows are pagedrun.pyx.cpu_gemm's I4Z rows (row o: in / 2 bytes of nibbles, input 2t in the
low nibble of byte t and 2t + 1 in the high one; then in / g fp16 s; then in / g bytes z), so
row stacking (fused q/k/v, gate/up) and the backend's PackedGgufWeight(raw, "I4Z", in) work on it
unchanged; dequantize() is the numpy reference.
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.errors import ModelLoadError

from .base import KeptQuantizedMethod, register
from .blocks import QuantizedMatrix

INT4_METHODS = ("awq", "gptq")
INT4_TYPE = "I4Z"  # pagedrun.pyx.cpu_gemm.INT4_TYPE (pyx/ and runtime/ do not import each other)
INT4_GROUPS = (32, 64, 128)  # pagedrun.pyx.cpu_gemm.INT4_GROUPS
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds output 8c + AWQ_ORDER[j]
GPTQ_FORMATS = ("gptq", "gptq_v2")
# The projections a checkpoint may hold as int4 (HF names model.layers.N.{name}.qweight ...).
LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(eq=False)
class Int4Matrix(QuantizedMatrix):
    """An HF [out, in] int4 matrix: ggml_type "I4Z", raw the cpu_gemm I4Z rows (module doc).
    input_perm: None, or int64 [in] for an act-order GPTQ matrix: raw's column j holds input
    input_perm[j] (parts() are in that column order; dequantize() in the inputs' order)."""

    input_perm: np.ndarray | None = None

    @property
    def group(self) -> int:
        k = self.shape[1]
        return k // ((self.raw.shape[1] - k // 2) // 3)

    def parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q uint8 [out, in], s float16 [out, in / g], z uint8 [out, in / g])."""
        k = self.shape[1]
        groups = k // self.group
        nib = self.raw[:, :k // 2]
        q = np.stack([nib & np.uint8(0x0F), nib >> np.uint8(4)], axis=2).reshape(-1, k)
        s = np.ascontiguousarray(self.raw[:, k // 2:k // 2 + 2 * groups]).view(np.float16)
        return q, s, self.raw[:, k // 2 + 2 * groups:]

    def dequantize(self) -> np.ndarray:
        """float32 [out, in] = s * (q - z) (exact: an fp16 times a 5-bit integer), columns in
        the inputs' order (an act-order matrix's columns put back)."""
        q, s, z = self.parts()
        g = self.group
        per_s = np.repeat(s.astype(np.float32), g, axis=1)
        per_z = np.repeat(z.astype(np.float32), g, axis=1)
        w = (per_s * (q.astype(np.float32) - per_z)).astype(np.float32)
        if self.input_perm is None:
            return w
        out = np.empty_like(w)
        out[:, self.input_perm] = w
        return out

    def take_rows(self, rows: np.ndarray) -> "Int4Matrix":
        rows = np.asarray(rows)
        return Int4Matrix(self.ggml_type, (int(rows.size), self.shape[1]),
                          np.ascontiguousarray(self.raw[rows]), release=self.release,
                          input_perm=self.input_perm)

    @classmethod
    def from_parts(cls, q, s, z) -> "Int4Matrix":
        """q uint8 [out, in] (0..15), s float16 [out, in / g], z uint8 [out, in / g] (0..15)."""
        q = np.asarray(q, dtype=np.uint8)
        nib = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
        raw = np.concatenate([nib, np.ascontiguousarray(s, dtype=np.float16).view(np.uint8),
                              np.asarray(z, dtype=np.uint8)], axis=1)
        return cls(INT4_TYPE, (int(q.shape[0]), int(q.shape[1])), np.ascontiguousarray(raw))


def read_quantization_config(model_dir: str | os.PathLike) -> dict | None:
    """config.json's `quantization_config` object, or None (no such key, or no config.json)."""
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"not valid JSON: {exc}") from None
    qc = data.get("quantization_config") if isinstance(data, dict) else None
    if qc is not None and not isinstance(qc, dict):
        raise ModelLoadError(path, "quantization_config is not an object",
                             field="quantization_config")
    return qc


def checkpoint_quant_method(model_dir: str | os.PathLike | None) -> str | None:
    """quantization_config.quant_method of an HF directory (lower case), or None."""
    if model_dir is None or not pathlib.Path(model_dir).is_dir():
        return None
    qc = read_quantization_config(model_dir)
    method = qc.get("quant_method") if qc else None
    return method.lower() if isinstance(method, str) else None


def int4_settings(model_dir: str | os.PathLike, method: str) -> dict:
    """The checked quantization_config of an AWQ / GPTQ checkpoint: {"group": g, "format": ...}.
    A setting this loader cannot serve exactly is a ModelLoadError saying which."""
    where = pathlib.Path(model_dir) / "config.json"
    qc = read_quantization_config(model_dir)
    if qc is None:
        raise ModelLoadError(where, f"quantization {method!r} needs a checkpoint with a "
                             "quantization_config (this one has none)")
    found = str(qc.get("quant_method", "")).lower()
    if found != method:
        raise ModelLoadError(where, f"quantization {method!r} but the checkpoint's quant_method "
                             f"is {found!r}", field="quantization_config")

    def refuse(field: str, why: str) -> ModelLoadError:
        return ModelLoadError(where, why, field=f"quantization_config.{field}")

    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse("bits", f"{method}: only 4-bit weights are served, got bits={bits!r}")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in INT4_GROUPS:
        raise refuse("group_size", f"{method}: group_size must be one of {INT4_GROUPS} (the "
                     f"cpu int4 kernel's groups), got {group!r}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse("version", f"awq: only AutoAWQ's 'gemm' packing is read, got "
                         f"{version!r}")
        if qc.get("zero_point", True) is not True:
            raise refuse("zero_point", "awq: only zero_point true (asymmetric) is read")
        return {"group": group, "format": "awq"}
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in GPTQ_FORMATS:
        raise refuse("checkpoint_format", f"gptq: checkpoint_format must be one of "
                     f"{GPTQ_FORMATS}, got {fmt!r}")
    return {"group": group, "format": fmt}


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., n] -> uint8 [..., n, 8]: nibble j of each word at [..., j]."""
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((u[..., None] >> shifts) & np.uint32(0xF)).astype(np.uint8)


def _awq_columns(words: np.ndarray) -> np.ndarray:
    """AWQ-packed int32 [rows, out / 8] -> uint8 [rows, out] in output order."""
    nib = _nibbles(words)  # [rows, out / 8, 8]: nibble j = output 8c + AWQ_ORDER[j]
    out = np.empty_like(nib)
    out[:, :, list(AWQ_ORDER)] = nib
    return out.reshape(words.shape[0], -1)


def unpack_awq(qweight, qzeros, scales, group: int) -> Int4Matrix:
    """AutoAWQ gemm tensors (module doc) -> Int4Matrix [out, in]."""
    q = _awq_columns(qweight).T  # [out, in]
    z = _awq_columns(qzeros).T   # [out, in / g]
    return Int4Matrix.from_parts(q, np.asarray(scales, np.float16).T, z)


def act_order_perm(g_idx: np.ndarray, group: int) -> np.ndarray | None:
    """The input order that makes act-order groups consecutive (module doc): None when g_idx
    is already input // group; ValueError unless every group holds exactly `group` inputs."""
    g_idx = np.asarray(g_idx)
    n_in = g_idx.shape[0]
    if np.array_equal(g_idx, np.arange(n_in) // group):
        return None
    counts = np.bincount(g_idx, minlength=n_in // group) if g_idx.min(initial=0) >= 0 else None
    if counts is None or counts.shape[0] != n_in // group or np.any(counts != group):
        raise ValueError(f"g_idx does not put exactly {group} inputs in each of the "
                         f"{n_in // group} groups")
    return np.argsort(g_idx, kind="stable").astype(np.int64)


def unpack_gptq(qweight, qzeros, scales, group: int, fmt: str = "gptq",
                g_idx=None) -> Int4Matrix:
    """GPTQ tensors (module doc; fmt "gptq": zeros stored minus one) -> Int4Matrix [out, in];
    an act-order g_idx gives a matrix with its input_perm (ValueError: a g_idx that is not)."""
    nib = _nibbles(qweight)  # [in / 8, out, 8]: nibble j = input 8r + j
    q = nib.transpose(1, 0, 2).reshape(qweight.shape[1], -1)  # [out, in]
    z = _nibbles(qzeros).reshape(qzeros.shape[0], -1)  # [in / g, out]
    if fmt == "gptq":
        z = (z + np.uint8(1)) & np.uint8(0xF)
    perm = None if g_idx is None else act_order_perm(g_idx, group)
    if perm is not None:
        q = q[:, perm]  # column j: input perm[j], of group j // group
    matrix = Int4Matrix.from_parts(q, np.asarray(scales, np.float16).T, z.T)
    matrix.input_perm = perm
    return matrix


def read_int4_linears(model_dir: str | os.PathLike, config, method: str) -> dict[str, Int4Matrix]:
    """{"model.layers.N.<proj>.weight": Int4Matrix} for every projection `model_dir` stores as
    qweight / qzeros / scales; shapes checked against `config` (a ModelConfig)."""
    from pagedrun.runtime.weights import SafetensorsCheckpoint

    settings = int4_settings(model_dir, method)
    group = settings["group"]
    checkpoint = SafetensorsCheckpoint(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {"self_attn.q_proj": (config.q_size, hidden),
              "self_attn.k_proj": (config.kv_size, hidden),
              "self_attn.v_proj": (config.kv_size, hidden),
              "self_attn.o_proj": (hidden, config.q_size),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    out: dict[str, Int4Matrix] = {}
    for layer in range(config.num_hidden_layers):
        for name in LINEAR_NAMES:
            base = f"model.layers.{layer}.{name}"
            if base + ".qweight" not in checkpoint:
                continue  # left in float (modules_to_not_convert): the float loader reads it
            n_out, n_in = shapes[name]
            if n_in % group or n_out % 8:
                raise ModelLoadError(model_dir, f"{method}: [{n_out}, {n_in}] does not split "
                                     f"into groups of {group} inputs and words of 8 outputs",
                                     tensor=base + ".qweight")
            if method == "awq":
                want = {"qweight": (n_in, n_out // 8), "qzeros": (n_in // group, n_out // 8)}
            else:
                want = {"qweight": (n_in // 8, n_out), "qzeros": (n_in // group, n_out // 8)}
            want["scales"] = (n_in // group, n_out)
            qweight = checkpoint.get(base + ".qweight", want["qweight"], np.int32)
            qzeros = checkpoint.get(base + ".qzeros", want["qzeros"], np.int32)
            scales = checkpoint.get(base + ".scales", want["scales"], np.float16)
            if method == "awq":
                out[base + ".weight"] = unpack_awq(qweight, qzeros, scales, group)
                continue
            g_idx = None
            if base + ".g_idx" in checkpoint:
                g_idx = checkpoint.get(base + ".g_idx", (n_in,), np.int32)
            try:
                out[base + ".weight"] = unpack_gptq(qweight, qzeros, scales, group,
                                                    settings["format"], g_idx)
            except ValueError as exc:
                raise ModelLoadError(model_dir, f"gptq: {exc}", tensor=base + ".g_idx") from None
    if not out:
        raise ModelLoadError(model_dir, f"{method}: no .qweight tensors in the checkpoint")
    return out


class Int4Method(KeptQuantizedMethod):
    """An AWQ / GPTQ checkpoint's projections kept int4 (module doc); the rest float32."""

    def __init__(self, name: str) -> None:
        self.name = name

    def read_linears(self, model_dir, config, gguf_file=None):
        return read_int4_linears(model_dir, config, self.name)


for _method in INT4_METHODS:
    register(Int4Method(_method))
