"""fp8 e4m3 KV caches (kv_cache_dtype "fp8") on the CUDA kernels: cuda/fp8.cuh's encode / decode
through the production kernels, bit for bit against numpy_ops.to_fp8_e4m3_bits /
from_fp8_e4m3_bits; rotary_cache_write_*_kv_fp8 against numpy_ops' write into the same uint8
cache; decode (split-K too) and prefill attention *_kv_fp8 against numpy_ops' attention over
the same caches, and bit for bit against the same kernel family over the exactly widened cache.

NaN-poisoned pools are NaN codes (0x7F) in every slot no request owns: a kernel that reads past
a context, or writes a padding token's slot, shows up as NaN / a changed byte.
"""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import (ATTENTION_TOL, BACKEND, DTYPES, ROTARY_TOL, PagedKV,
                                 as_kernel_dtype, assert_close, kernel_module, result_f32,
                                 to_device, to_host)
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels.attention import (DecodeSplitPlan, decode_tc_tiling,
                                                decode_tiling, paged_decode_attention,
                                                paged_prefill_attention, prefill_smem_bytes)
from pagedrun.runtime.kernels.cache_ops import rotary_embedding_and_cache_write
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

encode = numpy_ops.to_fp8_e4m3_bits
decode = numpy_ops.from_fp8_e4m3_bits
NAN_CODE = 0x7F
BLOCK_SIZE = 16


def _rotary(dt, q, k, v, positions, cos_sin, k_cache, v_cache, slots):
    """The kernel on device copies; returns host (q_rot, k_rot, k_cache, v_cache)."""
    k_dev, v_dev = to_device(k_cache), to_device(v_cache)
    q_rot, k_rot = rotary_embedding_and_cache_write(
        kernel_module("rotary_cache_write.cu"), to_device(q), to_device(k), to_device(v),
        to_device(positions), to_device(cos_sin), k_dev, v_dev, to_device(slots))
    return q_rot, k_rot, to_host(k_dev), to_host(v_dev)


# ------------------------------------------------------------------------ encode / decode

