"""Conformance: raw frames (docs/protocol.md) against a live server, every message type and
every error code, checked field by field; the fake engine is the oracle for tokens."""
from __future__ import annotations

import time

import msgpack
import pytest
from fake_engine import (FakeEngine, expected_cumulative_logprob, expected_logprobs_wire,
                         expected_prompt_logprobs_wire, expected_tokens)
from wire import assert_error_shape, assert_server_id, dealer, recv, recv_until_final, send

from pagedrun.server.protocol import PROTOCOL_REVISION, PROTOCOL_VERSION, MsgType

# server_id: protocol 1.2 (every DELTA, FINAL, ERROR, PONG, MODEL_INFO_REPLY).
FINAL_FIELDS = {"request_id", "finish_reason", "stop_reason", "outputs", "usage", "metrics",
                "server_id"}


def test_generate_stream_deltas_then_final(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    prompt = "the quick brown fox, 19"
    send(s, MsgType.GENERATE, {"request_id": "g1", "prompt": prompt,
                               "sampling_params": {"max_tokens": 19, "temperature": 0}})
    deltas, kind, final = recv_until_final(s, "g1")
    want = expected_tokens(list(prompt.encode()), 19)
    assert kind == MsgType.FINAL
    assert [t for d in deltas for t in d["token_ids"]] == want
    assert "".join(d["text"] for d in deltas) == bytes(want).decode()
    assert all(set(d) == {"request_id", "index", "token_ids", "text", "server_id"}
               for d in deltas)
    assert len({d["server_id"] for d in deltas} | {final["server_id"]}) == 1
    assert_server_id(final["server_id"])
    assert final["finish_reason"] == "length" and final["stop_reason"] is None
    assert final["outputs"] == [{"index": 0, "finish_reason": "length", "stop_reason": None}]
    assert final["usage"] == {"prompt_tokens": len(prompt), "cached_prompt_tokens": 0,
                              "completion_tokens": 19}
    m = final["metrics"]
    assert 0 <= m["time_to_first_token_s"] <= m["e2e_latency_s"]
    assert m["time_per_output_token_s"] >= 0


def test_generate_token_ids_no_stream_with_logprobs(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    ids = [7, 300, 511, 0, 42]
    send(s, MsgType.GENERATE, {"request_id": "g2", "prompt_token_ids": ids, "stream": False,
                               "sampling_params": {"max_tokens": 5, "logprobs": 1}})
    deltas, kind, final = recv_until_final(s, "g2")
    assert deltas == [] and kind == MsgType.FINAL
    out = final["outputs"][0]
    assert out["token_ids"] == expected_tokens(ids, 5)
    assert out["text"] == bytes(expected_tokens(ids, 5)).decode()
    assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"]
    # 1.3: rank, decoded_token, top_decoded_tokens; the sampled token has rank 1, 2, 3, ...
    assert out["logprobs"] == expected_logprobs_wire(out["token_ids"], 1)
    assert [len(lp["top"]) for lp in out["logprobs"]] == [1] * 5
    assert out["cumulative_logprob"] == expected_cumulative_logprob(5) == -4.5  # ranks 1,2,3,1,2
    assert set(out) == {"index", "finish_reason", "stop_reason", "token_ids", "text",
                        "logprobs", "cumulative_logprob"}


def test_stream_logprobs_and_cumulative_logprob(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "sl", "prompt_token_ids": [1, 2, 3],
                               "sampling_params": {"max_tokens": 4, "logprobs": 2}})
    deltas, kind, final = recv_until_final(s, "sl")
    tokens = [t for d in deltas for t in d["token_ids"]]
    assert kind == MsgType.FINAL and tokens == expected_tokens([1, 2, 3], 4)
    assert [e for d in deltas for e in d["logprobs"]] == expected_logprobs_wire(tokens, 2)
    # ranks 1, 2, 3, 1 against k = 2: the sampled token is in `top` only when its rank <= 2
    assert [[t[0] for t in e["top"]].count(e["token_id"]) for d in deltas
            for e in d["logprobs"]] == [1, 1, 0, 1]
    assert [d["cumulative_logprob"] for d in deltas] == [expected_cumulative_logprob(n)
                                                         for n in range(1, 5)]
    assert final["outputs"][0]["cumulative_logprob"] == expected_cumulative_logprob(4)


def prompt_logprobs_wire(prompt_ids: list[int], k: int) -> list:
    """The fake engine's reference prompt logprobs in the wire shape of docs/protocol.md."""
    return expected_prompt_logprobs_wire(prompt_ids, k)


def test_prompt_logprobs_stream_once_on_first_delta(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    prompt = "prompt logprobs"
    ids = list(prompt.encode())
    send(s, MsgType.GENERATE, {"request_id": "pl", "prompt": prompt,
                               "sampling_params": {"max_tokens": 4, "prompt_logprobs": 2,
                                                   "logprobs": 1}})
    deltas, kind, final = recv_until_final(s, "pl")
    assert kind == MsgType.FINAL and len(deltas) == 4
    first = deltas[0]
    assert set(first) == {"request_id", "index", "token_ids", "text", "logprobs",
                          "cumulative_logprob", "prompt_logprobs", "server_id"}
    plp = first["prompt_logprobs"]
    assert len(plp) == len(ids) == final["usage"]["prompt_tokens"]
    assert plp[0] is None
    assert [e["token_id"] for e in plp[1:]] == ids[1:]
    assert all(set(e) == {"token_id", "logprob", "top", "rank", "decoded_token",
                          "top_decoded_tokens"}
               and len(e["top"]) == len(e["top_decoded_tokens"]) == 2
               and all(len(pair) == 2 for pair in e["top"]) for e in plp[1:])  # 1.1's pairs
    assert plp == prompt_logprobs_wire(ids, 2)  # values exactly, top best first
    assert all("prompt_logprobs" not in d for d in deltas[1:])  # sent once
    assert set(final) == FINAL_FIELDS  # not repeated on the FINAL


def test_prompt_logprobs_no_stream_on_final(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    ids = [7, 300, 511, 0, 42]
    send(s, MsgType.GENERATE, {"request_id": "pn", "prompt_token_ids": ids, "stream": False,
                               "sampling_params": {"max_tokens": 3, "prompt_logprobs": 0}})
    deltas, kind, final = recv_until_final(s, "pn")
    assert deltas == [] and kind == MsgType.FINAL
    assert set(final) == FINAL_FIELDS | {"prompt_logprobs"}
    assert final["prompt_logprobs"] == prompt_logprobs_wire(ids, 0)
    assert final["prompt_logprobs"][0] is None
    assert all(e["top"] == [] for e in final["prompt_logprobs"][1:])  # k = 0: no alternatives
    assert "prompt_logprobs" not in final["outputs"][0]  # per request, not per sequence


def test_without_prompt_logprobs_nothing_extra_is_sent(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    for stream in (True, False):
        send(s, MsgType.GENERATE, {"request_id": f"x{stream}", "prompt": "abc",
                                   "stream": stream,
                                   "sampling_params": {"max_tokens": 3, "logprobs": 0}})
        deltas, kind, final = recv_until_final(s, f"x{stream}")
        assert kind == MsgType.FINAL and set(final) == FINAL_FIELDS
        assert all(set(d) == {"request_id", "index", "token_ids", "text", "logprobs",
                              "cumulative_logprob", "server_id"} for d in deltas)
        assert len(deltas) == (3 if stream else 0)


def test_generate_chat_messages(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    send(s, MsgType.GENERATE, {"request_id": "c", "messages": msgs,
                               "sampling_params": {"max_tokens": 3}})
    _, kind, final = recv_until_final(s, "c")
    assert kind == MsgType.FINAL and final["usage"]["completion_tokens"] == 3


def test_stop_token_id_gives_stop_reason(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    ids = [5, 6, 7]
    third = expected_tokens(ids, 3)[2]
    send(s, MsgType.GENERATE, {"request_id": "st", "prompt_token_ids": ids,
                               "sampling_params": {"max_tokens": 10,
                                                   "stop_token_ids": [third]}})
    deltas, _, final = recv_until_final(s, "st")
    assert final["finish_reason"] == "stop"
    assert [t for d in deltas for t in d["token_ids"]][-1] == third


def test_abort_found_and_not_found(start_server, zmq_ctx):
    _, ep = start_server(FakeEngine(step_delay_s=0.01))
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "long", "prompt": "x",
                               "sampling_params": {"max_tokens": 200}})
    kind, body = recv(s)
    assert kind == MsgType.DELTA
    send(s, MsgType.ABORT, {"request_id": "long"})
    replies = []
    while not any(k == MsgType.FINAL for k, _ in replies):
        replies.append(recv(s))
    acks = [b for k, b in replies if k == MsgType.ABORTED]
    assert acks == [{"request_id": "long", "found": True}]
    final = [b for k, b in replies if k == MsgType.FINAL][0]
    assert final["finish_reason"] == "abort" and final["usage"]["completion_tokens"] < 200
    send(s, MsgType.ABORT, {"request_id": "long"})
    assert recv(s) == (MsgType.ABORTED, {"request_id": "long", "found": False})


def test_ping_model_info_stats(start_server, zmq_ctx):
    _, ep = start_server(lease_s=7.5)
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.PING, {})
    kind, pong = recv(s)
    assert kind == MsgType.PONG and pong["status"] == "ok" and pong["request_id"] is None
    assert pong["protocol_version"] == PROTOCOL_VERSION and pong["lease_s"] == 7.5
    assert pong["protocol_revision"] == PROTOCOL_REVISION == "1.4"
    assert_server_id(pong["server_id"])
    assert abs(pong["server_time"] - time.time()) < 60
    send(s, MsgType.MODEL_INFO, {"request_id": "mi"})
    kind, info = recv(s)
    assert kind == MsgType.MODEL_INFO_REPLY and info["request_id"] == "mi"
    for key in ("model", "max_model_len", "block_size", "num_kv_blocks", "kv_capacity_tokens",
                "max_concurrency_at_max_len", "vocab_size", "eos_token_ids", "device", "dtype"):
        assert key in info
    assert info["kv_capacity_tokens"] == info["num_kv_blocks"] * info["block_size"]
    assert info["tokenizer"]["vocab_size"] == info["vocab_size"]
    assert info["server"]["lease_s"] == 7.5
    assert info["server"]["protocol_revision"] == PROTOCOL_REVISION
    assert info["server"]["max_logprobs"] == 20  # 1.3: the engine's (the fake's default)
    assert info["server_id"] == pong["server_id"]  # one instance, one id
    send(s, MsgType.STATS, {"request_id": "st"})
    kind, stats = recv(s)
    assert kind == MsgType.STATS_REPLY and stats["request_id"] == "st"
    for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                "num_free_blocks", "num_total_blocks"):
        assert key in stats["gauges"]
    for key in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions_total"):
        assert key in stats["counters"]
    hist = stats["histograms"]["time_to_first_token_seconds"]
    assert len(hist["counts"]) == len(hist["le"]) + 1 and hist["count"] == sum(hist["counts"])


def test_ttft_histogram_counts_requests(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    for i in range(3):
        send(s, MsgType.GENERATE, {"request_id": f"h{i}", "prompt": "ab",
                                   "sampling_params": {"max_tokens": 2}})
        recv_until_final(s, f"h{i}")
    send(s, MsgType.STATS, {})
    _, stats = recv(s)
    assert stats["histograms"]["time_to_first_token_seconds"]["count"] == 3
    assert stats["counters"]["request_success_total"] == 3


BAD_FRAMES = [
    ("one frame", [bytes((1, 1))], "invalid_message"),
    ("three frames", [bytes((1, 3)), b"\x80", b"x"], "invalid_message"),
    ("long header", [bytes((1, 3, 0)), b"\x80"], "invalid_message"),
    ("version 2", [bytes((2, 3)), b"\x80"], "unsupported_version"),
    ("unknown type", [bytes((1, 0x42)), b"\x80"], "unknown_type"),
    ("reply type", [bytes((1, 0x81)), b"\x80"], "unknown_type"),
    ("not msgpack", [bytes((1, 3)), b"\xc1"], "invalid_message"),
    ("not a map", [bytes((1, 3)), msgpack.packb([1, 2])], "invalid_message"),
    ("trailing bytes", [bytes((1, 3)), b"\x80\x80"], "invalid_message"),
    ("too large", [bytes((1, 1)), msgpack.packb({"prompt": "x" * 5000})], "message_too_large"),
    # 1.2: keys that are not strings anywhere, nesting past 16 levels, extension types.
    ("int key", [bytes((1, 3)), msgpack.packb({1: 2})], "invalid_message"),
    ("bytes key", [bytes((1, 3)), msgpack.packb({b"request_id": "x"}, use_bin_type=True)],
     "invalid_message"),
    ("bytes key nested", [bytes((1, 1)), msgpack.packb(
        {"request_id": "n", "prompt": "x", "sampling_params": {"stop": [{b"k": 1}]}},
        use_bin_type=True)], "invalid_message"),
    ("17 levels", [bytes((1, 1)), b"\x81" + msgpack.packb("stop") + b"\x91" * 15 + b"\x80"],
     "invalid_message"),
    ("1000 levels", [bytes((1, 1)), b"\x81" + msgpack.packb("stop") + b"\x91" * 999 + b"\x80"],
     "invalid_message"),
    ("2000 levels", [bytes((1, 1)), b"\x91" * 2000 + b"\x80"], "invalid_message"),
    ("ext type", [bytes((1, 3)), msgpack.packb({"request_id": msgpack.ExtType(5, b"x")})],
     "invalid_message"),
]


@pytest.mark.parametrize("name,frames,code", BAD_FRAMES, ids=[b[0] for b in BAD_FRAMES])
def test_malformed_frames_get_error(start_server, zmq_ctx, name, frames, code):
    _, ep = start_server(max_message_bytes=4096)
    s = dealer(zmq_ctx, ep)
    s.send_multipart(frames)
    kind, body = recv(s)
    assert kind == MsgType.ERROR and body["code"] == code, body
    assert_error_shape(body)


GOOD = {"request_id": "v", "prompt": "hello", "sampling_params": {"max_tokens": 2}}
BAD_GENERATES = [
    ("no request id", {"prompt": "x"}, "invalid_request", None),
    ("request id int", {"request_id": 5, "prompt": "x"}, "invalid_request", None),
    ("request id too long", {"request_id": "r" * 129, "prompt": "x"}, "invalid_request", None),
    ("unknown field", {**GOOD, "temperature": 0}, "invalid_request", "v"),
    ("two prompts", {**GOOD, "prompt_token_ids": [1]}, "invalid_request", "v"),
    ("no prompt", {"request_id": "v"}, "invalid_request", "v"),
    ("empty prompt", {**GOOD, "prompt": ""}, "empty_prompt", "v"),
    ("empty ids", {"request_id": "v", "prompt_token_ids": []}, "empty_prompt", "v"),
    ("id out of vocab", {"request_id": "v", "prompt_token_ids": [512]}, "invalid_request", "v"),
    ("negative id", {"request_id": "v", "prompt_token_ids": [-1]}, "invalid_request", "v"),
    ("bool id", {"request_id": "v", "prompt_token_ids": [True]}, "invalid_request", "v"),
    ("ids too long", {"request_id": "v", "prompt_token_ids": [1] * 257}, "prompt_too_long", "v"),
    ("text too long", {**GOOD, "prompt": "y" * 257}, "prompt_too_long", "v"),
    ("stream not bool", {**GOOD, "stream": 1}, "invalid_request", "v"),
    ("params not map", {**GOOD, "sampling_params": [1]}, "invalid_request", "v"),
    ("unknown param", {**GOOD, "sampling_params": {"beam": 2}}, "invalid_request", "v"),
    ("temperature str", {**GOOD, "sampling_params": {"temperature": "0"}}, "invalid_request", "v"),
    ("top_p zero", {**GOOD, "sampling_params": {"top_p": 0.0}}, "invalid_request", "v"),
    ("max_tokens 0", {**GOOD, "sampling_params": {"max_tokens": 0}}, "invalid_request", "v"),
    ("stop int", {**GOOD, "sampling_params": {"stop": 3}}, "invalid_request", "v"),
    # 1.2: the server's limits beyond SamplingParams (docs/protocol.md, "sampling_params").
    ("stop id out of vocab", {**GOOD, "sampling_params": {"stop_token_ids": [1, 512]}},
     "invalid_request", "v"),
    ("stop id 2**64-1", {**GOOD, "sampling_params": {"stop_token_ids": [2**64 - 1],
                                                     "min_tokens": 2}}, "invalid_request", "v"),
    ("stop ids 1025", {**GOOD, "sampling_params": {"stop_token_ids": [1] * 1025}},
     "invalid_request", "v"),
    ("stop strings 129", {**GOOD, "sampling_params": {"stop": ["a"] * 129}},
     "invalid_request", "v"),
    ("stop string 1025", {**GOOD, "sampling_params": {"stop": "s" * 1025}},
     "invalid_request", "v"),
    ("repetition_penalty tiny", {**GOOD, "sampling_params": {"repetition_penalty": 5e-324}},
     "invalid_request", "v"),
    ("repetition_penalty 0.0099", {**GOOD, "sampling_params": {"repetition_penalty": 0.0099}},
     "invalid_request", "v"),
    ("temperature nan", {**GOOD, "sampling_params": {"temperature": float("nan")}},
     "invalid_request", "v"),
    ("top_p inf", {**GOOD, "sampling_params": {"top_p": float("inf")}}, "invalid_request", "v"),
    ("seed -2", {**GOOD, "sampling_params": {"seed": -2}}, "invalid_request", "v"),
    ("temperature 2.0001", {**GOOD, "sampling_params": {"temperature": 2.0001}},
     "invalid_request", "v"),
    ("greedy n 2", {**GOOD, "sampling_params": {"temperature": 0, "n": 2}}, "invalid_request",
     "v"),
    # 1.3: vLLM's checks against the model, the new fields and their server limits.
    ("negative stop id", {**GOOD, "sampling_params": {"stop_token_ids": [-1]}},
     "invalid_request", "v"),
    ("logprobs 21", {**GOOD, "sampling_params": {"logprobs": 21}}, "invalid_request", "v"),
    ("logprobs -1 (vocab > 20)", {**GOOD, "sampling_params": {"logprobs": -1}},
     "invalid_request", "v"),
    ("prompt_logprobs 21", {**GOOD, "sampling_params": {"prompt_logprobs": 21}},
     "invalid_request", "v"),
    ("output_kind", {**GOOD, "sampling_params": {"output_kind": 1}}, "invalid_request", "v"),
    ("output_kind str", {**GOOD, "sampling_params": {"output_kind": "final_only"}},
     "invalid_request", "v"),
    ("private bad words ids", {**GOOD, "sampling_params": {"_bad_words_token_ids": [[1]]}},
     "invalid_request", "v"),
    ("logit_bias key not int", {**GOOD, "sampling_params": {"logit_bias": {"x": 1.0}}},
     "invalid_request", "v"),
    ("logit_bias out of vocab", {**GOOD, "sampling_params": {"logit_bias": {"512": 1.0}}},
     "invalid_request", "v"),
    ("logit_bias negative id", {**GOOD, "sampling_params": {"logit_bias": {"-1": 1.0}}},
     "invalid_request", "v"),
    ("logit_bias value str", {**GOOD, "sampling_params": {"logit_bias": {"5": "1"}}},
     "invalid_request", "v"),
    ("logit_bias 100.5", {**GOOD, "sampling_params": {"logit_bias": {"5": 100.5}}},
     "invalid_request", "v"),
    ("logit_bias nan", {**GOOD, "sampling_params": {"logit_bias": {"5": float("nan")}}},
     "invalid_request", "v"),
    ("logit_bias list", {**GOOD, "sampling_params": {"logit_bias": [[5, 1.0]]}},
     "invalid_request", "v"),
    ("logit_bias 1025", {**GOOD, "sampling_params": {"logit_bias": {
        str(i): 1.0 for i in range(1025)}}}, "invalid_request", "v"),
    ("allowed empty", {**GOOD, "sampling_params": {"allowed_token_ids": []}},
     "invalid_request", "v"),
    ("allowed out of vocab", {**GOOD, "sampling_params": {"allowed_token_ids": [1, 512]}},
     "invalid_request", "v"),
    ("allowed str", {**GOOD, "sampling_params": {"allowed_token_ids": ["1"]}},
     "invalid_request", "v"),
    ("allowed 16385", {**GOOD, "sampling_params": {"allowed_token_ids": [1] * 16385}},
     "invalid_request", "v"),
    ("bad_words str", {**GOOD, "sampling_params": {"bad_words": "a"}}, "invalid_request", "v"),
    ("bad_words empty word", {**GOOD, "sampling_params": {"bad_words": [""]}},
     "invalid_request", "v"),
    ("bad_words 129", {**GOOD, "sampling_params": {"bad_words": ["a"] * 129}},
     "invalid_request", "v"),
    ("bad word 1025", {**GOOD, "sampling_params": {"bad_words": ["b" * 1025]}},
     "invalid_request", "v"),
    ("truncate 0", {**GOOD, "sampling_params": {"truncate_prompt_tokens": 0}},
     "invalid_request", "v"),
    ("spaces not bool", {**GOOD, "sampling_params": {"spaces_between_special_tokens": 1}},
     "invalid_request", "v"),
    ("chat option with prompt", {**GOOD, "add_generation_prompt": False}, "invalid_request",
     "v"),
    ("tools with token ids", {"request_id": "v", "prompt_token_ids": [1], "tools": []},
     "invalid_request", "v"),
    ("tools not maps", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                        "tools": ["f"]}, "invalid_request", "v"),
    ("tools map", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                   "tools": {"type": "function"}}, "invalid_request", "v"),
    ("tools 129", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                   "tools": [{}] * 129}, "invalid_request", "v"),
    ("template int", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                      "chat_template": 5}, "invalid_request", "v"),
    ("template too long", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                           "chat_template": "x" * 32769}, "invalid_request", "v"),
    ("gen prompt not bool", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                             "add_generation_prompt": 1}, "invalid_request", "v"),
    ("continue and gen prompt", {"request_id": "v", "continue_final_message": True,
                                 "messages": [{"role": "assistant", "content": "a"}]},
     "invalid_request", "v"),
    ("kwargs list", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                     "chat_template_kwargs": [1]}, "invalid_request", "v"),
    ("kwargs reserved", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                         "chat_template_kwargs": {"messages": []}}, "invalid_request", "v"),
    ("kwargs 65", {"request_id": "v", "messages": [{"role": "user", "content": "a"}],
                   "chat_template_kwargs": {f"k{i}": i for i in range(65)}},
     "invalid_request", "v"),
    ("deep temperature", {**GOOD, "sampling_params": {"temperature": [[[[[[[[[[1]]]]]]]]]]}},
     "invalid_request", "v"),
    ("bytes value", {**GOOD, "prompt": b"bytes"}, "invalid_request", "v"),
    ("bad role", {"request_id": "v", "messages": [{"role": "x", "content": "a"}]},
     "invalid_request", "v"),
    ("empty chat", {"request_id": "v", "messages": [{"role": "user", "content": ""}]},
     "empty_prompt", "v"),
]


