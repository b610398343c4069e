"""The Hopper GEMM's host side, without a GPU: what its launch hands the kernel and when gemm()
lets it run.

* The TMA descriptors travel by value: the kernel declares them `const __grid_constant__`
  (PTX `.param .align 64 .b8 ..._param_1[128]`), the wrapper passes the 128 bytes the driver
  encoded as a size-1 record array (CuPy's by-value convention), and nothing is uploaded per
  call -- so no tensormap fence is needed and the GEMM may run inside graph capture.
* The harness hands such a struct to the kernel from a 64-byte aligned copy (its launch thunk
  reads it as a TmaDescriptor, which UBSan checks).
* setmaxnreg's register hand-over hangs unless the launch allocates exactly the planned
  registers: a loaded kernel reporting another num_regs is refused with a log line, and gemm()
  takes the mma.sync GEMM.
"""
from __future__ import annotations

import ctypes
import logging
import subprocess
import types

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from paged_kernel_inputs import BACKEND
from pagedrun.runtime.kernels import gemm as gemm_module
from pagedrun.runtime.kernels import gemm_hopper, kernel_args, sim_module, tma

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
    """A module of Function stand-ins. Its Hopper GEMM reports `hopper_regs` registers (None:
    a function without the attribute); has_hopper False: the module has none."""

    def __init__(self, hopper_regs=gemm_hopper.HOPPER_LAUNCH_REGS, has_hopper=True):
        self.hopper_regs, self.has_hopper, self.calls = hopper_regs, has_hopper, []

    def get_function(self, name):
        hopper = name.startswith("gemm_hopper_")
        if hopper and not self.has_hopper:
            raise AttributeError(name)
        fn = Function(name, self.calls)
        if not hopper:
            fn.num_regs = 64
        elif self.hopper_regs is not None:
            fn.num_regs = self.hopper_regs
        return fn


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


# ---- the register plan ------------------------------------------------------------------------
M, N, K = 130, 256, 64


@pytest.fixture
def device_view(monkeypatch):
    """gemm() sees an sm_90 "device" (numpy arrays, a stand-in array module)."""
    device = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))
    fake_xp = types.SimpleNamespace(empty=np.empty, cuda=device)
    monkeypatch.setattr(gemm_module, "array_module", lambda x: fake_xp)
    # (*args: the cached queries' signature is not this test's business)
    monkeypatch.setattr(kernel_args, "_cuda_arch", lambda *args: gemm_hopper.HOPPER_ARCH)
    monkeypatch.setattr(kernel_args, "_cuda_num_sms", lambda *args: 132)


def _launched(module):
    a, b = np.zeros((M, K), np.uint16), np.zeros((N, K), np.uint16)
    gemm_module.gemm(module, a, b)
    return [name for name, _ in module.calls]


@pytest.mark.skipif(BACKEND != "sim", reason="drives gemm()'s device checks with a stand-in")
def test_planned_register_count_runs_the_hopper_gemm(device_view, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedrun.kernels"):
        assert _launched(Launches()) == ["gemm_hopper_bf16_nk_obf16"]
    assert not caplog.records


@pytest.mark.skipif(BACKEND != "sim", reason="drives gemm()'s device checks with a stand-in")
@pytest.mark.parametrize("num_regs", [128, 232, None])
def test_other_register_count_falls_back_with_one_log_line(device_view, caplog, num_regs):
    """A build whose kernel got other registers than planned (NVRTC instead of the fatbin,
    another ptxas) would hang in setmaxnreg.inc: gemm() takes the mma.sync GEMM, and says so
    once per module and kernel (None: a function that cannot tell)."""
    module = Launches(hopper_regs=num_regs)
    with caplog.at_level(logging.WARNING, logger="pagedrun.kernels"):
        assert _launched(module) == ["gemm_bf16_nk_obf16"]
        assert _launched(module) == ["gemm_bf16_nk_obf16"] * 2
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1, logged
    assert logged[0].startswith(f"gemm_hopper_bf16_nk_obf16: loaded with {num_regs} registers "
                                f"per thread, planned {gemm_hopper.HOPPER_LAUNCH_REGS}"), logged


@pytest.mark.skipif(BACKEND != "sim", reason="drives gemm()'s device checks with a stand-in")
def test_module_without_the_hopper_gemm_falls_back_silently(device_view, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedrun.kernels"):
        assert _launched(Launches(has_hopper=False)) == ["gemm_bf16_nk_obf16"]
    assert not caplog.records


def test_direct_call_on_a_device_refuses_a_kernel_with_other_registers():
    xp = FakeCupy()
    a, b = xp.empty((M, K), np.uint16), xp.empty((N, K), np.uint16)
    with pytest.raises(kernel_args.UnsupportedKernelShape, match="registers per thread"):
        gemm_hopper.gemm_hopper(Launches(hopper_regs=128), a, b)
