"""Fuzz a real server process (docs/protocol.md 1.2, "every request gets a reply"): arbitrary
msgpack values (maps with non-string keys at any depth, nesting up to 2,000 levels, integers at
the 64-bit edges, NaN/inf floats, bytes, extension types), raw garbage frames, GENERATE bodies
with junk in any field, and valid-but-extreme sampling parameters (every documented bound, just
inside and just outside, in combination).

Per message the server must answer exactly once (an accepted GENERATE: DELTA* then one FINAL or
ERROR), every ERROR must have the documented shape, and no reply may be `internal_error`; the
process must be alive afterwards, a greedy request must give the tokens it gave before the
fuzzing, and once idle no KV block may be held. Each campaign prints one summary line.

Also the regression tests of the two crash classes of issue 12 (a map with non-string keys, a
value nested ~1,000 levels deep: both made 1.1 servers exit while formatting the error).

Protocol 1.3 adds to every campaign: the new sampling fields (logit_bias, allowed_token_ids,
bad_words, truncate_prompt_tokens, spaces_between_special_tokens; output_kind and the engine's
private field, never valid) at their bounds and past them, vLLM's new ranges, and GENERATEs
with chat options (valid and junk, with messages and with the other prompt kinds); and a test
that a burst of bad 1.3 requests leaves a stream in flight on the same connection untouched.
"""
from __future__ import annotations

import time

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire import assert_error_shape, dealer, free_tcp_endpoint, recv

from pagedrun.runtime.sampling_params import RequestOutputKind
from pagedrun.server.protocol import PROTOCOL_VERSION, MsgType

FAKE_VOCAB = 512   # tests/server/fake_engine.py
TINY_VOCAB = 257   # tests/fixtures/tiny/llama_tied_bf16
REPLY_TIMEOUT_MS = 30_000
TERMINAL = {MsgType.FINAL, MsgType.ERROR, MsgType.ABORTED, MsgType.PONG,
            MsgType.MODEL_INFO_REPLY, MsgType.STATS_REPLY}
TAGGED = {MsgType.DELTA, MsgType.FINAL, MsgType.ERROR, MsgType.PONG, MsgType.MODEL_INFO_REPLY}
# Error codes a fuzzed message may get. internal_error is not among them: it would mean the
# server or the engine failed on some input (a bug to report, not an answer to accept).
EXPECTED_CODES = {"invalid_message", "unsupported_version", "unknown_type", "message_too_large",
                  "invalid_request", "empty_prompt", "prompt_too_long", "capacity"}


def fuzz_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


# --- strategies -------------------------------------------------------------------------
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                             2**64 - 1, -2**31, -2**63])
INTS = st.one_of(EDGE_INTS, st.integers(-2**63, 2**64 - 1))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(width=32, allow_nan=True, allow_infinity=True),
                   st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 5e-324,
                                    1.7976931348623157e308]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=12),
                    st.binary(max_size=12),
                    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)))
KEYS = st.one_of(st.text(max_size=8), st.sampled_from(["request_id", "prompt", "stop", "n"]),
                 INTS, st.binary(max_size=4), st.booleans(), st.none(),
                 st.floats(allow_nan=False))
VALUES = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=24)
REQUEST_TYPES = st.sampled_from([MsgType.GENERATE] * 4 + [MsgType.ABORT, MsgType.PING,
                                                          MsgType.MODEL_INFO, MsgType.STATS])
SAMPLING_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens",
                   "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                   "logprobs", "prompt_logprobs", "skip_special_tokens",
                   # 1.3
                   "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                   "spaces_between_special_tokens", "output_kind", "_bad_words_token_ids"]
CHAT_OPTION_FIELDS = ["chat_template", "add_generation_prompt", "continue_final_message",
                      "tools", "chat_template_kwargs"]
_PLACEHOLDER = "\x00deep-value-goes-here\x00"


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def deep_bytes(kinds: list[int], leaf) -> bytes:
    """`len(kinds)` nested containers built as bytes (msgpack's packer stops at 512 levels):
    0 an array, 1 a map with a string key, 2 a map with an int key, 3 a map with a bytes key."""
    heads = {0: b"\x91", 1: b"\x81" + pack("k"), 2: b"\x81" + pack(7),
             3: b"\x81" + pack(b"k")}
    return b"".join(heads[k] for k in kinds) + pack(leaf)


