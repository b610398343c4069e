"""The HTTP gateway (server/http/) in front of the fake engine: SSE framing as `curl -N` sees it,
aborts when the HTTP client disconnects, the error statuses (400, 401, 404, 429, 503), the API
key, /metrics through a Prometheus text parser, and the `paged-run http`, `serve --http-port`
and `bench --backend openai` commands.

Expected texts come from the fake engine's own reference (`expected_tokens`: a function of the
prompt ids only), never from the gateway.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from fake_engine import FakeEngine, expected_tokens
from http_gateway import END_TOKEN, make_tiny_chat_model, sdk, start_stack, wait_until
from prometheus_client.parser import text_string_to_metric_families
from wire import free_tcp_endpoint

from pagedrun.client import Client

FAKE_MODEL = "fake-byte-model"
PROCESS_START_TIMEOUT_S = 60


def fake_chat_ids(messages: list[dict]) -> list[int]:
    """The fake engine's prompt for chat messages (fake_engine.FakeEngine.add_request)."""
    text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
    return list(text.encode())


def fake_text(prompt_ids: list[int], max_tokens: int) -> str:
    return bytes(expected_tokens(prompt_ids, max_tokens)).decode()


@pytest.fixture
def stack():
    stacks = []

    def start(engine=None, **kw):
        s = start_stack(engine if engine is not None else FakeEngine(), **kw)
        stacks.append(s)
        return s

    yield start
    for s in stacks:
        s.stop()


def stats(stack) -> dict:
    with Client(stack.endpoint, timeout_s=10) as c:
        return c.stats()


# --- SSE framing ------------------------------------------------------------------------------

