# cython: language_level=3
"""Physical KV blocks: free list in eviction order, ref counts, the prefix-cache hash map.

What this module owns
- `num_blocks` physical blocks of `block_size` token slots each; a block is *used* when its
  ref count (the number of block tables holding it) is > 0, *free* otherwise.
- The free list: an intrusive doubly linked list in C arrays (`free_prev`, `free_next`). Its
  order is the eviction order: `allocate()` takes the head. A block whose ref count drops to 0
  goes to the tail if it holds cached KV (least recently freed is evicted first) and to the
  head if it does not (it holds nothing worth keeping). A cache hit on a free block unlinks it
  from the middle in O(1).
- The prefix cache: `hash_to_block` maps a chained hash (parent block's hash, the block's
  token ids, an extra key for adapter / tenant salt) to a block id, for full blocks only.
  Cached blocks hold no reference: a cached block with ref count 0 stays on the free list
  and is evicted lazily when `allocate()` reaches it.
- Hits are verified, so a hash collision can never serve wrong KV: each cached block stores its
  token ids, extra key, and its *canonical parent* (the cached block id that held the previous
  block's content when this one was cached) with that parent's generation. A lookup walking a
  prompt from block 0 accepts a candidate only if tokens, key and parent id + generation all
  match the blocks already matched; by induction the whole prefix is then identical. A block's
  generation is bumped whenever it leaves the cache, which invalidates its cached children.

Python-facing methods (`allocate_block`, `free_block`, ...) exist for tests; the scheduler uses
the `cdef` methods declared in block_pool.pxd, all `nogil`.
"""
from libc.stdlib cimport calloc, free
from libc.string cimport memcmp, memcpy
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from cython.operator cimport dereference as deref

import numpy as np