def encode_probe_values(rng) -> np.ndarray:
    """float32 values covering every rounding case of e4m3: all 2^16 high halves (sign,
    exponent, 7 mantissa bits) with the low half 0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF -- so
    every e4m3 tie (normal: low 20 bits 0x80000; subnormal: odd multiples of 2^-10), a float32
    ulp either side, +-0, float32 subnormals, the saturation edge (448, 464, 480, ...),
    infinities and NaNs --, then random bit patterns and normals at scales 2^-14..2^11."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    grid = (high[:, None] | lows[None, :]).ravel()
    bits = rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    scaled = (rng.standard_normal(1 << 16) * 2.0 ** rng.integers(-14, 12, 1 << 16))
    return np.concatenate([grid.view(np.float32), bits.view(np.float32),
                           scaled.astype(np.float32)])


def test_encode_matches_numpy_bit_for_bit(rng):
    """rotary_cache_write_f32_kv_fp8 stores v as it is: its cache bytes are fp8_e4m3_from_f32
    of every value, which must be numpy's encoding bit for bit (RNE, ties to even, saturation
    to +-448, NaN -> 0x7F with its sign, -0 and underflow keep the sign)."""
    values = encode_probe_values(rng)
    num_kv_heads, head_dim = 4, 64
    row = num_kv_heads * head_dim
    num_tokens = -(-values.size // row)
    v = np.zeros(num_tokens * row, np.float32)
    v[:values.size] = values
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    q = np.zeros((num_tokens, num_kv_heads, head_dim), np.float32)
    cos_sin = numpy_ops.build_cos_sin_cache(numpy_ops.rope_inv_freq(head_dim, 10000.0), 4)
    _, _, _, v_cache = _rotary("f32", q, q.copy(), v, np.zeros(num_tokens, np.int32), cos_sin,
                               np.zeros(cache_shape, np.uint8), np.zeros(cache_shape, np.uint8),
                               np.arange(num_tokens, dtype=np.int32))
    got = v_cache.reshape(-1)[:values.size]
    with np.errstate(invalid="ignore", over="ignore"):
        want = encode(values)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of {values.size} codes differ, e.g. x="
                           f"{values[bad[0]]!r} (bits {values.view(np.uint32)[bad[0]]:#010x}): "
                           f"kernel {got[bad[0]]:#04x}, numpy {want[bad[0]]:#04x}")
    # The rules spelled out, so a failure names one (the probe grid holds these bit patterns).
    for x, code in ((1.0625, 0x38), (1.1875, 0x3A), (464.0, 0x7E), (2.0 ** 30, 0x7E),
                    (-np.inf, 0xFE), (-0.0, 0x80), (3 * 2.0 ** -10, 0x02), (2.0 ** -10, 0x00)):
        at = np.flatnonzero(values.view(np.uint32) == np.float32(x).view(np.uint32))[0]
        assert got[at] == code, f"{x!r} -> {got[at]:#04x}, want {code:#04x}"


@pytest.mark.parametrize("dt", DTYPES)
def test_decode_all_256_codes_exactly(dt):
    """Decode attention over a one-token context returns that token's V row widened (softmax
    of one key is exactly 1): all 256 codes in one row of head_dim 256 must come back as
    from_fp8_e4m3_bits' values exactly, NaN positions included (f16 / bf16 hold every e4m3
    value too; the sign of 0x80's -0 is lost to the softmax's 0 + p * v, as for any cache).
    Prefill over the same context: the same."""
    codes = np.arange(256, dtype=np.uint8).reshape(1, 1, 1, 256)
    v_cache = np.zeros((2, BLOCK_SIZE, 1, 256), np.uint8)
    v_cache[1, 0] = codes[0, 0]
    k_cache = np.zeros_like(v_cache)  # scores 0: one key, weight 1
    q, _ = as_kernel_dtype(np.ones((1, 1, 256), np.float32), dt)
    tables = np.array([[1, 0]], np.int32)
    lens = np.array([1], np.int32)
    want = decode(codes.reshape(256))
    out = paged_decode_attention(kernel_module("paged_attention_decode.cu"), to_device(q),
                                 to_device(k_cache), to_device(v_cache), to_device(tables),
                                 to_device(lens), 0.0625)
    prefill = paged_prefill_attention(kernel_module("paged_attention_prefill.cu"),
                                      to_device(q), to_device(k_cache), to_device(v_cache),
                                      to_device(tables), to_device(np.array([0, 1], np.int32)),
                                      to_device(lens), 0.0625)
    for what, result in (("decode", out), ("prefill", prefill)):
        got = result_f32(result, dt).reshape(256)
        assert np.array_equal(np.isnan(got), np.isnan(want)), what
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(got[finite], want[finite], err_msg=what)


@pytest.mark.parametrize("dt", ("f16", "bf16"))
@pytest.mark.parametrize("group", (4, 8))
def test_decode_tc_all_256_codes_exactly(dt, group):
    """The tensor-core decode (16-bit q, group 4 / 8) widens V codes in its own way (pairs for
    the mma B fragments, HMUL2 by 2^8 / 2^120): the one-token context must still return
    every code's exact value in every query head, subnormals and NaN positions included."""
    codes = np.arange(256, dtype=np.uint8)
    v_cache = np.full((2, BLOCK_SIZE, 1, 256), NAN_CODE, np.uint8)  # unused slots: NaN
    v_cache[1, 0, 0] = codes
    k_cache = np.full_like(v_cache, NAN_CODE)
    k_cache[1, 0] = 0  # scores 0: one key, weight 1
    q, _ = as_kernel_dtype(np.ones((1, group, 256), np.float32), dt)
    out = paged_decode_attention(kernel_module("paged_attention_decode.cu"), to_device(q),
                                 to_device(k_cache), to_device(v_cache),
                                 to_device(np.array([[1, 0]], np.int32)),
                                 to_device(np.array([1], np.int32)), 0.0625)
    want = decode(codes)
    got = result_f32(out, dt).reshape(group, 256)
    for head in range(group):
        assert np.array_equal(np.isnan(got[head]), np.isnan(want)), head
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(got[head][finite], want[finite], err_msg=f"head {head}")


# ------------------------------------------------------------------------ rotary + cache write

