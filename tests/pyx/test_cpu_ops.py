"""pagedrun.pyx.cpu_ops (the bf16 cpu backend's norms, activations, rotary + cache write and
decode attention in C++) against runtime/backends/numpy_ops.py, the float32 reference, on every
path this CPU runs (AVX512F, AVX2 + FMA and the portable one, forced): fresh random inputs at
awkward sizes (tails shorter than one 8- or 16-lane vector, head sizes without a
register-resident decode kernel, more query heads per kv head than one decode pass takes),
strided q/k/v views of a fused qkv row, random non-contiguous block tables, partial last
blocks, unused cache slots poisoned with NaN, sliding windows; and the same ValueErrors. The
cache ops run on float32 caches, bf16 ones (uint16 bits, kv_cache_dtype "bfloat16") and fp8
ones (uint8 e4m3 bits, kv_cache_dtype "fp8"): a write is to_bf16_bits / to_fp8_e4m3_bits of
what the op computed, bit for bit, and a read is exact, so decode attention over a bf16 or fp8
cache equals (bit for bit) the same op over its float32 widening. "auto" follows set_isa_cap.

Tolerance (one for every op, float32 both sides): |got - ref| <= RTOL * |ref| + ATOL * magnitude,
magnitude = the largest |value| of the reference output. The two sides differ only in float32
rounding: summation order (16-lane partial sums and FMA against numpy's pairwise sums and BLAS),
and exp (a polynomial with relative error < 2e-7 against numpy's). Each is a few units of
float32 roundoff (u = 6e-8) times the terms' magnitudes, measured <= 1e-6 relative here;
1e-5 leaves 10x margin and stays far below any real bug (one dropped or extra token of a 512-token
context moves an attention output by ~1e-3 of its magnitude; a wrong head or position by O(1)).
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedrun.pyx import cpu_ops
from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.backends.cpu_bf16_backend import CpuBf16Backend
from pagedrun.runtime.weights import from_bf16_bits, to_bf16_bits

PATHS = list(cpu_ops.available_paths())  # avx512, avx2 (where the CPU has them) and portable
# The cache element: float32, bf16 bits in uint16, fp8 e4m3 bits in uint8.
KV_DTYPES = ["float32", "bfloat16", "fp8"]
RTOL = 1e-5
ATOL = 1e-5  # times the reference output's largest magnitude
EPS = 1e-5


def assert_close(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    ref64 = ref.astype(np.float64)
    magnitude = float(np.max(np.abs(ref64))) if ref.size else 0.0
    err = np.abs(got.astype(np.float64) - ref64)
    bound = RTOL * np.abs(ref64) + ATOL * magnitude
    assert np.all(err <= bound), f"max err {err.max():.3g}, max err/bound {np.max(err / bound):.3g}"


@pytest.fixture
def rng():
    return np.random.default_rng(20261202)


def strided_rows(rng, rows, width):
    """[rows, width] float32 view with a row stride wider than its width (a slice of a wider
    array, like q/k/v of the qkv GEMM output)."""
    wide = rng.standard_normal((rows, width + 7)).astype(np.float32)
    return wide[:, 3:3 + width]


# --------------------------------------------------------------------------------- norms, MLP

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 17, 111])
@pytest.mark.parametrize("hidden", [576, 100, 7])  # 100, 7: 4 / 7 lanes past the last vector
def test_norms_match_numpy(rng, path, rows, hidden):
    x = strided_rows(rng, rows, hidden) * 3
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    assert_close(cpu_ops.rms_norm(x, weight, EPS, path=path), numpy_ops.rms_norm(x, weight, EPS))
    out, new_residual = cpu_ops.fused_add_rms_norm(x, residual, weight, EPS, path=path)
    ref_out, ref_residual = numpy_ops.fused_add_rms_norm(x, residual, weight, EPS)
    assert_close(out, ref_out)
    np.testing.assert_array_equal(new_residual, ref_residual)  # one float32 add: exact


def test_norm_shapes_dtypes_and_errors(rng):
    x = rng.standard_normal((2, 5, 64)).astype(np.float16)  # 3-D, float16: numpy's policy
    weight = rng.standard_normal(64).astype(np.float32)
    got = cpu_ops.rms_norm(x, weight, EPS)
    ref = numpy_ops.rms_norm(x, weight, EPS)
    assert got.dtype == np.float16 and got.shape == ref.shape
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=1e-3,
                               atol=1e-3)
    out, res = cpu_ops.fused_add_rms_norm(x, x, weight, EPS)
    assert out.dtype == np.float16 and res.dtype == np.float32
    assert cpu_ops.rms_norm(np.zeros((0, 64), np.float32), weight, EPS).shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rms_norm(x, weight[:10], EPS)
    with pytest.raises(ValueError, match="differ"):
        cpu_ops.fused_add_rms_norm(x, x[:1], weight, EPS)
    with pytest.raises(ValueError, match="path must be"):
        cpu_ops.rms_norm(x, weight, EPS, path="avx9")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 17, 111])
@pytest.mark.parametrize("inter", [1536, 37, 5])
def test_act_and_mul_match_numpy(rng, path, rows, inter):
    gate_up = strided_rows(rng, rows, 2 * inter) * 4
    gate_up[0, :4] = [-200.0, 200.0, -90.0, 90.0]  # exp over/underflow: the limits 0 and g
    for ours, ref in ((cpu_ops.silu_and_mul, numpy_ops.silu_and_mul),
                      (cpu_ops.gelu_tanh_and_mul, numpy_ops.gelu_tanh_and_mul)):
        with np.errstate(over="ignore"):
            expected = ref(gate_up)
        assert_close(ours(gate_up, path=path), expected)


@pytest.mark.parametrize("path", PATHS)
def test_act_and_mul_special_values(path):
    """exp's contract through both activations: NaN stays NaN, infinities and huge values reach
    the limits (e^-inf and anything under e^-104 -> 0, anything over e^89 -> inf), values near
    the float32 range's ends and subnormals stay accurate -- the same results as numpy's."""
    gate = np.array([np.nan, np.inf, -np.inf, 1e20, -1e20, 200.0, -200.0, 104.0, -104.0, 88.7,
                     -88.7, 87.0, -87.0, 30.0, -30.0, 1e-30, -1e-30, 1e-45, 0.0, -0.0, 0.5,
                     -0.5, 3.0, -3.0], np.float32)
    up = np.linspace(0.5, 2.0, gate.size, dtype=np.float32)
    gate_up = np.concatenate([gate, up])[None, :]
    for ours, ref in ((cpu_ops.silu_and_mul, numpy_ops.silu_and_mul),
                      (cpu_ops.gelu_tanh_and_mul, numpy_ops.gelu_tanh_and_mul)):
        with np.errstate(over="ignore", invalid="ignore"):
            expected = ref(gate_up)
        got = ours(gate_up, path=path)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        finite = np.isfinite(expected)
        np.testing.assert_array_equal(got[~finite & ~np.isnan(expected)],
                                      expected[~finite & ~np.isnan(expected)])  # +-inf
        # Elementwise: each value against its own scale |g * up| (act(g) <= |g|), as one
        # largest magnitude (1e20 here) would swamp the small ones.
        scale = np.abs(gate.astype(np.float64) * up)[None, :][finite]
        err = np.abs(got[finite].astype(np.float64) - expected[finite])
        assert np.all(err <= RTOL * np.abs(expected[finite].astype(np.float64)) + ATOL * scale)


def test_act_and_mul_errors():
    for ours, ref in ((cpu_ops.silu_and_mul, numpy_ops.silu_and_mul),
                      (cpu_ops.gelu_tanh_and_mul, numpy_ops.gelu_tanh_and_mul)):
        odd = np.zeros((3, 7), np.float32)
        with pytest.raises(ValueError) as expected:
            ref(odd)
        with pytest.raises(ValueError, match=str(expected.value)):
            ours(odd)


# --------------------------------------------------------------------------------- rotary

def qkv_views(rng, num_tokens, num_heads, num_kv_heads, head_dim):
    """q, k, v as llama.py makes them: reshaped column slices of one [T, (H + 2 KV) D] row."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = rng.standard_normal((num_tokens, q_size + 2 * kv_size)).astype(np.float32)
    q = qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].reshape(num_tokens, num_kv_heads, head_dim)
    assert num_tokens == 1 or not (q.flags.c_contiguous or k.flags.c_contiguous)
    return q, k, v


