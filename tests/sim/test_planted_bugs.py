"""Planted bugs the harness must catch in-process (tests/sim/kernels/planted_bugs.cu).
The sanitizer-only ones (race, out-of-bounds, misaligned float4) are in test_sanitizers.py.
Each bug has a correct sibling launch that must pass, so no check can pass vacuously."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pagedrun.runtime.kernels import SimKernelError
from pagedrun.runtime.kernels.sim_module import sanitizer_mode

TILE = 64  # kTile in planted_bugs.cu
# Under the sanitizer job these bugs are reported (and abort) by ASan/TSan instead.
plain_only = pytest.mark.skipif(sanitizer_mode() != "plain",
                                reason="the sanitizer reports this bug itself (test_sanitizers)")


@pytest.mark.skipif(sanitizer_mode() == "tsan", reason="TSan aborts on this race")
def test_missing_syncthreads_reads_poisoned_shared_memory(planted, rng):
    x = rng.standard_normal(2 * TILE).astype(np.float32)
    good, bad = np.empty_like(x), np.empty_like(x)
    planted.get_function("neighbour_synced")(2, TILE, (x, good))
    np.testing.assert_array_equal(good, np.roll(x.reshape(2, TILE), -1, axis=1).reshape(-1))
    planted.get_function("neighbour_missing_sync")(2, TILE, (x, bad))
    assert np.isnan(bad).any()


def test_read_of_unwritten_shared_memory_is_nan(planted, rng):
    x = rng.standard_normal(TILE).astype(np.float32)
    y = np.zeros_like(x)
    planted.get_function("read_unwritten_smem")(1, TILE, (x, y))
    np.testing.assert_array_equal(y[: TILE // 2], x[: TILE // 2])
    assert np.isnan(y[TILE // 2:]).all()


@plain_only
def test_dynamic_shared_memory_overflow_is_reported(planted, rng):
    threads = 48
    x = rng.standard_normal(threads).astype(np.float32)
    y = np.empty_like(x)
    fn = planted.get_function("stage_dynamic_smem")
    fn(1, threads, (x, y), shared_mem=4 * threads)
    np.testing.assert_array_equal(y, x[::-1])
    with pytest.raises(SimKernelError, match=r"stage_dynamic_smem: shared memory overflow in "
                                             r"block \(0,0,0\).*188 bytes"):
        fn(1, threads, (x, y), shared_mem=4 * threads - 4)


def test_divergent_barrier_is_a_deadlock_report(planted):
    y = np.zeros(64, np.float32)
    with pytest.raises(SimKernelError) as err:
        planted.get_function("divergent_barrier")((3,), (64,), (y,))
    msg = str(err.value)
    # The first block to run reports: block 0 in index order, any under --sim-schedule-seed.
    assert re.search(r"divergent_barrier: deadlock in block \([0-2],0,0\) of 64 threads", msg)
    assert "threads 0-31 wait at __syncthreads (planted_bugs.cu:" in msg
    assert "threads 32-63 have exited" in msg


def test_barrier_reached_from_two_sites_is_reported(planted):
    with pytest.raises(SimKernelError, match=r"barrier_two_sites: block \(0,0,0\) thread .*"
                                             r"divergent __syncthreads"):
        planted.get_function("barrier_two_sites")(1, 64, (np.zeros(64, np.float32),))


def test_full_mask_shuffle_in_partial_warp(planted, rng):
    x = rng.standard_normal(64).astype(np.float32)
    y = np.zeros(2, np.float32)
    fn = planted.get_function("warp_sum_full_mask")
    fn(1, 64, (x, y))
    np.testing.assert_allclose(y, x.reshape(2, 32).sum(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(SimKernelError) as err:
        fn(1, 48, (x, y))
    msg = str(err.value)
    # The first lane of warp 1 (threads 32-47) to reach the shuffle reports it: lane 0 in index
    # order, any of them under a shuffled schedule (--sim-schedule-seed).
    assert re.search(r"warp_sum_full_mask: block \(0,0,0\) thread \((3[2-9]|4[0-7]),0,0\) "
                     r"\[warp 1 lane \d+\]", msg), msg
    assert "__shfl_xor_sync with mask 0xffffffff in a partial warp" in msg
    assert "planted_bugs.cu:" in msg


def test_mismatched_shuffle_masks(planted, rng):
    x = rng.standard_normal(32).astype(np.float32)
    with pytest.raises(SimKernelError, match="mismatched warp operations"):
        planted.get_function("mismatched_masks")(1, 32, (x, np.zeros(32, np.float32)))


def test_cp_async_wait_one_group_short_reads_nan(planted, rng):
    x = rng.standard_normal(32).astype(np.float32)
    good, bad = np.zeros_like(x), np.zeros_like(x)
    planted.get_function("cp_async_wait_right")(1, 4, (x, good))
    np.testing.assert_array_equal(good, x)
    planted.get_function("cp_async_wait_one_short")(1, 4, (x, bad))
    np.testing.assert_array_equal(bad[:16], x[:16])
    assert np.isnan(bad[16:]).all()


@plain_only
def test_wild_pointer_fault_becomes_an_exception(planted):
    y = np.zeros(32, np.float32)
    with pytest.raises(SimKernelError, match=r"wild_pointer: block \(1,0,0\) thread \(5,0,0\) "
                                             r"\[warp 0 lane 5\]: segmentation fault at address"):
        planted.get_function("wild_pointer")(2, 32, (y, np.int64(16)))
    # the process and the module stay usable
    planted.get_function("read_unwritten_smem")(1, TILE, (np.ones(TILE, np.float32),
                                                          np.zeros(TILE, np.float32)))


def test_divergent_shuffle_is_a_deadlock_report(planted, rng):
    x = rng.standard_normal(32).astype(np.float32)
    with pytest.raises(SimKernelError) as err:
        planted.get_function("divergent_shuffle")(1, 32, (x, np.zeros(32, np.float32)))
    msg = str(err.value)
    if "deadlock" in msg:  # index order: lanes 16-31 exit before lanes 0-15 stall
        assert "divergent_shuffle: deadlock in block (0,0,0) of 32 threads" in msg
        assert "threads 0-15 wait at __shfl_xor_sync mask 0xffffffff (planted_bugs.cu:" in msg
        assert "threads 16-31 have exited" in msg
    else:  # a shuffled schedule (--sim-schedule-seed) may see the exit first: same bug
        assert re.search(r"divergent_shuffle: block \(0,0,0\) thread \((\d|1[0-5]),0,0\) .*"
                         r"__shfl_xor_sync with mask 0xffffffff names lane (1[6-9]|2\d|3[01]), "
                         r"which has exited", msg), msg
