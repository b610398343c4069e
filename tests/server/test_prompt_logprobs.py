"""Prompt logprobs (docs/protocol.md revision 1.1, "Prompt logprobs"): the server's carry rule
for engine outputs no socket test can produce on demand, and the Python client's decoding into
the offline API's shape (1.3: vLLM's {token_id: Logprob(logprob, rank, decoded_token)} per
position). Sent exactly once: on the first DELTA sent after the engine handed them over, else on
the FINAL."""
from __future__ import annotations

from fake_engine import FakeEngine, expected_prompt_logprobs, expected_prompt_logprobs_wire

from pagedrun.runtime.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.server.client import _Accumulator
from pagedrun.server.protocol import MsgType
from pagedrun.server.server import Server
from pagedrun.server.validation import GenerateRequest

PROMPT = [5, 6, 7, 8]


class RecordingLoop:
    def add(self, engine_id, kwargs):
        pass

    def abort(self, engine_id):
        pass


def server_with_request(stream: bool, prompt_logprobs: int | None = 1):
    """A Server (no socket) holding one GENERATE; returns it and the list of frames it sends."""
    server = Server(FakeEngine())
    server._loop = RecordingLoop()
    sent = []
    server._send = lambda identity, msg_type, body: sent.append((msg_type, body))
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    server._on_generate(b"peer", GenerateRequest("rq", params, stream=stream,
                                                 prompt_token_ids=PROMPT))
    return server, sent


def output(token_ids, *, prompt_logprobs=None, finish_reason=None) -> RequestOutput:
    comp = CompletionOutput(0, list(token_ids), "x" * len(token_ids),
                            finish_reason=finish_reason)
    return RequestOutput("r0", PROMPT, [comp], finished=finish_reason is not None,
                         usage=Usage(len(PROMPT), 0, len(token_ids)),
                         prompt_logprobs=prompt_logprobs)


PLP = expected_prompt_logprobs(PROMPT, 1)


PLP_WIRE = expected_prompt_logprobs_wire(PROMPT, 1)


def test_tokenless_output_defers_them_to_the_next_delta():
    server, sent = server_with_request(stream=True)
    server._on_output(output([], prompt_logprobs=PLP))  # nothing to send yet
    assert sent == []
    server._on_output(output([40]))
    server._on_output(output([41], prompt_logprobs=PLP))  # a repeat is never sent again
    server._on_output(output([42], finish_reason="length"))
    kinds = [k for k, _ in sent]
    assert kinds == [MsgType.DELTA, MsgType.DELTA, MsgType.DELTA, MsgType.FINAL]
    assert sent[0][1]["prompt_logprobs"] == PLP_WIRE
    assert all("prompt_logprobs" not in body for _, body in sent[1:])


def test_request_ending_before_any_delta_gets_them_on_the_final():
    server, sent = server_with_request(stream=True)
    server._on_output(output([], prompt_logprobs=PLP, finish_reason="abort"))
    assert [k for k, _ in sent] == [MsgType.FINAL]
    assert sent[0][1]["prompt_logprobs"] == PLP_WIRE


def test_abort_before_the_prompt_ran_sends_none():
    server, sent = server_with_request(stream=False)
    server._on_output(output([], finish_reason="abort"))
    assert [k for k, _ in sent] == [MsgType.FINAL] and "prompt_logprobs" not in sent[0][1]


def test_not_asked_means_not_sent_even_if_the_engine_had_them():
    server, sent = server_with_request(stream=True, prompt_logprobs=None)
    server._on_output(output([40], prompt_logprobs=PLP, finish_reason="length"))
    assert all("prompt_logprobs" not in body for _, body in sent)


def test_client_decodes_to_the_offline_shape():
    acc = _Accumulator("rq")
    d0 = acc.add({"request_id": "rq", "index": 0, "token_ids": [40], "text": "(",
                  "prompt_logprobs": PLP_WIRE})
    d1 = acc.add({"request_id": "rq", "index": 0, "token_ids": [41], "text": ")"})
    assert d0.prompt_logprobs == PLP and d1.prompt_logprobs is None
    for position, token in zip(d0.prompt_logprobs[1:], PROMPT[1:]):
        assert next(iter(position)) == token  # the prompt token first, as in vLLM
        assert all(isinstance(lp, Logprob) for lp in position.values())
    done = acc.finish({"request_id": "rq", "finish_reason": "length", "outputs": [{"index": 0}]})
    assert done.prompt_logprobs == PLP
    # stream off (or the FINAL fallback): taken from the FINAL
    done = _Accumulator("rq").finish({"request_id": "rq", "finish_reason": "length",
                                      "outputs": [{"index": 0, "token_ids": [], "text": ""}],
                                      "prompt_logprobs": PLP_WIRE})
    assert done.prompt_logprobs == PLP
    # a 1.0 server, or not asked for
    assert _Accumulator("rq").finish({"outputs": []}).prompt_logprobs is None


def test_clients_expose_them_blocking_and_async(start_server):
    import asyncio

    from pagedrun.client import AsyncClient, Client
    _, ep = start_server()
    params = {"max_tokens": 3, "prompt_logprobs": 2}
    want = expected_prompt_logprobs(list(b"hello"), 2)
    with Client(ep, timeout_s=10) as c:
        assert c.generate("hello", sampling_params=params).prompt_logprobs == want
        assert c.generate("hello", sampling_params=params, stream=True).prompt_logprobs == want

    async def run():
        async with AsyncClient(ep, timeout_s=10) as c:
            s = await c.stream("hello", sampling_params=params)
            deltas = [d async for d in s]
            return deltas, s.result

    deltas, result = asyncio.run(run())
    assert [d.prompt_logprobs for d in deltas] == [want, None, None]
    assert result.prompt_logprobs == want


def test_wire_shape_with_the_prompt_token_inside_and_outside_the_top():
    """Rank 1 + i % 3 against k = 2: inside the top (2 entries) or not (3): `top` always holds
    the k best, best first, with the prompt token among them only by its rank."""
    prompt = [5, 6, 7, 8, 9]
    server, sent = server_with_request(stream=False, prompt_logprobs=2)
    plp = expected_prompt_logprobs(prompt, 2)
    assert [len(p) for p in plp[1:]] == [2, 3, 2, 2]  # ranks 2, 3, 1, 2
    server._on_output(RequestOutput("r0", prompt, [CompletionOutput(0, [], "", None, None,
                                                                    "abort")],
                                    finished=True, prompt_logprobs=plp))
    assert sent[0][1]["prompt_logprobs"] == expected_prompt_logprobs_wire(prompt, 2)
    assert [len(e["top"]) for e in sent[0][1]["prompt_logprobs"][1:]] == [2, 2, 2, 2]
