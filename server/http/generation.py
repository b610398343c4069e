"""One chat or completions request: its GENERATEs, from the first frame to the last byte.

1. Open: one GENERATE per prompt (a completions batch has several), all in flight at once, and
   wait for each one's first reply frame before answering. So a request the engine refuses
   (`invalid_request`, `prompt_too_long`, `overloaded`, `shutting_down`) gets its HTTP status
   (400/429/503) even when streaming, instead of a 200 with an error event.
2. Merge: the replies of all GENERATEs in arrival order, as (job, "delta" | "final", value).
3. Answer: SSE events as they come (`stream: true`), or one JSON body after every FINAL.

A client that disconnects at any point cancels the work; each open GENERATE's stream is closed,
which sends ABORT, and the engine frees its KV blocks. An engine error after the response has
started goes out as an SSE event with OpenAI's error body, then `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedrun.server.client import RequestTimeout, ServerError
from pagedrun.server.http.chat_format import ChatFormat
from pagedrun.server.http.completion_format import CompletionFormat
from pagedrun.server.http.edge import CLIENT_CLOSED_STATUS, read_body
from pagedrun.server.http.errors import ApiError, bad_request, from_engine_error
from pagedrun.server.http.openai_models import GenerationSpec
from pagedrun.server.http.responses import created_now, new_response_id
from pagedrun.server.http.sse import (DONE, ClientDisconnected, EventStreamResponse,
                                      run_unless_disconnected, sse_event)

log = logging.getLogger("pagedrun.http")

ENGINE_ERRORS = (ServerError, RequestTimeout)


async def read_json(request: Request, engine_limit: int | None = None) -> dict:
    """The request's JSON object, its body read under the gateway's EdgeLimits (size cap while
    it streams in, deadline). engine_limit: a body over it (read, not yet parsed) is a 400
    message_too_large -- what the engine would answer a GENERATE of that size."""
    raw = await read_body(request, request.app.state.edge_limits)
    if engine_limit is not None and len(raw) > engine_limit:
        raise ApiError(400, f"the request body is {len(raw)} bytes; the engine's limit "
                       f"(max_message_bytes) is {engine_limit}", code="message_too_large")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # json's scanner recurses per level
        raise bad_request("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_json_values(body)
    return body


# What a body's values must be for the wire (msgpack, UTF-8): checked up front so a client's
# mistake is a 400 naming it, not a failure while the request is encoded (a 500, which the
# OpenAI SDK retries).
MSGPACK_INT_RANGE = (-(1 << 63), (1 << 64) - 1)
MAX_JSON_DEPTH = 64


def check_json_values(body: dict) -> None:
    """400 for any string (key or value) that is not valid Unicode text (a lone surrogate),
    any integer msgpack cannot carry, or nesting past MAX_JSON_DEPTH; iterative, one pass."""
    low, high = MSGPACK_INT_RANGE
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("the request body holds a string that is not valid Unicode "
                                  "(a lone surrogate escape)") from None
        elif isinstance(value, bool) or value is None or isinstance(value, float):
            continue
        elif isinstance(value, int):
            if not low <= value <= high:
                raise bad_request(f"the request body holds an integer outside [{low}, {high}]")
        elif depth >= MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests more than {MAX_JSON_DEPTH} levels deep")
        elif isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        else:  # list
            stack.extend((v, depth + 1) for v in value)


async def _next(stream) -> tuple[str, object]:
    try:
        return "delta", await stream.__anext__()
    except StopAsyncIteration:
        return "final", stream.result


async def _close_all(streams) -> None:
    for s in streams:
        await s.aclose()  # ABORT when still open; nothing when already finished


class Jobs:
    """The open GENERATEs of one request and each one's first reply."""

    def __init__(self, streams: list, firsts: list[tuple[str, object]]) -> None:
        self.streams = streams
        self.firsts = firsts

    @classmethod
    async def open(cls, link, spec: GenerationSpec, request_ids: list[str]) -> "Jobs":
        streams = []
        try:
            for rid, prompt in zip(request_ids, spec.prompts):
                streams.append(await link.stream(rid, prompt, spec))
            firsts = await asyncio.gather(*(_next(s) for s in streams),
                                          return_exceptions=True)
        except BaseException:
            await _close_all(streams)
            raise
        failed = [r for r in firsts if isinstance(r, BaseException)]
        if failed:
            await _close_all(streams)
            raise failed[0]
        return cls(streams, firsts)

    async def items(self) -> AsyncIterator[tuple[int, str, object]]:
        """Every reply, as (job, kind, Delta | Completion), in arrival order; closes the streams
        (ABORT for unfinished ones) when left early."""
        try:
            if len(self.streams) == 1:  # the common case: no merging tasks
                kind, value = self.firsts[0]
                yield 0, kind, value
                while kind != "final":
                    kind, value = await _next(self.streams[0])
                    yield 0, kind, value
                return
            async for item in self._merged():
                yield item
        finally:
            await _close_all(self.streams)

    async def _merged(self) -> AsyncIterator[tuple[int, str, object]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: int, stream) -> None:
            try:
                while True:
                    kind, value = await _next(stream)
                    queue.put_nowait((job, kind, value))
                    if kind == "final":
                        return
            except Exception as exc:  # an engine error of this GENERATE ends the request
                queue.put_nowait((job, "error", exc))

        for job, (kind, value) in enumerate(self.firsts):
            queue.put_nowait((job, kind, value))
        tasks = [asyncio.ensure_future(pump(job, stream))
                 for job, (stream, (kind, _)) in enumerate(zip(self.streams, self.firsts))
                 if kind != "final"]
        remaining = len(self.streams)
        try:
            while remaining:
                job, kind, value = await queue.get()
                if kind == "error":
                    raise value
                if kind == "final":
                    remaining -= 1
                yield job, kind, value
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _sse_events(fmt, jobs: Jobs, spec: GenerationSpec) -> AsyncIterator[bytes]:
    finals: list = [None] * len(jobs.streams)
    items = jobs.items()
    try:
        for chunk in fmt.opening_chunks(len(finals)):
            yield sse_event(chunk)
        async for job, kind, value in items:
            if kind == "delta":
                chunks = fmt.delta_chunks(job, value)
            else:
                finals[job] = value
                chunks = fmt.final_chunks(job, value)
            for chunk in chunks:
                yield sse_event(chunk)
        if spec.include_usage:
            yield sse_event(fmt.usage_chunk(finals))
    except ENGINE_ERRORS as exc:
        yield sse_event(from_engine_error(exc).body())
    finally:
        await items.aclose()
    yield DONE