@pytest.mark.parametrize("name,body,code,rid", BAD_GENERATES, ids=[b[0] for b in BAD_GENERATES])
def test_invalid_generate_gets_error_and_spares_others(start_server, zmq_ctx, name, body, code,
                                                        rid):
    _, ep = start_server(FakeEngine(step_delay_s=0.002))
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "ok", "prompt": "fine",
                               "sampling_params": {"max_tokens": 30}})
    send(s, MsgType.GENERATE, body)
    errors = []
    deltas, kind, _ = [], None, None
    while kind != MsgType.FINAL:
        kind, reply = recv(s)
        if kind == MsgType.ERROR:
            errors.append(reply)
        elif reply["request_id"] == "ok" and kind == MsgType.DELTA:
            deltas.append(reply)
    assert len(errors) == 1 and errors[0]["code"] == code and errors[0]["request_id"] == rid
    assert_error_shape(errors[0])
    assert [t for d in deltas for t in d["token_ids"]] == expected_tokens(list(b"fine"), 30)


GOOD_EXTREMES = [
    {"repetition_penalty": 0.01, "temperature": 2, "top_p": 5e-324},
    {"repetition_penalty": 1e6, "top_k": 2**63 - 1, "min_p": 1.0, "seed": 2**64 - 1},
    {"stop_token_ids": [0, 511] + [7] * 1022, "min_tokens": 3, "stop": ["q"] * 128},
    {"stop": "s" * 1024, "presence_penalty": -2, "frequency_penalty": 2, "n": 64},
    {"logprobs": 20, "prompt_logprobs": 20, "temperature": 1e-5, "top_k": -1},
    # 1.3
    {"seed": -1, "logprobs": True, "prompt_logprobs": True, "temperature": 0.001},
    {"logit_bias": {str(i): (-100.0 if i % 2 else 100) for i in range(512)},
     "allowed_token_ids": list(range(512)) * 32},
    {"bad_words": ["w" * 1024] + [f"b{i}" for i in range(127)], "truncate_prompt_tokens": -1,
     "spaces_between_special_tokens": False, "allowed_token_ids": [511]},
    {"logit_bias": {"0": 0, "511": 1e-300}, "truncate_prompt_tokens": 1, "n": 3},
]


