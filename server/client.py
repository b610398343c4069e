"""Python clients of the paged-run server: `Client` (blocking) and `AsyncClient` (asyncio).

Both speak docs/protocol.md over a DEALER socket, keep the server's lease alive with PINGs while
they wait, turn ERROR replies into `ServerError` subclasses carrying the server's `code`, and
abort a request whose stream is closed early, times out, or (async) whose task is cancelled.

Liveness (protocol 1.2, docs/protocol.md "Liveness"): while a request waits, the client PINGs
at least every min(heartbeat_s, lease_s / 3) (the lease the server announces in PONG and
MODEL_INFO_REPLY; the first wait PINGs at once to learn it), and also after
max(2 s, that interval) without any frame from the server. A PING unanswered for
`ping_timeout_s` (no frame at all since it was sent), or a reply whose `server_id` differs from
the one seen before (the server restarted and forgot the request), raises `ServerUnavailable`
for every request that was waiting, instead of waiting out `timeout_s`.

Results follow the offline API (protocol 1.3): `logprobs` and `prompt_logprobs` are vLLM's
shape, per position {token_id: Logprob(logprob, rank, decoded_token)} with the sampled (or
prompt) token first, and completions carry `cumulative_logprob`. Chat options (chat_template,
add_generation_prompt, continue_final_message, tools, chat_template_kwargs) are keyword
arguments of `generate` / `stream`, sent only when given (a 1.2 server refuses them).
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

from pagedrun.runtime.outputs import PositionLogprobs
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.server.auth import apply_curve_client
from pagedrun.server.protocol import MsgType, decode_reply, encode, position_from_wire

from pagedrun.server.protocol import DEFAULT_ENDPOINT  # re-exported: the one default
# Upper bound on the PING interval while waiting; the interval is min(this, lease_s / 3), so a
# server's short lease is always honoured and a 30 s lease still sees a PING every 5 s.
DEFAULT_HEARTBEAT_S = 5.0
# Fraction of the server's lease between two heartbeats: two may be lost in a row.
LEASE_FRACTION = 1 / 3
# After this long (at least) without any frame from the server while waiting, PING it.
MIN_SILENCE_S = 2.0
# A PING unanswered this long (no frame at all since it was sent): the server is gone.
DEFAULT_PING_TIMEOUT_S = 4.0
# How often a waiting client looks at the clock (liveness checks) at the least.
POLL_TICK_S = 0.25
HEARTBEAT_PREFIX = "_hb"
# Queue item kind (in place of a MsgType) that carries a ServerUnavailable to a waiting reader.
_LOST = "lost"
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


class ServerUnavailable(ServerError):
    """The server stopped answering (a PING went unanswered for `ping_timeout_s`) or restarted
    (its `server_id` changed, so it no longer knows the request). Raised by every request that
    was waiting; the request is not retried (it may or may not have run)."""

    code = "server_unavailable"

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__("server_unavailable", message, request_id)


class RequestTimeout(TimeoutError):
    """No reply frame arrived within the client's timeout; the request was aborted."""


