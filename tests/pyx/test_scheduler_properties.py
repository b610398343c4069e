"""Stateful property tests: random workloads against the scheduler, checked after every step.

A hypothesis state machine adds requests (sharing prefixes, so the prefix cache hits), steps
with fake sampled tokens and random stops, aborts (waiting, mid-prefill, mid-decode, and
between schedule() and update_from_output()), forks, and runs on pools small enough to force
preemption (recompute and swap). Every step is executed by the fake KV worker, which checks
that each row reads exactly its own prefix; an independent model of every request's tokens
and finish condition is compared with the scheduler's; invariants are checked after every
operation; at quiescence every block is free again.
"""
import numpy as np
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig

from pagedrun_tests_pyx_fake_worker import FakeWorker  # registered by tests/conftest.py

VOCAB = 4  # tiny, so prompts share blocks often
MAX_QUIESCE_STEPS = 3000


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 3, 4, 8]),
                extra_blocks=st.integers(0, 12),
                max_num_seqs=st.integers(1, 6),
                max_num_batched_tokens=st.integers(1, 40),
                max_model_len=st.integers(8, 40),
                caching=st.booleans(),
                swap=st.booleans(),
                num_cpu_blocks=st.integers(0, 40),
                threshold=st.sampled_from([0, 0, 3, 7]),
                prefixes=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
                                  min_size=1, max_size=3))
    def setup(self, block_size, extra_blocks, max_num_seqs, max_num_batched_tokens,
              max_model_len, caching, swap, num_cpu_blocks, threshold, prefixes):
        # Room for one request of max_model_len plus a little: concurrent requests compete.
        num_gpu_blocks = -(-max_model_len // block_size) + extra_blocks
        self.cfg = SchedulerConfig(
            num_gpu_blocks=num_gpu_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=caching, num_cpu_blocks=num_cpu_blocks if swap else 0,
            preemption_mode="swap" if swap else "recompute",
            long_prefill_token_threshold=threshold, check_invariants=True)
        self.sched = Scheduler(self.cfg)
        self.worker = FakeWorker(num_gpu_blocks, self.cfg.num_cpu_blocks, block_size)
        self.prefixes = prefixes
        self.tokens = {}       # request id -> expected token ids
        self.max_tokens = {}
        self.num_outputs = {}
        self.next_id = 0
        self.rng = np.random.default_rng(0)

    def _fits(self, prompt_len, max_tokens):
        longest = min(prompt_len + max_tokens, self.cfg.max_model_len)
        return -(-longest // self.cfg.block_size) <= self.cfg.num_gpu_blocks

    @rule(prefix_index=st.integers(0, 2), cut=st.integers(0, 24),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=12),
          max_tokens=st.integers(1, 24), priority=st.sampled_from([0, 0, 0, 1, -1]),
          salt=st.sampled_from([0, 0, 1]))
    def add(self, prefix_index, cut, suffix, max_tokens, priority, salt):
        prefix = self.prefixes[prefix_index % len(self.prefixes)]
        prompt = np.array(prefix[:cut] + suffix, dtype=np.int32)
        rid = self.next_id
        self.next_id += 1
        ok = (len(prompt) >= 1 and len(prompt) <= self.cfg.max_model_len
              and self._fits(len(prompt), max_tokens))
        try:
            self.sched.add_request(rid, prompt, max_tokens, priority=priority, cache_salt=salt)
        except ValueError:
            assert not ok, f"valid request {rid} rejected"
            return
        assert ok, f"invalid request {rid} accepted"
        self.tokens[rid] = prompt.tolist()
        self.max_tokens[rid] = max_tokens
        self.num_outputs[rid] = 0

    def _schedule_and_execute(self):
        self.mid_step = True  # cleared by _update; a failure in between leaves it set
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.cfg.max_num_batched_tokens
        assert out.num_reqs <= self.cfg.max_num_seqs
        written = out.slot_mapping
        assert len(np.unique(written)) == len(written), "a slot written twice in one step"
        assert set(out.req_ids.tolist()) <= set(self.tokens)
        self.worker.execute(self.sched, out)
        # Coverage of the interesting paths, visible with --hypothesis-show-statistics.
        for name in ("preempted_ids", "block_copies", "swap_out", "swap_in"):
            if len(getattr(out, name)):
                event(f"step with {name}")
        if out.num_prefix_cached_tokens.sum():
            event("step with a prefix hit")
        return out

    def _update(self, out, abort_row=None):
        sampled = self.rng.integers(0, VOCAB, out.num_reqs).astype(np.int32)
        stops = self.rng.random(out.num_reqs) < 0.05
        aborted = None
        if abort_row is not None and out.num_reqs:
            aborted = int(out.req_ids[abort_row % out.num_reqs])
            assert self.sched.abort_request(aborted)
            self._forget(aborted)
        finished = self.sched.update_from_output(out, sampled, stops)
        expected_finished = []
        for k in range(out.num_reqs):
            rid = int(out.req_ids[k])
            if rid == aborted or not out.sample_mask[k]:
                continue
            self.tokens[rid].append(int(sampled[k]))
            self.num_outputs[rid] += 1
            if (stops[k] or self.num_outputs[rid] >= self.max_tokens[rid]
                    or len(self.tokens[rid]) >= self.cfg.max_model_len):
                expected_finished.append(rid)
        assert sorted(finished) == sorted(expected_finished)
        for rid in finished:
            self._forget(rid)
        self.mid_step = False

    def _forget(self, rid):
        del self.tokens[rid], self.max_tokens[rid], self.num_outputs[rid]

    @rule()
    def step(self):
        self._update(self._schedule_and_execute())

    @rule(row=st.integers(0, 10))
    def abort_between_schedule_and_update(self, row):
        self._update(self._schedule_and_execute(), abort_row=row)

    @precondition(lambda self: len(self.tokens) > 0)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        rid = sorted(self.tokens)[pick % len(self.tokens)]
        assert self.sched.abort_request(rid)
        assert not self.sched.abort_request(rid)
        self._forget(rid)

    @precondition(lambda self: len(self.tokens) > 0)
    @rule(pick=st.integers(0, 1000), new_last=st.one_of(st.none(), st.integers(0, VOCAB - 1)))
    def fork(self, pick, new_last):
        forkable = [r for r in sorted(self.tokens)
                    if self.sched.get_request_status(r) == "running"
                    and self.sched.get_num_computed_tokens(r) == len(self.tokens[r]) - 1]
        if not forkable:
            return
        parent = forkable[pick % len(forkable)]
        child = self.next_id
        self.next_id += 1
        self.sched.fork_request(parent, child, new_last)
        self.tokens[child] = list(self.tokens[parent])
        if new_last is not None:
            self.tokens[child][-1] = new_last
        self.max_tokens[child] = self.max_tokens[parent]
        self.num_outputs[child] = self.num_outputs[parent]

    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        self.sched.check_invariants()
        assert self.sched.num_running + self.sched.num_waiting == len(self.tokens)
        for rid, toks in self.tokens.items():
            assert self.sched.get_token_ids(rid).tolist() == toks, rid

    def teardown(self):
        if not hasattr(self, "sched") or getattr(self, "mid_step", False):
            return  # not set up, or a step failed: the failure is the report
        for _ in range(MAX_QUIESCE_STEPS):
            if not self.sched.has_unfinished_requests():
                break
            self._update(self._schedule_and_execute())
        else:
            raise AssertionError("requests never finished (livelock)")
        assert not self.tokens
        stats = self.sched.get_stats()
        assert stats["num_free_blocks"] == self.cfg.num_gpu_blocks
        assert stats["num_free_cpu_blocks"] == self.cfg.num_cpu_blocks
        self.sched.check_invariants()


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_scheduler_state_machine = SchedulerMachine.TestCase