@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 8, 2), (128, 4, 4), (64, 9, 3)])
@pytest.mark.parametrize("num_tokens", (1, 17, 111))
def test_rotary_fp8_cache_matches_numpy(rng, dt, head_dim, num_heads, num_kv_heads, num_tokens):
    """Cache bytes bit for bit: v (no arithmetic) against numpy_ops' write into the same
    uint8 cache; k against the e4m3 encoding of the kernel's own k_out (the rotated k rounded
    to T, which the kernel stores and numpy cannot round the same way for bf16), and k_out
    close to numpy's; f32 / f16 on the harness: k bytes equal numpy's too (the same fp32 math;
    a GPU's contracted FMA may move a k by an ulp). Padding tokens (slot -1) write nothing:
    every other slot keeps its NaN code."""
    qkv32 = rng.standard_normal((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)) * 3
    qkv32[0, -4:] = [500.0, -1000.0, 464.0, 1e6]  # v past 448: saturation on the way in
    with np.errstate(over="ignore"):  # 1e6 is inf in f16: saturated too
        qkv, qkv_ref = as_kernel_dtype(qkv32, dt)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim

    def split(a):
        return (a[:, :q_end].reshape(num_tokens, num_heads, head_dim),
                a[:, q_end:k_end].reshape(num_tokens, num_kv_heads, head_dim),
                a[:, k_end:].reshape(num_tokens, num_kv_heads, head_dim))

    positions = rng.integers(0, 2048, num_tokens).astype(np.int32)
    num_blocks = 10
    slots = rng.permutation(num_blocks * BLOCK_SIZE)[:num_tokens].astype(np.int32)
    padding = rng.random(num_tokens) < 0.2
    padding[0] = False  # the saturating row is written
    slots[padding] = -1
    cos_sin = numpy_ops.build_cos_sin_cache(numpy_ops.rope_inv_freq(head_dim, 10000.0), 2048)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_ref_cache = np.full(shape, NAN_CODE, np.uint8)
    v_ref_cache = k_ref_cache.copy()
    q, k, v = split(qkv)
    q_rot, k_rot, k_cache, v_cache = _rotary(dt, q, k, v, positions, cos_sin,
                                             k_ref_cache.copy(), v_ref_cache.copy(), slots)
    q_exp, k_exp = numpy_ops.rotary_embedding_and_cache_write(
        *split(qkv_ref), positions, cos_sin, k_ref_cache, v_ref_cache, slots)
    assert k_cache.dtype == v_cache.dtype == np.uint8
    assert_close(result_f32(q_rot, dt), q_exp, ROTARY_TOL[dt], f"q_rot {dt}")
    assert_close(result_f32(k_rot, dt), k_exp, ROTARY_TOL[dt], f"k_rot {dt}")
    np.testing.assert_array_equal(v_cache, v_ref_cache)
    # 500, -1000, 464 and 1e6 (inf in f16) saturate to +-448.
    assert v_cache.reshape(-1, num_kv_heads * head_dim)[slots[0], -4:].tolist() == [
        0x7E, 0xFE, 0x7E, 0x7E]
    k_own = np.full(shape, NAN_CODE, np.uint8)
    written = slots >= 0
    k_own.reshape(-1, num_kv_heads, head_dim)[slots[written]] = encode(
        result_f32(k_rot, dt)[written])
    np.testing.assert_array_equal(k_cache, k_own)
    if BACKEND == "sim" and dt != "bf16":
        np.testing.assert_array_equal(k_cache, k_ref_cache)


def test_rotary_refuses_mismatched_caches():
    q = np.zeros((2, 4, 64), np.float16)
    kv = np.zeros((2, 2, 64), np.float16)
    args = (q, kv, kv, np.zeros(2, np.int32), np.zeros((4, 64), np.float32))
    module = kernel_module("rotary_cache_write.cu")
    for k_cache, v_cache in ((np.zeros((2, 16, 2, 64), np.uint8),
                              np.zeros((2, 16, 2, 64), np.float16)),
                             (np.zeros((2, 16, 2, 64), np.int8),) * 2,
                             (np.zeros((2, 16, 2, 64), np.float32),) * 2):
        with pytest.raises(UnsupportedKernelShape):
            rotary_embedding_and_cache_write(module, *args, k_cache, v_cache,
                                             np.zeros(2, np.int32))


# ------------------------------------------------------------------------ attention

FP8_VALUE_SCALE = 2.0


