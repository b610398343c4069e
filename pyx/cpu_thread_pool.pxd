# cython: language_level=3
"""C-level declarations of the process's one CPU helper thread (pyx/cpu_thread_pool.h), for the
kernel modules to cimport: each binds process_run_pair at import (bind_run_pair), so every
module's two-way split runs on the one helper that pagedrun.pyx.cpu_thread_pool owns."""
from libc.stdint cimport uintptr_t

cdef extern from "cpu_thread_pool.h" namespace "pagedrun_threads" nogil:
    ctypedef void (*PartFn)(const void* ctx, int part) noexcept nogil
    ctypedef void (*RunPairFn)(PartFn fn, const void* ctx) noexcept nogil
    # This module's binding (one static per extension module: cpu_thread_pool.h says why).
    void bind_run_pair(RunPairFn owner_run_pair)
    uintptr_t bound_run_pair_address()
    # Which threads ran the parts of one run_pair through this module's binding (tests).
    void probe_run_pair(long* thread_ids)

# The owner's run_pair: fn(ctx, 0) on the caller while the process's helper runs fn(ctx, 1).
cdef void process_run_pair(PartFn fn, const void* ctx) noexcept nogil


# Every kernel module's _thread_pool_probe(): (bound run_pair address, the caller's thread id,
# the id of the thread that ran part 1), for tests/pyx/test_cpu_thread_pool.py.
cdef inline tuple thread_pool_probe():
    cdef long thread_ids[2]
    with nogil:
        probe_run_pair(thread_ids)
    return bound_run_pair_address(), thread_ids[0], thread_ids[1]
