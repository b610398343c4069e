"""The Hopper GEMM's host side, without a GPU: what its launch hands the kernel and when gemm()
lets it run.

* The TMA descriptors travel by value: the kernel declares them `const __grid_constant__`
  (PTX `.param .align 64 .b8 ..._param_1[128]`), the wrapper passes the 128 bytes the driver
  encoded as a size-1 record array (CuPy's by-value convention), and nothing is uploaded per
  call -- so no tensormap fence is needed and the GEMM may run inside graph capture.
* The harness hands such a struct to the kernel from a 64-byte aligned copy (its launch thunk
  reads it as a TmaDescriptor, which UBSan checks).
"""
from __future__ import annotations

import ctypes
import subprocess
import types

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedrun.runtime.kernels import gemm_hopper, sim_module, tma

CUDA_SUCCESS = 0
REPO = Path(__file__).resolve().parents[2]
HOPPER_KERNELS = ("gemm_hopper_f16_nk_of16", "gemm_hopper_f16_nk_of32",
                  "gemm_hopper_bf16_nk_obf16", "gemm_hopper_bf16_nk_of32")


class Function:
    """A kernel stand-in: records its launches, runs nothing."""

    max_dynamic_shared_size_bytes = 0

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((self.name, args))


class Launches:
    """A module of Function stand-ins."""

    def __init__(self):
        self.calls = []

    def get_function(self, name):
        return Function(name, self.calls)


# ---- descriptors by value, nothing uploaded ------------------------------------------------
class FakeCupy:
    """The array module of FakeDeviceArray: allocates stand-ins, and records any host-to-device
    copy (asarray), which the Hopper GEMM must not make."""

    def __init__(self):
        self.uploads = []
        self.next_ptr = 0x7F0000000000
        # array_module() reads the module off the array's type.
        self.array_type = type("FakeDeviceArray", (FakeDeviceArray,),
                               {"pagedrun_array_module": self})

    def empty(self, shape, dtype):
        self.next_ptr += 1 << 20
        return self.array_type(shape, dtype, self.next_ptr)

    def asarray(self, x, *args, **kwargs):
        self.uploads.append(x)
        raise AssertionError("the Hopper GEMM uploaded something")


class FakeDeviceArray:
    """What the wrappers and cuda_descriptor read of a CuPy array."""

    def __init__(self, shape, dtype, ptr):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        self.strides = (self.shape[1] * self.itemsize, self.itemsize)
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.data = types.SimpleNamespace(ptr=ptr)


def _encode(out, dtype, rank, address, dims, strides, box, elem_strides, interleave, swizzle,
            promotion, oob_fill):
    """cuTensorMapEncodeTiled stand-in: word 0 the global address, word 1 the box rows, the
    rest a fill pattern, so each descriptor's bytes can be told apart."""
    words = (ctypes.c_uint64 * tma.DESCRIPTOR_WORDS).from_address(out.value)
    words[0], words[1] = address.value, box[1]
    for i in range(2, tma.DESCRIPTOR_WORDS):
        words[i] = 0xD0 + i
    return CUDA_SUCCESS


def test_descriptors_go_by_value_and_nothing_is_uploaded(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda name: types.SimpleNamespace(
        cuTensorMapEncodeTiled=_encode))
    xp = FakeCupy()
    a, b = xp.empty((130, 64), np.uint16), xp.empty((256, 64), np.uint16)
    module = Launches()
    out = gemm_hopper.gemm_hopper(module, a, b)
    (name, args), = module.calls
    assert name == "gemm_hopper_bf16_nk_obf16" and args[0] is out and xp.uploads == []
    for arg, matrix, box_rows in ((args[1], a, 128), (args[2], b, 256)):
        assert isinstance(arg, np.ndarray) and arg.shape == (1,), type(arg)
        assert arg.dtype == tma.DESCRIPTOR_PARAM_DTYPE and arg.dtype.itemsize == 128
        words = np.frombuffer(arg.tobytes(), np.uint64)
        assert words[0] == matrix.data.ptr and words[1] == box_rows
        assert list(words[2:]) == [0xD0 + i for i in range(2, tma.DESCRIPTOR_WORDS)]


def test_kernel_param_is_the_descriptor_bytes_as_one_record():
    words = tma.aligned_words(tma.DESCRIPTOR_WORDS)
    words[:] = np.arange(tma.DESCRIPTOR_WORDS, dtype=np.uint64)
    param = tma.kernel_param(words)
    assert param.shape == (1,) and param.ctypes.data == words.ctypes.data  # a view
    assert param.tobytes() == words.tobytes()
    with pytest.raises(ValueError, match="uint64"):
        tma.kernel_param(np.zeros(8, np.uint64))


def test_harness_hands_a_struct_parameter_over_64_byte_aligned():
    """The launch thunk reads a by-value TmaDescriptor through a pointer to its 64-byte aligned
    type; ctypes' own buffers promise 16."""
    words = np.arange(tma.DESCRIPTOR_WORDS, dtype=np.uint64)
    for _ in range(32):
        holder = sim_module._marshal("k", 1, "V128", tma.kernel_param(words))
        assert ctypes.addressof(holder) % 64 == 0
        assert bytes(holder) == words.tobytes()
    scalar = sim_module._marshal("k", 1, "V128", tma.kernel_param(words)[0])  # a void scalar
    assert ctypes.addressof(scalar) % 64 == 0 and bytes(scalar) == words.tobytes()
    with pytest.raises(TypeError, match="V128"):
        sim_module._marshal("k", 1, "V128", np.zeros(8, np.uint64).view("V64"))


def _compile_gates():
    """scripts/compile_gates.py as a module (its toolkit lookup)."""
    if "compile_gates" not in sys.modules:
        spec = importlib.util.spec_from_file_location("compile_gates",
                                                      REPO / "scripts" / "compile_gates.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules["compile_gates"]


def test_ptx_takes_the_descriptors_as_64_byte_aligned_params():
    """nvcc's PTX of cuda/gemm_hopper.cu: desc_a and desc_b are 128-byte parameters aligned to
    64 in every instantiation, not pointers into global memory. The parameter list comes from
    one macro for every target, so sm_90 (bodies trap: ~1 s) shows what sm_90a has (~6 s)."""
    if sim_module.sanitizer_mode() != "plain":
        pytest.skip("nvcc would run under the preloaded sanitizer; the plain job covers it")
    gates = _compile_gates()
    root = gates.toolkit_root()
    if root is None:
        pytest.skip("needs nvcc")
    proc = subprocess.run([str(root / "bin" / "nvcc"), "-ptx", "-arch=sm_90", "-std=c++17",
                           f"-I{gates.CUDA_DIR}", str(gates.CUDA_DIR / "gemm_hopper.cu"),
                           "-o", "-"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in HOPPER_KERNELS:
        for param in (1, 2):
            decl = f".param .align 64 .b8 {name}_param_{param}[128]"
            assert decl in proc.stdout, f"{name}: no `{decl}`"
