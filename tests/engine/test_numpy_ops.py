"""numpy backend ops against independent float64 references.

The references are written differently from the ops: K/V gathered token by token through the
block table, explicit loops over heads and query tokens, dense causal attention on the
concatenated context. Every cache slot and pool block a step must not read holds NaN.
Inputs are fresh random each run; the seed entropy is printed (shown by pytest on failure) and
can be pinned with REPRODUCE_ENTROPY to replay a failing run.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pagedrun.runtime.backends import numpy_ops as ops

REPRODUCE_ENTROPY: int | None = None  # set to a printed entropy to replay a failure

# Tolerances against the float64 reference, per activation dtype.
TOL = {
    np.float32: dict(rtol=1e-4, atol=2e-5),
    np.float16: dict(rtol=1e-2, atol=4e-3),
}


@pytest.fixture
def rng() -> np.random.Generator:
    seq = np.random.SeedSequence(REPRODUCE_ENTROPY)
    print(f"numpy SeedSequence entropy={seq.entropy}")
    return np.random.default_rng(seq)


# ------------------------------------------------------------------------------ scenario helpers

def make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim, dtype=np.float32):
    """K and V pools, every slot NaN (nothing written yet)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return np.full(shape, np.nan, dtype=dtype), np.full(shape, np.nan, dtype=dtype)


def allocate_block_tables(rng, context_lens, block_size, max_blocks, num_blocks):
    """Random non-contiguous blocks from a random permutation of the pool; padding 0."""
    needed = [-(-c // block_size) for c in context_lens]
    assert sum(needed) <= num_blocks
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(context_lens), max_blocks), dtype=np.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used:used + n]
        used += n
    return tables


