# cython: language_level=3
"""Physical KV blocks: free list in LRU order, ref counts, prefix-hash map (filled by issue 3)."""

def _built() -> bool:
    return True
