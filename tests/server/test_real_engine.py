"""End to end with the real LLMEngine (numpy backend): a tiny fixture model for concurrency,
aborts and prefix-cache usage, and the default model (SmolLM2-135M) for one real answer."""
from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from pagedrun.client import AsyncClient, Client
from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.sampling_params import SamplingParams

TINY_MODEL = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny", "llama_tied_bf16")
NUM_REQUESTS = 24


def tiny_engine(**overrides) -> LLMEngine:
    cfg = dict(model=TINY_MODEL, device="cpu", num_kv_blocks=96, max_num_seqs=8,
               max_num_batched_tokens=64, check_invariants=True)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def alone(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The reference: the same request served by a fresh engine with nothing else running."""
    engine = tiny_engine()
    engine.add_request("ref", prompt_token_ids=prompt_ids, sampling_params=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
    return tokens


def test_concurrent_requests_match_alone_and_free_every_block(start_server):
    rng = random.Random(7)
    shared_prefix = [rng.randrange(3, 257) for _ in range(35)]
    jobs = []
    for i in range(NUM_REQUESTS):
        tail = [rng.randrange(3, 257) for _ in range(rng.choice([1, 5, 19, 30]))]
        prompt = (shared_prefix + tail) if i % 2 else tail
        role = "abort" if i % 6 == 5 else "complete"
        jobs.append((prompt, rng.randint(3, 40), role))
    _, ep = start_server(tiny_engine())

    async def one(prompt, max_tokens, role):
        async with AsyncClient(ep, timeout_s=60) as c:
            s = await c.stream(prompt_token_ids=prompt, sampling_params={
                "max_tokens": max_tokens if role == "complete" else 80,
                "temperature": 0.0, "ignore_eos": True})
            got = []
            async for d in s:
                got.extend(d.token_ids)
                if role == "abort" and len(got) >= 2:
                    await s.aclose()
                    return None
            return got, s.result

    async def run_all():
        return await asyncio.wait_for(asyncio.gather(*[one(*job) for job in jobs]), 120)

    results = asyncio.run(run_all())
    cached = 0
    for (prompt, max_tokens, role), res in zip(jobs, results):
        if role == "complete":
            got, final = res
            assert got == alone(prompt, max_tokens)
            assert final.usage["prompt_tokens"] == len(prompt)
            assert final.usage["completion_tokens"] == max_tokens
            cached += final.usage["cached_prompt_tokens"]
    assert cached > 0  # the shared 35-token prefix was served from the prefix cache
    with Client(ep, timeout_s=10) as c:
        deadline = time.monotonic() + 20
        while (stats := c.stats())["gauges"]["server_requests_in_flight"] and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        info = c.model_info()
    g = stats["gauges"]
    assert g["num_free_blocks"] == g["num_total_blocks"] == 96
    assert g["num_requests_running"] == g["num_requests_waiting"] == 0
    assert stats["counters"]["request_abort_total"] == NUM_REQUESTS // 6
    assert stats["counters"]["prefix_cache_hits"] > 0
    # Every request was scheduled (the aborted ones streamed two tokens first); with
    # max_num_seqs 8 and 24 requests some waited, so the queue times add up to more than 0.
    queue = stats["histograms"]["request_queue_time_seconds"]
    assert queue["count"] == sum(queue["counts"]) == NUM_REQUESTS and queue["sum"] > 0
    assert info["kv_capacity_tokens"] == 96 * 16 and info["vocab_size"] == 257


def test_engine_rejections_become_error_codes(start_server):
    from pagedrun.client import CapacityError, InvalidRequestError, PromptTooLongError
    _, ep = start_server(tiny_engine(num_kv_blocks=4))  # 64 tokens of KV in all
    with Client(ep, timeout_s=10) as c:
        with pytest.raises(InvalidRequestError):  # this fixture model has no tokenizer
            c.generate("text needs a tokenizer")
        with pytest.raises(PromptTooLongError):
            c.generate(prompt_token_ids=[5] * 129)
        with pytest.raises(CapacityError) as info:  # 60 + 20 tokens need 5 blocks
            c.generate(prompt_token_ids=[5] * 60, sampling_params={"max_tokens": 20})
        assert info.value.code == "capacity"
        # The message comes without the code in front (the engine's RequestError str() has it;
        # the wire carries the code beside the message): no "capacity: capacity: ...".
        assert not info.value.message.startswith("capacity"), info.value.message
        ok = c.generate(prompt_token_ids=[5] * 10, sampling_params={"max_tokens": 3})
        assert len(ok.token_ids) >= 1


@pytest.fixture(scope="module")
def default_engine():
    return LLMEngine(EngineConfig(model=None, device="cpu", max_model_len=512,
                                  num_kv_blocks=256))


@pytest.mark.slow
def test_default_model_answers_through_the_server(start_server, default_engine):
    _, ep = start_server(default_engine)
    with Client(ep, timeout_s=120) as c:
        info = c.model_info()
        out = c.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                         sampling_params={"max_tokens": 16, "temperature": 0})
    assert info["tokenizer"]["has_chat_template"] is True
    assert "Paris" in out.text, out.text
    assert out.usage["completion_tokens"] <= 16 and out.metrics["time_to_first_token_s"] > 0


@pytest.mark.slow
def test_server_side_tokenization_matches_the_engine(default_engine):
    """The I/O thread tokenizes prompts and chat messages itself; the ids must be exactly the
    ones the engine computes when handed the text (its RequestOutput.prompt_token_ids)."""
    from pagedrun.server.server import Server
    from pagedrun.server.validation import GenerateRequest

    prompt = "Héllo <|im_start|> wörld"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    engine = default_engine
    one = SamplingParams(max_tokens=1)
    engine.add_request("text", prompt=prompt, sampling_params=one)
    engine.add_request("chat", messages=messages, sampling_params=one)
    by_engine = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_engine[out.request_id] = out.prompt_token_ids

    class RecordingLoop:
        def __init__(self):
            self.added = {}

        def add(self, engine_id, kwargs):
            self.added[engine_id] = kwargs

    server = Server(engine)
    server._loop = RecordingLoop()  # capture what would be handed to the engine thread
    server._on_generate(b"id", GenerateRequest("a", one, prompt=prompt))
    server._on_generate(b"id", GenerateRequest("b", one, messages=messages))
    a, b = server._loop.added.values()
    assert "prompt" not in a and "messages" not in b
    assert a["prompt_token_ids"] == list(by_engine["text"])
    assert b["prompt_token_ids"] == list(by_engine["chat"])


@pytest.mark.slow
def test_server_side_chat_options_match_the_engine(default_engine):
    """Protocol 1.3: with chat options the I/O thread renders exactly what the engine renders
    for LLMEngine.add_request(messages=, chat_options=); add_generation_prompt and
    continue_final_message change the prompt the way their names say."""
    from pagedrun.runtime.chat_options import ChatOptions
    from pagedrun.server.server import Server
    from pagedrun.server.validation import GenerateRequest

    engine = default_engine
    one = SamplingParams(max_tokens=1)
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    cases = {
        "gen": (history[:1], ChatOptions()),
        "nogen": (history[:1], ChatOptions(add_generation_prompt=False)),
        "cont": (history, ChatOptions(add_generation_prompt=False,
                                      continue_final_message=True)),
        "closed": (history, ChatOptions(add_generation_prompt=False)),
        "own": (history[:1], ChatOptions(chat_template="{% for m in messages %}"
                                         "{{ m.role }}: {{ m.content }}\n{% endfor %}")),
    }
    for rid, (messages, options) in cases.items():
        engine.add_request(rid, messages=messages, sampling_params=one, chat_options=options)
    by_engine = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_engine[out.request_id] = list(out.prompt_token_ids)

    class RecordingLoop:
        def __init__(self):
            self.added = []

        def add(self, engine_id, kwargs):
            self.added.append(kwargs)

    server = Server(engine)
    server._loop = RecordingLoop()
    for rid, (messages, options) in cases.items():
        server._on_generate(b"id", GenerateRequest(rid, one, messages=messages,
                                                   chat_options=options))
    by_server = {rid: kw["prompt_token_ids"] for rid, kw in zip(cases, server._loop.added)}
    assert by_server == by_engine
    tok = engine.tokenizer
    assert len(by_server["gen"]) > len(by_server["nogen"])  # the assistant turn's opening
    assert tok.decode(by_server["cont"]).endswith("The capital of France is")
    assert len(by_server["closed"]) > len(by_server["cont"])  # the turn is closed
    assert tok.decode(by_server["own"]) == "user: What is the capital of France?\n"


def test_parallel_sampling_stream_equals_no_stream(start_server):
    _, ep = start_server(tiny_engine())
    params = {"n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True,
              "logprobs": 2}
    with Client(ep, timeout_s=30) as c:
        whole = c.generate(prompt_token_ids=[9, 8, 7, 6], sampling_params=params)
        s = c.stream(prompt_token_ids=[9, 8, 7, 6], sampling_params=params)
        indices = {d.index for d in s}
    assert indices == {0, 1, 2} and len(whole.outputs) == 3
    for a, b in zip(whole.outputs, s.result.outputs):
        assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 6
        # vLLM's shape (protocol 1.3): the sampled token first in each position's dict
        assert [next(iter(lp)) for lp in a["logprobs"]] == a["token_ids"]
        assert a["logprobs"] == b["logprobs"]
        assert a["cumulative_logprob"] == b["cumulative_logprob"]
        assert abs(a["cumulative_logprob"] - sum(
            lp[t].logprob for lp, t in zip(a["logprobs"], a["token_ids"]))) <= 1e-4
    assert len({tuple(o["token_ids"]) for o in whole.outputs}) > 1  # seeded, not identical


def offline_prompt_logprobs(prompt_ids: list[int], params: dict) -> list:
    """The reference: LLMEngine's own prompt logprobs for the request, served alone; they come
    exactly once (docs/engine_api.md)."""
    from pagedrun.runtime.sampling_params import SamplingParams as SP
    engine = tiny_engine()
    engine.add_request("ref", prompt_token_ids=prompt_ids, sampling_params=SP.from_dict(params))
    got = []
    while engine.has_unfinished_requests():
        got += [out.prompt_logprobs for out in engine.step() if out.prompt_logprobs is not None]
    assert len(got) == 1
    return got[0]


def assert_prompt_logprobs_match(got, want, prompt_ids: list[int], k: int) -> None:
    """vLLM's shape on both sides: per position {token_id: Logprob}, the prompt token first,
    then the top k (k or k + 1 entries); same ids in the same order, same ranks, same values."""
    from pagedrun.runtime.outputs import Logprob
    assert len(got) == len(want) == len(prompt_ids)
    assert got[0] is None and want[0] is None
    for g, w, token in zip(got[1:], want[1:], prompt_ids[1:]):
        assert isinstance(g, dict) and next(iter(g)) == next(iter(w)) == token
        assert list(g) == list(w) and len(g) in (k, k + 1)
        assert all(isinstance(v, Logprob) for v in g.values())
        assert all(g[t].rank == w[t].rank and abs(g[t].logprob - w[t].logprob) <= 1e-5
                   for t in w)
        assert sorted(v.rank for v in g.values() if v.rank <= k) == list(range(1, k + 1))


def test_prompt_logprobs_through_the_server_match_the_offline_engine(start_server):
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 257) for _ in range(100)]  # prefilled in two chunks (64)
    short_prompt = [rng.randrange(3, 257) for _ in range(7)]
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": 3,
              "logprobs": 2}
    _, ep = start_server(tiny_engine())
    with Client(ep, timeout_s=60) as c:
        for prompt in (long_prompt, short_prompt):
            want = offline_prompt_logprobs(prompt, params)
            whole = c.generate(prompt_token_ids=prompt, sampling_params=params)
            assert_prompt_logprobs_match(whole.prompt_logprobs, want, prompt, 3)
            assert whole.usage["prompt_tokens"] == len(prompt)
            s = c.stream(prompt_token_ids=prompt, sampling_params=params)
            deltas = list(s)
            carried = [d for d in deltas if d.prompt_logprobs is not None]
            assert carried == deltas[:1]  # once, on the first token's delta
            assert_prompt_logprobs_match(deltas[0].prompt_logprobs, want, prompt, 3)
            assert s.result.prompt_logprobs == deltas[0].prompt_logprobs
            assert s.result.token_ids == whole.token_ids
        one = c.generate(prompt_token_ids=[42], sampling_params=params)  # nothing to score
        assert one.prompt_logprobs == [None]
        plain = {k: v for k, v in params.items() if k != "prompt_logprobs"}
        s = c.stream(prompt_token_ids=short_prompt, sampling_params=plain)
        assert all(d.prompt_logprobs is None for d in s) and s.result.prompt_logprobs is None
        assert c.generate(prompt_token_ids=short_prompt,
                          sampling_params=plain).prompt_logprobs is None


def test_prompt_logprobs_once_with_parallel_sampling(start_server):
    prompt = [9, 8, 7, 6, 5]
    params = {"n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 5, "ignore_eos": True,
              "prompt_logprobs": 1}
    want = offline_prompt_logprobs(prompt, params)
    _, ep = start_server(tiny_engine())
    with Client(ep, timeout_s=30) as c:
        s = c.stream(prompt_token_ids=prompt, sampling_params=params)
        deltas = list(s)
        whole = c.generate(prompt_token_ids=prompt, sampling_params=params)
    assert {d.index for d in deltas} == {0, 1, 2}
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1
    assert deltas[0].prompt_logprobs is not None
    assert_prompt_logprobs_match(s.result.prompt_logprobs, want, prompt, 1)
    assert_prompt_logprobs_match(whole.prompt_logprobs, want, prompt, 1)


@pytest.mark.slow
def test_default_model_logprobs_through_the_client(start_server, default_engine):
    """Protocol 1.3 with a real tokenizer: vLLM's shape, greedy tokens of rank 1, their own
    text as decoded_token, top_k entries best first, cumulative_logprob their sum."""
    _, ep = start_server(default_engine)
    with Client(ep, timeout_s=120) as c:
        out = c.generate("The capital of France is", sampling_params={
            "max_tokens": 6, "temperature": 0, "logprobs": 3, "prompt_logprobs": 2})
    tok = default_engine.tokenizer
    assert len(out.logprobs) == len(out.token_ids) == 6
    for position, token in zip(out.logprobs, out.token_ids):
        assert next(iter(position)) == token and position[token].rank == 1
        assert len(position) == 3  # rank 1: the sampled token is one of the top 3
        assert position[token].decoded_token == tok.decode([token])
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
    total = sum(p[t].logprob for p, t in zip(out.logprobs, out.token_ids))
    assert abs(out.cumulative_logprob - total) <= 1e-4
    prompt = out.prompt_logprobs
    assert prompt[0] is None and len(prompt) == out.usage["prompt_tokens"]
    assert all(len(p) in (2, 3) and all(lp.decoded_token is not None for lp in p.values())
               for p in prompt[1:])
