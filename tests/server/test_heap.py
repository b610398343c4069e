"""Freed heap given back (server/heap.py): the trimmer's schedule (only after work, once idle,
at most once per interval), the server calling it when its last request ends, and glibc's
malloc_trim returning the free pages of a fragmented heap (RSS measured in a child process, so
the test's own heap and threads do not blur it)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from fake_engine import FakeEngine

from pagedrun.client import Client
from pagedrun.server.heap import HeapTrimmer, _glibc
from pagedrun.server.server import Server, ServerConfig


def test_trims_once_idle_after_work_and_not_more_often_than_the_interval():
    calls = []
    trimmer = HeapTrimmer(trim=lambda: calls.append(1), idle_s=2.0, min_interval_s=30.0)
    trimmer.poll(0.0, busy=False)
    trimmer.poll(10.0, busy=False)
    assert calls == []                      # no request since start: nothing to give back
    trimmer.poll(11.0, busy=True)
    trimmer.poll(12.0, busy=False)
    trimmer.poll(13.9, busy=False)
    assert calls == []                      # idle for 1.9 s < 2
    trimmer.poll(14.0, busy=False)
    assert calls == [1]
    trimmer.poll(15.0, busy=True)
    trimmer.poll(16.0, busy=False)
    trimmer.poll(30.0, busy=False)
    assert calls == [1]                     # 16 s after the last trim < 30
    trimmer.poll(44.0, busy=False)
    assert calls == [1, 1]
    trimmer.poll(100.0, busy=False)
    assert calls == [1, 1] and trimmer.trims == 2   # no work since
    trimmer.note_work()                     # a request that came and went between two polls
    trimmer.poll(101.0, busy=False)
    trimmer.poll(103.0, busy=False)
    assert calls == [1, 1, 1]


def test_the_server_trims_when_its_last_request_has_ended():
    server = Server(FakeEngine(), ServerConfig(endpoint="tcp://127.0.0.1:*"))
    calls = []
    server.heap_trimmer = HeapTrimmer(trim=lambda: calls.append(time.monotonic()), idle_s=0.2,
                                      min_interval_s=0.0)
    endpoint = server.start()
    try:
        with Client(endpoint, timeout_s=10) as client:
            assert calls == []
            sent = time.monotonic()
            client.generate("hello", sampling_params={"max_tokens": 4})
            deadline = time.monotonic() + 10
            while not calls and time.monotonic() < deadline:
                time.sleep(0.02)
        # idle begins once the request has ended, which is after it was sent
        assert calls and calls[0] - sent >= 0.2, (calls, sent)
    finally:
        server.stop()


FRAGMENT_AND_TRIM = textwrap.dedent("""
    import sys
    from pagedrun.server.heap import trim_heap

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    # 64 KiB blocks (below glibc's mmap threshold: they come from the heap), every 16th kept,
    # so the freed ones are holes that free() alone cannot return (only the heap's top).
    blocks = [bytearray(64 << 10) for _ in range(4096)]   # 256 MiB, touched (zero-filled)
    kept = blocks[::16]
    before = rss_mib()
    del blocks
    after_free = rss_mib()
    trimmed = trim_heap()
    after_trim = rss_mib()
    print(before, after_free, after_trim, trimmed)
""")


@pytest.mark.skipif(_glibc() is None, reason="malloc_trim is glibc's: this libc has none")
def test_malloc_trim_returns_the_free_pages_of_a_fragmented_heap():
    out = subprocess.run([sys.executable, "-c", FRAGMENT_AND_TRIM], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    before, after_free, after_trim = map(float, out[:3])
    assert out[3] == "True"
    # 15/16 of 256 MiB are free holes: free() kept them, malloc_trim gave them back (a page of
    # each 64 KiB block's header neighbourhood may stay: half is a wide margin).
    assert before - after_free < 64, (before, after_free)
    assert after_free - after_trim > 240 / 2, (before, after_free, after_trim)
