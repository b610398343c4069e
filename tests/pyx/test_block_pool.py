"""BlockPool: free-list eviction order, ref counts, verified prefix-cache hits, counters."""
import numpy as np
import pytest

from pagedrun.pyx.block_pool import BlockPool, hash_tokens

BLOCK_SIZE = 4


def _tokens(*values):
    return np.array(values, dtype=np.int32)


def test_fresh_pool_hands_out_every_block_once_then_runs_dry():
    pool = BlockPool(7, BLOCK_SIZE)
    got = [pool.allocate_block() for _ in range(7)]
    assert sorted(got) == list(range(7))
    assert pool.allocate_block() == -1
    assert pool.num_free_blocks == 0
    pool.check_invariants(np.ones(7, dtype=np.int64))


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, BLOCK_SIZE)
    a, b, c, d = (pool.allocate_block() for _ in range(4))
    h = hash_tokens(0, _tokens(1, 2, 3, 4))
    assert pool.cache_full_block(a, h, _tokens(1, 2, 3, 4), -1) == a
    pool.free_block(a)  # cached: tail
    pool.free_block(b)  # uncached: head
    assert pool.free_list() == [b, a]
    assert pool.allocate_block() == b
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(3, BLOCK_SIZE)
    blocks = [pool.allocate_block() for _ in range(3)]
    parent = -1
    h = 0
    for i, blk in enumerate(blocks):
        toks = _tokens(i, i, i, i)
        h = hash_tokens(h, toks)
        assert pool.cache_full_block(blk, h, toks, parent) == blk
        parent = blk
    # A request frees tail first: the last block is evicted before its prefix.
    for blk in reversed(blocks):
        pool.free_block(blk)
    assert pool.free_list() == [blocks[2], blocks[1], blocks[0]]
    assert pool.allocate_block() == blocks[2]
    assert pool.stats()["num_evictions"] == 1
    assert not pool.is_block_cached(blocks[2])
    pool.check_invariants()


def test_hit_on_free_cached_block_unlinks_it_from_the_middle():
    pool = BlockPool(5, BLOCK_SIZE)
    blocks = [pool.allocate_block() for _ in range(5)]
    toks = _tokens(9, 8, 7, 6)
    h = hash_tokens(0, toks)
    pool.cache_full_block(blocks[2], h, toks, -1)
    for blk in blocks:
        pool.free_block(blk)
    hit = pool.find_cached(h, toks, -1)
    assert hit == blocks[2]
    pool.incref_block(hit)
    assert hit not in pool.free_list()
    assert pool.ref_count(hit) == 1
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_hash_collision_never_serves_wrong_tokens():
    pool = BlockPool(4, BLOCK_SIZE)
    a = pool.allocate_block()
    b = pool.allocate_block()
    forced_hash = 12345  # both contents stored under one hash: a collision
    assert pool.cache_full_block(a, forced_hash, _tokens(1, 2, 3, 4), -1) == a
    assert pool.find_cached(forced_hash, _tokens(1, 2, 3, 5), -1) == -1
    # The second content cannot be cached under the taken hash; its canonical block is none.
    assert pool.cache_full_block(b, forced_hash, _tokens(1, 2, 3, 5), -1) == -1
    assert pool.find_cached(forced_hash, _tokens(1, 2, 3, 4), -1) == a
    st = pool.stats()
    assert (st["num_queries"], st["num_hits"]) == (2, 1)


def test_hit_requires_same_parent_and_extra_key():
    pool = BlockPool(4, BLOCK_SIZE)
    p1, p2, child = (pool.allocate_block() for _ in range(3))
    pool.cache_full_block(p1, hash_tokens(0, _tokens(1, 1, 1, 1)), _tokens(1, 1, 1, 1), -1)
    pool.cache_full_block(p2, hash_tokens(0, _tokens(2, 2, 2, 2)), _tokens(2, 2, 2, 2), -1)
    toks = _tokens(5, 6, 7, 8)
    h = 777  # forced: the chained hash is the caller's; verification must not rely on it
    assert pool.cache_full_block(child, h, toks, p1, extra_key=3) == child
    assert pool.find_cached(h, toks, p2, extra_key=3) == -1
    assert pool.find_cached(h, toks, p1, extra_key=4) == -1
    assert pool.find_cached(h, toks, p1, extra_key=3) == child


def test_evicting_a_parent_invalidates_its_cached_children():
    pool = BlockPool(3, BLOCK_SIZE)
    parent, child, other = (pool.allocate_block() for _ in range(3))
    pt, ct = _tokens(1, 2, 3, 4), _tokens(5, 6, 7, 8)
    hp = hash_tokens(0, pt)
    hc = hash_tokens(hp, ct)
    pool.cache_full_block(parent, hp, pt, -1)
    pool.cache_full_block(child, hc, ct, parent)
    pool.free_block(other)
    pool.free_block(parent)  # parent first on the list after `other`
    pool.free_block(child)
    assert pool.allocate_block() == other
    gen_before = pool.generation(parent)
    assert pool.allocate_block() == parent  # evicts the parent
    assert pool.generation(parent) == gen_before + 1
    # Someone caches new content in the parent's old block id: the child must not chain to it.
    pool.cache_full_block(parent, hp, pt, -1)
    assert pool.find_cached(hc, ct, parent) == -1
    pool.check_invariants()


def test_ref_counts_and_double_free_is_rejected():
    pool = BlockPool(2, BLOCK_SIZE)
    a = pool.allocate_block()
    pool.incref_block(a)
    assert pool.ref_count(a) == 2
    pool.free_block(a)
    assert pool.num_free_blocks == 1
    pool.free_block(a)
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.free_block(a)
    with pytest.raises(IndexError):
        pool.ref_count(2)


def test_check_invariants_reports_a_wrong_ref_count():
    pool = BlockPool(3, BLOCK_SIZE)
    a = pool.allocate_block()
    expected = np.zeros(3, dtype=np.int64)
    with pytest.raises(AssertionError, match=f"block {a}: ref count 1 but 0"):
        pool.check_invariants(expected)


def test_random_operations_keep_the_pool_consistent():
    rng = np.random.default_rng(11)
    pool = BlockPool(19, BLOCK_SIZE)
    holders = np.zeros(19, dtype=np.int64)
    for _ in range(2000):
        op = rng.integers(0, 3)
        if op == 0:
            b = pool.allocate_block()
            if b >= 0:
                holders[b] += 1
        elif op == 1 and holders.any():
            b = int(rng.choice(np.flatnonzero(holders)))
            pool.free_block(b)
            holders[b] -= 1
        elif op == 2 and holders.any():
            b = int(rng.choice(np.flatnonzero(holders)))
            toks = rng.integers(0, 3, BLOCK_SIZE, dtype=np.int32)
            pool.cache_full_block(b, hash_tokens(0, toks), toks, -1)
    pool.check_invariants(holders)


def test_hash_is_chained_and_salted():
    toks = _tokens(1, 2, 3, 4)
    assert hash_tokens(0, toks) != hash_tokens(1, toks)
    assert hash_tokens(0, toks, 0) != hash_tokens(0, toks, 1)
    assert hash_tokens(0, toks) == hash_tokens(0, toks.copy())
