"""The HTTP edge's limits: how long a client may take to send a request, how many connections
one gateway holds, how large a request's head and body may be (issue 36, "the HTTP edge").

Without them a client that opens connections and sends its headers a byte a minute (slowloris)
holds each connection, and its buffers, for as long as it likes: uvicorn's own timers cover the
idle time between requests (keep-alive), not a request that is being sent.

    EdgeLimits                the numbers, from the CLI (`http` and `serve --http-port`)
    header_deadline_protocol  uvicorn's h11 protocol plus the header deadline: a connection
                              whose request head is not complete `header_timeout_s` after it
                              opened (or after its first byte following a response) gets 408
                              and is closed
    read_body                 a request's body, capped at `max_body_bytes` while it streams in
                              (413 without buffering the rest) and within `body_timeout_s` (408)

The connection cap is uvicorn's `limit_concurrency` (connections plus in-flight responses; past
it, 503) and the head size cap h11's `max_incomplete_event_size` (past it, 400): both set from
EdgeLimits by `uvicorn_options`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from pagedrun.server.http.errors import ApiError

# nginx's "client closed request": nobody reads the answer to a client that left; the access log
# shows it.
CLIENT_CLOSED_STATUS = 499
# What a connection gets when its request head is late: the whole reply, then the close.
LATE_HEAD_TEXT = b"request head not complete in time\n"
LATE_HEAD_REPLY = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                   b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                   % (len(LATE_HEAD_TEXT), LATE_HEAD_TEXT))


@dataclass(frozen=True)
class EdgeLimits:
    """Per-connection and per-request limits of one gateway. Defaults: a request head within
    10 s (nginx's client_header_timeout is 60 s; a client on a LAN or the internet sends a head
    in milliseconds), a body within 60 s of its head, 5 s of idle keep-alive (uvicorn's
    default), 512 connections (below the usual 1,024 open-file limit, with room for the ZeroMQ
    sockets and model files), a 16 KiB head (h11's default) and a 16 MiB body (the engine's
    own limit on a GENERATE, `max_message_bytes`, is 1 MiB by default: nothing legitimate is
    lost)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    max_connections: int = 512
    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections", "max_header_bytes", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def add_edge_options(p) -> None:
    """The limits as flags (both `http` and `serve --http-port`)."""
    d = EdgeLimits()
    p.add_argument("--http-header-timeout-s", type=float, default=d.header_timeout_s,
                   metavar="S", help="a connection's request head must be complete this long "
                   f"after it opens or after its previous response (else 408; default "
                   f"{d.header_timeout_s:g})")
    p.add_argument("--http-body-timeout-s", type=float, default=d.body_timeout_s, metavar="S",
                   help=f"a request body must arrive within this (else 408; default "
                   f"{d.body_timeout_s:g})")
    p.add_argument("--timeout-keep-alive", type=float, default=d.keep_alive_s, metavar="S",
                   help=f"idle keep-alive connections close after this (default "
                   f"{d.keep_alive_s:g}, vLLM's flag)")
    p.add_argument("--http-max-connections", type=int, default=d.max_connections,
                   metavar="N", help="open connections plus in-flight responses one gateway "
                   f"holds; past it, 503 (default {d.max_connections})")


def edge_limits(args) -> EdgeLimits:
    return EdgeLimits(header_timeout_s=args.http_header_timeout_s,
                      body_timeout_s=args.http_body_timeout_s,
                      keep_alive_s=args.timeout_keep_alive,
                      max_connections=args.http_max_connections)


def header_deadline_protocol(header_timeout_s: float):
    """uvicorn's H11Protocol with a deadline on every request head (`http=` of uvicorn.Config).
    The head is late while h11 still waits for it (their side IDLE): from the connection's
    start, and from the first byte of each later request (before that byte, uvicorn's own
    keep-alive timer runs)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        head_deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def data_received(self, data: bytes) -> None:
            if self.head_deadline is None and self.conn.their_state is h11.IDLE:
                self._arm_head_deadline()  # the first byte of a request after a response
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm_head_deadline()

        def connection_lost(self, exc) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self.head_deadline = self.loop.call_later(header_timeout_s, self._head_too_late)

        def _disarm_head_deadline(self) -> None:
            if self.head_deadline is not None:
                self.head_deadline.cancel()
                self.head_deadline = None

        def _head_too_late(self) -> None:
            self.head_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(LATE_HEAD_REPLY)
                self.transport.close()

    return HeaderDeadlineProtocol


def uvicorn_options(limits: EdgeLimits) -> dict:
    """uvicorn.Config keywords for `limits`."""
    return {"http": header_deadline_protocol(limits.header_timeout_s),
            "timeout_keep_alive": limits.keep_alive_s,
            "limit_concurrency": limits.max_connections,
            "h11_max_incomplete_event_size": limits.max_header_bytes}


async def read_body(request: Request, limits: EdgeLimits) -> bytes:
    """The request's body: 413 as soon as it passes `limits.max_body_bytes` (declared or
    streamed: a chunked body is not buffered past the cap), 408 if it is not all there within
    `limits.body_timeout_s`, 499 if the client left."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"request body over {limits.max_body_bytes} bytes", code="too_large")
    parts, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise ApiError(413, f"request body over {limits.max_body_bytes} bytes",
                                   code="too_large")
                parts.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED_STATUS, "the client disconnected") from None
    return b"".join(parts)
