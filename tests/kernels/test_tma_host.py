"""The host side of cuda_descriptor (runtime/kernels/tma.py) without a GPU: the encode call
against a strict fake of the driver's cuTensorMapEncodeTiled, which refuses what the driver
refuses (a tensor-map buffer not 64-byte aligned, an unaligned global address or stride, a box
over 256) and records what it was given."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pagedrun.runtime.kernels import tma

CUDA_ERROR_INVALID_VALUE = 1


class StrictEncode:
    """cuTensorMapEncodeTiled's contract (CUDA driver API) as far as the wrapper can break it."""

    restype = None

    def __init__(self):
        self.calls = []

    def __call__(self, out, dtype, rank, address, dims, strides, box, elem_strides, interleave,
                 swizzle, promotion, oob_fill):
        out_ptr, address = out.value, address.value
        if (out_ptr % tma.TENSOR_MAP_ALIGN or address % 16 or strides[0] % 16
                or rank.value != 2 or not all(1 <= box[i] <= tma.MAX_BOX for i in range(2))):
            return CUDA_ERROR_INVALID_VALUE
        ctypes.memset(out_ptr, 0xAB, tma.DESCRIPTOR_WORDS * 8)  # the driver writes 128 bytes
        self.calls.append((out_ptr, address, (dims[0], dims[1]), strides[0], (box[0], box[1]),
                           swizzle.value))
        return 0


class FakeDeviceMatrix:
    """What cuda_descriptor reads of a CuPy array."""

    def __init__(self, rows, cols, dtype=np.uint16, ptr=0x7F0000000000, row_bytes=None):
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.shape = (rows, cols)
        self.strides = (row_bytes or cols * self.itemsize, self.itemsize)
        self.data = type("Ptr", (), {"ptr": ptr})()


@pytest.fixture
def driver(monkeypatch):
    encode = StrictEncode()
    lib = type("LibCuda", (), {"cuTensorMapEncodeTiled": encode})()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    return encode


def test_aligned_words():
    for count in (1, 16, 17):
        for _ in range(20):
            words = tma.aligned_words(count)
            assert words.ctypes.data % tma.TENSOR_MAP_ALIGN == 0
            assert words.shape == (count,) and words.dtype == np.uint64 and not words.any()


def test_encode_gets_a_64_byte_aligned_buffer_every_time(driver):
    """numpy's own uint64 arrays are only 16-byte aligned: fifty encodes into such buffers would
    all but surely hit the driver's refusal at least once."""
    matrix = FakeDeviceMatrix(128, 64)
    for _ in range(50):
        desc = tma.cuda_descriptor(matrix, 64, 64, 128)
        assert desc.shape == (tma.DESCRIPTOR_WORDS,) and desc.ctypes.data % 64 == 0
        assert (desc == np.uint64(0xABABABABABABABAB)).all()  # what the driver wrote
    out_ptr, address, dims, stride, box, swizzle = driver.calls[-1]
    assert (address, dims, stride, box, swizzle) == (0x7F0000000000, (64, 128), 128, (64, 64), 3)


def test_the_fake_refuses_what_the_driver_refuses(driver):
    unaligned = np.zeros(tma.DESCRIPTOR_WORDS + 1, np.uint64)
    ptr = unaligned.ctypes.data + (8 if unaligned.ctypes.data % 64 == 0 else 0)
    args = (ctypes.c_int(1), ctypes.c_uint32(2), ctypes.c_void_p(0x7F0000000000),
            (ctypes.c_uint64 * 2)(64, 128), (ctypes.c_uint64 * 1)(128),
            (ctypes.c_uint32 * 2)(64, 64), (ctypes.c_uint32 * 2)(1, 1), ctypes.c_int(0),
            ctypes.c_int(3), ctypes.c_int(0), ctypes.c_int(0))
    assert driver(ctypes.c_void_p(ptr), *args) == CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="CUresult 1"):  # an unaligned global address
        tma.cuda_descriptor(FakeDeviceMatrix(128, 64, ptr=0x7F0000000008), 64, 64, 128)
