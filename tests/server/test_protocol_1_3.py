"""Protocol revision 1.3 end to end (server + Python clients, the fake engine as the oracle):
vLLM's logprobs shape and cumulative_logprob through the client, the new sampling fields and
their server limits with vLLM's messages, output_kind refused, truncate_prompt_tokens, and the
chat options (rendered by the engine, and by the server's I/O thread with a real Tokenizer)."""
from __future__ import annotations

import asyncio

import pytest
from fake_engine import (VOCAB_SIZE, ByteTokenizer, FakeEngine, expected_cumulative_logprob,
                         expected_logprobs, expected_prompt_logprobs, expected_tokens,
                         render_chat, sampled_rank)

from pagedrun.client import AsyncClient, Client, InvalidRequestError, PromptTooLongError
from pagedrun.runtime.chat_options import ChatOptions
from pagedrun.runtime.outputs import Logprob
from pagedrun.runtime.sampling_params import RequestOutputKind, SamplingParams
from pagedrun.runtime.tokenizer import Tokenizer
from pagedrun.server.client import _sampling_wire
from pagedrun.server.protocol import PROTOCOL_REVISION
from pagedrun.server.server import Server
from pagedrun.server.validation import GenerateRequest

PROMPT = [1, 2, 3]
USER = [{"role": "user", "content": "hi"}]


def assert_same_positions(got: list, want: list) -> None:
    """Equal dicts in the same order: the sampled (or prompt) token first, as vLLM's."""
    assert got == want
    assert [list(g) for g in got] == [list(w) for w in want]


# --- logprobs: vLLM's shape and cumulative_logprob -------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_client_logprobs_have_vllms_shape(start_server, stream):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        out = c.generate(prompt_token_ids=PROMPT, stream=stream,
                         sampling_params={"max_tokens": 5, "logprobs": 2})
    tokens = expected_tokens(PROMPT, 5)
    assert out.token_ids == tokens
    assert_same_positions(out.logprobs, expected_logprobs(tokens, 2))
    # code written for vLLM: lp[i][token].logprob / .rank / .decoded_token
    for i, (lp, tok) in enumerate(zip(out.logprobs, tokens)):
        assert isinstance(lp[tok], Logprob) and lp[tok].rank == sampled_rank(i)
        assert lp[tok].logprob == -sampled_rank(i) / 2 and lp[tok].decoded_token == chr(tok)
        assert len(lp) == (2 if sampled_rank(i) <= 2 else 3)  # k, or k + 1 off the top
    assert out.cumulative_logprob == expected_cumulative_logprob(5) == -4.5
    assert out.outputs[0]["logprobs"] == out.logprobs
    assert out.outputs[0]["cumulative_logprob"] == out.cumulative_logprob


def test_stream_deltas_carry_logprobs_and_the_running_cumulative(start_server):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        s = c.stream(prompt_token_ids=PROMPT, sampling_params={"max_tokens": 4, "logprobs": 0})
        deltas = list(s)
    tokens = expected_tokens(PROMPT, 4)
    assert [d.cumulative_logprob for d in deltas] == [expected_cumulative_logprob(n)
                                                      for n in range(1, 5)]
    assert_same_positions([lp for d in deltas for lp in d.logprobs],
                          expected_logprobs(tokens, 0))
    assert all(len(lp) == 1 for d in deltas for lp in d.logprobs)  # k = 0: the sampled only
    assert s.result.cumulative_logprob == expected_cumulative_logprob(4)


def test_async_client_logprobs_and_prompt_logprobs(start_server):
    _, ep = start_server()
    params = {"max_tokens": 3, "logprobs": 1, "prompt_logprobs": 2}

    async def run():
        async with AsyncClient(ep, timeout_s=10) as c:
            return await c.generate(prompt_token_ids=[5, 6, 7, 8], sampling_params=params)

    out = asyncio.run(run())
    assert_same_positions(out.logprobs, expected_logprobs(out.token_ids, 1))
    plp = out.prompt_logprobs
    assert plp[0] is None
    assert_same_positions(plp[1:], expected_prompt_logprobs([5, 6, 7, 8], 2)[1:])
    assert [plp[i][t].rank for i, t in enumerate([6, 7, 8], start=1)] == [2, 3, 1]


