"""KVCacheManager: prefix hits, all-or-nothing allocation, fork + copy-on-write, swap maps."""
import numpy as np

from pagedrun.pyx.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, n, dtype=np.int32)


def _admit(kv, slot, tokens, num_new=None):
    hits = kv.py_find_cached_prefix(slot, tokens)
    num_cached = hits * BLOCK_SIZE
    n = len(tokens) - num_cached if num_new is None else num_new
    assert kv.py_allocate_slots(slot, num_cached, n)
    return num_cached


def _finish_prefill(kv, slot, tokens):
    kv.py_cache_full_blocks(slot, tokens, len(tokens))


def test_prefix_hit_ending_at_a_block_edge():
    kv = KVCacheManager(32, BLOCK_SIZE, 0, True, 4)
    prompt = _prompt(11)
    assert _admit(kv, 0, prompt) == 0
    _finish_prefill(kv, 0, prompt)
    # A second prompt sharing exactly the first 8 tokens (two full blocks), then diverging.
    other = np.concatenate([prompt[:8], _prompt(5, seed=1)])
    assert _admit(kv, 1, other) == 8
    t0, t1 = kv.block_table(0), kv.block_table(1)
    assert list(t1[:2]) == list(t0[:2])
    assert t1[2] != t0[2]
    assert kv.gpu_pool.ref_count(int(t0[0])) == 2
    kv.check_invariants()


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(32, BLOCK_SIZE, 0, True, 4)
    prompt = _prompt(12)  # exactly three full blocks
    _admit(kv, 0, prompt)
    _finish_prefill(kv, 0, prompt)
    kv.py_free(0)
    # Every block is cached, but the last one must be recomputed to get the last logits.
    assert kv.py_find_cached_prefix(1, prompt) == 2
    prompt13 = np.concatenate([prompt, [7]]).astype(np.int32)
    assert kv.py_find_cached_prefix(1, prompt13) == 3


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(3, BLOCK_SIZE, 0, True, 4)
    assert not kv.py_allocate_slots(0, 0, 13)  # needs 4 blocks
    assert len(kv.block_table(0)) == 0
    assert kv.gpu_pool.num_free_blocks == 3
    assert kv.py_allocate_slots(0, 0, 12)
    assert kv.gpu_pool.num_free_blocks == 0
    kv.check_invariants()


def test_fork_then_copy_on_write_of_the_last_partial_block():
    kv = KVCacheManager(16, BLOCK_SIZE, 0, True, 4)
    prompt = _prompt(10)  # blocks: full, full, partial (2 tokens)
    _admit(kv, 0, prompt)
    _finish_prefill(kv, 0, prompt)
    kv.py_fork(0, 1)
    parent, child = kv.block_table(0), kv.block_table(1)
    assert list(parent) == list(child)
    assert all(kv.gpu_pool.ref_count(int(b)) == 2 for b in parent)
    kv.py_clear_ops()
    # The parent writes position 10 (third slot of the shared partial block): it gets a copy.
    assert kv.py_allocate_slots(0, 10, 1)
    new_parent = kv.block_table(0)
    assert list(new_parent[:2]) == list(parent[:2])
    assert new_parent[2] != parent[2]
    assert kv.ops()["block_copies"].tolist() == [[int(parent[2]), int(new_parent[2])]]
    # The child is now the only holder of the old block: it writes in place, no copy.
    kv.py_clear_ops()
    assert kv.py_allocate_slots(1, 10, 1)
    assert list(kv.block_table(1)) == list(child)
    assert len(kv.ops()["block_copies"]) == 0
    kv.check_invariants()


def test_fork_at_a_block_edge_needs_no_copy():
    kv = KVCacheManager(16, BLOCK_SIZE, 0, True, 4)
    prompt = _prompt(8)
    _admit(kv, 0, prompt)
    kv.py_fork(0, 1)
    kv.py_clear_ops()
    assert kv.py_allocate_slots(0, 8, 1)
    assert kv.py_allocate_slots(1, 8, 1)
    assert len(kv.ops()["block_copies"]) == 0
    assert kv.block_table(0)[2] != kv.block_table(1)[2]
    kv.check_invariants()


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(8, BLOCK_SIZE, 8, True, 4)
    prompt = _prompt(9)
    _admit(kv, 0, prompt)
    gpu_before = kv.block_table(0)
    kv.py_clear_ops()
    assert kv.py_swap_out(0)
    host = kv.block_table(0)
    assert kv.is_on_host(0)
    assert kv.gpu_pool.num_free_blocks == 8
    pairs = kv.ops()["swap_out"]
    assert sorted(map(tuple, pairs.tolist())) == sorted(zip(gpu_before.tolist(), host.tolist()))
    kv.check_invariants()
    kv.py_clear_ops()
    assert kv.py_swap_in(0, 10)
    back = kv.block_table(0)
    assert kv.ops()["swap_in"].tolist() == [[h, g] for h, g in zip(host.tolist(), back.tolist())]
    assert kv.cpu_pool.num_free_blocks == 8
    kv.check_invariants()


def test_swap_out_refused_without_host_room():
    kv = KVCacheManager(8, BLOCK_SIZE, 1, True, 4)
    _admit(kv, 0, _prompt(9))
    assert not kv.py_swap_out(0)
    assert not kv.is_on_host(0)


def test_free_releases_the_tail_first():
    kv = KVCacheManager(8, BLOCK_SIZE, 0, True, 4)
    prompt = _prompt(12)
    _admit(kv, 0, prompt)
    _finish_prefill(kv, 0, prompt)
    table = kv.block_table(0).tolist()
    kv.py_free(0)
    cached_order = [b for b in kv.gpu_pool.free_list() if b in table]
    assert cached_order == table[::-1]
