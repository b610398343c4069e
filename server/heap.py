"""Giving the server's freed heap back to the system (issue 36, "memory given back").

glibc's malloc keeps what a request freed in its arenas: a burst of large replies (whole-
vocabulary logprobs, long prompts' token lists, big messages) left a server at 3.7 GB where it
had started at 0.9 GB, and there it stayed. Two remedies, both glibc's own:

    cap_arenas()   at start: at most MAX_ARENAS malloc arenas (mallopt M_ARENA_MAX). glibc
                   makes up to 8 per core, one per thread that allocates while the others hold
                   theirs; each keeps its own free memory. The server's threads (I/O, engine,
                   gateway, tokenizer workers) then share a few.
    HeapTrimmer    malloc_trim(0) once the server has been idle (no request in flight) for
                   IDLE_S, at most once per MIN_INTERVAL_S: it returns every arena's free pages
                   (not only the top of the main heap, as free() does by itself). It runs on
                   the I/O thread only when no request is in flight, so nobody waits on it.

Elsewhere than glibc (musl, macOS) both are no-ops.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_ARENA_MAX = -8  # <malloc.h>
MAX_ARENAS = 2
IDLE_S = 2.0
MIN_INTERVAL_S = 30.0


@functools.lru_cache(maxsize=None)
def _glibc():
    """libc, when it is glibc (it has malloc_trim), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def cap_arenas(max_arenas: int = MAX_ARENAS) -> bool:
    """At most `max_arenas` malloc arenas from now on; True when glibc took it. Call before
    the server's threads start (arenas already made stay)."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, max_arenas) == 1)


def trim_heap() -> bool:
    """Every arena's free pages back to the system; True when glibc returned some."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class HeapTrimmer:
    """Calls `trim` (trim_heap) after `idle_s` without a request in flight, at most once per
    `min_interval_s`, and only when a request has ended since the last trim (an idle server
    does not trim every interval). `poll(now, busy)` is called every turn of the I/O loop,
    `note_work()` when a request is admitted."""

    def __init__(self, trim=trim_heap, idle_s: float = IDLE_S,
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.trim = trim
        self.idle_s = idle_s
        self.min_interval_s = min_interval_s
        self.idle_since: float | None = None
        self.last_trim = -float("inf")
        self.worked_since_trim = False
        self.trims = 0

    def note_work(self) -> None:
        """A request was admitted (the server calls this: a request that came and went between
        two polls would otherwise never be seen busy)."""
        self.idle_since = None
        self.worked_since_trim = True

    def poll(self, now: float, busy: bool) -> None:
        if busy:
            self.note_work()
            return
        if self.idle_since is None:
            self.idle_since = now
        if (self.worked_since_trim and now - self.idle_since >= self.idle_s
                and now - self.last_trim >= self.min_interval_s):
            self.trim()
            self.trims += 1
            self.last_trim = now
            self.worked_since_trim = False
