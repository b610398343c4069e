"""cuda/block_copy.cu (through runtime/kernels/cache_ops.py) against numpy_ops.copy_blocks /
swap_blocks: copy-on-write in every layer, gather/scatter through a staging buffer, swaps
between pools of different sizes."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import DTYPES, as_kernel_dtype, kernel_module, to_device, to_host
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.cache_ops import (copy_blocks, gather_blocks, move_blocks,
                                                scatter_blocks, swap_blocks)
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

NUM_LAYERS = 3


def _pools(rng, dt, num_blocks, block_size=16, num_kv_heads=2, head_dim=64):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [as_kernel_dtype(rng.standard_normal(shape), dt)[0] for _ in range(2 * NUM_LAYERS)]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("num_copies", (1, 5))
def test_copy_blocks_matches_reference(rng, dt, num_copies):
    num_blocks = 17
    ids = rng.permutation(num_blocks)[:2 * num_copies]
    block_copies = np.stack([ids[:num_copies], ids[num_copies:]], axis=1).astype(np.int32)
    pools = _pools(rng, dt, num_blocks)
    expected = [p.copy() for p in pools]
    numpy_ops.copy_blocks(expected[:NUM_LAYERS], expected[NUM_LAYERS:], block_copies)
    dev = [to_device(p) for p in pools]
    copy_blocks(kernel_module("block_copy.cu"), dev[:NUM_LAYERS], dev[NUM_LAYERS:],
                to_device(block_copies))
    for got, want in zip(dev, expected):
        assert np.array_equal(to_host(got).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dt", ("f16", "bf16"))
def test_gather_scatter_round_trip(rng, dt):
    (cache,) = _pools(rng, dt, 11)[:1]
    block_ids = rng.permutation(11)[:4].astype(np.int32)
    module = kernel_module("block_copy.cu")
    staging = gather_blocks(module, to_device(cache), to_device(block_ids))
    assert np.array_equal(to_host(staging), cache[block_ids])
    target = to_device(np.zeros_like(cache))
    scatter_blocks(module, target, to_device(block_ids), staging)
    got = to_host(target)
    assert np.array_equal(got[block_ids], cache[block_ids])
    untouched = np.setdiff1d(np.arange(11), block_ids)
    assert not got[untouched].any()


@pytest.mark.parametrize("dt", DTYPES)
def test_swap_blocks_matches_reference(rng, dt):
    # Swap out 5 blocks of a 13-block device pool into a 7-block host pool, then back in.
    device, host = _pools(rng, dt, 13), _pools(rng, dt, 7)
    pairs_out = np.stack([rng.permutation(13)[:5], rng.permutation(7)[:5]], axis=1).astype(np.int32)
    host_expected = [h.copy() for h in host]
    numpy_ops.swap_blocks(device, host_expected, pairs_out)
    module = kernel_module("block_copy.cu")
    device_dev = [to_device(d) for d in device]
    swap_blocks(module, device_dev, host, pairs_out)  # host side stays numpy
    for got, want in zip(host, host_expected):
        assert np.array_equal(got, want)
    pairs_in = pairs_out[:, ::-1].copy()
    device_expected = [d.copy() for d in device]
    numpy_ops.swap_blocks(host, device_expected, pairs_in)
    swap_blocks(module, host, device_dev, pairs_in)
    for got, want in zip(device_dev, device_expected):
        assert np.array_equal(to_host(got), want)


def test_move_blocks_rejects_unsupported():
    module = kernel_module("block_copy.cu")
    pairs = np.array([[0, 1]], np.int32)
    with pytest.raises(UnsupportedKernelShape, match="16-byte"):
        move_blocks(module, np.zeros((2, 1, 1, 2), np.float16), np.zeros((2, 1, 1, 2), np.float16),
                    pairs)
    with pytest.raises(UnsupportedKernelShape, match="layouts differ"):
        move_blocks(module, np.zeros((2, 16, 2, 64), np.float16),
                    np.zeros((2, 16, 1, 64), np.float16), pairs)
    with pytest.raises(UnsupportedKernelShape, match="int32"):
        move_blocks(module, np.zeros((2, 16, 2, 64), np.float16),
                    np.zeros((2, 16, 2, 64), np.float16), pairs.astype(np.int64))
