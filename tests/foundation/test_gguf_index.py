"""runtime/gguf_index.py (the serving path's GGUF reader) against gguf-py's GGUFReader on the
default model's own file and on files written by gguf-py's GGUFWriter: the same tensors (name,
type, shape, bytes) and scalar values; broken files refused with the file named."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pagedrun.runtime.errors import ModelLoadError  # noqa: E402
from pagedrun.runtime.gguf_index import GGML_TYPES, GgufIndex  # noqa: E402


def test_type_table_is_ggmls():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for type_id, (name, block, block_bytes) in GGML_TYPES.items():
        kind = GGMLQuantizationType(type_id)
        assert kind.name == name and GGML_QUANT_SIZES[kind] == (block, block_bytes)
    # (a type newer than this table is refused by name as "unknown GGML type": no kernel or
    # converter of ours reads it either)


def _same_as_gguf_py(path):
    index = GgufIndex(path)
    reader = gguf.GGUFReader(str(path))
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.type_name == theirs.tensor_type.name
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        np.testing.assert_array_equal(ours.data, np.asarray(theirs.data).view(np.uint8).ravel())
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # gguf-py's pseudo-fields for the header
            continue
        value = index.fields[key]
        if isinstance(value, tuple):  # an array: only its length is kept
            assert value == ("array", len(field.data))
        else:
            assert value == field.contents(), key
    return index


def test_the_default_models_file():
    from pagedrun.runtime.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    index = _same_as_gguf_py(path)
    assert index.get("general.architecture") == "llama"
    assert index.fields["tokenizer.ggml.tokens"] == ("array", 49152)
    assert {t.type_name for t in index.tensors} >= {"Q4_1", "Q8_0"}


def _write(path, alignment=None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "dddd"])
    w.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5, 3.5])
    w.add_bool("general.flag", True)
    q = gguf.quants.quantize(rng.standard_normal((17, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("blk.0.ffn_down.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("output_norm.weight", rng.standard_normal(7).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_files_gguf_py_writes(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    _write(path, alignment)
    index = _same_as_gguf_py(path)
    assert index.get("general.name") == "tiny ünïcode"
    assert index.get("tokenizer.ggml.tokens") is None  # arrays: counted, not kept
    down = index.tensors[0]
    assert down.type_name == "Q4_1" and down.shape == (64, 17) and down.data.nbytes == 17 * 2 * 20


def test_broken_files_are_refused(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelLoadError, match="magic"):
        GgufIndex(bad)
    for cut in (10, 100, len(data) - 8):
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="bad.gguf"):
            GgufIndex(bad)
    bad.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        GgufIndex(bad)


def test_dropped_pages_read_back_the_same(tmp_path):
    """drop_pages only lets go of resident pages: the bytes read afterwards are the file's."""
    path = tmp_path / "tiny.gguf"
    _write(path)
    index = GgufIndex(path)
    before = [t.data.copy() for t in index.tensors]
    for tensor in index.tensors:
        index.drop_pages(tensor)
    for tensor, want in zip(index.tensors, before):
        np.testing.assert_array_equal(tensor.data, want)


def test_quantized_matrices_carry_their_release(tmp_path):
    """read_quantized_linears' matrices drop their file pages when the backend asks, and a
    fused (stacked) or row-permuted matrix drops those of every part it was made from."""
    from pagedrun.runtime.quantization import QuantizedMatrix

    calls = []
    parts = [QuantizedMatrix("Q4_1", (2, 32), np.zeros((2, 20), np.uint8),
                             release=lambda i=i: calls.append(i)) for i in range(3)]
    fused = QuantizedMatrix.stack(parts)
    fused.release_pages()
    assert calls == [0, 1, 2]
    parts[0].take_rows(np.array([1, 0])).release_pages()
    assert calls == [0, 1, 2, 0]
    QuantizedMatrix("Q4_1", (2, 32), np.zeros((2, 20), np.uint8)).release_pages()  # no-op