def stored(values, kv):
    """float32 values as a cache of dtype kv holds them (to_bf16_bits / to_fp8_e4m3_bits)."""
    if kv == "bfloat16":
        return to_bf16_bits(values)
    return numpy_ops.to_fp8_e4m3_bits(values) if kv == "fp8" else np.asarray(values)


def nan_cache(num_blocks, block_size, num_kv_heads, head_dim, kv="float32"):
    return stored(np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32),
                  kv)


def widened(cache):
    """A cache's values as float32 (bf16 / fp8 bits widened exactly)."""
    if cache.dtype == np.uint8:
        return numpy_ops.from_fp8_e4m3_bits(cache)
    return from_bf16_bits(cache) if cache.dtype == np.uint16 else cache


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_tokens", [1, 17, 111])
@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size",
                         [(64, 3, 3, 16), (128, 2, 4, 32), (64, 4, 1, 32), (80, 1, 3, 16),
                          (32, 1, 8, 16), (36, 2, 2, 16)])  # 36: 2- and 4-lane tails
def test_rotary_cache_write_matches_numpy(rng, path, num_tokens, head_dim, num_kv_heads, group,
                                          block_size, kv):
    num_heads = num_kv_heads * group
    q, k, v = qkv_views(rng, num_tokens, num_heads, num_kv_heads, head_dim)
    max_position = 300
    cos_sin = numpy_ops.build_cos_sin_cache(numpy_ops.rope_inv_freq(head_dim, 10000.0),
                                            max_position)
    positions = rng.integers(0, max_position, num_tokens).astype(np.int32)
    num_blocks = num_tokens // block_size + 3
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    slots[rng.random(num_tokens) < 0.2] = -1  # padding tokens: rotated, never written
    k_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, kv)
    v_cache = k_cache.copy()
    ref_k_cache, ref_v_cache = k_cache.copy(), v_cache.copy()
    q_rot, k_rot = cpu_ops.rotary_embedding_and_cache_write(
        q, k, v, positions, cos_sin, k_cache, v_cache, slots, path=path)
    ref_q, ref_k = numpy_ops.rotary_embedding_and_cache_write(
        q, k, v, positions, cos_sin, ref_k_cache, ref_v_cache, slots)
    assert_close(q_rot, ref_q)
    assert_close(k_rot, ref_k)
    # Written slots hold k_rot and v exactly as the op returned them (bf16 / fp8: to_bf16_bits /
    # to_fp8_e4m3_bits of them, bit for bit); the rest stays NaN.
    assert k_cache.dtype == v_cache.dtype == ref_k_cache.dtype
    np.testing.assert_array_equal(np.isnan(widened(k_cache)), np.isnan(widened(ref_k_cache)))
    np.testing.assert_array_equal(v_cache, ref_v_cache)  # a copy / one rounding: bit for bit
    valid = slots >= 0
    written = k_cache.reshape(-1, num_kv_heads, head_dim)[slots[valid]]
    np.testing.assert_array_equal(written, stored(k_rot[valid], kv))