@st.composite
def deep_bodies(draw) -> bytes:
    depth = draw(st.one_of(st.integers(1, 40), st.integers(990, 1030), st.integers(1, 2000)))
    kinds = draw(st.lists(st.integers(0, 3), min_size=depth, max_size=depth)
                 if depth <= 40 else st.sampled_from([[k] * depth for k in range(4)]))
    deep = deep_bytes(kinds, draw(SCALARS))
    where = draw(st.sampled_from(["top", "request_id", "prompt", "messages", "temperature",
                                  "stop", "stop_token_ids", "extra"]))
    if where == "top":
        return deep
    body: dict = {"request_id": "deep", "prompt": "x", "sampling_params": {"max_tokens": 1}}
    if where in ("request_id", "prompt", "messages"):
        body.pop("prompt")
        body[where] = _PLACEHOLDER
    elif where == "extra":
        body["extra"] = _PLACEHOLDER
    else:
        body["sampling_params"][where] = _PLACEHOLDER
    return pack(body).replace(pack(_PLACEHOLDER), deep)


@st.composite
def junk_generates(draw, vocab: int) -> dict:
    """A GENERATE that is valid but for junk in some fields (or extra keys of any type)."""
    body: dict = {"request_id": draw(st.text(min_size=1, max_size=8)),
                  "prompt_token_ids": draw(st.lists(st.integers(0, vocab - 1), min_size=1,
                                                    max_size=12)),
                  "sampling_params": {"max_tokens": draw(st.integers(1, 8))},
                  "stream": draw(st.booleans())}
    for field in draw(st.lists(st.sampled_from(["request_id", "prompt_token_ids", "prompt",
                                                "messages", "stream", "sampling_params",
                                                *CHAT_OPTION_FIELDS]),
                               max_size=2, unique=True)):
        body[field] = draw(VALUES)
    params = body["sampling_params"]
    if isinstance(params, dict):
        for field in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), max_size=3, unique=True)):
            params[field] = draw(VALUES)
        if draw(st.booleans()):
            params.update(draw(st.dictionaries(KEYS, VALUES, max_size=2)))
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(KEYS, VALUES, max_size=2)))
    return body


def extreme_values(vocab: int) -> dict:
    """Per sampling field: (values inside its documented range: the bounds and just inside,
    values just outside it)."""
    return {
        "n": ([1, 2, 64], [0, 16385]),
        "temperature": ([0, 0.0, -0.0, 9.99e-6, 1e-5, 1.0001e-5, 0.005, 1.0, 2, 2.0],
                        [2.0001, 100, -1e-300, float("nan"), float("inf")]),
        "top_p": ([5e-324, 1e-300, 1e-7, 0.5, 1.0], [0.0, 1.0000001, float("nan")]),
        "top_k": ([-1, 0, 1, 2, vocab - 1, vocab, 2**31, 2**63 - 1], [-2, -2**63]),
        "min_p": ([0, 5e-324, 0.5, 1.0], [1.0000001, -5e-324]),
        "repetition_penalty": ([0.01, 0.0100001, 1.0, 9.99, 10, 10.0001, 1e6],
                               [5e-324, 0.0099, 0.0, float("inf")]),
        "presence_penalty": ([-2, -2.0, 0, 2, 2.0], [-2.0001, 2.0001]),
        "frequency_penalty": ([-2, -2.0, 0, 2, 2.0], [-2.0001, 2.0001]),
        "seed": ([None, -1, 0, 1, 2**63 - 1, 2**64 - 1], [-2, -2**63]),
        "max_tokens": ([None, 1, 2, 16], [0, -1]),
        "min_tokens": ([0, 1, 2], [2**63 - 1]),
        "stop": ([[], "a", ["a"], ["x" * 1024], ["a"] * 128], [["x" * 1025], ["a"] * 129,
                                                             [""], ""]),
        "stop_token_ids": ([[0], [1, vocab - 1], list(range(vocab)), [0] * 1024],
                           [[vocab], [2**63 - 1], [-1], [0] * 1025]),
        "include_stop_str_in_output": ([True, False], [1]),
        "ignore_eos": ([True, False], [0]),
        "skip_special_tokens": ([True, False], [None]),
        # -1: the whole vocabulary, more than the default max_logprobs of 20
        "logprobs": ([None, 0, 1, 20, True], [-1, 21, False]),
        "prompt_logprobs": ([None, 0, 20, True], [-1, 21, -2]),
        # 1.3
        "logit_bias": ([None, {}, {"0": 1.0}, {str(vocab - 1): -100, "1": 100, "2": -0.0},
                        {str(i): 0.25 for i in range(vocab)}],
                       [{"x": 1.0}, {str(vocab): 1.0}, {"-1": 1.0}, {"1": 100.5},
                        {"1": float("nan")}, {"1": "a"}, [[1, 1.0]], {"1": None},
                        {str(i): 1 for i in range(1025)}]),
        "allowed_token_ids": ([None, [0], [vocab - 1], list(range(vocab)),
                               [vocab - 1] * 16384],
                              [[], [vocab], [-1], ["1"], [0] * 16385, 5]),
        "bad_words": ([[], ["w" * 1024], [f"b{i}" for i in range(128)]],
                      [[""], "a", ["a"] * 129, ["x" * 1025], [1]]),
        "truncate_prompt_tokens": ([None, 1, 5, -1], [0, -2, 1.5]),
        "spaces_between_special_tokens": ([True, False], [1]),
    }


