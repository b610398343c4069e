"""Python clients of the paged-run server: `Client` (blocking) and `AsyncClient` (asyncio).

Both speak docs/protocol.md over a DEALER socket, keep the server's lease alive with PINGs while
they wait, turn ERROR replies into `ServerError` subclasses carrying the server's `code`, and
abort a request whose stream is closed early, times out, or (async) whose task is cancelled.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pagedrun.runtime.outputs import Logprob
from pagedrun.server.auth import apply_curve_client
from pagedrun.server.protocol import MsgType, encode, decode_reply

from pagedrun.server.protocol import DEFAULT_ENDPOINT  # re-exported: the one default
# Well under the server's default 30 s lease, so two lost PINGs in a row are still fine.
DEFAULT_HEARTBEAT_S = 5.0
HEARTBEAT_PREFIX = "_hb"
# On close, how long queued frames (an ABORT sent just before) may take to leave; with 0 an
# abort-then-close would silently drop the ABORT and leave the server to notice the disconnect.
CLOSE_LINGER_MS = 500


# --- errors -----------------------------------------------------------------------------
class ServerError(Exception):
    """An ERROR reply; `code` is the server's error code (docs/protocol.md, "Errors")."""

    code = "server_error"

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class InvalidRequestError(ServerError): pass       # noqa: E701
class PromptTooLongError(InvalidRequestError): pass  # noqa: E701
class EmptyPromptError(InvalidRequestError): pass  # noqa: E701
class DuplicateRequestIdError(InvalidRequestError): pass  # noqa: E701
class CapacityError(ServerError): pass             # noqa: E701
class OverloadedError(ServerError): pass           # noqa: E701
class ShuttingDownError(ServerError): pass         # noqa: E701
class LeaseExpiredError(ServerError): pass         # noqa: E701
class ProtocolMismatchError(ServerError): pass     # noqa: E701
class InternalServerError(ServerError): pass       # noqa: E701


ERROR_CLASSES = {
    "invalid_request": InvalidRequestError, "invalid_message": ProtocolMismatchError,
    "unsupported_version": ProtocolMismatchError, "unknown_type": ProtocolMismatchError,
    "message_too_large": InvalidRequestError, "prompt_too_long": PromptTooLongError,
    "empty_prompt": EmptyPromptError, "duplicate_request_id": DuplicateRequestIdError,
    "capacity": CapacityError, "overloaded": OverloadedError,
    "shutting_down": ShuttingDownError, "lease_expired": LeaseExpiredError,
    "internal_error": InternalServerError,
}


def error_from_body(body: dict) -> ServerError:
    code = body.get("code", "server_error")
    return ERROR_CLASSES.get(code, ServerError)(code, body.get("message", ""),
                                                body.get("request_id"))


class RequestTimeout(TimeoutError):
    """No reply frame arrived within the client's timeout; the request was aborted."""


# --- results ----------------------------------------------------------------------------
@dataclass
class Delta:
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None = None
    # Set on the one delta that carried them (protocol 1.1; see Completion.prompt_logprobs).
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: object = None
    usage: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    outputs: list[dict] = field(default_factory=list)
    logprobs: list | None = None
    # With sampling_params.prompt_logprobs: as LLM.generate's RequestOutput.prompt_logprobs, one
    # entry per prompt token, None for token 0, else Logprob(token_id, logprob, top {id: lp}).
    # None when not asked, when the request ended before its prompt had run, or when the server
    # predates protocol revision 1.1.
    prompt_logprobs: list[Logprob | None] | None = None


def _prompt_logprobs_from_wire(entries) -> list[Logprob | None] | None:
    """The wire's prompt_logprobs (nil or {token_id, logprob, top: [[id, lp], ...]} each) as
    the offline API returns them."""
    if entries is None:
        return None
    return [None if e is None else Logprob(int(e["token_id"]), float(e["logprob"]),
                                           {int(t): float(v) for t, v in e.get("top", [])})
            for e in entries]


def _generate_body(request_id, prompt, prompt_token_ids, messages, sampling_params,
                   stream) -> dict:
    body: dict = {"request_id": request_id, "stream": stream}
    if prompt is not None:
        body["prompt"] = prompt
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    if messages is not None:
        body["messages"] = list(messages)
    if sampling_params is not None:
        body["sampling_params"] = (sampling_params if isinstance(sampling_params, dict)
                                   else sampling_params.to_dict())
    return body