ROTARY_ERRORS = {
    "position past the table": dict(positions=[0, 300]),
    "negative position": dict(positions=[-1, 0]),
    "slot past the cache": dict(slots=[4 * 16, 0]),
    "duplicate slot": dict(slots=[5, 5]),
    "positions shape": dict(positions=[0, 1, 2]),
    "v shape": dict(v_shape=(2, 3, 32)),
    "cos_sin width": dict(width=32),
}


@pytest.mark.parametrize("case", list(ROTARY_ERRORS))
def test_rotary_errors_match_numpy(rng, case):
    spec = ROTARY_ERRORS[case]
    head_dim = 64
    q = rng.standard_normal((2, 3, head_dim)).astype(np.float32)
    k = rng.standard_normal((2, 3, head_dim)).astype(np.float32)
    v = rng.standard_normal(spec.get("v_shape", (2, 3, head_dim))).astype(np.float32)
    cos_sin = np.zeros((300, spec.get("width", head_dim)), np.float32)
    positions = np.array(spec.get("positions", [0, 1]), np.int32)
    slots = np.array(spec.get("slots", [0, 1]), np.int32)
    caches = [nan_cache(4, 16, 3, head_dim) for _ in range(4)]
    with pytest.raises(ValueError) as expected:
        numpy_ops.rotary_embedding_and_cache_write(q, k, v, positions, cos_sin, caches[0],
                                                   caches[1], slots)
    with pytest.raises(ValueError) as got:
        cpu_ops.rotary_embedding_and_cache_write(q, k, v, positions, cos_sin, caches[2],
                                                 caches[3], slots)
    assert str(got.value) == str(expected.value)
    assert np.isnan(caches[2]).all() and np.isnan(caches[3]).all()  # refused before any write