class _Liveness:
    """The client's view of the server: its lease, its instance id, when it last spoke, the
    PING (if any) still waiting for an answer, and which requests are waiting (and on which
    server instance). Shared by Client and AsyncClient; clock: time.monotonic() seconds.

    A request is lost when the server is found dead (a PING unanswered for `ping_timeout_s`:
    every waiting request) or restarted (a frame with a new `server_id`: the requests the old
    instance answered, or that were sent before the old instance last spoke -- a request sent
    later, after an idle spell, reached the new instance and goes on)."""

    def __init__(self, heartbeat_s: float | None, ping_timeout_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.ping_timeout_s = ping_timeout_s
        self.lease_s: float | None = None
        self.server_id: str | None = None
        self.last_recv = float("-inf")  # never heard: the first wait PINGs at once
        self.last_sent = float("-inf")
        self.probe_sent: float | None = None  # oldest PING sent since the last frame received
        self.asked_lease = False  # a PING went out since the lease was last unknown
        self.requests: dict[str, list] = {}  # request id -> [sent at, server id that answered]
        self.lost: dict[str, str] = {}       # request id -> why it is lost

    def keepalive_s(self) -> float:
        """Longest gap between two messages to the server while a request waits."""
        interval = self.heartbeat_s if self.heartbeat_s is not None else DEFAULT_HEARTBEAT_S
        if self.lease_s is not None:
            interval = min(interval, self.lease_s * LEASE_FRACTION)
        return interval

    def silence_s(self) -> float:
        """Silence from the server after which a waiting client PINGs it."""
        return max(MIN_SILENCE_S, self.keepalive_s())

    def track(self, request_id: str) -> None:
        self.requests[request_id] = [time.monotonic(), None]
        self.lost.pop(request_id, None)

    def untrack(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.lost.pop(request_id, None)

    def need_ping(self, now: float) -> bool:
        return ((self.lease_s is None and not self.asked_lease)  # learn it at once
                or now - self.last_sent >= self.keepalive_s()
                or (self.probe_sent is None and now - self.last_recv >= self.silence_s()))

    def sent(self, msg_type: MsgType, now: float) -> None:
        self.last_sent = now
        if msg_type == MsgType.PING:
            self.asked_lease = True
            if self.probe_sent is None:
                self.probe_sent = now

    def check_dead(self, now: float) -> list[str] | None:
        """None while the server counts as alive; once the outstanding PING is overdue, every
        waiting request is lost, and those not already lost are returned."""
        if self.probe_sent is None or now - self.probe_sent <= self.ping_timeout_s:
            return None
        self.probe_sent = None
        return self._lose(list(self.requests),
                          f"the server did not answer a PING within {self.ping_timeout_s:g} s "
                          "(it died, hangs, or is unreachable)")

    def received(self, msg_type: MsgType, body: dict, now: float) -> list[str]:
        """Note a frame from the server; returns the requests it shows lost (a restart)."""
        previous, self.last_recv = self.last_recv, now
        self.probe_sent = None
        if msg_type == MsgType.PONG:
            self._learn_lease(body.get("lease_s"))
        elif msg_type == MsgType.MODEL_INFO_REPLY and isinstance(body.get("server"), dict):
            self._learn_lease(body["server"].get("lease_s"))
        sid = body.get("server_id")
        if not isinstance(sid, str):
            return []
        rid = body.get("request_id")
        info = self.requests.get(rid) if isinstance(rid, str) else None
        if info is not None and info[1] is None:
            info[1] = sid
        old, self.server_id = self.server_id, sid
        if old is None or old == sid:
            return []
        if msg_type not in (MsgType.PONG, MsgType.MODEL_INFO_REPLY):  # the new instance
            # may have another lease, and this frame did not tell it: ask
            self.lease_s, self.asked_lease = None, False
        return self._lose([r for r, (sent_at, by) in self.requests.items()
                           if by == old or (by is None and sent_at <= previous)],
                          f"the server restarted (instance {old} is now {sid}); a request "
                          "sent to the old instance is lost")

    def _lose(self, request_ids: list[str], reason: str) -> list[str]:
        newly = [r for r in request_ids if r not in self.lost]
        for r in newly:
            self.lost[r] = reason
        return newly

    def _learn_lease(self, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            self.lease_s = float(value)


# --- results ----------------------------------------------------------------------------
@dataclass
class Delta:
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    # With sampling_params.logprobs: one {token_id: Logprob} per new token (vLLM's shape: the
    # sampled token first, then the top ones).
    logprobs: list[PositionLogprobs] | None = None
    # Set on the one delta that carried them (protocol 1.1; see Completion.prompt_logprobs).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Sum of the sequence's sampled logprobs so far (1.3), with sampling_params.logprobs.
    cumulative_logprob: float | None = None


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: object = None
    usage: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    # Each entry: index, finish_reason, stop_reason, token_ids, text, and with logprobs asked
    # `logprobs` (vLLM's shape, as Completion.logprobs) and `cumulative_logprob`.
    outputs: list[dict] = field(default_factory=list)
    # Of sequence 0, as LLM.generate's CompletionOutput.logprobs: one {token_id: Logprob(
    # logprob, rank, decoded_token)} per generated token, the sampled token first.
    logprobs: list[PositionLogprobs] | None = None
    # With sampling_params.prompt_logprobs: as LLM.generate's RequestOutput.prompt_logprobs, one
    # entry per prompt token, None for token 0, else {token_id: Logprob} with the prompt token
    # first. None when not asked, when the request ended before its prompt had run, or when the
    # server predates protocol revision 1.1.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Of sequence 0 (1.3): the sum of its sampled tokens' logprobs; None without logprobs.
    cumulative_logprob: float | None = None


def _logprobs_from_wire(entries) -> list[PositionLogprobs | None] | None:
    """The wire's logprobs / prompt_logprobs (nil or an entry each) in the offline API's shape."""
    if entries is None:
        return None
    return [None if e is None else position_from_wire(e) for e in entries]


def _sampling_wire(sampling_params) -> dict:
    """sampling_params (a dict or a SamplingParams) as the wire's map: a SamplingParams sends
    only what differs from the defaults (an older server refuses fields it does not know) and
    no output_kind while it is the default DELTA (the server streams per `stream`); logit_bias
    keys become strings (every wire map key is a string; the server converts them back)."""
    if isinstance(sampling_params, SamplingParams):
        defaults = SamplingParams().to_dict()
        wire = {k: v for k, v in sampling_params.to_dict().items() if v != defaults.get(k)}
    else:
        wire = dict(sampling_params)
    bias = wire.get("logit_bias")
    if isinstance(bias, dict):
        wire["logit_bias"] = {str(k): v for k, v in bias.items()}
    return wire


def _generate_body(request_id, prompt, prompt_token_ids, messages, sampling_params,
                   stream, chat_options: dict | None = None) -> dict:
    body: dict = {"request_id": request_id, "stream": stream}
    if prompt is not None:
        body["prompt"] = prompt
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    if messages is not None:
        body["messages"] = list(messages)
    if sampling_params is not None:
        body["sampling_params"] = _sampling_wire(sampling_params)
    for name, value in (chat_options or {}).items():
        if value is not None:
            body[name] = value
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
        self.cumulative_logprobs: dict[int, float | None] = {}
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None

    def add(self, body: dict) -> Delta:
        """Record one DELTA reply body; returns it as the Delta the stream yields."""
        d = Delta(self.request_id, body["index"], body["token_ids"], body["text"],
                  _logprobs_from_wire(body.get("logprobs")),
                  _logprobs_from_wire(body.get("prompt_logprobs")),
                  body.get("cumulative_logprob"))
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = d.prompt_logprobs
        self.texts.setdefault(d.index, []).append(d.text)
        self.token_ids.setdefault(d.index, []).extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs.setdefault(d.index, []).extend(d.logprobs)
        if "cumulative_logprob" in body:
            self.cumulative_logprobs[d.index] = d.cumulative_logprob
        return d

    def finish(self, body: dict) -> Completion:
        outputs = [dict(o) for o in body.get("outputs", [])]
        for o in outputs:
            i = o.get("index", 0)
            o.setdefault("token_ids", self.token_ids.get(i, []))
            o.setdefault("text", "".join(self.texts.get(i, [])))
            if "logprobs" in o:
                o["logprobs"] = _logprobs_from_wire(o["logprobs"])
            elif i in self.logprobs:
                o["logprobs"] = self.logprobs[i]
            if i in self.cumulative_logprobs:
                o.setdefault("cumulative_logprob", self.cumulative_logprobs[i])
        first = outputs[0] if outputs else {"token_ids": self.token_ids.get(0, []),
                                            "text": "".join(self.texts.get(0, []))}
        prompt_logprobs = _logprobs_from_wire(body.get("prompt_logprobs"))
        return Completion(self.request_id, first["text"], first["token_ids"],
                          body.get("finish_reason"), body.get("stop_reason"),
                          body.get("usage", {}), body.get("metrics", {}), outputs,
                          first.get("logprobs"),
                          self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                          first.get("cumulative_logprob"))


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
        self._client._unregister(self.request_id)
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


class _FollowsServer:
    """What both clients show of their _Liveness (`self._live`): the heartbeat interval and
    what they learned of the server."""

    _live: _Liveness

    @property
    def heartbeat_s(self) -> float | None:
        return self._live.heartbeat_s

    @heartbeat_s.setter
    def heartbeat_s(self, value: float | None) -> None:
        self._live.heartbeat_s = value

    @property
    def server_id(self) -> str | None:
        """The instance id of the server as last seen (protocol 1.2), None before any reply."""
        return self._live.server_id

    @property
    def lease_s(self) -> float | None:
        """The server's lease as last announced (PONG / MODEL_INFO_REPLY), None before."""
        return self._live.lease_s


class Client(_FollowsServer):
    """Blocking client. `timeout_s` bounds the wait for each reply frame; `heartbeat_s` is the
    longest PING interval while waiting (min'd with the server's lease_s / 3); a server that
    leaves a PING unanswered for `ping_timeout_s`, or restarts, raises `ServerUnavailable`."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, timeout_s: float = 60.0,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 ping_timeout_s: float = DEFAULT_PING_TIMEOUT_S,
                 server_public_key_file: str | None = None,
                 client_secret_key_file: str | None = None) -> None:
        self.timeout_s = timeout_s
        self._live = _Liveness(heartbeat_s, ping_timeout_s)
        self._ctx = zmq.Context()
        self._sock = _make_socket(self._ctx, endpoint, server_public_key_file,
                                  client_secret_key_file)
        self._pending: dict[str, collections.deque] = {}
        self._hb_ids = itertools.count()

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

    def load_lora(self, lora_name: str, lora_path: str) -> dict:
        """Load a PEFT adapter directory (a path on the server) under `lora_name` (1.4);
        returns the LORA_REPLY ({lora_name, lora_int_id, loaded: true})."""
        return self._call(MsgType.LOAD_LORA, {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora(self, lora_name: str) -> dict:
        """Unload an adapter (refused while requests use it); LORA_REPLY, loaded: false."""
        return self._call(MsgType.UNLOAD_LORA, {"lora_name": lora_name})

    def abort(self, request_id: str) -> bool:
        """True if the server still had the request in flight (its stream then ends with a
        FINAL whose finish_reason is "abort")."""
        created = request_id not in self._pending
        if created:
            self._register(request_id)
        self._send(MsgType.ABORT, {"request_id": request_id})
        try:
            _, body = self._recv_for(request_id, accept={MsgType.ABORTED})
        finally:
            if created:
                self._unregister(request_id)
        return bool(body["found"])

    def stream(self, prompt: str | None = None, *, prompt_token_ids=None, messages=None,
               sampling_params=None, request_id: str | None = None, chat_template=None,
               add_generation_prompt=None, continue_final_message=None, tools=None,
               chat_template_kwargs=None, lora_name: str | None = None) -> Stream:
        """A streamed GENERATE. The chat options (vLLM's LLM.chat keywords; only with
        `messages`) are sent when not None; the server checks them. `lora_name` (1.4): run
        under that loaded adapter."""
        rid = request_id or uuid.uuid4().hex
        chat = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools,
                    chat_template_kwargs=chat_template_kwargs, lora_name=lora_name)
        self._register(rid)
        self._send(MsgType.GENERATE, _generate_body(rid, prompt, prompt_token_ids, messages,
                                                    sampling_params, True, chat))
        return Stream(self, rid)

    def generate(self, prompt: str | None = None, *, prompt_token_ids=None, messages=None,
                 sampling_params=None, request_id: str | None = None,
                 stream: bool = False, chat_template=None, add_generation_prompt=None,
                 continue_final_message=None, tools=None,
                 chat_template_kwargs=None, lora_name: str | None = None) -> Completion:
        """Blocking generation; `stream=True` uses DELTA frames underneath (same result).
        Chat options and `lora_name` as in `stream`."""
        rid = request_id or uuid.uuid4().hex
        chat = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools,
                    chat_template_kwargs=chat_template_kwargs, lora_name=lora_name)
        if stream:
            s = self.stream(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                            sampling_params=sampling_params, request_id=rid, **chat)
            for _ in s:
                pass
            return s.result
        self._register(rid)
        self._send(MsgType.GENERATE, _generate_body(rid, prompt, prompt_token_ids, messages,
                                                    sampling_params, False, chat))
        try:
            msg_type, body = self._recv_for(rid)
        except BaseException:
            self._abort_quietly(rid)
            raise
        self._unregister(rid)
        if msg_type == MsgType.ERROR:
            raise error_from_body(body)
        return _Accumulator(rid).finish(body)

    # plumbing
    def _register(self, request_id: str) -> None:
        self._pending[request_id] = collections.deque()
        self._live.track(request_id)

    def _unregister(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._live.untrack(request_id)

    def _send(self, msg_type: MsgType, body: dict, flags: int = 0) -> None:
        # A DEALER with no connected server (down, or CURVE refused us) blocks on send;
        # SNDTIMEO turns that into zmq.Again after timeout_s.
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
        try:
            self._sock.send_multipart(encode(msg_type, body), flags)
        except zmq.Again:
            raise RequestTimeout(f"could not send to the server within {self.timeout_s} s "
                                 "(not connected?)") from None
        self._live.sent(msg_type, time.monotonic())

    def _call(self, msg_type: MsgType, fields: dict | None = None) -> dict:
        rid = uuid.uuid4().hex
        self._register(rid)
        try:
            self._send(msg_type, {"request_id": rid, **(fields or {})})
            got, body = self._recv_for(rid)
        finally:
            self._unregister(rid)
        if got == MsgType.ERROR:
            raise error_from_body(body)
        return body

    def _abort_quietly(self, request_id: str) -> None:
        if request_id in self._pending and not self._sock.closed:
            self._unregister(request_id)
            try:
                self._send(MsgType.ABORT, {"request_id": request_id}, zmq.NOBLOCK)
            except RequestTimeout:
                pass  # not connected: the server's lease/disconnect handling aborts it

    def _recv_for(self, request_id: str, accept=None) -> tuple[MsgType, dict]:
        """Next message for `request_id` (others are queued for their own readers). PINGs the
        server while waiting (lease and liveness); raises ServerUnavailable once the server is
        found dead or restarted, RequestTimeout after timeout_s without a reply for this
        request."""
        live = self._live
        if request_id not in self._pending:
            self._register(request_id)
        queue = self._pending[request_id]
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                for i, (msg_type, body) in enumerate(queue):
                    if accept is None or msg_type in accept:
                        del queue[i]
                        return msg_type, body
                if request_id in live.lost:
                    reason = live.lost[request_id]
                    self._unregister(request_id)
                    raise ServerUnavailable(reason, request_id)
                now = time.monotonic()
                if now >= deadline:
                    self._abort_quietly(request_id)
                    raise RequestTimeout(f"no reply for {request_id!r} within {self.timeout_s} s")
                if live.check_dead(now) is not None:
                    continue
                if live.need_ping(now):
                    try:
                        self._send(MsgType.PING,
                                   {"request_id": f"{HEARTBEAT_PREFIX}{next(self._hb_ids)}"},
                                   zmq.NOBLOCK)
                    except RequestTimeout:  # not even queued: as good as unanswered
                        live.sent(MsgType.PING, now)
                wait_s = min(deadline - now, live.keepalive_s(), POLL_TICK_S)
                if not self._sock.poll(max(1, int(wait_s * 1000))):
                    continue
                msg_type, body = decode_reply(self._sock.recv_multipart())
                live.received(msg_type, body, time.monotonic())
                rid = body.get("request_id")
                if msg_type == MsgType.PONG and isinstance(rid, str) and \
                        rid.startswith(HEARTBEAT_PREFIX):
                    continue
                if rid in self._pending and rid not in live.lost:
                    self._pending[rid].append((msg_type, body))
                # replies for requests nobody waits for any more (aborted streams, requests of
                # a server instance that is gone) are dropped
        finally:
            # A PING of this wait answered after it ended proves nothing about the next wait.
            live.probe_sent = None


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
        self._client._forget(self.request_id)
        if msg_type is _LOST:
            raise body
        if msg_type == MsgType.FINAL:
            self.result = self._acc.finish(body)
            raise StopAsyncIteration
        raise error_from_body(body)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._client._forget(self.request_id)
            try:
                await self._client._send(MsgType.ABORT, {"request_id": self.request_id})
            except RequestTimeout:
                pass  # not connected: the server's lease/disconnect handling aborts it

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncClient(_FollowsServer):
    """asyncio client; same options and liveness rules as `Client` (a background task PINGs
    while any request waits and fails every waiting request with `ServerUnavailable` once the
    server is found dead or restarted)."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, timeout_s: float = 60.0,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 ping_timeout_s: float = DEFAULT_PING_TIMEOUT_S,
                 server_public_key_file: str | None = None,
                 client_secret_key_file: str | None = None) -> None:
        self.timeout_s = timeout_s
        self._live = _Liveness(heartbeat_s, ping_timeout_s)
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

    async def _send(self, msg_type: MsgType, body: dict,
                    timeout_s: float | None = None) -> None:
        self._start()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        async with self._send_lock:
            try:  # with no connected server a send waits forever; bound it
                await _within(self._sock.send_multipart(encode(msg_type, body)), timeout_s)
            except asyncio.TimeoutError:
                raise RequestTimeout(f"could not send to the server within {timeout_s} s "
                                     "(not connected?)") from None
        self._live.sent(msg_type, time.monotonic())

    def _track(self, request_id: str) -> asyncio.Queue:
        queue = self._queues[request_id] = asyncio.Queue()
        self._live.track(request_id)
        return queue

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._live.untrack(request_id)

    def _fail_lost(self, request_ids: list[str], dead: bool) -> None:
        """Wake every lost request's reader with ServerUnavailable (and, when the server is
        dead, every ABORT still waiting for its ABORTED)."""
        for rid in request_ids:
            queue = self._queues.pop(rid, None)
            reason = self._live.lost.get(rid, "the server is unavailable")
            self._live.untrack(rid)
            if queue is not None:
                queue.put_nowait((_LOST, ServerUnavailable(reason, rid)))
        if dead:
            for rid, fut in list(self._aborts.items()):
                if not fut.done():
                    fut.set_exception(ServerUnavailable("the server did not answer a PING", rid))
            self._aborts.clear()

    async def _read_loop(self) -> None:
        while True:
            msg_type, body = decode_reply(await self._sock.recv_multipart())
            lost = self._live.received(msg_type, body, time.monotonic())
            if lost:
                self._fail_lost(lost, dead=False)
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
        """While anything waits: PING for the lease and for liveness; fail the waiting
        requests once a PING goes unanswered for ping_timeout_s."""
        live = self._live
        for n in itertools.count():
            await asyncio.sleep(min(POLL_TICK_S, live.keepalive_s()))
            if not self._queues and not self._aborts:
                live.probe_sent = None  # nothing waits: no verdict to reach
                continue
            now = time.monotonic()
            # A frame already queued in the socket (the reader task not yet run) is an answer.
            if live.probe_sent is not None and self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                continue
            lost = live.check_dead(now)
            if lost is not None:
                self._fail_lost(lost, dead=True)
                continue
            if live.need_ping(now):
                try:
                    await self._send(MsgType.PING, {"request_id": f"{HEARTBEAT_PREFIX}{n}"},
                                     timeout_s=POLL_TICK_S)
                except RequestTimeout:  # not even queued: as good as unanswered
                    live.sent(MsgType.PING, now)
                except Exception:  # noqa: BLE001 -- the socket is closing: the next tick judges
                    pass

    async def _call(self, msg_type: MsgType, fields: dict | None = None) -> dict:
        rid = uuid.uuid4().hex
        queue = self._track(rid)
        try:
            await self._send(msg_type, {"request_id": rid, **(fields or {})})
            got, body = await _within(queue.get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply within {self.timeout_s} s") from None
        finally:
            self._forget(rid)
        if got is _LOST:
            raise body
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

    async def load_lora(self, lora_name: str, lora_path: str) -> dict:
        """As Client.load_lora (1.4)."""
        return await self._call(MsgType.LOAD_LORA, {"lora_name": lora_name,
                                                    "lora_path": lora_path})

    async def unload_lora(self, lora_name: str) -> dict:
        """As Client.unload_lora (1.4)."""
        return await self._call(MsgType.UNLOAD_LORA, {"lora_name": lora_name})

    async def stream(self, prompt: str | None = None, *, prompt_token_ids=None, messages=None,
                     sampling_params=None, request_id: str | None = None, chat_template=None,
                     add_generation_prompt=None, continue_final_message=None, tools=None,
                     chat_template_kwargs=None, lora_name: str | None = None) -> AsyncStream:
        """As Client.stream (chat options and lora_name included)."""
        rid = request_id or uuid.uuid4().hex
        chat = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools,
                    chat_template_kwargs=chat_template_kwargs, lora_name=lora_name)
        queue = self._track(rid)
        try:
            await self._send(MsgType.GENERATE, _generate_body(
                rid, prompt, prompt_token_ids, messages, sampling_params, True, chat))
        except BaseException:
            self._forget(rid)
            raise
        return AsyncStream(self, rid, queue)

    async def generate(self, prompt: str | None = None, *, prompt_token_ids=None,
                       messages=None, sampling_params=None,
                       request_id: str | None = None, chat_template=None,
                       add_generation_prompt=None, continue_final_message=None, tools=None,
                       chat_template_kwargs=None, lora_name: str | None = None) -> Completion:
        s = await self.stream(prompt, prompt_token_ids=prompt_token_ids, messages=messages,
                              sampling_params=sampling_params, request_id=request_id,
                              chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools,
                              chat_template_kwargs=chat_template_kwargs, lora_name=lora_name)
        async with s:
            async for _ in s:
                pass
        return s.result