class _Accumulator:
    """Builds a Completion from DELTA frames (per sequence index) and the FINAL frame; after a
    stream, every `outputs` entry carries its sequence's `token_ids` and `text` as with
    stream off."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.prompt_logprobs: list[Logprob | None] | None = None

    def add(self, body: dict) -> Delta:
        """Record one DELTA reply body; returns it as the Delta the stream yields."""
        d = Delta(self.request_id, body["index"], body["token_ids"], body["text"],
                  body.get("logprobs"), _prompt_logprobs_from_wire(body.get("prompt_logprobs")))
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = d.prompt_logprobs
        self.texts.setdefault(d.index, []).append(d.text)
        self.token_ids.setdefault(d.index, []).extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs.setdefault(d.index, []).extend(d.logprobs)
        return d

    def finish(self, body: dict) -> Completion:
        outputs = [dict(o) for o in body.get("outputs", [])]
        for o in outputs:
            i = o.get("index", 0)
            o.setdefault("token_ids", self.token_ids.get(i, []))
            o.setdefault("text", "".join(self.texts.get(i, [])))
            if i in self.logprobs:
                o.setdefault("logprobs", self.logprobs[i])
        first = outputs[0] if outputs else {"token_ids": self.token_ids.get(0, []),
                                            "text": "".join(self.texts.get(0, []))}
        prompt_logprobs = _prompt_logprobs_from_wire(body.get("prompt_logprobs"))
        return Completion(self.request_id, first["text"], first["token_ids"],
                          body.get("finish_reason"), body.get("stop_reason"),
                          body.get("usage", {}), body.get("metrics", {}), outputs,
                          first.get("logprobs"),
                          self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)


def _make_socket(ctx, endpoint: str, server_public_key_file, client_secret_key_file):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
    if server_public_key_file is not None:
        apply_curve_client(sock, server_public_key_file, client_secret_key_file)
    sock.connect(endpoint)
    return sock


# --- blocking client --------------------------------------------------------------------
class Stream:
    """Iterator of `Delta`s; `.result` holds the Completion once exhausted. Closing it (or
    leaving a `with` block, or breaking out and dropping it) early aborts the request."""

    def __init__(self, client: "Client", request_id: str) -> None:
        self._client = client
        self.request_id = request_id
        self._acc = _Accumulator(request_id)
        self.result: Completion | None = None
        self._done = False

    def __iter__(self):
        return self

    def __next__(self) -> Delta:
        if self._done:
            raise StopIteration
        try:
            msg_type, body = self._client._recv_for(
                self.request_id, accept={MsgType.DELTA, MsgType.FINAL, MsgType.ERROR})
        except BaseException:
            self.close()
            raise
        if msg_type == MsgType.DELTA:
            return self._acc.add(body)
        self._done = True
        self._client._pending.pop(self.request_id, None)
        if msg_type == MsgType.FINAL:
            self.result = self._acc.finish(body)
            raise StopIteration
        raise error_from_body(body)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._client._abort_quietly(self.request_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Client:
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, timeout_s: float = 60.0,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 server_public_key_file: str | None = None,
                 client_secret_key_file: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self._ctx = zmq.Context()
        self._sock = _make_socket(self._ctx, endpoint, server_public_key_file,
                                  client_secret_key_file)
        self._pending: dict[str, collections.deque] = {}
        self._hb_ids = itertools.count()
        self._last_sent = time.monotonic()

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close()
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # requests
    def ping(self) -> dict:
        return self._call(MsgType.PING)

    def model_info(self) -> dict:
        return self._call(MsgType.MODEL_INFO)

    def stats(self) -> dict:
        return self._call(MsgType.STATS)

    def abort(self, request_id: str) -> bool:
        """True if the server still had the request in flight (its stream then ends with a
        FINAL whose finish_reason is "abort")."""
        created = request_id not in self._pending
        self._send(MsgType.ABORT, {"request_id": request_id})
        try:
            _, body = self._recv_for(request_id, accept={MsgType.ABORTED})
        finally:
            if created:
                self._pending.pop(request_id, None)
        return bool(body["found"])

    def stream(self, prompt: str | None = None, *, prompt_token_ids=None, messages=None,
               sampling_params=None, request_id: str | None = None) -> Stream:
        rid = request_id or uuid.uuid4().hex
        self._pending[rid] = collections.deque()
        self._send(MsgType.GENERATE, _generate_body(rid, prompt, prompt_token_ids, messages,
                                                    sampling_params, True))
        return Stream(self, rid)

    def generate(self, prompt: str | None = None, *, prompt_token_ids=None, messages=None,
                 sampling_params=None, request_id: str | None = None,
                 stream: bool = False) -> Completion:
        """Blocking generation; `stream=True` uses DELTA frames underneath (same result)."""
        rid = request_id or uuid.uuid4().hex
        if stream:
            s = self.stream(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                            sampling_params=sampling_params, request_id=rid)
            for _ in s:
                pass
            return s.result
        self._pending[rid] = collections.deque()
        self._send(MsgType.GENERATE, _generate_body(rid, prompt, prompt_token_ids, messages,
                                                    sampling_params, False))
        try:
            msg_type, body = self._recv_for(rid)
        except BaseException:
            self._abort_quietly(rid)
            raise
        self._pending.pop(rid, None)
        if msg_type == MsgType.ERROR:
            raise error_from_body(body)
        return _Accumulator(rid).finish(body)

    # plumbing
    def _send(self, msg_type: MsgType, body: dict, flags: int = 0) -> None:
        # A DEALER with no connected server (down, or CURVE refused us) blocks on send;
        # SNDTIMEO turns that into zmq.Again after timeout_s.
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
        try:
            self._sock.send_multipart(encode(msg_type, body), flags)
        except zmq.Again:
            raise RequestTimeout(f"could not send to the server within {self.timeout_s} s "
                                 "(not connected?)") from None
        self._last_sent = time.monotonic()

    def _call(self, msg_type: MsgType) -> dict:
        rid = uuid.uuid4().hex
        self._pending[rid] = collections.deque()
        self._send(msg_type, {"request_id": rid})
        got, body = self._recv_for(rid)
        self._pending.pop(rid, None)
        if got == MsgType.ERROR:
            raise error_from_body(body)
        return body

    def _abort_quietly(self, request_id: str) -> None:
        if request_id in self._pending and not self._sock.closed:
            self._pending.pop(request_id, None)
            try:
                self._send(MsgType.ABORT, {"request_id": request_id}, zmq.NOBLOCK)
            except RequestTimeout:
                pass  # not connected: the server's lease/disconnect handling aborts it

    def _recv_for(self, request_id: str, accept=None) -> tuple[MsgType, dict]:
        """Next message for `request_id` (others are queued for their own readers)."""
        queue = self._pending.setdefault(request_id, collections.deque())
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i, (msg_type, body) in enumerate(queue):
                if accept is None or msg_type in accept:
                    del queue[i]
                    return msg_type, body
            now = time.monotonic()
            if now >= deadline:
                self._abort_quietly(request_id)
                raise RequestTimeout(f"no reply for {request_id!r} within {self.timeout_s} s")
            if now - self._last_sent >= self.heartbeat_s:
                self._send(MsgType.PING, {"request_id": f"{HEARTBEAT_PREFIX}{next(self._hb_ids)}"})
            wait_s = min(deadline - now, self.heartbeat_s)
            if not self._sock.poll(max(1, int(wait_s * 1000))):
                continue
            msg_type, body = decode_reply(self._sock.recv_multipart())
            rid = body.get("request_id")
            if msg_type == MsgType.PONG and isinstance(rid, str) and \
                    rid.startswith(HEARTBEAT_PREFIX):
                continue
            if rid in self._pending:
                self._pending[rid].append((msg_type, body))
            # replies for requests nobody waits for any more (aborted streams) are dropped


# --- asyncio client ---------------------------------------------------------------------
async def _within(awaitable, timeout_s: float):
    """`await awaitable` with a timeout (asyncio.TimeoutError). Python 3.11's asyncio.timeout,
    because wait_for before 3.12 can swallow a cancellation that lands as the inner await
    completes, and a cancelled stream must abort, not keep running."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