@pytest.mark.parametrize("params", GOOD_EXTREMES)
def test_extreme_but_valid_params_are_served(start_server, zmq_ctx, params):
    """The bounds of every documented range are inside it (docs/protocol.md, 1.2)."""
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "e", "prompt": "edge", "stream": False,
                               "sampling_params": {**params, "max_tokens": 3}})
    _, kind, body = recv_until_final(s, "e")
    assert kind == MsgType.FINAL, body


def test_error_messages_are_bounded_and_request_ids_valid(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {**GOOD, "sampling_params": {"stop_token_ids": [-1] * 50_000}})
    kind, body = recv(s)
    assert kind == MsgType.ERROR and body["code"] == "invalid_request"
    assert len(body["message"]) <= 1000 and body["request_id"] == "v"
    send(s, MsgType.PING, {"request_id": "r" * 129, "junk": 1})  # not a valid id: not echoed
    kind, body = recv(s)
    assert kind == MsgType.ERROR and body["request_id"] is None
    assert_error_shape(body)


def test_other_messages_reject_unknown_fields(start_server, zmq_ctx):
    _, ep = start_server()
    s = dealer(zmq_ctx, ep)
    for t in (MsgType.PING, MsgType.MODEL_INFO, MsgType.STATS, MsgType.ABORT):
        send(s, t, {"request_id": "q", "extra": 1})
        kind, body = recv(s)
        assert kind == MsgType.ERROR and body["code"] == "invalid_request"
        assert body["request_id"] == "q" and "extra" in body["message"]
    send(s, MsgType.ABORT, {})
    kind, body = recv(s)
    assert kind == MsgType.ERROR and body["code"] == "invalid_request"


