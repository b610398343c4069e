# cython: language_level=3
"""Per-request block tables on top of the block pool: slots, prefix hits, fork / COW, swap.

What this module owns
- For each request slot (the scheduler's index), its block table: logical block i -> physical
  block, plus the chained hash and canonical cached block of every full block (the chain the
  prefix cache verifies against).
- `find_cached_prefix`: the longest run of cached full blocks matching a prompt, capped so at
  least one prompt token is left to compute (its logits give the first sampled token).
- `allocate_slots`: blocks for the next N tokens (a chunk), all-or-nothing. When the first
  token to write falls into a partly filled block that is shared (after a fork), the request
  gets a private copy first and a (src, dst) block-copy op is recorded for the worker.
- `cache_full_blocks`: offers blocks that became full (KV written) to the prefix cache.
- `free_blocks`: drops the request's references, last block first, so a sequence's tail is
  evicted before its prefix.
- `fork`: the child shares every block (ref counts rise).
- `swap_out` / `swap_in`: move a request's blocks to / from a host-side BlockPool, recording
  (gpu, host) and (host, gpu) pairs for the worker.
Ops accumulate until `clear_ops()` (the scheduler clears them at the start of each step).

A ref count equals the number of block tables holding the block; cache entries hold none.
"""
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memset
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

import numpy as np

from pagedrun.pyx.block_pool cimport BlockPool, NO_BLOCK, hash_block_tokens

# First capacity of a request's block table; tables double when they fill.
cdef enum:
    INITIAL_TABLE_CAPACITY = 16
    INITIAL_OPS_CAPACITY = 64


cdef inline int32_t cdiv(int32_t a, int32_t b) noexcept nogil:
    return (a + b - 1) // b


cdef inline int _grow(void** p, size_t num_bytes) noexcept nogil:
    """realloc *p to num_bytes; -1 (and *p untouched) when out of host memory."""
    cdef void* grown = realloc(p[0], num_bytes)
    if grown == NULL:
        return -1
    p[0] = grown
    return 0


