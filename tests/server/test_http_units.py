"""The gateway's pure parts without a server: request parsing, logprobs shapes, error mapping,
Prometheus buckets, SSE framing and the disconnect race (server/http/)."""
from __future__ import annotations

import asyncio
import json

import pytest

from pagedrun.runtime.outputs import Logprob
from pagedrun.server.client import OverloadedError, RequestTimeout, ServerError
from pagedrun.server.http.errors import ApiError, from_engine_error, param_of
from pagedrun.server.http.gateway_cmd import connect_endpoint, http_url
from pagedrun.server.http.logprobs import (MIN_JSON_LOGPROB, CompletionLogprobs,
                                           chat_logprobs)
from pagedrun.server.http.openai_models import parse_chat, parse_completion
from pagedrun.server.http.prometheus import histogram_buckets
from pagedrun.server.http.sse import (ClientDisconnected, EventStreamResponse,
                                      run_unless_disconnected, sse_event)


# --- parsing ----------------------------------------------------------------------------------

def test_chat_fields_map_onto_sampling_params():
    spec = parse_chat({
        "model": "m", "messages": [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}],
        "max_tokens": 9, "max_completion_tokens": 4, "temperature": 0.5, "top_p": 0.9,
        "n": 2, "seed": 3, "stop": "END", "presence_penalty": 0.1, "frequency_penalty": 0.2,
        "logprobs": True, "top_logprobs": 2, "logit_bias": {"7": -500, "8": 2},
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1,
        "ignore_eos": True, "stop_token_ids": [9], "include_stop_str_in_output": True,
        "skip_special_tokens": False, "user": "u-1", "stream": True,
        "stream_options": {"include_usage": True}, "continue_final_message": True,
        "add_generation_prompt": False, "unknown_field": 1})
    assert spec.prompts[0].messages == [{"role": "system", "content": "rules"},
                                        {"role": "user", "content": "a\nb"},
                                        {"role": "assistant", "content": ""}]
    assert spec.sampling_params == {
        "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "presence_penalty": 0.1,
        "frequency_penalty": 0.2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
        "min_tokens": 1, "ignore_eos": True, "stop_token_ids": [9],
        "include_stop_str_in_output": True, "skip_special_tokens": False, "stop": ["END"],
        "logit_bias": {"7": -100.0, "8": 2.0}, "max_tokens": 4, "logprobs": 2}
    assert spec.chat_options == {"continue_final_message": True, "add_generation_prompt": False}
    assert (spec.n, spec.logprobs, spec.stream, spec.include_usage, spec.user) == (
        2, 2, True, True, "u-1")


def test_completion_prompt_shapes_and_defaults():
    assert parse_completion({"prompt": "x"}).sampling_params == {"max_tokens": 16}
    assert [p.text for p in parse_completion({"prompt": ["a", "b"]}).prompts] == ["a", "b"]
    assert [p.token_ids for p in parse_completion({"prompt": [1, 2]}).prompts] == [[1, 2]]
    assert [p.token_ids for p in parse_completion({"prompt": [[1], [2, 3]]}).prompts] == [
        [1], [2, 3]]
    echo = parse_completion({"prompt": "x", "echo": True, "logprobs": 3})
    assert echo.sampling_params["prompt_logprobs"] == 3 and echo.prompt_logprobs is None
    explicit = parse_completion({"prompt": "x", "prompt_logprobs": 1})
    assert explicit.prompt_logprobs == 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logit_bias": {"one": 1}}, "logit_bias"),
    # int() would take these (issue 36): other digits, spaces, underscores, a leading zero
    # (which would name token 12 twice beside "12").
    ({"prompt": "x", "logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {" 12 ": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1_0": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"12": 1, "012": 2}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"+12": 1}}, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "guided_json": {}}, "guided_json"),
])
def test_completion_bad_fields_name_the_param(body, param):
    with pytest.raises(ApiError) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_object"}},
])
def test_chat_refusals(body):
    with pytest.raises(ApiError) as err:
        parse_chat(body)
    assert err.value.status == 400


# --- logprobs ---------------------------------------------------------------------------------

def position():
    """Sampled token 5 (rank 3) first, then the top 2: ids 8 and 9."""
    return {5: Logprob(-2.0, 3, "c"), 8: Logprob(-0.5, 1, "a"), 9: Logprob(-1.0, 2, "b")}