def test_duplicate_request_id_per_connection(start_server, zmq_ctx):
    _, ep = start_server(FakeEngine(step_delay_s=0.005))
    a, b = dealer(zmq_ctx, ep), dealer(zmq_ctx, ep)
    body = {"request_id": "same", "prompt": "p", "sampling_params": {"max_tokens": 20}}
    send(a, MsgType.GENERATE, body)
    send(a, MsgType.GENERATE, body)
    send(b, MsgType.GENERATE, body)  # another connection may reuse the id
    _, kind_b, _ = recv_until_final(b, "same")
    assert kind_b == MsgType.FINAL
    kinds = []
    while MsgType.FINAL not in kinds:
        kind, reply = recv(a)
        kinds.append(kind)
        if kind == MsgType.ERROR:
            assert reply["code"] == "duplicate_request_id"
    assert kinds.count(MsgType.ERROR) == 1


def test_overloaded_past_the_queue_bound(start_server, zmq_ctx):
    _, ep = start_server(FakeEngine(step_delay_s=0.01), max_queued_requests=3)
    s = dealer(zmq_ctx, ep)
    for i in range(5):
        send(s, MsgType.GENERATE, {"request_id": f"o{i}", "prompt": "p",
                                   "sampling_params": {"max_tokens": 50}})
    errors, finals = [], []
    while len(errors) + len(finals) < 5:
        kind, body = recv(s)
        if kind == MsgType.ERROR:
            errors.append(body)
        elif kind == MsgType.FINAL:
            finals.append(body)
    assert sorted(e["request_id"] for e in errors) == ["o3", "o4"]
    assert all(e["code"] == "overloaded" for e in errors) and len(finals) == 3