# --------------------------------------------------------------------------------- attention

def paged_context(rng, context_lens, block_size, num_kv_heads, head_dim, max_blocks,
                  kv="float32"):
    """K/V caches with each sequence's blocks at random, non-contiguous ids; every slot no
    sequence owns (padding table entries, the tail of partial last blocks) is NaN. kv
    "bfloat16" / "fp8": the same caches rounded to bf16 / fp8 e4m3 bits."""
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 5
    k_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = k_cache.copy()
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(context_lens), max_blocks), np.int32)
    tables[:, ::2] = perm[-1]  # padding entries: a NaN block (never dereferenced)
    used = 0
    for i, (n, nb) in enumerate(zip(context_lens, blocks_needed)):
        ids = perm[used:used + nb]
        used += nb
        tables[i, :nb] = ids
        for t in range(n):
            k_cache[ids[t // block_size], t % block_size] = rng.standard_normal(
                (num_kv_heads, head_dim))
            v_cache[ids[t // block_size], t % block_size] = rng.standard_normal(
                (num_kv_heads, head_dim))
    return stored(k_cache, kv), stored(v_cache, kv), tables


ATTENTION_CASES = [  # head_dim, num_kv_heads, group, block_size, context_lens
    (64, 3, 3, 16, [1, 17, 64, 200, 33]),     # the default model's heads
    (128, 2, 4, 32, [31, 1, 96, 129]),
    (64, 4, 1, 32, [5, 250]),
    (32, 1, 8, 16, [47, 16]),
    (128, 1, 7, 16, [70]),                    # group 7: passes of 3 + 3 + 1 heads
    (80, 2, 3, 16, [19, 1, 50]),              # no register-resident instantiation: masked path
    (36, 2, 2, 16, [23, 1, 40]),              # 36: not a multiple of 8 lanes either
    (32, 1, 10, 16, [47, 16, 3]),             # group 10: passes of 8 + 2 heads
    (128, 2, 2, 8, [9, 23, 8]),               # blocks of 8: every run 8 tokens or fewer
    # 7,806 positions x 9 heads x 64 x 2 = 9.0 M multiply-adds: past DECODE_SPLIT_MIN_MACS
    # (cpu_ops_kernels.h), so the sequences split over two threads (not with a short window).
    (64, 3, 3, 16, [700, 1, 650, 900, 45, 800, 333, 17, 1000, 760, 600, 1500, 500]),
]


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
@pytest.mark.parametrize("sliding_window", [None, 1, 20, 4096])
def test_decode_attention_matches_numpy(rng, path, case, sliding_window, kv):
    head_dim, num_kv_heads, group, block_size, context_lens = ATTENTION_CASES[case]
    num_heads = num_kv_heads * group
    max_blocks = max(-(-n // block_size) for n in context_lens) + 1
    k_cache, v_cache, tables = paged_context(rng, context_lens, block_size, num_kv_heads,
                                             head_dim, max_blocks, kv)
    # q: a strided view, as the rotary op's input would be (its output is contiguous).
    q, _, _ = qkv_views(rng, len(context_lens), num_heads, num_kv_heads, head_dim)
    lens = np.array(context_lens, np.int32)
    scale = head_dim ** -0.5
    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                         sliding_window, path=path)
    ref = numpy_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                           sliding_window)
    assert not np.isnan(got).any()
    assert_close(got, ref)
    if kv != "float32":  # reads widen exactly: the float32 cache of the same values, bit for bit
        np.testing.assert_array_equal(got, cpu_ops.paged_decode_attention(
            q, widened(k_cache), widened(v_cache), tables, lens, scale, sliding_window,
            path=path))


def test_decode_attention_full_table_and_empty_window(rng):
    """One sequence at the table's full capacity; a window of 0 sees nothing (NaN, as numpy)."""
    k_cache, v_cache, tables = paged_context(rng, [64], 16, 2, 64, max_blocks=4)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    lens = np.array([64], np.int32)
    for path in PATHS:
        assert_close(cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                                    path=path),
                     numpy_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125))
        with np.errstate(invalid="ignore"):
            ref = numpy_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 0)
        got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 0,
                                             path=path)
        assert np.isnan(ref).all() and np.isnan(got).all()


