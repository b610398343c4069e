# cython: language_level=3
"""C-level declarations of the KV cache manager (shared with the scheduler)."""
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from pagedrun.pyx.block_pool cimport BlockPool

# canonical[i] of a block whose content can never be cached (hash collision, stale parent).
cdef enum:
    UNCACHEABLE = -2


cdef struct ReqBlocks:
    # One request's logical -> physical block map, indexed by the scheduler's request slot.
    int32_t* block_ids        # [capacity] GPU block ids, or host block ids when on_host
    uint64_t* block_hashes    # [capacity] chained hash of each full block offered to the cache
    int32_t* canonical        # [capacity] cached block holding the same content, or UNCACHEABLE
    uint32_t* canonical_gen   # [capacity] that block's generation when recorded
    int32_t num_blocks        # blocks held
    int32_t capacity
    int32_t num_hashed_blocks  # blocks [0, num_hashed_blocks) were offered to the cache
    int32_t num_pending_hits   # prefix hits found by find_cached_prefix, not yet taken
    bint on_host               # swapped out: block_ids name host blocks
    bint may_share_partial     # set by fork: the partly filled last block may be shared, so
                               # the next write checks for copy-on-write (no one else can
                               # share a partial block: the prefix cache holds full ones only)


cdef class KVCacheManager:
    cdef readonly BlockPool gpu_pool
    cdef readonly BlockPool cpu_pool     # None when swap is off
    cdef readonly int32_t block_size
    cdef readonly bint enable_caching
    cdef ReqBlocks* reqs                 # [num_slots]
    cdef readonly int32_t num_slots
    # Ops for the worker, accumulated over one step and reset by clear_ops():
    cdef int32_t* copy_ops               # [copy_cap, 2] (src, dst) GPU blocks
    cdef int32_t num_copy_ops, copy_cap
    cdef int32_t* swap_out_ops           # [swap_out_cap, 2] (gpu, host)
    cdef int32_t num_swap_out_ops, swap_out_cap
    cdef int32_t* swap_in_ops            # [swap_in_cap, 2] (host, gpu)
    cdef int32_t num_swap_in_ops, swap_in_cap

    cdef int ensure_slots(self, int32_t num_slots) except -1
    cdef int _reserve(self, int32_t slot, int32_t num_blocks) noexcept nogil
    cdef int32_t find_cached_prefix(self, int32_t slot, const int32_t* token_ids,
                                    int32_t num_tokens, uint64_t extra_key) noexcept nogil
    cdef bint allocate_slots(self, int32_t slot, int32_t num_computed_tokens,
                             int32_t num_new_tokens) noexcept nogil
    cdef void free_blocks(self, int32_t slot) noexcept nogil
    cdef void trim_blocks(self, int32_t slot, int32_t num_tokens) noexcept nogil
    cdef void cache_full_blocks(self, int32_t slot, const int32_t* token_ids,
                                int32_t num_computed_tokens, uint64_t extra_key) noexcept nogil
    cdef bint fork(self, int32_t parent_slot, int32_t child_slot) noexcept nogil
    cdef bint can_swap_out(self, int32_t slot) noexcept nogil
    cdef void swap_out(self, int32_t slot) noexcept nogil
    cdef bint can_swap_in(self, int32_t slot, int32_t num_tokens_after) noexcept nogil
    cdef void swap_in(self, int32_t slot) noexcept nogil
    cdef void clear_ops(self) noexcept nogil
    cdef int _push_op(self, int32_t** ops, int32_t* num_ops, int32_t* cap,
                      int32_t a, int32_t b) noexcept nogil
