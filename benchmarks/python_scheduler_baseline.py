"""Plain-Python baseline of pyx/ (block pool + KV cache manager + scheduler), not shipped.

The same algorithm as the Cython modules, written the way one would in plain Python (objects
per request, lists, dicts, an OrderedDict free list), for benchmarks/bench_scheduler.py to
time side by side. It makes the same decisions step by step (same block ids, same rows, same
preemptions), which tests/pyx/test_baseline_agreement.py checks, so the speedup compares like
with like. Left out because the benchmark traces do not use them: swap preemption, fork,
invariant checks.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict

import numpy as np

NO_BLOCK = -1
UNCACHEABLE = -2


class PyBlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.free = OrderedDict((b, None) for b in range(num_blocks))  # head = next evicted
        self.gen = [0] * num_blocks
        self.cached = {}      # block -> (hash, tokens tuple, parent, parent_gen, extra_key)
        self.hash_to_block = {}
        self.num_queries = self.num_hits = self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            return NO_BLOCK
        b, _ = self.free.popitem(last=False)
        if b in self.cached:
            self._evict(b)
        self.ref_cnt[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.ref_cnt[b] == 0:
            del self.free[b]
        self.ref_cnt[b] += 1

    def decref(self, b: int) -> None:
        self.ref_cnt[b] -= 1
        if self.ref_cnt[b] == 0:
            self.free[b] = None
            if b not in self.cached:
                self.free.move_to_end(b, last=False)

    def _evict(self, b: int) -> None:
        h = self.cached.pop(b)[0]
        if self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
        self.gen[b] += 1
        self.num_evictions += 1

    def _matches(self, b, tokens, parent, parent_gen, extra_key) -> bool:
        _, toks, p, pg, key = self.cached[b]
        if p != parent or key != extra_key:
            return False
        if parent != NO_BLOCK and pg != parent_gen:
            return False
        return toks == tokens

    def lookup(self, h, tokens, parent, extra_key) -> int:
        self.num_queries += 1
        b = self.hash_to_block.get(h)
        if b is None:
            return NO_BLOCK
        pg = self.gen[parent] if parent != NO_BLOCK else 0
        if not self._matches(b, tokens, parent, pg, extra_key):
            return NO_BLOCK
        self.num_hits += 1
        return b

    def cache_block(self, b, h, tokens, parent, parent_gen, extra_key) -> int:
        if b in self.cached:
            return b
        if parent != NO_BLOCK and self.gen[parent] != parent_gen:
            return NO_BLOCK
        other = self.hash_to_block.get(h)
        if other is not None:
            if self._matches(other, tokens, parent, parent_gen, extra_key):
                return other
            op = self.cached[other][2]
            if op != NO_BLOCK and self.gen[op] != self.cached[other][3]:
                del self.hash_to_block[h]
                del self.cached[other]
                self.gen[other] += 1
                if self.ref_cnt[other] == 0:
                    del self.free[other]
                    self.free[other] = None
                    self.free.move_to_end(other, last=False)
            else:
                return NO_BLOCK
        self.hash_to_block[h] = b
        self.cached[b] = (h, tokens, parent, parent_gen, extra_key)
        return b


class PyRequest:
    __slots__ = ("req_id", "token_ids", "num_computed_tokens", "num_output_tokens", "max_tokens",
                 "priority", "arrival_seq", "cache_salt", "status", "block_ids", "block_hashes",
                 "canonical", "canonical_gen", "num_hashed_blocks", "pending_hits")

    def __init__(self, req_id, token_ids, max_tokens, priority, arrival_seq, cache_salt):
        self.req_id = req_id
        self.token_ids = list(token_ids)
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.cache_salt = cache_salt
        self.status = "waiting"
        self.block_ids = []
        self.block_hashes = []
        self.canonical = []
        self.canonical_gen = []
        self.num_hashed_blocks = 0
        self.pending_hits = []

    def key(self):
        return (self.priority, self.arrival_seq)


class PyKVCacheManager:
    def __init__(self, num_gpu_blocks, block_size, enable_caching=True):
        self.pool = PyBlockPool(num_gpu_blocks, block_size, enable_caching)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.copy_ops = []

    def find_cached_prefix(self, req) -> int:
        req.pending_hits = []
        if not self.enable_caching or req.block_ids:
            return 0
        bs = self.block_size
        h, parent = 0, NO_BLOCK
        for i in range((len(req.token_ids) - 1) // bs):
            toks = tuple(req.token_ids[i * bs:(i + 1) * bs])
            h = hash((h, toks, req.cache_salt))
            b = self.pool.lookup(h, toks, parent, req.cache_salt)
            if b == NO_BLOCK:
                break
            req.pending_hits.append((b, h))
            parent = b
        return len(req.pending_hits)

    def allocate_slots(self, req, num_computed_tokens, num_new_tokens) -> bool:
        bs, pool = self.block_size, self.pool
        hits, req.pending_hits = req.pending_hits, []
        num_held = len(req.block_ids) + len(hits)
        num_needed = -(-(num_computed_tokens + num_new_tokens) // bs)
        num_fresh = max(0, num_needed - num_held)
        cow_index = -1
        if num_computed_tokens % bs and num_new_tokens > 0:
            i = num_computed_tokens // bs
            if i < len(req.block_ids) and pool.ref_cnt[req.block_ids[i]] > 1:
                cow_index = i
        free_needed = num_fresh + (cow_index >= 0) + sum(pool.ref_cnt[b] == 0 for b, _ in hits)
        if pool.num_free_blocks < free_needed:
            return False
        for b, h in hits:
            pool.incref(b)
            req.block_ids.append(b)
            req.block_hashes.append(h)
            req.canonical.append(b)
            req.canonical_gen.append(pool.gen[b])
        if hits:
            req.num_hashed_blocks = len(req.block_ids)
        if cow_index >= 0:
            b = pool.allocate()
            self.copy_ops.append((req.block_ids[cow_index], b))
            pool.decref(req.block_ids[cow_index])
            req.block_ids[cow_index] = b
        for _ in range(num_fresh):
            req.block_ids.append(pool.allocate())
        return True

    def free_blocks(self, req) -> None:
        for b in reversed(req.block_ids):
            self.pool.decref(b)
        req.block_ids, req.block_hashes, req.canonical, req.canonical_gen = [], [], [], []
        req.num_hashed_blocks = 0

    def cache_full_blocks(self, req) -> None:
        if not self.enable_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_ids))
        for i in range(req.num_hashed_blocks, num_full):
            if i == 0:
                parent, parent_gen, parent_hash = NO_BLOCK, 0, 0
            else:
                parent, parent_gen, parent_hash = (req.canonical[i - 1], req.canonical_gen[i - 1],
                                                   req.block_hashes[i - 1])
            toks = tuple(req.token_ids[i * bs:(i + 1) * bs])
            h = hash((parent_hash, toks, req.cache_salt))
            canon = UNCACHEABLE
            if parent != UNCACHEABLE:
                canon = self.pool.cache_block(req.block_ids[i], h, toks, parent, parent_gen,
                                              req.cache_salt)
                if canon == NO_BLOCK:
                    canon = UNCACHEABLE
            gen = self.pool.gen[canon] if canon >= 0 else 0
            for arr, v in ((req.block_hashes, h), (req.canonical, canon), (req.canonical_gen, gen)):
                if i < len(arr):
                    arr[i] = v
                else:
                    arr.append(v)
        req.num_hashed_blocks = max(req.num_hashed_blocks, num_full)


class PySchedulerOutput:
    pass


class PyScheduler:
    """Same constructor knobs and step API as pagedrun.pyx.scheduler.Scheduler (subset)."""

    def __init__(self, num_gpu_blocks, block_size=16, max_num_seqs=256,
                 max_num_batched_tokens=2048, max_model_len=8192, enable_prefix_caching=True,
                 long_prefill_token_threshold=0):
        self.kv = PyKVCacheManager(num_gpu_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.threshold = long_prefill_token_threshold
        self.requests = {}
        self.running = []
        self.waiting = []        # sorted by key, descending: the next one is last
        self.next_arrival_seq = 0
        self.num_preemptions = self.prefix_queries = self.prefix_hits = 0

    def add_request(self, request_id, prompt_token_ids, max_tokens, priority=0, cache_salt=0):
        req = PyRequest(request_id, np.asarray(prompt_token_ids).tolist(), max_tokens, priority,
                        self.next_arrival_seq, cache_salt)
        self.next_arrival_seq += 1
        self.requests[request_id] = req
        self._enqueue(req)

    def _enqueue(self, req):
        keys = [(-r.priority, -r.arrival_seq) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, (-req.priority, -req.arrival_seq)), req)

    def abort_request(self, request_id) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        (self.running if req.status == "running" else self.waiting).remove(req)
        self.kv.free_blocks(req)
        req.status = "aborted"
        return True

    @property
    def num_running(self):
        return len(self.running)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def _preempt(self, req, preempted):
        self.kv.free_blocks(req)
        req.num_computed_tokens = 0
        req.status = "waiting"
        self._enqueue(req)
        preempted.append(req)
        self.num_preemptions += 1

    def schedule(self):
        bs, kv = self.block_size, self.kv
        kv.copy_ops = []
        budget = self.max_num_batched_tokens
        rows, preempted, new = [], [], []
        decodes_left = sum(1 for r in self.running
                           if len(r.token_ids) - r.num_computed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = len(req.token_ids) - req.num_computed_tokens
            if remaining == 1:
                decodes_left -= 1
                n = 1
            else:
                n = remaining
                if self.threshold > 0:
                    n = min(n, self.threshold)
                n = min(n, budget - decodes_left)
                if n <= 0:
                    i += 1
                    continue
            preempted_self = False
            while not kv.allocate_slots(req, req.num_computed_tokens, n):
                victim = self.running.pop()
                if victim is not req and len(victim.token_ids) - victim.num_computed_tokens == 1:
                    decodes_left -= 1
                self._preempt(victim, preempted)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break
            rows.append((req, n, req.num_computed_tokens))
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[-1]
                hits = kv.find_cached_prefix(req)
                n = len(req.token_ids) - hits * bs
                if self.threshold > 0:
                    n = min(n, self.threshold)
                n = min(n, budget)
                if not kv.allocate_slots(req, hits * bs, n):
                    break
                req.num_computed_tokens = hits * bs
                self.prefix_queries += len(req.token_ids)
                self.prefix_hits += hits * bs
                self.waiting.pop()
                req.status = "running"
                self.running.append(req)
                new.append((req.req_id, hits * bs))
                rows.append((req, n, req.num_computed_tokens))
                budget -= n
        return self._build_output(rows, preempted, new)

    def _build_output(self, rows, preempted, new):
        bs = self.block_size
        input_ids, positions, slot_mapping, qsl = [], [], [], [0]
        qlens, ctx, ncb, sample, tables = [], [], [], [], []
        for req, n, start in rows:
            table = req.block_ids
            for pos in range(start, start + n):
                input_ids.append(req.token_ids[pos])
                positions.append(pos)
                slot_mapping.append(table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            qlens.append(n)
            ncb.append(start)
            ctx.append(start + n)
            sample.append(start + n == len(req.token_ids))
            tables.append(table[:-(-(start + n) // bs)])
        width = max((len(t) for t in tables), default=0)
        out = PySchedulerOutput()
        out.rows = [req for req, _, _ in rows]
        out.num_reqs = len(rows)
        out.req_ids = np.array([r.req_id for r, _, _ in rows], dtype=np.int64)
        out.input_token_ids = np.array(input_ids, dtype=np.int32)
        out.positions = np.array(positions, dtype=np.int32)
        out.slot_mapping = np.array(slot_mapping, dtype=np.int32)
        out.query_start_loc = np.array(qsl, dtype=np.int32)
        out.query_lens = np.array(qlens, dtype=np.int32)
        out.context_lens = np.array(ctx, dtype=np.int32)
        out.num_computed_tokens_before = np.array(ncb, dtype=np.int32)
        out.block_tables = np.array([t + [0] * (width - len(t)) for t in tables],
                                    dtype=np.int32).reshape(len(rows), width)
        out.sample_mask = np.array(sample, dtype=np.bool_)
        out.block_copies = np.array(self.kv.copy_ops, dtype=np.int32).reshape(-1, 2)
        out.preempted_ids = np.array([r.req_id for r in preempted], dtype=np.int64)
        out.new_req_ids = np.array([rid for rid, _ in new], dtype=np.int64)
        out.num_prefix_cached_tokens = np.array([c for _, c in new], dtype=np.int32)
        out.num_batched_tokens = len(input_ids)
        return out

    def update_from_output(self, out, sampled_token_ids, stop_mask=None):
        sampled = np.asarray(sampled_token_ids).tolist()
        stops = [False] * out.num_reqs if stop_mask is None else np.asarray(stop_mask).tolist()
        finished = []
        for k, req in enumerate(out.rows):
            if req.status != "running":
                continue
            req.num_computed_tokens += int(out.query_lens[k])
            if req.num_computed_tokens // self.block_size > req.num_hashed_blocks:
                self.kv.cache_full_blocks(req)
            if req.num_computed_tokens != len(req.token_ids):
                continue
            req.token_ids.append(sampled[k])
            req.num_output_tokens += 1
            if (stops[k] or req.num_output_tokens >= req.max_tokens
                    or len(req.token_ids) >= self.max_model_len):
                req.status = "finished"
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status == "running"]
            for req in finished:
                self.kv.free_blocks(req)
                del self.requests[req.req_id]
        return [r.req_id for r in finished]
