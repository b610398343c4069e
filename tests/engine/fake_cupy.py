"""A strict fake of CuPy 14: the surface runtime/backends/cupy_runtime.py and the launch wrappers
use, over numpy, raising wherever CuPy or the driver would -- and, where a GPU would silently go
wrong instead of raising, raising anyway.

    cupy, cupyx = fake_cupy.make()               # a fresh fake device (8 GiB, sm_80)
    runtime = CupyRuntime(0, cupy=cupy, cupyx=cupyx)

Device arrays are `DeviceArray` (a numpy subclass naming the fake as its array module). Kernels
are the cuda/*.cu sources run by the CPU harness (a RawModule of a prebuilt fatbin or of NVRTC
code becomes the SimModule of the same sources). What it refuses:

- a host numpy array mixed into a device expression, assigned into a device array, or passed to
  a kernel (CuPy raises TypeError / the kernel would read a host address);
- a kernel argument of the wrong type: a Python int / float / bool or None (CuPy would pass an
  8-byte int64 / double where the kernel reads 4 bytes, or refuse None), a numpy scalar or an
  array of another dtype than the parameter's (the harness's signature check), an array whose
  address is not a multiple of its element size (the vector-load alignment each wrapper needs
  is checked by the wrappers themselves: kernel_args.require_aligned);
- dynamic shared memory over 48 KiB without max_dynamic_shared_size_bytes set (the launch fails);
- while a stream captures: a synchronize of it, a device-to-host copy, a host-to-device copy
  (cudaErrorStreamCaptureUnsupported), a launch or array operation issued on another stream (the
  graph would not hold it: cudaErrorStreamCaptureImplicit), an allocation that is not from the
  allocator of `using_allocator` with a pool other than the default one (the replay would write
  memory the default pool hands to others; CuPy would not notice);
- replaying a graph that was never ended, ending a capture never begun.

Capture records what a GPU graph would hold -- kernel launches, copies, fills, elementwise
operations and casts -- and runs it eagerly too (as the harness does), so a replay re-runs the
same operations on the same arrays. `memGetInfo` reports the fake's 8 GiB less what its pools
hold, so the KV budget arithmetic runs on real numbers.
"""
from __future__ import annotations

import ctypes
import json
import threading
import weakref
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from pagedrun.runtime.kernels import prebuilt
from pagedrun.runtime.kernels.sim_module import SimModule

TOTAL_BYTES = 8 << 30
COMPUTE_CAPABILITY = "80"  # an A100: the Hopper-only paths stay off (the harness lacks them)
NUM_SMS = 4
DEFAULT_SHARED_LIMIT = 48 << 10


class FakeCudaError(RuntimeError):
    """What CuPy's CUDARuntimeError / CUDADriverError would be."""


