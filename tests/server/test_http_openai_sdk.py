"""The official `openai` SDK (sync and async) against the gateway in front of a real engine server:
the tiny fixture model with a real byte-level tokenizer and chat template (http_gateway.py), so
prompts, chat templates, stop strings and logprob tokens take the real code paths.

Every expectation comes from the offline API (`pagedrun.LLM` over the same model directory) or
from the model's tokenizer, computed here, never from the gateway: greedy texts, seeded samples,
logprobs (rebuilt into OpenAI's shapes by this file's own code), prompt logprobs.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time

import httpx
import openai
import pytest
from http_gateway import (END_TOKEN, TINY_ENGINE, make_tiny_chat_model, model_name, sdk,
                          start_stack, tiny_engine)

from pagedrun import LLM, SamplingParams
from pagedrun.runtime.chat_options import MAX_CHAT_TEMPLATE_CHARS

PROMPTS = ["Hello, world", "The capital of France is"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"}]
LOWERCASE_IDS = list(range(ord("a"), ord("z") + 1))  # token id = byte value in this tokenizer
LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("http-sdk") / "tiny-chat")


@pytest.fixture(scope="module")
def stack(model_dir):
    engine = tiny_engine(model_dir)
    s = start_stack(engine, tokenizer=engine.tokenizer)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), **TINY_ENGINE)


def first(outputs):
    return [o.outputs[0] for o in outputs]


# --- greedy: HTTP == offline ------------------------------------------------------------------

def test_greedy_outputs_equal_the_offline_api(stack, offline):
    params = SamplingParams(temperature=0, max_tokens=12)
    want = first(offline.generate(PROMPTS, params))
    want_chat = first(offline.chat(MESSAGES, params))[0]
    client, name = sdk(stack), model_name(stack)

    batch = client.completions.create(model=name, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in batch.choices] == [w.text for w in want]
    assert [c.finish_reason for c in batch.choices] == [w.finish_reason for w in want]
    assert batch.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    prompt_ids = offline.engine.tokenizer.encode(PROMPTS[1])
    assert batch.usage.prompt_tokens == len(offline.engine.tokenizer.encode(PROMPTS[0])) + len(
        prompt_ids)
    by_ids = client.completions.create(model=name, prompt=prompt_ids, max_tokens=12,
                                       temperature=0)
    assert by_ids.choices[0].text == want[1].text

    chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=12,
                                          temperature=0)
    assert chat.choices[0].message.content == want_chat.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == want_chat.finish_reason

    async def streamed() -> tuple[str, str]:
        aclient = sdk(stack, asynchronous=True)
        chat_text, text = "", ""
        async for chunk in await aclient.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=12, temperature=0, stream=True):
            chat_text += "".join(c.delta.content or "" for c in chunk.choices)
        async for chunk in await aclient.completions.create(
                model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True):
            text += "".join(c.text for c in chunk.choices)
        await aclient.close()
        return chat_text, text

    assert asyncio.run(streamed()) == (want_chat.text, want[0].text)


def test_concurrent_async_requests_each_equal_the_offline_api(stack, offline):
    prompts = [f"Request number {i} says" for i in range(6)]
    want = [o.text for o in first(offline.generate(prompts, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True)))]
    name = model_name(stack)

    async def one(client, i):
        kwargs = dict(model=name, prompt=prompts[i], max_tokens=10, temperature=0,
                      extra_body={"ignore_eos": True})
        if i % 2:
            return "".join([c.choices[0].text async for c in
                            await client.completions.create(stream=True, **kwargs)])
        return (await client.completions.create(**kwargs)).choices[0].text

    async def run_all():
        client = sdk(stack, asynchronous=True)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
        finally:
            await client.close()

    assert asyncio.run(run_all()) == want


# --- streaming shape, n > 1, seeds ------------------------------------------------------------

def test_streamed_chat_with_n_and_usage_equals_the_whole_response(stack):
    client, name = sdk(stack), model_name(stack)
    kwargs = dict(model=name, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True},
                                                 **kwargs))
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
    assert sorted(c.choices[0].index for c in chunks[:3]) == [0, 1, 2]
    texts = {i: "" for i in range(3)}
    finish = {}
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.message.content for c in whole.choices}) > 1  # n samples, not n copies


def test_seed_reproduces_the_offline_sample(stack, offline):
    client, name = sdk(stack), model_name(stack)
    kwargs = dict(model=name, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(seed=123, **kwargs).choices[0].text
    b = client.completions.create(seed=123, **kwargs).choices[0].text
    c = client.completions.create(seed=124, **kwargs).choices[0].text
    want = first(offline.generate("Once upon a time", SamplingParams(
        temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)))[0].text
    assert a == b == want and c != a


# --- logprobs ---------------------------------------------------------------------------------

def expected_chat_logprobs(position: dict, k: int) -> dict:
    """OpenAI's chat entry for one offline position ({id: Logprob}, sampled first)."""
    sampled = next(iter(position.values()))
    best = sorted(position.values(), key=lambda e: e.rank)[:k]
    return {"token": sampled.decoded_token, "logprob": sampled.logprob,
            "top": [(e.decoded_token, e.logprob) for e in best]}