@st.composite
def extreme_generates(draw, vocab: int) -> dict:
    """Valid-but-extreme sampling parameters (mostly), now and then one value out of range."""
    values = extreme_values(vocab)
    names = draw(st.lists(st.sampled_from(sorted(values)), max_size=8, unique=True))
    params = {name: draw(st.sampled_from(values[name][0])) for name in names}
    if names and draw(st.integers(0, 4)) == 0:
        name = draw(st.sampled_from(names))
        params[name] = draw(st.sampled_from(values[name][1]))
    if params.get("max_tokens", 16) is None and params.get("n", 1) > 2:
        params["max_tokens"] = 4  # bound the run time, not the coverage of None
    if params.get("logprobs") is not None and params.get("n", 1) > 2:
        params["max_tokens"] = 2  # a reply entry per token and alternative: bound it
    return {"request_id": "x", "prompt_token_ids": draw(st.lists(st.integers(0, vocab - 1),
                                                                 min_size=1, max_size=20)),
            "sampling_params": params, "stream": draw(st.booleans())}


CHAT_OPTION_VALUES = {
    "chat_template": ([None, "{{ messages[0].content }}", "x" * 32768],
                      ["x" * 32769, 5, "{% for %}", ["t"]]),
    "add_generation_prompt": ([True, False], [1, None, "yes"]),
    "continue_final_message": ([False], [1, "no"]),
    "tools": ([None, [], [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "enum": ["a"]}}}}}],
               [{}] * 128], [[{}] * 129, ["f"], {"type": "function"}, [[{}]], "tools", 3]),
    "chat_template_kwargs": ([None, {}, {"style": "!"}, {f"k{i}": i for i in range(64)}],
                             [[1], "k", {"tokenize": True}, {"messages": []},
                              {f"k{i}": i for i in range(65)}]),
}


@st.composite
def chat_generates(draw, vocab: int) -> dict:
    """A GENERATE with chat options: mostly with messages, valid or one value out of range;
    now and then with another prompt kind (always an error)."""
    names = draw(st.lists(st.sampled_from(sorted(CHAT_OPTION_VALUES)), min_size=1,
                          max_size=3, unique=True))
    options = {n: draw(st.sampled_from(CHAT_OPTION_VALUES[n][0])) for n in names}
    if draw(st.integers(0, 2)) == 0:
        name = draw(st.sampled_from(names))
        options[name] = draw(st.sampled_from(CHAT_OPTION_VALUES[name][1]))
    body = {"request_id": "chat", "stream": draw(st.booleans()),
            "sampling_params": {"max_tokens": draw(st.integers(1, 4))}, **options}
    prompt = draw(st.sampled_from(["messages"] * 4 + ["prompt", "prompt_token_ids"]))
    if prompt == "messages":
        body["messages"] = [{"role": "user", "content": "hi"}] + draw(st.sampled_from(
            [[], [{"role": "assistant", "content": "The answer"}]]))
    elif prompt == "prompt":
        body["prompt"] = "hi"
    else:
        body["prompt_token_ids"] = [1 % vocab, 2 % vocab]
    return body


