"""The ROUTER front: sockets, request table, client leases, back-pressure, graceful shutdown.

One I/O thread (the caller of `serve()`) owns every socket and the request table; the engine
runs in its own thread (engine_loop.py). Life of a GENERATE: decode + validate (protocol.py,
validation.py) -> admit against the in-flight bound -> optional tokenization here (so the
engine thread never waits on it) -> EngineLoop.add -> engine outputs come back as events ->
DELTA frames (stream) or accumulation (no stream) -> one FINAL, or one ERROR. Every message
gets a reply.

Lost clients (docs/protocol.md, "Liveness"): ROUTER_MANDATORY turns a send to a disconnected
peer into EHOSTUNREACH, which orphans and aborts that peer's requests at once; a peer that stays
connected but silent longer than `lease_s` while it has requests in flight is treated the same.

Hostile input: the per-message handler is total -- decoding and validation raise only
ProtocolError (an ERROR with its code), and anything else a message causes is logged and
answered `internal_error`; no message ends the server. Every DELTA, FINAL, ERROR, PONG and
MODEL_INFO_REPLY carries `server_id`, random per server start, so clients can tell a restart.
Logprobs (1.3): the engine's per-position {token_id: Logprob} dicts become the wire's entries
(protocol.position_to_wire), and completions carry `cumulative_logprob` when logprobs were asked.
LoRA adapters (1.4): the adapter registry (name -> LoRARequest) lives here, in the I/O thread;
GENERATE's `lora_name` is resolved against it (unknown: `invalid_request`), LOAD_LORA /
UNLOAD_LORA go to the engine thread (EngineLoop.lora) and are answered LORA_REPLY or ERROR
when the engine has loaded the adapter or refused.
Shutdown: the first request_shutdown() drains; force_shutdown() (a second signal) answers every
in-flight request `shutting_down` and returns at once.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field

import zmq

from pagedrun.runtime.engine import LoRARequest  # the engine API takes it
from pagedrun.runtime.lora import ADAPTER_FILES  # what a runtime LOAD_LORA's directory holds
from pagedrun.runtime.sampling_params import MAX_LOGPROBS
from pagedrun.server.auth import CurveConfig, start_curve_server
from pagedrun.server.engine_loop import EngineLoop
from pagedrun.server.heap import HeapTrimmer
from pagedrun.server.metrics import ServerMetrics
from pagedrun.server.protocol import (DEFAULT_MAX_MESSAGE_BYTES, HARD_LIMIT_FACTOR,
                                      PROTOCOL_REVISION, PROTOCOL_VERSION, ErrorCode, MsgType,
                                      ProtocolError, decode, encode, error_body, is_int,
                                      is_loopback_endpoint, new_server_id, position_to_wire,
                                      valid_request_id)
from pagedrun.server.validation import (GenerateRequest, ModelLimits, check_fields,
                                        check_prompt_len, parse_generate, parse_lora_message,
                                        truncate_prompt)

log = logging.getLogger("pagedrun.server")

from pagedrun.server.protocol import DEFAULT_ENDPOINT  # re-exported: the one default
# Poll timeout: bounds how late a lease sweep or a shutdown request is noticed.
POLL_INTERVAL_S = 0.1
# Messages read per loop turn before engine events get a turn, so a flood cannot starve replies.
MAX_RECV_PER_TURN = 256
# Per-peer outgoing queue; a client this far behind is treated as gone (its requests aborted).
SEND_HWM_MESSAGES = 10_000
# After shutdown aborts what is left, how long to wait for the engine's abort finals.
ABORT_FLUSH_S = 5.0
# How long close() lets queued replies (finals of a shutdown) drain to their clients.
CLOSE_LINGER_MS = 2000
# A forced shutdown (second signal): how long the `shutting_down` errors may take to leave, and
# how long to wait for the engine thread (a daemon; a step in progress is not waited for).
FORCED_LINGER_MS = 500
FORCED_ENGINE_JOIN_S = 0.5
# Replies that carry the server instance id (protocol 1.2).
TAGGED_REPLIES = frozenset({MsgType.DELTA, MsgType.FINAL, MsgType.ERROR, MsgType.PONG,
                            MsgType.MODEL_INFO_REPLY, MsgType.LORA_REPLY})


def runtime_adapter_dir(root: str, path: str) -> str | None:
    """The adapter directory a LOAD_LORA names (`path`, relative to `root` or absolute), when
    it resolves (symbolic links followed) inside `root` and holds the adapter's files as
    regular files; None otherwise. Only stat calls: a FIFO or device named there is refused
    without being opened (opening a FIFO would block the engine thread until a writer came)."""
    root = os.path.realpath(root)
    target = os.path.realpath(os.path.join(root, path))
    if not target.startswith(root + os.sep) or not os.path.isdir(target):
        return None
    for name in ADAPTER_FILES:
        try:
            if not stat.S_ISREG(os.stat(os.path.join(target, name)).st_mode):
                return None
        except OSError:
            return None
    return target


def adapter_load_failed(name: str) -> str:
    """The one answer to every failed LOAD_LORA: which check failed is logged on the server,
    never sent, so a client cannot learn what exists on the server's file system."""
    return (f"LOAD_LORA: adapter {name!r} could not be loaded (not a PEFT LoRA adapter directory "
            "under the server's --lora-root that fits this model)")


