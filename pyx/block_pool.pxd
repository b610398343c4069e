# cython: language_level=3
"""C-level declarations of the block pool (shared with kv_cache_manager and scheduler)."""
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libcpp.unordered_map cimport unordered_map

# A block id that names no block (empty free list, no cache hit, no parent).
cdef enum:
    NO_BLOCK = -1

# The chained block hash below uses the 64-bit FNV-1a offset basis and prime over token ids,
# with a splitmix64 finalizer on the way in and out.
cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    # splitmix64 finalizer: spreads every input bit over the output (FNV alone mixes weakly).
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9ULL
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111ebULL
    x ^= x >> 31
    return x

cdef inline uint64_t hash_block_tokens(uint64_t parent_hash, const int32_t* token_ids,
                                       int32_t num_tokens, uint64_t extra_key) noexcept nogil:
    """Chained hash of one full block: hash(parent block's hash, its token ids, extra key)."""
    cdef uint64_t h = <uint64_t>0xcbf29ce484222325ULL ^ mix64(parent_hash ^ mix64(extra_key))
    cdef int32_t i
    for i in range(num_tokens):
        h = (h ^ <uint32_t>token_ids[i]) * <uint64_t>0x100000001b3ULL
    return mix64(h)


cdef class BlockPool:
    cdef readonly int32_t num_blocks
    cdef readonly int32_t block_size
    cdef readonly bint enable_caching
    cdef int32_t* ref_cnt          # [num_blocks]
    cdef int32_t* free_prev        # [num_blocks] intrusive free list; NO_BLOCK ends it
    cdef int32_t* free_next        # [num_blocks]
    cdef char* in_free_list        # [num_blocks]
    cdef int32_t free_head         # next block handed out (least recently freed)
    cdef int32_t free_tail
    cdef readonly int32_t num_free_blocks
    # Prefix cache (full blocks only). A cached block stores what it holds so a hit is verified:
    cdef char* is_cached           # [num_blocks]
    cdef uint64_t* cached_hash     # [num_blocks]
    cdef uint64_t* cached_extra_key  # [num_blocks] adapter / tenant salt
    cdef int32_t* cached_parent    # [num_blocks] canonical cached parent block, NO_BLOCK at block 0
    cdef uint32_t* cached_parent_gen  # [num_blocks] parent's generation when this was cached
    cdef uint32_t* gen             # [num_blocks] bumped whenever a block leaves the cache
    cdef int32_t* cached_tokens    # [num_blocks, block_size]
    cdef unordered_map[uint64_t, int32_t] hash_to_block
    cdef readonly int64_t num_queries
    cdef readonly int64_t num_hits
    cdef readonly int64_t num_evictions

    cdef int32_t allocate(self) noexcept nogil
    cdef void incref(self, int32_t block_id) noexcept nogil
    cdef void decref(self, int32_t block_id) noexcept nogil
    cdef int32_t lookup(self, uint64_t block_hash, const int32_t* token_ids, int32_t parent,
                        uint64_t extra_key) noexcept nogil
    cdef int32_t cache_block(self, int32_t block_id, uint64_t block_hash,
                             const int32_t* token_ids, int32_t parent, uint32_t parent_gen,
                             uint64_t extra_key) noexcept nogil
    cdef bint _matches(self, int32_t block_id, const int32_t* token_ids, int32_t parent,
                       uint32_t parent_gen, uint64_t extra_key) noexcept nogil
    cdef void _unlink(self, int32_t block_id) noexcept nogil
    cdef void _push_tail(self, int32_t block_id) noexcept nogil
    cdef void _push_head(self, int32_t block_id) noexcept nogil
    cdef void _evict(self, int32_t block_id) noexcept nogil
