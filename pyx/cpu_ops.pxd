# cython: language_level=3
"""C-level exports of pagedrun.pyx.cpu_ops for the other kernel modules to cimport: the table
of the norm, activation, rotary and decode-attention kernels pyx/cpu_decode_step.h calls
(OpsTable in cpu_ops_kernels.h), so they are compiled in this module only."""

cdef extern from "cpu_ops_kernels.h" namespace "pagedrun_ops" nogil:
    cdef cppclass OpsTable:
        pass

# The table of this module's compiled kernels (static: it lives as long as the process).
cdef const OpsTable* exported_ops_table() noexcept nogil