@dataclass
class ServerConfig:
    endpoint: str = DEFAULT_ENDPOINT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_queued_requests: int = 1024  # in flight (running + waiting) before `overloaded`
    lease_s: float = 30.0
    shutdown_timeout_s: float = 30.0  # let in-flight requests finish this long, then abort
    tokenize_in_server: bool = True
    curve: CurveConfig | None = None
    # LOAD_LORA at run time (paged-run serve --allow-runtime-lora --lora-root DIR): None, the
    # default, refuses it (adapters come from --lora-modules at start); else only adapter
    # directories that resolve inside this one are read.
    runtime_lora_root: str | None = None


@dataclass
class _Request:
    engine_id: str
    identity: bytes
    client_id: str
    stream: bool
    arrival_time: float
    first_token_time: float | None = None
    num_output_tokens: int = 0
    orphaned: bool = False  # client gone: abort sent, nothing more is sent to it
    abort_requested: bool = False  # the client sent ABORT; its FINAL "abort" is on the way
    texts: dict = field(default_factory=dict)      # index -> list[str] (stream off)
    token_ids: dict = field(default_factory=dict)  # index -> list[int] (stream off)
    logprobs: dict = field(default_factory=dict)   # index -> list (stream off, when asked)
    cumulative_logprobs: dict = field(default_factory=dict)  # index -> float (when asked)
    # Top logprobs per position asked for (-1 resolved to the vocabulary), None: not asked.
    num_logprobs: int | None = None
    num_prompt_logprobs: int | None = None
    # Wire form of the prompt logprobs once the engine has handed them over and until one frame
    # (the next DELTA, else the FINAL) has carried them; sent once per request.
    prompt_logprobs: list | None = None
    prompt_logprobs_taken: bool = False


def _logprobs_wire(logprobs, num_top: int) -> list:
    """Sample or prompt logprobs: one entry per position, nil where there is none (prompt
    token 0)."""
    return [None if pos is None else position_to_wire(pos, num_top) for pos in logprobs]


def _num_top(asked: int | None, vocab_size: int) -> int | None:
    """A request's logprobs / prompt_logprobs as a count of top entries (-1: the vocabulary)."""
    return None if asked is None else (vocab_size if asked == -1 else asked)


