# cython: language_level=3
"""cpu_thread_pool: owns the process's one CPU helper thread (pyx/cpu_thread_pool.h: the polled
two-way split the kernel modules use) and exports its run_pair through cpu_thread_pool.pxd.

Every kernel module (cpu_gemm, cpu_ops, cpu_decode_step) cimports process_run_pair and binds it
at import, so however many modules split work, one helper thread polls (for at most
HELPER_SPIN_US after its last job, then it sleeps). For tests and diagnostics:

    helper_thread_id()     the helper's Linux thread id, 0 until the first split starts it
    helper_thread_name()   its name in /proc/self/task/*/comm
    run_pair_address()     the address every module's binding must equal
"""
from libc.stdint cimport uintptr_t

cdef extern from "cpu_thread_pool.h" namespace "pagedrun_threads" nogil:
    const char* HELPER_THREAD_NAME
    void init_process_helper()
    void process_helper_run_pair(PartFn fn, const void* ctx)
    long process_helper_thread_id()


cdef void process_run_pair(PartFn fn, const void* ctx) noexcept nogil:
    process_helper_run_pair(fn, ctx)


# Once, at import (under the GIL): the helper object; its thread starts on the first split.
init_process_helper()


def helper_thread_id():
    """The helper's Linux thread id (gettid), or 0 before the first split has started it."""
    return process_helper_thread_id()


def helper_thread_name():
    """The helper thread's name (as /proc/self/task/<tid>/comm shows it)."""
    return HELPER_THREAD_NAME.decode()


def run_pair_address():
    """Address of process_run_pair: every kernel module's bound_run_pair must equal it."""
    return <uintptr_t>process_run_pair
