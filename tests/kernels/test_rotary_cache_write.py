"""cuda/rotary_cache_write.cu (through runtime/kernels/cache_ops.py) against
numpy_ops.rotary_embedding_and_cache_write: rotated q/k, cache contents slot by slot (padding
slots untouched), Llama-3 scaled tables, q/k/v as strided slices of a fused qkv row."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import (DTYPES, ROTARY_TOL, as_kernel_dtype, assert_close, kernel_module,
                                 result_f32, to_device, to_host)
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.cache_ops import rotary_embedding_and_cache_write
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MAX_POSITION = 4096
NUM_BLOCKS = 12
BLOCK_SIZE = 16


def _cache_values(cache, dt):
    return result_f32(cache, dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 8, 2), (128, 4, 4), (64, 8, 1)])
@pytest.mark.parametrize("num_tokens", (1, 17, 111))
def test_rotary_cache_write_matches_reference(rng, dt, head_dim, num_heads, num_kv_heads,
                                              num_tokens):
    # q, k, v are column slices of one fused qkv projection row, as the model produces them.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv, qkv_ref = as_kernel_dtype(rng.standard_normal((num_tokens, width)), dt)

    def split(a):
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        return (a[:, :q_end].reshape(num_tokens, num_heads, head_dim),
                a[:, q_end:k_end].reshape(num_tokens, num_kv_heads, head_dim),
                a[:, k_end:].reshape(num_tokens, num_kv_heads, head_dim))

    positions = rng.integers(0, MAX_POSITION, num_tokens).astype(np.int32)
    slot_mapping = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens].astype(np.int32)
    slot_mapping[rng.random(num_tokens) < 0.2] = -1  # padding tokens: rotated, never written
    cos_sin = numpy_ops.build_cos_sin_cache(
        numpy_ops.rope_inv_freq(head_dim, 500000.0, LLAMA3_SCALING), MAX_POSITION)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, k_cache_ref = as_kernel_dtype(np.full(cache_shape, np.nan, np.float32), dt)
    v_cache, v_cache_ref = as_kernel_dtype(np.full(cache_shape, np.nan, np.float32), dt)
    k_cache_ref, v_cache_ref = k_cache_ref.copy(), v_cache_ref.copy()

    qkv_dev = to_device(qkv)
    q, k, v = split(qkv_dev)
    k_cache_dev, v_cache_dev = to_device(k_cache), to_device(v_cache)
    q_rot, k_rot = rotary_embedding_and_cache_write(
        kernel_module("rotary_cache_write.cu"), q, k, v, to_device(positions), to_device(cos_sin),
        k_cache_dev, v_cache_dev, to_device(slot_mapping))
    q_ref, k_ref, v_ref = split(qkv_ref)
    q_exp, k_exp = numpy_ops.rotary_embedding_and_cache_write(
        q_ref, k_ref, v_ref, positions, cos_sin, k_cache_ref, v_cache_ref, slot_mapping)
    tol = ROTARY_TOL[dt]
    assert_close(result_f32(q_rot, dt), q_exp, tol, f"q_rot {dt}")
    assert_close(result_f32(k_rot, dt), k_exp, tol, f"k_rot {dt}")
    for name, got, want in (("k_cache", k_cache_dev, k_cache_ref), ("v_cache", v_cache_dev,
                                                                    v_cache_ref)):
        got = _cache_values(got, dt)
        want = np.asarray(want, dtype=np.float32)
        written = ~np.isnan(want)
        assert np.array_equal(np.isnan(got), ~written), f"{name}: wrong set of slots written"
        assert_close(got[written], want[written], tol, f"{name} {dt}")


def test_rotary_in_place(rng):
    q32 = rng.standard_normal((5, 4, 64)).astype(np.float32)
    k32 = rng.standard_normal((5, 2, 64)).astype(np.float32)
    v32 = rng.standard_normal((5, 2, 64)).astype(np.float32)
    positions = np.arange(5, dtype=np.int32) * 100
    slots = np.array([3, -1, 40, 7, 8], np.int32)
    cos_sin = numpy_ops.build_cos_sin_cache(numpy_ops.rope_inv_freq(64, 10000.0), 512)
    caches = [np.full((4, 16, 2, 64), np.nan, np.float32) for _ in range(4)]
    q, k = to_device(q32.copy()), to_device(k32.copy())
    q_out, k_out = rotary_embedding_and_cache_write(
        kernel_module("rotary_cache_write.cu"), q, k, to_device(v32), to_device(positions),
        to_device(cos_sin), to_device(caches[0]), to_device(caches[1]), to_device(slots),
        q_out=q, k_out=k)
    q_exp, k_exp = numpy_ops.rotary_embedding_and_cache_write(q32, k32, v32, positions, cos_sin,
                                                              caches[2], caches[3], slots)
    assert q_out is q and k_out is k
    assert_close(to_host(q), q_exp, ROTARY_TOL["f32"], "in-place q")
    assert_close(to_host(k), k_exp, ROTARY_TOL["f32"], "in-place k")


def _call(**overrides):
    args = dict(q=np.zeros((3, 4, 64), np.float16), k=np.zeros((3, 2, 64), np.float16),
                v=np.zeros((3, 2, 64), np.float16), positions=np.zeros(3, np.int32),
                cos_sin_cache=np.zeros((8, 64), np.float32),
                k_cache=np.zeros((2, 16, 2, 64), np.float16),
                v_cache=np.zeros((2, 16, 2, 64), np.float16), slot_mapping=np.zeros(3, np.int32))
    args.update(overrides)
    return rotary_embedding_and_cache_write(kernel_module("rotary_cache_write.cu"), **args)


@pytest.mark.parametrize("case,overrides", [
    ("odd head_dim", dict(q=np.zeros((3, 4, 63), np.float16), k=np.zeros((3, 2, 63), np.float16),
                          v=np.zeros((3, 2, 63), np.float16),
                          cos_sin_cache=np.zeros((8, 63), np.float32),
                          k_cache=np.zeros((2, 16, 2, 63), np.float16),
                          v_cache=np.zeros((2, 16, 2, 63), np.float16))),
    ("cos_sin width", dict(cos_sin_cache=np.zeros((8, 32), np.float32))),
    ("cos_sin float16", dict(cos_sin_cache=np.zeros((8, 64), np.float16))),
    ("int64 positions", dict(positions=np.zeros(3, np.int64))),
    ("cache heads", dict(k_cache=np.zeros((2, 16, 4, 64), np.float16))),
    ("dtype mismatch", dict(v=np.zeros((3, 2, 64), np.float32))),
    ("strided head_dim", dict(q=np.zeros((3, 4, 128), np.float16)[:, :, ::2])),
])
def test_rotary_rejects_unsupported(case, overrides):
    with pytest.raises(UnsupportedKernelShape):
        _call(**overrides)