def fp8_pool(rng, context_lens, num_kv_heads, head_dim, block_size):
    """PagedKV with values at scale FP8_VALUE_SCALE (past 1, so the exponent matters), as e4m3
    codes: the NaN-poisoned slots become NaN codes."""
    pool = PagedKV(rng, context_lens, num_kv_heads, head_dim, block_size)
    with np.errstate(invalid="ignore"):
        return (pool, encode(pool.k * FP8_VALUE_SCALE), encode(pool.v * FP8_VALUE_SCALE))


def fp8_attention_tol(dt: str) -> dict:
    """ATTENTION_TOL is set for unit-scale K and V. Here both are FP8_VALUE_SCALE larger: the
    scores' rounding grows with |k| and the output's with |v|, so the absolute bound grows by
    the product (the 16-bit bounds, set by the output rounding, keep their relative part)."""
    tol = ATTENTION_TOL[dt]
    return dict(atol=tol["atol"] * FP8_VALUE_SCALE ** 2, rtol=tol["rtol"])


def widened(cache, dt):
    """The fp8 cache's values as a cache of T (exact: every e4m3 value is an f16 / bf16)."""
    return as_kernel_dtype(decode(cache), dt)[0]


def run_decode_fp8(rng, dt, context_lens, *, num_kv_heads=2, group=3, head_dim=64,
                   block_size=16, split=None, sliding_window=None):
    pool, k8, v8 = fp8_pool(rng, context_lens, num_kv_heads, head_dim, block_size)
    q32 = rng.standard_normal((len(context_lens), num_kv_heads * group, head_dim))
    q, q_ref = as_kernel_dtype(q32.astype(np.float32), dt)
    scale = head_dim ** -0.5
    module = kernel_module("paged_attention_decode.cu")

    def launch(k_cache, v_cache):
        return result_f32(paged_decode_attention(
            module, to_device(q), to_device(k_cache), to_device(v_cache),
            to_device(pool.block_tables), to_device(pool.context_lens), scale, split=split,
            sliding_window=sliding_window), dt)

    got = launch(k8, v8)
    expected = numpy_ops.paged_decode_attention(q_ref, k8, v8, pool.block_tables,
                                                pool.context_lens, scale, sliding_window)
    what = (f"decode fp8 cache, {dt} group {group} head_dim {head_dim} block {block_size} "
            f"contexts {list(context_lens)} split {split} window {sliding_window}")
    assert_close(got, expected, fp8_attention_tol(dt), what)
    # Reads widen exactly: the T cache of the same values gives the same bits.
    np.testing.assert_array_equal(got, launch(widened(k8, dt), widened(v8, dt)), err_msg=what)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("group", (1, 3, 8))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_decode_fp8_matches_numpy(rng, dt, group, head_dim):
    run_decode_fp8(rng, dt, (1, 17, 111, 64), group=group, head_dim=head_dim,
                   num_kv_heads=1 if group == 8 else 2)


@pytest.mark.parametrize("dt", DTYPES)
def test_decode_fp8_split_and_window(rng, dt):
    run_decode_fp8(rng, dt, (1, 17, 111, 64), head_dim=128, split=DecodeSplitPlan(4, 32))
    run_decode_fp8(rng, dt, (1, 17, 111, 300), sliding_window=40,
                   split=DecodeSplitPlan(2, 256) if dt == "f32" else None)
    run_decode_fp8(rng, dt, (5, 33, 70), block_size=32, group=2)


@pytest.mark.parametrize("dt,head_dim", [("f32", 64), ("bf16", 128)])
def test_decode_fp8_pipeline_edges(rng, dt, head_dim):
    # Raw e4m3 bytes through the cp.async stages (7 of 4 KiB for f32 d64, 4 of 8 KiB for
    # bf16 d128): contexts around one tile and past the ring, then 13 splits of 24 tokens.
    tiling = decode_tiling(f"{dt}_kv_fp8", head_dim)
    tile = tiling.tile_tokens
    contexts = (1, 17, tile, tile + 1, (tiling.num_stages + 1) * tile + 9)
    run_decode_fp8(rng, dt, contexts, head_dim=head_dim, group=2, num_kv_heads=1)
    run_decode_fp8(rng, dt, (1, 25, 111, 300), head_dim=head_dim,
                   split=DecodeSplitPlan(13, 24))