ATTENTION_ERRORS = {
    "context_len 0": dict(lens=[3, 0]),
    "past the table": dict(lens=[3, 4 * 16 + 1]),
    "negative block id": dict(table_entry=-1),
    "block id past the pool": dict(table_entry=8),
    "rows differ": dict(lens=[3, 4, 5]),
    "heads not a multiple": dict(num_heads=4),
    "head_dim differs": dict(q_head_dim=32),
    "caches differ": dict(v_blocks=7),
}


@pytest.mark.parametrize("case", list(ATTENTION_ERRORS))
def test_decode_attention_errors_match_numpy(rng, case):
    spec = ATTENTION_ERRORS[case]
    k_cache = rng.standard_normal((8, 16, 3, 64)).astype(np.float32)
    v_cache = rng.standard_normal((spec.get("v_blocks", 8), 16, 3, 64)).astype(np.float32)
    q = rng.standard_normal((2, spec.get("num_heads", 9), spec.get("q_head_dim", 64))).astype(
        np.float32)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
    tables[1, 0] = spec.get("table_entry", tables[1, 0])
    lens = np.array(spec.get("lens", [3, 17]), np.int32)
    with pytest.raises(ValueError) as expected:
        numpy_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(ValueError) as got:
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert str(got.value) == str(expected.value)


def test_caches_must_be_float32_or_bf16(rng):
    q = rng.standard_normal((1, 3, 64)).astype(np.float32)
    cache = np.zeros((2, 16, 3, 64), np.float16)
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.paged_decode_attention(q, cache, cache, np.zeros((1, 2), np.int32),
                                       np.array([1], np.int32), 0.125)
    with pytest.raises(ValueError, match="dtypes differ"):  # k and v of one dtype
        cpu_ops.paged_decode_attention(q, cache.astype(np.uint16), cache.astype(np.float32),
                                       np.zeros((1, 2), np.int32), np.array([1], np.int32), 0.125)


# --------------------------------------------------------------------------------- bf16 KV cache

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim", [64, 80, 36])  # 80, 36: a 16-lane tail, a 4-element tail
def test_bf16_cache_write_rounds_like_to_bf16_bits(rng, path, head_dim):
    """v goes into the cache as written: random float32 bit patterns (NaNs with payloads,
    infinities, subnormals, both zeros) plus the hard cases -- ties to even both ways, a NaN
    whose payload would carry into the exponent, values that overflow to inf -- land as
    weights.to_bf16_bits' bits exactly, on both paths."""
    num_tokens, num_kv_heads = 9, 2
    bits = rng.integers(0, 2**32, (num_tokens, num_kv_heads, head_dim), dtype=np.uint64)
    bits = bits.astype(np.uint32)
    hard = [0x3F808000, 0x3F818000, 0xBF808000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000,
            0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x80008000,
            0x00000000, 0x80000000, 0x3F7FFFFF]
    bits[0, 0, :len(hard)] = hard
    v = bits.view(np.float32)
    k = rng.standard_normal(v.shape).astype(np.float32)
    q = rng.standard_normal((num_tokens, 2 * num_kv_heads, head_dim)).astype(np.float32)
    cos_sin = numpy_ops.build_cos_sin_cache(numpy_ops.rope_inv_freq(head_dim, 10000.0), 64)
    positions = rng.integers(0, 64, num_tokens).astype(np.int32)
    slots = rng.permutation(4 * 16)[:num_tokens].astype(np.int32)
    k_cache = nan_cache(4, 16, num_kv_heads, head_dim, "bfloat16")
    v_cache = k_cache.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        _, k_rot = cpu_ops.rotary_embedding_and_cache_write(q, k, v, positions, cos_sin, k_cache,
                                                            v_cache, slots, path=path)
    written = v_cache.reshape(-1, num_kv_heads, head_dim)[slots]
    np.testing.assert_array_equal(written, to_bf16_bits(v))
    np.testing.assert_array_equal(k_cache.reshape(-1, num_kv_heads, head_dim)[slots],
                                  to_bf16_bits(k_rot))


