"""Host-side TMA descriptors for tma_load_2d (cuda/hopper_groundwork.cuh): the 2-D tiled tensor
map of a row-major matrix, in the form each backend reads.

Used by the Hopper GEMM's wrapper (runtime/kernels/gemm_hopper.py, cuda/gemm_hopper.cu) and by
tests/sim/test_hopper_twins.py and tests/gpu/test_ptx_twins.py (the probe kernels of
tests/sim/kernels/hopper_probes.cu).

  sim_descriptor(matrix, box_rows, box_cols, swizzle_bytes) -> np.ndarray uint64[16]
      The CPU harness's TmaDescriptor (cuda/sim/hopper.cuh): {magic, base address, dims,
      row stride, box, element size, swizzle}. It holds the matrix's address: keep the
      matrix alive (and unmoved) while kernels use the descriptor.
  cuda_descriptor(matrix, box_rows, box_cols, swizzle_bytes) -> np.ndarray uint64[16]
      The CUtensorMap from the driver's cuTensorMapEncodeTiled (libcuda through ctypes) for a
      CuPy matrix (encoded into a 64-byte aligned host buffer, as the driver requires).
  kernel_param(words) -> np.ndarray, one 128-byte record
      Either descriptor as the by-value argument of a `const __grid_constant__ TmaDescriptor`
      kernel parameter (cuda/gemm_hopper.cu): no device copy, no fence, graph-capturable.
      (The probe kernels take a pointer instead: copy the words to device memory there.)

matrix: 2-D, contiguous rows whose stride is a multiple of 16 bytes (it may exceed the row,
as for a column slice), base 16-byte aligned, 2-byte (bf16/f16 as uint16/float16) or 4-byte
elements. box_cols * itemsize must be a multiple of 16 bytes, and equal swizzle_bytes when
swizzled (32, 64 or 128).
"""

from __future__ import annotations

import ctypes

import numpy as np

SIM_TMA_MAGIC = 0x31414D5452444150  # kTmaMagic in cuda/sim/hopper.cuh
DESCRIPTOR_WORDS = 16               # 128 bytes, like CUtensorMap
SWIZZLE_BYTES = (0, 32, 64, 128)
MAX_BOX = 256                       # per dimension, as cuTensorMapEncodeTiled allows
ROW_STRIDE_ALIGN = 16               # bytes; the base address too
# cuTensorMapEncodeTiled writes the CUtensorMap into host memory that must be 64-byte aligned
# (CUDA driver API); numpy only promises 16 for a uint64 array, so an encode could fail at
# random, depending on where the allocator put the buffer.
TENSOR_MAP_ALIGN = 64

# A descriptor passed by value: a size-1 numpy array of one 128-byte record. CuPy passes a
# size-1 numpy array by value -- the driver copies sizeof(parameter) bytes from its data
# (cupy/cuda/function.pyx: _pointer -> CNumpyArray; CuPy's user guide, "Custom user types") --
# while a numpy void *scalar* goes through CScalar, whose inline buffer (64 bytes in CuPy 14)
# cannot hold 128. The CPU harness (sim_module._marshal) takes the same array.
DESCRIPTOR_PARAM_DTYPE = np.dtype([("opaque", np.uint64, (DESCRIPTOR_WORDS,))])

# CUtensorMapSwizzle / CUtensorMapDataType values from the CUDA driver API (cuda.h).
_CU_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
_CU_DTYPE = {np.dtype(np.uint8): 0, np.dtype(np.uint16): 1, np.dtype(np.uint32): 2,
             np.dtype(np.int32): 3, np.dtype(np.float16): 6, np.dtype(np.float32): 7}


def _check(shape, itemsize, box_rows, box_cols, swizzle_bytes):
    if len(shape) != 2:
        raise ValueError(f"tma: a 2-D matrix is needed, got shape {shape}")
    if swizzle_bytes not in SWIZZLE_BYTES:
        raise ValueError(f"tma: swizzle_bytes {swizzle_bytes} not in {SWIZZLE_BYTES}")
    if not (1 <= box_rows <= MAX_BOX and 1 <= box_cols <= MAX_BOX):
        raise ValueError(f"tma: box {box_rows}x{box_cols} outside 1..{MAX_BOX}")
    row_bytes = box_cols * itemsize
    if row_bytes % 16 or (swizzle_bytes and row_bytes != swizzle_bytes):
        raise ValueError(f"tma: box row of {row_bytes} bytes must be a multiple of 16"
                         + (f" equal to the {swizzle_bytes}-byte swizzle" if swizzle_bytes else ""))