def test_capacity_error_from_engine(start_server, zmq_ctx):
    # The fake engine rejects everything when one max-length request cannot fit its pool.
    _, ep = start_server(FakeEngine(num_kv_blocks=4))
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "cap", "prompt": "p"})
    kind, body = recv(s)
    assert kind == MsgType.ERROR and body["code"] == "capacity" and body["request_id"] == "cap"


def test_lease_expiry_aborts_silent_client(start_server, zmq_ctx):
    server, ep = start_server(FakeEngine(step_delay_s=0.01), lease_s=0.5)
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "quiet", "prompt": "p", "stream": False,
                               "sampling_params": {"max_tokens": 10_000 // 100}})
    # max_tokens 100 at 10 ms a step takes ~1 s: longer than the lease, and we never ping.
    kind, body = recv(s)
    assert kind == MsgType.ERROR and body["code"] == "lease_expired"
    assert body["request_id"] == "quiet"


def test_pinging_client_keeps_its_lease(start_server, zmq_ctx):
    _, ep = start_server(FakeEngine(step_delay_s=0.01), lease_s=0.5)
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "alive", "prompt": "p", "stream": False,
                               "sampling_params": {"max_tokens": 100}})
    while True:
        send(s, MsgType.PING, {"request_id": "hb"})
        if not s.poll(200):
            continue
        kind, body = recv(s)
        if body.get("request_id") == "alive":
            break
    assert kind == MsgType.FINAL and body["usage"]["completion_tokens"] == 100


