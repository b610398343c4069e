"""The engine thread: the only caller of the engine; steps it while anything is unfinished.

The server's I/O thread never touches the engine. It posts commands (add, abort, stop) to
`commands`; this thread applies them between steps, runs `engine.step()`, and posts what came
back to `events`, then calls `notify()` so the I/O thread wakes. Socket I/O, message decoding,
validation and reply encoding therefore run while the model computes (numpy and CuPy release
the GIL in their kernels), and a slow client never delays a step.

Events posted (tuples): ("outputs", list[RequestOutput]) -- a request that failed alone is an
output with `error` set --, ("rejected", engine_request_id, code, message), ("failed", message,
engine_dead: True, the server must fail everything and exit), ("lora", op, token, lora_request,
error message or None) -- the outcome of a `lora` command (op "load": engine.add_lora, "unload":
engine.remove_lora; `token` is the server's, handed back). After
each step a fresh `engine.get_stats()` snapshot is stored in `latest_stats` *before* the step's
outputs are posted, so a client that saw its final frame and then asks for stats sees the blocks
of its request already freed.
"""
from __future__ import annotations

import logging
import queue
import threading
import traceback
from typing import Callable

log = logging.getLogger("pagedrun.server")

# How long an idle engine thread blocks waiting for a command; bounds shutdown latency only.
IDLE_WAIT_S = 0.1


class EngineLoop:
    def __init__(self, engine, notify: Callable[[], None]) -> None:
        self.engine = engine
        self.notify = notify
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.latest_stats: dict = dict(engine.get_stats())
        self._thread = threading.Thread(target=self._run, name="pagedrun-engine", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def add(self, engine_request_id: str, kwargs: dict) -> None:
        self.commands.put(("add", engine_request_id, kwargs))

    def abort(self, engine_request_id: str) -> None:
        self.commands.put(("abort", engine_request_id))

    def lora(self, op: str, token, lora_request) -> None:
        """Load ("load") or unload ("unload") an adapter between steps; a "lora" event says
        how it went."""
        self.commands.put(("lora", op, token, lora_request))

    def stop(self, timeout_s: float = 10.0) -> None:
        self.commands.put(("stop",))
        self._thread.join(timeout_s)

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "stop":
            self._stopped = True
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "lora":
            _, op, token, lora_request = cmd
            error = None
            try:
                if op == "load":
                    self.engine.add_lora(lora_request)
                elif not self.engine.remove_lora(lora_request.lora_int_id):
                    error = f"adapter {lora_request.lora_name!r} is not loaded"
            except Exception as exc:  # noqa: BLE001 -- a bad adapter or one in use: reported
                error = str(exc) or type(exc).__name__
            self.events.put(("lora", op, token, lora_request, error))
            self.notify()
        elif kind == "add":
            try:
                self.engine.add_request(cmd[1], **cmd[2])
            except Exception as exc:  # the engine's RequestError carries .code; others do not
                code = getattr(exc, "code", None)
                code = code if isinstance(code, str) else "invalid_request"
                # RequestError's str() is "code: message"; the wire carries the code beside the
                # message, so the message alone (else clients print the code twice).
                message = getattr(exc, "message", None)
                message = message if isinstance(message, str) and message else str(exc)
                self.events.put(("rejected", cmd[1], code, message or type(exc).__name__))
                self.notify()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            busy = engine.has_unfinished_requests()
            try:
                cmd = self.commands.get_nowait() if busy else self.commands.get(
                    timeout=IDLE_WAIT_S)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopped or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
                self.latest_stats = dict(engine.get_stats())
            except Exception:  # noqa: BLE001 -- reported, then the server exits
                # LLMEngine.step contains every fault of one request or one step (those come
                # back as outputs with `error` set); what escapes it -- EngineDeadError, a lost
                # tensor-parallel rank -- means no later step can be trusted: the server fails
                # every in-flight request and exits non-zero rather than accept work it cannot
                # do.
                message = traceback.format_exc(limit=3)
                log.error("engine step failed:\n%s", message)
                self.events.put(("failed", message.strip().splitlines()[-1], True))
                self.notify()
                self._stopped = True  # no step after this one: the server is shutting down
                continue
            if outputs:
                self.events.put(("outputs", outputs))
                self.notify()