def test_client_reads_entries_of_older_servers():
    """A 1.1/1.2 entry (no rank, no decoded tokens): the own token first, ranks from the
    order of `top` (best first), the own token's only when it is there."""
    from pagedrun.server.protocol import position_from_wire
    got = position_from_wire({"token_id": 5, "logprob": -1.0, "top": [[7, -0.5], [5, -1.0]]})
    assert list(got) == [5, 7]
    assert got == {5: Logprob(-1.0, 2, None), 7: Logprob(-0.5, 1, None)}
    outside = position_from_wire({"token_id": 9, "logprob": -4.0, "top": [[7, -0.5]]})
    assert outside == {9: Logprob(-4.0, None, None), 7: Logprob(-0.5, 1, None)}


def test_no_logprobs_no_cumulative(start_server):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        out = c.generate(prompt_token_ids=PROMPT, sampling_params={"max_tokens": 2})
    assert out.logprobs is None and out.cumulative_logprob is None
    assert "cumulative_logprob" not in out.outputs[0]


def test_logprobs_minus_one_is_the_vocabulary_when_max_logprobs_allows(start_server):
    _, ep = start_server(FakeEngine(max_logprobs=-1))
    with Client(ep, timeout_s=10) as c:
        out = c.generate(prompt_token_ids=PROMPT, sampling_params={"max_tokens": 1,
                                                                   "logprobs": -1})
        assert c.model_info()["server"]["max_logprobs"] == -1
    assert len(out.logprobs[0]) == VOCAB_SIZE


def test_max_logprobs_comes_from_the_engine_with_vllms_message(start_server):
    _, ep = start_server(FakeEngine(max_logprobs=5))
    with Client(ep, timeout_s=10) as c:
        assert c.model_info()["server"]["max_logprobs"] == 5
        ok = c.generate(prompt_token_ids=PROMPT, sampling_params={"max_tokens": 1,
                                                                  "logprobs": 5})
        assert len(ok.logprobs[0]) == 5  # rank 1: inside the top 5
        for params, message in [
                ({"logprobs": 6}, "Requested sample logprobs of 6, which is greater than max "
                                  "allowed: 5"),
                ({"logprobs": -1}, f"Requested sample logprobs of {VOCAB_SIZE}, which is "
                                   "greater than max allowed: 5"),
                ({"prompt_logprobs": 7}, "Requested prompt logprobs of 7, which is greater "
                                         "than max allowed: 5")]:
            with pytest.raises(InvalidRequestError) as info:
                c.generate(prompt_token_ids=PROMPT, sampling_params=params)
            assert info.value.message == message


# --- the new sampling fields -----------------------------------------------------------------
VLLM_MESSAGES = [
    ({"stop_token_ids": [3, 512, -1]}, "token_id(s) [512, -1] in stop_token_ids contain "
                                       "out-of-vocab token ids. Vocabulary size: 512"),
    ({"logit_bias": {"7": 1.0, "600": 2.0}}, "token_id(s) [600] in logit_bias contain "
                                             "out-of-vocab token ids. Vocabulary size: 512"),
    ({"allowed_token_ids": [0, 512]}, "allowed_token_ids contains out-of-vocab token id!"),
]


@pytest.mark.parametrize("params,message", VLLM_MESSAGES)
def test_out_of_vocab_ids_get_vllms_message(start_server, params, message):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        with pytest.raises(InvalidRequestError) as info:
            c.generate(prompt_token_ids=PROMPT, sampling_params=params)
    assert info.value.message == message


def test_new_fields_are_served_and_logit_bias_keys_travel_as_strings(start_server):
    server, ep = start_server()
    params = SamplingParams(max_tokens=3, logit_bias={5: 2.5, 511: -100.0},
                            allowed_token_ids=[5, 6], bad_words=["x"], seed=-1,
                            truncate_prompt_tokens=2, spaces_between_special_tokens=False)
    wire = _sampling_wire(params)
    assert wire["logit_bias"] == {"5": 2.5, "511": -100.0}  # every wire map key is a string
    assert "output_kind" not in wire and "temperature" not in wire  # defaults are not sent
    with Client(ep, timeout_s=10) as c:
        by_object = c.generate(prompt_token_ids=PROMPT, sampling_params=params)
        by_dict = c.generate(prompt_token_ids=PROMPT, sampling_params={
            "max_tokens": 3, "logit_bias": {5: 2.5}, "bad_words": ["x"]})
    # the fake engine ignores the masks; truncate_prompt_tokens=2 kept the last 2 prompt ids
    assert by_object.token_ids == expected_tokens(PROMPT[-2:], 3)
    assert by_object.usage["prompt_tokens"] == 2
    assert by_dict.token_ids == expected_tokens(PROMPT, 3)


