"""One CPU helper thread per process (pyx/cpu_thread_pool.h): every kernel module that splits work
(cpu_gemm, cpu_ops, cpu_decode_step) binds the run_pair of pagedrun.pyx.cpu_thread_pool, its
second part runs on the one helper, and after splits from every module the process holds
exactly one helper thread. Each check runs in a fresh interpreter, so the thread census sees
only this test's threads."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap




def run_fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


CENSUS = """
    import json, os
    from pagedrun.pyx import cpu_thread_pool

    def helper_tids():
        tids = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == cpu_thread_pool.helper_thread_name():
                        tids.append(int(tid))
            except FileNotFoundError:  # a thread that ended while we listed
                pass
        return sorted(tids)
"""


def test_every_module_runs_its_second_part_on_the_one_helper():
    got = run_fresh(CENSUS + """
    from pagedrun.pyx import cpu_decode_step, cpu_gemm, cpu_ops
    before = helper_tids()
    probes = {m.__name__: m._thread_pool_probe() for m in (cpu_gemm, cpu_ops, cpu_decode_step)}
    print(json.dumps({"before": before, "after": helper_tids(), "probes": probes,
                      "address": cpu_thread_pool.run_pair_address(),
                      "helper": cpu_thread_pool.helper_thread_id(), "me": os.getpid()}))
    """)
    assert got["before"] == []  # no thread until the first split
    assert got["helper"] != 0 and got["after"] == [got["helper"]]
    assert len(got["probes"]) == 3
    for name, (address, caller, second) in got["probes"].items():
        assert address == got["address"] != 0, name
        assert caller == got["me"], name       # the main thread: its tid is the pid
        assert second == got["helper"], name   # not the caller: the one helper


def test_splits_from_every_module_leave_one_helper_thread():
    """The real kernels' splits (GEMM tiles from cpu_gemm and cpu_decode_step, decode attention
    from cpu_ops, each large enough to split), then the census."""
    got = run_fresh(CENSUS + """
    import numpy as np
    from pagedrun.pyx import cpu_decode_step, cpu_gemm, cpu_ops

    rng = np.random.default_rng(0)
    w = rng.standard_normal((1000, 576)).astype(np.float32)
    x = rng.standard_normal((8, 576)).astype(np.float32)
    packed = cpu_gemm.PackedWeight(w)
    assert 8 * 1000 * 576 >= cpu_gemm.MIN_MACS_PER_THREADED_CALL["native"]
    census = {}
    y = cpu_gemm.gemm_bf16(x, packed, threads=2, pool="native")
    census["cpu_gemm"] = helper_tids()
    y_loop = cpu_decode_step.gemm(x, packed, None, threads=2)
    census["cpu_decode_step"] = helper_tids()
    # decode attention past DECODE_SPLIT_MIN_MACS (8 M): 4 x 1100 positions x 16 heads x 64 x 2
    block_size, kv_heads, heads, dim, lens = 16, 4, 16, 64, [1100, 1100, 1100, 1100]
    blocks = sum(-(-n // block_size) for n in lens)
    k_cache = rng.standard_normal((blocks, block_size, kv_heads, dim)).astype(np.float32)
    v_cache = rng.standard_normal((blocks, block_size, kv_heads, dim)).astype(np.float32)
    per_seq = -(-lens[0] // block_size)
    tables = np.arange(blocks, dtype=np.int32).reshape(len(lens), per_seq)
    q = rng.standard_normal((len(lens), heads, dim)).astype(np.float32)
    out = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables,
                                         np.array(lens, np.int32), dim ** -0.5)
    census["cpu_ops"] = helper_tids()
    print(json.dumps({"census": census, "helper": cpu_thread_pool.helper_thread_id(),
                      "same_gemm": bool(np.array_equal(y, y_loop)),
                      "finite": bool(np.isfinite(out).all())}))
    """)
    assert got["helper"] != 0
    for name, tids in got["census"].items():
        assert tids == [got["helper"]], name
    assert got["same_gemm"] and got["finite"]


def test_idle_helper_sleeps():
    """After its last job the helper polls for HELPER_SPIN_US (300 us), then sleeps: within a
    few seconds its state is S, and it then takes no CPU time over half a second."""
    got = run_fresh(CENSUS + """
    import time
    from pagedrun.pyx import cpu_gemm
    cpu_gemm._thread_pool_probe()
    tid = cpu_thread_pool.helper_thread_id()

    def state_and_ticks():
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state; utime + stime in ticks

    deadline = time.monotonic() + 5  # a busy box may keep the polling helper off a core
    while state_and_ticks()[0] != "S" and time.monotonic() < deadline:
        time.sleep(0.01)
    state, ticks = state_and_ticks()
    time.sleep(0.5)
    print(json.dumps({"state": state, "ticks": state_and_ticks()[1] - ticks}))
    """)
    assert got["state"] == "S"
    assert got["ticks"] == 0