def test_chat_logprobs_equal_the_offline_api(stack, offline):
    want = first(offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6,
                                                       logprobs=3)))[0]
    client, name = sdk(stack), model_name(stack)
    got = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.logprobs)
    for entry, position in zip(content, want.logprobs):
        exp = expected_chat_logprobs(position, 3)
        assert entry.token == exp["token"] and entry.bytes == list(exp["token"].encode())
        assert math.isclose(entry.logprob, exp["logprob"], abs_tol=LOGPROB_TOLERANCE)
        assert [t.token for t in entry.top_logprobs] == [t for t, _ in exp["top"]]
        for t, (_, lp) in zip(entry.top_logprobs, exp["top"]):
            assert math.isclose(t.logprob, lp, abs_tol=LOGPROB_TOLERANCE)
    streamed = [e for chunk in client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, stream=True) for c in chunk.choices if c.logprobs
        for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    bare = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2,
                                          temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


def test_completion_logprobs_and_echo_equal_the_offline_api(stack, offline):
    prompt = "Hi there"
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                   prompt_logprobs=2))[0]
    client, name = sdk(stack), model_name(stack)
    got = client.completions.create(model=name, prompt=prompt, max_tokens=4, temperature=0,
                                    logprobs=2).choices[0]
    positions = want.outputs[0].logprobs
    tokens = [next(iter(p.values())).decoded_token for p in positions]
    assert got.logprobs.tokens == tokens
    assert got.text == want.outputs[0].text
    for lp, p in zip(got.logprobs.token_logprobs, positions):
        assert math.isclose(lp, next(iter(p.values())).logprob, abs_tol=LOGPROB_TOLERANCE)
    for top, p in zip(got.logprobs.top_logprobs, positions):  # top 2 and the sampled token
        best = sorted(p.values(), key=lambda e: e.rank)[:2] + [next(iter(p.values()))]
        assert set(top) == {e.decoded_token for e in best}
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert got.logprobs.text_offset == offsets

    echoed = client.completions.create(model=name, prompt=prompt, max_tokens=4, temperature=0,
                                       logprobs=2, echo=True).choices[0]
    prompt_ids = offline.engine.tokenizer.encode(prompt)
    assert echoed.text == prompt + want.outputs[0].text
    assert echoed.logprobs.tokens == [chr(t) for t in prompt_ids] + tokens  # bytes = ids
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    for lp, p in zip(echoed.logprobs.token_logprobs[1:len(prompt_ids)],
                     want.prompt_logprobs[1:]):
        assert math.isclose(lp, next(iter(p.values())).logprob, abs_tol=LOGPROB_TOLERANCE)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=name, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True))
    assert streamed == echoed.text