@pytest.mark.parametrize("dt", ("f16", "bf16"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_decode_tc_fp8_pipeline_edges(rng, dt, head_dim):
    # The tensor-core kernels' rings of raw e4m3 rows (64 / 32 / 32-token tiles): contexts
    # around one tile and past the ring at group 8, then 13 splits of 24 tokens at group 4,
    # each bit for bit against the same kernel over the widened 16-bit cache.
    tiling = decode_tc_tiling(f"{dt}_kv_fp8", head_dim)
    tile = tiling.tile_tokens
    contexts = (1, 17, tile - 1, tile + 1, (tiling.num_stages + 1) * tile + 9)
    run_decode_fp8(rng, dt, contexts, head_dim=head_dim, group=8, num_kv_heads=1)
    run_decode_fp8(rng, dt, (1, 25, 111, 300), head_dim=head_dim, group=4,
                   split=DecodeSplitPlan(13, 24))
    run_decode_fp8(rng, dt, (1, 17, 111, 300), head_dim=head_dim, group=8, num_kv_heads=1,
                   sliding_window=40, split=DecodeSplitPlan(2, 32))


def run_prefill_fp8(rng, dt, requests, *, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                    sliding_window=None):
    pool, k8, v8 = fp8_pool(rng, [ctx for _, ctx in requests], num_kv_heads, head_dim,
                            block_size)
    qsl = np.concatenate([[0], np.cumsum([qlen for qlen, _ in requests])]).astype(np.int32)
    num_tokens = int(qsl[-1]) + 2  # padding rows
    q32 = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    q, q_ref = as_kernel_dtype(q32, dt)
    scale = head_dim ** -0.5
    module = kernel_module("paged_attention_prefill.cu")

    def launch(k_cache, v_cache):
        return result_f32(paged_prefill_attention(
            module, to_device(q), to_device(k_cache), to_device(v_cache),
            to_device(pool.block_tables), to_device(qsl), to_device(pool.context_lens), scale,
            sliding_window=sliding_window), dt)

    got = launch(k8, v8)
    expected = numpy_ops.paged_prefill_attention(q_ref, k8, v8, pool.block_tables, qsl,
                                                 pool.context_lens, scale, sliding_window)
    what = (f"prefill fp8 cache, {dt} group {group} head_dim {head_dim} block {block_size} "
            f"requests {list(requests)} window {sliding_window}")
    assert_close(got, expected, fp8_attention_tol(dt), what)
    np.testing.assert_array_equal(got, launch(widened(k8, dt), widened(v8, dt)), err_msg=what)


# (query_len, context_len): one token, a fresh 17-token prompt, a 111-token chunk behind a
# 20-token cached prefix (two 64-row tiles), a chunk continuing a prefill, a decode row.
PREFILL_MIX = ((1, 1), (17, 17), (111, 131), (5, 70), (1, 40))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("group", (1, 3))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_prefill_fp8_matches_numpy(rng, dt, group, head_dim):
    run_prefill_fp8(rng, dt, PREFILL_MIX, group=group, head_dim=head_dim)


@pytest.mark.parametrize("dt", DTYPES)
def test_prefill_fp8_window_and_block_size(rng, dt):
    run_prefill_fp8(rng, dt, ((30, 100), (1, 17)), sliding_window=24, head_dim=128)
    run_prefill_fp8(rng, dt, ((35, 35), (7, 63)), block_size=32, group=1)


def test_attention_refuses_mismatched_caches():
    q = np.zeros((1, 2, 64), np.float32)
    cache = np.zeros((2, 16, 1, 64), np.uint8)
    tables, lens = np.zeros((1, 2), np.int32), np.ones(1, np.int32)
    module = kernel_module("paged_attention_decode.cu")
    with pytest.raises(UnsupportedKernelShape, match="dtypes differ"):
        paged_decode_attention(module, q, cache, cache.view(np.int8), tables, lens, 0.1)
    with pytest.raises(UnsupportedKernelShape, match="neither"):
        paged_decode_attention(module, q, cache.astype(np.float16), cache.astype(np.float16),
                               tables, lens, 0.1)


def test_prefill_smem_of_fp8_kernels():
    """An fp8 cache's tiles are widened to T in shared memory: T's bytes (kernel_report reads
    the name's dtype part, "f32_kv_fp8")."""
    for dt in DTYPES:
        for head_dim in (64, 128, 256):
            assert prefill_smem_bytes(f"{dt}_kv_fp8", head_dim) == prefill_smem_bytes(dt, head_dim)