class Server:
    def __init__(self, engine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        info = dict(engine.model_info())
        self.model_info = info
        # vLLM's max_logprobs is an engine setting (EngineConfig); an engine without one (the
        # tests' fake) gets the default.
        max_logprobs = getattr(getattr(engine, "config", None), "max_logprobs", MAX_LOGPROBS)
        self.limits = ModelLimits(vocab_size=int(info["vocab_size"]),
                                  max_model_len=int(info["max_model_len"]),
                                  max_logprobs=max_logprobs if is_int(max_logprobs)
                                  else MAX_LOGPROBS)
        tokenizer = getattr(engine, "tokenizer", None)
        # Tokenize here, not in the engine thread, when the tokenizer offers the same calls the
        # engine would make (runtime/engine/core.py: encode(prompt); apply_chat_template(messages,
        # tokenize=True)); otherwise the engine does it (and the fake engine of the tests).
        use = self.config.tokenize_in_server and tokenizer is not None
        self._encode = getattr(tokenizer, "encode", None) if use else None
        self._apply_template = (getattr(tokenizer, "apply_chat_template", None)
                                if use and getattr(tokenizer, "chat_template", None) else None)
        self.metrics = ServerMetrics()
        # LoRA adapters by name (1.4): those the engine has at start (--lora-modules), then
        # LOAD_LORA / UNLOAD_LORA. New adapters get lora_int_ids above every known one.
        self.lora_enabled = bool(info.get("enable_lora"))
        known = getattr(engine, "list_lora_requests", list)()
        self._adapters: dict[str, LoRARequest] = {r.lora_name: r for r in known}
        self._next_lora_id = max((r.lora_int_id for r in known), default=0) + 1
        self._requests: dict[str, _Request] = {}          # engine id -> request
        self._by_client: dict[tuple[bytes, str], str] = {}  # (identity, client id) -> engine id
        self._by_identity: dict[bytes, set[str]] = {}
        self._last_seen: dict[bytes, float] = {}
        self._next_id = 0
        # Random per server start (protocol 1.2): clients compare it to tell a restarted server.
        self.server_id = new_server_id()
        self._shutdown = threading.Event()
        self._force = threading.Event()
        self.forced = False  # set once a forced shutdown has ended serve()
        self.engine_dead: str | None = None  # why, once a step failed for good (lost TP rank)
        self._bound = threading.Event()
        self._draining = False
        self.endpoint: str | None = None
        self._thread: threading.Thread | None = None
        # Freed heap back to the system once no request is in flight (server/heap.py).
        self.heap_trimmer = HeapTrimmer()

    # --- life cycle ---------------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Thread- and signal-safe: stop accepting, finish or abort in-flight work, return."""
        self._shutdown.set()

    def force_shutdown(self) -> None:
        """Thread- and signal-safe: stop now; every in-flight request is answered
        `shutting_down` (best effort) and serve() returns without waiting for the engine."""
        self._force.set()
        self._shutdown.set()

    def start(self) -> str:
        """Serve in a background thread (tests, in-process chat); returns the bound endpoint."""
        self._thread = threading.Thread(target=self.serve, name="pagedrun-io", daemon=True)
        self._thread.start()
        if not self._bound.wait(30):
            raise RuntimeError("server did not bind within 30 s")
        if self.endpoint is None:
            raise RuntimeError("server failed to bind; see log")
        return self.endpoint

    def wait_bound(self, timeout_s: float) -> str | None:
        """The bound endpoint once serve() has bound (None on timeout or bind failure)."""
        self._bound.wait(timeout_s)
        return self.endpoint

    def stop(self, timeout_s: float = 60.0) -> None:
        self.request_shutdown()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def serve(self) -> None:
        ctx = zmq.Context()
        auth = None
        try:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.MAXMSGSIZE,
                              self.config.max_message_bytes * HARD_LIMIT_FACTOR)
            router.setsockopt(zmq.SNDHWM, SEND_HWM_MESSAGES)
            router.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            if self.config.curve is not None:
                auth = start_curve_server(ctx, router, self.config.curve)
            router.bind(self.config.endpoint)
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            wake_rx = ctx.socket(zmq.PAIR)
            wake_rx.bind(f"inproc://wake-{id(self)}")
            wake_tx = ctx.socket(zmq.PAIR)
            wake_tx.connect(f"inproc://wake-{id(self)}")
        except Exception:
            self._bound.set()
            ctx.destroy(linger=0)
            if auth is not None:
                auth.stop()
            raise

        def notify() -> None:  # runs in the engine thread; wake_tx belongs to it from here on
            try:
                wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending

        self._router = router
        self._loop = EngineLoop(self.engine, notify)
        self._loop.start()
        self._warn_if_exposed()  # before _bound: start() returns with the warning logged
        self._bound.set()
        log.info("serving on %s (server id %s)", self.endpoint, self.server_id)
        try:
            self._run(router, wake_rx)
        finally:
            self._loop.stop(FORCED_ENGINE_JOIN_S if self.forced else 10.0)
            wake_tx.close(linger=0)
            wake_rx.close(linger=0)
            if self.forced:
                router.setsockopt(zmq.LINGER, FORCED_LINGER_MS)
            router.close()  # LINGER lets the last finals reach their clients
            if auth is not None:
                auth.stop()
            ctx.term()
            log.info("server stopped")

    def _warn_if_exposed(self) -> None:
        """Bound beyond loopback without CURVE: anyone who reaches the address is a client."""
        if self.config.curve is not None:
            return
        if is_loopback_endpoint(self.config.endpoint) and is_loopback_endpoint(self.endpoint):
            return
        log.warning("the client socket is bound to %s, beyond loopback, without CURVE: anyone "
                    "who can reach it can use the model and read its replies. Enable CURVE "
                    "with --curve-secret-key FILE --curve-allowed-clients DIR (ServerConfig."
                    "curve; docs/protocol.md, 'Security'), or bind 127.0.0.1.", self.endpoint)

    def _run(self, router, wake_rx) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake_rx, zmq.POLLIN)
        next_sweep = time.monotonic()
        drain_deadline = abort_deadline = None
        while True:
            ready = dict(poller.poll(POLL_INTERVAL_S * 1000))
            if self._force.is_set():
                self._stop_now()
                return
            if router in ready:
                for _ in range(MAX_RECV_PER_TURN):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
            if wake_rx in ready:
                while True:
                    try:
                        wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            self._drain_events()
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep_leases(now)
                next_sweep = now + min(1.0, self.config.lease_s / 4)
            self.heap_trimmer.poll(now, busy=bool(self._requests))
            if self._shutdown.is_set() and not self._draining:
                self._draining = True
                drain_deadline = now + self.config.shutdown_timeout_s
                log.info("shutting down: %d request(s) in flight", len(self._requests))
            if self._draining:
                # A dead engine confirms nothing: every request was answered internal_error
                # when it died, so there is nothing left to wait for.
                if not self._requests or self.engine_dead is not None:
                    return
                if abort_deadline is None and now >= drain_deadline:
                    for req in self._requests.values():
                        self._loop.abort(req.engine_id)
                    abort_deadline = now + ABORT_FLUSH_S
                elif abort_deadline is not None and now >= abort_deadline:
                    for req in list(self._requests.values()):
                        self._send_error(req.identity, ErrorCode.SHUTTING_DOWN,
                                         "server stopped before the engine confirmed the abort",
                                         req.client_id)
                    return

    def _stop_now(self) -> None:
        """A forced shutdown: answer every in-flight request `shutting_down`, best effort."""
        self.forced = True
        log.warning("forced shutdown: %d request(s) in flight answered shutting_down",
                    sum(not r.orphaned for r in self._requests.values()))
        for req in list(self._requests.values()):
            if not req.orphaned:
                self._send_error(req.identity, ErrorCode.SHUTTING_DOWN,
                                 "server forced to stop (second signal); request not finished",
                                 req.client_id)
                req.orphaned = True

    # --- incoming -----------------------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> None:
        """Handle one client message; total: whatever the frames hold, the sender gets exactly
        one reply (or, for an accepted GENERATE, its stream), and nothing is raised."""
        identity = frames[0]
        rid = None
        try:
            self.metrics.counters["messages_received_total"] += 1
            self._last_seen[identity] = time.monotonic()
            msg_type, body = decode(frames[1:], self.config.max_message_bytes)
            rid = valid_request_id(body.get("request_id"))
            if msg_type == MsgType.GENERATE:
                self._on_generate(identity, parse_generate(body, self.limits))
                return
            if msg_type in (MsgType.LOAD_LORA, MsgType.UNLOAD_LORA):
                self._on_lora(identity, msg_type, *parse_lora_message(msg_type, body))
                return
            rid = check_fields(msg_type, body)
            if msg_type == MsgType.ABORT:
                engine_id = self._by_client.get((identity, rid))
                if engine_id is not None and not self._requests[engine_id].abort_requested:
                    self._requests[engine_id].abort_requested = True
                    self._loop.abort(engine_id)
                self._send(identity, MsgType.ABORTED,
                           {"request_id": rid, "found": engine_id is not None})
            elif msg_type == MsgType.PING:
                self._send(identity, MsgType.PONG, {
                    "request_id": rid, "status": "draining" if self._stopping() else "ok",
                    "protocol_version": PROTOCOL_VERSION,
                    "protocol_revision": PROTOCOL_REVISION, "lease_s": self.config.lease_s,
                    "server_time": time.time(), "num_requests_in_flight": len(self._requests)})
            elif msg_type == MsgType.MODEL_INFO:
                self._send(identity, MsgType.MODEL_INFO_REPLY, self._model_info_body(rid))
            elif msg_type == MsgType.STATS:
                body = self.metrics.stats_body(self._loop.latest_stats, len(self._requests),
                                               len(self._by_identity))
                body["request_id"] = rid
                self._send(identity, MsgType.STATS_REPLY, body)
        except ProtocolError as exc:
            self._reject(identity, exc.code, exc.message, exc.request_id)
        except Exception as exc:  # noqa: BLE001 -- a bug or a hostile corner: answer, go on
            log.exception("failed to handle a message from client %s", identity.hex())
            self._reject(identity, ErrorCode.INTERNAL_ERROR,
                         f"the server failed to handle this message ({type(exc).__name__}); "
                         "it was dropped", rid)

    def _stopping(self) -> bool:
        """Whether new work is refused: draining, or shutdown requested. The event as well as
        _draining: a message that arrives after request_shutdown() returned but before the
        loop's next turn set _draining is refused too (and PING says draining)."""
        return self._draining or self._shutdown.is_set()

    def _reject(self, identity: bytes, code: ErrorCode, message: str,
                request_id: str | None) -> None:
        """Answer a message with an ERROR; never raises (a failure here is only logged)."""
        try:
            self.metrics.counters["request_rejected_total"] += 1
            self._send_error(identity, code, message, request_id)
        except Exception:  # noqa: BLE001
            log.exception("could not send an error reply to client %s", identity.hex())

    def _on_generate(self, identity: bytes, req: GenerateRequest) -> None:
        rid = req.request_id
        if self._stopping():
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "server is shutting down", rid)
        if (identity, rid) in self._by_client:
            raise ProtocolError(ErrorCode.DUPLICATE_REQUEST_ID,
                                f"request_id {rid!r} is already in flight on this connection",
                                rid)
        if len(self._requests) >= self.config.max_queued_requests:
            raise ProtocolError(ErrorCode.OVERLOADED,
                                f"{len(self._requests)} requests in flight (the limit is "
                                f"{self.config.max_queued_requests}); retry later", rid)
        params = req.sampling_params
        kwargs: dict = {"sampling_params": params}
        if req.lora_name is not None:
            kwargs["lora_request"] = self._adapter(req.lora_name, rid)
        if req.prompt is not None and self._encode is not None:
            ids = list(self._encode(req.prompt))
            if not ids:
                raise ProtocolError(ErrorCode.EMPTY_PROMPT, "prompt: encodes to no tokens", rid)
            ids = truncate_prompt(ids, params, self.limits)
            check_prompt_len(len(ids), self.limits, rid)
            kwargs["prompt_token_ids"] = ids
        elif req.prompt is not None:
            kwargs["prompt"] = req.prompt
        elif req.prompt_token_ids is not None:
            kwargs["prompt_token_ids"] = req.prompt_token_ids
        elif self._apply_template is not None:
            ids = self._render_chat(req, rid)
            if not ids:
                raise ProtocolError(ErrorCode.EMPTY_PROMPT, "messages: render to no tokens", rid)
            ids = truncate_prompt(ids, params, self.limits)
            check_prompt_len(len(ids), self.limits, rid)
            kwargs["prompt_token_ids"] = ids
        else:  # the engine renders (a model without a template of its own, the tests' fake)
            kwargs["messages"] = req.messages
            if req.chat_options is not None:
                kwargs["chat_options"] = req.chat_options
        now = time.monotonic()
        kwargs["arrival_time"] = now
        engine_id = f"r{self._next_id}"
        self._next_id += 1
        vocab = self.limits.vocab_size
        self._requests[engine_id] = _Request(
            engine_id, identity, rid, req.stream, now,
            num_logprobs=_num_top(params.logprobs, vocab),
            num_prompt_logprobs=_num_top(params.prompt_logprobs, vocab))
        self._by_client[(identity, rid)] = engine_id
        self._by_identity.setdefault(identity, set()).add(engine_id)
        self._loop.add(engine_id, kwargs)
        self.heap_trimmer.note_work()

    def _adapter(self, name: str, rid: str | None) -> LoRARequest:
        """The loaded adapter called `name`, or an `invalid_request` naming what is loaded."""
        if not self.lora_enabled:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "lora_name: LoRA is not enabled on "
                                "this server (paged-run serve --enable-lora)", rid)
        adapter = self._adapters.get(name)
        if adapter is None:
            loaded = ", ".join(repr(n) for n in sorted(self._adapters)[:16]) or "none"
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"lora_name: unknown adapter "
                                f"{name!r} (loaded: {loaded})", rid)
        return adapter

    def _on_lora(self, identity: bytes, msg_type: MsgType, rid: str | None, name: str,
                 path: str | None) -> None:
        """LOAD_LORA / UNLOAD_LORA: checked here, done by the engine thread; the reply is
        sent when its "lora" event comes back (_drain_events)."""
        if msg_type == MsgType.LOAD_LORA:
            if not self.lora_enabled:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "LoRA is not enabled on this "
                                    "server (paged-run serve --enable-lora)", rid)
            if self.config.runtime_lora_root is None:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "LOAD_LORA: this server loads "
                                    "adapters only at start (paged-run serve --lora-modules; "
                                    "--allow-runtime-lora --lora-root DIR allows run-time "
                                    "loading)", rid)
            resolved = runtime_adapter_dir(self.config.runtime_lora_root, path)
            known = self._adapters.get(name)
            if known is None and resolved is None:
                log.info("LOAD_LORA %r refused: %r is not an adapter directory under %s", name,
                         path, self.config.runtime_lora_root)
                raise ProtocolError(ErrorCode.INVALID_REQUEST, adapter_load_failed(name), rid)
            path = resolved
            # A loaded name (MODEL_INFO lists them) with any other path: says nothing of files.
            if known is not None and known.lora_path != path:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"lora_name: adapter {name!r} "
                                    "is already loaded from another path; unload it first", rid)
            adapter = known or LoRARequest(name, self._next_lora_id, path)
            if known is None:
                self._next_lora_id += 1
            self._loop.lora("load", (identity, rid), adapter)
        else:
            adapter = self._adapter(name, rid)
            # Gone from the registry now, so no new GENERATE names it while the engine
            # unloads; put back if the engine refuses (in use).
            del self._adapters[name]
            self._loop.lora("unload", (identity, rid), adapter)

    def _on_lora_done(self, op: str, token: tuple, adapter: LoRARequest,
                      error: str | None) -> None:
        identity, rid = token
        if error is None and op == "load":
            self._adapters[adapter.lora_name] = adapter
        elif error is not None and op == "unload":
            self._adapters[adapter.lora_name] = adapter
        if error is not None:
            if op == "load":  # the reason names files: logged here, never sent
                log.info("LOAD_LORA %r failed: %s", adapter.lora_name, error)
                message = adapter_load_failed(adapter.lora_name)
            else:
                message = f"{op} adapter {adapter.lora_name!r}: {error}"
            self._reject(identity, ErrorCode.INVALID_REQUEST, message, rid)
            return
        self._send(identity, MsgType.LORA_REPLY, {
            "request_id": rid, "lora_name": adapter.lora_name,
            "lora_int_id": adapter.lora_int_id, "loaded": op == "load"})

    def _render_chat(self, req: GenerateRequest, rid: str) -> list[int]:
        """The prompt ids of a chat request, rendered here exactly as LLMEngine.add_request
        would (the same Tokenizer.apply_chat_template call, chat options included: 1.3)."""
        options = req.chat_options
        extra = {} if options is None else options.template_kwargs()
        try:
            return list(self._apply_template(req.messages, tokenize=True, **extra))
        except Exception as exc:  # template errors are the messages' fault (as in engine)
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"chat template: {exc}",
                                rid) from None

    def _model_info_body(self, rid: str | None) -> dict:
        info = {k: v for k, v in self.model_info.items()}
        tok = getattr(self.engine, "tokenizer", None)
        info["tokenizer"] = {
            "vocab_size": self.limits.vocab_size,
            "eos_token_ids": list(self.model_info.get("eos_token_ids", [])),
            "name": getattr(tok, "name", None) or info.get("model"),
            "has_chat_template": bool(getattr(tok, "chat_template", None)),
        }
        info["server"] = {"protocol_version": PROTOCOL_VERSION,
                          "protocol_revision": PROTOCOL_REVISION, "lease_s": self.config.lease_s,
                          "max_message_bytes": self.config.max_message_bytes,
                          "max_queued_requests": self.config.max_queued_requests,
                          "max_logprobs": self.limits.max_logprobs}
        info["enable_lora"] = self.lora_enabled
        info["lora_adapters"] = [{"name": r.lora_name, "id": r.lora_int_id}
                                 for r in sorted(self._adapters.values(),
                                                 key=lambda r: r.lora_int_id)]
        info["request_id"] = rid
        return info

    # --- engine events ------------------------------------------------------------------
    def _drain_events(self) -> None:
        events = self._loop.events
        while not events.empty():
            event = events.get()
            if event[0] == "outputs":
                for out in event[1]:
                    try:
                        self._on_output(out)
                    except Exception:  # noqa: BLE001 -- fail that request, not the server
                        log.exception("failed to forward the output of request %s",
                                      getattr(out, "request_id", "?"))
                        self._fail_request(getattr(out, "request_id", None))
            elif event[0] == "lora":
                self._on_lora_done(*event[1:])
            elif event[0] == "rejected":
                _, engine_id, code, message = event
                req = self._forget(engine_id)
                if req is not None:
                    self.metrics.counters["request_rejected_total"] += 1
                    try:
                        code = ErrorCode(code)
                    except ValueError:
                        code = ErrorCode.INVALID_REQUEST
                    if not req.orphaned:
                        self._send_error(req.identity, code, message, req.client_id)
            elif event[0] == "failed":
                if event[2] and self.engine_dead is None:  # fail everything below, then exit
                    self.engine_dead = event[1]
                    log.error("engine is dead (%s): failing in-flight requests, shutting down",
                              event[1])
                    self.request_shutdown()
                for req in list(self._requests.values()):
                    if not req.orphaned:
                        self._send_error(req.identity, ErrorCode.INTERNAL_ERROR,
                                         f"engine step failed: {event[1]}", req.client_id)
                    req.orphaned = True
                    self._loop.abort(req.engine_id)

    def _on_output(self, out) -> None:
        req = self._requests.get(out.request_id)
        if req is None:
            return
        now = time.monotonic()
        if out.finished and getattr(out, "error", None):
            # The engine failed this request alone (docs/engine_api.md, "Failures"): its
            # blocks are freed; the client gets internal_error, the other requests go on.
            self._forget(req.engine_id)
            if not req.orphaned:
                self._send_error(req.identity, ErrorCode.INTERNAL_ERROR,
                                 f"the engine failed this request: {out.error}", req.client_id)
            return
        if (req.num_prompt_logprobs is not None and not req.prompt_logprobs_taken
                and out.prompt_logprobs is not None):
            req.prompt_logprobs = _logprobs_wire(out.prompt_logprobs, req.num_prompt_logprobs)
            req.prompt_logprobs_taken = True
        want_logprobs = req.num_logprobs is not None
        for comp in out.outputs:
            if want_logprobs and comp.cumulative_logprob is not None:
                req.cumulative_logprobs[comp.index] = float(comp.cumulative_logprob)
            if comp.token_ids or comp.text:
                if req.first_token_time is None and comp.token_ids:
                    req.first_token_time = now
                    self.metrics.ttft.observe(now - req.arrival_time)
                req.num_output_tokens += len(comp.token_ids)
                lps = None
                if want_logprobs:
                    lps = _logprobs_wire(comp.logprobs or [], req.num_logprobs)
                if req.stream:
                    body = {"request_id": req.client_id, "index": comp.index,
                            "token_ids": list(comp.token_ids), "text": comp.text}
                    if lps is not None:
                        body["logprobs"] = lps
                        body["cumulative_logprob"] = req.cumulative_logprobs.get(comp.index)
                    if req.prompt_logprobs is not None:  # once: the first DELTA that can
                        body["prompt_logprobs"], req.prompt_logprobs = req.prompt_logprobs, None
                    self._send_to_request(req, MsgType.DELTA, body)
                else:
                    req.token_ids.setdefault(comp.index, []).extend(comp.token_ids)
                    req.texts.setdefault(comp.index, []).append(comp.text)
                    if lps is not None:
                        req.logprobs.setdefault(comp.index, []).extend(lps)
        if out.finished:
            self._finish(req, out, now)

    def _finish(self, req: _Request, out, now: float) -> None:
        self._forget(req.engine_id)
        outputs = []
        for comp in sorted(out.outputs, key=lambda c: c.index):
            entry = {"index": comp.index, "finish_reason": comp.finish_reason,
                     "stop_reason": comp.stop_reason}
            if not req.stream:
                entry["token_ids"] = req.token_ids.get(comp.index, [])
                entry["text"] = "".join(req.texts.get(comp.index, []))
                if req.num_logprobs is not None:
                    entry["logprobs"] = req.logprobs.get(comp.index, [])
            if req.num_logprobs is not None:
                entry["cumulative_logprob"] = req.cumulative_logprobs.get(comp.index)
            outputs.append(entry)
        reason = outputs[0]["finish_reason"] if outputs else "abort"
        e2e = now - req.arrival_time
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        usage = out.usage
        completion_tokens = usage.completion_tokens or req.num_output_tokens
        tpot = None
        if ttft is not None and completion_tokens > 1:
            tpot = (e2e - ttft) / (completion_tokens - 1)
            self.metrics.tpot.observe(tpot)
        self.metrics.e2e.observe(e2e)
        queue_time = getattr(out, "queue_time", None)  # None: never scheduled (aborted early)
        if queue_time is not None:
            self.metrics.queue.observe(max(0.0, queue_time))
        kind = "request_abort_total" if reason == "abort" else "request_success_total"
        self.metrics.counters[kind] += 1
        if req.orphaned:
            return
        body = {
            "request_id": req.client_id, "finish_reason": reason,
            "stop_reason": outputs[0]["stop_reason"] if outputs else None, "outputs": outputs,
            "usage": {"prompt_tokens": usage.prompt_tokens,
                      "cached_prompt_tokens": usage.cached_prompt_tokens,
                      "completion_tokens": completion_tokens},
            "metrics": {"time_to_first_token_s": ttft, "time_per_output_token_s": tpot,
                        "e2e_latency_s": e2e}}
        if req.prompt_logprobs is not None:  # stream off, or no DELTA carried them
            body["prompt_logprobs"] = req.prompt_logprobs
        self._send_to_request(req, MsgType.FINAL, body)

    def _fail_request(self, engine_id) -> None:
        """Answer a request `internal_error`, forget it and abort it in the engine."""
        req = self._forget(engine_id) if isinstance(engine_id, str) else None
        if req is None:
            return
        self._loop.abort(req.engine_id)
        if not req.orphaned:
            try:
                self._send_error(req.identity, ErrorCode.INTERNAL_ERROR,
                                 "the server failed to forward this request's output",
                                 req.client_id)
            except Exception:  # noqa: BLE001
                log.exception("could not send an error reply for request %s", engine_id)

    def _forget(self, engine_id: str) -> _Request | None:
        req = self._requests.pop(engine_id, None)
        if req is not None:
            self._by_client.pop((req.identity, req.client_id), None)
            ids = self._by_identity.get(req.identity)
            if ids is not None:
                ids.discard(engine_id)
                if not ids:
                    del self._by_identity[req.identity]
        return req

    # --- outgoing and liveness ----------------------------------------------------------
    def _send(self, identity: bytes, msg_type: MsgType, body: dict) -> None:
        if msg_type in TAGGED_REPLIES:
            body["server_id"] = self.server_id
        try:
            self._router.send_multipart([identity, *encode(msg_type, body)], zmq.NOBLOCK)
            return
        except zmq.Again:
            log.warning("client %s is %d messages behind; dropping it", identity.hex(),
                        SEND_HWM_MESSAGES)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
        self._orphan(identity)

    def _send_to_request(self, req: _Request, msg_type: MsgType, body: dict) -> None:
        if not req.orphaned:
            self._send(req.identity, msg_type, body)

    def _send_error(self, identity: bytes, code: ErrorCode, message: str,
                    request_id: str | None) -> None:
        self._send(identity, MsgType.ERROR, error_body(code, message, request_id))

    def _orphan(self, identity: bytes) -> None:
        """The client is gone: abort all its requests; their blocks are freed by the engine."""
        for engine_id in self._by_identity.get(identity, ()):
            req = self._requests[engine_id]
            if not req.orphaned:
                req.orphaned = True
                if not req.abort_requested:
                    self.metrics.counters["clients_lost_total"] += 1
                    self._loop.abort(engine_id)
        self._last_seen.pop(identity, None)

    def _sweep_leases(self, now: float) -> None:
        for identity in list(self._last_seen):
            if identity in self._by_identity:
                if now - self._last_seen[identity] > self.config.lease_s:
                    for engine_id in list(self._by_identity[identity]):
                        req = self._requests[engine_id]
                        if not req.orphaned:
                            self._send_error(identity, ErrorCode.LEASE_EXPIRED,
                                             f"no message from this client for "
                                             f"{self.config.lease_s} s; request aborted",
                                             req.client_id)
                    self._orphan(identity)
            else:
                del self._last_seen[identity]  # idle clients need no lease
