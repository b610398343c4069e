"""tokenizer.json and tokenizer_config.json rebuilt from a tiny GGUF's vocabulary and merges.

The expected token sequences are worked out by hand from the merges tiny_gguf.py writes
(byte-level BPE: "Ġ" is the space byte, "Ã©" the two bytes of "é").
"""
from __future__ import annotations

import json

import pytest

from pagedrun.runtime.gguf_convert import convert_gguf
from pagedrun.runtime.tokenizer import Tokenizer

import pagedrun_tests_tiny_gguf as tiny_gguf  # registered by tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    model = tiny_gguf.write_tiny_gguf(tmp / "tiny.gguf", num_layers=1, seed=1)
    out = convert_gguf(model.path, tmp / "hf")
    return model, Tokenizer.from_dir(out), out


def _ids(model, pieces):
    return [model.tokens.index(p) for p in pieces]


def test_merges_apply_in_rank_order(tiny):
    model, tokenizer, _ = tiny
    assert tokenizer.encode("hello world") == _ids(model, ["hello", "Ġworld"])
    # "hel" + "p": "h e" merges, "l l" cannot (one l), so he + l + p.
    assert tokenizer.encode("help") == _ids(model, ["he", "l", "p"])


def test_digits_are_split_one_by_one(tiny):
    model, tokenizer, _ = tiny
    assert tokenizer.encode("2024") == _ids(model, ["2", "0", "2", "4"])


def test_multibyte_text_round_trips(tiny):
    model, tokenizer, _ = tiny
    text = "héllo 世界 🎉"
    ids = tokenizer.encode(text)
    assert model.tokens.index("Ã©") in ids
    assert tokenizer.decode(ids) == text


def test_special_tokens_match_in_text_and_are_skippable(tiny):
    model, tokenizer, _ = tiny
    ids = tokenizer.encode("<|im_start|>hello<|im_end|>")
    assert ids == [1, model.tokens.index("hello"), 2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello"
    assert tokenizer.decode(ids) == "<|im_start|>hello<|im_end|>"
    assert tokenizer.all_special_ids == frozenset({0, 1, 2})


def test_user_defined_token_is_added_but_not_special(tiny):
    model, tokenizer, _ = tiny
    tool = model.tokens.index("<tool>")
    assert tokenizer.encode("<tool>") == [tool]
    assert tokenizer.decode([tool], skip_special_tokens=True) == "<tool>"


def test_no_bos_added_when_gguf_says_so(tiny):
    _, tokenizer, _ = tiny
    assert (tokenizer.encode("hello", add_special_tokens=True)
            == tokenizer.encode("hello", add_special_tokens=False))


def test_tokenizer_config_carries_template_and_special_tokens(tiny):
    _, tokenizer, out = tiny
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tiny_gguf.CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_bos_is_added_when_gguf_asks(tmp_path):
    import gguf

    # Same vocabulary, add_bos_token true: rebuild the file with that one flag changed.
    model = tiny_gguf.write_tiny_gguf(tmp_path / "a.gguf", num_layers=1)
    reader = gguf.GGUFReader(model.path)
    writer = gguf.GGUFWriter(str(tmp_path / "bos.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = True if key == "tokenizer.ggml.add_bos_token" else field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = convert_gguf(tmp_path / "bos.gguf", tmp_path / "hf")
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer.encode("hello") == [1, model.tokens.index("hello")]
    assert tokenizer.encode("hello", add_special_tokens=False) == [model.tokens.index("hello")]