@st.composite
def messages(draw, vocab: int, extreme_percent: int) -> list[bytes]:
    """One fuzzed message: its list of frames (DEALER side: no routing id); about
    `extreme_percent` % of them are valid-but-extreme GENERATEs."""
    header = lambda t: bytes((PROTOCOL_VERSION, int(t)))  # noqa: E731
    if draw(st.integers(0, 99)) < extreme_percent:
        return [header(MsgType.GENERATE), pack(draw(extreme_generates(vocab)))]
    return draw(st.one_of(
        st.lists(st.binary(max_size=48), min_size=1, max_size=4),                  # garbage
        st.tuples(st.integers(0, 255), st.integers(0, 255), st.binary(max_size=64))
        .map(lambda v: [bytes(v[:2]), v[2]]),                                     # any header
        st.tuples(REQUEST_TYPES, VALUES).map(lambda v: [header(v[0]), pack(v[1])]),
        st.tuples(REQUEST_TYPES, st.dictionaries(KEYS, VALUES, max_size=5))
        .map(lambda v: [header(v[0]), pack(v[1])]),
        st.tuples(REQUEST_TYPES, deep_bodies()).map(lambda v: [header(v[0]), v[1]]),
        junk_generates(vocab).map(lambda b: [header(MsgType.GENERATE), pack(b)]),
        chat_generates(vocab).map(lambda b: [header(MsgType.GENERATE), pack(b)]),
    ))