class FlakyEngine(FakeEngine):
    """LLMEngine's fault isolation (docs/engine_api.md, "Failures"): the first time a request
    with a 'boom' prompt runs, its part of the step fails, so that request alone ends with
    finish_reason "error" and RequestOutput.error set, its blocks freed; the rest go on."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.armed = True

    def step(self):
        from pagedrun.runtime.outputs import CompletionOutput, RequestOutput, Usage
        failed = []
        for req in list(self._requests.values()):
            if self.armed and req.prompt_ids == list(b"boom"):
                self.armed = False
                del self._requests[req.request_id]
                failed.append(RequestOutput(
                    req.request_id, req.prompt_ids,
                    [CompletionOutput(0, [], "", finish_reason="error")], finished=True,
                    usage=Usage(len(req.prompt_ids), 0, 0),
                    error="sampling failed: RuntimeError: simulated kernel failure"))
        return failed + super().step()


class DeadEngine(FakeEngine):
    """A step that raises: what escapes LLMEngine.step (EngineDeadError) is fatal."""

    def step(self):
        if any(r.prompt_ids == list(b"dead") for r in self._requests.values()):
            raise RuntimeError("simulated dead device")
        return super().step()


def test_engine_death_fails_every_request_and_stops_the_server(start_server, zmq_ctx):
    server, ep = start_server(DeadEngine(step_delay_s=0.01))
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "a", "prompt": "abc",
                               "sampling_params": {"max_tokens": 500}})
    assert recv(s)[0] == MsgType.DELTA
    send(s, MsgType.GENERATE, {"request_id": "d", "prompt": "dead"})
    errors = {}
    while len(errors) < 2:
        kind, body = recv(s)
        if kind == MsgType.ERROR:
            assert_error_shape(body)
            errors[body["request_id"]] = body
    assert {e["code"] for e in errors.values()} == {"internal_error"}
    assert "simulated dead device" in errors["d"]["message"]
    server._thread.join(20)
    assert not server._thread.is_alive() and "simulated dead device" in server.engine_dead


def test_engine_failure_is_internal_error_and_server_recovers(start_server, zmq_ctx):
    _, ep = start_server(FlakyEngine(step_delay_s=0.002))
    s = dealer(zmq_ctx, ep)
    send(s, MsgType.GENERATE, {"request_id": "other", "prompt": "calm",
                               "sampling_params": {"max_tokens": 30}})
    send(s, MsgType.GENERATE, {"request_id": "b", "prompt": "boom"})
    ends, tokens = {}, []
    while len(ends) < 2:
        kind, body = recv(s)
        if kind == MsgType.DELTA:
            assert body["request_id"] == "other"
            tokens += body["token_ids"]
        else:
            ends[body["request_id"]] = (kind, body)
    kind, body = ends["b"]
    assert kind == MsgType.ERROR and body["code"] == "internal_error"
    assert "simulated kernel failure" in body["message"]
    assert_error_shape(body)
    assert ends["other"][0] == MsgType.FINAL  # the rest of the batch went on
    assert tokens == expected_tokens(list(b"calm"), 30)
    send(s, MsgType.GENERATE, {"request_id": "after", "prompt": "fine",
                               "sampling_params": {"max_tokens": 4}})
    deltas, kind, _ = recv_until_final(s, "after")
    assert kind == MsgType.FINAL
    assert [t for d in deltas for t in d["token_ids"]] == expected_tokens(list(b"fine"), 4)
    send(s, MsgType.STATS, {})
    _, stats = recv(s)
    assert stats["gauges"]["server_requests_in_flight"] == 0
    assert stats["gauges"]["num_free_blocks"] == stats["gauges"]["num_total_blocks"]