class DeviceArray(np.ndarray):
    """A device array of the fake: comes back to the host only through `.get()`."""

    pagedrun_array_module = None  # the FakeCupy that made it (kernel_args.array_module)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fake = _owner(inputs)
        for value in inputs + tuple(kwargs.get("out", ())):
            if type(value) is np.ndarray and value.ndim > 0:
                raise TypeError(f"{ufunc.__name__}: a host numpy array {value.shape} mixed into "
                                "a device expression (CuPy refuses it)")
        fake._device_op(f"ufunc {ufunc.__name__}")
        plain = tuple(np.asarray(v) if isinstance(v, DeviceArray) else v for v in inputs)
        outs = kwargs.pop("out", None)
        if outs is not None:
            outs = tuple(np.asarray(o) for o in outs)
            result = getattr(ufunc, method)(*plain, out=outs, **kwargs)
            fake._record(partial(getattr(ufunc, method), *plain, out=outs, **kwargs))
            del result
            views = tuple(o.view(DeviceArray) for o in outs)
            return views[0] if len(views) == 1 else views
        result = getattr(ufunc, method)(*plain, **kwargs)
        if method == "__call__" and isinstance(result, np.ndarray):
            fake._allocate(result, f"ufunc {ufunc.__name__}")
            fake._record(partial(ufunc, *plain, out=(result,), **kwargs))
            return result.view(DeviceArray)
        if isinstance(result, np.ndarray):
            fake._allocate(result, f"ufunc {ufunc.__name__}.{method}")
            return result.view(DeviceArray)
        return result

    def get(self, stream=None, order="C", out=None, blocking=True):
        fake = self.pagedrun_array_module
        fake._refuse_capturing("a device-to-host copy (ndarray.get)")
        if out is None:
            return np.array(self, order=order)
        if type(out) is not np.ndarray:
            raise TypeError("ndarray.get(out=...): out must be a numpy array")
        np.copyto(out, np.asarray(self))
        return out

    def astype(self, dtype, *args, **kwargs):
        fake = self.pagedrun_array_module
        fake._device_op("astype")
        result = np.asarray(self).astype(dtype, *args, **kwargs)
        if not np.may_share_memory(result, self):
            fake._allocate(result, "astype")
            fake._record(partial(np.copyto, result, np.asarray(self), casting="unsafe"))
        return result.view(DeviceArray)

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, np.ndarray) and not np.may_share_memory(value, self):
            # fancy indexing: a gather kernel into a new array
            fake = self.pagedrun_array_module
            fake._device_op("fancy index")
            src, index = np.asarray(self), _plain_index(key)
            fake._allocate(value, "fancy index")
            fake._record(lambda: np.copyto(np.asarray(value), src[index]))
        return value

    def __setitem__(self, key, value) -> None:
        if type(value) is np.ndarray and value.ndim > 0:
            raise TypeError("a host numpy array assigned into a device array (CuPy refuses it;"
                            " upload it with cupy.asarray first)")
        fake = self.pagedrun_array_module
        fake._device_op("setitem")
        dst, index = np.asarray(self), _plain_index(key)
        src = np.asarray(value) if isinstance(value, DeviceArray) else value
        dst[index] = src
        fake._record(lambda: dst.__setitem__(index, src))

    def fill(self, value) -> None:
        fake = self.pagedrun_array_module
        fake._device_op("fill")
        np.asarray(self).fill(value)
        fake._record(partial(np.asarray(self).fill, value))

    @property
    def data(self):
        """CuPy's MemoryPointer (`.ptr`)."""
        return SimpleNamespace(ptr=self.ctypes.data, array=self)


def _plain_index(key):
    if isinstance(key, tuple):
        return tuple(np.asarray(k) if isinstance(k, DeviceArray) else k for k in key)
    return np.asarray(key) if isinstance(key, DeviceArray) else key


def _owner(values):
    for v in values:
        if isinstance(v, DeviceArray):
            return v.pagedrun_array_module
    raise AssertionError("no device array among the operands")


# ---------------------------------------------------------------------- cuda namespace
class FakeStream:
    _next_ptr = 0x1000

    def __init__(self, fake: "FakeCupy", non_blocking: bool = False, null: bool = False) -> None:
        self._fake = fake
        self.ptr = 0 if null else FakeStream._next_ptr
        FakeStream._next_ptr += 0x10
        self._ops: list | None = None  # the graph being captured on this stream

    def use(self):
        self._fake._tls.stream = self
        return self

    def __enter__(self):
        self._outer = self._fake.cuda.get_current_stream()
        return self.use()

    def __exit__(self, *exc):
        self._outer.use()

    def synchronize(self) -> None:
        if self._ops is not None:
            raise FakeCudaError("cudaErrorStreamCaptureUnsupported: stream synchronize while "
                                "the stream captures")

    def is_capturing(self) -> bool:
        return self._ops is not None

    def begin_capture(self, mode=None) -> None:
        if self._ops is not None:
            raise FakeCudaError("cudaErrorIllegalState: the stream is already capturing")
        if self.ptr == 0:
            raise FakeCudaError("cudaErrorStreamCaptureUnsupported: the legacy null stream "
                                "cannot capture")
        self._ops = []
        self._fake._capturing = self

    def end_capture(self) -> "FakeGraph":
        if self._ops is None:
            raise FakeCudaError("cudaErrorIllegalState: end_capture without begin_capture")
        ops, self._ops = self._ops, None
        self._fake._capturing = None
        return FakeGraph(ops)

    def record(self, event=None) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self._stream = stream

    def synchronize(self) -> None:
        self._stream._fake._refuse_capturing("event synchronize")


