"""One test per classic scheduler off-by-one and per API contract corner (docs/scheduler.md)."""
import numpy as np
import pytest

from pagedrun.pyx.scheduler import (Scheduler, SchedulerConfig, SchedulerInvariantError,
                                    SchedulerOutput)

from pagedrun_tests_pyx_fake_worker import FakeWorker  # registered by tests/conftest.py


def _make(num_gpu_blocks=64, block_size=8, num_cpu_blocks=0, **kw):
    kw.setdefault("check_invariants", True)
    cfg = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                          num_cpu_blocks=num_cpu_blocks, **kw)
    return Scheduler(cfg), FakeWorker(num_gpu_blocks, num_cpu_blocks, block_size)


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 500, n, dtype=np.int32)


def _step(sched, worker, token=7, stop=None):
    out = sched.schedule()
    worker.execute(sched, out)
    sampled = np.full(out.num_reqs, token, dtype=np.int32)
    return out, sched.update_from_output(out, sampled, stop)


def _run_to_completion(sched, worker, max_steps=500):
    finished = []
    for i in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        _, fin = _step(sched, worker, token=100 + i)
        finished += fin
    raise AssertionError("requests did not finish")


def test_first_step_positions_are_zero_based_and_slots_follow_the_table():
    sched, worker = _make(block_size=8)
    sched.add_request(1, _prompt(13), max_tokens=2)
    out, _ = _step(sched, worker)
    assert out.positions.tolist() == list(range(13))
    table = out.block_tables[0]
    assert out.slot_mapping.tolist() == [int(table[p // 8]) * 8 + p % 8 for p in range(13)]
    assert out.num_computed_tokens_before.tolist() == [0]
    assert out.context_lens.tolist() == [13]
    assert out.query_start_loc.tolist() == [0, 13]
    assert out.sample_mask.tolist() == [True]
    assert out.slot_mapping.dtype == np.int32 and out.slot_mapping.flags.c_contiguous


def test_chunk_boundary_exactly_at_a_block_edge():
    sched, worker = _make(block_size=8, max_num_batched_tokens=16)
    sched.add_request(1, _prompt(32), max_tokens=1)
    out1, _ = _step(sched, worker)
    assert out1.query_lens.tolist() == [16] and out1.sample_mask.tolist() == [False]
    assert out1.block_tables.shape == (1, 2)
    out2, _ = _step(sched, worker)
    assert out2.num_computed_tokens_before.tolist() == [16]
    assert out2.positions.tolist() == list(range(16, 32))
    assert out2.block_tables.shape == (1, 4)
    assert out2.slot_mapping[0] == out2.block_tables[0, 2] * 8  # first slot of a fresh block
    assert out2.sample_mask.tolist() == [True]
    assert len(set(out2.block_tables[0].tolist())) == 4


def test_chunk_ending_one_past_a_block_edge():
    sched, worker = _make(block_size=8, max_num_batched_tokens=9)
    sched.add_request(1, _prompt(18), max_tokens=1)
    out1, _ = _step(sched, worker)
    assert out1.block_tables.shape == (1, 2) and out1.context_lens.tolist() == [9]
    out2, _ = _step(sched, worker)
    assert out2.positions.tolist() == list(range(9, 18))
    assert out2.block_tables.shape == (1, 3)


def test_prefix_hit_ending_at_a_block_edge():
    sched, worker = _make(block_size=8)
    base = _prompt(20)
    sched.add_request(1, base, max_tokens=1)
    _run_to_completion(sched, worker)
    second = np.concatenate([base[:16], _prompt(5, seed=9)])
    sched.add_request(2, second, max_tokens=1)
    out, _ = _step(sched, worker)
    assert out.num_prefix_cached_tokens.tolist() == [16]
    assert out.num_computed_tokens_before.tolist() == [16]
    assert out.positions.tolist() == list(range(16, 21))
    assert sched.get_stats()["prefix_cache_hits"] == 16


def test_full_prompt_hit_still_computes_the_last_block():
    sched, worker = _make(block_size=8)
    prompt = _prompt(16)
    sched.add_request(1, prompt, max_tokens=1)
    _run_to_completion(sched, worker)
    sched.add_request(2, prompt, max_tokens=1)
    out, _ = _step(sched, worker)
    # Both blocks are cached, but a hit must leave a token to compute: the last block reruns.
    assert out.num_prefix_cached_tokens.tolist() == [8]
    assert out.query_lens.tolist() == [8]
    assert out.sample_mask.tolist() == [True]


def test_full_prompt_hit_one_past_a_block_edge():
    sched, worker = _make(block_size=8)
    prompt = _prompt(17)
    sched.add_request(1, prompt, max_tokens=1)
    _run_to_completion(sched, worker)
    sched.add_request(2, prompt, max_tokens=1)
    out, _ = _step(sched, worker)
    assert out.num_prefix_cached_tokens.tolist() == [16]
    assert out.positions.tolist() == [16]


def test_cache_salt_separates_prefix_caches():
    sched, worker = _make(block_size=8)
    prompt = _prompt(24)
    sched.add_request(1, prompt, max_tokens=1, cache_salt=1)
    _run_to_completion(sched, worker)
    sched.add_request(2, prompt, max_tokens=1, cache_salt=2)
    out, _ = _step(sched, worker)
    assert out.num_prefix_cached_tokens.tolist() == [0]


@pytest.mark.parametrize("mode,num_cpu_blocks", [("recompute", 0), ("swap", 64)])
def test_preempted_request_resumes_with_identical_block_contents(mode, num_cpu_blocks):
    # 6 blocks of 4 tokens; two requests of 9-token prompts grow until one must be preempted.
    sched, worker = _make(num_gpu_blocks=6, block_size=4, num_cpu_blocks=num_cpu_blocks,
                          preemption_mode=mode, max_model_len=64)
    sched.add_request(1, _prompt(9, seed=1), max_tokens=12)
    sched.add_request(2, _prompt(9, seed=2), max_tokens=12)
    preempted = []
    expected_tokens = {1: list(_prompt(9, seed=1)), 2: list(_prompt(9, seed=2))}
    for i in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        preempted += out.preempted_ids.tolist()
        worker.execute(sched, out)  # asserts every row reads exactly its own prefix
        sampled = np.arange(out.num_reqs, dtype=np.int32) + 1000 + i
        for k in np.flatnonzero(out.sample_mask):
            expected_tokens[int(out.req_ids[k])].append(int(sampled[k]))
        sched.update_from_output(out, sampled)
        for rid in list(expected_tokens):
            try:
                got = sched.get_token_ids(rid).tolist()
            except KeyError:
                continue
            assert got == expected_tokens[rid]
    assert preempted == [2] or set(preempted) == {2}, preempted
    assert not sched.has_unfinished_requests()
    stats = sched.get_stats()
    assert stats["num_preemptions"] >= 1
    assert stats["num_free_blocks"] == 6
    if mode == "swap":
        assert stats["num_free_cpu_blocks"] == num_cpu_blocks


def test_recompute_preemption_keeps_generated_tokens_and_restarts_at_zero():
    sched, worker = _make(num_gpu_blocks=5, block_size=4, max_model_len=64)
    sched.add_request(1, _prompt(7, seed=1), max_tokens=13)
    sched.add_request(2, _prompt(5, seed=2), max_tokens=13)
    for i in range(100):
        out = sched.schedule()
        worker.execute(sched, out)
        if len(out.preempted_ids):
            victim = int(out.preempted_ids[0])
            assert sched.get_num_computed_tokens(victim) == 0
            assert sched.get_request_status(victim) == "waiting"
            tokens_at_preemption = sched.get_token_ids(victim)
            sched.update_from_output(out, np.zeros(out.num_reqs, np.int32))
            # It is recomputed from position 0 with all its tokens (generated ones included).
            while True:
                out = sched.schedule()
                worker.execute(sched, out)
                if victim in out.req_ids.tolist():
                    k = out.req_ids.tolist().index(victim)
                    assert out.num_computed_tokens_before[k] == out.num_prefix_cached_tokens[
                        out.new_req_ids.tolist().index(victim)]
                    assert np.array_equal(sched.get_token_ids(victim), tokens_at_preemption)
                    return
                sched.update_from_output(out, np.zeros(out.num_reqs, np.int32))
        sched.update_from_output(out, np.full(out.num_reqs, 3, np.int32))
    raise AssertionError("no preemption happened")


def test_cow_on_the_last_partial_block_of_a_forked_request():
    sched, worker = _make(block_size=4)
    sched.add_request(1, _prompt(10), max_tokens=5)
    out, _ = _step(sched, worker, token=41)  # prefill; samples the parent's first token
    parent_table = sched.get_block_table(1).tolist()
    sched.fork_request(1, 2, child_last_token_id=42)
    assert sched.get_block_table(2).tolist() == parent_table
    assert sched.get_token_ids(2)[-1] == 42 and sched.get_token_ids(1)[-1] == 41
    out, _ = _step(sched, worker)  # both write position 10 into the shared block 2
    assert out.block_copies.shape == (1, 2)
    src, dst = out.block_copies[0].tolist()
    assert src == parent_table[2]
    tables = {int(r): out.block_tables[k].tolist() for k, r in enumerate(out.req_ids)}
    assert sorted([tables[1][2], tables[2][2]]) == sorted([src, dst])
    assert tables[1][:2] == tables[2][:2] == parent_table[:2]
    _run_to_completion(sched, worker)
    assert sched.get_stats()["num_free_blocks"] == 64


def test_fork_rules():
    sched, worker = _make(block_size=4, max_num_seqs=2)
    sched.add_request(1, _prompt(10), max_tokens=5)
    with pytest.raises(ValueError, match="must be running"):
        sched.fork_request(1, 2)  # still waiting
    out = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.fork_request(1, 2)  # between schedule and update
    worker.execute(sched, out)
    sched.update_from_output(out, np.array([5], np.int32))
    sched.fork_request(1, 2)
    with pytest.raises(ValueError, match="already live"):
        sched.fork_request(1, 2)
    sched.fork_request(1, 3)  # max_num_seqs reached: the child waits, holding no blocks
    assert sched.get_request_status(3) == "waiting"
    assert len(sched.get_block_table(3)) == 0
    _run_to_completion(sched, worker)


def test_running_decodes_are_not_starved_by_a_long_prefill():
    # A long prefill admitted first sits ahead of every decode in admission order; forks put
    # more decodes behind it than the budget it leaves. Each decode must still get its token.
    sched, worker = _make(num_gpu_blocks=256, block_size=8, max_num_batched_tokens=32,
                          max_model_len=1024, long_prefill_token_threshold=24)
    sched.add_request(1, _prompt(400), max_tokens=2)
    shorts = list(range(2, 10))
    for rid in shorts:
        sched.add_request(rid, _prompt(1, seed=rid), max_tokens=50)
    out, _ = _step(sched, worker)
    assert (dict(zip(out.req_ids.tolist(), out.query_lens.tolist()))
            == {1: 24, **{r: 1 for r in shorts}})
    for rid in shorts:
        sched.fork_request(rid, rid + 100)
    for _ in range(4):
        out, _ = _step(sched, worker)
        lens = dict(zip(out.req_ids.tolist(), out.query_lens.tolist()))
        assert all(lens[r] == 1 and lens[r + 100] == 1 for r in shorts), lens
        assert lens[1] == 32 - 16
        assert out.num_batched_tokens == 32


def test_long_prefill_token_threshold_caps_chunks():
    sched, worker = _make(block_size=8, max_num_batched_tokens=64, long_prefill_token_threshold=10)
    sched.add_request(1, _prompt(25), max_tokens=1)
    lens = []
    while sched.has_unfinished_requests():
        out, _ = _step(sched, worker)
        lens += out.query_lens.tolist()
    assert lens == [10, 10, 5]


def test_max_num_seqs_and_budget_hold():
    sched, worker = _make(num_gpu_blocks=200, block_size=4, max_num_seqs=3,
                          max_num_batched_tokens=10)
    for rid in range(6):
        sched.add_request(rid, _prompt(7, seed=rid), max_tokens=3)
    while sched.has_unfinished_requests():
        out, _ = _step(sched, worker)
        assert out.num_reqs <= 3 and out.num_batched_tokens <= 10
        assert sched.num_running <= 3


def test_finish_on_max_tokens_stop_mask_and_max_model_len():
    sched, worker = _make(block_size=4, max_model_len=12)
    sched.add_request(1, _prompt(5), max_tokens=3)
    sched.add_request(2, _prompt(5, seed=1), max_tokens=100)
    sched.add_request(3, _prompt(10, seed=2), max_tokens=100)
    out = sched.schedule()
    worker.execute(sched, out)
    stop = np.array([r == 2 for r in out.req_ids.tolist()])
    assert sched.update_from_output(out, np.zeros(out.num_reqs, np.int32), stop) == [2]
    finished = _run_to_completion(sched, worker)
    assert sorted(finished) == [1, 3]


def test_request_reaching_max_model_len_exactly_finishes():
    sched, worker = _make(block_size=4, max_model_len=8)
    sched.add_request(1, _prompt(8), max_tokens=10)  # a prompt of max_model_len gets one token
    out, fin = _step(sched, worker)
    assert fin == [1]


def test_abort_mid_prefill_mid_decode_and_between_schedule_and_update():
    sched, worker = _make(num_gpu_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched.add_request(1, _prompt(30), max_tokens=5)
    sched.add_request(2, _prompt(3, seed=1), max_tokens=50)
    _step(sched, worker)
    assert sched.get_num_computed_tokens(1) == 8  # mid-prefill
    assert sched.abort_request(1)
    assert not sched.abort_request(1)
    _step(sched, worker)
    _step(sched, worker)  # request 2 decoding
    out = sched.schedule()
    assert sched.abort_request(2)  # between schedule and update: its row is ignored
    assert sched.update_from_output(out, np.zeros(out.num_reqs, np.int32)) == []
    assert sched.get_stats()["num_free_blocks"] == 32
    sched.check_invariants()


def test_update_requires_the_latest_output_once():
    sched, worker = _make()
    sched.add_request(1, _prompt(5), max_tokens=3)
    out = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):
        sched.update_from_output(out, np.zeros(2, np.int32))
    sched.update_from_output(out, np.zeros(1, np.int32))
    with pytest.raises(RuntimeError):
        sched.update_from_output(out, np.zeros(1, np.int32))


def test_add_request_validation():
    sched, _ = _make(num_gpu_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="non-empty"):
        sched.add_request(1, np.zeros(0, np.int32), 3)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(1, _prompt(101), 3)
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(1, _prompt(5), 0)
    with pytest.raises(ValueError, match="never fit"):
        sched.add_request(1, _prompt(20), 3)
    sched.add_request(1, _prompt(5), 3)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(1, _prompt(5), 3)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(num_gpu_blocks=4, preemption_mode="drop")


def test_invariant_violation_raises_a_precise_message():
    sched, worker = _make(block_size=4)
    sched.add_request(1, _prompt(6), max_tokens=3)
    _step(sched, worker)
    block = int(sched.get_block_table(1)[0])
    sched.kv.gpu_pool.free_block(block)  # corrupt: drop a reference a block table still holds
    with pytest.raises(SchedulerInvariantError, match=f"block {block}"):
        sched.check_invariants()


def test_priority_orders_the_waiting_queue():
    sched, worker = _make(block_size=4, max_num_seqs=1)
    sched.add_request(1, _prompt(4), max_tokens=1, priority=5)
    sched.add_request(2, _prompt(4, seed=1), max_tokens=1, priority=0)
    sched.add_request(3, _prompt(4, seed=2), max_tokens=1, priority=5)
    order = []
    while sched.has_unfinished_requests():
        out, _ = _step(sched, worker)
        order += out.new_req_ids.tolist()
    assert order == [2, 1, 3]


def test_output_type_and_empty_step():
    sched, _ = _make()
    out = sched.schedule()
    assert isinstance(out, SchedulerOutput)
    assert out.num_reqs == 0 and out.block_tables.shape == (0, 0)
    assert sched.update_from_output(out, np.zeros(0, np.int32)) == []
