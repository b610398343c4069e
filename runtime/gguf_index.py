"""GgufIndex: a GGUF file's metadata and tensor table, read in milliseconds, the tensors as views
of one read-only memory map.

Hand-written rather than gguf-py's GGUFReader, which builds a numpy view for every part of every
metadata value: the default model's 49,152-token vocabulary (three arrays of that length) took
1.5-3.2 s to index on the 2-core dev box, most of a cold start. This reads the same format (GGUF
v2 / v3, little-endian: the header, the key / value pairs, the tensor infos, then the data at
`general.alignment`) and keeps only what serving needs: scalar and string values (arrays are
skipped, their element count kept) and each tensor's name, GGML type, shape and bytes.
gguf-py stays the converter's reader (runtime/gguf_convert.py), and tests check this index
against it.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # the spec's, when general.alignment is absent
# Value types (the spec's numbering): fixed-size scalars, string (8), array (9).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGML tensor types: id -> (name, weights per block, bytes per block), the ggml type traits
# (tests/foundation/test_gguf_index.py checks this table against gguf-py's; importing gguf-py
# for it cost ~40 ms of a cold start).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str             # GGML type, e.g. "Q4_1", "F32"
    shape: tuple[int, ...]     # GGML order (fastest-varying dimension first)
    data: np.ndarray           # uint8 view of the tensor's bytes in the file


class GgufIndex:
    """index = GgufIndex(path); index.fields[key] (scalars and strings; arrays as
    ("array", count)); index.tensors (file order). The memory map stays open while any tensor
    view is referenced."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(self.path, f"cannot read GGUF: {exc}") from exc
        buf = self._map
        self._pos = 0
        if self._take(4) != GGUF_MAGIC:
            raise ModelLoadError(self.path, "not a GGUF file (bad magic)")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(self.path, f"GGUF version {version} is not supported (2, 3)")
        num_tensors, num_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        data = np.frombuffer(buf, dtype=np.uint8)
        self._base = data.__array_interface__["data"][0]
        self.tensors: list[GgufTensor] = []
        for name, dims, type_id, offset in infos:
            if type_id not in GGML_TYPES:
                raise ModelLoadError(self.path, f"unknown GGML type {type_id}", tensor=name)
            type_name, block, block_bytes = GGML_TYPES[type_id]
            count = int(np.prod(dims, dtype=np.int64)) if dims else 1
            nbytes = count // block * block_bytes
            begin = start + offset
            if count % block or begin + nbytes > len(buf):
                raise ModelLoadError(self.path, "tensor data out of the file's bounds",
                                     tensor=name)
            self.tensors.append(GgufTensor(name, type_name, dims, data[begin:begin + nbytes]))

    def drop_pages(self, tensor: GgufTensor) -> None:
        """Let go of the tensor's resident pages (MADV_DONTNEED on the read-only map: they stay
        in the page cache, leave this process's RSS, and fault back in if read again). For a
        tensor the cpu backend has repacked into its own layout: its file bytes are not read
        again (the embedding table's rows are, a few a step)."""
        advise = getattr(self._map, "madvise", None)
        dont_need = getattr(mmap, "MADV_DONTNEED", None)
        if advise is None or dont_need is None:
            return
        start = tensor.data.__array_interface__["data"][0] - self._base
        end = start + tensor.data.nbytes
        start -= start % mmap.PAGESIZE
        if end > start:
            advise(dont_need, start, end - start)

    def get(self, key: str, default=None):
        value = self.fields.get(key, default)
        return default if isinstance(value, tuple) else value  # arrays are not kept

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._map):
            raise ModelLoadError(self.path, "truncated GGUF header")
        out = self._map[self._pos:end]
        self._pos = end
        return out

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._unpack("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ModelLoadError(self.path, f"unknown GGUF value type {kind}")
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item in _SCALARS:  # fixed size: skipped in one step
            self._take(struct.calcsize(_SCALARS[item]) * count)
        elif item == _STRING:  # a length before each string: walked, not decoded
            mm, pos = self._map, self._pos
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", mm, pos)
                pos += 8 + length
            if pos > len(mm):
                raise ModelLoadError(self.path, "truncated GGUF metadata array")
            self._pos = pos
        else:  # nested arrays: not used by the model families served
            for _ in range(count):
                self._value(item)
        return ("array", count)
