"""Speculative decoding in the scheduler: draft rows, acceptance, block trimming, the prefix cache.

Every step runs on the fake KV worker with each row's sequence extended by its drafts (what
a target model's verification pass writes), so a rejected draft's KV that is later read --
through a stale block, a wrong prefix hit or a missed copy-on-write -- fails the step. The
expected values (k', token lists, block counts, prefix hits) are derived in each test from the
documented rules, not copied from a run.
"""
import numpy as np
import pytest

from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig

from pagedrun_tests_pyx_fake_worker import FakeWorker  # registered by tests/conftest.py

K = 3             # num_speculative_tokens of most tests
DRAFT_BASE = 1000   # draft ids start here, sampled ids at SAMPLED_BASE: both apart from prompts
SAMPLED_BASE = 2000


def _cdiv(a, b):
    return -(-a // b)


def _make(num_gpu_blocks=64, block_size=4, num_cpu_blocks=0, num_speculative_tokens=K, **kw):
    kw.setdefault("check_invariants", True)
    cfg = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                          num_cpu_blocks=num_cpu_blocks,
                          num_speculative_tokens=num_speculative_tokens, **kw)
    return Scheduler(cfg), FakeWorker(num_gpu_blocks, num_cpu_blocks, block_size)


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 500, n, dtype=np.int32)


class _WithDrafts:
    """The scheduler as the fake worker sees it in a step: each row's tokens then its drafts."""

    def __init__(self, sched, out):
        qsl = out.query_start_loc
        self.seqs = {}
        for k in range(out.num_reqs):
            rid, nd, end = int(out.req_ids[k]), int(out.num_draft_tokens[k]), int(qsl[k + 1])
            self.seqs[rid] = np.concatenate([sched.get_token_ids(rid),
                                             out.input_token_ids[end - nd:end]])

    def get_token_ids(self, rid):
        return self.seqs[rid]


def _execute(sched, worker, out):
    worker.execute(_WithDrafts(sched, out), out)


def _set_drafts(sched, drafts):
    """drafts: {request id: [draft token ids]}."""
    ids = list(drafts)
    width = max([1] + [len(d) for d in drafts.values()])
    tokens = np.zeros((len(ids), width), np.int32)
    for i, rid in enumerate(ids):
        tokens[i, :len(drafts[rid])] = drafts[rid]
    sched.set_draft_tokens(np.array(ids, np.int64), tokens, [len(drafts[r]) for r in ids])


def _accepted(out, num_accepted):
    """accepted_token_ids for num_accepted: each row's first drafts, row after row."""
    qsl = out.query_start_loc
    parts = [out.input_token_ids[qsl[k] + 1:qsl[k] + 1 + num_accepted[k]]
             for k in range(out.num_reqs)]
    return np.concatenate(parts + [np.zeros(0, np.int32)]).astype(np.int32)


def _step(sched, worker, drafts=None, accept=None, stop=()):
    """Propose drafts, schedule, execute, accept accept[rid] drafts of each row (0 if absent),
    stop the rows of `stop`. Returns (out, sampled, finished)."""
    if drafts:
        _set_drafts(sched, drafts)
    out = sched.schedule()
    _execute(sched, worker, out)
    rids = out.req_ids.tolist()
    num_accepted = np.array([(accept or {}).get(r, 0) for r in rids], np.int32)
    sampled = (SAMPLED_BASE + 10 * out.step_id + np.arange(out.num_reqs)).astype(np.int32)
    stops = np.array([r in stop for r in rids], bool)
    finished = sched.update_from_output(out, sampled, stops, num_accepted,
                                        _accepted(out, num_accepted))
    return out, sampled, finished


def _drafts(n, base=DRAFT_BASE):
    return list(range(base, base + n))


def _run_until_decoding(sched, worker, num_reqs, max_steps=50):
    for _ in range(max_steps):
        if len(sched.get_decode_request_ids()) == num_reqs:
            return
        _step(sched, worker)
    raise AssertionError("requests never all decoding")


def _decoding_request(sched, worker, prompt_len=5, max_tokens=20, rid=1, **kw):
    """A scheduler holding one request that has prefilled and sampled its first token."""
    sched.add_request(rid, _prompt(prompt_len, seed=rid), max_tokens=max_tokens, **kw)
    _step(sched, worker)
    assert rid in sched.get_decode_request_ids().tolist()


# ------------------------------------------------------------------ the draft row