def slot_of(block_table_row, pos, block_size):
    return int(block_table_row[pos // block_size]) * block_size + pos % block_size


def fill_context(rng, k_cache, v_cache, block_tables, context_lens):
    """Write random K/V into the first context_len slots of each request, token by token."""
    block_size = k_cache.shape[1]
    for row, ctx in zip(block_tables, context_lens):
        for pos in range(ctx):
            s = slot_of(row, pos, block_size)
            k_cache[s // block_size, s % block_size] = rng.standard_normal(k_cache.shape[2:])
            v_cache[s // block_size, s % block_size] = rng.standard_normal(v_cache.shape[2:])


def ref_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale):
    """Float64, token by token gather; explicit loops over requests, query tokens and heads."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, head_dim))
    for i in range(len(context_lens)):
        ctx = int(context_lens[i])
        keys = np.stack([k_cache[divmod(slot_of(block_tables[i], p, block_size), block_size)]
                         for p in range(ctx)]).astype(np.float64)
        values = np.stack([v_cache[divmod(slot_of(block_tables[i], p, block_size), block_size)]
                           for p in range(ctx)]).astype(np.float64)
        start, stop = int(query_start_loc[i]), int(query_start_loc[i + 1])
        for t in range(start, stop):
            pos = ctx - (stop - start) + (t - start)
            for h in range(num_heads):
                kv = h // group
                scores = keys[:pos + 1, kv] @ q[t, h].astype(np.float64) * scale
                w = np.exp(scores - scores.max())
                out[t, h] = (w / w.sum()) @ values[:pos + 1, kv]
    return out


# (block_size, num_heads, num_kv_heads, head_dim): GQA ratios 1, 4, 8; head dims 32, 64, 128.
ATTN_CONFIGS = [
    (8, 4, 4, 64),
    (16, 8, 2, 32),
    (32, 16, 2, 128),
    (16, 32, 4, 64),
]


def make_step(rng, block_size, num_heads, num_kv_heads, head_dim, reqs, max_len, dtype=np.float32,
              num_padding_tokens=0):
    """A prefill/mixed step: reqs = [(context_len, query_len)], random pool/tables, NaN
    elsewhere."""
    context_lens = np.array([c for c, _ in reqs], dtype=np.int32)
    query_lens = np.array([q for _, q in reqs], dtype=np.int32)
    max_blocks = max_len // block_size
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 5  # 5 unused NaN blocks
    k_cache, v_cache = make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = allocate_block_tables(rng, context_lens, block_size, max_blocks, num_blocks)
    fill_context(rng, k_cache, v_cache, tables, context_lens)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + num_padding_tokens
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(dtype)
    return q, k_cache, v_cache, tables, qsl, context_lens


# ------------------------------------------------------------------------------ attention

@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", ATTN_CONFIGS)
def test_prefill_attention_mixed_batch(rng, block_size, num_heads, num_kv_heads, head_dim):
    max_len = 8 * block_size if block_size < 32 else 4 * block_size
    reqs = [
        (1, 1),                         # first token of a one-token prompt
        (17, 17),                       # whole prompt, partial last block
        (max_len, 3),                   # one sequence at max length, chunk at the end
        (block_size * 2, block_size),   # chunk ending exactly on a block boundary
        (min(111, max_len - 1), 23),    # chunk after a cached prefix / earlier chunks
        (40, 1),                        # decode row inside a prefill batch
        (int(rng.integers(2, max_len)), 1),
    ]
    reqs = [(c, min(q, c)) for c, q in reqs]
    q, kc, vc, tables, qsl, ctx = make_step(rng, block_size, num_heads, num_kv_heads, head_dim,
                                            reqs, max_len, num_padding_tokens=3)
    scale = head_dim ** -0.5
    out = ops.paged_prefill_attention(q, kc, vc, tables, qsl, ctx, scale)
    ref = ref_attention(q, kc, vc, tables, qsl, ctx, scale)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **TOL[np.float32])


def test_prefill_attention_long_single_prompt(rng):
    """111-token prompt chunked against a 300-token cached prefix: exercises the query chunking."""
    reqs = [(411, 300)]
    q, kc, vc, tables, qsl, ctx = make_step(rng, 16, 4, 2, 64, reqs, 512)
    out = ops.paged_prefill_attention(q, kc, vc, tables, qsl, ctx, 0.125)
    ref = ref_attention(q, kc, vc, tables, qsl, ctx, 0.125)
    np.testing.assert_allclose(out, ref, **TOL[np.float32])


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", ATTN_CONFIGS)
def test_decode_attention(rng, block_size, num_heads, num_kv_heads, head_dim):
    max_len = 8 * block_size
    lens = [1, block_size - 1, block_size, block_size + 1, max_len, 17,
            *rng.integers(1, max_len + 1, size=5).tolist()]
    reqs = [(c, 1) for c in lens]
    q, kc, vc, tables, qsl, ctx = make_step(rng, block_size, num_heads, num_kv_heads, head_dim,
                                            reqs, max_len)
    scale = head_dim ** -0.5
    out = ops.paged_decode_attention(q, kc, vc, tables, ctx, scale)
    ref = ref_attention(q, kc, vc, tables, qsl, ctx, scale)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **TOL[np.float32])
    # The varlen prefill op on query_len 1 rows is the decode op.
    out_prefill = ops.paged_prefill_attention(q, kc, vc, tables, qsl, ctx, scale)
    np.testing.assert_allclose(out_prefill, out, rtol=1e-6, atol=1e-7)


def test_attention_float16(rng):
    reqs = [(33, 33), (70, 5), (9, 1)]
    q, kc, vc, tables, qsl, ctx = make_step(rng, 16, 8, 2, 64, reqs, 128, dtype=np.float16)
    out = ops.paged_prefill_attention(q, kc, vc, tables, qsl, ctx, 0.125)
    assert out.dtype == np.float16
    ref = ref_attention(q, kc, vc, tables, qsl, ctx, 0.125)
    np.testing.assert_allclose(out.astype(np.float64), ref, **TOL[np.float16])
    dec_rows = qsl[1:] - 1
    dec = ops.paged_decode_attention(q[dec_rows], kc, vc, tables, ctx, 0.125)
    np.testing.assert_allclose(dec.astype(np.float64), ref[dec_rows], **TOL[np.float16])


def test_attention_rejects_bad_shapes(rng):
    q, kc, vc, tables, qsl, ctx = make_step(rng, 8, 6, 4, 16, [(10, 10)], 16)
    with pytest.raises(ValueError, match="multiple"):
        ops.paged_prefill_attention(q, kc, vc, tables, qsl, ctx, 0.25)
    q, kc, vc, tables, qsl, ctx = make_step(rng, 8, 4, 2, 16, [(10, 10)], 16)
    with pytest.raises(ValueError, match="capacity"):
        ops.paged_decode_attention(q[:1], kc, vc, tables, np.array([17], np.int32), 0.25)
    with pytest.raises(ValueError, match="query_len"):
        ops.paged_prefill_attention(q, kc, vc, tables, qsl, np.array([5], np.int32), 0.25)


# ----------------------------------------------------------------------------- rotary + cache write

def ref_rotate(x, pos, cos_sin_cache):
    """Float64, explicit loop over heads and dimension pairs (i, i + d/2)."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    out = np.empty(x.shape)
    for h in range(x.shape[0]):
        for i in range(half):
            c = float(cos_sin_cache[pos, i])
            s = float(cos_sin_cache[pos, half + i])
            a, b = float(x[h, i]), float(x[h, i + half])
            out[h, i] = a * c - b * s
            out[h, i + half] = b * c + a * s
    return out


@pytest.mark.parametrize("num_tokens,block_size,num_heads,num_kv_heads,head_dim,dtype", [
    (1, 16, 4, 4, 64, np.float32),
    (17, 8, 8, 2, 32, np.float32),
    (111, 32, 16, 2, 128, np.float32),
    (19, 16, 8, 1, 64, np.float16),
])
def test_rotary_and_cache_write(rng, num_tokens, block_size, num_heads, num_kv_heads, head_dim,
                                dtype):
    max_position = 2048
    cos_sin = ops.build_cos_sin_cache(ops.rope_inv_freq(head_dim, 10000.0), max_position)
    num_blocks = -(-num_tokens // block_size) + 4
    k_cache, v_cache = make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(dtype)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    positions = rng.integers(0, max_position, size=num_tokens).astype(np.int32)
    slot_mapping = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    padding = rng.random(num_tokens) < 0.2  # padding tokens anywhere in the batch
    slot_mapping[padding] = -1

    q_rot, k_rot = ops.rotary_embedding_and_cache_write(q, k, v, positions, cos_sin, k_cache,
                                                        v_cache, slot_mapping)
    assert q_rot.dtype == dtype and k_rot.dtype == dtype
    tol = TOL[dtype]
    for t in range(num_tokens):
        np.testing.assert_allclose(q_rot[t].astype(np.float64),
                                   ref_rotate(q[t], positions[t], cos_sin), **tol)
        np.testing.assert_allclose(k_rot[t].astype(np.float64),
                                   ref_rotate(k[t], positions[t], cos_sin), **tol)
    written = np.zeros(num_blocks * block_size, dtype=bool)
    for t in range(num_tokens):
        s = int(slot_mapping[t])
        if s < 0:
            continue
        written[s] = True
        np.testing.assert_array_equal(k_cache[s // block_size, s % block_size], k_rot[t])
        np.testing.assert_array_equal(v_cache[s // block_size, s % block_size], v[t])
    flat_k = k_cache.reshape(num_blocks * block_size, -1)
    flat_v = v_cache.reshape(num_blocks * block_size, -1)
    assert np.isnan(flat_k[~written]).all() and np.isnan(flat_v[~written]).all()


def test_rotary_rejects_duplicate_slots(rng):
    k_cache, v_cache = make_pool(rng, 2, 8, 1, 8)
    x = rng.standard_normal((2, 1, 8)).astype(np.float32)
    cos_sin = ops.build_cos_sin_cache(ops.rope_inv_freq(8, 10000.0), 4)
    with pytest.raises(ValueError, match="twice"):
        ops.rotary_embedding_and_cache_write(x, x, x, np.array([0, 1], np.int32), cos_sin,
                                             k_cache, v_cache, np.array([3, 3], np.int32))


def test_build_cos_sin_cache(rng):
    head_dim, max_position = 64, 4096
    inv_freq = ops.rope_inv_freq(head_dim, 500000.0)
    table = ops.build_cos_sin_cache(inv_freq, max_position)
    assert table.shape == (max_position, head_dim) and table.dtype == np.float32
    pos = rng.integers(0, max_position, size=50)
    for p in pos:
        for i in range(head_dim // 2):
            angle = float(p) * float(inv_freq[i])
            # The angle is formed in float32: error up to half an ulp of p * f.
            tol = 2.0 * abs(angle) * 2.0 ** -24 + 1e-7
            assert abs(table[p, i] - math.cos(angle)) <= tol
            assert abs(table[p, head_dim // 2 + i] - math.sin(angle)) <= tol


def test_rope_inv_freq_llama3():
    head_dim, theta = 128, 500000.0
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    got = ops.rope_inv_freq(head_dim, theta, scaling)
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want = f
        elif wavelen > 8192 / 1.0:
            want = f / 8.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 8.0 + smooth * f
        assert abs(got[i] - want) <= 1e-6 * want, i
    linear = ops.rope_inv_freq(head_dim, theta, {"type": "linear", "factor": 4.0})
    np.testing.assert_allclose(linear, ops.rope_inv_freq(head_dim, theta) / 4.0, rtol=1e-7)
    with pytest.raises(NotImplementedError):
        ops.rope_inv_freq(head_dim, theta, {"rope_type": "yarn", "factor": 4.0})


# ------------------------------------------------------------------------------ norms, MLP, GEMM

@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (17, 96), (111, 33)])
def test_rms_norm_and_fused_add(rng, num_tokens, hidden):
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32) * 3
    residual = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    eps = 1e-5

    def ref(rows):
        out = np.empty(rows.shape)
        for t in range(rows.shape[0]):
            row = rows[t].astype(np.float64)
            out[t] = row / math.sqrt(sum(v * v for v in row) / hidden + eps) * weight
        return out

    np.testing.assert_allclose(ops.rms_norm(x, weight, eps), ref(x), **TOL[np.float32])
    out, new_residual = ops.fused_add_rms_norm(x, residual, weight, eps)
    assert new_residual.dtype == np.float32
    np.testing.assert_array_equal(new_residual, x + residual)
    np.testing.assert_allclose(out, ref(x.astype(np.float64) + residual), **TOL[np.float32])
    x16 = x.astype(np.float16)
    out16, res16 = ops.fused_add_rms_norm(x16, residual, weight, eps)
    assert out16.dtype == np.float16 and res16.dtype == np.float32
    np.testing.assert_allclose(out16.astype(np.float64),
                               ref(x16.astype(np.float64) + residual), **TOL[np.float16])


@pytest.mark.parametrize("num_tokens,intermediate", [(1, 8), (17, 45), (111, 128)])
def test_silu_and_mul(rng, num_tokens, intermediate):
    gate_up = (rng.standard_normal((num_tokens, 2 * intermediate)) * 4).astype(np.float32)
    gate_up[0, 0] = -200.0  # exp overflow region: silu -> -0
    gate = gate_up[:, :intermediate].astype(np.float64)
    up = gate_up[:, intermediate:].astype(np.float64)
    ref = gate * 0.5 * (1.0 + np.tanh(gate / 2.0)) * up  # sigmoid written through tanh
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (num_tokens, intermediate) and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **TOL[np.float32])


@pytest.mark.parametrize("num_tokens,in_features,out_features", [(1, 64, 17), (17, 33, 29),
                                                                 (111, 128, 96)])
def test_linear(rng, num_tokens, in_features, out_features):
    x = rng.standard_normal((num_tokens, in_features)).astype(np.float32)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
    bias = rng.standard_normal(out_features).astype(np.float32)
    ref = np.array([[math.fsum(x[t].astype(np.float64) * weight[o]) for o in range(out_features)]
                    for t in range(num_tokens)])
    tol = dict(rtol=1e-4, atol=1e-5 * math.sqrt(in_features))
    np.testing.assert_allclose(ops.linear(x, weight), ref, **tol)
    np.testing.assert_allclose(ops.linear(x, weight, bias), ref + bias, **tol)


def test_embedding(rng):
    table = rng.standard_normal((50, 12)).astype(np.float32)
    ids = rng.integers(0, 50, size=17).astype(np.int32)
    out = ops.embedding(ids, table)
    for t, i in enumerate(ids):
        np.testing.assert_array_equal(out[t], table[i])
    with pytest.raises(ValueError):
        ops.embedding(np.array([50], np.int32), table)
    with pytest.raises(ValueError):
        ops.embedding(np.array([-1], np.int32), table)


# ------------------------------------------------------------------------------ block moves

def test_copy_blocks(rng):
    num_layers, num_blocks = 3, 12
    k_caches = [rng.standard_normal((num_blocks, 8, 2, 16)).astype(np.float32)
                for _ in range(num_layers)]
    v_caches = [rng.standard_normal((num_blocks, 8, 2, 16)).astype(np.float32)
                for _ in range(num_layers)]
    for c in k_caches + v_caches:
        c[rng.random(c.shape) < 0.1] = np.nan  # NaN slots must copy as NaN, and stay put
    before = [c.copy() for c in k_caches + v_caches]
    perm = rng.permutation(num_blocks)
    pairs = np.stack([perm[:4], perm[4:8]], axis=1).astype(np.int32)
    pairs[1, 0] = pairs[0, 0]  # one source copied into two destinations (fork of n>1)
    ops.copy_blocks(k_caches, v_caches, pairs)
    dsts = {int(d): int(s) for s, d in pairs}
    for old, new in zip(before, k_caches + v_caches):
        for b in range(num_blocks):
            want = old[dsts[b]] if b in dsts else old[b]
            np.testing.assert_array_equal(new[b], want)
    with pytest.raises(ValueError):
        ops.copy_blocks(k_caches, v_caches, np.array([[1, 2], [2, 3]], np.int32))
    ops.copy_blocks(k_caches, v_caches, np.zeros((0, 2), np.int32))


def test_swap_blocks(rng):
    device = [rng.standard_normal((12, 16, 2, 8)).astype(np.float32) for _ in range(4)]
    host = [np.full((5, 16, 2, 8), np.nan, np.float32) for _ in range(4)]
    pairs = np.stack([rng.permutation(12)[:3], rng.permutation(5)[:3]], axis=1).astype(np.int32)
    ops.swap_blocks(device, host, pairs)  # swap out
    for d, h in zip(device, host):
        for s, t in pairs:
            np.testing.assert_array_equal(h[t], d[s])
        untouched = np.setdiff1d(np.arange(5), pairs[:, 1])
        assert np.isnan(h[untouched]).all()
    fresh = [np.zeros_like(d) for d in device]
    back = pairs[:, ::-1].copy()
    ops.swap_blocks(host, fresh, back)  # swap in to other device blocks
    for d, f in zip(device, fresh):
        for s, t in pairs:
            np.testing.assert_array_equal(f[s], d[s])
    with pytest.raises(ValueError):
        ops.swap_blocks(device[:1], [np.zeros((5, 8, 2, 8), np.float32)], pairs)


# ------------------------------------------------------------------------------ bf16 rounding

def test_round_to_bf16(rng):
    x = np.concatenate([
        rng.standard_normal(2000).astype(np.float32)
        * np.float32(10.0) ** rng.integers(-30, 30, 2000),
        # exact halfway cases: low 16 bits 0x8000, with even and odd kept lsb
        (np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000], np.uint32)).view(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf], np.float32),
    ]).astype(np.float32)
    out = ops.round_to_bf16(x)
    for value, got in zip(x, out):
        if not np.isfinite(value):
            assert got == value
            continue
        bits = int(np.float32(value).view(np.uint32))
        low = np.uint32(bits & 0xFFFF0000).view(np.float32)
        high = np.uint32((bits & 0xFFFF0000) + 0x10000).view(np.float32)  # next magnitude up
        dl, dh = abs(float(value) - float(low)), abs(float(high) - float(value))
        if dl < dh:
            want = low
        elif dh < dl:
            want = high
        else:  # tie: the candidate whose last kept bit is 0
            want = low if (bits >> 16) & 1 == 0 else high
        assert got.view(np.uint32) == np.float32(want).view(np.uint32), hex(bits)
    assert np.isnan(ops.round_to_bf16(np.array([np.nan], np.float32))).all()
    assert np.isnan(ops.round_to_bf16(np.array([0x7F800001], np.uint32).view(np.float32))).all()
    assert ops.round_to_bf16(np.array([3.4e38], np.float32))[0] == np.inf


# ------------------------------------------------------------------------------ the op chain

def dense_causal_reference(q, k, v, positions, cos_sin_cache, scale):
    """One sequence, all tokens at once, float64: rotate, then dense causal GQA attention."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    q_rot = np.stack([ref_rotate(q[t], positions[t], cos_sin_cache) for t in range(num_tokens)])
    k_rot = np.stack([ref_rotate(k[t], positions[t], cos_sin_cache) for t in range(num_tokens)])
    out = np.zeros(q.shape)
    for h in range(num_heads):
        scores = q_rot[:, h] @ k_rot[:, h // group].T * scale
        scores[np.triu_indices(num_tokens, 1)] = -np.inf
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (w / w.sum(axis=1, keepdims=True)) @ v[:, h // group].astype(np.float64)
    return out


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_chunked_prefill_with_prefix_hit_equals_dense(rng, block_size):
    """Two requests stepped through rotary+cache write and paged attention in random chunks
    (with padding tokens) give what one dense pass over each whole sequence gives. Request B
    starts with A's first two blocks (a prefix-cache hit): it reads A's KV through its table."""
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    scale = head_dim ** -0.5
    cos_sin = ops.build_cos_sin_cache(ops.rope_inv_freq(head_dim, 10000.0), 512)
    shared = 2 * block_size
    len_a, len_b = shared + 45, shared + 70
    seq_q = {r: rng.standard_normal((n, num_heads, head_dim)).astype(np.float32)
             for r, n in (("a", len_a), ("b", len_b))}
    seq_k = {r: rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
             for r, n in (("a", len_a), ("b", len_b))}
    seq_v = {r: rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
             for r, n in (("a", len_a), ("b", len_b))}
    seq_k["b"][:shared], seq_v["b"][:shared] = seq_k["a"][:shared], seq_v["a"][:shared]

    blocks_a, blocks_b = -(-len_a // block_size), -(-len_b // block_size)
    num_blocks = blocks_a + blocks_b - 2 + 3  # 3 never-used NaN blocks
    k_cache, v_cache = make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim)
    perm = rng.permutation(num_blocks)
    max_blocks = blocks_b + 1
    table = {"a": np.zeros(max_blocks, np.int32), "b": np.zeros(max_blocks, np.int32)}
    table["a"][:blocks_a] = perm[:blocks_a]
    table["b"][:2] = table["a"][:2]
    table["b"][2:blocks_b] = perm[blocks_a:blocks_a + blocks_b - 2]

    computed = {"a": 0, "b": None}  # b joins once a's shared prefix is in the cache
    outputs = {
        "a": np.zeros((len_a, num_heads, head_dim)),
        "b": np.zeros((len_b, num_heads, head_dim)),
    }
    seq_len = {"a": len_a, "b": len_b}
    while computed["a"] < len_a or computed["b"] is None or computed["b"] < len_b:
        if computed["b"] is None and computed["a"] >= shared:
            computed["b"] = shared  # prefix hit: b's first shared tokens are not recomputed
        active = [r for r in ("a", "b") if computed[r] is not None and computed[r] < seq_len[r]]
        chunks = {r: min(seq_len[r] - computed[r], int(rng.integers(1, 40))) for r in active}
        q_rows, k_rows, v_rows, positions, slots, tables, qsl, ctx = [], [], [], [], [], [], [0], []
        for r in active:
            pos = np.arange(computed[r], computed[r] + chunks[r])
            q_rows.append(seq_q[r][pos])
            k_rows.append(seq_k[r][pos])
            v_rows.append(seq_v[r][pos])
            positions.append(pos)
            slots.append([slot_of(table[r], p, block_size) for p in pos])
            tables.append(table[r])
            qsl.append(qsl[-1] + chunks[r])
            ctx.append(pos[-1] + 1)
        num_padding = int(rng.integers(0, 4))

        def pad(rows):
            return np.concatenate(
                rows + [np.zeros((num_padding,) + rows[0].shape[1:], np.float32)]
            )

        q, k, v = pad(q_rows), pad(k_rows), pad(v_rows)
        pos_all = np.concatenate(positions + [np.zeros(num_padding, int)]).astype(np.int32)
        slot_all = np.concatenate(slots + [np.full(num_padding, -1)]).astype(np.int32)
        q_rot, _ = ops.rotary_embedding_and_cache_write(q, k, v, pos_all, cos_sin, k_cache, v_cache,
                                                        slot_all)
        out = ops.paged_prefill_attention(q_rot, k_cache, v_cache, np.stack(tables),
                                          np.array(qsl, np.int32), np.array(ctx, np.int32), scale)
        for j, r in enumerate(active):
            outputs[r][computed[r]:computed[r] + chunks[r]] = out[qsl[j]:qsl[j + 1]]
            computed[r] += chunks[r]

    for r in ("a", "b"):
        ref = dense_causal_reference(seq_q[r], seq_k[r], seq_v[r], np.arange(seq_len[r]), cos_sin,
                                     scale)
        first = shared if r == "b" else 0  # b never computed its shared prefix's outputs
        np.testing.assert_allclose(outputs[r][first:], ref[first:], **TOL[np.float32])


def test_block_ids_out_of_range_are_refused(rng):
    q, kc, vc, tables, qsl, ctx = make_step(rng, 8, 4, 2, 16, [(10, 10)], 16)
    bad = tables.copy()
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="out of range"):
        ops.paged_prefill_attention(q, kc, vc, bad, qsl, ctx, 0.25)
    with pytest.raises(ValueError, match="out of range"):
        ops.copy_blocks([kc], [vc], np.array([[0, kc.shape[0]]], np.int32))
    with pytest.raises(ValueError, match="out of range"):
        ops.swap_blocks([kc], [vc], np.array([[-1, 0]], np.int32))
