"""SentencePiece ("llama") GGUF vocabularies -> tokenizer.json (Llama 2 / Mistral style).

The tiny vocabulary in tiny_gguf.py has scores chosen so the SentencePiece merge order can be
followed by hand: "▁hello▁world" merges he, ll, or, ld, hell, hello, ▁hello, ▁w, ▁wor, ▁world.
Characters outside the vocabulary fall back to <0xNN> byte tokens.
"""
from __future__ import annotations

import json

import pytest

from pagedrun.runtime.detokenizer import IncrementalDetokenizer
from pagedrun.runtime.gguf_convert import convert_gguf, sentencepiece_merges
from pagedrun.runtime.tokenizer import Tokenizer

import pagedrun_tests_tiny_gguf as tiny_gguf  # registered by tests/conftest.py


S = tiny_gguf.SPM_SPACE


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    model = tiny_gguf.write_tiny_gguf(tmp / "spm.gguf", num_layers=1, tokenizer="spm")
    out = convert_gguf(model.path, tmp / "hf")
    return model, Tokenizer.from_dir(out), out


def _ids(model, pieces):
    return [model.tokens.index(p) for p in pieces]


def test_merges_follow_scores():
    tokens, scores, types = tiny_gguf.spm_vocab()
    merges = sentencepiece_merges(tokens, scores, types)
    assert merges[:4] == [("h", "e"), ("l", "l"), ("o", "r"), ("l", "d")]
    assert merges[-1] == (S + "wor", "ld")
    assert ("he", "ll") in merges and ("hell", "o") in merges


def test_encode_adds_bos_and_space_prefix(spm):
    model, tokenizer, _ = spm
    assert tokenizer.encode("hello world") == _ids(model, ["<s>", S + "hello", S + "world"])
    assert (tokenizer.encode("hello world", add_special_tokens=False)
            == _ids(model, [S + "hello", S + "world"]))


def test_unknown_characters_fall_back_to_bytes(spm):
    model, tokenizer, _ = spm
    ids = tokenizer.encode("héllo", add_special_tokens=False)
    assert ids == _ids(model, [S, "h", "<0xC3>", "<0xA9>", "ll", "o"])


@pytest.mark.parametrize("text", ["hello world", "héllo 世界 🎉", "  two spaces", "world hello"])
def test_round_trip(spm, text):
    _, tokenizer, _ = spm
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_config_files(spm):
    _, tokenizer, out = spm
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True
    assert config["bos_token"] == "<s>" and config["unk_token"] == "<unk>"
    assert tokenizer.all_special_ids == frozenset({0, 1, 2})


def test_streaming_keeps_spaces_between_words_and_joins_bytes(spm):
    model, tokenizer, _ = spm
    prompt = tokenizer.encode("hello")
    generated = tokenizer.encode("world héllo 世界", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    deltas = [detok.add_token(t) for t in generated]
    assert deltas[0] == " world"          # the prompt context keeps the word's leading space
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == " world héllo 世界"