cdef class BlockPool:

    def __cinit__(self, int32_t num_blocks, int32_t block_size, bint enable_caching=True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.free_prev = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.free_next = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.in_free_list = <char*>calloc(num_blocks, sizeof(char))
        self.is_cached = <char*>calloc(num_blocks, sizeof(char))
        self.cached_hash = <uint64_t*>calloc(num_blocks, sizeof(uint64_t))
        self.cached_extra_key = <uint64_t*>calloc(num_blocks, sizeof(uint64_t))
        self.cached_parent = <int32_t*>calloc(num_blocks, sizeof(int32_t))
        self.cached_parent_gen = <uint32_t*>calloc(num_blocks, sizeof(uint32_t))
        self.gen = <uint32_t*>calloc(num_blocks, sizeof(uint32_t))
        self.cached_tokens = <int32_t*>calloc(<size_t>num_blocks * block_size, sizeof(int32_t))
        if (self.ref_cnt == NULL or self.free_prev == NULL or self.free_next == NULL
                or self.in_free_list == NULL or self.is_cached == NULL or self.cached_hash == NULL
                or self.cached_extra_key == NULL or self.cached_parent == NULL
                or self.cached_parent_gen == NULL or self.gen == NULL
                or self.cached_tokens == NULL):
            raise MemoryError("BlockPool: out of host memory")
        self.free_head = NO_BLOCK
        self.free_tail = NO_BLOCK
        self.num_free_blocks = 0
        cdef int32_t b
        for b in range(num_blocks):
            self._push_tail(b)
        self.num_queries = 0
        self.num_hits = 0
        self.num_evictions = 0

    def __dealloc__(self):
        free(self.ref_cnt); free(self.free_prev); free(self.free_next); free(self.in_free_list)
        free(self.is_cached); free(self.cached_hash); free(self.cached_extra_key)
        free(self.cached_parent); free(self.cached_parent_gen); free(self.gen)
        free(self.cached_tokens)

    # ---------------------------------------------------------------- free list (intrusive)
    cdef void _unlink(self, int32_t b) noexcept nogil:
        cdef int32_t p = self.free_prev[b]
        cdef int32_t n = self.free_next[b]
        if p != NO_BLOCK:
            self.free_next[p] = n
        else:
            self.free_head = n
        if n != NO_BLOCK:
            self.free_prev[n] = p
        else:
            self.free_tail = p
        self.in_free_list[b] = 0
        self.num_free_blocks -= 1

    cdef void _push_tail(self, int32_t b) noexcept nogil:
        self.free_prev[b] = self.free_tail
        self.free_next[b] = NO_BLOCK
        if self.free_tail != NO_BLOCK:
            self.free_next[self.free_tail] = b
        else:
            self.free_head = b
        self.free_tail = b
        self.in_free_list[b] = 1
        self.num_free_blocks += 1

    cdef void _push_head(self, int32_t b) noexcept nogil:
        self.free_next[b] = self.free_head
        self.free_prev[b] = NO_BLOCK
        if self.free_head != NO_BLOCK:
            self.free_prev[self.free_head] = b
        else:
            self.free_tail = b
        self.free_head = b
        self.in_free_list[b] = 1
        self.num_free_blocks += 1

    # ---------------------------------------------------------------- ref counts
    cdef int32_t allocate(self) noexcept nogil:
        """A fresh block with ref count 1 (evicting its cached KV lazily); NO_BLOCK if none."""
        cdef int32_t b = self.free_head
        if b == NO_BLOCK:
            return NO_BLOCK
        self._unlink(b)
        if self.is_cached[b]:
            self._evict(b)
        self.ref_cnt[b] = 1
        return b

    cdef void incref(self, int32_t b) noexcept nogil:
        if self.ref_cnt[b] == 0:
            self._unlink(b)  # a cache hit on a free block: out of the middle of the list
        self.ref_cnt[b] += 1

    cdef void decref(self, int32_t b) noexcept nogil:
        self.ref_cnt[b] -= 1
        if self.ref_cnt[b] == 0:
            if self.is_cached[b]:
                self._push_tail(b)
            else:
                self._push_head(b)

    # ---------------------------------------------------------------- prefix cache
    cdef void _evict(self, int32_t b) noexcept nogil:
        cdef unordered_map[uint64_t, int32_t].iterator it = self.hash_to_block.find(self.cached_hash[b])
        if it != self.hash_to_block.end() and deref(it).second == b:
            self.hash_to_block.erase(it)
        self.is_cached[b] = 0
        self.gen[b] += 1
        self.num_evictions += 1

    cdef bint _matches(self, int32_t b, const int32_t* token_ids, int32_t parent,
                       uint32_t parent_gen, uint64_t extra_key) noexcept nogil:
        if self.cached_parent[b] != parent or self.cached_extra_key[b] != extra_key:
            return False
        if parent != NO_BLOCK and self.cached_parent_gen[b] != parent_gen:
            return False
        return memcmp(&self.cached_tokens[<size_t>b * self.block_size], token_ids,
                      self.block_size * sizeof(int32_t)) == 0

    cdef int32_t lookup(self, uint64_t block_hash, const int32_t* token_ids, int32_t parent,
                        uint64_t extra_key) noexcept nogil:
        """The cached block holding this full block's KV after `parent` (the block matched for
        the previous block, NO_BLOCK at block 0), or NO_BLOCK. Takes no reference."""
        self.num_queries += 1
        cdef unordered_map[uint64_t, int32_t].iterator it = self.hash_to_block.find(block_hash)
        if it == self.hash_to_block.end():
            return NO_BLOCK
        cdef int32_t b = deref(it).second
        cdef uint32_t parent_gen = self.gen[parent] if parent != NO_BLOCK else 0
        if not self._matches(b, token_ids, parent, parent_gen, extra_key):
            return NO_BLOCK  # a hash collision: never serve it
        self.num_hits += 1
        return b

    cdef int32_t cache_block(self, int32_t b, uint64_t block_hash, const int32_t* token_ids,
                             int32_t parent, uint32_t parent_gen,
                             uint64_t extra_key) noexcept nogil:
        """Enter block `b` (held, full, KV written) into the cache. Returns the canonical block
        for this content (`b`, or an equal block cached earlier), or NO_BLOCK when the content
        cannot be cached (hash collision with different content, or a stale parent)."""
        if self.is_cached[b]:
            return b
        if parent != NO_BLOCK and self.gen[parent] != parent_gen:
            return NO_BLOCK  # the parent left the cache: no lookup can reach this block
        cdef unordered_map[uint64_t, int32_t].iterator it = self.hash_to_block.find(block_hash)
        cdef int32_t other
        if it != self.hash_to_block.end():
            other = deref(it).second
            if self._matches(other, token_ids, parent, parent_gen, extra_key):
                return other
            if (self.cached_parent[other] != NO_BLOCK
                    and self.gen[self.cached_parent[other]] != self.cached_parent_gen[other]):
                # A stale entry (its parent left the cache): unreachable, replace it.
                self.hash_to_block.erase(it)
                self.is_cached[other] = 0
                self.gen[other] += 1
                if self.ref_cnt[other] == 0:
                    self._unlink(other)
                    self._push_head(other)
            else:
                return NO_BLOCK
        self.hash_to_block[block_hash] = b
        self.is_cached[b] = 1
        self.cached_hash[b] = block_hash
        self.cached_extra_key[b] = extra_key
        self.cached_parent[b] = parent
        self.cached_parent_gen[b] = parent_gen
        memcpy(&self.cached_tokens[<size_t>b * self.block_size], token_ids,
               self.block_size * sizeof(int32_t))
        return b

    # ---------------------------------------------------------------- Python-facing (tests)
    def allocate_block(self) -> int:
        """A block with ref count 1, or -1 when no block is free."""
        return self.allocate()

    def incref_block(self, int32_t block_id) -> None:
        self._check_id(block_id)
        self.incref(block_id)

    def free_block(self, int32_t block_id) -> None:
        """Drop one reference to `block_id`."""
        self._check_id(block_id)
        if self.ref_cnt[block_id] <= 0:
            raise ValueError(f"block {block_id} is already free")
        self.decref(block_id)

    def ref_count(self, int32_t block_id) -> int:
        self._check_id(block_id)
        return self.ref_cnt[block_id]

    def generation(self, int32_t block_id) -> int:
        self._check_id(block_id)
        return self.gen[block_id]

    def is_block_cached(self, int32_t block_id) -> bool:
        self._check_id(block_id)
        return bool(self.is_cached[block_id])

    def free_list(self) -> list:
        """Free block ids in eviction order (head first)."""
        out = []
        cdef int32_t b = self.free_head
        while b != NO_BLOCK:
            out.append(b)
            b = self.free_next[b]
        return out

    def find_cached(self, uint64_t block_hash, const int32_t[::1] token_ids, int32_t parent,
                    uint64_t extra_key=0) -> int:
        """`lookup` for tests: token_ids int32 [block_size]."""
        self._check_tokens(token_ids)
        return self.lookup(block_hash, &token_ids[0], parent, extra_key)

    def cache_full_block(self, int32_t block_id, uint64_t block_hash,
                         const int32_t[::1] token_ids, int32_t parent, uint64_t extra_key=0) -> int:
        """`cache_block` for tests (parent generation taken as current)."""
        self._check_id(block_id)
        self._check_tokens(token_ids)
        if self.ref_cnt[block_id] <= 0:
            raise ValueError(f"block {block_id} must be held to be cached")
        cdef uint32_t pg = self.gen[parent] if parent != NO_BLOCK else 0
        return self.cache_block(block_id, block_hash, &token_ids[0], parent, pg, extra_key)

    def stats(self) -> dict:
        return {"num_blocks": self.num_blocks, "num_free_blocks": self.num_free_blocks,
                "num_cached_blocks": <int64_t>self.hash_to_block.size(),
                "num_queries": self.num_queries, "num_hits": self.num_hits,
                "num_evictions": self.num_evictions}

    def check_invariants(self, expected_ref_cnt=None) -> None:
        """Raise AssertionError unless the free list, ref counts and cache map agree.
        expected_ref_cnt: int array [num_blocks] of independently counted holders, or None."""
        cdef int32_t b = self.free_head
        cdef int32_t prev = NO_BLOCK
        cdef int64_t n = 0
        while b != NO_BLOCK:
            if self.ref_cnt[b] != 0:
                raise AssertionError(f"block {b} is on the free list with ref count {self.ref_cnt[b]}")
            if self.free_prev[b] != prev:
                raise AssertionError(f"free list broken at block {b}: prev {self.free_prev[b]} != {prev}")
            if not self.in_free_list[b]:
                raise AssertionError(f"block {b} on the free list is not marked free")
            n += 1
            if n > self.num_blocks:
                raise AssertionError("free list has a cycle")
            prev = b
            b = self.free_next[b]
        if prev != self.free_tail:
            raise AssertionError(f"free list tail {self.free_tail} != last element {prev}")
        if n != self.num_free_blocks:
            raise AssertionError(f"free list length {n} != num_free_blocks {self.num_free_blocks}")
        cdef int64_t num_used = 0
        for b in range(self.num_blocks):
            if self.ref_cnt[b] < 0:
                raise AssertionError(f"block {b} has negative ref count {self.ref_cnt[b]}")
            if self.ref_cnt[b] > 0:
                num_used += 1
                if self.in_free_list[b]:
                    raise AssertionError(f"block {b} is used (ref {self.ref_cnt[b]}) but on the free list")
            elif not self.in_free_list[b]:
                raise AssertionError(f"block {b} has ref count 0 but is not on the free list")
        if num_used + self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"free {self.num_free_blocks} + used {num_used} != total {self.num_blocks}")
        if expected_ref_cnt is not None:
            expected = np.asarray(expected_ref_cnt)
            for b in range(self.num_blocks):
                if expected[b] != self.ref_cnt[b]:
                    raise AssertionError(f"block {b}: ref count {self.ref_cnt[b]} but "
                                         f"{int(expected[b])} block tables hold it")
        cdef int64_t num_cached = 0
        for b in range(self.num_blocks):
            if self.is_cached[b]:
                num_cached += 1
                it = self.hash_to_block.find(self.cached_hash[b])
                if it == self.hash_to_block.end() or self.hash_to_block[self.cached_hash[b]] != b:
                    raise AssertionError(f"cached block {b} is not in the hash map under its hash")
        if num_cached != <int64_t>self.hash_to_block.size():
            raise AssertionError(f"{num_cached} blocks marked cached but the map has "
                                 f"{self.hash_to_block.size()} entries")

    def _check_id(self, int32_t block_id):
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _check_tokens(self, const int32_t[::1] token_ids):
        if token_ids.shape[0] != self.block_size:
            raise ValueError(f"token_ids must have block_size={self.block_size} entries, "
                             f"got {token_ids.shape[0]}")


def hash_tokens(uint64_t parent_hash, const int32_t[::1] token_ids, uint64_t extra_key=0) -> int:
    """The chained block hash (tests and the Python baseline's reference)."""
    cdef int32_t n = token_ids.shape[0]
    if n == 0:
        return hash_block_tokens(parent_hash, NULL, 0, extra_key)
    return hash_block_tokens(parent_hash, &token_ids[0], n, extra_key)