# --- stop, bias, lengths, cache ---------------------------------------------------------------

def test_stop_strings_cut_like_the_engine_says(stack):
    client, name = sdk(stack), model_name(stack)
    letters = {"allowed_token_ids": LOWERCASE_IDS, "ignore_eos": True}
    free = client.completions.create(model=name, prompt="abc", max_tokens=16, temperature=0,
                                     extra_body=letters).choices[0].text
    assert len(free) == 16 and free.isalpha() and free.islower()
    stop = free[6:8]
    cut = free.index(stop)
    got = client.completions.create(model=name, prompt="abc", max_tokens=16, temperature=0,
                                    stop=["never-there", stop], extra_body=letters).choices[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (free[:cut], "stop", stop)
    kept = client.completions.create(
        model=name, prompt="abc", max_tokens=16, temperature=0, stop=stop,
        extra_body={**letters, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == free[:cut + len(stop)]
    chat_free = client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=12, temperature=0,
        extra_body=letters).choices[0].message.content
    chat_stop = chat_free[3:5]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=12, temperature=0, stop=chat_stop,
        stream=True, extra_body=letters) if c.choices)
    assert streamed == chat_free[:chat_free.index(chat_stop)]


def test_logit_bias_is_clamped_to_openai_range(stack):
    client, name = sdk(stack), model_name(stack)
    x = ord("x")
    for bias in (100, 1000):  # the wire refuses |bias| > 100: 1000 passes only when clamped
        out = client.completions.create(model=name, prompt="abc", max_tokens=5, temperature=0,
                                        logit_bias={str(x): bias},
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == "xxxxx"


def test_max_tokens_names_and_usage(stack):
    client, name = sdk(stack), model_name(stack)
    out = client.chat.completions.create(model=name, messages=MESSAGES, temperature=0,
                                         max_tokens=9, max_completion_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == out.usage.prompt_tokens + 3
    plain = client.completions.create(model=name, prompt="p", temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 16  # OpenAI's completions default


def test_cached_prompt_tokens_are_reported(stack):
    client, name = sdk(stack), model_name(stack)
    prompt = "A prompt long enough to fill two KV blocks of sixteen tokens: cached?"
    sizes = []
    for _ in range(2):
        out = client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)
        sizes.append((out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens))
    (n, cold), (_, warm) = sizes
    assert n == len(prompt) and cold == 0
    assert 0 < warm < n and warm % 16 == 0  # whole blocks of the first request's prompt


def test_chat_template_options_reach_the_engine(stack, offline):
    client, name = sdk(stack), model_name(stack)
    convo = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one two"}]
    params = SamplingParams(temperature=0, max_tokens=6)
    want = first(offline.chat(convo, params, add_generation_prompt=False,
                              continue_final_message=True))[0].text
    got = client.chat.completions.create(
        model=name, messages=convo, max_tokens=6, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert got.choices[0].message.content == want
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=name, messages=convo, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert "add_generation_prompt" in err.value.message


def test_engine_refusals_are_400(stack):
    client, name = sdk(stack), model_name(stack)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt="x" * 200, max_tokens=2)
    assert err.value.code == "prompt_too_long"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt="x", n=2, temperature=0, max_tokens=2)
    assert err.value.body["param"] == "n"
    assert "n: must be 1 when using greedy sampling" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=[300], max_tokens=2)  # vocab is 257
    assert err.value.status_code == 400