class FakeGraph:
    def __init__(self, ops: list) -> None:
        self._ops = ops
        self.uploaded = False
        self.launches = 0

    def upload(self, stream) -> None:
        self.uploaded = True

    def launch(self, stream) -> None:
        stream._fake._refuse_capturing("graph launch")
        self.launches += 1
        for op in self._ops:
            op()


class FakeMemoryPool:
    """Bytes in use (arrays alive) and reserved (in use, plus freed blocks the pool keeps until
    free_all_blocks), as CuPy's pool counts them."""

    def __init__(self) -> None:
        self._used = 0
        self._reserved = 0

    def malloc(self, nbytes: int):
        self._used += int(nbytes)
        self._reserved += int(nbytes)
        return SimpleNamespace(pool=self, size=int(nbytes))

    def _free(self, nbytes: int) -> None:
        self._used -= nbytes  # the block stays reserved

    def total_bytes(self) -> int:
        return self._reserved

    def used_bytes(self) -> int:
        return self._used

    def free_all_blocks(self) -> None:
        self._reserved = self._used


class FakeRawModule:
    """cupy.RawModule: a prebuilt fatbin (path=) or NVRTC code (code=) as the harness module of
    the same sources; functions are strict about their launches."""

    def __init__(self, fake: "FakeCupy", code: str | None = None, path: str | None = None,
                 options=(), name_expressions=None, **_) -> None:
        if path is not None:
            manifest = Path(path).with_name(Path(path).stem + prebuilt.MANIFEST_SUFFIX)
            source = json.loads(manifest.read_text())["source"]
            code = f'#include "{source}"\n'
        if code is None:
            raise TypeError("RawModule needs code= or path=")
        self._fake = fake
        self._code, self._name_expressions = code, name_expressions
        self._module = None  # built at the first get_function, as CuPy loads lazily
        self._functions: dict[str, FakeRawKernel] = {}

    def _harness_module(self):
        if self._module is None:
            try:
                self._module = SimModule(self._code, name_expressions=self._name_expressions)
            except Exception as exc:  # noqa: BLE001 -- an sm_90a-only source: no host build
                self._module = exc
        if isinstance(self._module, Exception):
            raise FakeCudaError(f"CUDA_ERROR_NOT_FOUND: the harness cannot run this module "
                                f"({type(self._module).__name__})")
        return self._module

    def get_function(self, name: str) -> "FakeRawKernel":
        if name not in self._functions:
            try:
                fn = self._harness_module().get_function(name)
            except AttributeError as exc:
                raise FakeCudaError(f"CUDA_ERROR_NOT_FOUND: {exc}") from exc
            self._functions[name] = FakeRawKernel(self._fake, fn)
        return self._functions[name]

    def compile(self, log_stream=None) -> None:
        pass


class FakeRawKernel:
    def __init__(self, fake: "FakeCupy", fn) -> None:
        self._fake = fake
        self._fn = fn
        self.name = fn.name
        self.max_dynamic_shared_size_bytes = 0
        self.num_regs = 32

    def __call__(self, grid, block, args, *, shared_mem: int = 0) -> None:
        fake = self._fake
        fake._device_op(f"kernel {self.name}")
        if shared_mem > max(DEFAULT_SHARED_LIMIT, self.max_dynamic_shared_size_bytes):
            raise FakeCudaError(f"kernel {self.name}: {shared_mem} bytes of dynamic shared "
                                "memory over the limit set (max_dynamic_shared_size_bytes "
                                f"{self.max_dynamic_shared_size_bytes})")
        marshalled = []
        for index, (code, value) in enumerate(zip(self._fn.param_codes, args)):
            where = f"kernel {self.name} argument {index}"
            if value is None:
                raise TypeError(f"{where}: None (CuPy refuses it; a NULL pointer is "
                                "np.uint64(0))")
            if isinstance(value, (bool, int, float)):
                raise TypeError(f"{where}: a Python {type(value).__name__} (CuPy passes it as "
                                "8 bytes; give the numpy scalar of the parameter's type)")
            if isinstance(value, np.ndarray) and not isinstance(value, DeviceArray):
                raise TypeError(f"{where}: a host numpy array {value.shape} {value.dtype}")
            if isinstance(value, DeviceArray) and value.ctypes.data % value.itemsize:
                raise FakeCudaError(f"{where}: address {value.ctypes.data:#x} is not aligned "
                                    f"to its {value.itemsize}-byte elements "
                                    "(cudaErrorMisalignedAddress at the first load)")
            if code == "p" and isinstance(value, np.uint64) and value == 0:
                value = None  # CuPy's NULL is the harness's None
            marshalled.append(np.asarray(value) if isinstance(value, DeviceArray) else value)
        # CuPy sets the attribute on the driver's function: the harness function is that.
        self._fn.max_dynamic_shared_size_bytes = self.max_dynamic_shared_size_bytes
        launch = partial(self._fn, grid, block, tuple(marshalled), shared_mem=shared_mem)
        launch()
        fake._record(launch)
        fake.launches.append(self.name)


