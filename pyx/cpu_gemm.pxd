# cython: language_level=3
"""C-level exports of pagedrun.pyx.cpu_gemm for the other kernel modules to cimport: the table
of the GEMM kernels pyx/cpu_decode_step.h calls (GemmTable in cpu_gemm_kernels.h), so they are
compiled in this module only."""

cdef extern from "cpu_gemm_kernels.h" namespace "pagedrun_gemm" nogil:
    cdef cppclass GemmTable:
        pass

# The table of this module's compiled kernels (static: it lives as long as the process).
cdef const GemmTable* exported_gemm_table() noexcept nogil