def test_numpy_ops_on_bf16_caches(rng):
    """The reference on a bf16 cache: decode and prefill attention gather and widen the blocks
    they read (the same result as over the float32 widening, bit for bit); copy_blocks and
    swap_blocks move uint16 blocks; a swap between pools of different dtypes is refused."""
    k_cache, v_cache, tables = paged_context(rng, [23, 40], 16, 2, 64, max_blocks=4,
                                             kv="bfloat16")
    wide_k, wide_v = widened(k_cache), widened(v_cache)
    lens = np.array([23, 40], np.int32)
    q = rng.standard_normal((2, 6, 64)).astype(np.float32)
    np.testing.assert_array_equal(
        numpy_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 16),
        numpy_ops.paged_decode_attention(q, wide_k, wide_v, tables, lens, 0.125, 16))
    qsl = np.array([0, 5, 12], np.int32)
    q_prefill = rng.standard_normal((12, 6, 64)).astype(np.float32)
    np.testing.assert_array_equal(
        numpy_ops.paged_prefill_attention(q_prefill, k_cache, v_cache, tables, qsl, lens, 0.125),
        numpy_ops.paged_prefill_attention(q_prefill, wide_k, wide_v, tables, qsl, lens, 0.125))
    src, dst = int(tables[0, 0]), int(tables[0, 3])
    numpy_ops.copy_blocks([k_cache], [v_cache], np.array([[src, dst]], np.int32))
    np.testing.assert_array_equal(k_cache[dst], k_cache[src])
    assert k_cache.dtype == np.uint16
    host = np.zeros((3,) + k_cache.shape[1:], np.uint16)
    numpy_ops.swap_blocks([k_cache], [host], np.array([[src, 2]], np.int32))
    np.testing.assert_array_equal(host[2], k_cache[src])
    with pytest.raises(ValueError, match="dtypes differ"):
        numpy_ops.swap_blocks([k_cache], [host.astype(np.float32)], np.array([[src, 2]]))


# --------------------------------------------------------------------------------- paths

def test_paths_and_isa_cap(rng):
    """available_paths lists what the CPU runs, fastest first; a path the CPU lacks is refused;
    set_isa_cap limits what "auto" picks (auto_path names it, and "auto" computes exactly what
    that forced path does) and leaves forced paths alone."""
    assert PATHS[-1] == "portable" and set(PATHS) <= set(cpu_ops.PATHS)
    assert ("avx2" in PATHS) == cpu_ops.has_avx2()
    assert ("avx512" in PATHS) == cpu_ops.has_avx512f()
    assert PATHS == [p for p in ("avx512", "avx2", "portable") if p in PATHS]
    for missing in set(cpu_ops.PATHS) - set(PATHS):
        with pytest.raises(RuntimeError, match=missing):
            cpu_ops.silu_and_mul(np.zeros((1, 16), np.float32), path=missing)
    gate_up = strided_rows(rng, 3, 2 * 37) * 4
    forced = {p: cpu_ops.silu_and_mul(gate_up, path=p) for p in PATHS}
    expected = {"auto": PATHS[0], "amx": PATHS[0], "avx512": PATHS[0],
                "avx2": "avx2" if "avx2" in PATHS else "portable", "portable": "portable"}
    previous = cpu_ops.set_isa_cap("auto")
    try:
        for cap, path in expected.items():
            assert cpu_ops.set_isa_cap(cap) in expected
            assert cpu_ops.auto_path() == path
            assert cpu_ops.path_code() == cpu_ops.path_code(path)
            np.testing.assert_array_equal(cpu_ops.silu_and_mul(gate_up), forced[path])
            for p in PATHS:  # forced paths ignore the cap
                np.testing.assert_array_equal(cpu_ops.silu_and_mul(gate_up, path=p), forced[p])
        with pytest.raises(ValueError, match="isa cap"):
            cpu_ops.set_isa_cap("avx9")
        assert cpu_ops.auto_path() == "portable"  # a refused cap changes nothing
    finally:
        cpu_ops.set_isa_cap(previous)
    assert cpu_ops.auto_path() == expected[previous]


# --------------------------------------------------------------------------------- wiring

def test_bf16_backend_runs_cpu_ops():
    backend = CpuBf16Backend()
    assert backend.kv_dtype == np.uint16  # kv_cache_dtype "auto": bf16 bits
    assert CpuBf16Backend(kv_cache_dtype="float32").kv_dtype == np.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CpuBf16Backend(kv_cache_dtype="float16")
    assert backend.paged_decode_attention is cpu_ops.paged_decode_attention
    assert backend.fused_add_rms_norm is cpu_ops.fused_add_rms_norm
    portable = CpuBf16Backend(path="portable")
    assert portable.silu_and_mul.keywords == {"path": "portable"}