# --- the campaign -----------------------------------------------------------------------
class Campaign:
    """One DEALER against one server process; counts what the summary line reports."""

    def __init__(self, proc, endpoint: str, zmq_ctx) -> None:
        self.proc = proc
        self.sock = dealer(zmq_ctx, endpoint)
        self.sent = self.replies = self.deltas = self.finals = 0
        self.codes: dict[str, int] = {}
        self.start = time.monotonic()
        self.server_id = self.call(MsgType.PING)["server_id"]

    def call(self, msg_type: MsgType, body: dict | None = None) -> dict:
        rid = f"__call{time.monotonic_ns()}"
        self.sock.send_multipart([bytes((PROTOCOL_VERSION, int(msg_type))),
                                  pack({**(body or {}), "request_id": rid})])
        while True:
            kind, reply = recv(self.sock, REPLY_TIMEOUT_MS)
            if reply.get("request_id") == rid and kind != MsgType.DELTA:
                return reply

    def greedy(self, vocab: int) -> list[int]:
        rid = f"__greedy{time.monotonic_ns()}"
        self.sock.send_multipart([bytes((PROTOCOL_VERSION, MsgType.GENERATE)), pack({
            "request_id": rid, "prompt_token_ids": [3, 1, 4, 1, 5, 9 % vocab], "stream": False,
            "sampling_params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}})])
        while True:
            kind, reply = recv(self.sock, REPLY_TIMEOUT_MS)
            if reply.get("request_id") == rid:
                assert kind == MsgType.FINAL, reply
                return reply["outputs"][0]["token_ids"]

    def exchange(self, frames: list[bytes]) -> None:
        """Send one message, then a PING as a barrier; exactly one terminal reply must come
        for the message (DELTAs before it only for an accepted GENERATE's stream)."""
        self.sock.send_multipart(frames)
        self.sent += 1
        barrier = f"__barrier{self.sent}"
        self.sock.send_multipart([bytes((PROTOCOL_VERSION, MsgType.PING)),
                                  pack({"request_id": barrier})])
        terminals, open_streams, barrier_seen = [], set(), False
        while not (barrier_seen and terminals and not open_streams):
            try:
                kind, body = recv(self.sock, REPLY_TIMEOUT_MS)
            except TimeoutError:
                alive = self.proc.poll() is None
                raise AssertionError(f"no reply to {frames!r:.300} (server alive: {alive})")
            if kind in TAGGED:
                assert body.get("server_id") == self.server_id, body
            if body.get("request_id") == barrier:
                assert kind == MsgType.PONG
                barrier_seen = True
                continue
            if kind == MsgType.DELTA:
                self.deltas += 1
                open_streams.add(body["request_id"])
                continue
            self.replies += 1
            self.finals += kind == MsgType.FINAL
            terminals.append((kind, body))
            open_streams.discard(body.get("request_id"))
            if kind == MsgType.ERROR:
                assert_error_shape(body)
                self.codes[body["code"]] = self.codes.get(body["code"], 0) + 1
                assert body["code"] in EXPECTED_CODES, (body, frames)
        assert len(terminals) == 1, (terminals, frames)
        assert self.proc.poll() is None, "the server process exited"

    def leaked_blocks(self, timeout_s: float = 20.0) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            gauges = self.call(MsgType.STATS)["gauges"]
            idle = gauges["server_requests_in_flight"] == 0 and \
                gauges["num_requests_running"] == 0 and gauges["num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return gauges["num_total_blocks"] - gauges["num_free_blocks"]
            time.sleep(0.05)

    def summary(self, name: str, leaked: int) -> str:
        crashes = 0 if self.proc.poll() is None else 1
        return (f"fuzz[{name}]: {self.sent} messages, {self.replies} replies (one each: "
                f"{self.finals} FINAL, {sum(self.codes.values())} ERROR, the rest PONG/"
                f"ABORTED/..., plus {self.deltas} DELTA frames), {crashes} crashes, {leaked} "
                f"leaked blocks, {time.monotonic() - self.start:.1f} s; error codes "
                f"{self.codes}")


def run_campaign(server_process, zmq_ctx, capsys, name: str, vocab: int, max_examples: int,
                 extreme_percent: int, *server_args) -> None:
    proc, ep = server_process(free_tcp_endpoint(), *server_args)
    campaign = Campaign(proc, ep, zmq_ctx)
    before = campaign.greedy(vocab)

    @fuzz_settings(max_examples)
    @given(frames=messages(vocab, extreme_percent))
    def one(frames):
        campaign.exchange(frames)

    one()
    assert proc.poll() is None
    assert campaign.greedy(vocab) == before  # the server still serves exactly as before
    leaked = campaign.leaked_blocks()
    with capsys.disabled():
        print("\n" + campaign.summary(name, leaked))
    assert leaked == 0
    assert campaign.replies == campaign.sent


def test_fuzz_server_process_fake_engine(server_process, zmq_ctx, capsys):
    run_campaign(server_process, zmq_ctx, capsys, "fake engine", FAKE_VOCAB, 3000, 25)


def test_fuzz_server_process_real_engine(server_process, zmq_ctx, capsys):
    """Shorter: the real LLMEngine (tiny model, numpy), so extreme parameters reach the real
    sampler, penalties and stop checks."""
    run_campaign(server_process, zmq_ctx, capsys, "real engine, tiny model", TINY_VOCAB, 600,
                 70, "--engine", "tiny")


# --- regressions: the two crash classes of issue 12 --------------------------------------
def _generate(**fields) -> bytes:
    return pack({"request_id": "r", "prompt": "x", **fields})


NON_STRING_KEYS = [
    ("bytes and str unknown keys", MsgType.GENERATE, pack({"request_id": "r", "prompt": "x",
                                                           b"k": 1, "zz": 2})),
    ("int and str keys", MsgType.GENERATE, b"\x83" + pack("request_id") + pack("r") +
     pack("prompt") + pack("x") + pack(5) + pack(1)),
    ("bytes key in PING", MsgType.PING, pack({b"a": 1, "b": 2})),
    ("bytes key in ABORT", MsgType.ABORT, pack({"request_id": "r", b"x": None, "y": 0})),
    ("bytes key in sampling_params", MsgType.GENERATE,
     _generate(sampling_params={b"top_k": 1, "max_tokens": 1})),
    ("bytes key nested in stop", MsgType.GENERATE,
     _generate(sampling_params={"stop": [{b"k": 1}]})),
    ("bytes key in a chat message", MsgType.GENERATE,
     pack({"request_id": "r", "messages": [{"role": "user", "content": "hi", b"x": 1}]})),
    ("nil key", MsgType.STATS, b"\x82" + pack(None) + pack(1) + pack("q") + pack(2)),
    ("float key", MsgType.MODEL_INFO, b"\x81" + pack(1.5) + pack(1)),
    # 1.3: logit_bias is a map keyed by token ids, but on the wire those keys are strings
    ("int key in logit_bias", MsgType.GENERATE,
     _generate(sampling_params={"logit_bias": {5: 1.0}})),
    ("int key in chat_template_kwargs", MsgType.GENERATE,
     pack({"request_id": "r", "messages": [{"role": "user", "content": "hi"}],
           "chat_template_kwargs": {3: "x"}})),
    ("bytes key in a tool", MsgType.GENERATE,
     pack({"request_id": "r", "messages": [{"role": "user", "content": "hi"}],
           "tools": [{"type": "function", "function": {b"name": "f"}}]}, )),
]


def test_regression_non_string_keys_get_one_error(server_process, zmq_ctx):
    """1.1 servers exited on a map with keys of mixed types (sorting the unknown fields)."""
    proc, ep = server_process(free_tcp_endpoint())
    campaign = Campaign(proc, ep, zmq_ctx)
    before = campaign.greedy(FAKE_VOCAB)
    for name, msg_type, body in NON_STRING_KEYS:
        campaign.codes.clear()
        campaign.exchange([bytes((PROTOCOL_VERSION, int(msg_type))), body])
        assert list(campaign.codes) == ["invalid_message"], name
    assert campaign.greedy(FAKE_VOCAB) == before


def test_regression_deep_nesting_gets_one_error(server_process, zmq_ctx):
    """1.1 servers exited on a value nested ~1,000 levels deep (repr of it in the error)."""
    proc, ep = server_process(free_tcp_endpoint())
    campaign = Campaign(proc, ep, zmq_ctx)
    before = campaign.greedy(FAKE_VOCAB)
    for where in ("temperature", "stop", "stop_token_ids", "top_p", "top", "request_id",
                  "messages", "extra"):
        for depth, kind in ((1000, 0), (1000, 1), (999, 3), (2000, 0), (17, 0), (16, 1)):
            deep = deep_bytes([kind] * depth, 1)
            if where == "top":
                body = deep
            else:
                fields = {"request_id": "r", "prompt": "x", "sampling_params": {"max_tokens": 1}}
                if where in ("temperature", "stop", "stop_token_ids", "top_p"):
                    fields["sampling_params"][where] = _PLACEHOLDER
                else:
                    if where == "messages":
                        del fields["prompt"]
                    fields[where] = _PLACEHOLDER
                body = pack(fields).replace(pack(_PLACEHOLDER), deep)
            campaign.codes.clear()
            campaign.exchange([bytes((PROTOCOL_VERSION, MsgType.GENERATE)), body])
            # 16 levels in all is the limit: the body map plus 15 (16 below sampling_params is
            # 18 in all); anything deeper is invalid_message, a shallower bad value
            # invalid_request.
            total = depth + (0 if where == "top" else 2 if where in ("temperature", "stop",
                                                                  "stop_token_ids",
                                                                  "top_p") else 1)
            malformed = total > 16 or kind in (2, 3) or (where == "top" and kind == 0)
            want = "invalid_message" if malformed else "invalid_request"
            assert list(campaign.codes) == [want], (where, depth, kind, campaign.codes)
    assert campaign.greedy(FAKE_VOCAB) == before


# --- 1.3: a burst of bad requests next to a stream in flight -----------------------------
BAD_1_3 = [  # (body fields besides request_id, the field its ERROR message must name)
    ({"prompt": "x", "sampling_params": {"logit_bias": {"abc": 1}}}, "logit_bias"),
    ({"prompt": "x", "sampling_params": {"logit_bias": {"512": 1}}}, "logit_bias"),
    ({"prompt": "x", "sampling_params": {"logit_bias": {"1": 1e300}}}, "logit_bias"),
    ({"prompt": "x", "sampling_params": {"logit_bias": {str(i): 1 for i in range(2000)}}},
     "logit_bias"),
    ({"prompt": "x", "sampling_params": {"allowed_token_ids": list(range(512)) * 40}},
     "allowed_token_ids"),
    ({"prompt": "x", "sampling_params": {"allowed_token_ids": [-5]}}, "allowed_token_ids"),
    ({"prompt": "x", "sampling_params": {"bad_words": ["w"] * 5000}}, "bad_words"),
    ({"prompt": "x", "sampling_params": {"bad_words": [{"w": 1}]}}, "bad_words"),
    ({"prompt": "x", "sampling_params": {"stop_token_ids": [99999]}}, "stop_token_ids"),
    ({"prompt": "x", "sampling_params": {"output_kind": 2}}, "output_kind"),
    ({"prompt": "x", "sampling_params": {"truncate_prompt_tokens": "all"}},
     "truncate_prompt_tokens"),
    ({"prompt": "x", "sampling_params": {"logprobs": 10**6}}, "sample logprobs"),
    ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"prompt_token_ids": [1], "chat_template": "{{ x }}"}, "chat_template"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [1, 2]}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{}] * 500}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template": "t" * 40000},
     "chat_template"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": ["k"]},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "continue_final_message"),
]


def test_bad_1_3_requests_spare_a_stream_in_flight(server_process, zmq_ctx):
    """A long stream runs while the same connection sends every kind of bad 1.3 request:
    each gets exactly one invalid_request whose message names the field, the stream's tokens
    are exactly the reference, and the server goes on."""
    from fake_engine import expected_tokens

    proc, ep = server_process(free_tcp_endpoint(), "--step-delay-s", "0.01")
    sock = dealer(zmq_ctx, ep)
    header = lambda t: bytes((PROTOCOL_VERSION, int(t)))  # noqa: E731
    sock.send_multipart([header(MsgType.GENERATE), pack({
        "request_id": "good", "prompt": "steady", "sampling_params": {"max_tokens": 40}})])
    for i, (fields, _) in enumerate(BAD_1_3):
        sock.send_multipart([header(MsgType.GENERATE), pack({"request_id": f"bad{i}",
                                                               **fields})])
    errors, tokens, final = {}, [], None
    while final is None:
        kind, body = recv(sock, REPLY_TIMEOUT_MS)
        rid = body.get("request_id")
        if kind == MsgType.ERROR:
            assert_error_shape(body)
            assert rid not in errors and rid != "good", body
            errors[rid] = body
        elif rid == "good" and kind == MsgType.DELTA:
            tokens += body["token_ids"]
        elif rid == "good":
            final = (kind, body)
    assert final[0] == MsgType.FINAL and tokens == expected_tokens(list(b"steady"), 40)
    while len(errors) < len(BAD_1_3):  # an error may come after the good FINAL
        kind, body = recv(sock, REPLY_TIMEOUT_MS)
        assert kind == MsgType.ERROR and body["request_id"] not in errors, body
        errors[body["request_id"]] = body
    for i, (_, named) in enumerate(BAD_1_3):
        err = errors[f"bad{i}"]
        assert err["code"] == "invalid_request" and named in err["message"], (i, err)
    assert proc.poll() is None


# --- totality, in process (no sockets: many more examples per second) -------------------
@fuzz_settings(1500)
@given(frames=messages(FAKE_VOCAB, 30))
def test_decode_and_validation_raise_only_protocol_errors(frames):
    """decode + the validation of every message type: a request or a ProtocolError whose
    ERROR body (error_body) is well-formed, for any frames at all."""
    from pagedrun.server.protocol import ProtocolError, decode, error_body, valid_request_id
    from pagedrun.server.validation import ModelLimits, check_fields, parse_generate

    limits = ModelLimits(vocab_size=FAKE_VOCAB, max_model_len=256)
    try:
        msg_type, body = decode(frames, 1 << 20)
        if msg_type == MsgType.GENERATE:
            req = parse_generate(body, limits)
            assert valid_request_id(req.request_id) == req.request_id
            params = req.sampling_params
            assert all(0 <= t < FAKE_VOCAB for t in params.stop_token_ids)
            # 1.3: whatever arrived, the engine gets int-keyed, in-vocabulary, bounded fields
            # and DELTA outputs; chat options only with messages
            assert params.output_kind == RequestOutputKind.DELTA
            assert all(type(t) is int and 0 <= t < FAKE_VOCAB and abs(b) <= 100
                       for t, b in (params.logit_bias or {}).items())
            assert all(0 <= t < FAKE_VOCAB for t in params.allowed_token_ids or [0])
            assert len(params.bad_words) <= 128
            assert req.chat_options is None or req.messages is not None
        else:
            check_fields(msg_type, body)
    except ProtocolError as exc:
        reply = error_body(exc.code, exc.message, exc.request_id)
        assert set(reply) == {"code", "message", "request_id"}
        assert len(reply["message"]) <= 1000
        assert reply["request_id"] is None or valid_request_id(reply["request_id"])
        pack(reply)