def test_client_mistakes_are_4xx_never_5xx(stack):
    """Issue 36 item 7: each of these was a 500 (which the OpenAI SDK retries three times)."""
    name = model_name(stack)
    completions = f"{stack.url}/v1/completions"
    raw_bodies = [
        b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % name.encode(),  # surrogate
        b'{"model": "%s", "prompt": "x", "max_tokens": 2, "extra": %s%s}' % (
            name.encode(), b"[" * 100_000, b"]" * 100_000),                       # 100k deep
    ]
    for body in raw_bodies:
        r = httpx.post(completions, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body[:80], r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"
    for fields in ({"max_tokens": 2 ** 64}, {"seed": 2 ** 64, "max_tokens": 2},
                   {"n": 2 ** 64, "max_tokens": 2}, {"prompt": [2 ** 64], "max_tokens": 2},
                   {"seed": -(2 ** 64), "max_tokens": 2}):
        r = httpx.post(completions, json={"model": name, "prompt": "x", **fields})
        assert r.status_code == 400, (fields, r.text[:200])
    tokenize = f"{stack.url}/tokenize"
    for extra in ({"chat_template_kwargs": {"tokenize": False}},       # a keyword of its own
                  {"chat_template": "{{ no_such_function() }}"},        # undefined callable
                  {"chat_template": "{{ 'a' + 1 }}"},
                  {"chat_template": "{{ raise_exception('refused') }}"}):
        r = httpx.post(tokenize, json={"messages": MESSAGES, **extra})
        assert r.status_code == 400, (extra, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_is_bounded_and_runs_off_the_event_loop(stack):
    """Issue 36 case 6: /tokenize and /detokenize refuse what the engine would (a template over
    ChatOptions' limit, a body over max_message_bytes) with a 400, and their tokenizer work
    runs on threads of their own: a chat template that renders for seconds does not hold up
    the gateway's other endpoints (it stalled them all while it ran on the event loop)."""
    tokenize = f"{stack.url}/tokenize"
    r = httpx.post(tokenize, json={"messages": MESSAGES,
                                   "chat_template": "x" * (MAX_CHAT_TEMPLATE_CHARS + 1)})
    assert r.status_code == 400 and "chat_template: at most" in r.json()["error"]["message"]
    limit = stack.server.config.max_message_bytes
    r = httpx.post(tokenize, json={"prompt": "a" * (limit + 1)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "message_too_large"
    r = httpx.post(f"{stack.url}/detokenize", json={"tokens": [1] * (limit // 2)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "message_too_large"

    # ~36 M template loop steps: seconds of rendering on any of our machines.
    slow = ("{% for i in range(6000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}"
            "{{ messages[0]['content'] }}")
    result = {}

    def render():
        result["response"] = httpx.post(tokenize, json={"messages": MESSAGES,
                                                        "chat_template": slow}, timeout=300)

    renderer = threading.Thread(target=render)
    renderer.start()
    time.sleep(0.3)  # the render has begun
    during = []  # /version latencies measured while the render was still running
    while renderer.is_alive() and len(during) < 10:
        start = time.monotonic()
        assert httpx.get(f"{stack.url}/version", timeout=60).status_code == 200
        if renderer.is_alive():
            during.append(time.monotonic() - start)
        time.sleep(0.05)
    renderer.join()
    assert result["response"].status_code == 200
    assert result["response"].json()["tokens"] == list(b"Be brief.")
    assert len(during) >= 3, f"the render ended too soon to tell ({len(during)} answers)"
    assert max(during) < 0.5, f"/version took {max(during):.2f} s during the render"


def test_tokenize_and_detokenize_use_the_model_tokenizer(stack, offline):
    tok = offline.engine.tokenizer
    r = httpx.post(f"{stack.url}/tokenize", json={"prompt": "hi" + END_TOKEN}).json()
    assert r == {"count": 3, "max_model_len": 128, "tokens": tok.encode("hi" + END_TOKEN),
                 "token_strs": None}
    chat = httpx.post(f"{stack.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tok.apply_chat_template(MESSAGES, tokenize=True)
    assert httpx.post(f"{stack.url}/detokenize",
                      json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert httpx.post(f"{stack.url}/detokenize", json={"tokens": [999]}).status_code == 400