def test_draft_row_queries_the_last_token_then_the_drafts():
    sched, worker = _make(block_size=4)
    _decoding_request(sched, worker, prompt_len=6)
    tokens = sched.get_token_ids(1)
    num_computed = sched.get_num_computed_tokens(1)
    drafts = _drafts(K)
    _set_drafts(sched, {1: drafts})
    out = sched.schedule()
    _execute(sched, worker, out)
    assert out.query_lens.tolist() == [1 + K]
    assert out.input_token_ids.tolist() == [int(tokens[-1])] + drafts
    positions = np.arange(num_computed, num_computed + 1 + K)
    assert out.positions.tolist() == positions.tolist()
    assert out.num_computed_tokens_before.tolist() == [num_computed]
    assert out.context_lens.tolist() == [num_computed + 1 + K]
    table = out.block_tables[0]
    assert out.block_tables.shape[1] == _cdiv(num_computed + 1 + K, 4)
    assert out.slot_mapping.tolist() == (table[positions // 4] * 4 + positions % 4).tolist()
    assert out.sample_mask.tolist() == [True]
    assert out.num_draft_tokens.tolist() == [K] and out.num_draft_tokens.dtype == np.int32
    assert out.total_draft_tokens == K
    sched.update_from_output(out, np.array([5], np.int32))


@pytest.mark.parametrize("drafting", ["first", "last", "all"])
def test_drafts_are_cut_to_the_budget_left_after_the_other_decodes(drafting):
    num_reqs, spare = 4, 2
    budget = num_reqs + spare  # one token per decode, then `spare` for drafts
    sched, worker = _make(max_num_batched_tokens=budget)
    for rid in range(num_reqs):
        sched.add_request(rid, _prompt(3, seed=rid), max_tokens=30)
    _run_until_decoding(sched, worker, num_reqs)
    order = sched.get_decode_request_ids().tolist()  # running order
    drafters = {"first": order[:1], "last": order[-1:], "all": order}[drafting]
    # A row may take what is left after its own token and one per decode behind it.
    expected, left, decodes_behind = {}, budget, num_reqs
    for rid in order:
        decodes_behind -= 1
        k = max(0, min(K, left - 1 - decodes_behind)) if rid in drafters else 0
        expected[rid] = k
        left -= 1 + k
    assert expected[drafters[0]] == spare < K  # the case under test: the budget binds
    lasts = {rid: int(sched.get_token_ids(rid)[-1]) for rid in order}
    out, _, _ = _step(sched, worker, drafts={rid: _drafts(K) for rid in drafters})
    assert out.req_ids.tolist() == order
    assert out.num_draft_tokens.tolist() == [expected[r] for r in order]
    assert out.query_lens.tolist() == [1 + expected[r] for r in order]
    assert out.num_batched_tokens == budget
    qsl = out.query_start_loc
    for k, rid in enumerate(order):
        row = out.input_token_ids[qsl[k]:qsl[k + 1]].tolist()
        assert row == [lasts[rid]] + _drafts(expected[rid])


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
@pytest.mark.parametrize("tokens_left", [1, 2, 3])
def test_drafts_are_cut_to_what_the_request_may_still_emit(limit, tokens_left):
    prompt_len = 6
    sched, worker = _make(max_model_len=64 if limit == "max_tokens" else
                          prompt_len + 1 + tokens_left)
    _decoding_request(sched, worker, prompt_len=prompt_len,
                      max_tokens=1 + tokens_left if limit == "max_tokens" else 40)
    # The step's final (sampled) token is one of the tokens left: drafts get the rest.
    expected = min(K, tokens_left - 1)
    out, sampled, finished = _step(sched, worker, drafts={1: _drafts(K)}, accept={1: expected})
    assert out.num_draft_tokens.tolist() == [expected] and out.total_draft_tokens == expected
    assert out.query_lens.tolist() == [1 + expected]
    # Everything accepted: the request emitted exactly its tokens left and is done.
    assert expected + 1 == tokens_left and finished == [1]


def test_drafts_of_a_prefilling_or_waiting_request_are_ignored():
    sched, worker = _make(max_num_batched_tokens=4, max_num_seqs=1)
    prompt = _prompt(10, seed=1)
    sched.add_request(1, prompt, max_tokens=5)
    sched.add_request(2, _prompt(3, seed=2), max_tokens=5)  # waits: max_num_seqs=1
    _step(sched, worker)
    assert sched.get_num_computed_tokens(1) == 4 and sched.get_request_status(2) == "waiting"
    out, _, _ = _step(sched, worker, drafts={1: _drafts(K), 2: _drafts(K)})
    assert out.req_ids.tolist() == [1]
    assert out.num_draft_tokens.tolist() == [0] and out.total_draft_tokens == 0
    assert out.input_token_ids.tolist() == prompt[4:8].tolist()
    assert out.sample_mask.tolist() == [False]


def test_a_proposal_is_good_for_one_schedule_and_replaces_the_previous_one():
    sched, worker = _make()
    sched.add_request(1, _prompt(5, seed=1), max_tokens=20)
    sched.add_request(2, _prompt(5, seed=2), max_tokens=20)
    _run_until_decoding(sched, worker, 2)
    _set_drafts(sched, {1: _drafts(K)})
    out, _, _ = _step(sched, worker, drafts={2: _drafts(2)})  # replaces request 1's proposal
    assert dict(zip(out.req_ids.tolist(), out.num_draft_tokens.tolist())) == {1: 0, 2: 2}
    out, _, _ = _step(sched, worker)  # no set_draft_tokens: plain decodes
    assert out.query_lens.tolist() == [1, 1] and out.num_draft_tokens.tolist() == [0, 0]
    assert out.total_draft_tokens == 0


def test_drafts_do_not_take_the_blocks_a_later_decode_needs():
    bs, len_a, len_b = 4, 7, 8
    # After the prefill A's next token (position 7) fits its blocks, B's (position 8) needs
    # one more block, and A's drafts (positions 8..10) one more too: one block is free.
    num_blocks = _cdiv(len_a, bs) + _cdiv(len_b, bs) + 1
    sched, worker = _make(num_gpu_blocks=num_blocks, block_size=bs)
    sched.add_request(1, _prompt(len_a, seed=1), max_tokens=10)
    sched.add_request(2, _prompt(len_b, seed=2), max_tokens=10)
    _step(sched, worker)
    assert sched.get_decode_request_ids().tolist() == [1, 2]
    assert sched.get_stats()["num_free_blocks"] == 1
    out, _, _ = _step(sched, worker, drafts={1: _drafts(K)})
    assert out.preempted_ids.tolist() == []
    assert out.req_ids.tolist() == [1, 2]
    assert out.num_draft_tokens.tolist() == [0, 0]  # B took the last block: no room for drafts


# ------------------------------------------------------------------ acceptance and blocks


@pytest.mark.parametrize("num_accepted", range(K + 1))
def test_accepted_drafts_then_the_sampled_token_and_rejected_blocks_are_trimmed(num_accepted):
    bs = 4
    sched, worker = _make(block_size=bs)
    # 6 tokens (5 computed): the drafts sit at positions 6, 7, 8 -- the last in a new block.
    _decoding_request(sched, worker, prompt_len=5)
    old_tokens = sched.get_token_ids(1).tolist()
    old_num_blocks = len(sched.get_block_table(1))
    total = sched.get_stats()["num_total_blocks"]
    drafts = _drafts(K)
    out, sampled, _ = _step(sched, worker, drafts={1: drafts}, accept={1: num_accepted})
    step_table = out.block_tables[0].tolist()
    assert len(step_table) == _cdiv(len(old_tokens) + K, bs) == old_num_blocks + 1
    tokens = sched.get_token_ids(1).tolist()
    assert tokens == old_tokens + drafts[:num_accepted] + [int(sampled[0])]
    assert sched.get_num_computed_tokens(1) == len(old_tokens) + num_accepted == len(tokens) - 1
    # Kept: the blocks of the computed tokens (what a plain decode step leaves); the rest go
    # back, and the next step allocates the sampled token's block if it needs a new one.
    kept = _cdiv(len(tokens) - 1, bs)
    assert sched.get_block_table(1).tolist() == step_table[:kept]
    assert sched.get_stats()["num_free_blocks"] == total - kept
    if num_accepted == K:
        assert kept == len(step_table)  # all accepted across the block edge: nothing trimmed
    # The next plain decode writes the sampled token's position through the kept table.
    out, _, _ = _step(sched, worker)
    pos = len(tokens) - 1
    table = out.block_tables[0].tolist()
    assert table[:kept] == step_table[:kept]
    assert out.positions.tolist() == [pos]
    assert out.slot_mapping.tolist() == [table[pos // bs] * bs + pos % bs]


def _expected_hit_tokens(computed_seqs, prompt, bs):
    """Prefix-cache hit of `prompt` (in tokens) when the cache holds the full blocks of each of
    computed_seqs (token ids whose KV is verified): whole matching blocks, leaving one token."""
    best = 0
    for seq in computed_seqs:
        n = min(len(seq), len(prompt))
        mismatch = np.flatnonzero(np.asarray(seq[:n]) != np.asarray(prompt[:n]))
        common = int(mismatch[0]) if len(mismatch) else n
        best = max(best, common // bs)
    return min(best, (len(prompt) - 1) // bs) * bs


def test_only_verified_tokens_enter_the_prefix_cache():
    bs, k = 4, 4
    sched, worker = _make(block_size=bs, num_speculative_tokens=k)
    # 3 + 1 sampled tokens fill block 0; 4 drafts fill block 1 exactly, all rejected.
    _decoding_request(sched, worker, prompt_len=3)
    rejected = _drafts(k)
    prefix = sched.get_token_ids(1).tolist()
    _step(sched, worker, drafts={1: rejected}, accept={1: 0})
    computed = sched.get_token_ids(1)[:sched.get_num_computed_tokens(1)].tolist()
    assert len(computed) == bs  # block 0 is verified, block 1 held only rejected drafts
    # A request continuing with the rejected drafts hits block 0 only.
    continuation = prefix + rejected + [7]
    sched.add_request(2, continuation, max_tokens=1)
    out, _, _ = _step(sched, worker)
    expected = _expected_hit_tokens([computed], continuation, bs)
    assert expected == bs
    assert out.new_req_ids.tolist() == [2] and out.num_prefix_cached_tokens.tolist() == [expected]
    # Request 1 goes on, every draft accepted across block edges, then stops.
    _step(sched, worker, drafts={1: _drafts(k, base=3000)}, accept={1: k})
    _step(sched, worker, drafts={1: _drafts(k, base=4000)}, accept={1: 2})
    tokens = sched.get_token_ids(1).tolist()
    computed = tokens[:sched.get_num_computed_tokens(1)]
    hits_before = sched.get_stats()["prefix_cache_hits"]
    _, sampled, finished = _step(sched, worker, stop=(1,))
    assert finished == [1]
    computed += [tokens[-1]]  # the stop step computed the last token's KV
    verified = tokens + [int(sampled[0])]
    sched.add_request(3, verified, max_tokens=1)
    out, _, _ = _step(sched, worker)
    expected = _expected_hit_tokens([computed], verified, bs)
    assert expected >= 2 * bs  # blocks holding accepted drafts are cached too
    assert out.num_prefix_cached_tokens.tolist() == [expected]
    assert sched.get_stats()["prefix_cache_hits"] - hits_before == expected
    assert not sched.has_unfinished_requests()
    assert sched.get_stats()["num_free_blocks"] == sched.get_stats()["num_total_blocks"]


# ------------------------------------------------------------------ errors


def _drafted_output(sched, worker):
    _decoding_request(sched, worker)
    _set_drafts(sched, {1: _drafts(K)})
    out = sched.schedule()
    _execute(sched, worker, out)
    return out


@pytest.mark.parametrize("case", ["too_many", "mismatch", "missing_tokens", "no_drafts_row"])
def test_bad_acceptance_raises_before_changing_state(case):
    sched, worker = _make()
    if case == "no_drafts_row":
        sched.add_request(2, _prompt(5, seed=2), max_tokens=20)  # decodes without drafts
        _step(sched, worker)
    out = _drafted_output(sched, worker)
    rids = out.req_ids.tolist()
    row = rids.index(1)
    good = np.zeros(out.num_reqs, np.int32)
    good[row] = 2
    drafts = _drafts(K)
    bad_counts, bad_tokens = good.copy(), drafts[:2]
    if case == "too_many":
        bad_counts[row], bad_tokens = K + 1, drafts + [1]
    elif case == "mismatch":
        bad_tokens = [drafts[0], drafts[2]]
    elif case == "missing_tokens":
        bad_tokens = drafts[:1]
    else:
        bad_counts[rids.index(2)], bad_tokens = 1, drafts[:2] + [0]
    tokens, computed = sched.get_token_ids(1).tolist(), sched.get_num_computed_tokens(1)
    sampled = np.full(out.num_reqs, 9, np.int32)
    with pytest.raises(ValueError):
        sched.update_from_output(out, sampled, None, bad_counts, np.array(bad_tokens, np.int32))
    assert sched.get_token_ids(1).tolist() == tokens
    assert sched.get_num_computed_tokens(1) == computed
    # The step is still open: the correct update goes through.
    sched.update_from_output(out, sampled, None, good, np.array(drafts[:2], np.int32))
    assert sched.get_token_ids(1).tolist() == tokens + drafts[:2] + [9]


def test_set_draft_tokens_validation():
    sched, worker = _make()
    _decoding_request(sched, worker)
    _set_drafts(sched, {1: _drafts(2)})  # the proposal that failed calls must leave alone
    with pytest.raises(ValueError):
        _set_drafts(sched, {1: _drafts(K + 1)})
    with pytest.raises(ValueError):
        sched.set_draft_tokens([1], np.zeros((1, K), np.int32), [-1])
    with pytest.raises(ValueError):
        sched.set_draft_tokens([1], np.array([[5, -3]], np.int32), [2])
    with pytest.raises(ValueError):
        sched.set_draft_tokens([1], np.zeros((1, 1), np.int32), [2])  # count past the row
    with pytest.raises(KeyError):
        _set_drafts(sched, {1: _drafts(1), 99: _drafts(1)})
    out = sched.schedule()
    assert out.num_draft_tokens.tolist() == [2]
    with pytest.raises(RuntimeError):
        _set_drafts(sched, {1: _drafts(1)})
    sched.update_from_output(out, np.zeros(1, np.int32))
    with pytest.raises(ValueError):
        SchedulerConfig(num_gpu_blocks=4, num_speculative_tokens=-1)
    off, _ = _make(num_speculative_tokens=0)
    off.add_request(1, _prompt(3), max_tokens=4)
    off.set_draft_tokens([1], np.zeros((1, 1), np.int32), [0])  # nothing proposed: fine
    with pytest.raises(ValueError):
        off.set_draft_tokens([1], np.zeros((1, 1), np.int32), [1])


# ------------------------------------------------------------------ fork


@pytest.mark.parametrize("num_accepted", range(K + 1))
def test_fork_after_a_speculative_step(num_accepted):
    bs = 4
    sched, worker = _make(block_size=bs)
    _decoding_request(sched, worker, prompt_len=5)  # drafts at 6, 7, 8: see the trim test
    _step(sched, worker, drafts={1: _drafts(K)}, accept={1: num_accepted})
    tokens = sched.get_token_ids(1).tolist()
    assert sched.get_num_computed_tokens(1) == len(tokens) - 1
    sched.fork_request(1, 2)
    assert sched.get_token_ids(2).tolist() == tokens
    assert sched.get_num_computed_tokens(2) == len(tokens) - 1
    # Both speculate next; the worker checks each reads its own prefix (copy-on-write).
    out, sampled, _ = _step(sched, worker, drafts={1: _drafts(K, 3000), 2: _drafts(K, 4000)},
                            accept={1: 1, 2: K})
    assert sorted(out.req_ids.tolist()) == [1, 2]
    rows = {r: k for k, r in enumerate(out.req_ids.tolist())}
    assert sched.get_token_ids(1).tolist() == tokens + [3000, int(sampled[rows[1]])]
    assert sched.get_token_ids(2).tolist() == tokens + _drafts(K, 4000) + [int(sampled[rows[2]])]
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        _step(sched, worker)
    stats = sched.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ------------------------------------------------------------------ random workload

VOCAB = 4  # tiny, so prompts and drafts share blocks and the prefix cache hits


def _random_prompt(rng, prefixes):
    prefix = prefixes[rng.integers(len(prefixes))]
    suffix = rng.integers(0, VOCAB, rng.integers(0, 8)).tolist()
    prompt = prefix[:rng.integers(0, len(prefix) + 1)] + suffix
    return prompt or [0]


@pytest.mark.parametrize("mode,num_cpu_blocks", [("recompute", 0), ("swap", 16)])
def test_random_speculative_workload_matches_a_model(mode, num_cpu_blocks):
    rng = np.random.default_rng(1234)
    bs, max_model_len, max_live, num_steps = 4, 32, 12, 200
    sched, worker = _make(num_gpu_blocks=8, block_size=bs, num_cpu_blocks=num_cpu_blocks,
                          preemption_mode=mode, max_num_seqs=4, max_num_batched_tokens=12,
                          max_model_len=max_model_len)
    prefixes = [rng.integers(0, VOCAB, 12).tolist() for _ in range(2)]
    tokens, max_tokens, num_outputs = {}, {}, {}  # the model, per live request
    counts = dict(added=0, forks=0, draft_rows=0, accepted=0, rejected=0, finished=0)

    def forget(rid):
        del tokens[rid], max_tokens[rid], num_outputs[rid]

    for step in range(10 * num_steps):
        adding = step < num_steps  # then drain
        if not adding and not sched.has_unfinished_requests():
            break
        if adding and len(tokens) < max_live and rng.random() < 0.4:
            rid, prompt = counts["added"], _random_prompt(rng, prefixes)
            counts["added"] += 1
            tokens[rid], max_tokens[rid], num_outputs[rid] = prompt, int(rng.integers(1, 24)), 0
            sched.add_request(rid, prompt, max_tokens[rid])
        if adding and tokens and rng.random() < 0.02:
            rid = sorted(tokens)[rng.integers(len(tokens))]
            assert sched.abort_request(rid)
            forget(rid)
        forkable = [r for r in sorted(tokens) if sched.get_request_status(r) == "running"
                    and sched.get_num_computed_tokens(r) == len(tokens[r]) - 1]
        if adding and forkable and len(tokens) < max_live and rng.random() < 0.1:
            parent, child = forkable[rng.integers(len(forkable))], counts["added"]
            counts["added"] += 1
            counts["forks"] += 1
            sched.fork_request(parent, child)
            tokens[child], max_tokens[child] = list(tokens[parent]), max_tokens[parent]
            num_outputs[child] = num_outputs[parent]
        proposed = {int(r): rng.integers(0, VOCAB, rng.integers(0, K + 1)).tolist()
                    for r in sched.get_decode_request_ids() if rng.random() < 0.8}
        if tokens and rng.random() < 0.2:  # drafts for any live one: ignored unless decoding
            proposed.setdefault(sorted(tokens)[rng.integers(len(tokens))], [1, 2])
        if proposed:
            _set_drafts(sched, proposed)
        out = sched.schedule()
        _execute(sched, worker, out)
        rids = out.req_ids.tolist()
        num_accepted = np.zeros(out.num_reqs, np.int32)
        for k, rid in enumerate(rids):
            nd = int(out.num_draft_tokens[k])
            if nd:
                assert nd <= len(proposed.get(rid, []))
                assert out.num_computed_tokens_before[k] == len(tokens[rid]) - 1  # a decode
                assert nd <= max_tokens[rid] - num_outputs[rid] - 1
                assert nd <= max_model_len - len(tokens[rid]) - 1
                num_accepted[k] = rng.integers(0, nd + 1)
                counts["draft_rows"] += 1
                counts["rejected"] += nd - int(num_accepted[k])
        aborted = None
        if rids and rng.random() < 0.02:
            aborted = rids[rng.integers(len(rids))]
            assert sched.abort_request(aborted)
            forget(aborted)
        sampled = rng.integers(0, VOCAB, out.num_reqs).astype(np.int32)
        stops = rng.random(out.num_reqs) < 0.05
        finished = sched.update_from_output(out, sampled, stops, num_accepted,
                                            _accepted(out, num_accepted))
        qsl = out.query_start_loc
        expected_finished = []
        for k, rid in enumerate(rids):
            if rid == aborted or not out.sample_mask[k]:
                continue
            a = int(num_accepted[k])
            tokens[rid] = (tokens[rid] + out.input_token_ids[qsl[k] + 1:qsl[k] + 1 + a].tolist()
                           + [int(sampled[k])])
            num_outputs[rid] += a + 1
            counts["accepted"] += a
            if (stops[k] or num_outputs[rid] >= max_tokens[rid]
                    or len(tokens[rid]) >= max_model_len):
                expected_finished.append(rid)
        assert sorted(finished) == sorted(expected_finished)
        counts["finished"] += len(finished)
        for rid in finished:
            forget(rid)
        for rid, toks in tokens.items():
            assert sched.get_token_ids(rid).tolist() == toks, (step, rid)
    else:
        raise AssertionError("requests never finished")
    # The run exercised what it is meant to.
    stats = sched.get_stats()
    assert counts["finished"] > 0 and counts["forks"] > 0
    assert counts["draft_rows"] > 0 and counts["accepted"] > 0 and counts["rejected"] > 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert not tokens and sched.num_running == sched.num_waiting == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_cpu_blocks"] == num_cpu_blocks
    sched.check_invariants()