cdef class KVCacheManager:

    def __cinit__(self, int32_t num_gpu_blocks, int32_t block_size, int32_t num_cpu_blocks=0,
                  bint enable_caching=True, int32_t num_slots=64):
        self.gpu_pool = BlockPool(num_gpu_blocks, block_size, enable_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, block_size, False) if num_cpu_blocks > 0 else None
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.reqs = NULL
        self.num_slots = 0
        self.copy_cap = INITIAL_OPS_CAPACITY
        self.swap_out_cap = INITIAL_OPS_CAPACITY
        self.swap_in_cap = INITIAL_OPS_CAPACITY
        self.copy_ops = <int32_t*>malloc(2 * self.copy_cap * sizeof(int32_t))
        self.swap_out_ops = <int32_t*>malloc(2 * self.swap_out_cap * sizeof(int32_t))
        self.swap_in_ops = <int32_t*>malloc(2 * self.swap_in_cap * sizeof(int32_t))
        if self.copy_ops == NULL or self.swap_out_ops == NULL or self.swap_in_ops == NULL:
            raise MemoryError("KVCacheManager: out of host memory")
        self.clear_ops()
        self.ensure_slots(num_slots)

    def __dealloc__(self):
        cdef int32_t s
        if self.reqs != NULL:
            for s in range(self.num_slots):
                free(self.reqs[s].block_ids); free(self.reqs[s].block_hashes)
                free(self.reqs[s].canonical); free(self.reqs[s].canonical_gen)
            free(self.reqs)
        free(self.copy_ops); free(self.swap_out_ops); free(self.swap_in_ops)

    cdef int ensure_slots(self, int32_t num_slots) except -1:
        if num_slots <= self.num_slots:
            return 0
        cdef ReqBlocks* grown = <ReqBlocks*>realloc(self.reqs, num_slots * sizeof(ReqBlocks))
        if grown == NULL:
            raise MemoryError("KVCacheManager: out of host memory")
        memset(&grown[self.num_slots], 0, (num_slots - self.num_slots) * sizeof(ReqBlocks))
        self.reqs = grown
        self.num_slots = num_slots
        return 0

    cdef int _reserve(self, int32_t s, int32_t n) noexcept nogil:
        """Make slot s's arrays hold at least n blocks; -1 when out of host memory."""
        cdef ReqBlocks* rb = &self.reqs[s]
        if n <= rb.capacity:
            return 0
        cdef int32_t cap = rb.capacity if rb.capacity > 0 else INITIAL_TABLE_CAPACITY
        while cap < n:
            cap *= 2
        # Each array is grown in place, so a failure leaves every array valid (some larger).
        if (_grow(<void**>&rb.block_ids, cap * sizeof(int32_t)) < 0
                or _grow(<void**>&rb.block_hashes, cap * sizeof(uint64_t)) < 0
                or _grow(<void**>&rb.canonical, cap * sizeof(int32_t)) < 0
                or _grow(<void**>&rb.canonical_gen, cap * sizeof(uint32_t)) < 0):
            return -1
        rb.capacity = cap
        return 0

    cdef int _push_op(self, int32_t** ops, int32_t* num_ops, int32_t* cap,
                      int32_t a, int32_t b) noexcept nogil:
        cdef int32_t* grown
        if num_ops[0] == cap[0]:
            grown = <int32_t*>realloc(ops[0], 4 * cap[0] * sizeof(int32_t))
            if grown == NULL:
                return -1
            ops[0] = grown
            cap[0] *= 2
        ops[0][2 * num_ops[0]] = a
        ops[0][2 * num_ops[0] + 1] = b
        num_ops[0] += 1
        return 0

    cdef void clear_ops(self) noexcept nogil:
        self.num_copy_ops = 0
        self.num_swap_out_ops = 0
        self.num_swap_in_ops = 0

    # ---------------------------------------------------------------- admission
    cdef int32_t find_cached_prefix(self, int32_t s, const int32_t* token_ids,
                                    int32_t num_tokens, uint64_t extra_key) noexcept nogil:
        """Stage the longest verified cached prefix of a slot holding no blocks; returns the
        number of hit blocks. At least one token is left uncached (its logits are needed)."""
        cdef ReqBlocks* rb = &self.reqs[s]
        rb.num_pending_hits = 0
        if not self.enable_caching or rb.num_blocks != 0:
            return 0
        cdef int32_t bs = self.block_size
        cdef int32_t max_hits = (num_tokens - 1) // bs
        if self._reserve(s, max_hits) < 0:
            return 0
        cdef uint64_t h = 0
        cdef int32_t parent = NO_BLOCK
        cdef int32_t i, b
        for i in range(max_hits):
            h = hash_block_tokens(h, &token_ids[i * bs], bs, extra_key)
            b = self.gpu_pool.lookup(h, &token_ids[i * bs], parent, extra_key)
            if b == NO_BLOCK:
                break
            rb.block_ids[i] = b
            rb.block_hashes[i] = h
            rb.canonical[i] = b
            rb.canonical_gen[i] = self.gpu_pool.gen[b]
            rb.num_pending_hits = i + 1
            parent = b
        return rb.num_pending_hits

    cdef bint allocate_slots(self, int32_t s, int32_t num_computed_tokens,
                             int32_t num_new_tokens) noexcept nogil:
        """Blocks so that tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)
        have slots, taking staged prefix hits first (num_computed_tokens counts them). All or
        nothing: False leaves the slot's table as it was (staged hits are dropped)."""
        cdef ReqBlocks* rb = &self.reqs[s]
        cdef int32_t bs = self.block_size
        cdef int32_t num_hits = rb.num_pending_hits
        rb.num_pending_hits = 0
        cdef int32_t num_held = rb.num_blocks + num_hits
        cdef int32_t num_needed = cdiv(num_computed_tokens + num_new_tokens, bs)
        cdef int32_t num_fresh = num_needed - num_held if num_needed > num_held else 0
        cdef int32_t i, b, cow_index = -1
        # Copy-on-write: the first token to write lands in a partly filled, shared block.
        if rb.may_share_partial and num_computed_tokens % bs != 0 and num_new_tokens > 0:
            i = num_computed_tokens // bs
            if i < rb.num_blocks and self.gpu_pool.ref_cnt[rb.block_ids[i]] > 1:
                cow_index = i
        cdef int32_t num_free_needed = num_fresh + (1 if cow_index >= 0 else 0)
        for i in range(rb.num_blocks, num_held):
            if self.gpu_pool.ref_cnt[rb.block_ids[i]] == 0:
                num_free_needed += 1  # a hit on a free cached block takes it off the free list
        if self.gpu_pool.num_free_blocks < num_free_needed or self._reserve(s, num_needed) < 0:
            return False
        for i in range(rb.num_blocks, num_held):
            self.gpu_pool.incref(rb.block_ids[i])
        if num_hits > 0:
            rb.num_hashed_blocks = num_held
        rb.num_blocks = num_held
        if cow_index >= 0:
            b = self.gpu_pool.allocate()
            if self._push_op(&self.copy_ops, &self.num_copy_ops, &self.copy_cap,
                             rb.block_ids[cow_index], b) < 0:
                self.gpu_pool.decref(b)
                return False
            self.gpu_pool.decref(rb.block_ids[cow_index])
            rb.block_ids[cow_index] = b
        for i in range(num_fresh):
            rb.block_ids[rb.num_blocks] = self.gpu_pool.allocate()
            rb.num_blocks += 1
        if num_new_tokens > 0:
            rb.may_share_partial = False  # the partial block is private from now on
        return True

    cdef void free_blocks(self, int32_t s) noexcept nogil:
        """Drop every block reference of slot s, last block first."""
        cdef ReqBlocks* rb = &self.reqs[s]
        cdef int32_t i
        for i in range(rb.num_blocks - 1, -1, -1):
            if rb.on_host:
                self.cpu_pool.decref(rb.block_ids[i])
            else:
                self.gpu_pool.decref(rb.block_ids[i])
        rb.num_blocks = 0
        rb.num_hashed_blocks = 0
        rb.num_pending_hits = 0
        rb.on_host = False
        rb.may_share_partial = False

    cdef void trim_blocks(self, int32_t s, int32_t num_tokens) noexcept nogil:
        """Drop the blocks past the first cdiv(num_tokens, block_size), last first: a
        speculative step's blocks that hold only rejected tokens (never offered to the prefix
        cache, since only computed -- verified -- tokens are hashed)."""
        cdef ReqBlocks* rb = &self.reqs[s]
        cdef int32_t keep = cdiv(num_tokens, self.block_size)
        while rb.num_blocks > keep:
            rb.num_blocks -= 1
            self.gpu_pool.decref(rb.block_ids[rb.num_blocks])
        if rb.num_hashed_blocks > rb.num_blocks:
            rb.num_hashed_blocks = rb.num_blocks

    cdef void cache_full_blocks(self, int32_t s, const int32_t* token_ids,
                                int32_t num_computed_tokens, uint64_t extra_key) noexcept nogil:
        """Offer the blocks that are full of computed KV to the prefix cache."""
        if not self.enable_caching:
            return
        cdef ReqBlocks* rb = &self.reqs[s]
        cdef int32_t bs = self.block_size
        cdef int32_t num_full = num_computed_tokens // bs
        if num_full > rb.num_blocks:
            num_full = rb.num_blocks
        cdef int32_t i, parent, canon
        cdef uint32_t parent_gen
        cdef uint64_t parent_hash
        for i in range(rb.num_hashed_blocks, num_full):
            if i == 0:
                parent, parent_gen, parent_hash = NO_BLOCK, 0, 0
            else:
                parent, parent_gen, parent_hash = (rb.canonical[i - 1], rb.canonical_gen[i - 1],
                                                   rb.block_hashes[i - 1])
            rb.block_hashes[i] = hash_block_tokens(parent_hash, &token_ids[i * bs], bs, extra_key)
            canon = UNCACHEABLE
            if parent != UNCACHEABLE:
                canon = self.gpu_pool.cache_block(rb.block_ids[i], rb.block_hashes[i],
                                                  &token_ids[i * bs], parent, parent_gen,
                                                  extra_key)
                if canon == NO_BLOCK:
                    canon = UNCACHEABLE
            rb.canonical[i] = canon
            rb.canonical_gen[i] = self.gpu_pool.gen[canon] if canon >= 0 else 0
        if num_full > rb.num_hashed_blocks:
            rb.num_hashed_blocks = num_full

    # ---------------------------------------------------------------- fork
    cdef bint fork(self, int32_t p, int32_t c) noexcept nogil:
        """The child slot c shares every block of the parent slot p."""
        cdef ReqBlocks* rp = &self.reqs[p]
        if self._reserve(c, rp.num_blocks) < 0:
            return False
        rp = &self.reqs[p]
        cdef ReqBlocks* rc = &self.reqs[c]
        cdef int32_t n = rp.num_blocks
        cdef int32_t i
        memcpy(rc.block_ids, rp.block_ids, n * sizeof(int32_t))
        memcpy(rc.block_hashes, rp.block_hashes, n * sizeof(uint64_t))
        memcpy(rc.canonical, rp.canonical, n * sizeof(int32_t))
        memcpy(rc.canonical_gen, rp.canonical_gen, n * sizeof(uint32_t))
        rc.num_blocks = n
        rc.num_hashed_blocks = rp.num_hashed_blocks
        rc.num_pending_hits = 0
        rc.on_host = False
        rp.may_share_partial = True
        rc.may_share_partial = True
        for i in range(n):
            self.gpu_pool.incref(rp.block_ids[i])
        return True

    # ---------------------------------------------------------------- swap
    cdef bint can_swap_out(self, int32_t s) noexcept nogil:
        return (self.cpu_pool is not None and not self.reqs[s].on_host
                and self.cpu_pool.num_free_blocks >= self.reqs[s].num_blocks)

    cdef void swap_out(self, int32_t s) noexcept nogil:
        """Move slot s's blocks to host blocks (caller checked can_swap_out)."""
        cdef ReqBlocks* rb = &self.reqs[s]
        cdef int32_t i, g, h
        for i in range(rb.num_blocks - 1, -1, -1):
            g = rb.block_ids[i]
            h = self.cpu_pool.allocate()
            self._push_op(&self.swap_out_ops, &self.num_swap_out_ops, &self.swap_out_cap, g, h)
            self.gpu_pool.decref(g)
            rb.block_ids[i] = h
        rb.on_host = True

    cdef bint can_swap_in(self, int32_t s, int32_t num_tokens_after) noexcept nogil:
        cdef int32_t needed = cdiv(num_tokens_after, self.block_size)
        if needed < self.reqs[s].num_blocks:
            needed = self.reqs[s].num_blocks
        return self.reqs[s].on_host and self.gpu_pool.num_free_blocks >= needed

    cdef void swap_in(self, int32_t s) noexcept nogil:
        """Move slot s's blocks back to fresh GPU blocks (caller checked can_swap_in)."""
        cdef ReqBlocks* rb = &self.reqs[s]
        cdef int32_t i, g, h
        for i in range(rb.num_blocks):
            h = rb.block_ids[i]
            g = self.gpu_pool.allocate()
            self._push_op(&self.swap_in_ops, &self.num_swap_in_ops, &self.swap_in_cap, h, g)
            self.cpu_pool.decref(h)
            rb.block_ids[i] = g
        rb.on_host = False

    # ---------------------------------------------------------------- Python-facing (tests)
    def py_ensure_slots(self, int32_t num_slots) -> None:
        self.ensure_slots(num_slots)

    def _check_slot(self, int32_t s):
        if not 0 <= s < self.num_slots:
            raise IndexError(f"slot {s} out of range [0, {self.num_slots})")

    def py_find_cached_prefix(self, int32_t slot, const int32_t[::1] token_ids,
                              uint64_t extra_key=0) -> int:
        """Stage prefix hits for an empty slot; returns the number of hit blocks."""
        self._check_slot(slot)
        if token_ids.shape[0] < 1:
            raise ValueError("token_ids must not be empty")
        return self.find_cached_prefix(slot, &token_ids[0], token_ids.shape[0], extra_key)

    def py_allocate_slots(self, int32_t slot, int32_t num_computed_tokens,
                          int32_t num_new_tokens) -> bool:
        self._check_slot(slot)
        return self.allocate_slots(slot, num_computed_tokens, num_new_tokens)

    def py_trim(self, int32_t slot, int32_t num_tokens) -> None:
        self._check_slot(slot)
        self.trim_blocks(slot, num_tokens)

    def py_free(self, int32_t slot) -> None:
        self._check_slot(slot)
        self.free_blocks(slot)

    def py_cache_full_blocks(self, int32_t slot, const int32_t[::1] token_ids,
                             int32_t num_computed_tokens, uint64_t extra_key=0) -> None:
        self._check_slot(slot)
        if token_ids.shape[0] < num_computed_tokens:
            raise ValueError("token_ids shorter than num_computed_tokens")
        if num_computed_tokens >= self.block_size:
            self.cache_full_blocks(slot, &token_ids[0], num_computed_tokens, extra_key)

    def py_fork(self, int32_t parent_slot, int32_t child_slot) -> None:
        self._check_slot(parent_slot)
        self._check_slot(child_slot)
        if self.reqs[child_slot].num_blocks != 0:
            raise ValueError(f"child slot {child_slot} holds blocks")
        if not self.fork(parent_slot, child_slot):
            raise MemoryError("fork: out of host memory")

    def py_swap_out(self, int32_t slot) -> bool:
        self._check_slot(slot)
        if not self.can_swap_out(slot):
            return False
        self.swap_out(slot)
        return True

    def py_swap_in(self, int32_t slot, int32_t num_tokens_after) -> bool:
        self._check_slot(slot)
        if not self.can_swap_in(slot, num_tokens_after):
            return False
        self.swap_in(slot)
        return True

    def py_clear_ops(self) -> None:
        self.clear_ops()

    def block_table(self, int32_t slot):
        """int32 [num_blocks] copy of the slot's block table."""
        self._check_slot(slot)
        cdef ReqBlocks* rb = &self.reqs[slot]
        out = np.empty(rb.num_blocks, dtype=np.int32)
        cdef int32_t[::1] view = out
        cdef int32_t i
        for i in range(rb.num_blocks):
            view[i] = rb.block_ids[i]
        return out

    def is_on_host(self, int32_t slot) -> bool:
        self._check_slot(slot)
        return bool(self.reqs[slot].on_host)

    def ops(self) -> dict:
        """The step's ops: {"block_copies", "swap_out", "swap_in"}: int32 [k, 2] copies."""
        return {"block_copies": _pairs(self.copy_ops, self.num_copy_ops),
                "swap_out": _pairs(self.swap_out_ops, self.num_swap_out_ops),
                "swap_in": _pairs(self.swap_in_ops, self.num_swap_in_ops)}

    def count_refs(self):
        """Independent ref counts: (gpu int64 [num_gpu_blocks], host int64 [num_cpu_blocks])."""
        gpu = np.zeros(self.gpu_pool.num_blocks, dtype=np.int64)
        cpu = np.zeros(self.cpu_pool.num_blocks if self.cpu_pool is not None else 0, dtype=np.int64)
        cdef int32_t s, i
        for s in range(self.num_slots):
            for i in range(self.reqs[s].num_blocks):
                if self.reqs[s].on_host:
                    cpu[self.reqs[s].block_ids[i]] += 1
                else:
                    gpu[self.reqs[s].block_ids[i]] += 1
        return gpu, cpu

    def check_invariants(self) -> None:
        """Pools consistent and every ref count equal to the block tables holding the block."""
        gpu, cpu = self.count_refs()
        self.gpu_pool.check_invariants(gpu)
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants(cpu)


cdef object _pairs(const int32_t* ops, int32_t n):
    out = np.empty((n, 2), dtype=np.int32)
    cdef int32_t[:, ::1] view = out
    cdef int32_t i
    for i in range(n):
        view[i, 0] = ops[2 * i]
        view[i, 1] = ops[2 * i + 1]
    return out