def test_chat_logprobs_top_are_the_best_k_by_rank():
    out = chat_logprobs([position()], 2, None)["content"][0]
    assert out == {"token": "c", "logprob": -2.0, "bytes": [99], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]},
        {"token": "b", "logprob": -1.0, "bytes": [98]}]}
    assert chat_logprobs([position()], 0, None)["content"][0]["top_logprobs"] == []


def test_completion_logprobs_keep_the_sampled_token_and_running_offsets():
    builder = CompletionLogprobs(2, None)
    first = builder.build([position(), {7: Logprob(float("-inf"), 9, "dd")}])
    assert first == {"tokens": ["c", "dd"], "token_logprobs": [-2.0, MIN_JSON_LOGPROB],
                     "top_logprobs": [{"c": -2.0, "a": -0.5, "b": -1.0},
                                      {"dd": MIN_JSON_LOGPROB}],
                     "text_offset": [0, 1]}
    assert builder.build([position()])["text_offset"] == [3]  # continues after "c" + "dd"
    echo = CompletionLogprobs(1, None).build([], [None, {4: Logprob(-0.25, 1, "q")}], "p")
    assert echo["tokens"] == ["p", "q"] and echo["token_logprobs"] == [None, -0.25]
    assert echo["top_logprobs"] == [None, {"q": -0.25}] and echo["text_offset"] == [0, 1]


def test_token_text_without_decoded_token():
    pos = {65: Logprob(-1.0, 1, None)}
    assert chat_logprobs([pos], 1, lambda t: chr(t))["content"][0]["token"] == "A"
    assert chat_logprobs([pos], 1, None)["content"][0]["token"] == "token_id:65"


# --- errors, endpoints, buckets ---------------------------------------------------------------

def test_engine_errors_map_to_statuses():
    assert from_engine_error(OverloadedError("overloaded", "full")).status == 429
    assert from_engine_error(OverloadedError("overloaded", "full")).headers() == {
        "retry-after": "1"}
    assert from_engine_error(ServerError("shutting_down", "bye")).status == 503
    assert from_engine_error(ServerError("internal_error", "boom")).status == 500
    assert from_engine_error(RequestTimeout("slow")).status == 504
    bad = from_engine_error(ServerError("invalid_request", "sampling_params.top_p: no"))
    assert (bad.status, bad.param, bad.message) == (400, "top_p", "top_p: no")
    assert param_of("messages[2].role: must be") == "messages[2].role"
    assert param_of("Requested sample logprobs of 50") is None


def test_histogram_buckets_become_cumulative():
    h = {"le": [0.1, 1.0], "counts": [2, 0, 3], "sum": 9.5, "count": 5}
    assert histogram_buckets(h) == [("0.1", 2), ("1.0", 2), ("+Inf", 5)]


def test_endpoints():
    assert connect_endpoint("tcp://0.0.0.0:5555") == "tcp://127.0.0.1:5555"
    assert connect_endpoint("tcp://[::]:5555") == "tcp://[::1]:5555"
    assert connect_endpoint("tcp://10.0.0.2:5555") == "tcp://10.0.0.2:5555"
    assert connect_endpoint("ipc:///tmp/x") == "ipc:///tmp/x"
    assert http_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert http_url("::1", 8000) == "http://[::1]:8000"


# --- SSE and disconnects ----------------------------------------------------------------------

def test_sse_event_is_one_data_line():
    event = sse_event({"text": "a\nb", "é": 1})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2 and json.loads(event[6:]) == {"text": "a\nb", "é": 1}


def disconnect_after(delay_s: float):
    async def receive():
        await asyncio.sleep(delay_s)
        return {"type": "http.disconnect"}
    return receive


def test_disconnect_cancels_the_work_and_its_cleanup_can_still_await():
    cleaned = []

    async def work():
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.01)  # like sending ABORT: an await inside the cleanup
            cleaned.append(True)

    async def main():
        with pytest.raises(ClientDisconnected):
            await run_unless_disconnected(disconnect_after(0.05), work())
        assert await run_unless_disconnected(disconnect_after(5), asyncio.sleep(0, "ok")) == "ok"

    asyncio.run(main())
    assert cleaned == [True]


def test_event_stream_closes_its_source_on_disconnect():
    sent, closed = [], []

    async def events():
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(30)
            yield b"data: 2\n\n"
        finally:
            await asyncio.sleep(0.01)
            closed.append(True)

    async def send(message):
        sent.append(message)

    asyncio.run(EventStreamResponse(events())({"type": "http"}, disconnect_after(0.05), send))
    assert closed == [True]
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"data: 1\n\n" and len(sent) == 2