def test_the_engine_gets_int_keys_and_delta_outputs():
    server = Server(FakeEngine())
    added = {}
    server._loop = type("Loop", (), {"add": lambda self, i, kw: added.update({i: kw})})()
    from pagedrun.server.validation import ModelLimits, parse_generate
    req = parse_generate({"request_id": "a", "prompt_token_ids": PROMPT, "sampling_params": {
        "logit_bias": {"5": 1.5}, "allowed_token_ids": [5]}}, ModelLimits(512, 256))
    server._on_generate(b"peer", req)
    params = added["r0"]["sampling_params"]
    assert params.logit_bias == {5: 1.5} and params.allowed_token_ids == [5]
    assert params.output_kind == RequestOutputKind.DELTA


@pytest.mark.parametrize("output_kind", [0, 1, 2, "final_only", "delta", None])
def test_output_kind_is_not_a_wire_field(start_server, output_kind):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        with pytest.raises(InvalidRequestError) as info:
            c.generate(prompt_token_ids=PROMPT, sampling_params={"output_kind": output_kind})
        assert "output_kind" in info.value.message and "`stream`" in info.value.message
        # a SamplingParams object: the default (DELTA) is not sent, anything else is refused
        with pytest.raises(InvalidRequestError):
            c.generate(prompt_token_ids=PROMPT, sampling_params=SamplingParams(
                max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY))
        served = c.generate(prompt_token_ids=PROMPT, sampling_params=SamplingParams(
            max_tokens=2, output_kind=RequestOutputKind.DELTA), stream=True)
    assert served.token_ids == expected_tokens(PROMPT, 2)


def test_truncate_prompt_tokens_before_the_length_check(start_server):
    _, ep = start_server()  # max_model_len 256
    long_ids = [(7 * i) % 500 + 1 for i in range(300)]
    with Client(ep, timeout_s=10) as c:
        with pytest.raises(PromptTooLongError):
            c.generate(prompt_token_ids=long_ids)
        ten = c.generate(prompt_token_ids=long_ids, sampling_params={
            "max_tokens": 3, "truncate_prompt_tokens": 10})
        whole = c.generate(prompt_token_ids=long_ids, sampling_params={
            "max_tokens": 3, "truncate_prompt_tokens": -1})
        text = c.generate("y" * 250 + "abcdefg", sampling_params={
            "max_tokens": 3, "truncate_prompt_tokens": 7})
    assert ten.usage["prompt_tokens"] == 10
    assert ten.token_ids == expected_tokens(long_ids[-10:], 3)
    assert whole.usage["prompt_tokens"] == 256
    assert whole.token_ids == expected_tokens(long_ids[-256:], 1)  # max_model_len: 1 token
    assert text.token_ids == expected_tokens(list(b"abcdefg"), 3)
    with Client(ep, timeout_s=10) as c, pytest.raises(InvalidRequestError) as info:
        c.generate(prompt_token_ids=[1], sampling_params={"truncate_prompt_tokens": 257})
    assert info.value.message == ("truncate_prompt_tokens (257) is greater than max_model_len "
                                  "(256)")


# --- chat options ----------------------------------------------------------------------------
def chat(c, messages, **options):
    return c.generate(messages=messages, sampling_params={"max_tokens": 2}, **options)


def test_chat_options_rendered_by_the_engine(start_server):
    """The fake engine renders (its tokenizer has no template): the server hands it the
    ChatOptions; the prompt it generated from is exactly render_chat(messages, options)."""
    _, ep = start_server()
    history = [{"role": "user", "content": "capital?"}, {"role": "assistant", "content": "Par"}]
    cases = [(USER, {}), (USER, {"add_generation_prompt": True}),
             (USER, {"add_generation_prompt": False}),
             (history, {"add_generation_prompt": False, "continue_final_message": True}),
             (USER, {"tools": [{"type": "function", "function": {"name": "f"}}, {}]}),
             (USER, {"chat_template_kwargs": {"lang": "fr"}, "chat_template": "T"})]
    with Client(ep, timeout_s=10) as c:
        for messages, options in cases:
            out = chat(c, messages, **options)
            prompt = list(render_chat(messages, ChatOptions(**options)).encode())
            assert out.usage["prompt_tokens"] == len(prompt), options
            assert out.token_ids == expected_tokens(prompt, 2), options
        with_gen = chat(c, USER, add_generation_prompt=True).usage["prompt_tokens"]
        without = chat(c, USER, add_generation_prompt=False).usage["prompt_tokens"]
    assert with_gen - without == len("<assistant>")


TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if tools %}[{{ tools | length }} tools]{% endif %}{{ style or '' }}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