def test_curl_sees_sse_framing_of_a_streamed_chat(stack):
    s = stack()
    messages = [{"role": "user", "content": "Say hi"}]
    body = {"model": FAKE_MODEL, "messages": messages, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    proc = subprocess.run(["curl", "-sS", "-N", "-D", "-", "-H", "Content-Type: application/json",
                           "-d", json.dumps(body), f"{s.url}/v1/chat/completions"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    head, _, stream = proc.stdout.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower()
    assert stream.endswith("\n\n")
    events = stream[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == fake_text(fake_chat_ids(messages), 6)
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finishing] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == len(fake_chat_ids(messages))


def test_completions_batch_of_prompts_with_echo(stack):
    s = stack()
    out = sdk(s).completions.create(model=FAKE_MODEL, prompt=["ab", "xyz"], max_tokens=4,
                                    echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == "ab" + fake_text(list(b"ab"), 4)
    assert out.choices[1].text == "xyz" + fake_text(list(b"xyz"), 4)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 8
    ids = sdk(s).completions.create(model=FAKE_MODEL, prompt=[[5, 6], [7]], max_tokens=3)
    assert [c.text for c in ids.choices] == [fake_text([5, 6], 3), fake_text([7], 3)]
    texts, finished = ["", ""], []
    for chunk in sdk(s).completions.create(model=FAKE_MODEL, prompt=["ab", "xyz"], echo=True,
                                           max_tokens=4, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.append(c.index)
    assert texts == [c.text for c in out.choices] and sorted(finished) == [0, 1]


# --- disconnects abort ------------------------------------------------------------------------

def _settled(s, aborts: int) -> bool:
    st = stats(s)
    return (st["gauges"]["server_requests_in_flight"] == 0
            and st["counters"]["request_abort_total"] == aborts)


def test_sdk_stream_closed_midway_aborts_the_request(stack):
    s = stack(FakeEngine(step_delay_s=0.02))
    stream = sdk(s).chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=200,
        stream=True)
    got = []
    for chunk in stream:
        got.append(chunk.choices[0].delta.content)
        if len(got) >= 3:
            break
    stream.close()
    assert wait_until(lambda: _settled(s, 1)), stats(s)
    assert stats(s)["counters"]["generation_tokens_total"] < 150  # stopped, not run to the end


def test_non_streaming_client_that_hangs_up_aborts_the_request(stack):
    s = stack(FakeEngine(step_delay_s=0.02))
    body = json.dumps({"model": FAKE_MODEL, "prompt": "go", "max_tokens": 200}).encode()
    with socket.create_connection(("127.0.0.1", s.gateway.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: stats(s)["gauges"]["server_requests_in_flight"] == 1)
    assert wait_until(lambda: _settled(s, 1)), stats(s)


# --- errors -----------------------------------------------------------------------------------

def test_overloaded_engine_is_429_with_retry_after(stack):
    s = stack(FakeEngine(step_delay_s=0.02), max_queued_requests=1)
    with httpx.stream("POST", f"{s.url}/v1/completions", timeout=30, json={
            "model": FAKE_MODEL, "prompt": "slow", "max_tokens": 100, "stream": True}) as slow:
        lines = slow.iter_lines()  # kept: dropping the iterator closes the stream (an abort)
        next(lines)  # the first request holds the only slot
        with pytest.raises(openai.RateLimitError) as err:
            sdk(s).completions.create(model=FAKE_MODEL, prompt="more", max_tokens=2)
        assert err.value.status_code == 429 and err.value.code == "overloaded"
        assert err.value.response.headers["retry-after"] == "1"


def test_draining_engine_is_503(stack):
    s = stack(FakeEngine(step_delay_s=0.02))
    with httpx.stream("POST", f"{s.url}/v1/completions", timeout=30, json={
            "model": FAKE_MODEL, "prompt": "slow", "max_tokens": 150, "stream": True}) as slow:
        lines = slow.iter_lines()
        next(lines)
        s.server.request_shutdown()  # drains: the stream in flight keeps it alive
        with pytest.raises(openai.InternalServerError) as err:
            sdk(s).completions.create(model=FAKE_MODEL, prompt="late", max_tokens=2)
        assert err.value.status_code == 503 and err.value.code == "shutting_down"
        assert httpx.get(f"{s.url}/health").status_code == 503
        assert [x for x in lines if x][-1] == "data: [DONE]"  # the one in flight finishes


def test_bad_requests_are_400_in_openai_shape(stack):
    s = stack()
    client = sdk(s)
    cases = [  # (request fields, the error's param, a piece of its message)
        (dict(prompt="x", temperature=3.0), "temperature", "[0, 2]"),
        (dict(prompt="x", top_p=0.0), "top_p", "(0, 1]"),
        (dict(prompt="x", logprobs=50), None, "greater than max allowed: 20"),  # vLLM's words
        (dict(prompt="x", max_tokens=0), "max_tokens", ">= 1"),
        (dict(prompt=[]), "prompt", "non-empty"),
        (dict(prompt="x", extra_body={"top_k": "many"}), "top_k", "an integer"),
        (dict(prompt="x", stream=False, extra_body={"stream_options": {}}), "stream_options",
         "stream: true"),
        (dict(prompt="x", suffix="tail"), "suffix", "not supported"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=FAKE_MODEL, **{"max_tokens": 2, **kwargs})
        assert err.value.status_code == 400
        assert err.value.body["param"] == param, (kwargs, err.value.body)
        assert words in err.value.body["message"], (kwargs, err.value.body)
        assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=FAKE_MODEL, messages=[{"role": "x", "content": ""}])
    assert "messages[0].role" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=FAKE_MODEL, top_logprobs=2,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:  # prompt over max_model_len (256)
        client.completions.create(model=FAKE_MODEL, prompt="y" * 300, max_tokens=2)
    assert err.value.code == "prompt_too_long"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="another-model", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model"
    raw = httpx.post(f"{s.url}/v1/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(f"{s.url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.post(f"{s.url}/tokenize", json={"prompt": "x"}).status_code == 501


def test_api_key_guards_the_v1_routes(stack):
    s = stack(api_key="sesame")
    with pytest.raises(openai.AuthenticationError):
        sdk(s, api_key="wrong").models.list()
    assert sdk(s, api_key="sesame").models.list().data[0].id == FAKE_MODEL
    out = sdk(s, api_key="sesame").completions.create(model=FAKE_MODEL, prompt="k", max_tokens=2)
    assert out.choices[0].text == fake_text(list(b"k"), 2)
    assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "k"}).status_code == 401
    assert httpx.get(f"{s.url}/health").status_code == 200  # not a /v1/ route
    assert httpx.get(f"{s.url}/metrics").status_code == 200


def test_models_health_version(stack):
    s = stack()
    models = sdk(s).models.list()
    assert [m.id for m in models.data] == [FAKE_MODEL]
    assert models.data[0].model_extra["max_model_len"] == 256
    assert sdk(s).models.retrieve(FAKE_MODEL).id == FAKE_MODEL
    health = httpx.get(f"{s.url}/health")
    assert health.status_code == 200 and health.content == b""
    from pagedrun import __version__
    assert httpx.get(f"{s.url}/version").json() == {"version": __version__}


# --- /metrics ---------------------------------------------------------------------------------

REQUIRED_FAMILIES = {
    "paged_run:num_requests_running": "gauge",
    "paged_run:num_requests_waiting": "gauge",
    "paged_run:kv_cache_usage_perc": "gauge",
    "paged_run:prefix_cache_queries": "counter",
    "paged_run:prefix_cache_hits": "counter",
    "paged_run:num_preemptions": "counter",
    "paged_run:prompt_tokens": "counter",
    "paged_run:generation_tokens": "counter",
    "paged_run:time_to_first_token_seconds": "histogram",
    "paged_run:time_per_output_token_seconds": "histogram",
    "paged_run:e2e_request_latency_seconds": "histogram",
}


def test_metrics_page_after_load_parses_and_adds_up(stack):
    s = stack()
    client = sdk(s)
    lengths = [3, 5, 8, 13]
    for i, n in enumerate(lengths):
        client.completions.create(model=FAKE_MODEL, prompt=f"prompt {i}", max_tokens=n)
    client.chat.completions.create(model=FAKE_MODEL, max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
    page = httpx.get(f"{s.url}/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(page.text)}
    for name, kind in REQUIRED_FAMILIES.items():
        assert name in families and families[name].type == kind, name

    def value(name, suffix=""):
        (sample,) = [x for x in families[name].samples if x.name == name + suffix]
        assert sample.labels == {"model_name": FAKE_MODEL}
        return sample.value

    assert value("paged_run:generation_tokens", "_total") == sum(lengths) + 2
    assert value("paged_run:num_requests_running") == 0
    assert value("paged_run:engine_up") == 1
    e2e = families["paged_run:e2e_request_latency_seconds"].samples
    buckets = [x for x in e2e if x.name.endswith("_bucket")]
    counts = [x.value for x in buckets]
    assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
    assert counts[-1] == value("paged_run:e2e_request_latency_seconds", "_count") == 5
    http = {(x.labels["route"], x.labels["status"]): x.value
            for x in families["paged_run:http_requests"].samples if x.name.endswith("_total")}
    assert http[("/v1/completions", "200")] == 4 and http[("/v1/chat/completions", "200")] == 1


def test_metrics_when_the_engine_is_gone(stack):
    s = stack()
    s.server.stop()
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{s.url}/metrics", timeout=30).text)}
    assert families["paged_run:engine_up"].samples[0].value == 0
    assert "paged_run:num_requests_running" not in families


# --- the commands -----------------------------------------------------------------------------

def free_port() -> int:
    return int(free_tcp_endpoint().rsplit(":", 1)[1])


def wait_http(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + PROCESS_START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


def stop_process(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_http_command_fronts_a_server_process_and_bench_measures_it(server_process):
    from pagedrun.server.cli import main

    _, endpoint = server_process(free_tcp_endpoint())
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedrun", "http", "--engine", endpoint,
                             "--port", str(port), "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0)
        out = client.completions.create(model=FAKE_MODEL, prompt="cmd", max_tokens=5)
        assert out.choices[0].text == fake_text(list(b"cmd"), 5)
        code = main(["bench", "--backend", "openai", "--base-url",
                     f"http://127.0.0.1:{port}/v1", "--num-prompts", "12", "--concurrency", "4",
                     "--input-len-mix", "4:1,20:1", "--output-len-mix", "3:1,9:1",
                     "--no-progress", "--json"])
        assert code == 0
    finally:
        assert stop_process(proc) == 0


def test_serve_with_http_port_answers_the_openai_sdk(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-chat")
    zmq_port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedrun", "serve", str(model), "--port",
                             str(zmq_port), "--http-port", str(http_port), "--device", "cpu",
                             "--num-kv-blocks", "64", "--max-model-len", "128",
                             "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_http(f"http://127.0.0.1:{http_port}/health", proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-",
                               max_retries=0)
        name = client.models.list().data[0].id
        assert name == str(model)
        out = client.chat.completions.create(model=name, max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": "hi"}],
                                             extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        tokens = httpx.post(f"http://127.0.0.1:{http_port}/tokenize",
                            json={"prompt": "hi" + END_TOKEN}).json()
        assert tokens["tokens"] == [104, 105, 256]  # the engine's own tokenizer object
        with Client(f"tcp://127.0.0.1:{zmq_port}", timeout_s=10) as c:  # ZeroMQ alongside
            assert c.model_info()["model"] == name
    finally:
        assert stop_process(proc) == 0
    assert f"OpenAI HTTP API on http://127.0.0.1:{http_port}/v1" in proc.stdout.read()

