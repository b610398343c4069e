"""Fuzz: thousands of malformed messages (random frames, truncated msgpack, wrong field types,
unknown types, oversized bodies) against one live server. Every case must get exactly one ERROR
of the fixed shape, and afterwards the server must still serve a normal request correctly."""
from __future__ import annotations

import msgpack
import pytest
from fake_engine import FakeEngine, expected_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire import assert_error_shape, dealer, recv, recv_until_final, send

from pagedrun.server.protocol import MsgType

MAX_MESSAGE_BYTES = 2048
FUZZ = settings(max_examples=800, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

VALID = {"request_id": "fz", "prompt": "hello", "stream": True,
         "sampling_params": {"max_tokens": 1, "temperature": 0}}


@pytest.fixture(scope="module")
def server_endpoint():
    import zmq

    from pagedrun.server.server import Server, ServerConfig
    server = Server(FakeEngine(), ServerConfig(endpoint="tcp://127.0.0.1:*",
                                               max_message_bytes=MAX_MESSAGE_BYTES))
    endpoint = server.start()
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint)
    yield sock
    # The server is still healthy: a normal request is served exactly.
    send(sock, MsgType.GENERATE, {**VALID, "request_id": "after",
                                  "sampling_params": {"max_tokens": 7}})
    deltas, kind, _ = recv_until_final(sock, "after")
    assert kind == MsgType.FINAL
    assert [t for d in deltas for t in d["token_ids"]] == expected_tokens(list(b"hello"), 7)
    send(sock, MsgType.STATS, {})
    _, stats = recv(sock)
    assert stats["gauges"]["server_requests_in_flight"] == 0
    ctx.destroy(linger=0)
    server.stop()


def expect_one_error(sock) -> dict:
    kind, body = recv(sock)
    assert kind == MsgType.ERROR, body
    assert_error_shape(body)
    assert not sock.poll(0) or recv(sock)[0] != MsgType.ERROR  # exactly one reply
    return body


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_frames(server_endpoint, frames):
    server_endpoint.send_multipart(frames)
    expect_one_error(server_endpoint)


@FUZZ
@given(body=st.binary(max_size=256), msg_type=st.integers(0, 255))
def test_random_body_any_type(server_endpoint, body, msg_type):
    server_endpoint.send_multipart([bytes((1, msg_type)), body])
    expect_one_error(server_endpoint)


@FUZZ
@given(cut=st.integers(1, 10_000), msg_type=st.sampled_from(list(MsgType)[:5]))
def test_truncated_msgpack(server_endpoint, cut, msg_type):
    packed = msgpack.packb(VALID)
    send(server_endpoint, msg_type, packed[:cut % len(packed)])
    expect_one_error(server_endpoint)


@FUZZ
@given(size=st.integers(MAX_MESSAGE_BYTES + 1, 4 * MAX_MESSAGE_BYTES))
def test_oversized_bodies(server_endpoint, size):
    body = msgpack.packb({**VALID, "prompt": "z" * size})
    send(server_endpoint, MsgType.GENERATE, body)
    error = expect_one_error(server_endpoint)
    # request_id is the first key: the refusal names it (read from the body's first bytes).
    assert error["code"] == "message_too_large" and error["request_id"] == VALID["request_id"]


@pytest.mark.parametrize("body,expected", [
    ({"request_id": "a", "prompt": "z" * 5000}, "a"),
    ({"stream": True, "n": 2, "request_id": "b", "prompt": "z" * 5000}, "b"),
    ({"prompt": "z" * 5000, "request_id": "late"}, None),      # past the prefix: not read
    ({"request_id": "r" * 129, "prompt": "z" * 5000}, None),   # not a valid id
    ({"request_id": 7, "prompt": "z" * 5000}, None),
    ([["request_id", "a"]], None),                              # not a map
])
def test_request_id_from_a_bounded_prefix(body, expected):
    from pagedrun.server.protocol import ID_PREFIX_BYTES, request_id_from_prefix
    packed = msgpack.packb(body)
    assert request_id_from_prefix(packed[:ID_PREFIX_BYTES]) == expected


@FUZZ
@given(prefix=st.binary(max_size=2048))
def test_request_id_from_any_prefix_is_total(prefix):
    from pagedrun.server.protocol import request_id_from_prefix
    rid = request_id_from_prefix(prefix)
    assert rid is None or (isinstance(rid, str) and 1 <= len(rid) <= 128)


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                 st.text(max_size=8), st.binary(max_size=8),
                 st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**63 - 1), max_size=2))


def wrong_for(field: str):
    """Values that are never valid for `field` of a GENERATE body."""
    if field == "request_id":
        return JUNK.filter(lambda v: not (isinstance(v, str) and 1 <= len(v) <= 128))
    if field == "prompt":
        return JUNK.filter(lambda v: not isinstance(v, str) or v == "")
    if field == "stream":
        return JUNK.filter(lambda v: not isinstance(v, bool))
    return JUNK.filter(lambda v: not isinstance(v, dict) or v)  # sampling_params


def _valid_bias(value) -> bool:
    """A logit_bias the fake engine's server accepts: keys of ids in [0, 512), |bias| <= 100."""
    if not isinstance(value, dict):
        return False
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            return False
        if not (0 <= token_id < 512 and isinstance(bias, (int, float))
                and not isinstance(bias, bool) and abs(bias) <= 100):
            return False
    return True


PARAM_JUNK = {
    "temperature": JUNK.filter(lambda v: not (isinstance(v, (int, float))
                                              and not isinstance(v, bool) and 0 <= v <= 2)),
    "max_tokens": JUNK.filter(lambda v: v is not None and not (
        isinstance(v, int) and not isinstance(v, bool) and v >= 1)),
    "top_k": JUNK.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool)
                                        and v >= -1)),
    "n": JUNK.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool)
                                    and 1 <= v <= 16384)),
    # True is 1 (vLLM); -1 is the whole vocabulary, more than the fake engine's max_logprobs
    "logprobs": JUNK.filter(lambda v: v is not None and v is not True and not (
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 20)),
    "logit_bias": JUNK.filter(lambda v: v is not None and not _valid_bias(v)),
    "allowed_token_ids": JUNK.filter(lambda v: v is not None and not (
        isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t < 512 for t in v))),
    "ignore_eos": JUNK.filter(lambda v: not isinstance(v, bool)),
}


@FUZZ
@given(data=st.data(), field=st.sampled_from(["request_id", "prompt", "stream",
                                               "sampling_params"]))
def test_wrong_field_types(server_endpoint, data, field):
    body = {**VALID, field: data.draw(wrong_for(field))}
    send(server_endpoint, MsgType.GENERATE, body)
    expect_one_error(server_endpoint)


@FUZZ
@given(data=st.data(), name=st.sampled_from(sorted(PARAM_JUNK)))
def test_wrong_sampling_params(server_endpoint, data, name):
    body = {**VALID, "sampling_params": {name: data.draw(PARAM_JUNK[name])}}
    send(server_endpoint, MsgType.GENERATE, body)
    assert expect_one_error(server_endpoint)["code"] == "invalid_request"


@FUZZ
@given(extra=st.text(min_size=1, max_size=10).filter(
    lambda k: k not in {"request_id", "prompt", "prompt_token_ids", "messages",
                        "sampling_params", "stream"}), value=JUNK,
       msg_type=st.sampled_from(list(MsgType)[:5]))
def test_unknown_fields(server_endpoint, extra, value, msg_type):
    send(server_endpoint, msg_type, {**VALID, extra: value})
    assert expect_one_error(server_endpoint)["code"] == "invalid_request"