class _CudaNamespace:
    def __init__(self, fake: "FakeCupy") -> None:
        self._fake = fake
        self.runtime = SimpleNamespace(memGetInfo=fake._mem_get_info,
                                       getDeviceCount=lambda: 1)
        self.MemoryPool = FakeMemoryPool
        self.Graph = FakeGraph

    def Device(self, device_id: int | None = None):  # noqa: N802 -- CuPy's name
        return SimpleNamespace(id=device_id or 0, use=lambda: None,
                               compute_capability=COMPUTE_CAPABILITY,
                               attributes={"MultiProcessorCount": NUM_SMS})

    def Stream(self, non_blocking: bool = False) -> FakeStream:  # noqa: N802
        return FakeStream(self._fake, non_blocking)

    def get_current_stream(self) -> FakeStream:
        return getattr(self._fake._tls, "stream", self._fake._null_stream)

    @contextmanager
    def using_allocator(self, allocator=None):
        tls = self._fake._tls
        outer = getattr(tls, "allocator", None)
        tls.allocator = allocator
        try:
            yield
        finally:
            tls.allocator = outer

    @staticmethod
    def UnownedMemory(ptr, size, owner):  # noqa: N802
        return SimpleNamespace(ptr=ptr, size=size, owner=owner)

    @staticmethod
    def MemoryPointer(memory, offset):  # noqa: N802
        return SimpleNamespace(mem=memory, offset=offset, ptr=memory.ptr + offset)


class _NdarrayType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, DeviceArray)