async def _collect(jobs: Jobs) -> list:
    finals: list = [None] * len(jobs.streams)
    items = jobs.items()
    try:
        async for job, kind, value in items:
            if kind == "final":
                finals[job] = value
    finally:
        await items.aclose()
    return finals


def _echo_parts(gateway, spec: GenerationSpec) -> tuple[list, list]:
    """Per prompt: its text (echo) and its first token's text (echo + logprobs)."""
    texts, firsts = [], []
    tokenizer, decode = gateway.local_tokenizer, gateway.decode
    for p in spec.prompts:
        ids = p.token_ids
        if p.text is not None:
            texts.append(p.text)
            if spec.logprobs is not None and tokenizer is not None:
                ids = tokenizer.encode(p.text)
        elif tokenizer is None:
            raise bad_request("echo with token-id prompts needs a tokenizer in the gateway "
                              "(paged-run http --tokenizer MODEL)", "echo")
        else:
            texts.append(tokenizer.decode(ids))
        firsts.append(decode(ids[0]) if ids and decode is not None else None)
    return texts, firsts


async def serve_generation(request: Request, gateway, spec: GenerationSpec) -> Response:
    """Answer a parsed chat / completions request (see the module docstring)."""
    link = gateway.link
    model = await gateway.check_model(spec.model)
    created = created_now()
    if spec.kind == "chat":
        response_id = new_response_id("chatcmpl")
        fmt = ChatFormat(spec, response_id, model, created, gateway.decode)
    else:
        response_id = new_response_id("cmpl")
        if spec.echo:
            await gateway.find_tokenizer()
        echo_texts, first_tokens = (_echo_parts(gateway, spec) if spec.echo
                                    else ([None] * len(spec.prompts), [None] * len(spec.prompts)))
        fmt = CompletionFormat(spec, response_id, model, created, gateway.decode, echo_texts,
                               first_tokens)
    request_ids = ([response_id] if len(spec.prompts) == 1 else
                   [f"{response_id}-{j}" for j in range(len(spec.prompts))])
    try:
        jobs = await run_unless_disconnected(request.receive,
                                             Jobs.open(link, spec, request_ids))
        if spec.stream:
            return EventStreamResponse(_sse_events(fmt, jobs, spec))
        finals = await run_unless_disconnected(request.receive, _collect(jobs))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except ENGINE_ERRORS as exc:
        raise from_engine_error(exc) from None
    return JSONResponse(fmt.response(finals))