class AsyncStream:
    """Async iterator of `Delta`s; `.result` after exhaustion. `aclose()`, leaving an
    `async with` block, or cancelling the awaiting task aborts the request."""

    def __init__(self, client: "AsyncClient", request_id: str, queue: asyncio.Queue) -> None:
        self._client = client
        self.request_id = request_id
        self._queue = queue
        self._acc = _Accumulator(request_id)
        self.result: Completion | None = None
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            msg_type, body = await _within(self._queue.get(), self._client.timeout_s)
        except asyncio.TimeoutError:
            await self.aclose()
            raise RequestTimeout(f"no reply for {self.request_id!r} within "
                                 f"{self._client.timeout_s} s") from None
        except BaseException:  # cancellation included
            await self.aclose()
            raise
        if msg_type == MsgType.DELTA:
            return self._acc.add(body)
        self._done = True
        self._client._queues.pop(self.request_id, None)
        if msg_type == MsgType.FINAL:
            self.result = self._acc.finish(body)
            raise StopAsyncIteration
        raise error_from_body(body)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._client._queues.pop(self.request_id, None)
            try:
                await self._client._send(MsgType.ABORT, {"request_id": self.request_id})
            except RequestTimeout:
                pass  # not connected: the server's lease/disconnect handling aborts it

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncClient:
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, timeout_s: float = 60.0,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 server_public_key_file: str | None = None,
                 client_secret_key_file: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self._ctx = zmq.asyncio.Context()
        self._sock = _make_socket(self._ctx, endpoint, server_public_key_file,
                                  client_secret_key_file)
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborts: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None
        self._send_lock: asyncio.Lock | None = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in (self._reader, self._heartbeat):
            if task is not None:
                task.cancel()
        self._sock.close()
        self._ctx.term()

    def _start(self) -> None:
        if self._reader is None:
            self._send_lock = asyncio.Lock()
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
            self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def _send(self, msg_type: MsgType, body: dict) -> None:
        self._start()
        async with self._send_lock:
            try:  # with no connected server a send waits forever; bound it
                await _within(self._sock.send_multipart(encode(msg_type, body)), self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestTimeout(f"could not send to the server within {self.timeout_s} s "
                                     "(not connected?)") from None

    async def _read_loop(self) -> None:
        while True:
            msg_type, body = decode_reply(await self._sock.recv_multipart())
            rid = body.get("request_id")
            if msg_type == MsgType.ABORTED:
                fut = self._aborts.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(bool(body["found"]))
                continue
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait((msg_type, body))

    async def _heartbeat_loop(self) -> None:
        for n in itertools.count():
            await asyncio.sleep(self.heartbeat_s)
            if self._queues:
                await self._send(MsgType.PING, {"request_id": f"{HEARTBEAT_PREFIX}{n}"})

    async def _call(self, msg_type: MsgType) -> dict:
        rid = uuid.uuid4().hex
        queue = self._queues[rid] = asyncio.Queue()
        try:
            await self._send(msg_type, {"request_id": rid})
            got, body = await _within(queue.get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply within {self.timeout_s} s") from None
        finally:
            self._queues.pop(rid, None)
        if got == MsgType.ERROR:
            raise error_from_body(body)
        return body

    async def ping(self) -> dict:
        return await self._call(MsgType.PING)

    async def model_info(self) -> dict:
        return await self._call(MsgType.MODEL_INFO)

    async def stats(self) -> dict:
        return await self._call(MsgType.STATS)

    async def abort(self, request_id: str) -> bool:
        fut = self._aborts[request_id] = asyncio.get_running_loop().create_future()
        await self._send(MsgType.ABORT, {"request_id": request_id})
        return await _within(fut, self.timeout_s)

    async def stream(self, prompt: str | None = None, *, prompt_token_ids=None, messages=None,
                     sampling_params=None, request_id: str | None = None) -> AsyncStream:
        rid = request_id or uuid.uuid4().hex
        queue = self._queues[rid] = asyncio.Queue()
        await self._send(MsgType.GENERATE, _generate_body(rid, prompt, prompt_token_ids,
                                                          messages, sampling_params, True))
        return AsyncStream(self, rid, queue)

    async def generate(self, prompt: str | None = None, *, prompt_token_ids=None,
                       messages=None, sampling_params=None,
                       request_id: str | None = None) -> Completion:
        s = await self.stream(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                              sampling_params=sampling_params, request_id=request_id)
        async with s:
            async for _ in s:
                pass
        return s.result
