"""The CPU harness runs CUDA semantics faithfully: indices, shared memory, barriers, warp
shuffles and votes, atomics, half/bfloat16 rounding, and the CuPy-like launch surface."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedrun.runtime.kernels import SimKernelError, load_module
from pagedrun.runtime.kernels.sim_module import SimModule, sanitizer_mode



@pytest.mark.parametrize("n, threads", [(1, 32), (111, 64), (989, 256)])
def test_block_reverse_through_shared_memory(smoke, rng, n, threads):
    x = rng.standard_normal(n).astype(np.float32)
    y = np.full(n, np.nan, np.float32)
    blocks = -(-n // threads)
    smoke.get_function("block_reverse")((blocks,), (threads,), (x, y, np.int32(n)))
    padded = np.zeros(blocks * threads, np.float32)
    padded[:n] = x
    expect = padded.reshape(blocks, threads)[:, ::-1].reshape(-1)[:n]
    np.testing.assert_array_equal(y, expect)


def test_builtin_indices_3d(smoke):
    grid, block = (3, 2, 2), (5, 3, 2)
    per_block = 5 * 3 * 2
    out = np.full((12 * per_block * 12,), -7, np.int32)
    smoke.get_function("write_indices")(grid, block, (out,))
    rows = out.reshape(-1, 12)
    expect = []
    for bz in range(2):
        for by in range(2):
            for bx in range(3):
                for tz in range(2):
                    for ty in range(3):
                        for tx in range(5):
                            expect.append([tx, ty, tz, bx, by, bz, 5, 3, 2, 3, 2, 32])
    np.testing.assert_array_equal(rows, np.array(expect, np.int32))


def _shuffle_reference(x, src, delta, lane_mask, width):
    out = np.empty((len(x), 4), np.float32)
    for t in range(len(x)):
        warp, lane = divmod(t, 32)
        base = lane & ~(width - 1)
        idx = base + (src % width)
        up = lane - delta if lane - delta >= base else lane
        down = lane + delta if lane + delta < base + width else lane
        xr = lane ^ lane_mask if (lane ^ lane_mask) < base + width else lane
        out[t] = [x[warp * 32 + i] for i in (idx, up, down, xr)]
    return out


@pytest.mark.parametrize("src, delta, lane_mask, width",
                         [(0, 1, 1, 32), (7, 5, 19, 32), (3, 2, 4, 8), (35, 3, 6, 4)])
def test_shuffles_match_reference(smoke, rng, src, delta, lane_mask, width):
    x = rng.standard_normal(64).astype(np.float32)
    y = np.empty((64, 4), np.float32)
    smoke.get_function("shuffles")((1,), (64,), (x, y, np.int32(src), np.int32(delta),
                                                  np.int32(lane_mask), np.int32(width)))
    np.testing.assert_array_equal(y, _shuffle_reference(x, src, delta, lane_mask, width))


def test_votes_and_counting_barriers(smoke, rng):
    pred = (rng.random(96) < 0.3).astype(np.int32)
    pred[64:] = 1  # warp 2 all true
    out = np.zeros((96, 5), np.uint32)
    smoke.get_function("votes")((1,), (96,), (pred, out))
    for w in range(3):
        p = pred[32 * w: 32 * (w + 1)]
        ballot = sum(1 << i for i in range(32) if p[i])
        np.testing.assert_array_equal(out[32 * w: 32 * (w + 1), 0], ballot)
        np.testing.assert_array_equal(out[32 * w: 32 * (w + 1), 1], int(p.any()))
        np.testing.assert_array_equal(out[32 * w: 32 * (w + 1), 2], int(p.all()))
    np.testing.assert_array_equal(out[:, 3], pred.sum())
    np.testing.assert_array_equal(out[:, 4], 1)


def test_partial_mask_half_warp_sum(smoke, rng):
    x = rng.standard_normal(64).astype(np.float32)
    y = np.empty_like(x)
    smoke.get_function("half_warp_sum")((1,), (64,), (x, y))
    for w in range(2):
        np.testing.assert_allclose(y[32 * w: 32 * w + 16], x[32 * w: 32 * w + 16].sum(),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(y[32 * w + 16: 32 * w + 32], x[32 * w + 16: 32 * w + 32])


def test_atomics(smoke, rng):
    n, nbins = 1000, 19
    keys = rng.integers(0, nbins, n).astype(np.int32)
    bins = np.zeros(nbins, np.int32)
    total = np.zeros(1, np.float32)
    vmax = np.full(1, -1, np.int32)
    smoke.get_function("histogram")((-(-n // 128),), (128,), (keys, np.int32(n), bins, total, vmax))
    np.testing.assert_array_equal(bins, np.bincount(keys, minlength=nbins))
    assert total[0] == 0.5 * n and vmax[0] == keys.max()


def test_half_and_bfloat16_round_to_nearest_even(smoke, rng):
    special = np.array([0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e-8, 2.0**-25,
                        2.0**-25 * 1.0001, 2.0**-24 * 1.5, 6.1e-5, np.inf, -np.inf,
                        3.0e38, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], np.float32)
    x = np.concatenate([special, rng.standard_normal(3000).astype(np.float32) *
                        np.float32(10.0) ** rng.integers(-8, 6, 3000).astype(np.float32)])
    n = len(x)
    h, b = np.empty(n, np.uint16), np.empty(n, np.uint16)
    hx, bx = np.empty(n, np.float32), np.empty(n, np.float32)
    smoke.get_function("convert_halves")((-(-n // 256),), (256,), (x, h, b, hx, bx, np.int32(n)))
    with np.errstate(over="ignore"):
        x16 = x.astype(np.float16)
    np.testing.assert_array_equal(h, x16.view(np.uint16))
    np.testing.assert_array_equal(hx, x16.astype(np.float32))
    bits = x.view(np.uint32).astype(np.uint64)
    expect_b = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(b, expect_b)
    np.testing.assert_array_equal(bx, (expect_b.astype(np.uint32) << 16).view(np.float32))
    nan_out = np.empty(1, np.uint16)
    smoke.get_function("convert_halves")(1, 1, (np.array([np.nan], np.float32), nan_out,
                                                np.empty(1, np.uint16), np.empty(1, np.float32),
                                                np.empty(1, np.float32), np.int32(1)))
    assert np.isnan(nan_out.view(np.float16)[0])


def test_scalar_arguments_exact_dtypes(smoke):
    out = np.zeros(6, np.float64)
    fn = smoke.get_function("scalar_args")
    assert fn.param_codes == ("p", "i4", "u4", "i8", "f4", "f8", "u1")
    fn(1, 32, (out, np.int32(-3), np.uint32(7), np.int64(-2**40), np.float32(1.5),
               np.float64(2.25), np.uint8(200)))
    np.testing.assert_array_equal(out, [-3, 7, -2**40, 1.5, 2.25, 200])


@pytest.mark.parametrize("bad_args, match", [
    ((np.zeros(6),), "takes 7 arguments"),
    ((np.zeros(6), 1, np.uint32(7), np.int64(1), np.float32(1), np.float64(1), np.uint8(1)),
     "numpy scalar"),
    ((np.zeros(6), np.int64(1), np.uint32(7), np.int64(1), np.float32(1), np.float64(1),
      np.uint8(1)), "type code i4"),
    ((np.zeros(6), np.int32(1), np.uint32(7), np.int64(1), np.float64(1), np.float64(1),
      np.uint8(1)), "type code f4"),
    ((np.zeros((6, 2))[:, 0], np.int32(1), np.uint32(7), np.int64(1), np.float32(1),
      np.float64(1), np.uint8(1)), "C-contiguous"),
])
def test_wrong_arguments_raise_before_launch(smoke, bad_args, match):
    with pytest.raises(TypeError, match=match):
        smoke.get_function("scalar_args")(1, 32, bad_args)


def test_dynamic_shared_memory(smoke, rng):
    threads, offset = 40, 7
    x = rng.standard_normal(threads).astype(np.float32)
    y = np.empty_like(x)
    smoke.get_function("dynamic_smem_roundtrip")(1, threads, (x, y, np.int32(offset)),
                                                 shared_mem=4 * (threads + offset))
    np.testing.assert_array_equal(y, np.roll(x, -1))


def test_unknown_kernel_and_bad_geometry(smoke):
    with pytest.raises(AttributeError, match="no extern"):
        smoke.get_function("no_such_kernel")
    y = np.empty(2048, np.float32)
    with pytest.raises(SimKernelError, match="block of 2048 threads"):
        smoke.get_function("barrier_rounds")(1, 2048, (y, np.int32(1)))
    with pytest.raises(ValueError):
        smoke.get_function("barrier_rounds")((0,), 32, (y, np.int32(1)))


def test_builds_are_cached_by_content(smoke, build_test_module):
    again = build_test_module("smoke.cu")
    assert again.path == smoke.path
    other = build_test_module("smoke.cu", options=("-DUNUSED_FLAG=1",))
    assert other.path != smoke.path


def test_load_module_sim_backend_matches_cupy_surface():
    with pytest.raises(FileNotFoundError):
        load_module("no_such_kernel_file.cu")
    with pytest.raises(ValueError, match="backend"):
        load_module([], backend="metal")
    with pytest.raises(ValueError, match="no host equivalent"):
        SimModule('#include "smoke.cu"\n', options=("-Xptxas=-v",),
                  include_dirs=(Path(__file__).parent / "kernels",))


def test_large_dynamic_shared_memory_needs_the_opt_in_attribute(smoke, rng):
    threads, offset = 32, 20000  # 80 KiB of dynamic shared memory
    nbytes = 4 * (threads + offset)
    x = rng.standard_normal(threads).astype(np.float32)
    y = np.empty_like(x)
    fn = smoke.get_function("dynamic_smem_roundtrip")
    with pytest.raises(SimKernelError, match="max_dynamic_shared_size_bytes"):
        fn(1, threads, (x, y, np.int32(offset)), shared_mem=nbytes)
    fn.max_dynamic_shared_size_bytes = nbytes
    fn(1, threads, (x, y, np.int32(offset)), shared_mem=nbytes)
    np.testing.assert_array_equal(y, np.roll(x, -1))


def test_launch_bounds_are_enforced(smoke):
    fn = smoke.get_function("bounded_iota")
    assert fn.launch_bounds_max_threads == 64
    assert smoke.get_function("block_reverse").launch_bounds_max_threads == 0
    y = np.zeros(64, np.int32)
    fn(1, 64, (y,))
    np.testing.assert_array_equal(y, np.arange(64))
    with pytest.raises(SimKernelError, match="exceeds its __launch_bounds__ of 64"):
        fn(1, (32, 3), (np.zeros(96, np.int32),))


@pytest.fixture
def schedule_seed():
    """Sets the harness's schedule seed for one test and restores the session's afterwards."""
    from pagedrun.runtime.kernels import sim_module

    before = sim_module.schedule_seed()
    yield sim_module.set_schedule_seed
    sim_module.set_schedule_seed(before)


def _racy(smoke, threads=64):
    data = np.zeros(threads, np.int32)
    out = np.full(threads, -1, np.int32)
    smoke.get_function("racy_neighbour_read")((1,), (threads,), (data, out))
    return out


def _block_order(smoke, blocks=40):
    counter = np.zeros(1, np.int32)
    order = np.full(blocks, -1, np.int32)
    smoke.get_function("block_order")((blocks,), (32,), (counter, order))
    return order


# The planted race is a real one: TSan reports it and aborts (which is right).
racy = pytest.mark.skipif(sanitizer_mode() == "tsan", reason="TSan aborts on this planted race")


@racy
def test_index_order_schedule_hides_the_race(smoke, schedule_seed):
    schedule_seed(0)
    out = _racy(smoke)
    t = np.arange(64)
    np.testing.assert_array_equal(out, np.where(t % 2 == 0, 0, t))  # even first, always
    np.testing.assert_array_equal(_block_order(smoke), np.arange(40))


@racy
def test_random_schedule_exposes_the_race(smoke, schedule_seed):
    t = np.arange(64)
    index_order = np.where(t % 2 == 0, 0, t)
    schedule_seed(12345)
    first = _racy(smoke), _block_order(smoke)
    # 32 pairs per launch, each run in either order: all even-first is a 2^-32 event.
    assert (first[0] != index_order).any()
    assert sorted(first[1]) == list(range(40)) and (first[1] != np.arange(40)).any()
    # Every outcome is one a GPU may produce: a pair reads (0, even + 1) or (odd + 1, 0).
    even, odd = first[0][0::2], first[0][1::2]
    assert (((even == 0) & (odd == t[0::2] + 1)) | ((even == t[0::2] + 2) & (odd == 0))).all()


@pytest.mark.parametrize("seed", (1, 2, 3))
def test_race_free_kernels_agree_under_random_schedules(smoke, rng, schedule_seed, seed):
    schedule_seed(seed)
    test_block_reverse_through_shared_memory(smoke, rng, 989, 256)


def _index_order_model(threads: int) -> list[int]:
    """The log schedule_order writes under index order, from the documented rule alone
    (cuda/sim/runtime.cpp, "Schedules"): rounds over the threads in index order, each runnable
    thread running until it parks at a rendezvous or exits; the thread that completes a
    rendezvous wakes the others and runs on. Each thread's program, as in smoke.cu: log 0,
    barrier (all threads), log 1, shuffle (its warp), log 2, __syncwarp (even lanes; odd lanes
    skip), log 3, exit."""
    def program(t):
        ops = [("log", t), ("sync", "block"), ("log", 1000 + t), ("sync", ("warp", t // 32)),
               ("log", 2000 + t)]
        if t % 2 == 0:
            ops.append(("sync", ("even", t // 32)))
        return ops + [("log", 3000 + t)]

    def members(key):
        if key == "block":
            return set(range(threads))
        kind, warp = key
        lanes = range(warp * 32, warp * 32 + 32)
        return {t for t in lanes if kind == "warp" or t % 2 == 0}

    progs = [program(t) for t in range(threads)]
    pc = [0] * threads
    waiting: dict = {}             # rendezvous key -> threads parked there
    runnable = [True] * threads
    log = []

    def run(t):
        while pc[t] < len(progs[t]):
            op, arg = progs[t][pc[t]]
            pc[t] += 1
            if op == "log":
                log.append(arg)
                continue
            parked = waiting.setdefault(arg, set())
            parked.add(t)
            if parked == members(arg):       # complete: wake the others, run on
                del waiting[arg]
                for o in parked:
                    runnable[o] = True
                continue
            runnable[t] = False
            return
        runnable[t] = False                  # exited

    while any(pc[t] < len(progs[t]) for t in range(threads)):
        progressed = False
        for t in range(threads):
            if runnable[t]:
                run(t)
                progressed = True
        assert progressed, "the model deadlocked"
    return log


@racy  # the log counter is shared without atomics on purpose: the harness runs one thread at a time
@pytest.mark.parametrize("threads", (32, 96))
def test_index_order_runs_threads_in_the_documented_order(smoke, schedule_seed, threads):
    """Pins the index-order schedule (and the hand-off between parked and next threads of
    plain builds, which must not change it) to a model of its documented rule."""
    schedule_seed(0)
    expected = _index_order_model(threads)
    log = np.full(len(expected), -1, np.int32)
    count = np.zeros(1, np.int32)
    smoke.get_function("schedule_order")((1,), (threads,), (log, count))
    assert count[0] == len(expected)
    np.testing.assert_array_equal(log, expected)
    assert len(set(expected[:threads])) == threads   # the model is not trivially sorted
    assert expected[threads] == 1000 + threads - 1   # the barrier's last arrival runs on