class FakeCupy:
    """The fake `cupy` module of one fake device."""

    _MAKERS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "arange",
               "stack", "concatenate", "where")

    def __init__(self) -> None:
        self._tls = threading.local()
        self._null_stream = FakeStream(self, null=True)
        self._default_pool = FakeMemoryPool()
        self._capturing: FakeStream | None = None
        self.cuda = _CudaNamespace(self)
        self.launches: list[str] = []

        class ndarray(metaclass=_NdarrayType):  # noqa: N801 -- CuPy's name
            def __new__(cls, shape, dtype, memptr=None):
                """An array over existing device memory (a view: the memory's owner -- the
                array, or the graph that recorded it -- keeps it alive)."""
                shape = (shape,) if np.isscalar(shape) else tuple(shape)
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                raw = (ctypes.c_uint8 * nbytes).from_address(memptr.ptr)
                return np.frombuffer(raw, np.uint8).view(dtype).reshape(shape).view(DeviceArray)

        self.ndarray = ndarray

    # ------------------------------------------------------------------ strictness
    def _refuse_capturing(self, what: str) -> None:
        if self._capturing is not None:
            raise FakeCudaError(f"cudaErrorStreamCaptureUnsupported: {what} while a stream "
                                "captures")

    def _device_op(self, what: str) -> None:
        """Work queued on the current stream: while a capture is open it must be that stream."""
        capturing = self._capturing
        if capturing is not None and self.cuda.get_current_stream() is not capturing:
            raise FakeCudaError(f"cudaErrorStreamCaptureImplicit: {what} issued on another "
                                "stream than the one capturing (the graph would not hold it)")

    def _allocate(self, array: np.ndarray, what: str) -> None:
        """`array` is new device memory: from the allocator in use (using_allocator), or the
        default pool, which gets its bytes back when the array dies."""
        allocator = getattr(self._tls, "allocator", None)
        if self._capturing is not None and (allocator is None
                                            or allocator == self._default_pool.malloc):
            raise FakeCudaError(f"{what}: an allocation from the default pool during capture "
                                "(a replay would write memory the pool hands to others)")
        block = (allocator or self._default_pool.malloc)(array.nbytes)
        pool = getattr(block, "pool", None)
        if pool is not None:
            base = array if array.base is None else array.base
            weakref.finalize(base, pool._free, array.nbytes)

    def _record(self, op) -> None:
        if self._capturing is not None:
            self._capturing._ops.append(op)

    def _mem_get_info(self) -> tuple[int, int]:
        return TOTAL_BYTES - self._default_pool.total_bytes(), TOTAL_BYTES

    def _device(self, host: np.ndarray, what: str) -> DeviceArray:
        self._allocate(host, what)
        out = host.view(DeviceArray)
        out.pagedrun_array_module = self
        return out

    # ------------------------------------------------------------------ module surface
    def get_default_memory_pool(self) -> FakeMemoryPool:
        return self._default_pool

    def asarray(self, a, dtype=None):
        if isinstance(a, DeviceArray):
            if dtype is None or np.dtype(dtype) == a.dtype:
                return a
            return a.astype(dtype)
        self._refuse_capturing("a host-to-device copy (cupy.asarray)")
        return self._device(np.array(a, dtype=dtype), "asarray")

    def ascontiguousarray(self, a, dtype=None):
        if isinstance(a, DeviceArray):
            self._device_op("ascontiguousarray")
            out = np.ascontiguousarray(np.asarray(a), dtype=dtype)
            if np.may_share_memory(out, a):
                return a if dtype is None or a.dtype == out.dtype else out.view(DeviceArray)
            self._allocate(out, "ascontiguousarray")
            self._record(partial(np.copyto, out, np.asarray(a), casting="unsafe"))
            return self._wrap(out)
        return self.asarray(np.ascontiguousarray(a, dtype=dtype))

    def array(self, a, dtype=None, copy=True):
        if isinstance(a, DeviceArray):
            self._device_op("array")
            out = np.array(np.asarray(a), dtype=dtype)
            self._allocate(out, "array")
            self._record(partial(np.copyto, out, np.asarray(a), casting="unsafe"))
            return self._wrap(out)
        return self.asarray(a, dtype=dtype)

    def _wrap(self, out: np.ndarray) -> DeviceArray:
        view = out.view(DeviceArray)
        view.pagedrun_array_module = self
        return view

    def __getattr__(self, name: str):
        attr = getattr(np, name)
        if name not in self._MAKERS:
            return attr

        def make(*args, **kwargs):
            for value in args:
                if type(value) is np.ndarray and value.ndim > 0:
                    raise TypeError(f"cupy.{name}: a host numpy array argument")
            self._device_op(name)
            plain = [np.asarray(a) if isinstance(a, DeviceArray) else a for a in args]
            if name in ("stack", "concatenate"):
                plain[0] = [np.asarray(a) if isinstance(a, DeviceArray) else a for a in args[0]]
            out = attr(*plain, **kwargs)
            self._allocate(out, name)
            if name in ("zeros", "zeros_like", "ones", "full"):
                self._record(partial(np.copyto, out, out.copy()))
            return self._wrap(out)

        return make

    def RawModule(self, **kwargs) -> FakeRawModule:  # noqa: N802 -- CuPy's name
        return FakeRawModule(self, **kwargs)


def make() -> tuple[FakeCupy, SimpleNamespace]:
    """A fresh fake device: (cupy, cupyx)."""
    fake = FakeCupy()
    DeviceArray.pagedrun_array_module = fake

    def empty_pinned(shape, dtype=np.float32):
        return np.empty(shape, dtype)

    return fake, SimpleNamespace(empty_pinned=empty_pinned)
