"""The Python clients: results, typed errors carrying the server's code, timeouts, and aborts
when a stream is closed early or (asyncio) its task is cancelled."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from fake_engine import FakeEngine, expected_tokens

from pagedrun.client import (AsyncClient, Client, EmptyPromptError, InvalidRequestError,
                             OverloadedError, PromptTooLongError, RequestTimeout, ServerError)


def wait_idle(client: Client, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats["gauges"]["server_requests_in_flight"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_generate_and_stream_agree(start_server):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        whole = c.generate("Paris?", sampling_params={"max_tokens": 11, "temperature": 0})
        s = c.stream("Paris?", sampling_params={"max_tokens": 11, "temperature": 0})
        deltas = list(s)
    want = expected_tokens(list(b"Paris?"), 11)
    assert whole.token_ids == want and whole.text == bytes(want).decode()
    assert [t for d in deltas for t in d.token_ids] == want
    assert s.result.text == whole.text and s.result.usage["completion_tokens"] == 11
    assert whole.usage == {"prompt_tokens": 6, "cached_prompt_tokens": 0,
                           "completion_tokens": 11}


def test_sampling_params_object_and_messages(start_server):
    from pagedrun.runtime.sampling_params import SamplingParams
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        out = c.generate(messages=[{"role": "user", "content": "hi"}],
                         sampling_params=SamplingParams(max_tokens=4, temperature=0))
        assert len(out.token_ids) == 4
        ids = c.generate(prompt_token_ids=[1, 2, 3], sampling_params={"max_tokens": 2})
        assert ids.token_ids == expected_tokens([1, 2, 3], 2)


@pytest.mark.parametrize("kwargs,exc,code", [
    ({"prompt": ""}, EmptyPromptError, "empty_prompt"),
    ({"prompt": "x" * 300}, PromptTooLongError, "prompt_too_long"),
    ({"prompt": "x", "sampling_params": {"top_p": 2}}, InvalidRequestError, "invalid_request"),
])
def test_errors_are_typed(start_server, kwargs, exc, code):
    _, ep = start_server()
    with Client(ep, timeout_s=10) as c:
        with pytest.raises(exc) as info:
            c.generate(request_id="bad", **kwargs)
        assert info.value.code == code and info.value.request_id == "bad"
        assert isinstance(info.value, ServerError)
        with pytest.raises(exc):
            list(c.stream(**kwargs))


def test_overloaded_is_typed(start_server):
    _, ep = start_server(FakeEngine(step_delay_s=0.01), max_queued_requests=1)
    with Client(ep, timeout_s=10) as c:
        first = c.stream("a", sampling_params={"max_tokens": 50})
        next(first)
        with pytest.raises(OverloadedError):
            c.generate("b")
        first.close()


def test_oversize_message_is_refused_on_its_request_id(start_server):
    """A body over max_message_bytes is answered message_too_large on the request's id (read
    from the body's first bytes: the client sends request_id first), so the caller gets the
    error at once, not its timeout (issue 36: the gateway waited 600 s on a 1.5 MB prompt)."""
    _, ep = start_server(max_message_bytes=4096)  # libzmq itself drops frames over 16x that
    with Client(ep, timeout_s=30) as c:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError) as info:
            c.generate("x" * 20_000, request_id="big")
        assert info.value.code == "message_too_large" and info.value.request_id == "big"
        # Far below the timeout: no reply on the id would have meant waiting 30 s.
        assert time.monotonic() - started < 15
        with pytest.raises(InvalidRequestError):
            list(c.stream(prompt_token_ids=[7] * 10_000))
        assert c.generate("ok", sampling_params={"max_tokens": 2}).token_ids


def test_timeout_raises_and_aborts(start_server):
    _, ep = start_server(FakeEngine(step_delay_s=0.05))
    with Client(ep, timeout_s=0.3) as c:
        with pytest.raises(RequestTimeout):
            c.generate("slow", sampling_params={"max_tokens": 100})
        c.timeout_s = 10
        stats = wait_idle(c)
    assert stats["counters"]["request_abort_total"] == 1


def test_timeout_without_server():
    ctx_free_port = zmq.Context()
    sock = ctx_free_port.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")  # bound, never answers
    with Client(f"tcp://127.0.0.1:{port}", timeout_s=0.2) as c:
        with pytest.raises(RequestTimeout):
            c.ping()
    sock.close(0)
    ctx_free_port.term()


def test_closing_a_stream_aborts(start_server):
    _, ep = start_server(FakeEngine(step_delay_s=0.01))
    with Client(ep, timeout_s=10) as c:
        with c.stream("x", sampling_params={"max_tokens": 500}) as s:
            next(s)
            next(s)
        stats = wait_idle(c)
        assert stats["counters"]["request_abort_total"] == 1
        assert stats["gauges"]["num_free_blocks"] == stats["gauges"]["num_total_blocks"]
        # The connection is still usable afterwards.
        assert c.generate("y", sampling_params={"max_tokens": 2}).finish_reason == "length"


def test_explicit_abort_ends_stream_with_abort(start_server):
    _, ep = start_server(FakeEngine(step_delay_s=0.01))
    with Client(ep, timeout_s=10) as c:
        s = c.stream("x", request_id="mine", sampling_params={"max_tokens": 500})
        next(s)
        assert c.abort("mine") is True
        list(s)
        assert s.result.finish_reason == "abort"
        assert c.abort("mine") is False


def test_async_client_generate_stream_and_errors(start_server):
    _, ep = start_server()

    async def main():
        async with AsyncClient(ep, timeout_s=10) as c:
            assert (await c.ping())["status"] == "ok"
            assert (await c.model_info())["vocab_size"] == 512
            outs = await asyncio.gather(*[
                c.generate(f"p{i}", sampling_params={"max_tokens": 5 + i}) for i in range(8)])
            for i, out in enumerate(outs):
                assert out.token_ids == expected_tokens(list(f"p{i}".encode()), 5 + i)
            with pytest.raises(EmptyPromptError):
                await c.generate("")
            return (await c.stats())["counters"]["request_success_total"]

    assert asyncio.run(main()) == 8


def test_async_cancellation_aborts(start_server):
    _, ep = start_server(FakeEngine(step_delay_s=0.01))

    async def main():
        async with AsyncClient(ep, timeout_s=10) as c:
            async def consume():
                s = await c.stream("x", sampling_params={"max_tokens": 500})
                async for _ in s:
                    pass
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                stats = await c.stats()
                if stats["gauges"]["server_requests_in_flight"] == 0:
                    break
                await asyncio.sleep(0.02)
            return stats

    stats = asyncio.run(main())
    assert stats["counters"]["request_abort_total"] == 1
    assert stats["counters"]["clients_lost_total"] == 0


def test_client_heartbeats_keep_long_requests_alive(start_server):
    _, ep = start_server(FakeEngine(step_delay_s=0.01), lease_s=0.4)
    with Client(ep, timeout_s=10, heartbeat_s=0.1) as c:
        out = c.generate("x", sampling_params={"max_tokens": 100})  # ~1 s, no stream
    assert len(out.token_ids) == 100

    async def main():
        async with AsyncClient(ep, timeout_s=10, heartbeat_s=0.1) as c:
            return await c.generate("x", sampling_params={"max_tokens": 100})

    assert len(asyncio.run(main()).token_ids) == 100
