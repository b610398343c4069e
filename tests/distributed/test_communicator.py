"""CpuCommunicator: the all-reduce is the sum in the fixed order ((x0 + x1) + x2) + ..., bit for
bit on every rank and independent of which rank's message arrives first; bf16 bits are summed
in float32 and rounded once; gather hands rank 0 every rank's array in rank order; a peer that
vanishes mid-collective raises PeerLostError instead of hanging. Ranks are threads here (the
process tests are test_tp_*.py)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pagedrun.runtime.distributed.communicator import CpuCommunicator, PeerLostError
from pagedrun.runtime.kernels.kernel_args import from_bf16_bits, to_bf16_bits


def run_ranks(world: int, body, delays=None):
    """body(comm) on `world` ranks (threads); returns each rank's result, in rank order."""
    root = CpuCommunicator(0, world)
    comms = [root] + [CpuCommunicator(r, world, connect=root.address) for r in range(1, world)]
    root.wait_for_peers(10)
    results, errors = [None] * world, []

    def run(rank):
        try:
            if delays:
                time.sleep(delays[rank])
            results[rank] = body(comms[rank])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in comms:
        c.close()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_is_the_fixed_order_sum(world):
    rng = np.random.default_rng(world)
    xs = [(rng.standard_normal((7, 33)) * 10 ** rng.uniform(-3, 3, (7, 33))).astype(np.float32)
          for _ in range(world)]
    expected = xs[0].copy()
    for x in xs[1:]:
        expected += x
    # Later ranks send first: arrival order must not change the sum.
    delays = [0.02 * (world - r) for r in range(world)]
    results = run_ranks(world, lambda c: [c.all_reduce(xs[c.rank]) for _ in range(3)], delays)
    for per_rank in results:
        for got in per_rank:
            assert got.dtype == np.float32 and got.shape == (7, 33)
            assert np.array_equal(got, expected)  # bitwise, on every rank, every time


def test_all_reduce_bf16_bits():
    rng = np.random.default_rng(5)
    xs = [to_bf16_bits(rng.standard_normal(19).astype(np.float32)) for _ in range(3)]
    total = from_bf16_bits(xs[0]) + from_bf16_bits(xs[1]) + from_bf16_bits(xs[2])
    results = run_ranks(3, lambda c: c.all_reduce(xs[c.rank]))
    for got in results:
        assert got.dtype == np.uint16
        assert np.array_equal(got, to_bf16_bits(total))


def test_gather_in_rank_order():
    xs = [np.full((2, r + 1), r, np.float32) for r in range(4)]
    results = run_ranks(4, lambda c: c.gather(xs[c.rank]))
    assert results[1:] == [None, None, None]
    assert [g.tolist() for g in results[0]] == [x.tolist() for x in xs]


def test_peer_lost_mid_collective():
    root = CpuCommunicator(0, 3, timeout_s=60)
    peers = [CpuCommunicator(r, 3, connect=root.address) for r in (1, 2)]
    root.wait_for_peers(10)
    peers[1].close()  # rank 2 vanishes before the collective
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="dropped"):
        root.all_reduce(np.ones(4, np.float32))
    assert time.monotonic() - started < 5
    peers[0].close()
    root.close()


def test_silent_peer_times_out():
    root = CpuCommunicator(0, 2, timeout_s=0.5)
    peer = CpuCommunicator(1, 2, connect=root.address)
    root.wait_for_peers(10)
    with pytest.raises(PeerLostError, match="no answer within"):
        root.all_reduce(np.ones(4, np.float32))
    peer.close()
    root.close()


def test_nccl_communicator_without_cupy_says_what_to_install():
    from pagedrun.runtime.distributed import nccl_communicator

    if nccl_communicator.nccl is not None:
        pytest.skip("CuPy with NCCL is installed here (tests/gpu/run_all.sh covers it)")
    with pytest.raises(nccl_communicator.NcclNotAvailableError, match="cupy"):
        nccl_communicator.NcclCommunicator(0, 1, [0] * 128)
