"""End to end on the default model (SmolLM2-135M-Instruct): the offline LLM, batched and paged,
reproduces transformers' greedy continuations (tests/fixtures/default_model.json) token for
token and text for text, plain prompts through `generate` and chat cases through `chat`."""
from __future__ import annotations

import json
import pathlib

import pytest

from pagedrun.runtime.sampling_params import SamplingParams

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "default_model.json"


@pytest.fixture(scope="module")
def llm():
    from pagedrun import LLM
    from pagedrun.runtime.errors import ModelLoadError

    try:
        # dtype float32: the float reference (dtype auto serves the file's own Q4_1 blocks,
        # whose agreement is tests/engine/test_cpu_gguf.py's).
        return LLM(device="cpu", dtype="float32", max_model_len=256, block_size=16,
                   max_num_batched_tokens=64)
    except ModelLoadError as exc:  # the default model package is not installed
        pytest.skip(str(exc))


# Enough tokens to cross several decode steps of a 6-request batch; a greedy continuation's
# prefix is itself the greedy continuation, so comparing a prefix of the fixture is exact.
NUM_COMPARED_TOKENS = 12


def test_default_model_matches_transformers(llm):
    record = json.loads(FIXTURE.read_text(encoding="utf-8"))
    cases = record["cases"]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_COMPARED_TOKENS)
    outputs = llm.generate([c["prompt_token_ids"] for c in cases], params)
    for case, out in zip(cases, outputs):
        completion = out.outputs[0]
        expected = case["output_token_ids"][:NUM_COMPARED_TOKENS]
        assert completion.token_ids == expected
        assert case["output_text"].startswith(completion.text)
        eos = expected[-1] in record["eos_token_ids"]
        assert completion.finish_reason == ("stop" if eos else "length")
        if len(case["output_token_ids"]) <= NUM_COMPARED_TOKENS:
            assert completion.text == case["output_text"]


def test_default_model_prompts_and_chat_render_like_transformers(llm):
    record = json.loads(FIXTURE.read_text(encoding="utf-8"))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    plain = [c for c in record["cases"] if c["messages"] is None]
    chats = [c for c in record["cases"] if c["messages"] is not None]
    outputs = llm.generate([c["prompt"] for c in plain], one) + llm.chat(
        [c["messages"] for c in chats], one)
    for case, out in zip(plain + chats, outputs):
        assert out.prompt_token_ids == case["prompt_token_ids"]
        assert out.outputs[0].token_ids == case["output_token_ids"][:1]
