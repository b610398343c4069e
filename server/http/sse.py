"""Server-Sent Events framing, and the ASGI response that aborts its request on disconnect.

Framing (what OpenAI's servers send and its SDK parses): each event is one `data: <JSON>` line
followed by a blank line, and the stream ends with `data: [DONE]`.

Disconnects: the response pumps events and, at the same time, waits for the client's
`http.disconnect`. When that comes first, the pump task is cancelled with asyncio's own
(one-shot) cancellation, so the event source's cleanup can still await: the ZeroMQ client's
stream then sends ABORT and the engine frees the request's KV blocks. (Starlette's
StreamingResponse cancels through an anyio cancel scope, which cancels every await in the
cleanup too; the ABORT would never leave.) `run_unless_disconnected` is the same race for a
non-streaming request and for the wait before a stream's first byte.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, TypeVar

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a reverse proxy must not buffer the stream
]


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False,
                                  separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(receive, main: asyncio.Future) -> bool:
    """Wait for `main` or the client's disconnect; on disconnect cancel `main` and wait for its
    cleanup. True when the client disconnected."""
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({main, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        main.cancel()
        raise
    finally:
        if not watcher.done():
            watcher.cancel()
    if main.done():
        return False
    main.cancel()
    await asyncio.gather(main, return_exceptions=True)
    return True


async def run_unless_disconnected(receive, awaitable: Awaitable[T]) -> T:
    """`await awaitable`, cancelled (its cleanup awaited) if the client disconnects first, then
    ClientDisconnected is raised."""
    task = asyncio.ensure_future(awaitable)
    if await _race(receive, task):
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse:
    """An ASGI response: status 200, SSE headers, then `events` (bytes each) as they come.
    The iterator is closed (aclose) whether it ends, fails, or the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        self.events = events
        self.headers = SSE_HEADERS + [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                      for k, v in (headers or {}).items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        pump = asyncio.ensure_future(self._pump(send))
        try:
            disconnected = await _race(receive, pump)
        finally:
            await self.events.aclose()
        if not disconnected:
            pump.result()  # re-raise what the pump raised (a bug), after the cleanup

    async def _pump(self, send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