class ByteTemplateTokenizer(Tokenizer):
    """The runtime Tokenizer (its apply_chat_template, chat options included) over bytes."""

    def __init__(self) -> None:
        super().__init__(backend=None, config={}, chat_template=TEMPLATE)
        self._bytes = ByteTokenizer()

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._bytes.encode(text)

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self._bytes.decode(list(token_ids))


def templated_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.tokenizer = ByteTemplateTokenizer()
    return engine


SERVER_RENDERED = [
    ({}, "<user>hi</user><assistant>"),
    ({"add_generation_prompt": False}, "<user>hi</user>"),
    ({"tools": [{"name": "a"}, {"name": "b"}]}, "<user>hi</user>[2 tools]<assistant>"),
    ({"chat_template_kwargs": {"style": "!"}}, "<user>hi</user>!<assistant>"),
    ({"chat_template": "{{ messages[0].content }}:{{ add_generation_prompt }}"}, "hi:True"),
]


@pytest.mark.parametrize("options,text", SERVER_RENDERED)
def test_chat_options_rendered_in_the_server(start_server, options, text):
    """A model template: the I/O thread renders with the same Tokenizer call as the engine;
    the expected prompts are written out by hand."""
    server, ep = start_server(templated_engine())
    assert server._apply_template is not None
    with Client(ep, timeout_s=10) as c:
        out = chat(c, USER, **options)
    assert out.usage["prompt_tokens"] == len(text)
    assert out.token_ids == expected_tokens(list(text.encode()), 2)


def test_continue_final_message_rendered_in_the_server(start_server):
    _, ep = start_server(templated_engine())
    history = USER + [{"role": "assistant", "content": "The capital is"}]
    with Client(ep, timeout_s=10) as c:
        out = chat(c, history, add_generation_prompt=False, continue_final_message=True)
        closed = chat(c, history, add_generation_prompt=False)
    text = "<user>hi</user><assistant>The capital is"  # open: no </assistant>
    assert out.usage["prompt_tokens"] == len(text)
    assert out.token_ids == expected_tokens(list(text.encode()), 2)
    assert closed.usage["prompt_tokens"] == len(text) + len("</assistant>")


def test_the_server_hands_chat_options_to_an_engine_that_renders():
    server = Server(FakeEngine())
    added = {}
    server._loop = type("Loop", (), {"add": lambda self, i, kw: added.update({i: kw})})()
    options = ChatOptions(add_generation_prompt=False, tools=[{"a": 1}])
    server._on_generate(b"p", GenerateRequest("a", SamplingParams(), messages=USER,
                                              chat_options=options))
    server._on_generate(b"p", GenerateRequest("b", SamplingParams(), messages=USER))
    assert added["r0"]["chat_options"] is options and added["r0"]["messages"] == USER
    assert "chat_options" not in added["r1"]  # none sent: the engine's default rendering


CHAT_ERRORS = [
    ({"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt_token_ids": [1], "tools": [], "chat_template": "t"}, "chat_template, tools"),
    ({"messages": USER, "continue_final_message": True},
     "continue_final_message and add_generation_prompt cannot both be True."),
    ({"messages": USER, "tools": [["f"]]}, "tools"),
    ({"messages": USER, "chat_template_kwargs": {"tokenize": False}}, "tokenize"),
    ({"messages": USER, "chat_template_kwargs": {"tools": []}}, "tools"),
    ({"messages": USER, "add_generation_prompt": "yes"}, "add_generation_prompt"),
]


@pytest.mark.parametrize("fields,named", CHAT_ERRORS)
def test_bad_chat_options_name_the_field(start_server, fields, named):
    _, ep = start_server(templated_engine())
    with Client(ep, timeout_s=10) as c:
        kwargs = {k: v for k, v in fields.items() if k not in ("prompt",)}
        with pytest.raises(InvalidRequestError) as info:
            c.generate(fields.get("prompt"), **kwargs)
        assert named in info.value.message
        assert chat(c, USER).finish_reason == "length"  # the connection goes on


def test_a_broken_request_template_is_invalid_request(start_server):
    _, ep = start_server(templated_engine())
    with Client(ep, timeout_s=10) as c:
        with pytest.raises(InvalidRequestError) as info:
            chat(c, USER, chat_template="{% for %}")
    assert info.value.message.startswith("chat template:")


def test_revision_is_advertised(start_server):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        assert c.ping()["protocol_revision"] == PROTOCOL_REVISION == "1.4"
        assert c.model_info()["server"]["protocol_revision"] == "1.4"