def _check_layout(strides, itemsize):
    # cuTensorMapEncodeTiled's rules, enforced on both paths so the harness refuses what the
    # GPU refuses.
    if strides[1] != itemsize or strides[0] % ROW_STRIDE_ALIGN:
        raise ValueError(f"tma: rows must be contiguous with a row stride multiple of "
                         f"{ROW_STRIDE_ALIGN} bytes (strides {strides})")


def sim_descriptor(matrix: np.ndarray, box_rows: int, box_cols: int,
                   swizzle_bytes: int = 0) -> np.ndarray:
    """matrix: [rows, cols] numpy array (last axis contiguous)."""
    _check(matrix.shape, matrix.itemsize, box_rows, box_cols, swizzle_bytes)
    _check_layout(matrix.strides, matrix.itemsize)
    if matrix.ctypes.data % ROW_STRIDE_ALIGN:
        raise ValueError("tma: the matrix must start on a 16-byte boundary")
    rows, cols = matrix.shape
    d = np.zeros(DESCRIPTOR_WORDS, np.uint64)
    d[0] = SIM_TMA_MAGIC
    d[1] = matrix.ctypes.data
    d[2], d[3] = cols, rows
    d[4] = matrix.strides[0]
    d[5] = box_cols | (box_rows << 32)
    d[6] = matrix.itemsize | (swizzle_bytes << 32)
    return d


def aligned_words(count: int, align: int = TENSOR_MAP_ALIGN) -> np.ndarray:
    """A zeroed uint64 [count] whose first byte is `align`-byte aligned (a view into a slightly
    larger array, which it keeps alive)."""
    base = np.zeros(count + align // 8, np.uint64)
    skip = (-base.ctypes.data % align) // 8
    return base[skip:skip + count]


def cuda_descriptor(matrix, box_rows: int, box_cols: int, swizzle_bytes: int = 0) -> np.ndarray:
    """matrix: [rows, cols] CuPy array on the current device (last axis contiguous)."""
    _check(matrix.shape, matrix.itemsize, box_rows, box_cols, swizzle_bytes)
    dtype = np.dtype(matrix.dtype)
    if dtype.name == "bfloat16" or dtype.kind == "V":
        dtype = np.dtype(np.uint16)
    if dtype not in _CU_DTYPE:
        raise ValueError(f"tma: element type {matrix.dtype} not supported")
    _check_layout(matrix.strides, matrix.itemsize)
    libcuda = ctypes.CDLL("libcuda.so.1")
    fn = libcuda.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    rows, cols = matrix.shape
    out = aligned_words(DESCRIPTOR_WORDS)
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(matrix.strides[0])
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem_strides = (ctypes.c_uint32 * 2)(1, 1)
    rc = fn(ctypes.c_void_p(out.ctypes.data), ctypes.c_int(_CU_DTYPE[dtype]), ctypes.c_uint32(2),
            ctypes.c_void_p(int(matrix.data.ptr)), dims, strides, box, elem_strides,
            ctypes.c_int(0),                             # CU_TENSOR_MAP_INTERLEAVE_NONE
            ctypes.c_int(_CU_SWIZZLE[swizzle_bytes]),
            ctypes.c_int(0),                             # CU_TENSOR_MAP_L2_PROMOTION_NONE
            ctypes.c_int(0))                             # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc}")
    return out


def kernel_param(words: np.ndarray) -> np.ndarray:
    """words: a descriptor, uint64 [16] (sim_descriptor / cuda_descriptor) -> the same bytes as
    a [1] array of DESCRIPTOR_PARAM_DTYPE (a view: no copy)."""
    if words.dtype != np.uint64 or words.shape != (DESCRIPTOR_WORDS,):
        raise ValueError(f"tma: a descriptor is uint64[{DESCRIPTOR_WORDS}], got {words.dtype} "
                         f"{words.shape}")
    return np.ascontiguousarray(words).view(DESCRIPTOR_PARAM_DTYPE)
